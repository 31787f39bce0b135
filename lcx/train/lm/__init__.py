"""`lcx train lm`: train a small Llama-style causal LM on Shakespeare + the KJV Bible (or Python
code), from scratch or as a fine-tune, optionally mixing in passkey / retrieval / copy examples.

One module per concern:

    corpora.py    CORPORA: the train / held-out documents per `--corpus`
    variants.py   ATTENTION_VARIANTS: attention implementations a model trains with (sdpa, swat)
    config.py     ModelConfig, TrainConfig (frozen, validated); rows per batch; autocast
    model.py      the HF Llama model: build_model, llama_config, --init resolution and loading
    batches.py    batches as a function of (seed, step); passkey examples; validation windows
    metrics.py    lm_loss, evaluate (validation loss), passkey / copy accuracy
    loop.py       train(): the optimisation loop, checkpoints, resume, log and curve
    cli.py        `lcx train lm` flags -> TrainConfig -> train()

The names below are the package's API (`from lcx.train.lm import TrainConfig, train`).
"""

from __future__ import annotations

from .batches import PasskeyExamples, batch_at, val_windows, weighted_batch_at
from .config import (
    AUTOCAST_DTYPES,
    ModelConfig,
    TrainConfig,
    autocast_ctx,
    passkey_rows,
    retrieval_rows,
)
from .corpora import CODE_CORPORA, CORPORA
from .loop import TrainResult, lr_at, plot_curve, train
from .metrics import (
    COPY_VAL_COUNT,
    COPY_VAL_SEED,
    PASSKEY_VAL_COUNT,
    PASSKEY_VAL_SEED,
    copy_accuracy,
    copy_val_examples,
    evaluate,
    lm_loss,
    passkey_accuracy,
    passkey_val_examples,
)
from .model import build_model, file_sha256, init_model_config, llama_config, load_init, model_config_of, resolve_init
from .variants import ATTENTION_VARIANTS, WINDOWED_VARIANTS

__all__ = [
    "ATTENTION_VARIANTS", "AUTOCAST_DTYPES", "CODE_CORPORA", "CORPORA", "COPY_VAL_COUNT", "COPY_VAL_SEED",
    "ModelConfig", "PASSKEY_VAL_COUNT", "PASSKEY_VAL_SEED", "PasskeyExamples", "TrainConfig", "TrainResult",
    "WINDOWED_VARIANTS", "autocast_ctx", "batch_at", "build_model", "copy_accuracy", "copy_val_examples",
    "evaluate", "file_sha256", "init_model_config", "llama_config", "lm_loss", "load_init", "lr_at",
    "model_config_of", "passkey_accuracy", "passkey_rows", "passkey_val_examples", "plot_curve",
    "resolve_init", "retrieval_rows", "train", "val_windows", "weighted_batch_at",
]
