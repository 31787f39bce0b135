#!/usr/bin/env bash
# Gemma-3-270m on RULER inside and beyond its 32k context (#42 item 4), step 2 after the floor
# screen (scripts/report_gemma3_ruler.sh at 8k: niah_single_1 4/8, niah_single_2_pd 7/8,
# niah_single_3_pd 6/8; niah_multikey_1_pd 2/8 and the other seven at 0-1/8 are left out by the
# rule of docs/report.md, "Which tasks an extension sweep runs": >= 3 of 8 inside the context):
# those three tasks, 8 prompts each, at 48k (1.5x beyond) and 16k (inside), for the methods of the
# passkey sweep (scripts/report_gemma3.sh, same presets, same factor: YaRN and dynamic NTK x1.5,
# sized for the longest length) -> results/report/gemma3-270m-ruler/. Budget (docs/report.md,
# from the measured prefill of the model as loaded on lcx: ~84 CPU s at 16k, ~433 s at 48k, plus
# a 128-token answer; the prefix cache reuses each prompt's haystack up to its needle): ~0.4
# core-hours per method at 16k, ~1.9 at 48k, ~14 in all; run after the passkey sweep, in the
# background across sessions, 48k first (the question is beyond the context). Dynamic NTK last:
# its basis follows the prompt's length, so it alone reuses nothing from the prefix cache (the
# first 48k cell, YaRN, took ~9 min for its first prompt and 1.5-2 min for the next ones).
# Resumable: every answer is journaled and every finished (method, length) cell kept; rerun the
# same command after an interruption. LENGTHS must include 49152 (the RoPE factor follows the
# longest length).
#   bash scripts/report_gemma3_ruler_sweep.sh [LENGTHS [EXTRA lcx report FLAGS]]
#   bash scripts/report_gemma3_ruler_sweep.sh 49152                 # (default) the 48k cells
#   bash scripts/report_gemma3_ruler_sweep.sh 16384,49152 --render  # tables from what is measured
#   bash scripts/report_gemma3_ruler_sweep.sh steps    # the sweep's steps, one per line (scripts/sweeps.sh
#                                                        resumes them): 48k first, then the 16k row
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = steps ]; then printf '%s\n' "49152" "16384,49152"; exit 0; fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
reuse=--reuse  # measuring: keep every stored cell; --render measures nothing and takes no --reuse
for a in "${@:2}"; do [ "$a" = --render ] && reuse=; done
exec lcx report --model gemma3-270m --lengths "${1:-49152}" --decode-lengths none --tasks ruler \
  --ruler-tasks niah_single_1,niah_single_2_pd,niah_single_3_pd --ruler-samples 8 \
  --presets yarn,self_extend,vanilla,lm_infinite,sinks,dynamic --threads 1 \
  $reuse --keep-other-code --out results/report/gemma3-270m-ruler "${@:2}"
