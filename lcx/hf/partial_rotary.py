"""Partial rotary heads (Phi, StableLM, GLM-4-MoE, Nemotron): the family rotates the first
`r` of a head's D channels (rotate-half on those r: pairs (i, i + r/2)) and passes the other
D - r through; lcx's methods rotate rotate-half on the whole head (pairs (j, j + D/2)).

Stated once, used by the attention patch and the engine: inside lcx a partial head is held in
**lcx order**, a fixed permutation of its channels,

    lcx channel  [0, r/2)         [r/2, D/2)          [D/2, D/2 + r/2)   [D/2 + r/2, D)
    family       [0, r/2)         [r, r + (D-r)/2)    [r/2, r)           [r + (D-r)/2, D)
                 rotated, low     passed, first half  rotated, high      passed, second half

with the RoPE basis padded by (D - r)/2 zero frequencies (`padded_basis`): a rotate-half
rotation of the whole head in lcx order is the family's rotation of its first r channels, and
a zero frequency leaves its pair where it is. q and k are permuted alike, so every score
q.k is the family's (a dot product does not see an order shared by both); v is not permuted,
so the attention output is in the family's order as it was.

One difference remains: lcx scales cos and sin by the attention factor on every channel (a
zero-frequency pair included), transformers only on the r rotated ones, so a basis with an
attention factor a != 1 (YaRN, LongRoPE) would weight the passed channels' share of every
score by a^2. `fix_query` divides the query's passed channels by a^2 (queries are never
cached, so this holds for every method, backend and cache, static or length-dependent basis).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """lcx channel c holds the family's channel `_order(...)[c]` (module doc)."""
    r2, p2 = rotary_dim // 2, (head_dim - rotary_dim) // 2
    rot, passed = torch.arange(rotary_dim), torch.arange(rotary_dim, head_dim)
    return torch.cat((rot[:r2], passed[:p2], rot[r2:], passed[p2:]))


def check_dims(head_dim: int, rotary_dim: int) -> None:
    """A partial head lcx can hold in lcx order: r and D - r even, 0 < r <= D."""
    if not (0 < rotary_dim <= head_dim) or rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise NotImplementedError(f"a head of {head_dim} channels rotating {rotary_dim} of them: lcx holds partial "
                                  "rotary heads with an even number of rotated and of passed channels only")


def to_lcx_order(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x `[..., D]` in the family's order -> lcx order (x itself when r = D)."""
    D = x.shape[-1]
    if rotary_dim == D:
        return x
    check_dims(D, rotary_dim)
    return x.index_select(-1, _order(D, rotary_dim).to(x.device))


def padded_basis(inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """inv_freq `[r/2]` -> `[D/2]`: zero frequencies for the passed channels' pairs."""
    n = head_dim // 2 - inv_freq.shape[-1]
    if n == 0:
        return inv_freq
    if n < 0:
        raise ValueError(f"a RoPE basis of {inv_freq.shape[-1]} frequencies for a head of {head_dim} channels")
    return torch.cat((inv_freq, inv_freq.new_zeros(n)))


def fix_query(q: torch.Tensor, rotary_dim: int, attention_factor: float) -> torch.Tensor:
    """q `[..., D]` in lcx order with its passed channels divided by attention_factor^2 (module
    doc); q itself when r = D or the factor is 1."""
    D = q.shape[-1]
    if rotary_dim == D or attention_factor == 1.0:
        return q
    r2 = rotary_dim // 2
    w = torch.ones(D, dtype=q.dtype, device=q.device)
    w[r2:D // 2] = w[D // 2 + r2:] = 1.0 / attention_factor ** 2
    return q * w


__all__ = ["check_dims", "fix_query", "padded_basis", "to_lcx_order"]
