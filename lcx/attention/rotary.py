"""Turning unrotated q/k plus a `Rotary` into kernel inputs (shared by the reference and backends).

Rotation itself is `lcx.rope.apply_rotary_ref` with tables whose angles are formed in float64,
rounded to max(float32, input dtype) and applied in that dtype (`table_dtype`; float32 tables
as the Triton/CUDA kernels build them), so every backend sees bit-identical rotated inputs.
(Applying float64 tables to float32 inputs cost 10-30x the float32 rotation on CPU in a one-off
measurement on the 2-core dev machine, for a difference of one rounding.)

LM-Infinite's distance cap (arXiv 2308.16137, official `models/llama.py`): a global key is
scored with the key UNROTATED and the query rotated by `d = min(limit_distance, Tk - 1)`.
lcx writes both as rotations: the key to position 0 and the query to position d, so the
attention factor scales both branches alike (the official code scales the capped branch
once, not twice; the two agree when attention_factor = 1). Every global key thus sits at
relative distance d, whatever its real distance.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lcx.masks import MaskMod
from lcx.masks.base import named
from lcx.rope import apply_rotary_ref, rope_cos_sin

from .spec import LambdaParams, Rotary


def table_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype rotation runs in for inputs of `x_dtype`: max(float32, x_dtype)."""
    return torch.promote_types(x_dtype, torch.float32)


def _tables(rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin(positions, rotary.inv_freq, rotary.attention_factor, table_dtype(dtype))


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, rotary: Rotary, q_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[B, Tq, H, D]` at positions[q_offset : q_offset + Tq], k `[B, Tk, Hkv, D]` at positions."""
    Tq, Tk = q.shape[1], k.shape[1]
    cos, sin = _tables(rotary, rotary.key_positions(Tk, k.device), k.dtype)  # [(B,) Tk, r]
    k_rot = apply_rotary_ref(k, cos, sin)
    q_rot = apply_rotary_ref(q, cos[..., q_offset : q_offset + Tq, :], sin[..., q_offset : q_offset + Tq, :])
    return q_rot, k_rot


def rotate_to(x: torch.Tensor, rotary: Rotary, position: int) -> torch.Tensor:
    """Every token of x `[B, T, H, D]` rotated to the same position."""
    cos, sin = _tables(rotary, torch.tensor([position], device=x.device), x.dtype)  # [1, r]
    T = x.shape[1]
    return apply_rotary_ref(x, cos.expand(T, -1), sin.expand(T, -1))


class LambdaInputs(NamedTuple):
    q_rot: torch.Tensor  # [B, Tq, H, D]   local branch, real positions
    k_rot: torch.Tensor  # [B, Tk, Hkv, D]
    q_cap: torch.Tensor  # [B, Tq, H, D]   global branch, rotated to position d
    k_glob: torch.Tensor  # [B, G', Hkv, D] first G' = min(n_global, Tk) keys at position 0


def lambda_inputs(
    q: torch.Tensor, k: torch.Tensor, rotary: Rotary, lp: LambdaParams, q_offset: int
) -> LambdaInputs:
    q_rot, k_rot = rotate_qk(q, k, rotary, q_offset)
    n_glob = min(lp.n_global, k.shape[1])
    q_cap = rotate_to(q, rotary, lp.effective_limit(k.shape[1]))
    k_glob = rotate_to(k[:, :n_glob], rotary, 0)
    return LambdaInputs(q_rot, k_rot, q_cap, k_glob)


def lambda_global_mask(n_global: int, n_local: int) -> MaskMod:
    """Keys scored by the capped global branch: `j < n_global` and outside the local window."""

    def lambda_global(b, h, q_idx, kv_idx):
        return (kv_idx < n_global) & (q_idx - kv_idx >= n_local)

    fn = named(lambda_global, f"lambda_global_{n_global}_{n_local}", None, {})
    fn.global_outside_window = (n_global, n_local)  # structure as data, for backends that cut it (flash)
    return fn


def lambda_concat_inputs(
    li: LambdaInputs, v: torch.Tensor, lp: LambdaParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MaskMod]:
    """One-pass LM-Infinite for kernels without a log-sum-exp output (sdpa, compiled flex).

    Both branches go into ONE softmax by doubling the head dim: q2 = [q_rot | q_cap];
    keys are G' copies of the global keys, [0 | k_glob], followed by all Tk keys,
    [k_rot | 0]; so q2.k2 is q_rot.k_rot on window keys and q_cap.k_glob on global copies.
    Values follow the keys. Call the kernel with the ORIGINAL scale and q_offset; the
    returned mask_mod works on the concatenated key index c (c < G': global copy of key c;
    c >= G': key c - G').
    Returns q2 `[B, Tq, H, 2D]`, k2 `[B, G'+Tk, Hkv, 2D]`, v2 `[B, G'+Tk, Hkv, Dv]`, mask.
    """
    n_glob, n_local = li.k_glob.shape[1], lp.n_local
    q2 = torch.cat((li.q_rot, li.q_cap), dim=-1)
    k_g = torch.cat((torch.zeros_like(li.k_glob), li.k_glob), dim=-1)
    k_l = torch.cat((li.k_rot, torch.zeros_like(li.k_rot)), dim=-1)
    k2 = torch.cat((k_g, k_l), dim=1)
    v2 = torch.cat((v[:, :n_glob], v), dim=1)

    def lambda_concat(b, h, q_idx, c_idx):
        j = c_idx - n_glob
        glob = (c_idx < n_glob) & (q_idx - c_idx >= n_local)
        local = (c_idx >= n_glob) & (j <= q_idx) & (q_idx - j < n_local)
        return glob | local

    mask = named(lambda_concat, f"lambda_concat_{n_glob}_{n_local}", None, {})
    return q2, k2, v2, mask
