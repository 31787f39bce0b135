"""Mask algebra: `and_masks`, `or_masks`, `not_mask` (attention-gym / flex_attention style).

Unlike torch's versions, the result's `__name__` spells the expression, e.g.
`and(global_tokens_4,not(sliding_window_7))`, and it carries a key span for blockwise backends.
"""

from __future__ import annotations

import functools

from .base import MaskMod, mask_span, named, span_intersection, span_union


def _names(mods: tuple[MaskMod, ...]) -> str:
    return ",".join(m.__name__ for m in mods)


def and_masks(*mods: MaskMod) -> MaskMod:
    """Visible where every mask is visible."""
    if not mods:
        raise ValueError("and_masks needs at least one mask_mod")

    def and_mask(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    span = functools.reduce(span_intersection, (mask_span(m) for m in mods))
    return named(and_mask, f"and({_names(mods)})", span, {"masks": [m.__name__ for m in mods]})


def or_masks(*mods: MaskMod) -> MaskMod:
    """Visible where any mask is visible."""
    if not mods:
        raise ValueError("or_masks needs at least one mask_mod")

    def or_mask(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    span = functools.reduce(span_union, (mask_span(m) for m in mods))
    return named(or_mask, f"or({_names(mods)})", span, {"masks": [m.__name__ for m in mods]})


def not_mask(mod: MaskMod) -> MaskMod:
    """Visible where `mod` is not (including future keys: combine with a causal mask)."""

    def inverted(b, h, q_idx, kv_idx):
        return ~mod(b, h, q_idx, kv_idx)

    return named(inverted, f"not({mod.__name__})", None, {"mask": mod.__name__})
