#!/usr/bin/env bash
# One call on a GPU machine, at most 9 minutes, in a fixed order; everything worth keeping goes
# to $OUT as at most 8 files (the device machines' limit), each stage's status in summary.txt:
#
#   OUT=/some/dir bash scripts/gpu_session.sh        # from the repository root
#
#   0. env          GPU, driver, torch / transformers / triton versions, nvcc      -> env.txt
#      imports      everything the GPU stages import, with lm_eval, fastapi, uvicorn and gguf
#                   blocked and sockets refused (the device has none of them and no network)
#   1. build        the CUDA extensions (torch.utils.cpp_extension.load)
#   2. pytest_gpu   `pytest -m gpu`: every kernel against its reference (STYLE.md's tolerance rule),
#                   over 8 xdist workers where pytest-xdist is installed; failures logged as they come
#   3. kernels      `lcx bench kernels`: this GPU's first baseline, or `--check` against it
#                   -> <gpu>.json (a new baseline: commit it to results/kernels/) or <gpu>.latest.json
#   3a. tune        `lcx bench kernels --tune`: the Triton Λ kernel's launch configurations (16) at
#                   the 32k prefill shape, each checked against the default's output -> tune-<gpu>.json
#                   (commit as results/kernels/<gpu>.tune.json; enter the winner in TUNED)
#   3b. profile     `lcx bench scale --profile-decode`: one untimed run of two decode cells under
#                   torch.profiler (Llama-3-8B's shape, 8 layers, 32k) -> logs.tar:profile/*.txt
#   4. scale        `lcx bench scale --resume --time-limit ...`: the methods at 32k-128k on random
#                   llama-3-8b / llama-3.2-1b / smollm2-135m weights, most valuable cells first
#                   -> scale-<gpu>.json (commit as results/scale/<gpu>.json)
#   5. report       `lcx report` on the bundled tiny-ret-5m on CUDA (bf16), to set beside the
#                   committed CPU numbers (results/report/) -> report-<gpu>.tar. Needs lm-eval:
#                   carried wheels installed from $LCX_GPU_WHEELS (`bash scripts/gpu_wheels.sh`
#                   builds them, ~18 MB, with the corpora the report reads), or a folder of
#                   installed packages in $LCX_GPU_SITE; otherwise SKIP with the reason.
#   logs.tar        every stage's log and pytest's junit XML
#
# summary.txt has one line per stage: `PASS|FAIL|SKIP <stage>: <detail or reason> (<s>s)`, then
# `total <s>s, status <0|1>`. Exit status 0 only if no stage failed (a skipped one is no failure).
# A stage that fails does not stop the next. A second call on the same (warm) machine resumes:
# stages that passed are skipped ("done in an earlier call", their files copied to $OUT again)
# and the scale sweep continues its cells (state under build/gpu_session/, ignored by git); on a
# fresh machine commit the first call's JSON into results/ and the second call continues from it.
#
# Assumes (the lcx device machines): Python 3.12, torch 2.11 with CUDA, transformers 5.17,
# triton 3.6, nvcc and ninja; no network, no flash-attn; the repository copied in as the working
# directory (<= 64 MiB together with carried paths: `git ls-files -co --exclude-standard -z |
# xargs -0 du -cb | tail -1`; tests/test_packaging.py keeps the tracked tree under 32 MiB).
#
# Knobs (environment): SESSION_S (default 540: the time box), GPU_STAGES (default
# "build,pytest_gpu,kernels,tune,profile,scale,report"), SCALE_ARGS (extra `lcx bench scale` flags),
# REPORT_S (seconds kept for the report when lm-eval is there, default 120), LCX_GPU_DRY_RUN=1
# (no GPU: run the kernel and scale stages as CPU smoke runs, to test this script).
set -u -o pipefail
OUT=${OUT:-$PWD/gpu_session_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1 MAX_JOBS=${MAX_JOBS:-16}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/build/torch_extensions}
STATE=${GPU_SESSION_STATE:-$ROOT/build/gpu_session}
LOGS=$STATE/logs
mkdir -p "$LOGS"
SESSION_S=${SESSION_S:-540}
DRY=${LCX_GPU_DRY_RUN:-0}
STATUS=0
t_start=$(date +%s)
: >"$OUT/summary.txt"
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
elapsed() { echo $(( $(date +%s) - t_start )); }
left() { echo $(( SESSION_S - $(elapsed) )); }
want() { [[ ",${GPU_STAGES:-build,pytest_gpu,kernels,tune,profile,scale,report}," == *",$1,"* ]]; }
done_before() { [ -f "$STATE/$1.done" ]; }
# run_stage NAME LIMIT_S DETAIL_CMD -- CMD...: run CMD with a time limit, log to $LOGS/NAME.log,
# record PASS/FAIL (DETAIL_CMD prints a one-line detail from the log; may be `:`)
run_stage() {
  local name=$1 limit=$2 detail=$3; shift 4
  local t0=$(date +%s) rc
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t0 )) d
  d=$($detail "$LOGS/$name.log" 2>/dev/null | tail -n 1)
  if [ $rc -eq 0 ]; then
    summary "PASS $name: ${d:-ok} (${dt}s)"; touch "$STATE/$name.done"
  else
    local why="rc=$rc"; [ $rc -eq 124 ] && why="time limit ${limit}s"
    summary "FAIL $name: $why${d:+; $d}; see logs.tar:$name.log (${dt}s)"; STATUS=1
  fi
  return $rc
}
skip() { summary "SKIP $1: $2"; }
PY=python
LCX="$PY -m lcx.cli"

# ---- 0. environment
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not found"
  $PY - <<'EOF' 2>&1
import platform, importlib
print("python", platform.python_version())
for m in ("torch", "transformers", "triton", "numpy", "lm_eval"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:  # noqa: BLE001
        print(m, "-", type(e).__name__)
import torch
print("cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
EOF
  nvcc --version 2>&1 | tail -1; ninja --version 2>&1 | sed 's/^/ninja /'
  git rev-parse HEAD 2>&1; git status --short 2>&1 | head -20
} >"$OUT/env.txt" 2>&1
CUDA=0
$PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1 && CUDA=1
if [ $CUDA = 1 ]; then
  SLUG=$($PY -c "from benchmarks.harness import gpu_slug; import torch; print(gpu_slug(torch.cuda.get_device_name()))" 2>/dev/null)
else SLUG=cpu; fi
summary "PASS env: $(grep -E '^(python|torch|transformers|triton) ' "$OUT/env.txt" | tr '\n' ' ')gpu=$([ $CUDA = 1 ] && echo "$SLUG" || echo none)"

# make `import lcx` (with lcx.kernels -> kernels/) work without network
# (an editable install can succeed and still not map lcx.kernels -> kernels/: some setuptools
# versions write a plain path entry, and ./lcx then shadows the mapping; so check the import again)
if ! $PY -c "import lcx.kernels.cuda, benchmarks.kernels" >/dev/null 2>&1; then
  pip install --no-deps --no-build-isolation --no-index -e . >"$LOGS/install.log" 2>&1
  if ! $PY -c "import lcx.kernels.cuda, lcx.eval_tasks, lcx.serve, benchmarks.kernels" >>"$LOGS/install.log" 2>&1; then
    # fallback: pyproject's package-dir mapping by symlinks inside this (disposable) copy
    for d in kernels eval_tasks serve; do [ -e "lcx/$d" ] || ln -s "../$d" "lcx/$d"; done
    trap 'for d in kernels eval_tasks serve; do [ -L "lcx/$d" ] && rm "lcx/$d"; done' EXIT
    summary "note: pip install -e left lcx.kernels unimportable (see logs.tar:install.log); lcx/{kernels,eval_tasks,serve} symlinked"
  fi
fi

# ---- imports: what the GPU stages need, without lm-eval, fastapi, uvicorn, gguf or a network
imports_check() {
  $PY - <<'EOF'
import importlib, socket, sys

BLOCKED = ("lm_eval", "fastapi", "uvicorn", "gguf")


class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is blocked (the GPU machines do not have it)")
        return None


sys.meta_path.insert(0, Block())


def no_network(*a, **k):
    raise OSError("no network on the GPU machines")


socket.socket.connect = no_network
socket.create_connection = no_network
mods = ["lcx", "lcx.kernels.cuda", "lcx.kernels.cuda.lambda_decode", "lcx.kernels.cuda.rerotate",
        "benchmarks.kernels", "benchmarks.scale", "lcx.engine", "lcx.methods", "lcx.attention",
        "lcx.attention.flash_backend", "lcx.attention.triton_backend", "lcx.hf", "lcx.hf.attention_patch",
        "lcx.models", "lcx.presets", "transformers", "transformers.models.llama.modeling_llama"]
if importlib.util.find_spec("triton") is not None:
    mods += ["lcx.kernels.triton", "lcx.kernels.triton.lambda_attention", "lcx.kernels.triton.swat"]
for m in mods:
    importlib.import_module(m)
import lcx

lcx.MethodConfig.from_dict({"attention": {"type": "lm_infinite", "n_global": 10, "n_local": 64}, "backend": "triton"})
print(f"{len(mods)} modules imported with {', '.join(BLOCKED)} blocked and no network")
EOF
}
export PY
export -f imports_check
run_stage imports 120 cat -- bash -c imports_check

# ---- 1. build the CUDA extensions (cached in TORCH_EXTENSIONS_DIR)
build() {
  $PY - <<'EOF'
import time, torch
assert torch.cuda.is_available(), "no CUDA device"
from lcx.kernels.cuda import lambda_decode, rerotate
for mod in (rerotate, lambda_decode):
    t = time.time()
    mod.load_extension(verbose=True)
    print(f"built {mod.__name__} in {time.time() - t:.1f}s", flush=True)
EOF
}
pytest_summary() { grep -E "passed|failed|error|no tests ran" "$1" | tail -n 1; }
kernel_summary() { grep -cE "REGRESSION|MISSING" "$1" | sed 's/^/regressions or missing: /'; }
# a kernel row skipped because lcx's own module failed to import is a broken install, not a skip
kernels_broken() { grep -E "skipped: (ModuleNotFoundError|ImportError).*'lcx" "$LOGS/kernels.log" | head -n 1; }
scale_summary() { grep -E "^wrote|cells kept" "$1" | tail -n 1; }

if ! want build; then skip build "not asked for (GPU_STAGES)"
elif done_before build; then skip build "done in an earlier call"
elif [ $CUDA = 0 ]; then skip build "no CUDA device"
else export -f build; run_stage build 150 "grep -c ^built" -- bash -c build; fi

# ---- 2. the GPU tests (every kernel against its reference)
# (--continue-on-collection-errors: a module needing a package this machine lacks must not stop
# the kernel tests)
if ! want pytest_gpu; then skip pytest_gpu "not asked for (GPU_STAGES)"
elif done_before pytest_gpu; then skip pytest_gpu "done in an earlier call"
elif [ $CUDA = 0 ]; then skip pytest_gpu "no CUDA device"
else
  # the Triton grid compiles a kernel per case (~1.5 s each, 355 cases in all): spread over
  # workers when pytest-xdist is there (the device image has it); each failure is written to
  # pytest_gpu_failures.log the moment it happens (tests/conftest.py), so a run stopped at its
  # limit still names what failed and why
  XDIST=(); $PY -c "import xdist" >/dev/null 2>&1 && XDIST=(-n "${GPU_TEST_WORKERS:-8}")
  export LCX_FAILURES_LOG=$LOGS/pytest_gpu_failures.log; : >"$LCX_FAILURES_LOG"
  run_stage pytest_gpu 240 pytest_summary -- $PY -m pytest -q -m gpu -p no:cacheprovider "${XDIST[@]}" \
    --continue-on-collection-errors --junitxml="$LOGS/pytest_gpu.xml" -o junit_family=xunit2 -rf --tb=short
  [ -s "$LCX_FAILURES_LOG" ] && summary "  failed so far: $(grep -c '^FAILED' "$LCX_FAILURES_LOG") (logs.tar:pytest_gpu_failures.log): $(grep '^FAILED' "$LCX_FAILURES_LOG" | head -n 3 | cut -c8- | tr '\n' ' ')"
  unset LCX_FAILURES_LOG
fi

# ---- 3. kernel benchmark: the first baseline of this GPU, or the check against it
KDIR=results/kernels
if ! want kernels; then skip kernels "not asked for (GPU_STAGES)"
elif done_before kernels; then skip kernels "done in an earlier call"
elif [ $CUDA = 0 ] && [ "$DRY" != 1 ]; then skip kernels "no CUDA device"
elif [ $CUDA = 0 ]; then
  run_stage kernels 120 kernel_summary -- $LCX bench kernels --device cpu --only rope --warmup 1 --repeats 2 \
    --out "$STATE/kernels-cpu-smoke.json" && cp "$STATE/kernels-cpu-smoke.json" "$STATE/out-kernels.json"
elif [ -f "$KDIR/$SLUG.json" ]; then
  run_stage kernels 90 kernel_summary -- $LCX bench kernels --warmup 3 --repeats 10 --check
  [ -n "$(kernels_broken)" ] && { summary "FAIL kernels: lcx's own modules did not import: $(kernels_broken)"; STATUS=1; rm -f "$STATE/kernels.done"; }
  cp "$KDIR/$SLUG.latest.json" "$STATE/out-kernels.json" 2>/dev/null
else
  if run_stage kernels 90 kernel_summary -- $LCX bench kernels --warmup 3 --repeats 10; then
    if [ -n "$(kernels_broken)" ]; then
      summary "FAIL kernels: lcx's own modules did not import, no baseline: $(kernels_broken)"; STATUS=1
      rm -f "$STATE/kernels.done" "$KDIR/$SLUG.json"
    else summary "  new baseline $SLUG.json: commit it as $KDIR/$SLUG.json"; fi
  fi
  cp "$KDIR/$SLUG.json" "$STATE/out-kernels.json" 2>/dev/null
fi

# ---- 3a. the Triton Λ kernel's launch configurations (its one default was chosen without a GPU;
# the first H100 run: Λ prefill at ~10% of the matmul ceiling) -> tune-<gpu>.json (commit it as
# results/kernels/<gpu>.tune.json and enter the winner in lcx.kernels.triton.lambda_attention.TUNED)
tune_summary() { grep -E "^best|MISMATCH" "$1" | tail -n 1; }
if ! want tune; then skip tune "not asked for (GPU_STAGES)"
elif done_before tune; then skip tune "done in an earlier call"
elif [ $CUDA = 0 ] && [ "$DRY" != 1 ]; then skip tune "no CUDA device"
elif [ $CUDA = 0 ]; then
  TRITON_INTERPRET=1 run_stage tune 120 tune_summary -- $LCX bench kernels --tune --device cpu --warmup 1 --repeats 1 \
    --out "$STATE/tune-cpu-smoke.json" && cp "$STATE/tune-cpu-smoke.json" "$STATE/out-tune.json"
else
  run_stage tune 150 tune_summary -- $LCX bench kernels --tune --warmup 2 --repeats 5 --out "$STATE/tune.json"
  cp "$STATE/tune.json" "$STATE/out-tune.json" 2>/dev/null
fi

# ---- 3b. where a decode step's time goes (the first H100 run: vanilla 32k decode at 6.5% of the
# copy bandwidth): one untimed profiled run of two cells, operator tables -> logs.tar:profile/
PROFILE_DIR=$LOGS/profile
profile_summary() { grep -hE "^(decode steps profiled|device busy)" "$PROFILE_DIR"/*.txt 2>/dev/null | tr '\n' ' '; }
if ! want profile; then skip profile "not asked for (GPU_STAGES)"
elif done_before profile; then skip profile "done in an earlier call"
elif [ $CUDA = 0 ] && [ "$DRY" != 1 ]; then skip profile "no CUDA device"
else
  if [ $CUDA = 0 ]; then
    set -- --device cpu --shape smollm2-135m --layers 2 --lengths 512 --context 128 --decode-tokens 4 --cases vanilla
  else  # 8 of Llama-3-8B's 32 layers: the per-layer pattern at a quarter of the build and step time
    set -- --shape llama-3-8b --layers 8 --lengths 32768 --decode-tokens 8 --cases vanilla,lm_infinite/triton
  fi
  run_stage profile 120 profile_summary -- $LCX bench scale "$@" --no-ceilings --profile-decode "$PROFILE_DIR" \
    --out "$STATE/profile-scale.json"
fi

# ---- 5 (decided first, so the scale sweep leaves it its time): can the report run here?
report_why=""
want report || report_why="not asked for (GPU_STAGES)"
[ -z "$report_why" ] && done_before report && report_why="done in an earlier call"
[ -z "$report_why" ] && [ $CUDA = 0 ] && report_why="no CUDA device"
if [ -z "$report_why" ] && ! $PY -c "import lm_eval" >/dev/null 2>&1; then
  if [ -n "${LCX_GPU_WHEELS:-}" ] && [ -d "$LCX_GPU_WHEELS" ]; then
    pip install --no-index --find-links "$LCX_GPU_WHEELS" --no-deps "$LCX_GPU_WHEELS"/*.whl >"$LOGS/wheels.log" 2>&1
  fi
  [ -n "${LCX_GPU_SITE:-}" ] && export PYTHONPATH="$LCX_GPU_SITE${PYTHONPATH:+:$PYTHONPATH}"
  $PY -c "import lm_eval, lm_eval.evaluator" >>"$LOGS/wheels.log" 2>&1 || report_why="lm_eval is not importable: the device has no lm-eval; carry its wheels (LCX_GPU_WHEELS) or a site folder (LCX_GPU_SITE)"
fi
REPORT_S=${REPORT_S:-120}
[ -z "$report_why" ] || REPORT_S=0

# ---- 4. the methods at GPU scale (as much as the time box allows; resumable cells)
SCALE_JSON=results/scale/$SLUG.json
if ! want scale; then skip scale "not asked for (GPU_STAGES)"
elif done_before scale; then skip scale "done in an earlier call"
elif [ $CUDA = 0 ] && [ "$DRY" != 1 ]; then skip scale "no CUDA device"
else
  budget=$(( $(left) - REPORT_S - 15 ))
  if [ $budget -lt 60 ]; then skip scale "only ${budget}s left"
  else
    if [ $CUDA = 0 ]; then
      SCALE_JSON=$STATE/scale-cpu-smoke.json
      set -- --device cpu --shape smollm2-135m --layers 2 --lengths 512 --context 128 --decode-tokens 3 \
        --cases vanilla,sinks,lm_infinite/flash --no-ceilings
    else set --; fi
    # the sweep stops starting cells near its limit and records the rest as not run (a second
    # call continues them); timeout is the backstop, the JSON is rewritten after every cell
    run_stage scale $(( budget + 30 )) scale_summary -- $LCX bench scale "$@" --resume --time-limit "$budget" \
      --out "$SCALE_JSON" ${SCALE_ARGS:-}
    if [ -f "$SCALE_JSON" ]; then
      cp "$SCALE_JSON" "$STATE/out-scale.json"
      if $PY -c "import json,sys; sys.exit(json.load(open('$SCALE_JSON')).get('complete') is not True)"; then :
      else rm -f "$STATE/scale.done"; summary "  scale: cells left for a second call (it resumes them)"; fi
    fi
  fi
fi

# ---- 5. the bundled tiny-ret-5m report on CUDA, beside the committed CPU numbers
if [ -n "$report_why" ]; then skip report "$report_why"
elif [ "$(left)" -lt 60 ]; then skip report "only $(left)s left"
else
  RDIR=$STATE/report-$SLUG
  run_stage report "$(( $(left) - 5 ))" "grep -E 'cells|wrote' " -- $LCX report --tasks passkey,ppl --device cuda --dtype bfloat16 --out "$RDIR"
  [ -d "$RDIR" ] && tar -C "$RDIR" -cf "$STATE/out-report.tar" . 2>/dev/null
fi

# ---- outputs: at most 8 files
[ -f "$STATE/out-kernels.json" ] && cp "$STATE/out-kernels.json" "$OUT/kernels-$SLUG.json"
[ -f "$STATE/out-scale.json" ] && cp "$STATE/out-scale.json" "$OUT/scale-$SLUG.json"
[ -f "$STATE/out-tune.json" ] && cp "$STATE/out-tune.json" "$OUT/tune-$SLUG.json"
[ -f "$STATE/out-report.tar" ] && cp "$STATE/out-report.tar" "$OUT/report-$SLUG.tar"
summary "total $(elapsed)s, status $STATUS"
tar -C "$LOGS" -cf "$OUT/logs.tar" . 2>/dev/null
exit $STATUS
