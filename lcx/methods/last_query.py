"""The last query of a call, fast: decode steps as one plain softmax attention per layer.

A decode step asks one query per sequence. For every method but SWAT, that query's attention is
plain softmax attention over a subset of the keys, each key rotated to some position
(`AttentionMethod.last_query_keys`: a branch that moves the *query* — LM-Infinite's capped
distance, StreamingLLM's renumbered sinks, Self-Extend's grouped positions — moves the key by
the same relative amount instead). Only relative rotations matter, so the query stays unrotated
and each key is rotated by (its position - the query's): one rotation of the keys, then one
`scaled_dot_product_attention` call with a key mask, instead of the method's general path (two
passes merged by log-sum-exp, or a doubled head dim) built for many queries.

    plan = LastQueryPlan.build(method, rotary, n_keys=Tk, batch=B)   # once per step
    out = plan.attend(q, k, v, scale=scale)                          # every layer sharing the rotary

The tables depend only on the step's positions, so a caller that runs many layers with the same
rotary (the vLLM plugin's decode step) builds the plan once. Rotation uses float64 angles rounded
to tables in max(float32, input dtype), applied in that dtype — equal to `method.attend` within
the tolerances of `lcx.testing` (tests/methods/test_last_query.py), not bit-identical to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lcx.attention import Rotary, sdpa
from lcx.attention.rotary import table_dtype
from lcx.rope import rope_cos_sin

from .base import AttentionMethod


@dataclass(frozen=True)
class LastQueryPlan:
    """Rotation tables and key mask of one step's last queries (see the module docstring)."""

    k_cos: torch.Tensor  # [B, Tk, 1, r]  (head axis for broadcasting), scaled by attention_factor^2
    k_sin: torch.Tensor  # [B, Tk, 1, r]  sign-folded: [-sin | sin] (see `_rotate`)
    mask: torch.Tensor | None  # [B, 1, 1, Tk] bool (True: attend), None: every key

    @classmethod
    def build(cls, method: AttentionMethod, rotary: Rotary, *, n_keys: int, batch: int,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> LastQueryPlan | None:
        """None if the method's last query is not plain softmax attention (then use `attend`).
        `dtype`: the inputs' dtype; tables are in `lcx.attention.rotary.table_dtype(dtype)`."""
        pos = rotary.key_positions(n_keys, torch.device(device))
        pos = pos.expand(batch, n_keys) if pos.dim() == 1 else pos
        keys = method.last_query_keys(pos)
        if keys is None:
            return None
        # the query stays unrotated: a.R(p_q)q . a.R(p_k)k = q . a^2 R(p_k - p_q)k
        rel = keys.key_positions - pos[:, -1:]
        k_cos, k_sin = _tables(rel, rotary.inv_freq.to(device), rotary.attention_factor ** 2, table_dtype(dtype))
        mask = None
        if keys.visible is not None and not bool(keys.visible.all()):
            mask = keys.visible[:, None, None, :]
        return cls(k_cos, k_sin, mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """UNROTATED q `[B, 1, H, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]` -> `[B, 1, H, Dv]`.
        `softcap`: the model's attention-logit soft-capping (Gemma 2) on every scaled logit."""
        wide = torch.promote_types(q.dtype, self.k_cos.dtype)
        kr = _rotate(k.to(wide), self.k_cos, self.k_sin).transpose(1, 2)  # [B, Hkv, Tk, D], relative to q
        out = sdpa(q.to(wide).transpose(1, 2), kr, v.to(wide).transpose(1, 2), attn_mask=self.mask, scale=scale,
                   softcap=softcap)
        return out.transpose(1, 2).to(v.dtype)


@dataclass(frozen=True)
class RelativeKeys:
    """Which keys each of a call's last Tq queries sees and at what relative position, as rows of
    small rotation tables (what `lcx.kernels.cpu.paged_relative_attention_cpu` reads).

    index: `[Bd, Tq, Tk]` int64, the table row of (query, key), -1 where not visible
           (Bd = 1: shared by every request of the call, else one per request);
    cos:   `[U, r/2]` cos of the angles of each distinct relative position (key - query), one
           per rotary pair (the halves of `rope_cos_sin`'s tables are equal), x attention_factor^2;
    sin:   `[U, r/2]` sin of the same.
    """

    index: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(cls, method: AttentionMethod, rotary: Rotary, *, n_keys: int, n_queries: int = 1,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> RelativeKeys | None:
        """From `method.query_keys` (None where the method is not plain softmax attention).
        Rotary positions `[Tk]` (or None: 0..Tk-1) give Bd = 1, `[B, Tk]` give Bd = B."""
        pos = rotary.key_positions(n_keys, torch.device(device))
        pos = pos[None] if pos.dim() == 1 else pos  # [Bd, Tk]
        keys = method.query_keys(pos, n_queries)
        if keys is None:
            return None
        rel = keys.key_positions - pos[:, n_keys - n_queries:, None]  # [Bd, Tq, Tk]
        visible = torch.ones_like(rel, dtype=torch.bool) if keys.visible is None else keys.visible
        cos, sin, inverse = _distinct_cos_sin(rel[visible], rotary.inv_freq.to(device),
                                              rotary.attention_factor ** 2, table_dtype(dtype))
        index = torch.full(rel.shape, -1, dtype=torch.long, device=rel.device)
        index[visible] = inverse
        h = sin.shape[-1] // 2
        return cls(index, cos[:, :h].contiguous(), sin[:, :h].contiguous())


def _distinct_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, af: float, dtype: torch.dtype):
    """`rope_cos_sin` `[U, r]` of the distinct values of `positions` and, per entry of
    `positions`, its row. A step's relative positions repeat across rows (every full compressed
    cache has its keys at the same distances from its query), so the trigonometry runs on the
    distinct ones only: elementwise per position, hence bit-identical to the direct tables."""
    uniq, inverse = torch.unique(positions, return_inverse=True)
    cos, sin = rope_cos_sin(uniq, inv_freq, af, dtype)
    return cos, sin, inverse


def _tables(positions: torch.Tensor, inv_freq: torch.Tensor, af: float, dtype: torch.dtype):
    """cos and sign-folded sin `[B, T, 1, r]`: sin_signed = [-sin(a) | sin(a)] for the halves."""
    cos, sin, index = _distinct_cos_sin(positions, inv_freq, af, dtype)  # [U, r], [B, T]
    h = sin.shape[-1] // 2
    sin_signed = torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)
    return cos[index].unsqueeze(-2), sin_signed[index].unsqueeze(-2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`lcx.rope.apply_rotary_ref` in two fused ops: x*cos + swap_halves(x)*sin_signed (rotary
    dim r = cos.shape[-1]; channels past r pass through)."""
    r = cos.shape[-1]
    xr = x[..., :r]
    h = r // 2
    out = torch.addcmul(xr * cos, torch.cat((xr[..., h:], xr[..., :h]), dim=-1), sin_signed)
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)


def attend_last_query(method: AttentionMethod, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      rotary: Rotary, scale: float | None = None, layer_idx: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """`method.attend(q, k, v, ...)` for one query per row (Tq = 1), through `LastQueryPlan` where
    the method allows it (else `attend` itself, given `layer_idx` for methods that differ per layer);
    `softcap`: the model's attention-logit soft-capping, in either route."""
    if q.shape[1] != 1:
        raise ValueError(f"attend_last_query takes one query per row, got Tq={q.shape[1]}")
    plan = LastQueryPlan.build(method, rotary, n_keys=k.shape[1], batch=q.shape[0], device=q.device, dtype=q.dtype)
    if plan is None:
        return method.attend(q, k, v, rotary=rotary, scale=scale, layer_idx=layer_idx, softcap=softcap)
    return plan.attend(q, k, v, scale=scale, softcap=softcap)


__all__ = ["LastQueryPlan", "RelativeKeys", "attend_last_query"]
