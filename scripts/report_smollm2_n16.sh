#!/usr/bin/env bash
# The SmolLM2-135M passkey sweep with sample sizes that can rank methods (#32 item 3): 16 prompts
# per cell (8 depths x 2 keys) and 4 perplexity windows at 8k, 12k and 16k, for vanilla, YaRN x2,
# dynamic NTK x2, LM-Infinite, LM-Infinite + top-k (the paper's passkey configuration), sinks and
# Self-Extend -> results/report/smollm2-135m-n16/. About 15-25 h of one CPU core in all: it is
# run across sessions, a length at a time, most informative first (16k, then 8k, then 12k);
# every finished (method, length) cell is kept and reused (--reuse), so rerun the same command
# after an interruption. No decode cells (--decode-lengths none): `lcx bench decode` and the main
# SmolLM2 report measure decoding.
#   bash scripts/report_smollm2_n16.sh [LENGTHS [EXTRA lcx report FLAGS]]   (LENGTHS must include 16384:
#   the RoPE factor and the perplexity windows follow the longest length)
#   bash scripts/report_smollm2_n16.sh 16384            # (default) the 16k cells
#   bash scripts/report_smollm2_n16.sh 8192,12288,16384 --render   # tables from what is measured
#   bash scripts/report_smollm2_n16.sh 8192,16384 --presets vanilla,self_extend  # a second process on the
#       other core: extra flags override (the last --presets wins); give the two processes disjoint
#       cells (here: methods whose 16k cells exist), cells run length by length, shortest first
# Cells are fingerprinted by the library versions: run it with the environment the existing
# cells name (transformers 5.23 from scripts/setup.sh, not the 5.19 vLLM's install pins).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
reuse=--reuse  # measuring: keep every stored cell; --render measures nothing and takes no --reuse
for a in "${@:2}"; do [ "$a" = --render ] && reuse=; done
exec lcx report --model smollm2-135m --lengths "${1:-16384}" --decode-lengths none --tasks passkey,ppl \
  --presets lm_infinite_topk,lm_infinite,self_extend,vanilla,yarn,dynamic,sinks \
  --depths 8 --samples-per-depth 2 --ppl-docs 4 --threads 1 \
  $reuse --keep-other-code --out results/report/smollm2-135m-n16 "${@:2}"
