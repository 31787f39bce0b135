"""Triton sliding-window attention with gradients: SWAT's sigmoid window (and softmax windows).

SWAT (arXiv 2502.18845): o_i = sum_{i-w < j <= i} sigmoid(scale * q_i.k_j - m_h |i - j|) v_j with
per-head ALiBi slopes m_h of both signs (`lcx.attention.balanced_alibi_slopes`) on q/k that
are ALREADY rotated (RoPE is applied by the caller, differentiably). Same semantics as
`lcx.attention.attention_ref(q, k, v, mask=sliding_window(left=w - 1), alibi_slopes=...,
activation="sigmoid")`; the same kernels also serve causal / window / sinks masks with softmax.

    swat_attention_triton(q, k, v, *, window, alibi_slopes=None, scale=None, q_offset=None) -> out
    window_attention_triton(q, k, v, *, left=None, n_global=0, alibi_slopes=None,
                            activation="sigmoid", scale=None, q_offset=None, return_lse=False)

Layers: the forward is `lambda_attention._attn_fwd_kernel` (one forward kernel for every mask
lcx runs in Triton); the backward is `_bwd_dkdv_kernel` + `_bwd_dq_kernel` here, launched by
`window_attention_backward`, wrapped by the `WindowAttentionFunction` autograd Function.

Backward (P = weights, dP = dO V^T):
  sigmoid: P = sigmoid(S), dS = dP * P * (1 - P)           (no normalisation, no lse needed)
  softmax: P = exp(S - lse), dS = P * (dP - delta),  delta_i = dO_i . O_i
  dV = P^T dO, dK = scale * dS^T Q, dQ = scale * dS K      (ALiBi slopes are constants)

Block skipping: a key block [j0, j1) is seen only by queries i in [j0, j1 - 1 + left] (all
i >= j0 if the block holds one of the n_global first keys); the dK/dV program of a key block
loops over those query blocks only, for each of the GROUP query heads of its kv head (so dK/dV
need no atomics under GQA). The dQ program of a query block visits the same key blocks as the
forward. Cost follows the window area, O(T * w), not O(T^2).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import cast_rne, dot, interpreting, load_rows, pow2
from .lambda_attention import (
    DEFAULT_CONFIG,
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    FwdConfig,
    lambda_attention_triton,
)


@triton.jit
def _scores(q, k, i, j, row_ok, col_ok, slope, scale, NG, LEFT,
            ALIBI: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """Logits [BM, BN] (scale, ALiBi) and visibility of queries i [BM] on keys j [BN]."""
    s = dot(q, tl.trans(k), DOT_F32, PRECISION) * scale
    d = i[:, None] - j[None, :]
    if ALIBI:
        s -= slope[:, None] * tl.abs(d).to(tl.float32)
    visible = row_ok[:, None] & col_ok[None, :] & (d >= 0) & ((d <= LEFT) | (j[None, :] < NG))
    return s, visible


@triton.jit
def _weights(s, visible, lse, SIGMOID: tl.constexpr):
    if SIGMOID:
        p = 1.0 / (1.0 + tl.exp(-s))
    else:
        p = tl.exp(s - lse[:, None])
    return tl.where(visible, p, 0.0)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, SLOPES, DK, DV,
    Tq, Tk, q_offset, Hkv, NG, LEFT, scale,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_dob, stride_dot, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_lt,
    stride_dkb, stride_dkt, stride_dkh, stride_dkd,
    stride_dvb, stride_dvt, stride_dvh, stride_dvd,
    GROUP: tl.constexpr, D: tl.constexpr, DV_: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ALIBI: tl.constexpr, SIGMOID: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    kvh = pid_bh % Hkv
    j0 = pid_n * BLOCK_N
    j = j0 + tl.arange(0, BLOCK_N)
    col_ok = j < Tk
    cd = tl.arange(0, BLOCK_D)
    cv = tl.arange(0, BLOCK_DV)
    k_rows = b * stride_kb + j.to(tl.int64) * stride_kt + kvh.to(tl.int64) * stride_kh
    k = load_rows(K, k_rows, cd, D, stride_kd, col_ok)
    v = load_rows(V, b * stride_vb + j.to(tl.int64) * stride_vt + kvh.to(tl.int64) * stride_vh,
                   cv, DV_, stride_vd, col_ok)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    # queries (as t = i - q_offset) that can see a key of this block
    j_last = tl.minimum(j0 + BLOCK_N, Tk) - 1
    i_hi = tl.where(j0 < NG, q_offset + Tq - 1, tl.minimum(q_offset + Tq - 1, j_last + LEFT))
    t_lo = tl.maximum(j0 - q_offset, 0)
    t_end = tl.where((LEFT < 0) & (j0 >= NG), t_lo, i_hi - q_offset + 1)
    t_end = tl.maximum(t_end, t_lo)
    for g in range(GROUP):
        h = kvh * GROUP + g
        if ALIBI:
            slope = tl.load(SLOPES + h + tl.zeros([BLOCK_M], tl.int32))
        else:
            slope = tl.zeros([BLOCK_M], tl.float32)
        for t0 in range(t_lo, t_end, BLOCK_M):
            t = t0 + tl.arange(0, BLOCK_M)
            row_ok = t < t_end
            q_rows = b * stride_qb + t.to(tl.int64) * stride_qt + h.to(tl.int64) * stride_qh
            q = load_rows(Q, q_rows, cd, D, stride_qd, row_ok)
            do = load_rows(DO, b * stride_dob + t.to(tl.int64) * stride_dot + h.to(tl.int64) * stride_doh,
                            cv, DV_, stride_dod, row_ok)
            l_offs = b * stride_lb + h.to(tl.int64) * stride_lh + t.to(tl.int64) * stride_lt
            lse = tl.load(LSE + l_offs, mask=row_ok, other=0.0)
            s, visible = _scores(q, k, q_offset + t, j, row_ok, col_ok, slope, scale, NG, LEFT,
                                 ALIBI, DOT_F32, PRECISION)
            p = _weights(s, visible, lse, SIGMOID)  # [BM, BN]
            dv += dot(tl.trans(cast_rne(p, DO.dtype.element_ty, DOT_F32)), do, DOT_F32, PRECISION)
            dp = dot(do, tl.trans(v), DOT_F32, PRECISION)
            if SIGMOID:
                ds = dp * p * (1.0 - p)
            else:
                delta = tl.load(DELTA + l_offs, mask=row_ok, other=0.0)
                ds = p * (dp - delta[:, None])
            dk += dot(tl.trans(cast_rne(ds, Q.dtype.element_ty, DOT_F32)), q, DOT_F32, PRECISION)
    dk *= scale
    tl.store(DK + b * stride_dkb + j.to(tl.int64)[:, None] * stride_dkt + kvh.to(tl.int64) * stride_dkh
             + cd[None, :] * stride_dkd, cast_rne(dk, DK.dtype.element_ty, DOT_F32), mask=col_ok[:, None] & (cd[None, :] < D))
    tl.store(DV + b * stride_dvb + j.to(tl.int64)[:, None] * stride_dvt + kvh.to(tl.int64) * stride_dvh
             + cv[None, :] * stride_dvd, cast_rne(dv, DV.dtype.element_ty, DOT_F32), mask=col_ok[:, None] & (cv[None, :] < DV_))


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, SLOPES, DQ,
    Tq, Tk, q_offset, H, Hkv, NG, LEFT, scale,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_dob, stride_dot, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_lt,
    stride_dqb, stride_dqt, stride_dqh, stride_dqd,
    GROUP: tl.constexpr, D: tl.constexpr, DV_: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ALIBI: tl.constexpr, SIGMOID: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = h // GROUP
    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = t < Tq
    i = q_offset + t
    cd = tl.arange(0, BLOCK_D)
    cv = tl.arange(0, BLOCK_DV)
    q = load_rows(Q, b * stride_qb + t.to(tl.int64) * stride_qt + h.to(tl.int64) * stride_qh, cd, D, stride_qd, row_ok)
    do = load_rows(DO, b * stride_dob + t.to(tl.int64) * stride_dot + h.to(tl.int64) * stride_doh,
                    cv, DV_, stride_dod, row_ok)
    l_offs = b * stride_lb + h.to(tl.int64) * stride_lh + t.to(tl.int64) * stride_lt
    lse = tl.load(LSE + l_offs, mask=row_ok, other=0.0)
    if not SIGMOID:
        delta = tl.load(DELTA + l_offs, mask=row_ok, other=0.0)
    if ALIBI:
        slope = tl.load(SLOPES + h + tl.zeros([BLOCK_M], tl.int32))
    else:
        slope = tl.zeros([BLOCK_M], tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # the forward's key blocks: global [0, g_end), window [win_lo, win_hi)
    t_hi = tl.minimum(Tq - 1, pid_m * BLOCK_M + BLOCK_M - 1)
    win_hi = tl.minimum(Tk, q_offset + t_hi + 1)
    win_lo = tl.maximum(0, q_offset + pid_m * BLOCK_M - LEFT)
    win_lo = tl.where(LEFT < 0, win_hi, tl.minimum(win_lo, win_hi))
    g_end = tl.minimum(NG, win_lo)
    n_gb = tl.cdiv(g_end, BLOCK_N)
    n_blocks = n_gb + tl.cdiv(win_hi - win_lo, BLOCK_N)
    for blk in range(0, n_blocks):
        is_g = blk < n_gb
        start = tl.where(is_g, blk * BLOCK_N, win_lo + (blk - n_gb) * BLOCK_N)
        j = start + tl.arange(0, BLOCK_N)
        col_ok = j < tl.where(is_g, g_end, win_hi)
        k_rows = b * stride_kb + j.to(tl.int64) * stride_kt + kvh.to(tl.int64) * stride_kh
        k = load_rows(K, k_rows, cd, D, stride_kd, col_ok)
        v = load_rows(V, b * stride_vb + j.to(tl.int64) * stride_vt + kvh.to(tl.int64) * stride_vh,
                       cv, DV_, stride_vd, col_ok)
        s, visible = _scores(q, k, i, j, row_ok, col_ok, slope, scale, NG, LEFT, ALIBI, DOT_F32, PRECISION)
        p = _weights(s, visible, lse, SIGMOID)
        dp = dot(do, tl.trans(v), DOT_F32, PRECISION)
        if SIGMOID:
            ds = dp * p * (1.0 - p)
        else:
            ds = p * (dp - delta[:, None])
        dq += dot(cast_rne(ds, K.dtype.element_ty, DOT_F32), k, DOT_F32, PRECISION)
    dq *= scale
    tl.store(DQ + b * stride_dqb + t.to(tl.int64)[:, None] * stride_dqt + h.to(tl.int64) * stride_dqh
             + cd[None, :] * stride_dqd, cast_rne(dq, DQ.dtype.element_ty, DOT_F32), mask=row_ok[:, None] & (cd[None, :] < D))


def window_attention_backward(
    q, k, v, out, lse, dout, *, left, n_global, alibi_slopes, activation, scale, q_offset,
    config: FwdConfig = DEFAULT_CONFIG, dq=None, dk=None, dv=None,
):
    """Gradients (dq, dk, dv) of `window_attention_triton`; buffers may be given (tests poison them).

    q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]`, out/dout `[B, Tq, H, Dv]`,
    lse `[B, H, Tq]` float32 (the forward's).
    """
    B, Tq, H, D = q.shape
    Tk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if B * H == 0 or Tk == 0:
        return dq, dk, dv
    sigmoid = activation == "sigmoid"
    if sigmoid:
        delta = lse  # unused
    else:  # delta_i = dO_i . O_i, [B, H, Tq]
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    slopes = q if alibi_slopes is None else torch.as_tensor(alibi_slopes, dtype=torch.float32).to(q.device)
    LEFT = Tk + Tq if left is None else left
    NG = min(n_global, Tk)
    interp = interpreting()
    common = dict(
        GROUP=H // Hkv, D=D, DV_=Dv, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_D=pow2(D), BLOCK_DV=pow2(Dv), ALIBI=alibi_slopes is not None, SIGMOID=sigmoid,
        DOT_F32=interp, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    scale = float(scale)
    if Tq > 0:
        _bwd_dkdv_kernel[(triton.cdiv(Tk, config.block_n), B * Hkv)](
            q, k, v, dout, lse, delta, slopes, dk, dv,
            Tq, Tk, q_offset, Hkv, NG, LEFT, scale,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(),
            *dk.stride(), *dv.stride(), **common,
        )  # fmt: skip
        _bwd_dq_kernel[(triton.cdiv(Tq, config.block_m), B * H)](
            q, k, v, dout, lse, delta, slopes, dq,
            Tq, Tk, q_offset, H, Hkv, NG, LEFT, scale,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(),
            *dq.stride(), **common,
        )  # fmt: skip
    else:
        dk.zero_(), dv.zero_()
    return dq, dk, dv


class WindowAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: forward by `lambda_attention_triton` (no rotary), backward above."""

    @staticmethod
    def forward(ctx, q, k, v, left, n_global, alibi_slopes, activation, scale, q_offset, config):
        out, lse = lambda_attention_triton(
            q, k, v, n_global=n_global, left=left, alibi_slopes=alibi_slopes, activation=activation,
            scale=scale, q_offset=q_offset, num_splits=1, config=config,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (left, n_global, alibi_slopes, activation, scale, q_offset, config)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        left, n_global, slopes, activation, scale, q_offset, config = ctx.args
        dq, dk, dv = window_attention_backward(
            q, k, v, out, lse, dout.contiguous(), left=left, n_global=n_global, alibi_slopes=slopes,
            activation=activation, scale=scale, q_offset=q_offset, config=config,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None, None


def window_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    left: int | None = None,
    n_global: int = 0,
    alibi_slopes=None,
    activation: str = "sigmoid",
    scale: float | None = None,
    q_offset: int | None = None,
    return_lse: bool = False,
    config: FwdConfig = DEFAULT_CONFIG,
):
    """Differentiable attention on rotated q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]`.

    Visible keys: `j <= i` and (`i - j <= left` or `j < n_global`); `left=None` is causal.
    Returns out `[B, Tq, H, Dv]` (and lse `[B, H, Tq]`, no gradient through it).
    """
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"window_attention_triton supports float32/float16/bfloat16, got {q.dtype}")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"head dim > {MAX_HEAD_DIM}")
    off = k.shape[1] - q.shape[1] if q_offset is None else q_offset
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    slopes = None if alibi_slopes is None else tuple(float(s) for s in alibi_slopes)
    out, lse = WindowAttentionFunction.apply(q, k, v, left, n_global, slopes, activation, sc, off, config)
    return (out, lse) if return_lse else out


def swat_attention_triton(q, k, v, *, window: int, alibi_slopes=None, scale=None, q_offset=None):
    """SWAT: sigmoid attention over a causal window of `window` keys (left = window - 1)."""
    return window_attention_triton(q, k, v, left=window - 1, alibi_slopes=alibi_slopes,
                                   activation="sigmoid", scale=scale, q_offset=q_offset)


__all__ = ["WindowAttentionFunction", "swat_attention_triton", "window_attention_backward", "window_attention_triton"]
