"""A causal sliding window of w keys, the query itself included.

The `lcx.masks.sliding_window(left=w - 1)` mask at true positions, one `lcx.attention` call.
Decode rule: a window branch of w keys, no side branch. Bounded: a query sees only the last w
keys (`cache_window = (0, w)`), so a cache of w - 1 keys per layer decodes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lcx.attention import AttentionSpec
from lcx.masks import sliding_window as sliding_window_mask
from lcx.masks.base import check_count

from .base import AttentionMethod, DecodeRule, LastQueryKeys


@dataclass(frozen=True)
class SlidingWindow(AttentionMethod):
    """Causal sliding window of `window` keys, the query itself included."""

    name: ClassVar[str] = "sliding_window"
    examples = ({"window": 4}, {"window": 1})
    window: int

    def __post_init__(self) -> None:
        check_count("window", self.window, 1)

    def _spec(self, scale):
        return AttentionSpec(mask=sliding_window_mask(left=self.window - 1), scale=scale)

    def causal_up_to(self):
        return self.window

    def last_query_keys(self, positions):
        Tk = positions.shape[-1]
        visible = torch.arange(Tk, device=positions.device) >= Tk - self.window
        return LastQueryKeys(visible.expand_as(positions), positions)

    def decode_rule(self):
        return DecodeRule(window=self.window)

    @property
    def cache_window(self):
        return (0, self.window)


def sliding_window(*, window: int) -> SlidingWindow:
    """`window` keys, the query included (keyword-only: the mask `lcx.masks.sliding_window(left=...)`
    counts the keys before the query)."""
    return SlidingWindow(window)
