"""Global tokens: query i sees the first `n` keys (those not in its future), nothing else.

A building block: attention sinks and the Λ-mask are `global_tokens | sliding_window`.
"""

from __future__ import annotations

from .base import KeySpan, MaskMod, check_count, named


def global_tokens(n: int) -> MaskMod:
    check_count("n", n, 0)

    def global_tokens_mask(b, h, q_idx, kv_idx):
        return (kv_idx < n) & (kv_idx <= q_idx)

    return named(global_tokens_mask, f"global_tokens_{n}", KeySpan(n, -1), {"n": n}, exact=True)
