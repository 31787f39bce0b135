"""`PositionedKVCache`: a KV cache that knows each cached key's position and RoPE basis.

Semantics, stated once for lcx's cache surgery (PIE, see `lcx.cache.pie`):

- **Layout.** Per layer, `keys`/`values` are `[B, H_kv, T, D]`: the Hugging Face cache layout
  (`transformers.cache_utils.DynamicLayer`), not lcx's activation layout `[B, T, H, D]`; the
  re-rotation kernels take the `[B, T, H, D]` view `keys.transpose(1, 2)` (a strided view, no copy).
- **Keys are stored after RoPE** (`rope_applied=True`), as HF Llama-family attention does:
  `apply_rotary_pos_emb` runs before `past_key_values.update` (transformers 5.17,
  `modeling_llama.LlamaAttention.forward`). A cached key is `a * R(p) W_k h` with `a` the
  attention factor. `rope_applied=False` describes a cache of un-rotated keys (StreamingLLM
  style); such a cache is relabelled, never rotated, by position edits.
- **A position** is the index of a token in the current sequence: cached tokens occupy 0..T-1
  and the next token fed is at `len(cache)`. `positions[t]` records the position the key in
  slot t was actually rotated with. The two agree except after a deliberately stale update
  (`conflict`), whose kept keys still carry their old positions.
- **Basis.** `inv_freq` ([r/2], float64) and `attention_factor` are the RoPE basis the keys
  were rotated with. For static RoPE types it never changes. Length-dependent types (dynamic
  NTK, longrope) choose a basis per forward from its max position + 1, like transformers; when
  a forward's basis differs from the cache's, the cache no longer has one basis and
  `inv_freq` becomes None (`has_single_basis` False): rotating such a cache by a position
  delta is meaningless and `lcx.cache.pie` refuses to.

Batch: tensors carry a batch dim B, but edits are per sequence, so the edit API needs B == 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..hf.head import head_logits
from ..hf import decoder as _decoder
from ..hf import model_shape
from ..hf.rope_patch import rope_basis

def same_basis(a: tuple[torch.Tensor, float] | None, b: tuple[torch.Tensor, float] | None) -> bool:
    if a is None or b is None:
        return False
    return a[0].shape == b[0].shape and torch.equal(a[0].cpu(), b[0].cpu()) and a[1] == b[1]


@dataclass
class ForwardCost:
    """Work of one or more decoder forwards: tokens encoded, approximate FLOPs, wall seconds."""

    tokens: int = 0
    flops: float = 0.0
    wall_s: float = 0.0

    def add(self, other: "ForwardCost") -> None:
        self.tokens += other.tokens
        self.flops += other.flops
        self.wall_s += other.wall_s


def forward_flops(config: Any, n_new: int, n_past: int) -> float:
    """Approximate FLOPs of a decoder forward of `n_new` tokens after `n_past` cached ones.

    2 FLOPs per multiply-add: `2 * P * n_new` for the non-embedding weights P of the layers
    (q, k, v, o projections and the gated MLP; norms ignored) plus `4 * L * H * D` per (query,
    visible key) pair for QK^T and AV, with query i seeing n_past + i + 1 keys. The LM head is
    not counted: cache updates never need logits.
    """
    shape = model_shape(config)
    d, L, H, Hkv, D = shape.hidden_size, shape.layers, shape.heads, shape.kv_heads, shape.head_dim
    per_layer = d * H * D + 2 * d * Hkv * D + H * D * d + 3 * d * config.intermediate_size
    pairs = n_new * n_past + n_new * (n_new + 1) / 2
    return 2.0 * per_layer * L * n_new + 4.0 * L * H * D * pairs


@dataclass
class PositionedKVCache:
    """Per-layer keys/values `[B, H_kv, T, D]` plus, per slot, the token id and the position its
    key was rotated with, and the RoPE basis of the keys. See the module docstring.

    Build with `PositionedKVCache.prefill(model, input_ids)`; grow with `extend`; hand to HF with
    `to_hf()` (shares tensors).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    token_ids: torch.Tensor  # [B, T] int64
    positions: torch.Tensor  # [T] int64: position each key was rotated with
    inv_freq: torch.Tensor | None  # [r/2] float64, None when the keys mix bases
    attention_factor: float = 1.0
    rope_applied: bool = True
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values):
            raise ValueError(f"{len(self.keys)} key layers but {len(self.values)} value layers")
        if self.token_ids.dim() != 2:
            raise ValueError(f"token_ids must be [B, T], got {tuple(self.token_ids.shape)}")
        T = self.token_ids.shape[1]
        if self.positions.shape != (T,):
            raise ValueError(f"positions must be [T]=[{T}], got {tuple(self.positions.shape)}")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k.dim() != 4 or k.shape[2] != T or v.shape[:3] != k.shape[:3]:
                raise ValueError(f"layer {i}: keys {tuple(k.shape)} / values {tuple(v.shape)} are not "
                                 f"[B, H_kv, T={T}, D]")

    # ------------------------------------------------------------------ construction
    @classmethod
    def empty(cls, model: nn.Module, batch_size: int = 1) -> "PositionedKVCache":
        cfg = model.config
        p = next(model.parameters())
        shape = model_shape(cfg)
        Hkv, D = shape.kv_heads, shape.head_dim
        z = torch.zeros(batch_size, Hkv, 0, D, dtype=p.dtype, device=p.device)
        return cls(keys=[z.clone() for _ in range(cfg.num_hidden_layers)],
                   values=[z.clone() for _ in range(cfg.num_hidden_layers)],
                   token_ids=torch.zeros(batch_size, 0, dtype=torch.long, device=p.device),
                   positions=torch.zeros(0, dtype=torch.long, device=p.device),
                   inv_freq=None, attention_factor=1.0, rope_applied=True)

    @classmethod
    def prefill(cls, model: nn.Module, input_ids: torch.Tensor) -> "PositionedKVCache":
        """Encode `input_ids: [B, T]` at positions 0..T-1 into a fresh cache."""
        cache = cls.empty(model, input_ids.shape[0])
        cache.extend(model, input_ids)
        return cache

    @classmethod
    def from_hf(cls, hf_cache: Any, token_ids: torch.Tensor, positions: torch.Tensor | None = None,
                *, basis: tuple[torch.Tensor, float] | None = None,
                rope_applied: bool = True) -> "PositionedKVCache":
        """Wrap an HF `DynamicCache` (shares its tensors). `positions` default to 0..T-1."""
        keys = [layer.keys for layer in hf_cache.layers]
        values = [layer.values for layer in hf_cache.layers]
        T = token_ids.shape[-1]
        if positions is None:
            positions = torch.arange(T, device=token_ids.device)
        inv, af = basis if basis is not None else (None, 1.0)
        return cls(keys, values, token_ids.reshape(-1, T), positions.to(torch.long), inv, af, rope_applied)

    def to_hf(self):
        """An HF `DynamicCache` whose layers hold this cache's tensors (no copy)."""
        from transformers.cache_utils import DynamicCache

        hf = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in zip(self.keys, self.values)])
        for layer, k, v in zip(hf.layers, self.keys, self.values):
            layer.keys, layer.values = k, v
        return hf

    # ------------------------------------------------------------------ properties
    def __len__(self) -> int:
        return int(self.token_ids.shape[1])

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def has_single_basis(self) -> bool:
        return self.inv_freq is not None

    @property
    def basis(self) -> tuple[torch.Tensor, float] | None:
        return None if self.inv_freq is None else (self.inv_freq, self.attention_factor)

    @property
    def next_position(self) -> int:
        """Position of the next token fed: its index in the sequence, `len(self)`."""
        return len(self)

    # ------------------------------------------------------------------ slot surgery
    def clone(self) -> "PositionedKVCache":
        return PositionedKVCache([k.clone() for k in self.keys], [v.clone() for v in self.values],
                                 self.token_ids.clone(), self.positions.clone(),
                                 None if self.inv_freq is None else self.inv_freq.clone(),
                                 self.attention_factor, self.rope_applied, dict(self.meta))

    def select(self, index: torch.Tensor | slice) -> "PositionedKVCache":
        """Slots `index` (a slice or an index tensor over T), same basis; slices share storage."""
        if not isinstance(index, slice):
            index = index.to(self.token_ids.device)
        return PositionedKVCache([k[:, :, index] for k in self.keys], [v[:, :, index] for v in self.values],
                                 self.token_ids[:, index], self.positions[index], self.inv_freq,
                                 self.attention_factor, self.rope_applied, dict(self.meta))

    @staticmethod
    def cat(parts: list["PositionedKVCache"]) -> "PositionedKVCache":
        """Concatenate caches along T (in list order). The result has one basis only if all do."""
        if not parts:
            raise ValueError("cat needs at least one cache")
        first = parts[0]
        if any(p.rope_applied != first.rope_applied for p in parts):
            raise ValueError("cannot concatenate caches with and without RoPE applied to keys")
        filled = [p for p in parts if len(p)] or [first]
        basis = filled[0].basis
        if any(not same_basis(basis, p.basis) for p in filled[1:]):
            basis = None
        return PositionedKVCache(
            [torch.cat([p.keys[i] for p in parts], dim=2) for i in range(first.num_layers)],
            [torch.cat([p.values[i] for p in parts], dim=2) for i in range(first.num_layers)],
            torch.cat([p.token_ids for p in parts], dim=1), torch.cat([p.positions for p in parts]),
            None if basis is None else basis[0], first.attention_factor if basis is None else basis[1],
            first.rope_applied, dict(first.meta))

    # ------------------------------------------------------------------ encoding
    @torch.no_grad()
    def extend(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
               *, return_hidden: bool = False) -> ForwardCost | tuple[ForwardCost, torch.Tensor]:
        """Run the decoder on `input_ids: [B, n]` attending to every cached slot plus causally to
        themselves, at `positions: [n]` (default `len(self)..len(self)+n-1`); append their K/V.

        Attention over cached slots is order-free (the position is inside the rotated key), so
        the new tokens see all cached slots whatever the slot order. Returns the cost, and with
        `return_hidden` the final hidden states `[B, n, d]` (after the last norm).
        """
        if not self.rope_applied:
            raise ValueError("HF attention needs keys stored after RoPE; this cache has rope_applied=False")
        B, n = input_ids.shape
        if B != self.token_ids.shape[0]:
            raise ValueError(f"input batch {B} != cache batch {self.token_ids.shape[0]}")
        dev = self.token_ids.device
        if positions is None:
            positions = torch.arange(len(self), len(self) + n, device=dev)
        positions = positions.to(device=dev, dtype=torch.long)
        if positions.shape != (n,):
            raise ValueError(f"positions must be [{n}], got {tuple(positions.shape)}")
        cost = ForwardCost(tokens=n, flops=forward_flops(model.config, n, len(self)))
        if n == 0:
            return (cost, torch.zeros(B, 0, model.config.hidden_size, device=dev)) if return_hidden else cost
        try:
            fwd_basis = rope_basis(model, int(positions.max()) + 1)
        except ValueError:  # basis not knowable (unpatched HF dynamic/longrope): record none
            fwd_basis = None
        if fwd_basis is None:
            self.inv_freq = None
        elif len(self) == 0:
            self.inv_freq, self.attention_factor = fwd_basis
        elif not same_basis(self.basis, fwd_basis):
            self.inv_freq = None  # the cache now mixes bases (length-dependent RoPE type)
        hf = self.to_hf()
        sync_device(dev)
        t0 = time.perf_counter()
        out = _decoder(model)(input_ids=input_ids.to(dev), position_ids=positions[None].expand(B, n),
                              past_key_values=hf, use_cache=True)
        sync_device(dev)
        cost.wall_s = time.perf_counter() - t0
        self.keys = [layer.keys for layer in hf.layers]
        self.values = [layer.values for layer in hf.layers]
        self.token_ids = torch.cat([self.token_ids, input_ids.to(dev)], dim=1)
        self.positions = torch.cat([self.positions, positions])
        return (cost, out.last_hidden_state) if return_hidden else cost

    @torch.no_grad()
    def extend_logits(self, model: nn.Module, input_ids: torch.Tensor,
                      positions: torch.Tensor | None = None) -> tuple[ForwardCost, torch.Tensor]:
        """`extend`, then the LM head on the last new token: returns `(cost, logits [B, vocab])`."""
        cost, h = self.extend(model, input_ids, positions, return_hidden=True)
        return cost, head_logits(model, h[:, -1])


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["ForwardCost", "PositionedKVCache", "forward_flops", "rope_basis"]
