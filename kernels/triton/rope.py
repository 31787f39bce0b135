"""Fused RoPE application in Triton: same signature and semantics as `lcx.rope.apply_rotary_ref`.

    apply_rotary_triton(x [B, T, H, D] | [T, H, D], cos, sin [B, T, r] | [T, r], *, inverse=False, out=None)
    rotate_by_positions_triton(x, positions [T] | [B, T], inv_freq [r/2], *, inverse=False, out=None)

Forward `y = x*cos + J(x)*sin` on the first r channels (pairs (c, c + r/2), "rotate half"),
channels r..D-1 copied; `inverse=True` is `(y*cos - J(y)*sin) / (cos^2 + sin^2)`. The tables
come from any lcx RoPE type (`lcx.rope.rope_cos_sin`, attention factor included), and only
their first half `[..., :r/2]` is read (the halves are equal by construction). Arithmetic in
float32, or float64 when x or the tables are float64 (as the reference: x's dtype unless the
tables are wider); result in x's dtype. One read of x and the tables, one write: memory bound.

Tiling: one program per (BLOCK_T tokens, batch row), all heads in blocks of BLOCK_H; cos/sin
are loaded once per (token, frequency) and reused for every head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lcx.rope import rope_cos_sin

from ._common import cast_rne, interpreting


@triton.jit
def _rope_kernel(
    X, OUT, COS, SIN,
    T, H,
    stride_xb, stride_xt, stride_xh, stride_xd,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_cb, stride_ct, stride_cd,
    HALF: tl.constexpr, N_PASS: tl.constexpr, INVERSE: tl.constexpr, F64: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    f = tl.arange(0, BLOCK_F)
    mask_t = t < T
    mask_f = f < HALF
    c_off = b * stride_cb + t[:, None] * stride_ct + f[None, :] * stride_cd
    cm = mask_t[:, None] & mask_f[None, :]
    wide = tl.float64 if F64 else tl.float32
    cos = tl.load(COS + c_off, mask=cm, other=0.0).to(wide)[:, None, :]  # [BT, 1, BF]
    sin = tl.load(SIN + c_off, mask=cm, other=0.0).to(wide)[:, None, :]
    if INVERSE:
        norm = cos * cos + sin * sin
        sin = -sin
    fk = f[None, None, :]
    for h0 in range(0, H, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)[None, :, None]
        m = mask_t[:, None, None] & (h < H) & mask_f[None, None, :]
        x_h = X + b * stride_xb + t[:, None, None] * stride_xt + h * stride_xh
        o_h = OUT + b * stride_ob + t[:, None, None] * stride_ot + h * stride_oh
        x1 = tl.load(x_h + fk * stride_xd, mask=m, other=0.0).to(wide)
        x2 = tl.load(x_h + (fk + HALF) * stride_xd, mask=m, other=0.0).to(wide)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        if INVERSE:
            y1 = y1 / norm
            y2 = y2 / norm
        tl.store(o_h + fk * stride_od, cast_rne(y1, OUT.dtype.element_ty, EMULATE), mask=m)
        tl.store(o_h + (fk + HALF) * stride_od, cast_rne(y2, OUT.dtype.element_ty, EMULATE), mask=m)
        if N_PASS > 0:
            p = tl.arange(0, BLOCK_P)[None, None, :]
            mp = mask_t[:, None, None] & (h < H) & (p < N_PASS)
            xp = tl.load(x_h + (2 * HALF + p) * stride_xd, mask=mp, other=0.0)
            tl.store(o_h + (2 * HALF + p) * stride_od, xp, mask=mp)


def apply_rotary_triton(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    out: torch.Tensor | None = None,
    block_t: int | None = None,
) -> torch.Tensor:
    """Rotate `x: [B, T, H, D]` (or `[T, H, D]`) by tables `cos, sin: [B, T, r]` or `[T, r]`.

    See the module docstring; `out` (same shape/dtype as x) may be given, even `out=x`
    (in place); `block_t` overrides the tokens per program (tests).
    """
    r = cos.shape[-1]
    if r % 2 or r > x.shape[-1]:
        raise ValueError(f"rotary table width {r} must be even and <= head dim {x.shape[-1]}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise ValueError(f"apply_rotary_triton: unsupported dtype {x.dtype}")
    assert x.device.type == "cuda" or interpreting(), "triton needs CUDA tensors (or TRITON_INTERPRET=1)"
    x4 = x if x.dim() == 4 else x.unsqueeze(0)  # [B, T, H, D]
    B, T, H, D = x4.shape
    c3, s3 = (cos, sin) if cos.dim() == 3 else (cos.unsqueeze(0), sin.unsqueeze(0))  # [Bc, T, r]
    if c3.shape[1] != T or c3.shape[0] not in (1, B) or c3.dim() != 3:
        raise ValueError(f"tables {tuple(cos.shape)} do not match x {tuple(x.shape)}")
    c3, s3 = c3.to(x.device), s3.to(x.device)
    if s3.stride() != c3.stride():
        s3 = s3.contiguous()
        c3 = c3.contiguous()
    if out is None:
        out = torch.empty_like(x)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match x {tuple(x.shape)} {x.dtype}")
    o4 = out if out.dim() == 4 else out.unsqueeze(0)
    if B * T * H == 0:
        return out
    half = r // 2
    same = o4.data_ptr() == x4.data_ptr() and o4.stride() == x4.stride()
    n_pass = 0 if same else D - r
    BLOCK_F = triton.next_power_of_2(max(half, 1))
    BLOCK_P = triton.next_power_of_2(max(n_pass, 1))
    budget = 1 << 16 if interpreting() else 1 << 12  # pairs per tile (see kernels/triton/rerotate.py)
    BLOCK_H = min(triton.next_power_of_2(H), max(1, budget // BLOCK_F))
    if block_t is None:
        block_t = min(triton.next_power_of_2(T), max(1, budget // (BLOCK_H * BLOCK_F)))
    BLOCK_T = triton.next_power_of_2(block_t)
    wide64 = torch.float64 in (x.dtype, cos.dtype)
    _rope_kernel[(triton.cdiv(T, BLOCK_T), B)](
        x4, o4, c3, s3, T, H,
        *x4.stride(), *o4.stride(),
        0 if c3.shape[0] == 1 else c3.stride(0), c3.stride(1), c3.stride(2),
        HALF=half, N_PASS=n_pass, INVERSE=inverse, F64=wide64, EMULATE=interpreting(),
        BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_F=BLOCK_F, BLOCK_P=BLOCK_P,
    )  # fmt: skip
    return out


def rotate_by_positions_triton(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, inverse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`lcx.rope.rotate_by_positions_ref` (pure rotation, no attention factor) with the fused kernel.

    Tables are formed in float64 on the host (exact angles at any position) and rounded once to
    float32 for the kernel (float64 kept when x is float64).
    """
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, torch.float64)
    tdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return apply_rotary_triton(x, cos.to(tdt), sin.to(tdt), inverse=inverse, out=out)


__all__ = ["apply_rotary_triton", "rotate_by_positions_triton"]
