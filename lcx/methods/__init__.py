"""Attention methods for whole HF models, one module each (`lcx.methods.<name>`).

>>> from lcx.methods import lm_infinite, attention_patched, BoundedKVCache, greedy_generate
>>> with attention_patched(model, lm_infinite(n_global=16, n_local=256)):      # doctest: +SKIP
...     logits = model(ids).logits                                            # full sequence
...     out = greedy_generate(model, ids, 64, cache=BoundedKVCache(lm_infinite(16, 256)))

- `lcx.methods.base`: `AttentionMethod` (each method's `attend(q, k, v, rotary=...)` on
  UNROTATED q/k, its decode rule, `cache_window` for bounded caches, `examples` for the tests).
- `lcx.methods.<name>`: one module per method (its dataclass, validation, reference, factory),
  named by its registry key (`lcx.methods.lm_infinite`, ...); `lcx.methods.streaming` holds
  StreamingLLM's renumbered positions over a whole sequence (`sinks`).
- `lcx.methods.registry`: `ATTENTION_METHODS`, the only list of them; `method_from_dict`;
  `examples()`, the cases every test grid over methods is generated from. Everything the registry
  imports from a method's module is exported here.
- `lcx.methods.last_query`: the last query of a call as plain softmax attention (decode fast path).
- `lcx.methods.bounded_cache`: `BoundedKVCache` (a transformers `Cache`), `greedy_generate` (the
  reference decode loop over such a cache; `lcx.engine` is lcx's decode loop and is tested equal).
- `patch_attention` / `unpatch_attention` / `attention_patched` / `current_attention`: the
  attention patch, which installs a method in an HF model, lives in the HF adapter
  (`lcx.hf.attention_patch`); re-exported here, resolved on first use.
"""

from importlib import import_module
from typing import Any

from . import registry
from .base import AttentionMethod, DecodeRule, LastQueryKeys
from .bounded_cache import BoundedKVCache, GenerationResult, cache_len, cache_nbytes, greedy_generate
from .registry import *  # noqa: F403 -- the registry, every method class and factory (registry.__all__)
from .streaming import streaming_attention, streaming_attention_ref

# Re-exported from the HF adapter lazily: `lcx.hf.attention_patch` imports `lcx.methods.base`,
# so an eager import here would fail whenever `lcx.hf.attention_patch` is imported first.
_FROM_HF = ("ATTN_IMPLEMENTATION", "attention_patched", "current_attention", "patch_attention", "unpatch_attention")


def __getattr__(name: str) -> Any:
    if name in _FROM_HF:
        return getattr(import_module("lcx.hf.attention_patch"), name)
    raise AttributeError(f"module 'lcx.methods' has no attribute {name!r}")


__all__ = [
    "AttentionMethod",
    "BoundedKVCache",
    "DecodeRule",
    "GenerationResult",
    "LastQueryKeys",
    "cache_len",
    "cache_nbytes",
    "greedy_generate",
    "streaming_attention",
    "streaming_attention_ref",
]
__all__ += [*_FROM_HF, *registry.__all__]
