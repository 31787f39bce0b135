"""Build a SWAT model: a `LlamaConfig` that describes one (`swat_config`), a freshly initialised
`LlamaForCausalLM` from it (`build_swat_model`, what `lcx train lm --attention swat` calls).

SWAT (Sliding Window Attention Training, arXiv 2502.18845): sigmoid attention over a window of
w keys with balanced ALiBi + RoPE; the maths is `lcx.attention` (`AttentionSpec.swat`).

The split: this module builds models; how transformers then runs SWAT (the attention and mask
functions, their registration, the `config.lcx_attention` format `SwatParams`, `swat_params`,
`is_swat`, and `from_pretrained_kwargs` for loading a saved SWAT directory) is the HF adapter's
`lcx.hf.swat`. A model built here is a stock `LlamaForCausalLM` whose config names that adapter's
attention function, so it saves and loads (`lcx.load_model`) like any HF checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from lcx.hf.swat import ATTN_IMPLEMENTATION, CONFIG_KEY, DEFAULT_BACKEND, SwatParams, register


def swat_config(config: Any, window: int, *, alibi_slopes=None, backend: str = DEFAULT_BACKEND) -> Any:
    """Make a `LlamaConfig` (in place, returned) describe a SWAT model with a window of `window`
    keys; slopes default to `balanced_alibi_slopes(num_attention_heads)`."""
    n_heads = config.num_attention_heads
    if alibi_slopes is None:
        p = SwatParams.default(window, n_heads, backend)
    else:
        p = SwatParams(window, tuple(alibi_slopes), backend)
    if len(p.alibi_slopes) != n_heads:
        raise ValueError(f"{len(p.alibi_slopes)} alibi slopes for {n_heads} heads")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError("SWAT attention has no attention dropout (attention_dropout must be 0)")
    register()
    setattr(config, CONFIG_KEY, p.to_dict())
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
