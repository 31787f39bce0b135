"""The `lcx` lm-eval model a report cell evaluates (passkey/perplexity and RULER cells alike)."""

from __future__ import annotations

from typing import Any

from ..presets import PresetRun
from .config import ReportConfig


def lmeval_model(run: PresetRun, cfg: ReportConfig, *, prefix_caching: bool = True) -> Any:
    """The `lcx` lm-eval model a cell of `run` evaluates (batch size 1: prompts in prefix-reuse
    order; `prefix_caching=False`: the engine without its prefix cache)."""
    from ..lmeval_model import LcxLM

    return LcxLM(pretrained=run.model, batch_size=1, dtype=cfg.dtype, device=cfg.device,
                 prefix_caching=prefix_caching, **run.config.with_default_backend(cfg.attn_backend).to_flat())
