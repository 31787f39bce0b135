#!/usr/bin/env bash
# Gemma-3-270m on RULER (#42 item 4), step 1: the floor screen inside its 32k context. Vanilla (the
# model as loaded) at 8192 tokens, all 11 of lcx's offline RULER tasks, 8 prompts each ->
# results/report/gemma3-270m-ruler8k/. As for SmolLM2 (results/report/smollm2-135m-ruler4k), the
# tasks it does above floor inside its context are the ones worth an extension sweep (16k, 32k and
# 48k, as scripts/report_gemma3.sh runs passkey); the rest tell nothing about extension.
# Estimated from the passkey cells (a 16k Gemma prompt prefills in ~84 CPU s on the as-loaded fast
# path): ~30-60 s per 8k prompt with its 128-token answer budget, 88 prompts, ~1-1.5 core-hours.
# Resumable: every answer is journaled (docs/report.md); rerun the same command after an interruption.
#   bash scripts/report_gemma3_ruler.sh [LENGTHS [EXTRA lcx report FLAGS]]
#   bash scripts/report_gemma3_ruler.sh 8192 --render     # tables from what is measured
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
reuse=--reuse  # measuring: keep every stored cell; --render measures nothing and takes no --reuse
for a in "${@:2}"; do [ "$a" = --render ] && reuse=; done
exec lcx report --model gemma3-270m --lengths "${1:-8192}" --decode-lengths none --tasks ruler --ruler-samples 8 \
  --presets vanilla --threads 1 \
  $reuse --keep-other-code --out results/report/gemma3-270m-ruler8k "${@:2}"
