"""The running batch's KV cache: per-row slots, keys rotated once, bounded where the method is.

Layout (stated once; `lcx.engine`'s docstring points here). Per layer, up to two stores of keys
and values `[B, H_kv, C, D]` (HF's head-major layout), with the position each slot holds,
`[B, C]` long, shared by every layer of a layer group (below; -1: empty):

    main  the window branch of the method's `DecodeRule`: a ring of `window` slots (a key at
          position p sits in slot p % window, so the key a step writes overwrites the one that
          just left the window) for bounded methods, or every key (slot p) for unbounded ones;
    side  the side branch: the first `side` positions (slot p; LM-Infinite's global keys,
          StreamingLLM's sinks) or every key (slot p; Self-Extend's grouped keys).

    LM-Infinite G=2, L=4, after position 9:   main  [8 9 6 7]  (slot p % 4)   side  [0 1]

**Per-layer layouts** (`KVLayout`, `ModelKV`): the layers of a model are grouped by what they
run, and each group has its own `CacheLayout` and its own stores (and slot positions). A model
whose layers are all alike is one group. A hybrid local/global model (Gemma 3) is two or more:
its sliding layers run their own window (a ring of `sliding_window` slots: KV constant in those
layers, even for the model as loaded) on their own RoPE base, its global layers the method (or
every key); with `layers="all"` every layer runs the method, still one group per RoPE base.
A decode step builds one `DecodeStep` per group (`ModelStep`); each layer attends with its own.

A position is a token's index in its request. Slot order carries no meaning to attention, a sum
over slots where each key carries its position in its rotation (LM-Infinite's top-k choice
breaks score ties by position; an unbounded store's slot is the position). So rows of different lengths
share the tensors without padding at the front (their unused slots are empty), a decode step
writes each row's new key into its own slot (`index_put`, no copy of the cache), and a bounded
method's cache never grows past window + side slots per row. Rows are the first B rows of buffers
with spare rows (`lcx.engine.slots.SlotStore`): a request joining the batch is copied into a spare
row, a finished one's row is refilled from the end of the batch (`ModelKV.drop`, whose new row
order the scheduler's running list follows), so neither copies the other rows' keys.

Two ways to decode (`CacheLayout`):

- **rotated** (the fast path; every method with a `DecodeRule` and a RoPE basis that does not
  change with the length). Main keys are stored rotated at their true positions, side keys at
  `side_key(p)`, once, when they enter. A step rotates only the new query (at p_q, and at
  `side_query(p_q)` for the side branch) and the new key, then runs one softmax over
  [main | side] per layer for the whole batch (`DecodeStep`). Unpatched models (vanilla, RoPE
  scaling) are the case window=None, no side, rotated by the model's own rotary embedding
  exactly as transformers rotates them; their layers with their own sliding window (Gemma 3's
  sliding layers, Mistral's `sliding_window`) a ring of that window (`CacheLayout.own_window`).
- **unrotated** (the general path: SWAT, methods without a rule, a length-dependent RoPE basis
  with an attention method, or an explicit `decode_backend`; one layout for every layer, keeping
  the union of the layers' windows, each layer's `attend` picking its own keys). Keys are stored
  unrotated; a step
  gathers each row's visible keys in position order and runs the method's own `attend` on them
  (`lcx.hf.attention_patch`, `lcx_key_positions`): exact for every method, at the cost of a copy
  and a rotation of the visible keys per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..rope import apply_rotary_ref, rope_cos_sin
from .decode_step import DecodeStep, ModelStep, decode_attention  # (the step: lcx.engine.decode_step)
from .slots import SlotStore, drop_order


# ============================================================================================
# Layout
# ============================================================================================

@dataclass(frozen=True)
class CacheLayout:
    """How the engine caches one model's keys (module docstring).

    window:  main store: a ring of `window` slots, or None: every key.
    side:    side store: 0 none, n: the first n positions, None: every key.
    rotated: keys stored rotated (fast path) or unrotated (general path).
    rule:    the method's `DecodeRule` (rotated layouts with an attention method), else None.
    basis:   (inv_freq [r/2] float64, attention_factor) lcx rotates with (rotated + a method);
             None: the model's own rotary embedding rotates (unpatched models).
    order:   the family's channel layout (`lcx.hf.channel_order.ChannelOrder`) when lcx rotates:
             keys arrive in the family's order and are stored rotated in lcx's; None: lcx's own.
    """

    window: int | None = None
    side: int | None = 0
    rotated: bool = True
    rule: Any = None
    basis: tuple[torch.Tensor, float] | None = None
    order: Any = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 or None, got {self.window}")
        if self.side not in (0, None) and self.side < 0:
            raise ValueError(f"side must be >= 0 or None, got {self.side}")

    @property
    def has_side(self) -> bool:
        return self.side != 0

    @classmethod
    def unpatched(cls) -> "CacheLayout":
        """A model without an attention method: every key, rotated by the model (as HF caches)."""
        return cls()

    @classmethod
    def own_window(cls, window: int) -> "CacheLayout":
        """A layer of an unpatched model that runs its own sliding window of `window` keys (the
        query and the window - 1 before it, as transformers' sliding masks): a ring of `window`
        slots, keys rotated by the model (the family's per-layer rotation)."""
        from ..methods.sliding_window import sliding_window

        return cls(window, 0, True, sliding_window(window=window).decode_rule(), None)

    @classmethod
    def general(cls, window: tuple[int, int] | None) -> "CacheLayout":
        """The general path (unrotated keys, gathered per step) keeping `window` (n_first,
        n_recent) per row, or every key for None."""
        if window is None:
            return cls(None, 0, False)
        n_first, n_recent = window
        return cls(n_recent, n_first, False)

    @classmethod
    def for_method(cls, method: Any, *, basis: tuple[torch.Tensor, float] | None,
                   general: bool = False, order: Any = None) -> "CacheLayout":
        """The layout of an `lcx.methods` attention method. `basis`: the model's RoPE basis when
        it does not depend on the length (None: it does, so keys cannot be rotated once);
        `general=True` forces the general path (e.g. an explicit decode backend)."""
        rule = None if general or basis is None else method.decode_rule()
        if rule is not None:  # (a top-k branch may pick any older key: the side store keeps them all)
            return cls(rule.window, None if rule.top_k else rule.side, True, rule, basis, order)
        return cls.general(method.cache_window)


@dataclass(frozen=True)
class KVLayout:
    """A model's cache layout: groups of layers, each with one `CacheLayout` (module docstring).

    groups: (layout, the model layers it holds, increasing) per group; every layer in one group.
    """

    groups: tuple[tuple[CacheLayout, tuple[int, ...]], ...]

    def __post_init__(self) -> None:
        layers = sorted(i for _, g in self.groups for i in g)
        if layers != list(range(len(layers))):
            raise ValueError(f"every layer must be in exactly one group; got {[g for _, g in self.groups]}")
        if len(self.groups) > 1 and not self.rotated:
            raise ValueError("the general path (unrotated keys) runs one layout on every layer")

    @classmethod
    def single(cls, layout: CacheLayout, n_layers: int) -> "KVLayout":
        return cls(((layout, tuple(range(n_layers))),))

    @property
    def rotated(self) -> bool:
        """The fast path (every group stores rotated keys)."""
        return all(lay.rotated for lay, _ in self.groups)

    @property
    def n_layers(self) -> int:
        return sum(len(g) for _, g in self.groups)

    def of_layer(self, layer: int) -> CacheLayout:
        return next(lay for lay, g in self.groups if layer in g)


# ============================================================================================
# The store
# ============================================================================================

class KVStore:
    """The running batch's cache in a `CacheLayout` (module docstring).

    Built from a prefill's left-padded cache (`from_prefill`), merged with newly prefilled rows
    (`cat`), narrowed to the rows still running (`rows`); `step(p_q)` makes the decode step's
    shared state. `budget [B]`: the most positions a row will ever hold (prompt + max_tokens),
    which caps how far an unbounded store grows.
    """

    def __init__(self, layout: CacheLayout, main: SlotStore, side: SlotStore | None, budget: torch.Tensor,
                 layers: tuple[int, ...] | None = None):
        self.layout, self.main, self.side, self.budget = layout, main, side, budget
        # the model layers this store holds, in the order of its per-layer lists (None: every
        # layer, list index = layer index)
        self.layers = layers
        self._local = None if layers is None else {layer: i for i, layer in enumerate(layers)}

    def local(self, layer: int) -> int:
        """Index of model layer `layer` in this store's per-layer lists."""
        return layer if self._local is None else self._local[layer]

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _plan(layout: CacheLayout, pos: torch.Tensor, budget: torch.Tensor) -> tuple:
        """What a prefill's rows keep, and in how many slots: (keep_main, C, side: (keep, Cs,
        ring, limit, rotation) or None, rotation of the main store)."""
        n = pos.max(1).values + 1  # [b] the next query of row b is at position n[b]
        valid = pos >= 0
        most = int(budget.max())  # no row ever holds more positions than its budget
        if layout.window is not None:
            keep_main = valid & (pos > n[:, None] - layout.window)
            C = min(layout.window, max(most, int(n.max()) + 1))  # a ring never wider than it can fill
        else:
            keep_main = valid
            C = _capacity(int(n.max()) + 1, 2 * int(n.max()), int(budget.max()))
        side = None
        if layout.has_side:
            if layout.side is None:  # every key (Self-Extend's grouped keys)
                keep_side, Cs = valid, _capacity(int(n.max()) + 1, 2 * int(n.max()), int(budget.max()))
            else:
                keep_side, Cs = valid & (pos < layout.side), min(layout.side, max(most, int(n.max()) + 1))
            side_key = layout.rule.side_key if layout.rule is not None else (lambda p: p)
            side = (keep_side, Cs, None, layout.side, _rotation(layout, side_key))
        return keep_main, C, side, _rotation(layout, lambda p: p)

    def has_room(self, layout: CacheLayout, b: int, plan: tuple) -> bool:
        """Whether b new rows of `plan` (`_plan`) fit this store's spare rows and slots in place."""
        _, C, side, _ = plan
        return (self.layout == layout and self.main.spare_rows >= b and self.main.capacity >= C
                and (side is None or (self.side is not None and self.side.spare_rows >= b
                                      and self.side.capacity >= side[1])))

    @classmethod
    def from_prefill(cls, layout: CacheLayout, keys: list[torch.Tensor], values: list[torch.Tensor],
                     pos: torch.Tensor, budget: torch.Tensor, layers: tuple[int, ...] | None = None,
                     into: "KVStore | None" = None, plan: tuple | None = None) -> "KVStore":
        """Rows prefilled together: keys/values per layer `[b, Hkv, T, D]` (unrotated for a patched
        model, rotated by HF for an unpatched one), pos `[b, T]` (-1: padding, anywhere: a row
        continued from held KV, `lcx.engine.prefix`, may hold only a bounded method's kept keys).
        `into`: a store of this layout with room for them (`has_room`): they are written into its
        spare rows in place (`_scatter`) and it is returned grown; else a new store."""
        keep_main, C, side, rotation = plan if plan is not None else cls._plan(layout, pos, budget)
        if into is not None and not into.has_room(layout, int(pos.shape[0]), (keep_main, C, side, rotation)):
            into = None
        main = _scatter(keys, values, pos, keep_main, C, layout.window, None, rotation,
                        into.main if into is not None else None)
        side_store = None if side is None else _scatter(keys, values, pos, *side,
                                                        into=into.side if into is not None else None)
        if into is not None:
            into.budget = torch.cat([into.budget, budget.to(into.budget.device)])
            return into
        return cls(layout, main, side_store, budget.to(pos.device), layers)

    def append(self, other: "KVStore") -> None:
        """Add `other`'s rows after this store's, in place (`SlotStore.append`)."""
        self.main.append(other.main)
        if self.side is not None:
            self.side.append(other.side)
        self.budget = torch.cat([self.budget, other.budget])

    def move(self, dst: list[int], src: list[int], n: int) -> None:
        """Rows `src` into rows `dst`, then the first n kept, in place (`SlotStore.move`)."""
        self.main.move(dst, src, n)
        if self.side is not None:
            self.side.move(dst, src, n)
        if dst:
            self.budget[torch.tensor(dst)] = self.budget[torch.tensor(src)]
        self.budget = self.budget[:n]

    @staticmethod
    def cat(parts: list["KVStore"]) -> "KVStore":
        side = SlotStore.cat([p.side for p in parts]) if parts[0].side is not None else None
        return KVStore(parts[0].layout, SlotStore.cat([p.main for p in parts]), side,
                       torch.cat([p.budget for p in parts]), parts[0].layers)

    def rows(self, rows: list[int]) -> "KVStore":
        sel = torch.tensor(rows, device=self.main.pos.device)
        return KVStore(self.layout, self.main.rows(sel), None if self.side is None else self.side.rows(sel),
                       self.budget[sel], self.layers)

    # ------------------------------------------------------------------ sizes
    @property
    def batch(self) -> int:
        return int(self.main.pos.shape[0])

    def nbytes(self) -> int:
        return self.main.nbytes() + (self.side.nbytes() if self.side is not None else 0)

    @property
    def slots(self) -> int:
        """Slots per row (main + side capacity)."""
        return self.main.capacity + (self.side.capacity if self.side is not None else 0)

    def layer_nbytes(self, i: int) -> int:
        """Bytes of the keys and values of this store's i-th layer (all rows)."""
        st = [self.main] + ([self.side] if self.side is not None else [])
        return sum(x.k[i].nbytes + x.v[i].nbytes for x in st)

    def held(self) -> torch.Tensor:
        """Keys each row holds `[B]` (a key in both stores counts twice)."""
        n = (self.main.pos >= 0).sum(1)
        return n + (self.side.pos >= 0).sum(1) if self.side is not None else n

    # ------------------------------------------------------------------ a decode step
    def step(self, p_q: torch.Tensor) -> "StepSlots":
        """Reserve the slots of each row's new key at position p_q `[B]` (growing unbounded
        stores, within `budget`), record the positions, and return what every layer needs."""
        B = self.batch
        ar = torch.arange(B, device=p_q.device)
        for st in (self.main, self.side):
            if st is None:
                continue
            writes = p_q if st.limit is None else p_q[p_q < st.limit]
            need = int(st.slot(writes).max()) + 1 if writes.numel() else 0
            if need > st.capacity:  # unbounded: double (within the budget); bounded: up to ring/limit
                st.grow(_capacity(need, 2 * st.capacity, int(self.budget.max()))
                        if st.ring is None and st.limit is None else need)
        slot = self.main.slot(p_q)
        self.main.pos[ar, slot] = p_q
        side_rows = side_slot = None
        if self.side is not None:
            writes = p_q < self.side.limit if self.side.limit is not None else torch.ones_like(p_q, dtype=torch.bool)
            side_rows = writes.nonzero().squeeze(1)
            side_slot = p_q[side_rows]
            if side_rows.numel():
                self.side.pos[side_rows, side_slot] = side_slot
        return StepSlots(self, p_q, ar, slot, side_rows, side_slot)

    # ------------------------------------------------------------------ the general path
    def gathered(self, p_q: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Each row's keys visible to its query at p_q (before the new key), in position order,
        left-padded: (keys, values per layer `[B, Hkv, T, D]`, positions `[B, T]`, -1 padding)."""
        lay = self.layout
        pos = self.main.pos
        if lay.window is not None:
            pos = pos.masked_fill(pos <= p_q[:, None] - lay.window, -1)  # the slot the new key overwrites
        ks, vs = self.main.k, self.main.v
        if self.side is not None:
            side_pos = self.side.pos
            if lay.window is not None:  # inside the window the main store has them
                side_pos = side_pos.masked_fill(side_pos > p_q[:, None] - lay.window, -1)
            pos = torch.cat([side_pos, pos], 1)
            ks = [torch.cat([a, b], 2) for a, b in zip(self.side.k, ks)]
            vs = [torch.cat([a, b], 2) for a, b in zip(self.side.v, vs)]
        order = pos.argsort(dim=1, stable=True)  # -1 first: left padding
        T = int((pos >= 0).sum(1).max())
        order = order[:, pos.shape[1] - T:]
        pos = pos.gather(1, order)
        idx = order[:, None, :, None]

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.gather(2, idx.expand(t.shape[0], t.shape[1], T, t.shape[3]))

        return [take(t) for t in ks], [take(t) for t in vs], pos

    def write_unrotated(self, slots: "StepSlots", keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store the step's new keys/values `[B, Hkv, D]` per layer (general path: unrotated)."""
        for layer, (k, v) in enumerate(zip(keys, values)):
            slots.write(layer, k, v, k)


def _capacity(need: int, grown: int, budget: int) -> int:
    """Slots for an unbounded store: at least `need`, doubling when it grows, never past the
    rows' budget (unless `need` is)."""
    return max(need, min(grown, budget))


def _rotation(layout: CacheLayout, positions: Callable[[torch.Tensor], torch.Tensor]) -> Callable | None:
    """(x `[N, Hkv, D]`, p `[N]`) -> x rotated to positions(p); None where keys are kept as
    they are (unrotated layouts, and unpatched models, whose keys HF already rotated)."""
    if not layout.rotated or layout.basis is None:
        return None
    return lambda x, p: rotate_rows(x, positions(p.to(torch.float64)), layout.basis, layout.order)


def rotate_rows(x: torch.Tensor, positions: torch.Tensor, basis: tuple[torch.Tensor, float],
                order: Any = None) -> torch.Tensor:
    """x `[N, Hkv, D]` (one token per row) rotated to float64 positions `[N]` with lcx's tables
    (angles in float64, applied in max(float32, x.dtype), as every lcx.attention call rotates).
    With a family's channel `order` (`lcx.hf.channel_order.ChannelOrder`), x arrives in the
    family's order and leaves rotated in lcx's, as the decode step writes its keys."""
    inv_freq, af = basis
    if order is not None:
        x, inv_freq = order.to_lcx(x), order.basis(inv_freq)
    cos, sin = rope_cos_sin(positions, inv_freq.to(x.device), af, torch.promote_types(x.dtype, torch.float32))
    return apply_rotary_ref(x, cos, sin)  # [N, Hkv, D] read as [T=N, H, D]


def _scatter(keys, values, pos, keep, C: int, ring: int | None, limit: int | None,
             rotation: Callable | None, into: SlotStore | None = None) -> SlotStore:
    """The kept slots (`keep [b, T]`) of a left-padded prefill cache, moved into a store of C
    slots (slot p % ring, or p), keys rotated by `rotation` on the way. Where every row keeps the
    same run of consecutive positions landing on consecutive slots (`_one_run`: rows of one
    length, no wrap of a ring), they move as one slice per layer, not by gathering each slot (the
    same values). `into`: a store of the same kind with b spare rows and at least C slots, whose
    spare rows take the new rows in place (returned, its rows grown; the running batch's or a
    parked store's buffers, memory already paged in), else None or no room: a new store."""
    b_idx, t_idx = keep.nonzero(as_tuple=True)
    p = pos[b_idx, t_idx]
    s_idx = p % ring if ring is not None else p
    B = pos.shape[0]
    room = (into is not None and into.ring == ring and into.limit == limit and into.spare_rows >= B
            and into.capacity >= C)
    Ct = into.capacity if room else C  # (slots C..Ct of the new rows: empty)
    if room:
        k_rows, v_rows, out_pos = into.spare(B)
        out_pos.fill_(-1)
    else:
        out_pos = torch.full((B, C), -1, dtype=torch.long, device=pos.device)
    out_pos[b_idx, s_idx] = p
    run = _one_run(pos, keep, ring, C)
    ks, vs = [], []
    for i, (k, v) in enumerate(zip(keys, values)):
        if room:
            kk, vv = k_rows[i], v_rows[i]
        else:
            kk, vv = k.new_empty(B, k.shape[1], C, k.shape[3]), v.new_empty(B, v.shape[1], C, v.shape[3])
        if run is None:
            kk.zero_()
            vv.zero_()
            src = k[b_idx, :, t_idx]  # [N, Hkv, D]
            kk[b_idx, :, s_idx] = src if rotation is None else rotation(src, p)
            vv[b_idx, :, s_idx] = v[b_idx, :, t_idx]
        else:  # one slice; only the slots outside it zeroed
            t0, s0, n = run
            for x in (kk, vv):
                x[:, :, :s0].zero_()
                x[:, :, s0 + n:Ct].zero_()
            kk[:, :, s0:s0 + n] = k[:, :, t0:t0 + n] if rotation is None else _rotated(
                k[:, :, t0:t0 + n], pos[:, t0:t0 + n], rotation)
            vv[:, :, s0:s0 + n] = v[:, :, t0:t0 + n]
        ks.append(kk)
        vs.append(vv)
    if room:
        into.grow_rows(B)
        return into
    return SlotStore(ks, vs, out_pos, ring, limit)


def _one_run(pos: torch.Tensor, keep: torch.Tensor, ring: int | None, C: int) -> tuple[int, int, int] | None:
    """(t0, s0, n) where every row keeps exactly slots t0 .. t0 + n - 1 (n > 0), at the same
    consecutive positions, landing on slots s0 .. s0 + n - 1 (slot p % ring, or p) without wrapping
    or passing C; else None."""
    n = int(keep[0].sum())
    if n == 0 or not bool((keep.sum(1) == n).all()):
        return None
    t0 = int(keep[0].int().argmax())
    p0 = int(pos[0, t0])
    if not bool(keep[:, t0:t0 + n].all()) or not torch.equal(
            pos[:, t0:t0 + n], (p0 + torch.arange(n, device=pos.device)).expand(pos.shape[0], n)):
        return None
    s0 = p0 % ring if ring is not None else p0
    return (t0, s0, n) if s0 + n <= min(C, ring if ring is not None else C) else None


def _rotated(k: torch.Tensor, p: torch.Tensor, rotation: Callable) -> torch.Tensor:
    """k `[b, Hkv, n, D]` at positions p `[b, n]` through `rotation` (`[N, Hkv, D]`, `[N]`)."""
    b, h, n, d = k.shape
    out = rotation(k.transpose(1, 2).reshape(b * n, h, d), p.reshape(-1))
    return out.reshape(b, n, h, d).transpose(1, 2)


# ============================================================================================
# A decode step
# ============================================================================================

@dataclass
class StepSlots:
    """The slots one decode step writes (`KVStore.step`): every row's main slot, and the rows
    (and slots) that also write a side key."""

    store: KVStore
    p_q: torch.Tensor  # [B] positions of the new tokens
    ar: torch.Tensor  # [B] arange
    slot: torch.Tensor  # [B] main slot of each row
    side_rows: torch.Tensor | None  # [n] rows writing a side key
    side_slot: torch.Tensor | None  # [n]

    def write(self, layer: int, k_main: torch.Tensor, v: torch.Tensor, k_side: torch.Tensor | None) -> None:
        """New keys/values `[B, Hkv, D]` (k_side: `[n, Hkv, D]` for the side rows, or the full
        `[B, ...]` tensor to take them from)."""
        st = self.store
        st.main.k[layer][self.ar, :, self.slot] = k_main
        st.main.v[layer][self.ar, :, self.slot] = v
        if st.side is not None and self.side_rows.numel():
            ks = k_side if k_side.shape[0] == self.side_rows.numel() else k_side[self.side_rows]
            st.side.k[layer][self.side_rows, :, self.side_slot] = ks
            st.side.v[layer][self.side_rows, :, self.side_slot] = v[self.side_rows]


# ============================================================================================
# A whole model: one store per group of layers
# ============================================================================================

class ModelKV:
    """The running batch's cache of a whole model in a `KVLayout`: one `KVStore` per group of
    layers (module docstring), every group holding the same rows in the same order. The engine's
    only handle on its cache: built from a prefill (`from_prefill`), merged (`cat`), narrowed
    (`rows`), stepped (`decode_step` on the fast path; `only` is the one store of the general
    path)."""

    def __init__(self, layout: KVLayout, parts: list[KVStore]):
        self.layout, self.parts = layout, parts

    @classmethod
    def from_prefill(cls, layout: KVLayout, keys: list[torch.Tensor], values: list[torch.Tensor],
                     pos: torch.Tensor, budget: torch.Tensor, into: "ModelKV | None" = None) -> "ModelKV":
        """Rows prefilled together: keys/values per model layer `[b, Hkv, T, D]`, pos `[b, T]`
        (`KVStore.from_prefill`); each group keeps what its layout keeps of its layers. `into`: a
        store of this layout (the running batch's, or a parked one) whose spare rows take the rows
        in place where every group has room: returned grown; else a new store."""
        plans = [KVStore._plan(lay, pos, budget) for lay, _ in layout.groups]
        b = int(pos.shape[0])
        if into is not None and not (into.layout == layout and all(
                p.has_room(lay, b, plan) for p, (lay, _), plan in zip(into.parts, layout.groups, plans))):
            into = None  # not every group has room: a new store (the caller appends it)
        parts = [KVStore.from_prefill(lay, [keys[i] for i in g], [values[i] for i in g], pos, budget, layers=g,
                                      into=into.parts[j] if into is not None else None, plan=plans[j])
                 for j, (lay, g) in enumerate(layout.groups)]
        return into if into is not None else cls(layout, parts)

    @staticmethod
    def cat(parts: list["ModelKV"]) -> "ModelKV":
        return ModelKV(parts[0].layout, [KVStore.cat([p.parts[j] for p in parts]) for j in range(len(parts[0].parts))])

    def rows(self, rows: list[int]) -> "ModelKV":
        return ModelKV(self.layout, [p.rows(rows) for p in self.parts])

    def append(self, other: "ModelKV") -> None:
        """`other`'s rows join after these, in place: only they are copied (`SlotStore.append`)."""
        for p, q in zip(self.parts, other.parts):
            p.append(q)

    def drop(self, rows: list[int]) -> list[int]:
        """Drop these rows in place, each hole filled by a live row from the end of the batch (so
        at most as many rows move as are dropped, whatever their place); returns the rows' new
        order as old indices (`drop_order`), which the scheduler's running list follows."""
        n, dst, src, order = drop_order(self.batch, rows)
        for p in self.parts:
            p.move(dst, src, n)
        return order

    @property
    def only(self) -> KVStore:
        """The one store of a single-group layout (the general path)."""
        if len(self.parts) != 1:
            raise RuntimeError(f"this cache has {len(self.parts)} layer groups, not one")
        return self.parts[0]

    @property
    def batch(self) -> int:
        return self.parts[0].batch

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    @property
    def slots(self) -> int:
        """Slots per row of the widest layer (`layer_slots` gives every layer's)."""
        return max(p.slots for p in self.parts)

    def layer_slots(self) -> list[int]:
        """Slots per row of each model layer (main + side capacity of its group)."""
        out = [0] * self.layout.n_layers
        for p, (_, g) in zip(self.parts, self.layout.groups):
            for layer in g:
                out[layer] = p.slots
        return out

    def layer_nbytes(self) -> list[int]:
        """Bytes of each model layer's keys and values (all rows)."""
        out = [0] * self.layout.n_layers
        for p, (_, g) in zip(self.parts, self.layout.groups):
            for i, layer in enumerate(g):
                out[layer] = p.layer_nbytes(i)
        return out

    def held(self) -> torch.Tensor:
        """Keys each row holds in its widest layer `[B]`."""
        return torch.stack([p.held() for p in self.parts]).max(0).values

    def decode_step(self, p_q: torch.Tensor, dtype: torch.dtype) -> "ModelStep":
        """The fast path's step for new tokens at p_q `[B]`: one `DecodeStep` per group."""
        steps = [DecodeStep.build(p, p_q, dtype) for p in self.parts]
        return ModelStep({layer: st for st, (_, g) in zip(steps, self.layout.groups) for layer in g})


__all__ = ["CacheLayout", "DecodeStep", "KVLayout", "KVStore", "ModelKV", "ModelStep", "StepSlots", "decode_attention",
           "drop_order", "rotate_rows"]
