"""Attention variants a `lcx train lm` model can be trained with (`ModelConfig.attention`).

One registry, `ATTENTION_VARIANTS`: name -> builder(LlamaConfig) -> model. `sdpa` is the stock
`LlamaForCausalLM`; `swat` is SWAT (arXiv 2502.18845: sigmoid, sliding window, balanced ALiBi +
RoPE, `lcx.models.swat`). Windowed variants (`WINDOWED_VARIANTS`) take `ModelConfig.window`,
passed to the builder as `LlamaConfig.sliding_window`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _build_sdpa(config) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _build_swat(config) -> torch.nn.Module:
    from lcx.models.swat import build_swat_model  # window: config.sliding_window

    return build_swat_model(config)


# Attention variants a model can be trained with: name -> builder(LlamaConfig) -> model. A new
# variant (e.g. SWAT's sigmoid sliding-window attention) registers its builder here; it gets the
# same LlamaConfig and must return an HF causal LM whose forward takes `input_ids`.
ATTENTION_VARIANTS: dict[str, Callable[[Any], torch.nn.Module]] = {
    "sdpa": _build_sdpa,
    "swat": _build_swat,  # SWAT (arXiv 2502.18845): sigmoid, window, balanced ALiBi; lcx.models.swat
}
# Variants that take ModelConfig.window (passed to the builder as LlamaConfig.sliding_window).
WINDOWED_VARIANTS = frozenset({"swat"})
