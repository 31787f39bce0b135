"""What determines a `lcx train lm` run's weights: `ModelConfig` (the model's shape and attention
variant) and `TrainConfig` (data, optimisation, schedule, retrieval mixes), frozen and validated;
`from_dict` rejects unknown keys. Runtime knobs (threads, device, progress) are not here.

Also the two rules that follow from a `TrainConfig` alone: how many rows of a batch are passkey /
retrieval examples (`passkey_rows`, `retrieval_rows`), and the mixed precision it trains in
(`autocast_ctx`: `--autocast bfloat16` runs forward and backward under `torch.autocast`, float32
weights and optimizer; ~1.6x faster per token for SmolLM2-135M on a CPU with AVX512-BF16;
validation loss is then computed the same way).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from lcx.configs import strict_from_dict

from .corpora import CORPORA
from .variants import ATTENTION_VARIANTS, WINDOWED_VARIANTS

# Mixed precision: TrainConfig.autocast -> torch dtype (None: plain float32).
AUTOCAST_DTYPES: dict[str | None, torch.dtype | None] = {None: None, "bfloat16": torch.bfloat16}


def autocast_ctx(cfg: "TrainConfig", device_type: str = "cpu"):
    """`torch.autocast` for `cfg.autocast`, or a no-op context."""
    import contextlib

    dtype = AUTOCAST_DTYPES[cfg.autocast]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the Llama-style model. `attention` picks an entry of `ATTENTION_VARIANTS`."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 5
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    attention: str = "sdpa"
    window: int | None = None  # keys per query, itself included; windowed variants only (swat)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.attention not in ATTENTION_VARIANTS:
            raise ValueError(f"attention={self.attention!r} is not known; known: {sorted(ATTENTION_VARIANTS)}")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            raise ValueError(f"window must be a positive integer, got {self.window!r}")
        if (self.window is not None) != (self.attention in WINDOWED_VARIANTS):
            raise ValueError(f"window is required by and only by the windowed attention variants "
                             f"{sorted(WINDOWED_VARIANTS)}; got attention={self.attention!r}, window={self.window!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        return strict_from_dict(cls, d)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained weights (runtime knobs such as threads are not here)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 800
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    val_windows: int = 128
    ckpt_every: int = 100
    init: str | None = None  # preset name or HF directory to fine-tune from (None: fresh init)
    passkey_mix: float = 0.0  # fraction of each batch's rows that are passkey examples
    passkey_answer_weight: float = 1.0  # loss weight of a passkey example's answer tokens (1: plain mean)
    retrieval_mix: float = 0.0  # fraction of rows that are lcx.train.retrieval examples (after the passkey rows)
    stop_at_passkey: float | None = None  # stop once held-out passkey accuracy >= this at 2 evals in a row
    stop_at_copy: float | None = None  # stop once held-out copy accuracy >= this at 2 evals in a row
    retrieval_formats: tuple[str, ...] | None = None  # formats drawn uniformly (None: retrieval.FORMATS)
    copy_vocab: int | None = None  # copy runs draw from this many most frequent tokens (None: all)
    corpus: str = "text"  # a key of CORPORA: the train / held-out documents
    autocast: str | None = None  # "bfloat16": forward/backward under torch.autocast (weights stay float32)

    def __post_init__(self) -> None:
        if isinstance(self.model, Mapping):
            object.__setattr__(self, "model", ModelConfig.from_dict(self.model))
        for name in ("steps", "batch_size", "seq_len", "eval_every", "val_windows", "ckpt_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1/beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError("weight_decay must be >= 0 and grad_clip > 0")
        if self.seq_len > self.model.max_position_embeddings:
            raise ValueError(f"seq_len ({self.seq_len}) exceeds max_position_embeddings "
                             f"({self.model.max_position_embeddings})")
        if self.init is not None and (not isinstance(self.init, str) or not self.init.strip()):
            raise ValueError(f"init must be a model preset name or directory, got {self.init!r}")
        mix = self.passkey_mix
        if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0.0 <= mix <= 1.0:
            raise ValueError(f"passkey_mix must be a fraction in [0, 1], got {mix!r}")
        w = self.passkey_answer_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (1.0 <= w and math.isfinite(w)):
            raise ValueError(f"passkey_answer_weight must be a finite number >= 1, got {w!r}")
        rmix = self.retrieval_mix
        if isinstance(rmix, bool) or not isinstance(rmix, (int, float)) or not 0.0 <= rmix <= 1.0:
            raise ValueError(f"retrieval_mix must be a fraction in [0, 1], got {rmix!r}")
        if mix + rmix > 1.0 + 1e-9:
            raise ValueError(f"passkey_mix + retrieval_mix must be <= 1, got {mix} + {rmix}")
        if w != 1.0 and mix == 0 and rmix == 0:
            raise ValueError("passkey_answer_weight needs passkey_mix or retrieval_mix > 0 (there is no answer "
                             "to weight)")
        if rmix > 0 and retrieval_rows(self) == 0:
            raise ValueError(f"retrieval_mix={rmix} gives no retrieval row in a batch of {self.batch_size}")
        if self.retrieval_formats is not None:
            from lcx.train.retrieval import FORMATS

            fmts = tuple(self.retrieval_formats)
            object.__setattr__(self, "retrieval_formats", fmts)
            bad = sorted(set(fmts) - set(FORMATS))
            if not fmts or bad:
                raise ValueError(f"retrieval_formats must name formats of {sorted(set(FORMATS))}, got {list(fmts)}")
        sp = self.stop_at_passkey
        if sp is not None and (isinstance(sp, bool) or not isinstance(sp, (int, float)) or not 0 < sp <= 1):
            raise ValueError(f"stop_at_passkey must be a fraction in (0, 1], got {sp!r}")
        if sp is not None and mix == 0 and self.retrieval_mix == 0:
            raise ValueError("stop_at_passkey needs passkey_mix or retrieval_mix > 0 (passkey is not measured)")
        cv = self.copy_vocab
        if cv is not None and (isinstance(cv, bool) or not isinstance(cv, int) or cv < 2):
            raise ValueError(f"copy_vocab must be an integer >= 2, got {cv!r}")
        sc = self.stop_at_copy
        if sc is not None and (isinstance(sc, bool) or not isinstance(sc, (int, float)) or not 0 < sc <= 1):
            raise ValueError(f"stop_at_copy must be a fraction in (0, 1], got {sc!r}")
        if sc is not None and (rmix == 0 or "copy" not in (self.retrieval_formats or ("copy",))):
            raise ValueError("stop_at_copy needs retrieval_mix > 0 with the copy format (copy is not measured)")
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus={self.corpus!r} is not known; known: {sorted(CORPORA)}")
        if self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"autocast must be one of {sorted(AUTOCAST_DTYPES, key=str)}, got {self.autocast!r}")
        if mix > 0 and passkey_rows(self) == 0:
            raise ValueError(f"passkey_mix={mix} gives no passkey row in a batch of {self.batch_size} "
                             f"(round(passkey_mix * batch_size) = 0); raise it or the batch size")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        return strict_from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


def passkey_rows(cfg: TrainConfig) -> int:
    """How many rows of each batch are passkey examples: round(passkey_mix * batch_size)."""
    return int(round(cfg.passkey_mix * cfg.batch_size))


def retrieval_rows(cfg: TrainConfig) -> int:
    """How many rows (after the passkey rows) are retrieval examples: round(retrieval_mix * batch_size)."""
    return min(cfg.batch_size - passkey_rows(cfg), int(round(cfg.retrieval_mix * cfg.batch_size)))
