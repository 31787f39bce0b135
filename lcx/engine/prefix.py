"""Prefill continuing from held KV (chunked prefill) and the automatic prefix cache.

A row's *prefill-form* KV (`RowKV`) is what the model's forward reads back from an HF cache:
per layer keys/values `[Hkv, n, D]` and the position of each slot `[n]`: keys UNROTATED for a
model patched with an attention method (`lcx.hf.attention_patch` caches keys before RoPE),
rotated by the model for an unpatched one. A prefill call continues from it: the held slots go
in as the call's cache, the new tokens as its queries, each row's key positions as
`lcx_key_positions` (patched) or a 2D attention mask (unpatched); the queries are the last keys
of the call (`lcx.masks` convention), so a prompt cut into calls computes what one call computes
where the method allows it:

- **Which prompts may be cut or reused** (`reuse_refusal`): every query's output must depend only
  on the keys up to it, not on what follows it. True for causal attention with a static RoPE
  basis and every registered attention method whose `call_dependence` is None. Refused (one
  call per prompt, the cache bypassed, the reason in `Engine.prefix_cache_refusal`): a RoPE
  basis that follows the length (`RopeSpec.is_length_dependent`: dynamic NTK, longrope), a
  method whose rows depend on the call's length (LM-Infinite with limit_distance > n_local). An
  unpatched model with its own sliding windows (Gemma 3's sliding layers, Mistral) is cut and
  reused like any other: a continuation's masks are built from the slots' positions per layer
  type (`lcx.engine.runner.position_masks`), since HF's, by slot index, would shift a window
  across the padding between held and new slots. A method whose last query of a call sees more
  (`last_query_extra`, LM-Infinite's top-k) is never cut, but may reuse a prefix: the cache holds
  only rows that were not the last of their call (below).
- **Bounded methods hold bounded KV**: after each call a row keeps only the keys its next query
  can see, `lcx.hf.bounded_cache.kept_slots` (the first n_first and the last n_recent - 1
  positions; `MethodConfig.kv_window`), so a 16k-token prompt prefilled in chunks under
  LM-Infinite holds G + L - 1 keys per layer between chunks, exactly as the bounded cache does.
  The prefill form is one set of slots for every layer, so on a model whose layers differ
  (Gemma 3's sliding layers and the method on the global ones) it keeps the union of the
  layers' windows (first max n_first, last max n_recent - 1); each layer's attention picks its
  own keys from them. The decode cache is bounded per layer (`lcx.engine.kv`).

The prefix cache (`PrefixCache`, vLLM's automatic prefix caching on lcx's layout). A prompt's KV
is kept in blocks of `block_size` tokens; block j is keyed by a hash chained over the tokens
before it, (key of block j - 1, tokens of block j), from a root that hashes the engine's method
config (`Engine.methods_info()`: the attention method, the resolved RoPE spec, the KV window),
the model and its dtype, so KV filled under one method or RoPE spec is never read under another.
Each block stores its tokens and its parent's key and a lookup compares them, so a hash
collision is a miss, never a wrong hit. Only blocks of positions < T - 1 of a prompt of T tokens
are stored (the last prompt token is the last query of its call, and at least one token is
always computed to give the first logits). A new request walks the chain over its prompt and
reuses the longest run of cached blocks, then prefills only the rest; a request that asks for
prompt logprobs computes every prompt token (it still fills the cache). Eviction is LRU in
bytes (`max_bytes`); a hit refreshes its blocks deepest first, so a chain is evicted from its
tail, and a prompt never evicts its own chain to make room for itself: one whose KV exceeds the
bound keeps its first blocks and drops the rest (`dropped_blocks`), since a block whose parent is
gone is one no lookup reaches. A bounded method reads back only the blocks its continuation can
see (those overlapping the first n_first positions and the last n_recent - 1): the store keeps every block because
any block may end some later request's shared prefix, but a continuation holds what the method
can still see. Exact by construction: a reused block holds the very keys/values the request's
own whole-prompt prefill would compute (tests/engine/test_prefix_cache.py, every registered
method and RoPE type, greedy tokens and logprobs with and without the cache).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class RowKV:
    """One row's held KV in prefill form (module docstring): per layer k `[Hkv, n, D]`, v
    `[Hkv, n, Dv]`, positions `[n]` (long, increasing; [first n_first | a contiguous run])."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    pos: torch.Tensor

    @property
    def slots(self) -> int:
        return int(self.pos.shape[0])

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    def kept(self, next_position: int, window: tuple[int, int] | None) -> "RowKV":
        """Only the slots a query at `next_position` can still see under a bounded method's
        `window` (n_first, n_recent) (`kept_slots`); the whole row for None."""
        if window is None:
            return self
        from ..hf.bounded_cache import kept_slots

        keep = kept_slots(self.pos, next_position, *window)
        if bool(keep.all()):
            return self
        idx = keep.nonzero().squeeze(1)
        return RowKV([t.index_select(1, idx) for t in self.k], [t.index_select(1, idx) for t in self.v],
                     self.pos[idx])


def stack_rows(rows: Sequence[RowKV | None], n_layers: int, like: tuple[torch.Tensor, torch.Tensor] | None,
               room: int = 0):
    """Rows' held KV left-padded into one batch: (keys, values per layer `[b, Hkv, N, D]`,
    positions `[b, N]` (-1: padding)); None keys when no row holds anything. `room` > 0: the
    keys and values are `[b, Hkv, N + room, D]` buffers, the rows in the first N slots and the
    last `room` left unwritten for the step's new keys (no concatenation per layer)."""
    N = max((r.slots for r in rows if r is not None), default=0)
    b = len(rows)
    ref = next((r for r in rows if r is not None and r.slots), None)
    if N == 0 or ref is None:
        return None, None, torch.full((b, 0), -1, dtype=torch.long)
    if b == 1 and not room:  # one row (a long prompt's chunks): views, no copy (the forward's cache appends to them)
        return [t[None] for t in ref.k], [t[None] for t in ref.v], ref.pos[None]
    pos = torch.full((b, N), -1, dtype=torch.long, device=ref.pos.device)
    keys, values = [], []
    if not room and all(r is not None and r.slots == N for r in rows):  # rows of one length: no padding
        for layer in range(n_layers):
            keys.append(torch.stack([r.k[layer] for r in rows]))
            values.append(torch.stack([r.v[layer] for r in rows]))
    for layer in range(n_layers if not keys else 0):  # each element written once: the row or its padding
        k0, v0 = ref.k[layer], ref.v[layer]
        kk = k0.new_empty(b, k0.shape[0], N + room, k0.shape[2])
        vv = v0.new_empty(b, v0.shape[0], N + room, v0.shape[2])
        for i, r in enumerate(rows):
            n = r.slots if r is not None else 0
            if n < N:
                kk[i, :, :N - n].zero_()
                vv[i, :, :N - n].zero_()
            if n:
                kk[i, :, N - n:N] = r.k[layer]
                vv[i, :, N - n:N] = r.v[layer]
        keys.append(kk)
        values.append(vv)
    for i, r in enumerate(rows):
        if r is not None and r.slots:
            pos[i, N - r.slots:] = r.pos
    return keys, values, pos


# ============================================================================================
# The prefix cache
# ============================================================================================

@dataclass
class _Block:
    parent: int
    tokens: tuple[int, ...]
    start: int  # position of its first token
    k: list[torch.Tensor]  # per layer [Hkv, block_size, D]
    v: list[torch.Tensor]
    nbytes: int


@dataclass
class PrefixCacheStats:
    """Counters of a `PrefixCache` (`EngineStats` and `/stats` show them)."""

    queries: int = 0  # requests looked up
    hits: int = 0  # requests that reused at least one block
    query_tokens: int = 0  # prompt tokens looked up (each prompt's first T - 1)
    hit_tokens: int = 0  # of those, tokens reused
    stored_blocks: int = 0
    evicted_blocks: int = 0
    dropped_blocks: int = 0  # blocks of a prompt longer than the bound not stored (its tail)

    @property
    def hit_rate(self) -> float:
        """Reused / looked-up prompt tokens (0 before any lookup)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    """KV of prompt blocks under chained content hashes, LRU-evicted within `max_bytes` (module
    docstring). `namespace`: what the KV was computed under (method config, model, dtype)."""

    def __init__(self, namespace: Any, *, block_size: int = 16, max_bytes: int = 1 << 30):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"prefix cache block_size must be a positive integer, got {block_size!r}")
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prefix cache max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.block_size, self.max_bytes = block_size, max_bytes
        text = json.dumps(namespace, sort_keys=True, default=str)
        self.root = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # key -> block; LRU first
        self.nbytes = 0
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def _keys(self, tokens: Sequence[int], n_blocks: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """(key, parent key, tokens) of the first n_blocks blocks of `tokens`."""
        out, parent, bs = [], self.root, self.block_size
        for j in range(n_blocks):
            toks = tuple(tokens[j * bs:(j + 1) * bs])
            key = hash((parent, toks))
            out.append((key, parent, toks))
            parent = key
        return out

    def lookup(self, prompt: Sequence[int], window: tuple[int, int] | None) -> tuple[int, RowKV | None]:
        """The longest cached prefix of `prompt` (at most T - 1 tokens, whole blocks): (its length
        n, its held KV: every slot, or for a bounded `window` (n_first, n_recent) only what a query
        at n can see, possibly nothing). (0, None) on a miss. Counts the lookup in `stats`."""
        usable = len(prompt) - 1
        self.stats.queries += 1
        self.stats.query_tokens += max(usable, 0)
        found: list[_Block] = []
        for key, parent, toks in self._keys(prompt, max(usable, 0) // self.block_size):
            blk = self._blocks.get(key)
            if blk is None or blk.parent != parent or blk.tokens != toks:
                break
            found.append(blk)
        if not found:
            return 0, None
        for key, _, _ in reversed(self._keys(prompt, len(found))):  # deepest first: the root ends newest
            self._blocks.move_to_end(key)
        n = len(found) * self.block_size
        self.stats.hits += 1
        self.stats.hit_tokens += n
        if window is not None:  # only the blocks a query at n can see
            g, r = window
            found = [b for b in found if b.start < g or b.start + self.block_size > n - r]
        dev = found[0].k[0].device
        pos = torch.cat([torch.arange(b.start, b.start + self.block_size, device=dev) for b in found])
        row = RowKV([torch.cat([b.k[i] for b in found], 1) for i in range(len(found[0].k))],
                    [torch.cat([b.v[i] for b in found], 1) for i in range(len(found[0].v))], pos)
        return n, row.kept(n, window)

    def insert(self, prompt: Sequence[int], start: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store the blocks of `prompt` whose positions lie in [start, start + n) and below
        T - 1, from a call's new keys/values per layer `[Hkv, n, D]` (position start + t at index t)."""
        if self.max_bytes == 0:
            return
        bs, n = self.block_size, keys[0].shape[1]
        end = min(start + n, len(prompt) - 1)
        first = -(-start // bs)  # the first block starting at or after `start`
        last = end // bs  # blocks j < last end at or before `end`
        if last <= first:
            return
        chain = self._keys(prompt, last)
        if first and chain[first - 1][0] not in self._blocks:  # its parent is gone: unreachable
            self.stats.dropped_blocks += last - first
            return
        keep = {key for key, _, _ in chain}  # this prompt's chain: never evicted to make room for itself
        for j in range(first, last):
            key, parent, toks = chain[j]
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            a = j * bs - start
            k = [t[:, a:a + bs].clone() for t in keys]
            v = [t[:, a:a + bs].clone() for t in values]
            nb = sum(t.nbytes for t in (*k, *v))
            if nb > self.max_bytes or not self._evict(self.max_bytes - nb, keep):
                # a prompt longer than the bound keeps its head: its tail's blocks are dropped
                # (evicting its own head would leave blocks no lookup can reach)
                self.stats.dropped_blocks += last - j
                break
            self._blocks[key] = _Block(parent, toks, j * bs, k, v, nb)
            self.nbytes += nb
            self.stats.stored_blocks += 1
        for key, _, _ in reversed(chain[:last]):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _evict(self, room: int, keep: set[int] | frozenset[int] = frozenset()) -> bool:
        """Evict least recently used blocks, none of `keep`, until at most `room` bytes are held;
        False (nothing more evicted) when only blocks of `keep` are left to evict."""
        while self.nbytes > room:
            key = next((k for k in self._blocks if k not in keep), None)
            if key is None:
                return False
            self.nbytes -= self._blocks.pop(key).nbytes
            self.stats.evicted_blocks += 1
        return True

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0

    def to_dict(self) -> dict[str, Any]:
        s = self.stats
        return {"block_size": self.block_size, "max_bytes": self.max_bytes, "bytes": self.nbytes,
                "blocks": len(self._blocks), "queries": s.queries, "hits": s.hits, "query_tokens": s.query_tokens,
                "hit_tokens": s.hit_tokens, "hit_rate": round(s.hit_rate, 6), "stored_blocks": s.stored_blocks,
                "evicted_blocks": s.evicted_blocks, "dropped_blocks": s.dropped_blocks}


def reuse_refusal(methods: Any, static_basis: bool) -> str | None:
    """Why a prompt of this engine may not be cut into calls nor reuse a cached prefix (module
    docstring), or None. `static_basis`: every layer's RoPE basis is independent of the length."""
    if not static_basis:
        return "the RoPE basis follows the sequence length (dynamic NTK / longrope): a prefix's keys depend on what follows"
    method = methods.attention
    return None if method is None else method.call_dependence


__all__ = ["PrefixCache", "PrefixCacheStats", "RowKV", "reuse_refusal", "stack_rows"]
