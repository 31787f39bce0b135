#!/usr/bin/env bash
# Train lcx's bundled retrieving model `tiny-ret-5m` (lcx/assets/tiny-retrieval-5m) from scratch:
# a 5.2M-parameter Llama (4 layers, hidden 256, 4/2 heads, untied embeddings, one token per
# digit) with a 256-token training context that retrieves a passkey at every depth.
#   bash scripts/train_tiny_retrieval.sh     # ~45 min on one CPU core; resumable: rerun it
#
# Phase 1 (induction heads): a pure copy task (a random run of 8-28 of the 256 most frequent
# tokens, repeated) at 64 tokens, AdamW lr 1e-3, beta2 0.98, no weight decay, until held-out copy
# accuracy holds >= 0.9 (~800 steps, 7 min). Without it no mix we tried ever formed the circuit
# (results/passkey_training/README.md): the loss sits on the induction plateau.
# Phase 2 (retrieval + text): from phase 1, 2000 steps of 16 x 256-token rows: 1/4 lm-eval-format
# passkey, 1/4 retrieval formats (copy over the whole vocabulary, passkey phrasings, key-value
# lookup), 1/2 Shakespeare/KJV text; answer tokens weighted 5x. Held-out passkey passes 0.9 within
# ~200 steps; the rest of the budget is for the language model (perplexity is measured too).
# The result is exported in float16 (half the bytes; loaded as float32).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
THREADS=${THREADS:-1}
P1=runs/tiny-retrieval-copy P2=runs/tiny-retrieval-mix OUT=lcx/assets/tiny-retrieval-5m LOGS=results/passkey_training
mkdir -p runs "$LOGS"

resume_flag() { [ -f "$1/state.pt" ] && echo --resume || true; }

if [ ! -f "$P1/train_log.json" ] || [ -f "$P1/state.pt" ]; then
  lcx train lm --out "$P1" $(resume_flag "$P1") --steps 4000 --eval-every 100 --batch-size 32 --seq-len 64 \
    --retrieval-mix 1.0 --retrieval-formats copy --copy-vocab 256 --stop-at-copy 0.9 \
    --lr 1e-3 --weight-decay 0 --beta2 0.98 --split-digits \
    --model-shape '{"num_hidden_layers": 4, "tie_word_embeddings": false}' --threads "$THREADS"
fi
if [ ! -f "$P2/train_log.json" ] || [ -f "$P2/state.pt" ] || ! grep -q final_val_loss "$P2/train_log.json"; then
  if [ -f "$P2/state.pt" ]; then
    lcx train lm --out "$P2" --resume --threads "$THREADS"
  else
    lcx train lm --init "$P1" --out "$P2" --steps 2000 --eval-every 100 --batch-size 16 --seq-len 256 \
      --passkey-mix 0.25 --retrieval-mix 0.25 --retrieval-formats copy,passkey,lookup --passkey-answer-weight 5 \
      --lr 1e-3 --warmup-steps 50 --weight-decay 0 --beta2 0.98 --threads "$THREADS"
  fi
fi
lcx models --export "$P2" --out "$OUT" --dtype float16
gzip -n -9 -c "$P1/train_log.json" > "$LOGS/tiny_retrieval_phase1_copy.json.gz"
gzip -n -9 -c "$P2/train_log.json" > "$LOGS/tiny_retrieval_phase2_mix.json.gz"
cp "$P2/train_log.png" "$LOGS/tiny_retrieval_phase2_mix.png"
echo "tiny-ret-5m written to $OUT; logs in $LOGS"
