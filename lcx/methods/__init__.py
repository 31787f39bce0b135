"""Attention methods for whole HF models, one module each (`lcx.methods.<name>`).

>>> from lcx.methods import lm_infinite
>>> from lcx.hf import BoundedKVCache, attention_patched, greedy_generate
>>> with attention_patched(model, lm_infinite(n_global=16, n_local=256)):      # doctest: +SKIP
...     logits = model(ids).logits                                            # full sequence
...     out = greedy_generate(model, ids, 64, cache=BoundedKVCache(lm_infinite(16, 256)))

The methods are the math (no transformers): installing one in an HF model, the bounded cache
and the reference decode loop are the HF adapter's (`lcx.hf`), one layer up.

- `lcx.methods.base`: `AttentionMethod` (each method's `attend(q, k, v, rotary=...)` on
  UNROTATED q/k, its decode rule, `cache_window` for bounded caches, `examples` for the tests).
- `lcx.methods.<name>`: one module per method (its dataclass, validation, reference, factory),
  named by its registry key (`lcx.methods.lm_infinite`, ...); `lcx.methods.streaming` holds
  StreamingLLM's renumbered positions over a whole sequence (`sinks`).
- `lcx.methods.registry`: `ATTENTION_METHODS`, the only list of them; `method_from_dict`;
  `examples()`, the cases every test grid over methods is generated from. Everything the registry
  imports from a method's module is exported here.
- `lcx.methods.last_query`: the last query of a call as plain softmax attention (decode fast path).
- `lcx.methods.plan`: the decode step plan of a `DecodeRule` (which keys each row sees, in which
  branch, re-rotated by how much), the one definition `lcx.engine` and the vLLM plugin read.
"""

from . import registry
from .base import AttentionMethod, DecodeRule, LastQueryKeys
from .registry import *  # noqa: F403 -- the registry, every method class and factory (registry.__all__)
from .streaming import streaming_attention, streaming_attention_ref

__all__ = [
    "AttentionMethod",
    "DecodeRule",
    "LastQueryKeys",
    "streaming_attention",
    "streaming_attention_ref",
]
__all__ += registry.__all__
