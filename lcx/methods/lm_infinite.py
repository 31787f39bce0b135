"""LM-Infinite (arXiv 2308.16137, "LM-Infinite: Zero-Shot Extreme Length Generalization").

`lm_infinite(G, L, limit)`: the Λ-mask, G global keys (the first G) + a window of L local keys
(the query's own included); global keys outside the window are scored at distance
min(limit, Tk - 1) (default limit L): the query rotated to that distance, the key to 0.
`lcx.attention.lambda_attention_ref` defines it; `top_k=5` adds the paper's top-k middle keys
for the last query of each call (`lcx.attention.lambda_topk_attention_ref`).

Decode rule: a window branch of L keys; a side branch of the G global keys, stored rotated at
position 0 (side_key 0), scored with the query at min(limit, p_q) (side_query: the distance
cap). With top_k: the k best middle keys, stored like the global keys (rotated at 0), scored
with the query at top_k_insert_at. Bounded (`cache_window = (G, L)`) without top_k when
limit <= G + L - 1 (`check_bounded`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from lcx.attention import AttentionSpec, LambdaParams, lambda_topk_attention_ref
from lcx.masks.base import check_count

from .base import AttentionMethod, DecodeRule, LastQueryKeys


@dataclass(frozen=True)
class LMInfinite(AttentionMethod):
    """LM-Infinite (arXiv 2308.16137): G global + L local keys, global distance capped.

    n_global: first keys every query sees (paper: 10-100 behave alike).
    n_local:  window of keys, the query itself included (paper: the pretraining length).
    limit_distance: distance at which global keys outside the window are scored (default
        n_local); the query is rotated to min(limit_distance, Tk - 1), global keys to 0.

    Top-k middle keys (the paper's passkey/Qasper runs, `--top_k_attention 5 --top_k_from_layer 4`
    of Glaciohound/LM-Infinite `models/llama.py`); off when top_k = 0 (the default):
    top_k:            k. In layers top_k_from_layer <= layer < top_k_to_layer, the LAST query of
                      each call (the last prompt token of a prefill, every decode step; no other
                      row) also sees, per query head, the k middle keys j in [n_global, i - n_local
                      + 1) (those the Λ-mask hides from query i) scoring highest with the query
                      rotated to top_k_insert_at and the key to 0; their logits are those scores,
                      in one softmax with the Λ keys (`lcx.attention.lambda_topk_attention_ref`).
                      Fewer than k middle keys: the plain Λ row.
    top_k_from_layer: first layer (0-based) that does it (official default 4).
    top_k_to_layer:   first layer that no longer does (default None: every layer after; the
                      official default is 1000).
    top_k_insert_at:  the distance every middle key is scored at (default n_local // 2: the
                      official default is 2048 with a 4096-key window).
    With top_k > 0 the cache keeps every key (`cache_window` None: any middle key can be
    chosen, so memory grows with the sequence as full attention's), `attend` needs `layer_idx`,
    and the last query is not a fixed-subset softmax (`last_query_keys`/`query_keys` None).
    Calls cut differently (chunked prefill) give the top-k to different rows, as in the
    official code.
    """

    name: ClassVar[str] = "lm_infinite"
    needs_unrotated_keys: ClassVar[bool] = True
    examples = (
        {"n_global": 3, "n_local": 5},
        {"n_global": 2, "n_local": 4, "limit_distance": 3},  # the cap inside the window
        {"n_global": 2, "n_local": 4, "limit_distance": 9},  # the cap past G + L - 1: no bounded cache
        {"n_global": 0, "n_local": 4},  # no global keys: a sliding window
        # top-k middle keys in every layer (an odd cap and insert position), and from layer 1 on
        {"n_global": 1, "n_local": 3, "limit_distance": 2, "top_k": 3, "top_k_from_layer": 0, "top_k_insert_at": 5},
        {"n_global": 2, "n_local": 4, "top_k": 2, "top_k_from_layer": 1, "top_k_insert_at": 3},
    )
    n_global: int
    n_local: int
    limit_distance: int | None = None
    top_k: int = 0
    top_k_from_layer: int = 4
    top_k_to_layer: int | None = None
    top_k_insert_at: int | None = None

    def __post_init__(self) -> None:
        # One validation for LM-Infinite's parameters: lcx.attention.LambdaParams.
        lp = LambdaParams(self.n_global, self.n_local, self.limit_distance)
        object.__setattr__(self, "limit_distance", lp.limit_distance)
        check_count("top_k", self.top_k, 0)
        check_count("top_k_from_layer", self.top_k_from_layer, 0)
        if self.top_k_to_layer is not None:
            check_count("top_k_to_layer", self.top_k_to_layer, self.top_k_from_layer + 1)
        if self.top_k_insert_at is None:
            object.__setattr__(self, "top_k_insert_at", self.n_local // 2)
        check_count("top_k_insert_at", self.top_k_insert_at, 0)
        if not self.top_k:
            unused = [f.name for f in dataclasses.fields(self)
                      if f.name.startswith("top_k_") and getattr(self, f.name) != self._default(f)]
            if unused:
                raise ValueError(f"lm_infinite: {unused} set but top_k = 0 (top-k middle keys off)")

    def _default(self, f):
        # None means n_local (the cap) and n_local // 2 (the top-k insert position)
        if f.name == "limit_distance":
            return self.n_local
        return self.n_local // 2 if f.name == "top_k_insert_at" else f.default

    def top_k_in_layer(self, layer_idx: int | None) -> bool:
        """Whether the last query of a call in layer `layer_idx` gets the top-k middle keys."""
        if not self.top_k:
            return False
        if layer_idx is None:
            raise ValueError("lm_infinite with top_k > 0 differs per layer: attend() needs layer_idx "
                             f"(top-k in layers [{self.top_k_from_layer}, {self.top_k_to_layer}))")
        return self.top_k_from_layer <= layer_idx and (self.top_k_to_layer is None or layer_idx < self.top_k_to_layer)

    def attend(self, q, k, v, *, rotary, backend="blockwise", scale=None, layer_idx=None, softcap=None):
        out = super().attend(q, k, v, rotary=rotary, backend=backend, scale=scale, softcap=softcap)  # Λ, every row
        if not self.top_k_in_layer(layer_idx):
            return out
        # the last row again, with its top-k middle keys: one row, dense (O(Tk) work)
        last = lambda_topk_attention_ref(
            q[:, -1:], k, v, rotary=rotary, n_global=self.n_global, n_local=self.n_local,
            limit_distance=self.limit_distance, top_k=self.top_k, top_k_insert_at=self.top_k_insert_at,
            scale=scale, softcap=softcap)  # [B, 1, H, Dv]
        return torch.cat((out[:, :-1], last.to(out.dtype)), dim=1)

    @property
    def call_dependence(self):
        # a query i with a global key outside its window (i >= n_local) is scored at the cap
        # min(limit, Tk - 1) of its call: independent of Tk >= i + 1 iff limit <= n_local
        if self.n_global and self.limit_distance > self.n_local:
            return (f"lm_infinite's cap min(limit_distance={self.limit_distance}, Tk - 1) follows the call's "
                    f"length for queries before position {self.limit_distance} (limit_distance > n_local)")
        return None

    @property
    def last_query_extra(self):
        return bool(self.top_k)

    def _spec(self, scale):
        return AttentionSpec.lm_infinite(self.n_global, self.n_local, self.limit_distance, scale=scale)

    def causal_up_to(self):
        # every key in the window, at its true distance: no global key is capped, no middle key exists
        return self.n_local

    @property
    def cache_window(self):
        return None if self.top_k else (self.n_global, self.n_local)

    def decode_rule(self):
        # global keys stored unrotated (position 0), scored with the query at the cap
        # d = min(limit, p_q) (on a contiguous history Tk - 1 = p_q); with top_k, the middle
        # keys are stored the same way and scored with the query at top_k_insert_at
        limit = self.limit_distance
        top = dict(top_k=self.top_k, top_k_query=float(self.top_k_insert_at),
                   top_k_layers=(self.top_k_from_layer, self.top_k_to_layer)) if self.top_k else {}
        return DecodeRule(window=self.n_local, side=self.n_global, side_key=torch.zeros_like,
                          side_query=lambda p: torch.clamp(p, max=limit), **top)

    def last_query_keys(self, positions):
        keys = self.query_keys(positions, 1)
        return None if keys is None else LastQueryKeys(keys.visible[..., 0, :], keys.key_positions[..., 0, :])

    def query_keys(self, positions, n_queries):
        if self.top_k:
            return None  # which middle keys the last query sees depends on the scores
        # local keys (the last n_local up to the query) at their positions; global keys outside
        # the window are scored with the query at d = min(limit, Tk - 1) of the whole call (not
        # of its own prefix) and the key at 0: relative rotation -d
        Tk = positions.shape[-1]
        i = torch.arange(Tk - n_queries, Tk, device=positions.device)[:, None]  # [Tq, 1]
        j = torch.arange(Tk, device=positions.device)  # [Tk]
        local = (j <= i) & (j > i - self.n_local)
        glob = (j < self.n_global) & (j <= i) & ~local
        d = LambdaParams(self.n_global, self.n_local, self.limit_distance).effective_limit(Tk)
        p = positions[..., None, :]  # [B, 1, Tk]
        p_query = positions[..., Tk - n_queries:, None]  # [B, Tq, 1]
        eff = torch.where(glob, p_query - d, p)
        return LastQueryKeys((local | glob).expand_as(eff), eff)

    def check_bounded(self) -> None:
        if self.top_k:
            raise ValueError("lm_infinite with top_k > 0 may pick any middle key: it has no bounded cache")
        # The global branch rotates the query to min(limit_distance, Tk - 1). A compressed
        # cache has Tk <= n_global + n_local, so it reproduces the full cache only if the cap
        # never exceeds n_global + n_local - 1 (no global keys: nothing is capped).
        cap = self.n_global + self.n_local - 1
        if self.n_global > 0 and self.limit_distance > cap:
            raise ValueError(
                f"limit_distance={self.limit_distance} > n_global + n_local - 1 = {cap}: with a bounded "
                f"cache the capped distance min(limit_distance, Tk - 1) would depend on evicted keys; "
                f"use limit_distance <= {cap} (default n_local) or a full cache")


def lm_infinite(n_global: int, n_local: int, limit_distance: int | None = None, *, top_k: int = 0,
                top_k_from_layer: int = 4, top_k_to_layer: int | None = None,
                top_k_insert_at: int | None = None) -> LMInfinite:
    """LM-Infinite; `top_k > 0` adds the paper's top-k middle keys (see `LMInfinite`)."""
    return LMInfinite(n_global, n_local, limit_distance, top_k, top_k_from_layer, top_k_to_layer, top_k_insert_at)
