"""A family's RoPE channel layout, and the one order lcx holds heads in.

lcx's methods rotate rotate-half on the whole head: channel j pairs with j + D/2. Families differ:
some rotate only the first r of a head's D channels and pass the rest (partial rotary: Phi,
GLM-4-MoE), some pair channels (2i, 2i + 1) (interleaved: Cohere, GLM-4, ERNIE 4.5, Helium), and a
rotation may turn the other way (rotate-half with flipped signs, a rotation by -angle, as NanoChat's,
a family refused for another reason: `lcx.hf.models.LEFT_OUT`). All of them
are rotate-half on the whole head after a fixed permutation of the channels. Inside lcx a head is
held in **lcx order**: `ChannelOrder.lcx` lists, for lcx channel c, the family's channel it holds,

    lcx channel  [0, r/2)       [r/2, D/2)           [D/2, D/2 + r/2)   [D/2 + r/2, D)
    holds        first of each  passed channels,     second of each     passed channels,
                 rotated pair   first half           rotated pair       second half

(a pair's "first" is the channel the family's rotation moves by -sin: channel i of rotate-half,
2i of interleaved pairs, the other one when flipped), with the RoPE basis padded by (D - r)/2 zero
frequencies (`basis`): rotating the whole head rotate-half in lcx order is the family's rotation,
and a zero frequency leaves its pair where it is. q and k are permuted alike, so every score q.k
is the family's (a dot product does not see an order shared by both); v is not permuted, so the
attention output is in the family's order as it was.

One difference remains on partial heads: lcx scales cos and sin by the attention factor on every
channel (a zero-frequency pair included), transformers only on the r rotated ones, so a basis
with an attention factor a != 1 (YaRN, LongRoPE) would weight the passed channels' share of every
score by a^2. `fix_query` divides the query's passed channels by a^2 (queries are never cached,
so this holds for every method, backend and cache, static or length-dependent basis).

The layout is found, not declared: `detect` runs the family's own `apply_rotary_pos_emb` on a
probe and keeps the candidate order it reproduces (to float32's precision), or raises.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from lcx.rope import apply_rotary_ref, rope_cos_sin

TABLE_LAYOUTS = ("halves", "pairs")  # a family's (cos, sin): [a | a] (Llama) or [a0 a0 a1 a1 ...] (Cohere)


@dataclass(frozen=True)
class ChannelOrder:
    """How a family's head of `head_dim` channels is rotated: the first `rotary_dim` channels
    (the rest pass), in pairs (2i, 2i + 1) (`interleaved`) or (i, i + r/2), turned the other
    way when `flipped` (see the module doc)."""

    head_dim: int
    rotary_dim: int
    interleaved: bool = False
    flipped: bool = False

    def __post_init__(self) -> None:
        D, r = self.head_dim, self.rotary_dim
        if not (0 < r <= D) or r % 2 or (D - r) % 2:
            raise NotImplementedError(f"a head of {D} channels rotating {r} of them: lcx holds heads with an even "
                                      "number of rotated and of passed channels only")

    @property
    def identity(self) -> bool:
        """lcx's own layout (rotate-half on the whole head): nothing to permute or correct."""
        return self.rotary_dim == self.head_dim and not self.interleaved and not self.flipped

    @functools.cached_property
    def lcx(self) -> torch.Tensor:
        """`[D]` long: lcx channel c holds the family's channel `lcx[c]`."""
        D, r = self.head_dim, self.rotary_dim
        rot = torch.arange(r)
        first, second = (rot[0::2], rot[1::2]) if self.interleaved else (rot[: r // 2], rot[r // 2:])
        if self.flipped:
            first, second = second, first
        passed = torch.arange(r, D)
        return torch.cat((first, passed[: (D - r) // 2], second, passed[(D - r) // 2:]))

    def to_lcx(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., D]` in the family's order -> lcx order (x itself for the identity)."""
        return x if self.identity else x.index_select(-1, self.lcx.to(x.device))

    def from_lcx(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_lcx`."""
        return x if self.identity else x.index_select(-1, torch.argsort(self.lcx).to(x.device))

    def basis(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """inv_freq `[r/2]` -> `[D/2]`: zero frequencies for the passed channels' pairs."""
        n = self.head_dim // 2 - inv_freq.shape[-1]
        if n < 0 or inv_freq.shape[-1] != self.rotary_dim // 2:
            raise ValueError(f"a RoPE basis of {inv_freq.shape[-1]} frequencies for a head rotating {self.rotary_dim} "
                             f"of {self.head_dim} channels")
        return inv_freq if n == 0 else torch.cat((inv_freq, inv_freq.new_zeros(n)))

    def fix_query(self, q: torch.Tensor, attention_factor: float) -> torch.Tensor:
        """q `[..., D]` in lcx order with its passed channels divided by attention_factor^2
        (module doc); q itself on a whole rotated head or for a factor of 1."""
        D, r = self.head_dim, self.rotary_dim
        if r == D or attention_factor == 1.0:
            return q
        w = torch.ones(D, dtype=q.dtype, device=q.device)
        w[r // 2:D // 2] = w[D // 2 + r // 2:] = 1.0 / attention_factor ** 2
        return q * w


def family_tables(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype,
                  layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[..., T, r]` in a family's table layout (`TABLE_LAYOUTS`): what its rotary
    module returns and its `apply_rotary_pos_emb` reads."""
    cos, sin = rope_cos_sin(positions, inv_freq, attention_factor, dtype)  # halves: [a | a]
    if layout == "halves":
        return cos, sin
    if layout != "pairs":
        raise ValueError(f"table layout {layout!r}; expected one of {TABLE_LAYOUTS}")
    h = cos.shape[-1] // 2
    return cos[..., :h].repeat_interleave(2, -1), sin[..., :h].repeat_interleave(2, -1)


def table_layout(cos: torch.Tensor) -> str:
    """The layout (`TABLE_LAYOUTS`) of a family's cos table `[..., T, r]` at positions with
    distinct angles: equal halves, or equal neighbours."""
    h = cos.shape[-1] // 2
    if torch.equal(cos[..., :h], cos[..., h:]):
        return "halves"
    if torch.equal(cos[..., 0::2], cos[..., 1::2]):
        return "pairs"
    raise ValueError("the family's rotary tables are neither [a | a] nor pairwise repeated; lcx cannot read them")


def detect(fn: Callable, head_dim: int, rotary_dim: int, layout: str, where: str) -> ChannelOrder:
    """The `ChannelOrder` under which the family's `apply_rotary_pos_emb` (`fn`, reading tables
    in `layout`) is lcx's rotate-half rotation, found on a float64 probe; `ValueError` naming
    `where` if no candidate reproduces it. A family whose forward splits off the rotated channels
    itself (Phi) hands `fn` only those: it is probed on them, the rest passing through."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 3, head_dim, generator=g, dtype=torch.float64)  # [B, H, T, D]
    inv = torch.rand(rotary_dim // 2, generator=g, dtype=torch.float64) + 0.1
    pos = torch.arange(3)[None]
    cos, sin = family_tables(pos, inv, 1.0, torch.float64, layout)  # [1, 3, r]
    try:
        got, _ = fn(x, x, cos, sin)
    except RuntimeError:  # (a width mismatch: the forward hands fn the rotated channels only)
        rot, _ = fn(x[..., :rotary_dim], x[..., :rotary_dim], cos, sin)
        got = torch.cat((rot, x[..., rotary_dim:]), -1)
    for interleaved in (False, True):
        for flipped in (False, True):
            order = ChannelOrder(head_dim, rotary_dim, interleaved, flipped)
            c, s = rope_cos_sin(pos, order.basis(inv), 1.0, torch.float64)
            want = order.from_lcx(apply_rotary_ref(order.to_lcx(x).transpose(1, 2), c, s).transpose(1, 2))
            # (to float32's precision: some families rotate in float32 whatever their inputs, e.g.
            # Cohere; a wrong candidate differs by O(1))
            if got.shape == want.shape and torch.allclose(got.to(want.dtype), want, rtol=1e-5, atol=1e-5):
                return order
    raise ValueError(f"{where}.apply_rotary_pos_emb is not a RoPE lcx can hold (rotate-half or interleaved pairs on "
                     f"the first {rotary_dim} of {head_dim} channels); lcx attention methods cannot run this family")


__all__ = ["TABLE_LAYOUTS", "ChannelOrder", "detect", "family_tables", "table_layout"]
