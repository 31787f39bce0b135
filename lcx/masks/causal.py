"""Causal mask: query i sees every key j <= i."""

from __future__ import annotations

from .base import KeySpan, MaskMod, named


def causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


named(causal_mask, "causal", KeySpan(0, None), {}, exact=True)


def causal() -> MaskMod:
    """Factory form of `causal_mask` (the registry holds factories)."""
    return causal_mask
