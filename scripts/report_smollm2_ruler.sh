#!/usr/bin/env bash
# SmolLM2-135M on RULER beyond its 8k context (#42 item 4): the four tasks it does above floor inside
# its context (results/report/smollm2-135m-ruler4k: niah_single_1 8/8, niah_single_2_pd 8/8,
# niah_single_3_pd 5/8, niah_multikey_1_pd 3/8 at 4096; the other seven 0-1/8 are left out), 16
# prompts per (task, length) at 8k, 12k and 16k, for vanilla, YaRN x2, dynamic NTK x2, Self-Extend,
# LM-Infinite +- top-k and sinks -> results/report/smollm2-135m-ruler/. Estimated from the 4k screen
# (29 s per prompt with its 128-token answer budget) and the passkey sweep's prefill times: ~20-40 h
# of one CPU core, so it runs in the background across sessions, a length at a time (16k first, the
# most informative); every finished (method, length) cell is kept and reused (--reuse): rerun the
# same command after an interruption.
#   bash scripts/report_smollm2_ruler.sh [LENGTHS [EXTRA lcx report FLAGS]]   (LENGTHS must include
#   16384: the RoPE factor follows the longest length)
#   bash scripts/report_smollm2_ruler.sh 16384                    # (default) the 16k cells
#   bash scripts/report_smollm2_ruler.sh 8192,12288,16384 --render   # tables from what is measured
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
reuse=--reuse  # measuring: keep every stored cell; --render measures nothing and takes no --reuse
for a in "${@:2}"; do [ "$a" = --render ] && reuse=; done
exec lcx report --model smollm2-135m --lengths "${1:-16384}" --decode-lengths none --tasks ruler \
  --ruler-tasks niah_single_1,niah_single_2_pd,niah_single_3_pd,niah_multikey_1_pd --ruler-samples 16 \
  --presets self_extend,yarn,dynamic,vanilla,lm_infinite_topk,lm_infinite,sinks --threads 1 \
  $reuse --keep-other-code --out results/report/smollm2-135m-ruler "${@:2}"
