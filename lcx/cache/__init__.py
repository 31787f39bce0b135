"""KV-cache surgery: a cache that knows its keys' positions, edits, PIE re-rotation.

>>> from lcx.cache import PositionedKVCache, Edit, update_cache
>>> cache = PositionedKVCache.prefill(model, ids)                       # ids: [1, T]
>>> res = update_cache(model, cache, [Edit(10, 12, [5, 6, 7])], strategy="pie")
>>> res.cache, res.cost.tokens_encoded

Semantics (cache layout, keys after RoPE, what a position is after an edit) are stated in
`lcx.cache.kv` and `lcx.cache.pie`.

`lcx.cache.gpe`: wait-k streaming generation with group position encoding (`stream_generate`);
not StreamingLLM, which is the `sinks` attention method (`lcx.methods.streaming`).
"""

from .gpe import StreamingConfig, StreamingSession, StreamResult, stream_generate
from .kv import ForwardCost, PositionedKVCache, forward_flops
from .pie import (
    EDIT_STRATEGIES,
    Edit,
    EditCost,
    EditPlan,
    EditResult,
    apply_edits,
    plan_edits,
    update_cache,
)
from .rerotate import REROTATE_BACKENDS, rerotate, rerotate_ref

__all__ = [
    "EDIT_STRATEGIES",
    "REROTATE_BACKENDS",
    "Edit",
    "EditCost",
    "EditPlan",
    "EditResult",
    "ForwardCost",
    "PositionedKVCache",
    "StreamResult",
    "StreamingConfig",
    "StreamingSession",
    "apply_edits",
    "forward_flops",
    "plan_edits",
    "rerotate",
    "rerotate_ref",
    "stream_generate",
    "update_cache",
]
