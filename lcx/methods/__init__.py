"""Attention methods for whole HF models: LM-Infinite, sliding window, StreamingLLM sinks, Self-Extend, SWAT.

>>> from lcx.methods import lm_infinite, attention_patched, BoundedKVCache, greedy_generate
>>> with attention_patched(model, lm_infinite(n_global=16, n_local=256)):      # doctest: +SKIP
...     logits = model(ids).logits                                            # full sequence
...     out = greedy_generate(model, ids, 64, cache=BoundedKVCache(lm_infinite(16, 256)))

- `lcx.methods.spec`: the methods (`ATTENTION_METHODS`), each `attend(q, k, v, rotary=...)`
  on UNROTATED q/k, and `cache_window` for bounded caches.
- `lcx.methods.streaming`: StreamingLLM's renumbered positions over a whole sequence.
- `lcx.methods.self_extend`, `lcx.methods.swat`: Self-Extend and SWAT, one module each.
- `lcx.methods.bounded_cache`: `BoundedKVCache` (a transformers `Cache`), `greedy_generate` (the
  reference decode loop over such a cache; `lcx.engine` is lcx's decode loop and is tested equal).
- `patch_attention` / `unpatch_attention` / `attention_patched` / `current_attention`: the
  attention patch, which installs a method in an HF model, lives in the HF adapter
  (`lcx.hf.attention_patch`); re-exported here, resolved on first use.
"""

from importlib import import_module
from typing import Any

from .bounded_cache import BoundedKVCache, GenerationResult, cache_len, cache_nbytes, greedy_generate
from .spec import (
    ATTENTION_METHODS,
    UNROTATED_METHODS,
    AttentionMethod,
    Causal,
    LMInfinite,
    Sinks,
    SelfExtend,
    SlidingWindow,
    SWAT,
    causal,
    lm_infinite,
    method_from_dict,
    self_extend,
    sinks,
    sliding_window,
    swat,
)
from .self_extend import self_extend_ref
from .streaming import streaming_attention, streaming_attention_ref

# Re-exported from the HF adapter lazily: `lcx.hf.attention_patch` imports `lcx.methods.spec`,
# so an eager import here would fail whenever `lcx.hf.attention_patch` is imported first.
_FROM_HF = ("ATTN_IMPLEMENTATION", "attention_patched", "current_attention", "patch_attention", "unpatch_attention")


def __getattr__(name: str) -> Any:
    if name in _FROM_HF:
        return getattr(import_module("lcx.hf.attention_patch"), name)
    raise AttributeError(f"module 'lcx.methods' has no attribute {name!r}")


__all__ = [
    "ATTENTION_METHODS",
    "ATTN_IMPLEMENTATION",
    "AttentionMethod",
    "BoundedKVCache",
    "Causal",
    "GenerationResult",
    "LMInfinite",
    "Sinks",
    "SelfExtend",
    "SlidingWindow",
    "SWAT",
    "UNROTATED_METHODS",
    "attention_patched",
    "cache_len",
    "cache_nbytes",
    "causal",
    "current_attention",
    "greedy_generate",
    "lm_infinite",
    "method_from_dict",
    "patch_attention",
    "self_extend",
    "self_extend_ref",
    "sinks",
    "sliding_window",
    "streaming_attention",
    "streaming_attention_ref",
    "swat",
    "unpatch_attention",
]
