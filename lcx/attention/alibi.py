"""ALiBi slopes and bias (Press et al., arXiv 2108.12409; SWAT, arXiv 2502.18845).

Convention (flash-attn's `alibi_slopes`): head h adds `-m_h * |i - j|` to the logit of
query i and key j. m > 0 penalises distance (classic ALiBi), m < 0 favours it.

`alibi_slopes(H)`: the classic schedule, m_h = 2^(-8(h+1)/H) for H a power of two (other H:
Press et al.'s interleaving).

`balanced_alibi_slopes(H)`: lcx's fixed schedule for SWAT's "balanced" (bidirectional) ALiBi.
With H' = H/2: heads 0..H'-1 get m = +2^(-8(h+1)/H') (penalise distance), heads H'..H-1 get
m = -2^(-8(h-H'+1)/H') (favour distance). SWAT's public code has varied between versions;
this is the one lcx uses.
"""

from __future__ import annotations

import math

import torch


def _power_of_two_slopes(n: int) -> list[float]:
    return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]


def alibi_slopes(n_heads: int) -> tuple[float, ...]:
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    p = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = _power_of_two_slopes(p)
    if p < n_heads:  # Press et al.: take every other slope of the 2p schedule
        slopes += _power_of_two_slopes(2 * p)[0::2][: n_heads - p]
    return tuple(slopes)


def balanced_alibi_slopes(n_heads: int) -> tuple[float, ...]:
    if n_heads < 2 or n_heads % 2:
        raise ValueError(f"balanced ALiBi needs an even number of heads >= 2, got {n_heads}")
    half = _power_of_two_slopes(n_heads // 2)
    return tuple(half) + tuple(-m for m in half)


def alibi_bias(
    slopes: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`-m_h * |i - j|`: slopes `[H]`, q_idx `[Tq]`, kv_idx `[Tk]` -> `[H, Tq, Tk]` in dtype."""
    dist = (q_idx[:, None] - kv_idx[None, :]).abs().to(dtype)  # exact: integers < 2^24
    return -slopes.to(dtype)[:, None, None] * dist
