#!/usr/bin/env bash
# SmolLM2-135M on RULER beyond its 8k context (#42 item 4): the four tasks it does above floor inside
# its context (results/report/smollm2-135m-ruler4k, seeded prompts: niah_single_1 8/8,
# niah_single_2_pd 8/8, niah_single_3_pd 5/8, niah_multikey_1_pd 5/8 at 4096; niah_multikey_2 2/8
# and the other six 0-1/8 are left out by the rule of docs/report.md, "Which tasks an extension
# sweep runs": >= 3 of 8 inside the context), 16
# prompts per (task, length) at 16k, 12k, 8k and 4k (inside the context), for vanilla, YaRN x2,
# dynamic NTK x2, Self-Extend, LM-Infinite +- top-k and sinks -> results/report/smollm2-135m-ruler/.
# Cost measured on the first 16k cell (Self-Extend, prefix cache on): ~150 CPU s per prompt, ~2.7
# core-hours per 16k cell; ~30-40 core-hours for the 28 cells (~43 h of one core left on
# 2026-11-29, docs/report.md), so it runs in the background across sessions, a length at a time
# (16k first, the most informative; then 12k, 8k, 4k: `sweep` below); every answer
# is journaled and every finished (method, length) cell kept (--reuse): rerun the same command
# after an interruption.
#   bash scripts/report_smollm2_ruler.sh [LENGTHS [EXTRA lcx report FLAGS]]   (LENGTHS must include
#   16384: the RoPE factor follows the longest length)
#   bash scripts/report_smollm2_ruler.sh 16384                    # (default) the 16k cells
#   bash scripts/report_smollm2_ruler.sh 12288,16384              # then 12k (and so on)
#   bash scripts/report_smollm2_ruler.sh 4096,8192,12288,16384 --render   # tables from what is measured
#   bash scripts/report_smollm2_ruler.sh sweep    # every step below in order, informative cells first
#   bash scripts/report_smollm2_ruler.sh steps    # the steps, one per line (scripts/sweeps.sh resumes them)
# Method order: vanilla third, so the paired tests against it come early. `sweep`'s order: 16k, 12k
# (every method), 8k and 4k for Self-Extend, YaRN and vanilla, then 8k and 4k for the rest (where
# their windows cover RULER's prompts and dynamic NTK does not rescale, so they should answer as
# vanilla; docs/report.md, "What the real-model RULER sweeps still cost").
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# (8k and 4k share a step, so that with --jobs 2 (LCX_SWEEP_JOBS) no core idles on a step's odd cell)
STEPS=("16384" "12288,16384" "4096,8192,16384 --presets self_extend,yarn,vanilla" "4096,8192,16384")
if [ "${1:-}" = steps ]; then printf '%s\n' "${STEPS[@]}"; exit 0; fi  # (scripts/sweeps.sh runs them)
if [ "${1:-}" = sweep ]; then
  for step in "${STEPS[@]}"; do
    bash scripts/report_smollm2_ruler.sh $step  # (the cwd is the checkout now)
  done
  exit 0
fi
reuse=--reuse  # measuring: keep every stored cell; --render measures nothing and takes no --reuse
for a in "${@:2}"; do [ "$a" = --render ] && reuse=; done
exec lcx report --model smollm2-135m --lengths "${1:-16384}" --decode-lengths none --tasks ruler \
  --ruler-tasks niah_single_1,niah_single_2_pd,niah_single_3_pd,niah_multikey_1_pd --ruler-samples 16 \
  --presets self_extend,yarn,vanilla,dynamic,lm_infinite_topk,lm_infinite,sinks --threads 1 \
  $reuse --keep-other-code --out results/report/smollm2-135m-ruler "${@:2}"
