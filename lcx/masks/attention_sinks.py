"""Attention sinks (StreamingLLM, arXiv 2309.17453): `n_sink` first keys + a sliding window.

Query i sees `j < n_sink` (j <= i) and `i - left <= j <= i`. As a mask this is the Λ-mask
`lambda_mask(n_sink, left + 1)`; the methods differ in positions, not in the mask:
StreamingLLM renumbers positions inside its bounded cache, LM-Infinite caps distances
(`lcx.attention.lambda_attention_ref`).
"""

from __future__ import annotations

from .base import KeySpan, MaskMod, check_count, named
from .compose import or_masks
from .global_tokens import global_tokens
from .sliding_window import sliding_window


def attention_sinks(n_sink: int, left: int) -> MaskMod:
    check_count("n_sink", n_sink, 0)
    check_count("left", left, 0)
    inner = or_masks(global_tokens(n_sink), sliding_window(left=left))

    def attention_sinks_mask(b, h, q_idx, kv_idx):
        return inner(b, h, q_idx, kv_idx)

    return named(
        attention_sinks_mask,
        f"attention_sinks_{n_sink}_{left}",
        KeySpan(n_sink, left),
        {"n_sink": n_sink, "left": left},
        exact=True,
    )
