"""Full causal attention computed by lcx: a control, equal to the unpatched model.

Every query sees every key up to itself at its true position: the `causal` mask, one
`lcx.attention` call. Decode rule: one window branch over every key (window None), no side
branch. Unbounded: no bounded cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from lcx.attention import AttentionSpec
from lcx.masks import causal_mask

from .base import AttentionMethod, DecodeRule, LastQueryKeys


@dataclass(frozen=True)
class Causal(AttentionMethod):
    """Full causal attention, computed by lcx (a control: equals the unpatched model)."""

    name: ClassVar[str] = "causal"
    examples = ({},)

    def _spec(self, scale):
        return AttentionSpec(mask=causal_mask, scale=scale)

    def last_query_keys(self, positions):
        return LastQueryKeys(None, positions)

    def decode_rule(self):
        return DecodeRule(window=None)

    def causal_up_to(self):
        return math.inf


def causal() -> Causal:
    return Causal()
