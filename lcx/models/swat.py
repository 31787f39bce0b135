"""Build a SWAT model: a `LlamaConfig` that describes one (`swat_config`), a freshly initialised
`LlamaForCausalLM` from it (`build_swat_model`, what `lcx train lm --attention swat` calls).

SWAT (Sliding Window Attention Training, arXiv 2502.18845): sigmoid attention over a window of
w keys with balanced ALiBi + RoPE. The method is the registry's `lcx.methods.swat.SWAT` (its
parameters, validation and maths, on `lcx.attention`); a model built here is trained with it.

The split: this module builds models; the config records the method (`lcx.hf.recorded`:
`config.lcx_attention`, read back by the engine and every front end like any other method), and
how transformers then runs it (the attention and mask functions, their registration, and
`from_pretrained_kwargs` for loading a saved SWAT directory) is the HF adapter's `lcx.hf.swat`.
A model built here is a stock `LlamaForCausalLM` whose config names that adapter's attention
function, so it saves and loads (`lcx.load_model`) like any HF checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from lcx.hf.recorded import record_method
from lcx.hf.swat import ATTN_IMPLEMENTATION, DEFAULT_BACKEND, register
from lcx.methods.swat import SWAT


def swat_config(config: Any, window: int, *, alibi_slopes=None, backend: str = DEFAULT_BACKEND) -> Any:
    """Make a `LlamaConfig` (in place, returned) describe a SWAT model with a window of `window`
    keys; slopes default to `balanced_alibi_slopes(num_attention_heads)` and are stored, so a
    saved model keeps its schedule."""
    method = SWAT(window, alibi_slopes).for_heads(config.num_attention_heads)  # ValueError on a mismatch
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError("SWAT attention has no attention dropout (attention_dropout must be 0)")
    register()
    record_method(config, method, backend=backend)  # config.lcx_attention
    config.sliding_window = window  # DynamicCache(config) then keeps w - 1 keys per layer
    config.attn_implementation = ATTN_IMPLEMENTATION  # serialised; read back by PretrainedConfig
    config._attn_implementation = ATTN_IMPLEMENTATION
    return config


def build_swat_model(config: Any, window: int | None = None) -> torch.nn.Module:
    """A freshly initialised SWAT `LlamaForCausalLM` from a `LlamaConfig`.

    `window` defaults to `config.sliding_window` (how `lcx train lm --window` passes it). This is
    the builder `lcx.train.lm.ATTENTION_VARIANTS["swat"]` calls.
    """
    from transformers import LlamaForCausalLM

    window = window if window is not None else getattr(config, "sliding_window", None)
    if window is None:
        raise ValueError("SWAT needs a window (config.sliding_window or window=...), e.g. 128")
    return LlamaForCausalLM(swat_config(config, window))


__all__ = ["build_swat_model", "swat_config"]
