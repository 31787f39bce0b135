"""Self-Extend (arXiv 2401.01325, "LLM Maybe LongLM"): grouped attention beyond a neighbour window.

Training-free: tokens within `window` keys of the query keep their true relative distance;
farther tokens are scored with FLOOR-DIVIDED positions, so their distances grow `group_size`
times slower and stay inside the range the model was trained on. For query i and key j
(positions p_i, p_j; the official code's `group_size_1` = G, `group_size_2` = W):

    i - j <  W  (neighbours):  q rotated to p_i,                     k rotated to p_j
    i - j >= W  (grouped):     q rotated to floor(p_i / G) + W - W/G, k rotated to floor(p_j / G)

one softmax over all keys. The shift W - W/G makes the grouped distance continue from the
window: at i - j = W it is W (for G | W). Longest sequence whose distances all stay within a
trained context L: G * (L - W + floor(W / G)), i.e. (L - W) * G + W for G | W (`context_len`, the
default max_model_len of the engine and both servers). The paper's defaults: G in 2..16, W in 512..2048 (larger W, smaller G
keep more of the model's precision). Not implemented: the optional log-scaling of queries
(`scale_base`, off by default in the official code).

    ┌ keys ──────────────────────────────▶
    │ j <= i - W: grouped positions │ i - W < j <= i: true positions (window of W keys)
    query i

Reference: `self_extend_ref` (dense scores, one softmax). `SelfExtend.attend` computes the same
thing as two passes merged by their log-sum-exp (`lcx.attention.merge_attention`), each a shape
every backend runs natively:

    window pass   q, k at true positions, mask `sliding_window(left=W - 1)`, over all keys
    grouped pass  q, k at grouped positions, keys [0, Tk - W) under plain `causal`: with lcx's
                  window convention (queries are the last Tq of the keys), query index i maps
                  to mask index i - W, which sees exactly the keys j <= i - W.

Decode rule: a window branch of W keys; a side branch of every older key, stored rotated at
floor(p_k / G) (side_key), scored with the query at floor(p_q / G) + W - W / G (side_query).

Unbounded (every key stays visible): no bounded cache; keys are cached unrotated because the
grouped pass rotates them to other positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lcx.attention import AttentionSpec, Rotary, attention, merge_attention, soft_cap
from lcx.attention.rotary import table_dtype
from lcx.masks import causal_mask
from lcx.masks import sliding_window as sliding_window_mask
from lcx.masks.base import check_count
from lcx.rope import apply_rotary_ref, rope_cos_sin

from .base import AttentionMethod, DecodeRule, LastQueryKeys


def grouped_positions(pos: torch.Tensor, group_size: int, window: int, *, query: bool) -> torch.Tensor:
    """float64 positions of the grouped branch: floor(p / G) (+ W - W/G for queries)."""
    g = torch.div(pos.to(torch.int64), group_size, rounding_mode="floor").to(torch.float64)
    return g + (window - window / group_size) if query else g


def _rotate(x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """x `[B, T, H, D]` rotated to `positions` `[T]` or `[B, T]` (float64 angles, tables in
    `lcx.attention.rotary.table_dtype`, as every lcx.attention call rotates)."""
    cos, sin = rope_cos_sin(positions, rotary.inv_freq, rotary.attention_factor, table_dtype(x.dtype))
    return apply_rotary_ref(x, cos, sin)


def self_extend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rotary: Rotary, group_size: int,
                    window: int, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """The definition, densely: unrotated q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`, v -> `[B, Tq, H, Dv]`.

    Queries are the last Tq keys (`lcx.masks` convention); `rotary.positions` the keys' positions."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    pos = rotary.key_positions(Tk, q.device)  # [Tk] or [B, Tk]
    qpos = pos[..., Tk - Tq:]
    wide = torch.promote_types(q.dtype, torch.float32)

    def scores(qr, kr):  # [B, H, Tq, Tk]
        kr = kr.repeat_interleave(H // Hkv, dim=2)
        return torch.einsum("bqhd,bkhd->bhqk", qr.to(wide), kr.to(wide))

    near = scores(_rotate(q, qpos, rotary), _rotate(k, pos, rotary))
    far = scores(_rotate(q, grouped_positions(qpos, group_size, window, query=True), rotary),
                 _rotate(k, grouped_positions(pos, group_size, window, query=False), rotary))
    i = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]
    j = torch.arange(Tk, device=q.device)[None, :]
    s = soft_cap(torch.where(i - j < window, near, far) * (scale if scale is not None else D ** -0.5), softcap)
    s = s.masked_fill(j > i, float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(H // Hkv, dim=2).to(wide))
    return out.to(v.dtype)


@dataclass(frozen=True)
class SelfExtend(AttentionMethod):
    """Self-Extend (arXiv 2401.01325): true positions within `window` keys (the query itself
    included), positions floor-divided by `group_size` beyond. See the module docstring."""

    name: ClassVar[str] = "self_extend"
    needs_unrotated_keys: ClassVar[bool] = True
    examples = ({"group_size": 2, "window": 4}, {"group_size": 3, "window": 5})
    group_size: int
    window: int

    def __post_init__(self) -> None:
        check_count("group_size", self.group_size, 1)
        check_count("window", self.window, 1)

    def attend(self, q, k, v, *, rotary, backend="blockwise", scale=None, layer_idx=None, softcap=None):
        Tq, Tk = q.shape[1], k.shape[1]
        W = self.window
        near, lse_near = attention(q, k, v, AttentionSpec(mask=sliding_window_mask(left=W - 1), scale=scale,
                                                          softcap=softcap),
                                   backend=backend, rotary=rotary, return_lse=True)
        first = max(0, W - (Tk - Tq))  # the first query (of Tq) with a key W or more behind it
        if first >= Tq:  # no query reaches beyond its window
            return near
        pos = rotary.key_positions(Tk, q.device)
        qpos = pos[..., Tk - Tq + first:]
        kpos = pos[..., : Tk - W]
        qg = _rotate(q[:, first:], grouped_positions(qpos, self.group_size, W, query=True), rotary)
        kg = _rotate(k[:, : Tk - W], grouped_positions(kpos, self.group_size, W, query=False), rotary)
        far, lse_far = attention(qg, kg, v[:, : Tk - W], AttentionSpec(mask=causal_mask, scale=scale, softcap=softcap),
                                 backend=backend, return_lse=True)
        B, _, H, Dv = near.shape
        if first:  # queries without grouped keys: an empty pass (o = 0, lse = -inf)
            far = torch.cat((far.new_zeros(B, first, H, Dv), far), 1)
            lse_far = torch.cat((lse_far.new_full((B, H, first), float("-inf")), lse_far), 2)
        out, _ = merge_attention(near, lse_near, far, lse_far)
        return out

    def last_query_keys(self, positions):
        # keys W or more behind the query: q at gq(p_i), k at gk(p_j), i.e. k moved to
        # p_i - (gq(p_i) - gk(p_j)) against the query at p_i (float positions)
        Tk = positions.shape[-1]
        near = torch.arange(Tk, device=positions.device) > Tk - 1 - self.window
        p = positions.to(torch.float64)
        gq = grouped_positions(positions[..., -1:], self.group_size, self.window, query=True)
        far = p[..., -1:] - (gq - grouped_positions(positions, self.group_size, self.window, query=False))
        return LastQueryKeys(None, torch.where(near, p, far))

    def decode_rule(self):
        # grouped keys stored rotated at floor(p / G), once; the query at gq(p_q) for them
        G, W = self.group_size, self.window
        return DecodeRule(window=W, side=None,
                          side_key=lambda p: grouped_positions(p, G, W, query=False),
                          side_query=lambda p: grouped_positions(p, G, W, query=True))

    def causal_up_to(self):
        # every key inside the neighbour window: no grouped pass
        return self.window

    def context_len(self, trained):
        # The largest scored distance is the grouped one to key 0: gq(p) - gk(0) = floor(p / G)
        # + W - W/G, within the trained distances (<= L - 1) while floor(p / G) <= L - 1 - W +
        # floor(W / G), i.e. for p < G * (L - W + floor(W / G)): that many tokens, (L - W) * G + W
        # when G divides W (the paper's reach). The neighbours' distances (< W) need W <= L.
        L, G, W = int(trained), self.group_size, self.window
        reach = G * (L - W + W // G) if W <= L else 0
        return reach if reach > L else None

    def _spec(self, scale):
        raise NotImplementedError("self_extend is two attention calls (see SelfExtend.attend), not one spec")

    def _call_specs(self):
        return (AttentionSpec(mask=sliding_window_mask(left=self.window - 1)), AttentionSpec(mask=causal_mask))


def self_extend(group_size: int, window: int) -> SelfExtend:
    return SelfExtend(group_size, window)
