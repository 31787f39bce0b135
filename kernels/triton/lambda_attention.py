"""Triton forward attention for Λ-shaped masks (LM-Infinite), windows and plain causal masks.

Same semantics as `lcx.attention.reference` (`lambda_attention_ref` with `rotary`, or
`attention_ref` on already-rotated q/k); public entry point:

    lambda_attention_triton(q [B, Tq, H, D], k [B, Tk, Hkv, D], v [B, Tk, Hkv, Dv], *,
                            n_global=0, left=None, limit_distance=None, rotary=None,
                            alibi_slopes=None, activation="softmax", scale=None, q_offset=None,
                            num_splits=None, out=None, lse=None) -> (out [B, Tq, H, Dv], lse [B, H, Tq])

Visible keys of the query at mask index i (lcx window convention, `lcx.masks`):
`j <= i` and (`i - j <= left` or `j < n_global`); `left=None` is causal, `left=-1` no window.
With `limit_distance` (LM-Infinite, needs `rotary`, `left = n_local - 1`) a key with
`j < n_global` and `i - j > left` is a *global* key, scored as `scale * R(d) q_i . R(0) k_j`,
d = min(limit_distance, Tk - 1); every other visible key is scored at its true positions,
`scale * R(p_i) q_i . R(p_j) k_j`. A global key inside the window is counted once, as local.

Three layers (flash-attention style): `_attn_fwd_kernel` (@triton.jit), `_launch` (asserts,
tables, grid, strides), `lambda_attention_triton` (public wrapper).

Tiling. A program owns BLOCK_M *rows*; row r is query t = r // GROUP of query head
kvh * GROUP + r % GROUP, so the GROUP query heads sharing a kv head (GQA) share every K/V
tile they load. For the rows' queries i in [i_lo, i_hi] the program visits only

    key blocks:  [0, g_end) global keys           g_end = min(n_global, win_lo)
                 [win_lo, win_hi) the window      win_lo = i_lo - left, win_hi = i_hi + 1

    e.g. lambda_mask(2, 3), BLOCK_M = 2 queries:    key j:  0 1 2 3 4 5 6 7
        queries i = 6, 7 visit global [0, 2) and window [4, 8):   G G . . x x x x

so the cost follows the unmasked area, (G + L + BLOCK) per query, not Tk. Split-K (decode):
with `num_splits = S > 1` the visited key blocks are divided among S programs per row block,
each writing an unnormalised partial (acc, running max m, sum l); `_combine_kernel` merges
them by log-sum-exp. Use it when Tq is small (decode reads G + L cached keys with few rows).

RoPE inside the kernel: q/k arrive unrotated (as the bounded cache stores them) with float32
cos/sin tables `[B or 1, Tk, r/2]` computed on the host in float64 by `lcx.rope.rope_cos_sin`
(exact at any position), attention factor included; rotary pairs are (c, c + r/2) (rotate half)
and channels r..D-1 pass through unscaled, as in `lcx.rope.apply_rotary_ref`. Rotated q/k are
rounded to the input dtype before the dot, as the reference does.

Activation: softmax by online softmax; sigmoid (o = sum sigmoid(s) v, lse = log sum sigmoid(s))
through the same loop on logits logsigmoid(s) with o = acc * exp(m), so nothing overflows.
Numerics: dots accumulate in float32 (fp32 inputs: IEEE, not TF32); the interpreter gets
float32 dot operands (it mis-multiplies bf16 `tl.dot`) and rounds to bfloat16 on the bits
(`_common.cast_rne`: the interpreter's own float32 -> bfloat16 conversion truncates, where GPUs round to nearest).

Run on CPU tensors with `TRITON_INTERPRET=1` set before triton is first imported (tests).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from lcx.rope import rope_cos_sin

from ._common import cast_rne, dot, interpreting, load_rows, pow2

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class FwdConfig:
    """Launch parameters. No autotuning at run time: `lcx bench kernels --tune` measures a grid
    of them on a GPU (results/kernels/<gpu>.tune.json) and its winner is entered in `TUNED`."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_CONFIG = FwdConfig()

# GPU slug (lcx.kernels.gpu_slug of the device name) -> the measured best launch configuration
# at the lambda_prefill benchmark's shape (`lcx bench kernels --tune`); entered by hand from
# results/kernels/<slug>.tune.json (tests/benchmarks/test_bench_kernels.py keeps the two equal).
# Empty until a GPU session has tuned: every GPU runs DEFAULT_CONFIG.
TUNED: dict[str, FwdConfig] = {}

_override: list[FwdConfig] = []  # launch_config's stack (the tuner's; not for concurrent use)


@contextmanager
def launch_config(config: FwdConfig):
    """Within the block, every call that names no `config` launches with `config` (how the tuner
    times a configuration through the same `attention(..., backend="triton")` call as the bench)."""
    _override.append(config)
    try:
        yield config
    finally:
        _override.pop()


@lru_cache(maxsize=None)
def _tuned_for(index: int) -> FwdConfig:
    from lcx.kernels import gpu_slug

    return TUNED.get(gpu_slug(torch.cuda.get_device_name(index)), DEFAULT_CONFIG)


def config_for(device: torch.device) -> FwdConfig:
    """The launch configuration for `device`: launch_config's if one is active, this GPU's
    tuned one if `TUNED` has it, else DEFAULT_CONFIG."""
    if _override:
        return _override[-1]
    if device.type == "cuda":
        return _tuned_for(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_CONFIG


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, COS, SIN, CAP_CS, SLOPES, OUT, LSE, PART_O, PART_ML,
    Tq, Tk, q_offset, n_rows, Hkv, NG, LEFT,
    scale, k_glob_factor,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ct,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lt,
    GROUP: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr,
    ROTARY: tl.constexpr, CAP: tl.constexpr, ALIBI: tl.constexpr, SIGMOID: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // Hkv).to(tl.int64)
    kvh = pid_bh % Hkv

    # ---- rows: (query t, head h) pairs
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < n_rows
    t = r // GROUP
    h = kvh * GROUP + r % GROUP
    i = q_offset + t  # mask index of each row's query
    ch = tl.arange(0, BLOCK_H)
    q_rows = b * stride_qb + t.to(tl.int64) * stride_qt + h.to(tl.int64) * stride_qh
    qa = load_rows(Q, q_rows, ch, HALF, stride_qd, row_ok)
    qb = load_rows(Q + HALF * stride_qd, q_rows, ch, HALF, stride_qd, row_ok)
    if PASS > 0:
        qp = load_rows(Q + 2 * HALF * stride_qd, q_rows, tl.arange(0, BLOCK_P), PASS, stride_qd, row_ok)
    if CAP:  # global branch: every query rotated to the capped distance d
        cc = tl.load(CAP_CS + ch, mask=ch < HALF, other=0.0)[None, :]
        cs = tl.load(CAP_CS + HALF + ch, mask=ch < HALF, other=0.0)[None, :]
        qa_f, qb_f = qa.to(tl.float32), qb.to(tl.float32)
        qca = cast_rne(qa_f * cc - qb_f * cs, Q.dtype.element_ty, DOT_F32)
        qcb = cast_rne(qb_f * cc + qa_f * cs, Q.dtype.element_ty, DOT_F32)
    if ROTARY:  # local branch: query at its own position
        c_rows = b * stride_cb + i.to(tl.int64) * stride_ct
        cq = load_rows(COS, c_rows, ch, HALF, 1, row_ok)
        sq = load_rows(SIN, c_rows, ch, HALF, 1, row_ok)
        qa_f, qb_f = qa.to(tl.float32), qb.to(tl.float32)
        qa = cast_rne(qa_f * cq - qb_f * sq, Q.dtype.element_ty, DOT_F32)
        qb = cast_rne(qb_f * cq + qa_f * sq, Q.dtype.element_ty, DOT_F32)
    if ALIBI:
        slope = tl.load(SLOPES + h, mask=row_ok, other=0.0)

    # ---- key blocks this row block can see: global [0, g_end), window [win_lo, win_hi)
    t_lo = (pid_m * BLOCK_M) // GROUP
    t_hi = tl.minimum(Tq - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP)
    win_hi = tl.minimum(Tk, q_offset + t_hi + 1)
    win_lo = tl.maximum(0, q_offset + t_lo - LEFT)
    win_lo = tl.where(LEFT < 0, win_hi, tl.minimum(win_lo, win_hi))
    g_end = tl.minimum(NG, win_lo)
    n_gb = tl.cdiv(g_end, BLOCK_N)
    n_blocks = n_gb + tl.cdiv(win_hi - win_lo, BLOCK_N)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    blk_lo = pid_s * per_split
    blk_hi = tl.minimum(n_blocks, blk_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    cv = tl.arange(0, BLOCK_DV)
    for blk in range(blk_lo, blk_hi):
        is_g = blk < n_gb
        start = tl.where(is_g, blk * BLOCK_N, win_lo + (blk - n_gb) * BLOCK_N)
        hi = tl.where(is_g, g_end, win_hi)
        j = start + tl.arange(0, BLOCK_N)
        col_ok = j < hi
        k_rows = b * stride_kb + j.to(tl.int64) * stride_kt + kvh.to(tl.int64) * stride_kh
        ka = load_rows(K, k_rows, ch, HALF, stride_kd, col_ok)
        kb = load_rows(K + HALF * stride_kd, k_rows, ch, HALF, stride_kd, col_ok)
        if PASS > 0:
            kp = load_rows(K + 2 * HALF * stride_kd, k_rows, tl.arange(0, BLOCK_P), PASS, stride_kd, col_ok)
            s_pass = dot(qp, tl.trans(kp), DOT_F32, PRECISION)
        if CAP:
            ka_raw, kb_raw = ka, kb
        if ROTARY:
            ck_rows = b * stride_cb + j.to(tl.int64) * stride_ct
            ck = load_rows(COS, ck_rows, ch, HALF, 1, col_ok)
            sk = load_rows(SIN, ck_rows, ch, HALF, 1, col_ok)
            ka_f, kb_f = ka.to(tl.float32), kb.to(tl.float32)
            ka = cast_rne(ka_f * ck - kb_f * sk, K.dtype.element_ty, DOT_F32)
            kb = cast_rne(kb_f * ck + ka_f * sk, K.dtype.element_ty, DOT_F32)
        s = dot(qa, tl.trans(ka), DOT_F32, PRECISION) + dot(qb, tl.trans(kb), DOT_F32, PRECISION)
        if PASS > 0:
            s += s_pass
        d = i[:, None] - j[None, :]
        visible = row_ok[:, None] & col_ok[None, :] & (d >= 0) & ((d <= LEFT) | (j[None, :] < NG))
        if CAP:
            if start < NG:  # only blocks holding global keys pay for the second dot
                s_g = dot(qca, tl.trans(ka_raw), DOT_F32, PRECISION) + dot(qcb, tl.trans(kb_raw), DOT_F32, PRECISION)
                s_g = s_g * k_glob_factor  # R(0) k = attention_factor * k on rotary channels
                if PASS > 0:
                    s_g += s_pass
                s = tl.where((j[None, :] < NG) & (d > LEFT), s_g, s)
        s = s * scale
        if ALIBI:
            s -= slope[:, None] * tl.abs(d).to(tl.float32)
        if SIGMOID:  # logsigmoid(s), stable: min(s, 0) - log(1 + exp(-|s|))
            s = tl.minimum(s, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(s)))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = b * stride_vb + j.to(tl.int64) * stride_vt + kvh.to(tl.int64) * stride_vh
        vt = load_rows(V, v_rows, cv, DV, stride_vd, col_ok)
        acc = acc * alpha[:, None] + dot(cast_rne(p, V.dtype.element_ty, DOT_F32), vt, DOT_F32, PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        if SIGMOID:
            o = acc * tl.exp(m_i)[:, None]  # undo the shift: sum sigmoid(s) v (m <= 0)
        else:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = m_i + tl.log(l_i)  # -inf for rows without keys
        o_rows = b * stride_ob + t.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh
        tl.store(OUT + o_rows[:, None] + cv[None, :] * stride_od, cast_rne(o, OUT.dtype.element_ty, DOT_F32),
                 mask=row_ok[:, None] & (cv[None, :] < DV))
        tl.store(LSE + b * stride_lb + h.to(tl.int64) * stride_lh + t.to(tl.int64) * stride_lt, lse, mask=row_ok)
    else:  # partials [B*Hkv, S, rows_pad, DV] and [B*Hkv, S, 2, rows_pad]
        n_pad = tl.num_programs(0) * BLOCK_M
        base = (pid_bh.to(tl.int64) * NUM_SPLITS + pid_s) * n_pad
        tl.store(PART_O + (base + r)[:, None] * BLOCK_DV + cv[None, :], acc)
        tl.store(PART_ML + 2 * base + r, m_i)
        tl.store(PART_ML + 2 * base + n_pad + r, l_i)


@triton.jit
def _combine_kernel(
    PART_O, PART_ML, OUT, LSE,
    n_rows, n_pad, Hkv,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lt,
    GROUP: tl.constexpr, DV: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, SIGMOID: tl.constexpr, EMULATE: tl.constexpr,
):
    """Merge the S split-K partials of BLOCK_R rows by log-sum-exp (flash-decoding)."""
    pid_r = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    kvh = pid_bh % Hkv
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < n_rows
    cv = tl.arange(0, BLOCK_DV)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        base = (pid_bh.to(tl.int64) * NUM_SPLITS + s) * n_pad
        m = tl.maximum(m, tl.load(PART_ML + 2 * base + r, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_tot = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for s in range(NUM_SPLITS):
        base = (pid_bh.to(tl.int64) * NUM_SPLITS + s) * n_pad
        m_s = tl.load(PART_ML + 2 * base + r, mask=row_ok, other=float("-inf"))
        l_s = tl.load(PART_ML + 2 * base + n_pad + r, mask=row_ok, other=0.0)
        w = tl.exp(m_s - m_safe)
        l_tot += l_s * w
        o_s = tl.load(PART_O + (base + r)[:, None] * BLOCK_DV + cv[None, :], mask=row_ok[:, None], other=0.0)
        acc += o_s * w[:, None]
    if SIGMOID:
        o = acc * tl.exp(m)[:, None]
    else:
        o = acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
    t = r // GROUP
    h = kvh * GROUP + r % GROUP
    o_rows = b * stride_ob + t.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh
    tl.store(OUT + o_rows[:, None] + cv[None, :] * stride_od, cast_rne(o, OUT.dtype.element_ty, EMULATE),
             mask=row_ok[:, None] & (cv[None, :] < DV))
    tl.store(LSE + b * stride_lb + h.to(tl.int64) * stride_lh + t.to(tl.int64) * stride_lt,
             m + tl.log(l_tot), mask=row_ok)


def _rotary_tables(rotary, half: int, n_keys: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin `[B or 1, Tk, r/2]` at the keys' positions, from float64 (attention factor in)."""
    pos = rotary.key_positions(n_keys, torch.device("cpu") if rotary.positions is None else rotary.positions.device)
    cos, sin = rope_cos_sin(pos, rotary.inv_freq.to(pos.device), rotary.attention_factor, torch.float64)
    cos, sin = cos[..., :half], sin[..., :half]  # [(B,) Tk, r/2]: the two halves are equal
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    return (cos.to(device=device, dtype=torch.float32).contiguous(),
            sin.to(device=device, dtype=torch.float32).contiguous())


def _cap_table(rotary, half: int, distance: int, device) -> torch.Tensor:
    """[cos(d) | sin(d)] `[r]` float32 for the capped query rotation (float64 on the host)."""
    cos, sin = rope_cos_sin(torch.tensor([distance]), rotary.inv_freq.cpu(), rotary.attention_factor, torch.float64)
    return torch.cat((cos[0, :half], sin[0, :half])).to(device=device, dtype=torch.float32)


def default_num_splits(n_rows: int, n_keys_visited: int, batch_heads: int, block_m: int, block_n: int,
                       device: torch.device) -> int:
    """Split-K only when the row blocks alone leave the GPU idle (decode)."""
    row_blocks = triton.cdiv(n_rows, block_m) * batch_heads
    key_blocks = triton.cdiv(max(n_keys_visited, 1), block_n)
    if interpreting() or device.type != "cuda" or key_blocks < 2:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(key_blocks, (2 * sms) // max(row_blocks, 1), 64))


def lambda_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    n_global: int = 0,
    left: int | None = None,
    limit_distance: int | None = None,
    rotary=None,
    alibi_slopes=None,
    activation: str = "softmax",
    scale: float | None = None,
    q_offset: int | None = None,
    num_splits: int | None = None,
    config: FwdConfig | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward; see the module docstring. Returns out `[B, Tq, H, Dv]`, lse `[B, H, Tq]` (fp32).

    n_global / left: the mask (`left=None` causal, `-1` no window); limit_distance: LM-Infinite's
    cap (requires rotary, and applies to keys j < n_global outside the window); rotary: a
    `lcx.attention.Rotary` (q/k unrotated) or None (q/k already rotated or position-free);
    alibi_slopes: per-head slopes `[H]` (logit - m_h |i - j|). `out`/`lse` may be given
    (tests poison them with NaN); `num_splits` forces split-K (default: a heuristic); `config`:
    the launch configuration (default `config_for(q.device)`).
    """
    B, Tq, H, D = q.shape
    Tk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"lambda_attention_triton supports float32/float16/bfloat16, got {q.dtype}")
    if max(D, Dv) > MAX_HEAD_DIM:
        raise ValueError(f"head dim {max(D, Dv)} > {MAX_HEAD_DIM}")
    if activation not in ("softmax", "sigmoid"):
        raise ValueError(f"activation={activation!r}")
    if limit_distance is not None and (rotary is None or left is None or left < 0):
        raise ValueError("limit_distance needs rotary and a window (left >= 0)")
    assert q.device.type == "cuda" or interpreting(), "triton needs CUDA tensors (or TRITON_INTERPRET=1)"
    off = Tk - Tq if q_offset is None else q_offset
    dev = q.device
    group = H // Hkv
    if out is None:
        out = torch.empty(B, Tq, H, Dv, dtype=q.dtype, device=dev)
    if lse is None:
        lse = torch.empty(B, H, Tq, dtype=torch.float32, device=dev)
    assert out.shape == (B, Tq, H, Dv) and out.dtype == q.dtype and lse.shape == (B, H, Tq)
    if B == 0 or Tq == 0 or H == 0:
        return out, lse

    if rotary is not None:
        half = rotary.inv_freq.shape[0]
        cos, sin = _rotary_tables(rotary, half, Tk, dev)
        stride_cb = 0 if cos.shape[0] == 1 else cos.stride(0)
        stride_ct = cos.stride(1)
    else:
        half = D // 2
        cos = sin = q  # unused (ROTARY=False)
        stride_cb = stride_ct = 0
    n_pass = D - 2 * half
    cap = limit_distance is not None
    if cap:
        cap_cs = _cap_table(rotary, half, min(limit_distance, max(Tk - 1, 0)), dev)
        k_glob_factor = float(rotary.attention_factor)
    else:
        cap_cs, k_glob_factor = q, 1.0
    slopes = q
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32).to(dev)
        assert slopes.shape == (H,), slopes.shape
    LEFT = Tk + Tq if left is None else left  # causal: a window wider than any distance
    NG = min(n_global, Tk)

    cfg = config if config is not None else config_for(q.device)
    n_rows = Tq * group
    # decode: few rows (Tq * GROUP); a 16-row tile (the tl.dot minimum) instead of block_m
    BLOCK_M, BLOCK_N = min(cfg.block_m, pow2(n_rows)), cfg.block_n
    visited = NG + (min(Tk, LEFT + 1) if LEFT >= 0 else 0) + BLOCK_M // group
    S = num_splits or default_num_splits(n_rows, visited, B * Hkv, BLOCK_M, BLOCK_N, dev)
    BLOCK_DV = pow2(Dv)
    grid_m = triton.cdiv(n_rows, BLOCK_M)
    if S > 1:
        n_pad = grid_m * BLOCK_M
        part_o = torch.empty(B * Hkv * S * n_pad * BLOCK_DV, dtype=torch.float32, device=dev)
        part_ml = torch.empty(B * Hkv * S * 2 * n_pad, dtype=torch.float32, device=dev)
    else:
        part_o = part_ml = lse
    interp = interpreting()
    _attn_fwd_kernel[(grid_m, B * Hkv, S)](
        q, k, v, cos, sin, cap_cs, slopes, out, lse, part_o, part_ml,
        Tq, Tk, off, n_rows, Hkv, NG, LEFT,
        float(scale if scale is not None else 1.0 / math.sqrt(D)), k_glob_factor,
        *q.stride(), *k.stride(), *v.stride(),
        stride_cb, stride_ct,
        *out.stride(), *lse.stride(),
        GROUP=group, HALF=half, PASS=n_pass, DV=Dv,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_H=pow2(half), BLOCK_P=pow2(n_pass), BLOCK_DV=BLOCK_DV,
        ROTARY=rotary is not None, CAP=cap, ALIBI=alibi_slopes is not None,
        SIGMOID=activation == "sigmoid", NUM_SPLITS=S,
        DOT_F32=interp, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if S > 1:
        BLOCK_R = 16
        _combine_kernel[(triton.cdiv(n_rows, BLOCK_R), B * Hkv)](
            part_o, part_ml, out, lse,
            n_rows, grid_m * BLOCK_M, Hkv,
            *out.stride(), *lse.stride(),
            GROUP=group, DV=Dv, NUM_SPLITS=S, BLOCK_R=BLOCK_R, BLOCK_DV=BLOCK_DV,
            SIGMOID=activation == "sigmoid", EMULATE=interp,
        )  # fmt: skip
    return out, lse


__all__ = ["DEFAULT_CONFIG", "FwdConfig", "lambda_attention_triton", "interpreting"]
