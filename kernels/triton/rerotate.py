"""Triton re-rotation of cached keys by a per-token position delta: `k <- R(delta) k` (PIE).

Same keyword signature and semantics as the reference `lcx.cache.rerotate.rerotate_ref`:

    rerotate_triton(k_cache [B, T, H, D], delta_positions [T] | [B, T] int, inv_freq [r/2], *, out=None)

In place unless `out` is given. Rotary pairs are (i, i + r/2) ("rotate half", as in HF); channels
r..D-1 are passed through (copied when `out` is given, untouched in place).

Three layers: `_rerotate_kernel` (@triton.jit), `_launch` (asserts, block sizes, grid, strides),
`rerotate_triton` (public wrapper). Tiling: one program handles BLOCK_T slots of one batch row,
all heads (looping over BLOCK_H heads at a time) and all r/2 frequencies; cos/sin are computed
once per (slot, frequency) and reused for every head:

    program (pid_t, b):  slots t in [pid_t*BLOCK_T, pid_t*BLOCK_T + BLOCK_T)
        angle[t, f] = delta[b, t] * inv_freq[f]            -> cos, sin   [BLOCK_T, BLOCK_F]
        for each head block:  x1 = k[b, t, h, f], x2 = k[b, t, h, f + r/2]   [BLOCK_T, BLOCK_H, BLOCK_F]
                              (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin)

Precision: the angle is formed in float64 as turns `delta * inv_freq / (2 pi)` (exact integer
delta for |delta| < 2^53), reduced in float64 to a quarter turn and a remainder in
[-pi/4, pi/4], and only that remainder goes to float32, where cos/sin are polynomials of ~1 ulp
(`_cos_sin_of_turns`). The float32 trig argument is therefore accurate to ~1e-7 rad at any
delta, where a float32 product `delta * inv_freq` loses ~|delta| * 6e-8 rad (0.06 rad at 1e6).
Arithmetic on keys is float32 whatever the storage dtype (fp32 / fp16 / bf16).

Run on CPU tensors with `TRITON_INTERPRET=1` set before triton is first imported (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lcx.rope.rotary import rerotate_operands

from ._common import interpreting


@triton.jit
def _cos_sin_of_turns(turns):
    """cos and sin (float32) of the angle 2*pi*turns given in float64 turns.

    Reduction in float64 to a quarter turn q and a remainder x in [-pi/4, pi/4] (exact
    subtraction; x rounded once to float32), then Cephes' single-precision minimax polynomials
    (~1 ulp) and the quadrant swap. Written out instead of tl.cos/tl.sin so the accuracy does
    not depend on how a backend lowers trig (approximate PTX instructions, or numpy in the
    interpreter).
    """
    quarters = turns * 4.0
    q = tl.floor(quarters + 0.5)
    x = ((quarters - q) * 1.5707963267948966).to(tl.float32)  # [-pi/4, pi/4]
    z = x * x
    s = x + x * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5))
    quad = q.to(tl.int64) & 3  # two's complement: also right for negative q
    cos = tl.where(quad == 0, c, tl.where(quad == 1, -s, tl.where(quad == 2, -c, s)))
    sin = tl.where(quad == 0, s, tl.where(quad == 1, c, tl.where(quad == 2, -s, -c)))
    return cos, sin


@triton.jit
def _rerotate_kernel(
    K, OUT, DELTA, INV_TURNS,
    T, H,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_db, stride_dt,
    HALF: tl.constexpr,  # r/2 rotary pairs
    N_PASS: tl.constexpr,  # D - r channels to copy (0 when rotating in place)
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    f = tl.arange(0, BLOCK_F)  # [BF]
    mask_t = t < T
    mask_f = f < HALF
    t64 = t.to(tl.int64)  # 64-bit offsets: B*T*H*D may exceed 2^31

    delta = tl.load(DELTA + pid_b * stride_db + t64 * stride_dt, mask=mask_t, other=0)  # [BT] int64
    inv_turns = tl.load(INV_TURNS + f, mask=mask_f, other=0.0)  # [BF] float64, inv_freq / (2 pi)
    cos, sin = _cos_sin_of_turns(delta.to(tl.float64)[:, None] * inv_turns[None, :])  # [BT, BF]
    cos = cos[:, None, :]  # [BT, 1, BF]: shared by all heads
    sin = sin[:, None, :]

    k_row = K + pid_b * stride_kb + t64[:, None, None] * stride_kt  # [BT, 1, 1] pointers
    o_row = OUT + pid_b * stride_ob + t64[:, None, None] * stride_ot
    fk = f[None, None, :]  # [1, 1, BF]
    for h0 in range(0, H, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)[None, :, None]  # [1, BH, 1]
        m = mask_t[:, None, None] & (h < H) & mask_f[None, None, :]  # [BT, BH, BF]
        k_h = k_row + h * stride_kh
        o_h = o_row + h * stride_oh
        x1 = tl.load(k_h + fk * stride_kd, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(k_h + (fk + HALF) * stride_kd, mask=m, other=0.0).to(tl.float32)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        tl.store(o_h + fk * stride_od, y1.to(OUT.dtype.element_ty), mask=m)
        tl.store(o_h + (fk + HALF) * stride_od, y2.to(OUT.dtype.element_ty), mask=m)
        if N_PASS > 0:  # out-of-place: copy the unrotated channels r..D-1
            p = tl.arange(0, BLOCK_P)[None, None, :]
            mp = mask_t[:, None, None] & (h < H) & (p < N_PASS)
            xp = tl.load(k_h + (2 * HALF + p) * stride_kd, mask=mp, other=0.0)
            tl.store(o_h + (2 * HALF + p) * stride_od, xp, mask=mp)


def _launch(k: torch.Tensor, out: torch.Tensor, delta: torch.Tensor, inv_turns: torch.Tensor,
            *, block_t: int | None = None) -> None:
    B, T, H, D = k.shape
    half = inv_turns.shape[0]
    assert delta.dtype == torch.int64 and delta.shape == (B, T), (delta.dtype, delta.shape)
    assert inv_turns.dtype == torch.float64 and inv_turns.is_contiguous()
    assert out.shape == k.shape and out.dtype == k.dtype
    assert 2 * half <= D
    assert k.device.type == "cuda" or interpreting(), "triton needs CUDA tensors (or TRITON_INTERPRET=1)"
    n_pass = 0 if out.data_ptr() == k.data_ptr() and out.stride() == k.stride() else D - 2 * half
    BLOCK_F = triton.next_power_of_2(half)
    BLOCK_P = triton.next_power_of_2(max(n_pass, 1))
    # Tile of BLOCK_T x BLOCK_H x BLOCK_F pairs: ~4k elements per program on a GPU (4 warps, a
    # few registers per element); the interpreter runs one numpy op per tile, so it gets big
    # tiles and a small grid.
    budget = 1 << 16 if interpreting() else 1 << 12
    BLOCK_H = min(triton.next_power_of_2(H), max(1, budget // BLOCK_F))
    if block_t is None:
        block_t = max(1, budget // (BLOCK_H * BLOCK_F))
        block_t = min(triton.next_power_of_2(T), triton.next_power_of_2(block_t))
    BLOCK_T = triton.next_power_of_2(block_t)
    grid = (triton.cdiv(T, BLOCK_T), B)
    _rerotate_kernel[grid](
        k, out, delta, inv_turns,
        T, H,
        *k.stride(), *out.stride(), *delta.stride(),
        HALF=half, N_PASS=n_pass,
        BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_F=BLOCK_F, BLOCK_P=BLOCK_P,
    )


def rerotate_triton(k_cache: torch.Tensor, delta_positions: torch.Tensor, inv_freq: torch.Tensor, *,
                    out: torch.Tensor | None = None, block_t: int | None = None) -> torch.Tensor:
    """Rotate `k_cache: [B, T, H, D]` by R(delta_positions) in the basis `inv_freq: [r/2]`.

    delta_positions: [T] or [B, T], integer. In place (returns k_cache) unless `out` is given
    (then `out` receives the result and k_cache is untouched). `block_t` overrides the number
    of slots per program (tests). See the module docstring for tiling and precision.
    """
    target, delta, inv_turns = rerotate_operands(k_cache, delta_positions, inv_freq, out, kernel="rerotate_triton")
    if delta is None:
        return target
    _launch(k_cache, target, delta, inv_turns, block_t=block_t)
    return target


__all__ = ["rerotate_triton"]
