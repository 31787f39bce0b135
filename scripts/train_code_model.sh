#!/usr/bin/env bash
# Fine-tune SmolLM2-135M (preset smollm2-135m: the Instruct Q4_1 GGUF dequantized to float32) on
# Python standard-library code, for the PIE code-edit benchmark (lcx bench pie).
#   bash scripts/train_code_model.sh          # resumable: rerun it to continue; STOP_AFTER=N time-boxes
#   DEVICE=cuda bash scripts/train_code_model.sh   # on a GPU machine (default DEVICE=cpu)
#   STAGES=1 bash scripts/train_code_model.sh      # stage 1 only (STAGES=2: stages 1 and 2)
#
# Data: `--corpus stdlib-code`, the train packages of lcx.data.code's by-package split (~2.0M
# tokens); held-out loss on its val packages. The benchmark samples only the eval packages
# (`lcx bench pie --split eval`), which this run never reads; the split (rule, units, file
# lists) is recorded in the log and in the model's train_config.json.
# Optimisation: full fine-tune, AdamW, bf16 autocast (float32 weights), two stages:
#   1. from SmolLM2: lr 3e-4 (warmup 10, cosine to 3e-5 over 250 steps), 4 x 512-token windows
#      per step (~17 s a step on one CPU thread, ~70 min) -> runs/code-smollm2-135m,
#      log results/pie_code_model/train_log.{json.gz,png}
#   2. from stage 1: lr 1.5e-4 (warmup 10, cosine to 1.5e-5 over 240 steps), 2 x 1024-token
#      windows per step (same tokens a step; longer windows for the 2048-token eval), batch
#      seed 1 (other windows than stage 1) (~16 s a step, ~65 min) -> runs/code-smollm2-135m-s2,
#      log results/pie_code_model/train_log_stage2.{json.gz,png}
#   3. from stage 2: more kinds of code (`--corpus python-code`: the train packages plus ~26 MB of
#      third-party code from site-packages, filtered and decontaminated against the stdlib's val
#      and eval packages, lcx.data.code.site_code), lr 1e-4 (warmup 10, cosine over 360 steps),
#      2 x 1024-token windows, batch seed 2 (~16 s a step, ~95 min) -> runs/code-smollm2-135m-s3,
#      log results/pie_code_model/train_log_stage3.{json.gz,png}; its selection depends on the
#      installed packages and is listed in runs/code-smollm2-135m-s3/site_code_files.json
# Output models are float32, ~540 MB each: not committed.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
THREADS=${THREADS:-1} DEVICE=${DEVICE:-cpu} STAGES=${STAGES:-3}
S1=${OUT:-runs/code-smollm2-135m} S2=${OUT2:-runs/code-smollm2-135m-s2} S3=${OUT3:-runs/code-smollm2-135m-s3}
mkdir -p runs results/pie_code_model
STOP=()
[ -n "${STOP_AFTER:-}" ] && STOP=(--stop-after "$STOP_AFTER")
RUNTIME=(--threads "$THREADS" --device "$DEVICE" "${STOP[@]}")

# stage OUT LOG ARGS...: start, resume or skip (finished) one fine-tuning run; a run stopped
# by STOP_AFTER (its state.pt is kept) ends the script, so a later stage never starts from it
stage() {
  local out=$1 log=$2; shift 2
  if [ -f "$out/state.pt" ]; then
    lcx train lm --out "$out" --log "$log" --resume "${RUNTIME[@]}"
  elif [ ! -f "$out/train_config.json" ]; then
    lcx train lm --autocast bfloat16 --out "$out" --log "$log" \
      --ckpt-every 10 --val-windows 16 "$@" "${RUNTIME[@]}"
  else
    echo "$out is finished (no state.pt); remove it to train again"
  fi
  if [ -f "$out/state.pt" ]; then echo "$out stopped early: rerun to continue"; exit 0; fi
}

stage "$S1" results/pie_code_model/train_log.json.gz --init smollm2-135m --corpus stdlib-code \
  --steps 250 --batch-size 4 --seq-len 512 --lr 3e-4 --warmup-steps 10 --eval-every 50
[ "$STAGES" -ge 2 ] || exit 0
stage "$S2" results/pie_code_model/train_log_stage2.json.gz --init "$S1" --corpus stdlib-code \
  --steps 240 --batch-size 2 --seq-len 1024 --lr 1.5e-4 --warmup-steps 10 --eval-every 60 --seed 1
[ "$STAGES" -ge 3 ] || exit 0
stage "$S3" results/pie_code_model/train_log_stage3.json.gz --init "$S2" --corpus python-code \
  --steps 360 --batch-size 2 --seq-len 1024 --lr 1e-4 --warmup-steps 10 --eval-every 60 --seed 2
