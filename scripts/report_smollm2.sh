#!/usr/bin/env bash
# The SmolLM2-135M extrapolation report on CPU (docs/report.md's showcase): 4k, 8k and 16k tokens around
# its 8k training context, seven methods. Hours on 2 cores; resumable: rerun the same command
# after an interruption and it continues the interrupted run (lcx report's cells).
#   bash scripts/report_smollm2.sh [THREADS [EXTRA lcx report FLAGS]]
#   bash scripts/report_smollm2.sh 1 --render     # write the tables from the cells measured so far
# After a code change that leaves the numbers alone (the report lists what differs), add
# --keep-other-code to keep the cells measured before it instead of measuring them again.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec lcx report --model smollm2-135m --lengths 4096,8192,16384 --tasks passkey,ppl \
  --presets vanilla,yarn,dynamic,truncate,lm_infinite,lm_infinite+yarn,sinks \
  --depths 0.1,0.37,0.63,0.9 --samples-per-depth 1 --ppl-docs 2 --decode-tokens 16 \
  --threads "${1:-1}" --out results/report/smollm2-135m "${@:2}"
