"""StreamingLLM (arXiv 2309.17453, "Efficient Streaming Language Models with Attention Sinks").

`sinks(S, w)`: S sink keys (the first S) + a window of w keys, positions renumbered as
StreamingLLM's cache does: a query sees the sinks as if they sat just before its window
(`lcx.methods.streaming` defines it over a whole sequence). `sinks(S, w, renumber=False)` is the
bare `lcx.masks.attention_sinks` mask at true positions (no renumbering).

Decode rule: a window branch of w keys; a side branch of the S sinks, stored rotated at their own
position (side_key p_k: a sink's slot index is its position, p < S), scored with the query at
min(p_q, S + w - 1), the last slot of the full compressed cache (renumbered), or at p_q (bare).
Bounded: `cache_window = (S, w)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lcx.attention import AttentionSpec
from lcx.masks import attention_sinks
from lcx.masks.base import check_count

from .base import AttentionMethod, DecodeRule, LastQueryKeys
from .streaming import streaming_attention


@dataclass(frozen=True)
class Sinks(AttentionMethod):
    """StreamingLLM (arXiv 2309.17453): `n_sink` first keys + a window of `window` keys.

    renumber=True (StreamingLLM): positions are renumbered inside the cache, so a query sees
        the sinks as if they sat just before its window (`lcx.methods.streaming`).
    renumber=False: the bare `attention_sinks(n_sink, window - 1)` mask at true positions
        (distances to the sinks grow without bound).
    """

    name: ClassVar[str] = "sinks"
    needs_unrotated_keys: ClassVar[bool] = True
    examples = ({"n_sink": 2, "window": 3}, {"n_sink": 2, "window": 3, "renumber": False},
                {"n_sink": 0, "window": 5})
    n_sink: int
    window: int
    renumber: bool = True

    def __post_init__(self) -> None:
        check_count("n_sink", self.n_sink, 0)
        check_count("window", self.window, 1)
        if not isinstance(self.renumber, bool):
            raise ValueError(f"renumber must be a bool, got {self.renumber!r}")

    @property
    def renumber_in_cache(self) -> bool:  # type: ignore[override]
        return self.renumber

    def _spec(self, scale):
        return AttentionSpec(mask=attention_sinks(self.n_sink, self.window - 1), scale=scale)

    def attend(self, q, k, v, *, rotary, backend="blockwise", scale=None, layer_idx=None, softcap=None):
        if not self.renumber:
            return super().attend(q, k, v, rotary=rotary, backend=backend, scale=scale, softcap=softcap)
        return streaming_attention(q, k, v, rotary=rotary, n_sink=self.n_sink, window=self.window,
                                   backend=backend, scale=scale, softcap=softcap)

    def last_query_keys(self, positions):
        # query i = Tk - 1; window keys j > i - w at their positions; sinks j < S outside the
        # window: renumbered, the query at p[c], c = min(i, S + w - 1) (`lcx.methods.streaming`)
        Tk = positions.shape[-1]
        i = Tk - 1
        j = torch.arange(Tk, device=positions.device)
        window = j > i - self.window
        sink = (j < self.n_sink) & ~window
        eff = positions
        if self.renumber:
            shift = positions[..., i:] - positions[..., min(i, self.n_sink + self.window - 1)][..., None]
            eff = torch.where(sink, positions + shift, positions)
        return LastQueryKeys((window | sink).expand_as(positions), eff)

    def decode_rule(self):
        # renumbered: a sink keeps its slot index (= its position, p < S) and the query sits at
        # slot min(p_q, S + w - 1), the last slot of the full compressed cache
        last = self.n_sink + self.window - 1
        query = (lambda p: torch.clamp(p, max=last)) if self.renumber else (lambda p: p)
        return DecodeRule(window=self.window, side=self.n_sink, side_key=lambda p: p, side_query=query)

    def causal_up_to(self):
        # every key is a sink or in the window; nothing evicted, so renumbered positions are the true ones
        return self.n_sink + self.window

    @property
    def cache_window(self):
        return (self.n_sink, self.window)


def sinks(n_sink: int, window: int, renumber: bool = True) -> Sinks:
    return Sinks(n_sink, window, renumber)
