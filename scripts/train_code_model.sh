#!/usr/bin/env bash
# Fine-tune SmolLM2-135M (preset smollm2-135m: the Instruct Q4_1 GGUF dequantized to float32) on
# Python standard-library code, for the PIE code-edit benchmark (lcx bench pie).
#   bash scripts/train_code_model.sh          # resumable: rerun it to continue; STOP_AFTER=N time-boxes
#   DEVICE=cuda bash scripts/train_code_model.sh   # on a GPU machine (default DEVICE=cpu)
#
# Data: `--corpus stdlib-code`, the train packages of lcx.data.code's by-package split (~2.0M
# tokens); held-out loss on its val packages. The benchmark samples only the eval packages
# (`lcx bench pie --split eval`), which this run never reads; the split (rule, units, file
# lists) is recorded in the log and in the model's train_config.json.
# Optimisation: full fine-tune, AdamW lr 3e-4 (warmup 10, cosine to 3e-5 over 250 steps), 4 x 512-token windows
# per step, bf16 autocast (float32 weights): ~17 s a step on one CPU thread.
# Output: the model in runs/code-smollm2-135m (float32, ~540 MB: not committed), the log and curve
# in results/pie_code_model/train_log.{json,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
THREADS=${THREADS:-1} DEVICE=${DEVICE:-cpu}
OUT=${OUT:-runs/code-smollm2-135m} LOG=results/pie_code_model/train_log.json
mkdir -p runs results/pie_code_model
STOP=()
[ -n "${STOP_AFTER:-}" ] && STOP=(--stop-after "$STOP_AFTER")
if [ -f "$OUT/state.pt" ]; then
  lcx train lm --out "$OUT" --log "$LOG" --resume --threads "$THREADS" --device "$DEVICE" "${STOP[@]}"
elif [ ! -f "$OUT/train_config.json" ]; then
  lcx train lm --init smollm2-135m --corpus stdlib-code --autocast bfloat16 --out "$OUT" --log "$LOG" \
    --steps 250 --batch-size 4 --seq-len 512 --lr 3e-4 --warmup-steps 10 --eval-every 50 --val-windows 16 \
    --ckpt-every 10 --threads "$THREADS" --device "$DEVICE" "${STOP[@]}"
else
  echo "$OUT is finished (no state.pt); remove it to train again"
fi
