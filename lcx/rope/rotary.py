"""Rotary tables and the reference rotation.

Layout, stated once for all of lcx: activations are `[B, T, H, D]` (batch, time, heads, head
dim). Rotary pairs follow the Hugging Face / GPT-NeoX "rotate half" convention: channel i is
paired with channel i + r/2 (r = rotary dim), both turned by angle `pos * inv_freq[i]`.
Channels r..D-1 (partial rotary) pass through unchanged. Tables are `[..., T, r]` with the
half-table repeated: `cos = cat(cos(angle), cos(angle))`.

Precision: angles are formed in float64. In float32, `position * inv_freq` at position 1e7
has an absolute error of ~1 radian (the spacing of float32 near 1e7 is 1.0), which destroys
the high-frequency channels; float64's spacing there is ~2e-9.
"""

from __future__ import annotations

import math

import torch

from .spec import RopeSpec
from .types import ROPE_TYPES, rope_theta_powers


def compute_inv_freq(
    spec: RopeSpec | dict, head_dim: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[rotary_dim // 2]` (float64) and the cos/sin `attention_factor`.

    `seq_len` matters only for length-dependent types (dynamic, longrope): the number of
    positions the current forward covers (max position + 1).
    """
    spec = RopeSpec.from_dict(spec)
    if spec.rope_theta is None:
        raise ValueError(
            "rope_theta is unset (None means 'inherit from the model'): pass rope_theta=... "
            "or resolve the spec with RopeSpec.for_model(spec, model.config)"
        )
    dim = spec.rotary_dim(head_dim)
    inv_freq, af = ROPE_TYPES[spec.rope_type].fn(spec, rope_theta_powers(spec.rope_theta, dim), dim, seq_len)
    if spec.attention_factor is not None:  # (every type takes one: `lcx.rope.types`)
        af = spec.attention_factor
    return inv_freq, float(af)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Angles `positions[..., None] * inv_freq` in float64: `[..., T] -> [..., T, r/2]`.

    Positions may be integer or float (fractional positions are allowed, e.g. interpolated).
    """
    if positions.is_floating_point():
        pos = positions.to(torch.float64)
    else:
        pos = positions.to(torch.int64).to(torch.float64)  # exact for |p| < 2^53
    return pos.unsqueeze(-1) * inv_freq.to(device=pos.device, dtype=torch.float64)


def rope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables `[..., T, r]` for the given positions, scaled by attention_factor."""
    ang = rope_angles(positions, inv_freq)  # [..., T, r/2] float64
    ang = torch.cat((ang, ang), dim=-1)  # [..., T, r]
    cos, sin = ang.cos(), ang.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def rope_cos_sin_for_spec(
    spec: RopeSpec | dict,
    head_dim: int,
    positions: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of a spec at `positions`; `seq_len` defaults to max(positions)+1."""
    if seq_len is None and positions.numel():
        seq_len = int(positions.max().item()) + 1
    inv_freq, af = compute_inv_freq(spec, head_dim, seq_len)
    return rope_cos_sin(positions, inv_freq, af, dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the last dim: the 90-degree turn J of every rotary pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate `x: [B, T, H, D]` (or `[T, H, D]`) by tables `cos, sin: [B, T, r]` or `[T, r]`.

    Forward: `y = x*cos + J(x)*sin`, i.e. `y = a * R(p) x` with a = attention_factor.
    `inverse=True` undoes exactly that map, `x = (y*cos - J(y)*sin) / (cos^2 + sin^2)`, which
    is R(-p) y / a; with unit tables it is the rotation by -p (used to re-rotate cached keys).
    Computation happens in x's dtype unless the tables are wider, result in x's dtype.
    """
    r = cos.shape[-1]
    if r % 2 or r > x.shape[-1]:
        raise ValueError(f"rotary table width {r} must be even and <= head dim {x.shape[-1]}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    cos_h, sin_h = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [.., T, 1, r]: broadcast over heads
    xr, xp = x[..., :r], x[..., r:]
    if inverse:
        out = (xr * cos_h - rotate_half(xr) * sin_h) / (cos_h * cos_h + sin_h * sin_h)
    else:
        out = xr * cos_h + rotate_half(xr) * sin_h
    out = out.to(x.dtype)
    # (the full-width case skips a copy through cat; contiguous as cat's result was)
    return out.contiguous() if r == x.shape[-1] else torch.cat((out, xp), dim=-1)


def rotate_by_positions_ref(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Pure rotation of `x: [.., T, H, D]` by R(positions) (no attention factor), float64 angles.

    `rotate_by_positions_ref(x, delta, inv_freq)` is the PIE update `k <- R(delta) k`.
    """
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, torch.float64)
    out = apply_rotary_ref(x.to(torch.float64), cos, sin, inverse=inverse)
    return out.to(x.dtype)


# ---------------------------------------------------------------- re-rotation of cached keys (PIE)
def check_rerotate_args(k_cache: torch.Tensor, delta_positions: torch.Tensor, inv_freq: torch.Tensor,
                        out: torch.Tensor | None) -> None:
    """Validate the shared signature; raises ValueError naming the bad argument."""
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [B, T, H, D], got shape {tuple(k_cache.shape)}")
    B, T, H, D = k_cache.shape
    if delta_positions.is_floating_point() or delta_positions.is_complex() or delta_positions.dtype == torch.bool:
        raise ValueError(f"delta_positions must be an integer tensor (positions are integers), "
                         f"got {delta_positions.dtype}")
    if tuple(delta_positions.shape) not in ((T,), (B, T)):
        raise ValueError(f"delta_positions must be [T]=[{T}] or [B, T]=[{B}, {T}], "
                         f"got {tuple(delta_positions.shape)}")
    if inv_freq.dim() != 1 or not (1 <= inv_freq.shape[0] <= D // 2):
        raise ValueError(f"inv_freq must be [r/2] with 1 <= r/2 <= D/2 = {D // 2}, got {tuple(inv_freq.shape)}")
    if out is not None and (out.shape != k_cache.shape or out.dtype != k_cache.dtype
                            or out.device != k_cache.device):
        raise ValueError(f"out must match k_cache in shape/dtype/device: {tuple(out.shape)} {out.dtype} "
                         f"{out.device} vs {tuple(k_cache.shape)} {k_cache.dtype} {k_cache.device}")


def rerotate_operands(k_cache: torch.Tensor, delta_positions: torch.Tensor, inv_freq: torch.Tensor,
                      out: torch.Tensor | None, *, kernel: str,
                      dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)):
    """The re-rotation kernels' shared preamble: validate (`check_rerotate_args`, then the key
    dtypes `kernel` supports) and prepare what every launcher takes.

    Returns (target, delta [B, T] int64 on the keys' device (a stride-0 expand of a [T] delta:
    no copy), inv_turns [r/2] float64 = inv_freq / 2 pi, contiguous, on the keys' device: the
    kernels work in turns). delta and inv_turns are None when there is nothing to rotate
    (B or T is 0). target is k_cache (in place) unless `out` is given.
    """
    check_rerotate_args(k_cache, delta_positions, inv_freq, out)
    if k_cache.dtype not in dtypes:
        raise ValueError(f"{kernel} supports {', '.join(str(d).removeprefix('torch.') for d in dtypes)} keys, "
                         f"got {k_cache.dtype}")
    target = k_cache if out is None else out
    B, T = k_cache.shape[:2]
    if B == 0 or T == 0:
        return target, None, None
    delta = delta_positions.to(device=k_cache.device, dtype=torch.int64)
    if delta.dim() == 1:
        delta = delta.expand(B, T)
    inv_turns = (inv_freq.to(torch.float64) / (2 * math.pi)).contiguous().to(k_cache.device)
    return target, delta, inv_turns


def rerotate_ref(k_cache: torch.Tensor, delta_positions: torch.Tensor, inv_freq: torch.Tensor, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference re-rotation (float64 throughout, via `lcx.rope.rotate_by_positions_ref`).

    k_cache: [B, T, H, D]; delta_positions: [T] or [B, T] int; inv_freq: [r/2]. In place unless
    `out` is given. See `lcx.cache.rerotate` for the semantics and precision.
    """
    check_rerotate_args(k_cache, delta_positions, inv_freq, out)
    delta = delta_positions.to(k_cache.device)
    if delta.dim() == 1:
        delta = delta.expand(k_cache.shape[0], -1)  # [B, T]
    rotated = rotate_by_positions_ref(k_cache, delta, inv_freq.to(k_cache.device))  # [B, T, H, D]
    target = k_cache if out is None else out
    target.copy_(rotated)
    return target
