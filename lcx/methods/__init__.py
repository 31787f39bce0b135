"""Attention methods for whole HF models: LM-Infinite, sliding window, StreamingLLM sinks, Self-Extend.

>>> from lcx.methods import lm_infinite, attention_patched, BoundedKVCache, greedy_generate
>>> with attention_patched(model, lm_infinite(n_global=16, n_local=256)):      # doctest: +SKIP
...     logits = model(ids).logits                                            # full sequence
...     out = greedy_generate(model, ids, 64, cache=BoundedKVCache(lm_infinite(16, 256)))

- `lcx.methods.spec`: the methods (`ATTENTION_METHODS`), each `attend(q, k, v, rotary=...)`
  on UNROTATED q/k, and `cache_window` for bounded caches.
- `lcx.methods.streaming`: StreamingLLM's renumbered positions over a whole sequence.
- `lcx.methods.attention_patch`: `patch_attention` / `unpatch_attention` / `attention_patched`.
- `lcx.methods.bounded_cache`: `BoundedKVCache` (a transformers `Cache`), `greedy_generate`.
"""

from .attention_patch import (
    ATTN_IMPLEMENTATION,
    attention_patched,
    current_attention,
    patch_attention,
    unpatch_attention,
)
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
    causal,
    lm_infinite,
    method_from_dict,
    self_extend,
    sinks,
    sliding_window,
)
from .self_extend import self_extend_ref
from .streaming import streaming_attention, streaming_attention_ref

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
    "unpatch_attention",
]
