"""What an attention call computes: `AttentionSpec` (the method) and `Rotary` (per-call RoPE).

Layout (lcx-wide): q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]`, H % Hkv == 0.
GQA: query head h reads kv head `h // (H // Hkv)` (the `repeat_interleave` convention of HF).
Query t sits at mask index `q_offset + t`, `q_offset = Tk - Tq` by default (see `lcx.masks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from lcx.masks import MaskMod, causal_mask, lambda_mask, sliding_window
from lcx.masks.base import check_count, default_q_offset

ACTIVATIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class LambdaParams:
    """LM-Infinite (arXiv 2308.16137): Λ-mask plus a distance cap for the global keys.

    `limit_distance` defaults to `n_local`. As in the official code, every global key outside
    the local window is scored at the same distance `min(limit_distance, Tk - 1)`.
    """

    n_global: int
    n_local: int
    limit_distance: int | None = None

    def __post_init__(self) -> None:
        check_count("n_global", self.n_global, 0)
        check_count("n_local", self.n_local, 1)
        if self.limit_distance is None:
            object.__setattr__(self, "limit_distance", self.n_local)
        check_count("limit_distance", self.limit_distance, 0)

    def effective_limit(self, n_keys: int) -> int:
        return min(self.limit_distance, max(n_keys - 1, 0))


@dataclass(frozen=True)
class AttentionSpec:
    """The method of an attention call; backends take it unchanged.

    mask:          mask_mod (`lcx.masks`), or None for no mask.
    activation:    "softmax", or "sigmoid" (SWAT: o_i = sum_j sigmoid(s_ij) v_j, no
                   normalisation).
    alibi_slopes:  per-head slopes m_h; the logit gets `-m_h * |i - j|` (flash-attn's
                   `alibi_slopes` convention: m > 0 penalises distance, m < 0 favours it).
                   Schedules: `lcx.attention.alibi`.
    scale:         logit scale, default 1/sqrt(D).
    lambda_params: LM-Infinite distance cap; then q/k arrive unrotated with a `Rotary`, and
                   `mask` must be `lambda_mask(n_global, n_local)` (use `lm_infinite()`).
    softcap:       attention-logit soft-capping (Gemma 2): the scaled logit s = scale * q.k
                   becomes `softcap * tanh(s / softcap)` before the ALiBi bias, the mask and
                   the activation (transformers' and flash-attn's order); None: none.
    """

    mask: MaskMod | None = causal_mask
    activation: str = "softmax"
    alibi_slopes: tuple[float, ...] | None = None
    scale: float | None = None
    lambda_params: LambdaParams | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}; known: {list(ACTIVATIONS)}")
        if self.alibi_slopes is not None:
            slopes = tuple(float(s) for s in _as_list(self.alibi_slopes))
            if not slopes or not all(math.isfinite(s) for s in slopes):
                raise ValueError(f"alibi_slopes must be finite and non-empty, got {slopes}")
            object.__setattr__(self, "alibi_slopes", slopes)
        if self.scale is not None and not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"scale must be positive and finite, got {self.scale}")
        if self.softcap is not None:
            if isinstance(self.softcap, bool) or not (float(self.softcap) > 0 and math.isfinite(self.softcap)):
                raise ValueError(f"softcap must be positive and finite (or None), got {self.softcap}")
            object.__setattr__(self, "softcap", float(self.softcap))
        lp = self.lambda_params
        if lp is not None:
            want = f"lambda_{lp.n_global}_{lp.n_local}"
            if self.mask is None or self.mask.__name__ != want:
                got = None if self.mask is None else self.mask.__name__
                raise ValueError(
                    f"lambda_params needs mask={want} (got {got}); build with AttentionSpec.lm_infinite"
                )
            if self.alibi_slopes is not None:
                raise ValueError("alibi_slopes with lambda_params is not defined (distance is capped)")

    @classmethod
    def lm_infinite(
        cls, n_global: int, n_local: int, limit_distance: int | None = None, **kw: Any
    ) -> "AttentionSpec":
        lp = LambdaParams(n_global, n_local, limit_distance)
        return cls(mask=lambda_mask(n_global, n_local), lambda_params=lp, **kw)

    @classmethod
    def swat(cls, window: int, n_heads: int, **kw: Any) -> "AttentionSpec":
        """SWAT (arXiv 2502.18845): sigmoid, a window of `window` keys, balanced ALiBi."""
        from .alibi import balanced_alibi_slopes

        check_count("window", window, 1)
        if "alibi_slopes" not in kw:  # (not setdefault: the balanced default needs an even head count)
            kw["alibi_slopes"] = balanced_alibi_slopes(n_heads)
        return cls(mask=sliding_window(left=window - 1), activation="sigmoid", **kw)

    @property
    def name(self) -> str:
        parts = ["full" if self.mask is None else self.mask.__name__, self.activation]
        if self.alibi_slopes is not None:
            parts.append(f"alibi{len(self.alibi_slopes)}")
        if self.lambda_params is not None:
            parts.append(f"cap{self.lambda_params.limit_distance}")
        if self.softcap is not None:
            parts.append(f"softcap{self.softcap:g}")
        return "-".join(parts)


def _as_list(x: Any) -> Sequence[Any]:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().tolist()
    return list(x)


@dataclass(frozen=True, eq=False)
class Rotary:
    """RoPE applied inside the call: q and k arrive unrotated.

    inv_freq:         `[r/2]` (from `lcx.rope.compute_inv_freq`).
    positions:        rotary positions of the keys, `[Tk]` or `[B, Tk]`; default `arange(Tk)`.
                      The query at mask index i is the token at key index i and takes
                      `positions[i]` (so `q_offset + Tq <= Tk`).
    attention_factor: scales cos and sin (logits by its square), as in `lcx.rope`.
    """

    inv_freq: torch.Tensor
    positions: torch.Tensor | None = None
    attention_factor: float = 1.0

    def key_positions(self, n_keys: int, device: torch.device) -> torch.Tensor:
        if self.positions is None:
            return torch.arange(n_keys, device=device)
        if self.positions.shape[-1] != n_keys:
            raise ValueError(f"rotary positions {tuple(self.positions.shape)} do not match Tk={n_keys}")
        return self.positions.to(device)


@dataclass(frozen=True)
class CallInfo:
    """Facts about the tensors of one call that decide whether a backend can run it."""

    device_type: str
    dtype: torch.dtype
    requires_grad: bool
    return_lse: bool
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_queries: int
    n_keys: int
    q_offset: int
    rotary: bool = False

    @classmethod
    def from_call(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        q_offset: int | None = None,
        rotary: Rotary | None = None,
        return_lse: bool = False,
    ) -> "CallInfo":
        return cls(
            device_type=q.device.type,
            dtype=q.dtype,
            requires_grad=torch.is_grad_enabled()
            and any(t.requires_grad for t in (q, k, v)),
            return_lse=return_lse,
            n_heads=q.shape[2],
            n_kv_heads=k.shape[2],
            head_dim=q.shape[3],
            n_queries=q.shape[1],
            n_keys=k.shape[1],
            q_offset=default_q_offset(q.shape[1], k.shape[1], q_offset),
            rotary=rotary is not None,
        )


def check_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    q_offset: int | None,
    rotary: Rotary | None,
) -> int:
    """Validate shapes; return the resolved q_offset."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    (B, Tq, H, D), (Bk, Tk, Hkv, Dk) = q.shape, k.shape
    if Bk != B or v.shape[0] != B or Dk != D or v.shape[1] != Tk or v.shape[2] != Hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not agree")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} kv heads")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k, v must share dtype and device")
    if spec.alibi_slopes is not None and len(spec.alibi_slopes) != H:
        raise ValueError(f"{len(spec.alibi_slopes)} alibi slopes for {H} heads")
    off = default_q_offset(Tq, Tk, q_offset)
    if spec.lambda_params is not None and rotary is None:
        raise ValueError("an LM-Infinite spec needs rotary= (q and k arrive unrotated)")
    if rotary is not None and off + Tq > Tk:
        raise ValueError(f"with rotary, queries must be keys: q_offset + Tq = {off + Tq} > Tk = {Tk}")
    return off


def scale_of(spec: AttentionSpec, head_dim: int) -> float:
    return spec.scale if spec.scale is not None else 1.0 / math.sqrt(head_dim)


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Scaled logits soft-capped (`AttentionSpec.softcap`): `softcap * tanh(scores / softcap)`,
    or `scores` as they are when `softcap` is None. The one statement of the cap, for every
    backend and decode path written in PyTorch."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
         scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """torch's `scaled_dot_product_attention` (q `[B, H, Tq, D]`, k/v `[B, Hkv, Tk, D]`, a bool
    `attn_mask` True where a key is seen, grouped-query heads when Hkv < H) with the scaled logits
    soft-capped (`soft_cap`). Without a cap torch's fused kernel; with one, scores and softmax in
    the inputs' dtype (torch's kernels have no cap). Every visible row needs a visible key."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale,
                                                                enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = soft_cap(torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5), softcap)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)
