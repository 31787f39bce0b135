"""Causal sliding window: query i sees keys `i - left <= j <= i` (left + 1 keys).

`left` is flash-attn's `window_size[0]` and attention-gym's `window_size`. A window of w keys
(SWAT's w, LM-Infinite's n_local) is `sliding_window(left=w - 1)`.
"""

from __future__ import annotations

from .base import KeySpan, MaskMod, check_count, named


def sliding_window(*, left: int) -> MaskMod:
    check_count("left", left, 0)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= left)

    return named(sliding_window_mask, f"sliding_window_{left}", KeySpan(0, left), {"left": left}, exact=True)
