"""Attention masks as `mask_mod(b, h, q_idx, kv_idx) -> bool` functions (attention-gym style).

Each mask is a factory in its own file (`sliding_window(left=left) -> mask_mod`); masks compose with
`and_masks` / `or_masks` / `not_mask`; the returned function's `__name__` records its
parameters (`sliding_window_7`, `lambda_4_16`); `MASKS` is the registry of factories.

Window convention (the one statement of it in lcx)
--------------------------------------------------
Indices are absolute positions in the key sequence: key j = 0 .. Tk-1. The Tq queries are
the LAST Tq of those positions: query t (0 <= t < Tq) has index i = q_offset + t with
q_offset = Tk - Tq unless given. A mask_mod is called with (i, j), never with t.

- prefill          Tq = Tk,   q_offset = 0,       query t is token t.
- chunked prefill  Tq < Tk,   q_offset = Tk - Tq, earlier chunks are already in the cache.
- decode           Tq = 1,    q_offset = Tk - 1,  the new token sees the whole cache.

`sliding_window(left=left)` lets query i see keys i - left <= j <= i: left + 1 keys, itself
included (flash-attn's window_size=(left, 0)). A "window of w keys" (SWAT's w, LM-Infinite's
n_local) is left = w - 1. Example, `sliding_window(left=2)`, chunked prefill Tq=3 of Tk=6:

                    key j:  0 1 2 3 4 5
    query t=0 (i=3)         . x x x . .
    query t=1 (i=4)         . . x x x .
    query t=2 (i=5)         . . . x x x

`lambda_mask(n_global, n_local)` adds the first n_global keys to a window of n_local keys;
`lambda_mask(2, 2)`, prefill Tk=6 (G = global key, x = window key):

                    key j:  0 1 2 3 4 5
    query i=0               x . . . . .
    query i=1               x x . . . .
    query i=2               G x x . . .
    query i=3               G G x x . .
    query i=4               G G . x x .
    query i=5               G G . . x x

lcx masks do not depend on b or h. The tests pin each mask with hand-written matrices.
"""

from __future__ import annotations

from typing import Any, Callable

from .attention_sinks import attention_sinks
from .base import KeySpan, MaskMod, default_q_offset, mask_matrix, mask_span, window_shape
from .causal import causal, causal_mask
from .compose import and_masks, not_mask, or_masks
from .global_tokens import global_tokens
from .lambda_mask import lambda_mask
from .sliding_window import sliding_window

# The only list of masks: name -> factory(**params) -> mask_mod.
MASKS: dict[str, Callable[..., MaskMod]] = {
    "causal": causal,
    "sliding_window": sliding_window,
    "global_tokens": global_tokens,
    "attention_sinks": attention_sinks,
    "lambda": lambda_mask,
}


def make_mask(name: str, **params: Any) -> MaskMod:
    """`MASKS[name](**params)`, with errors that name the mask and the bad key."""
    if name not in MASKS:
        raise ValueError(f"mask {name!r} is not known; known: {sorted(MASKS)}")
    try:
        return MASKS[name](**params)
    except TypeError as e:  # unknown or missing keyword
        raise ValueError(f"mask {name!r}: {e}") from None


__all__ = [
    "MASKS",
    "KeySpan",
    "MaskMod",
    "and_masks",
    "attention_sinks",
    "causal",
    "causal_mask",
    "window_shape",
    "default_q_offset",
    "global_tokens",
    "lambda_mask",
    "make_mask",
    "mask_matrix",
    "mask_span",
    "not_mask",
    "or_masks",
    "sliding_window",
]
