"""Editing a prefilled KV cache: `Edit`s and three update strategies (PIE, arXiv 2407.03157).

An `Edit(start, end, new_token_ids)` replaces the original tokens `[start, end)` by
`new_token_ids`: an insertion has `start == end`, a deletion no new tokens, an empty edit
neither. Several edits are given in ORIGINAL coordinates, sorted and non-overlapping
(`end_i <= start_{i+1}`; list order breaks ties at one point), and applied left to right, each
shifted by the length change of those before it::

    old   a b c d e f g h            Edit(2, 4, "XYZ"), Edit(6, 7, "")
          0 1 2 3 4 5 6 7
    new   a b X Y Z e f h            new positions of kept tokens: a0 b1 e5 f6 h7 (delta +1, +1, 0)

Strategies (registry `EDIT_STRATEGIES`, each `fn(model, cache, edits, *, backend) -> EditResult`):

- `recompute`: keep the cache before the first edit, re-encode every token from there on.
  Exact: equals prefilling the edited sequence (the baseline).
- `pie`: encode only the new tokens of each edit (each span sees every slot before it), and
  re-rotate every kept key whose position moved by its delta, `k <- R(delta) k`, in place;
  values and the deeper-layer content of kept tokens are not recomputed. In layer 0 the result
  equals `recompute` for kept tokens (layer-0 K/V depend only on token and position); in
  deeper layers it is an approximation.
- `conflict`: like `pie` without the re-rotation: kept keys keep their stale positions
  (duplicated or skipped positions after the edit): the failure PIE fixes.

All positions after an edit are indices in the new sequence (the next token fed is at
`len(cache)`); `cache.positions` records what each key is rotated with, so after `conflict`
it holds the stale positions. A strategy consumes its input cache (pie rotates its keys in
place); call `cache.clone()` first to keep it.

Length-dependent RoPE types (dynamic NTK, longrope) choose a basis per forward from max
position + 1, so which basis a key carries depends on the forward that wrote it. PIE here is
defined in the cache's one basis: `pie` raises ValueError when the cache does not have a single
basis or when encoding an edited span would use another basis (e.g. dynamic beyond L, or a
longrope edit below L in a cache longer than L); `recompute` re-encodes from position 0 when
the edited sequence's basis differs from the cache's, so it stays equal to a fresh prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from ..hf.models import model_shape
from ..hf.rope_patch import rope_basis
from .kv import ForwardCost, PositionedKVCache, same_basis, sync_device
from .rerotate import rerotate


@dataclass(frozen=True)
class Edit:
    """Replace original tokens `[start, end)` by `new_token_ids` (see the module docstring)."""

    start: int
    end: int
    new_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ids = self.new_token_ids
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        object.__setattr__(self, "new_token_ids", tuple(int(i) for i in ids))
        if not (isinstance(self.start, int) and isinstance(self.end, int)):
            raise ValueError(f"Edit start/end must be ints, got {self.start!r}, {self.end!r}")
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"Edit needs 0 <= start <= end, got start={self.start}, end={self.end}")

    @property
    def is_empty(self) -> bool:
        return self.start == self.end and not self.new_token_ids

    @property
    def length_change(self) -> int:
        return len(self.new_token_ids) - (self.end - self.start)


@dataclass(frozen=True)
class Segment:
    """A run of the edited sequence: kept old slots `[old_start, old_end)` or new tokens."""

    new_start: int
    old_start: int | None = None  # None for new tokens
    old_end: int | None = None
    new_token_ids: tuple[int, ...] = ()

    @property
    def is_new(self) -> bool:
        return self.old_start is None

    def __len__(self) -> int:
        return len(self.new_token_ids) if self.is_new else self.old_end - self.old_start


@dataclass(frozen=True)
class EditPlan:
    """Where every old slot goes and which new spans must be encoded.

    `new_position[j]` is the new index of old slot j, or -1 if it is removed. `segments` cover
    the edited sequence in order. `first_change` is the first index (old == new there) at which
    the sequences may differ; every slot before it is untouched by every strategy.
    """

    n_old: int
    n_new: int
    new_position: torch.Tensor  # [n_old] int64
    segments: tuple[Segment, ...]
    first_change: int


def plan_edits(n_old: int, edits: Sequence[Edit]) -> EditPlan:
    """Validate `edits` against a sequence of `n_old` tokens and lay out the edited sequence."""
    edits = [e for e in edits if not e.is_empty]
    prev_end = 0
    for i, e in enumerate(edits):
        if e.end > n_old:
            raise ValueError(f"edit {i} ({e.start}, {e.end}) runs past the {n_old} cached tokens")
        if e.start < prev_end:
            raise ValueError(f"edits must be sorted and non-overlapping in original coordinates: "
                             f"edit {i} starts at {e.start} before the previous one ends at {prev_end}")
        prev_end = e.end
    new_position = torch.full((n_old,), -1, dtype=torch.long)
    segments: list[Segment] = []
    old, new = 0, 0  # cursor in old and new coordinates
    for e in edits:
        if e.start > old:
            segments.append(Segment(new, old, e.start))
            new_position[old:e.start] = torch.arange(new, new + e.start - old)
            new += e.start - old
        if e.new_token_ids:
            segments.append(Segment(new, new_token_ids=e.new_token_ids))
            new += len(e.new_token_ids)
        old = e.end
    if old < n_old:
        segments.append(Segment(new, old, n_old))
        new_position[old:] = torch.arange(new, new + n_old - old)
        new += n_old - old
    first_change = edits[0].start if edits else n_old
    return EditPlan(n_old, new, new_position, tuple(segments), first_change)


def apply_edits(token_ids: Sequence[int], edits: Sequence[Edit]) -> list[int]:
    """The edited token list (the same plan the cache strategies follow)."""
    plan = plan_edits(len(token_ids), edits)
    out: list[int] = []
    for s in plan.segments:
        out.extend(s.new_token_ids if s.is_new else token_ids[s.old_start:s.old_end])
    return out


@dataclass
class EditCost:
    """What an update cost: tokens encoded, slots whose keys were re-rotated (in every layer),
    FLOPs, wall time.

    `flops` = decoder FLOPs of the encoded tokens (`lcx.cache.kv.forward_flops`) + 6 per rotated
    pair and layer-head for the re-rotation (4 multiplies, 2 adds; trig not counted).
    `wall_s` covers the whole update (forwards, rotation, reassembly), measured after syncing.
    """

    strategy: str
    tokens_encoded: int = 0
    rotated_slots: int = 0
    flops: float = 0.0
    wall_s: float = 0.0
    details: dict = field(default_factory=dict)


@dataclass
class EditResult:
    cache: PositionedKVCache
    cost: EditCost


def _single_batch(cache: PositionedKVCache) -> torch.Tensor:
    if cache.token_ids.shape[0] != 1:
        raise ValueError(f"cache edits are per sequence: need batch size 1, got {cache.token_ids.shape[0]}")
    return cache.token_ids[0]


def _encode_spans(model: nn.Module, plan: EditPlan, kept: PositionedKVCache, cost: EditCost) -> PositionedKVCache:
    """Assemble the edited cache: kept slots (already rotated or not, by the caller) in new order
    and each new span encoded against every slot before it. `kept` holds the old slots."""
    pieces: list[PositionedKVCache] = []
    work: PositionedKVCache | None = None
    fwd = ForwardCost()
    for seg in plan.segments:
        if not seg.is_new:
            pieces.append(kept.select(slice(seg.old_start, seg.old_end)))
            continue
        work = PositionedKVCache.cat(pieces) if pieces else PositionedKVCache.empty(model)
        ids = torch.tensor([seg.new_token_ids], dtype=torch.long, device=kept.token_ids.device)
        pos = torch.arange(seg.new_start, seg.new_start + len(seg), device=kept.token_ids.device)
        fwd.add(work.extend(model, ids, pos))
        pieces = [work]
    cost.tokens_encoded += fwd.tokens
    cost.flops += fwd.flops
    return PositionedKVCache.cat(pieces) if pieces else kept.select(slice(0, 0))  # all deleted


def _rotation_flops(cache: PositionedKVCache, n_slots: int) -> float:
    if not cache.num_layers or cache.inv_freq is None:
        return 0.0
    B, Hkv = cache.keys[0].shape[:2]
    return 6.0 * B * Hkv * cache.inv_freq.shape[0] * n_slots * cache.num_layers


def _basis_or_none(model: nn.Module, seq_len: int) -> tuple[torch.Tensor, float] | None:
    try:
        return rope_basis(model, seq_len)
    except ValueError:
        return None


def edit_recompute(model: nn.Module, cache: PositionedKVCache, edits: Sequence[Edit], *,
                   backend: str = "ref") -> EditResult:
    """Exact baseline: keep slots before the first edit, re-encode everything after it.

    If the RoPE basis of the edited length differs from the cache's (length-dependent types), the
    kept prefix is in the wrong basis too and everything is re-encoded from position 0.
    """
    ids_old = _single_batch(cache)
    plan = plan_edits(len(cache), edits)
    cost = EditCost("recompute")
    dev = ids_old.device
    sync_device(dev)
    t0 = time.perf_counter()
    new_ids = torch.tensor([apply_edits(ids_old.tolist(), edits)], dtype=torch.long, device=dev)
    start = plan.first_change
    if plan.n_new and start > 0 and not same_basis(cache.basis, _basis_or_none(model, plan.n_new)):
        start, cost.details["reencoded_from_zero"] = 0, "the RoPE basis changed with the length (or is unknown)"
    if plan.n_new == plan.n_old == start:  # nothing changed
        out = cache
    else:
        out = cache.select(slice(0, start))
        fwd = out.extend(model, new_ids[:, start:], torch.arange(start, plan.n_new, device=dev))
        cost.tokens_encoded, cost.flops = fwd.tokens, fwd.flops
    sync_device(dev)
    cost.wall_s = time.perf_counter() - t0
    return EditResult(out, cost)


def _check_pie_basis(model: nn.Module, cache: PositionedKVCache, plan: EditPlan) -> None:
    if not cache.rope_applied:
        return
    shape = model_shape(model)
    if shape.rotary_dim != shape.head_dim:
        raise ValueError(f"pie: this model rotates {shape.rotary_dim} of its {shape.head_dim} head channels "
                         "(partial rotary); PIE re-rotates whole heads; use strategy='recompute'")
    if not cache.has_single_basis:
        raise ValueError("pie: the cached keys have no one known RoPE basis (a length-dependent RoPE type "
                         "changed basis between forwards, or an unpatched model's rotary module hides it), "
                         "so a position delta has no single rotation; use strategy='recompute'")
    hint = ("(length-dependent RoPE type: dynamic NTK beyond L, or longrope across L); "
            "use strategy='recompute'")
    if plan.n_new and not same_basis(cache.basis, rope_basis(model, plan.n_new)):  # may raise: unknown basis
        raise ValueError(f"pie: the edited length {plan.n_new} has another RoPE basis than the cached "
                         f"keys (written at length {plan.n_old}) {hint}")
    for seg in plan.segments:
        if seg.is_new and not same_basis(cache.basis, rope_basis(model, seg.new_start + len(seg))):
            raise ValueError(
                f"pie: encoding the edited span at positions {seg.new_start}..{seg.new_start + len(seg) - 1} "
                f"uses another RoPE basis than the cached keys {hint}")


def edit_pie(model: nn.Module, cache: PositionedKVCache, edits: Sequence[Edit], *,
             backend: str = "ref") -> EditResult:
    """PIE: re-rotate moved keys in place by their position delta, encode only the new tokens.

    `backend` picks the re-rotation kernel (`lcx.cache.rerotate.REROTATE_BACKENDS`).
    """
    _single_batch(cache)
    plan = plan_edits(len(cache), edits)
    _check_pie_basis(model, cache, plan)
    cost = EditCost("pie")
    dev = cache.token_ids.device
    sync_device(dev)
    t0 = time.perf_counter()
    old_pos = cache.positions
    new_pos = plan.new_position.to(dev)
    # target minus the position each key actually carries: also repairs stale (conflict) slots
    delta = torch.where(new_pos >= 0, new_pos - old_pos, 0)  # [n_old]
    moved = (delta != 0).nonzero()
    if len(moved) and cache.rope_applied:
        lo = int(moved[0])  # rotate the contiguous tail of slots from the first moved one
        d = delta[lo:]
        for k in cache.keys:  # k: [B, H_kv, T, D]; the kernel takes the [B, T, H, D] view
            rerotate(k.transpose(1, 2)[:, lo:], d, cache.inv_freq, backend=backend)
        cost.rotated_slots = int((d != 0).sum())
        cost.flops += _rotation_flops(cache, cost.rotated_slots)
    cache.positions = torch.where(new_pos >= 0, new_pos, old_pos)  # removed slots are dropped below
    out = _encode_spans(model, plan, cache, cost)
    sync_device(dev)
    cost.wall_s = time.perf_counter() - t0
    return EditResult(out, cost)


def edit_conflict(model: nn.Module, cache: PositionedKVCache, edits: Sequence[Edit], *,
                  backend: str = "ref") -> EditResult:
    """Conflict fast encoding: encode only the new tokens at their new positions, leave kept keys
    (and their recorded positions) stale. `backend` is accepted for a uniform signature."""
    _single_batch(cache)
    plan = plan_edits(len(cache), edits)
    cost = EditCost("conflict")
    dev = cache.token_ids.device
    sync_device(dev)
    t0 = time.perf_counter()
    out = _encode_spans(model, plan, cache, cost)
    sync_device(dev)
    cost.wall_s = time.perf_counter() - t0
    return EditResult(out, cost)


EditStrategy = Callable[..., EditResult]
EDIT_STRATEGIES: dict[str, EditStrategy] = {
    "recompute": edit_recompute,
    "pie": edit_pie,
    "conflict": edit_conflict,
}


def update_cache(model: nn.Module, cache: PositionedKVCache, edits: Sequence[Edit], *,
                 strategy: str = "pie", backend: str = "ref") -> EditResult:
    """Apply `edits` to `cache` with `EDIT_STRATEGIES[strategy]` (consumes `cache`)."""
    if strategy not in EDIT_STRATEGIES:
        raise ValueError(f"unknown edit strategy {strategy!r}; known: {sorted(EDIT_STRATEGIES)}")
    return EDIT_STRATEGIES[strategy](model, cache, edits, backend=backend)


__all__ = ["EDIT_STRATEGIES", "Edit", "EditCost", "EditPlan", "EditResult", "Segment", "apply_edits",
           "edit_conflict", "edit_pie", "edit_recompute", "plan_edits", "update_cache"]
