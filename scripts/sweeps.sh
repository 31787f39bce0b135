#!/usr/bin/env bash
# The long real-model RULER sweeps (#42, #43), carried across sessions and machines: every answer is
# journaled and every finished cell committed, and a fresh machine resumes them with one command.
#
#   bash scripts/sweeps.sh plan   [SWEEP...]   # what `resume` would run, and where (nothing started)
#   bash scripts/sweeps.sh resume [SWEEP...]   # start each sweep in the background (after set-up)
#   bash scripts/sweeps.sh status [SWEEP...]   # cells measured, journals in progress, running or not
#   bash scripts/sweeps.sh checkpoint          # copy each sweep's cells + journals here and commit
#   bash scripts/sweeps.sh checkpoint --every SECONDS   # ... forever, in the background
#   bash scripts/sweeps.sh worktree [COMMIT]   # the worktree a step at COMMIT runs in (made if missing)
#   SWEEPs: smollm2-ruler (scripts/report_smollm2_ruler.sh), gemma3-ruler (scripts/report_gemma3_ruler_sweep.sh)
#
# Why worktrees: a journal resumes only under the settings *and the numerics code* that started it
# (docs/report.md, "It measures; it does not replay"), so a cell in progress must finish from a
# checkout of the commit its journal was started at (`<journal>.key.json` records it; the two
# journals of older code that have none are listed below). `resume` therefore, per sweep:
#   1. finishes every journaled cell in a worktree at its journal's commit (that method alone;
#      the lengths keep the sweep's longest, which sets the RoPE factor), unless that commit's
#      code is HEAD's (only results, docs, tests or the README differ): then step 2 finishes it;
#   2. runs the sweep's steps in order in a worktree of this checkout's HEAD at launch, so editing
#      this checkout mid-sweep changes nothing under it. Finished cells are kept across code
#      (`--reuse --keep-other-code`, listed in the report).
# Worktrees live under $SWEEPS_WT (default: ../wt beside this checkout), logs under $SWEEPS_LOGS
# (default: ../logs): <sweep>.log, and <sweep>.active (the worktree measuring now, which
# `checkpoint` copies from). Each step runs with --threads 1; LCX_SWEEP_JOBS=N adds --jobs N to the
# steps at HEAD (cells in parallel, docs/report.md) where a sweep has the machine to itself.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WT_ROOT=${SWEEPS_WT:-$(dirname "$ROOT")/wt}
LOGS=${SWEEPS_LOGS:-$(dirname "$ROOT")/logs}
SWEEPS=(smollm2-ruler gemma3-ruler)

# Journals written before `.key.json` existed: the commit each was started at (session notes 35-36).
legacy_commit() {
  case "$1" in
    sinks.ruler.16384.9d42df2855db) echo ce648eb ;;
    lm_infinite.ruler.49152.ac2620936a59) echo 16256dc ;;
    *) return 1 ;;
  esac
}

# sweep -> its output folder, its script, its longest length, its steps (one per line, from the script)
sweep_def() {
  case "$1" in
    smollm2-ruler)
      OUT=results/report/smollm2-135m-ruler SCRIPT=scripts/report_smollm2_ruler.sh LONGEST=16384 ;;
    gemma3-ruler)
      OUT=results/report/gemma3-270m-ruler SCRIPT=scripts/report_gemma3_ruler_sweep.sh LONGEST=49152 ;;
    *) echo "sweeps.sh: unknown sweep '$1' (known: ${SWEEPS[*]})" >&2; return 2 ;;
  esac
  STEPS=$(bash "$SCRIPT" steps)  # the script's own list, in its order
}

# journal stem (NAME.KIND.LENGTH.HASH) -> the commit it resumes under
journal_commit() {
  local key="$ROOT/$OUT/cells/journal/$1.key.json"
  if [ -f "$key" ]; then
    python3 -c 'import json, sys; print((json.load(open(sys.argv[1])).get("git") or {}).get("sha") or "")' "$key"
  else
    legacy_commit "$1" || echo ""
  fi
}

journals() {  # the journal stems of a sweep in this checkout
  local db
  for db in "$ROOT/$OUT"/cells/journal/*_rank0.db; do
    [ -e "$db" ] && basename "${db%_rank0.db}"
  done
  return 0
}

answers() {  # answers held by a journal db
  python3 -c 'import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute("select count(*) from unnamed").fetchone()[0])' "$1" 2>/dev/null || echo "?"
}

same_code() {  # does commit $1 hold HEAD's code (all but results/, docs/, tests/, README.md and this runner)?
  git diff --quiet "$1" HEAD -- . ':!results' ':!docs' ':!tests' ':!README.md' ':!scripts/sweeps.sh' 2>/dev/null
}

# The commands `resume` runs for one sweep, one per line: "<worktree commit> <script args>".
plan_lines() {
  local stem name len sha head
  head=$(git rev-parse --short=12 HEAD)
  for stem in $(journals); do
    name=${stem%%.*} len=$(echo "$stem" | cut -d. -f3)
    sha=$(journal_commit "$stem")
    if [ -z "$sha" ]; then
      echo "sweeps.sh: journal $stem has no recorded commit: it is resumed at HEAD only if HEAD's code matches" >&2
      sha=$head
    fi
    # a journal of a commit whose code is HEAD's (they differ in results, prose or tests only)
    # is finished by HEAD's steps, which plan every cell, in parallel under LCX_SWEEP_JOBS
    same_code "$sha" && continue
    [ "$len" = "$LONGEST" ] && lens=$len || lens="$len,$LONGEST"
    echo "$(git rev-parse --short=12 "$sha") $lens --presets $name"
  done
  while IFS= read -r step; do echo "$head $step"; done <<< "$STEPS"
}

worktree_at() {  # a worktree of commit $1 -> its path
  local wt="$WT_ROOT/sweep-$1"
  if [ ! -d "$wt" ]; then
    mkdir -p "$WT_ROOT"
    git worktree add -f --detach "$wt" "$1" > /dev/null 2>&1
  fi
  # pyproject maps lcx.kernels, lcx.eval_tasks and lcx.serve to top-level folders; with only
  # PYTHONPATH=$wt those would come from the editable install (another checkout's code, or none:
  # a moved checkout fails with "No module named 'lcx.kernels'"). Link them inside the worktree's
  # lcx/ (untracked, so the checkout is not dirty) so every module is the commit's own.
  python - "$wt" <<'PY'
import os, sys, tomllib
wt = sys.argv[1]
dirs = tomllib.load(open(os.path.join(wt, "pyproject.toml"), "rb"))["tool"]["setuptools"]["package-dir"]
for name, folder in dirs.items():
    link = os.path.join(wt, *name.split("."))
    if name != "lcx" and not os.path.lexists(link):
        os.symlink(os.path.relpath(os.path.join(wt, folder), os.path.dirname(link)), link)
PY
  echo "$wt"
}

sync_cells() {  # copy a sweep's cells folder from $1 to $2 (roots of checkouts)
  [ "$1" = "$2" ] && return 0
  [ -d "$1/$OUT/cells" ] || return 0
  mkdir -p "$2/$OUT"
  rm -rf "$2/$OUT/cells.tmp"; cp -a "$1/$OUT/cells" "$2/$OUT/cells.tmp"
  rm -rf "$2/$OUT/cells"; mv "$2/$OUT/cells.tmp" "$2/$OUT/cells"
}

run_sweep() {  # (in the background) every planned command in turn
  local sweep=$1 from=$ROOT wt sha args jobs head
  head=$(git rev-parse --short=12 HEAD)
  while read -r sha args; do
    jobs=""  # --jobs at HEAD only (an older checkout's lcx report may not have it)
    [ "$sha" = "$head" ] && jobs=${LCX_SWEEP_JOBS:+--jobs $LCX_SWEEP_JOBS}
    wt=$(worktree_at "$sha")
    sync_cells "$from" "$wt"
    echo "$wt" > "$LOGS/$sweep.active"
    echo "[sweeps] $(date -u +%FT%TZ) $sweep: at $sha: $SCRIPT $args $jobs"
    # shellcheck disable=SC2086  # (args is the step's word list)
    (cd "$wt" && PYTHONPATH="$wt" bash "$SCRIPT" $args --threads 1 $jobs) || { echo "[sweeps] $sweep: step failed: $args"; return 1; }
    from=$wt
  done < <(plan_lines)
  echo "[sweeps] $(date -u +%FT%TZ) $sweep: DONE (render and commit: bash scripts/sweeps.sh checkpoint)"
}

running_pid() {
  local pidf="$LOGS/$1.pid"
  [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null && cat "$pidf"
  return 0
}

checkpoint() {
  local sweep src paths=()
  for sweep in "${SWEEPS[@]}"; do
    sweep_def "$sweep"
    src=$(cat "$LOGS/$sweep.active" 2>/dev/null || echo "$ROOT")
    sync_cells "$src" "$ROOT"
    paths+=("$OUT/cells")
  done
  git add -A -- "${paths[@]}"
  if git diff --cached --quiet -- "${paths[@]}"; then
    echo "[checkpoint] $(date -u +%T) nothing new"
  else
    git commit -q -m "results: sweep cells and journals, checkpoint (#42, #43)" -- "${paths[@]}"
    echo "[checkpoint] $(date -u +%T) committed $(git rev-parse --short HEAD)"
  fi
}

cmd=${1:-status}; shift || true
case "$cmd" in
  plan|resume|status)
    chosen=("$@"); [ ${#chosen[@]} -gt 0 ] || chosen=("${SWEEPS[@]}")
    mkdir -p "$LOGS"
    for sweep in "${chosen[@]}"; do
      sweep_def "$sweep"
      case "$cmd" in
        plan) echo "$sweep ($OUT):"; plan_lines | sed 's/^/  at /' ;;
        status)  # (running: the worktree measuring now, else this checkout)
          src=$ROOT; [ -n "$(running_pid "$sweep")" ] && src=$(cat "$LOGS/$sweep.active")
          echo "$sweep ($OUT): $(ls "$src/$OUT"/cells/*.json.gz 2>/dev/null | wc -l) cells;" \
               "$( [ "$src" != "$ROOT" ] && echo "running (pid $(running_pid "$sweep"), in $src)" || echo "not running")"
          for stem in $(ROOT=$src journals); do
            echo "  in progress: $stem: $(answers "$src/$OUT/cells/journal/${stem}_rank0.db") answers, resumes at $(ROOT=$src journal_commit "$stem")"
          done ;;
        resume)
          if [ -n "$(running_pid "$sweep")" ]; then echo "$sweep: already running (pid $(running_pid "$sweep"))"; continue; fi
          # a worktree of an earlier launch on this machine may hold cells this checkout lacks: take them first
          if [ -f "$LOGS/$sweep.active" ] && [ -d "$(cat "$LOGS/$sweep.active")" ]; then
            sync_cells "$(cat "$LOGS/$sweep.active")" "$ROOT"
          fi
          plan_lines > /dev/null  # (fails here, not in the background, on a bad plan)
          export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
          # freed memory kept for reuse (lcx.allocator; glibc reads these at start-up): the steps at a
          # journal's older commit, whose code does not set it, get it too. Changes no number.
          export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647
          nohup setsid bash "$0" _run "$sweep" >> "$LOGS/$sweep.log" 2>&1 < /dev/null &
          echo $! > "$LOGS/$sweep.pid"
          echo "$sweep: started (pid $!), log $LOGS/$sweep.log" ;;
      esac
    done ;;
  # exit at once: bash reads a script as it runs, so a runner (hours long) must not read on into a file
  # edited meanwhile
  _run) sweep_def "$1"; run_sweep "$1"; exit $? ;;
  checkpoint)
    if [ "${1:-}" = --every ]; then
      every=${2:?--every SECONDS}
      nohup setsid bash -c "while sleep $every; do bash '$0' checkpoint; done" >> "$LOGS/checkpoint.log" 2>&1 < /dev/null &
      echo "checkpoint every ${every}s (pid $!), log $LOGS/checkpoint.log"
    else
      checkpoint
    fi ;;
  worktree) worktree_at "$(git rev-parse --short=12 "${1:-HEAD}")" ;;
  -h|--help|help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" ;;  # the comment above
  *) echo "sweeps.sh: unknown command '$cmd' (plan, resume, status, checkpoint, worktree)" >&2; exit 2 ;;
esac
