"""The vLLM plugin's per-step plan: which keys each request's rows read, from which cache rows,
re-rotated by which deltas (`method_attention._MethodAttention.forward` runs it).

Built once per step from the step's metadata only (query_start_loc, seq_lens, block_table) by the
first layer and cached on the metadata object (`_step_plan`), so every layer of the step shares
it, as it shares the rotation tables built from it (`_memo_basis`):

- rotated layout: `_RuleDecode`, every decode row (and, where `rule_covers_prefill`, every
  banded prefill row) under the method's `DecodeRule`, as the shared decode plan says
  (`lcx.methods.plan.step_plan`, the one definition of which keys a row reads and their
  re-rotation delta = a(p_k) - b(p_q); `RuleShifts` memoised per method; `_RotationRows`: cos/sin
  rows of the distinct deltas kept across steps), its key positions mapped to cache slots through
  the block table. Where the C++ kernel runs the step the plan is one call of the extension's
  `rule_plan` (`_rule_decode_cpp`, the plan's "cpp" backend fused with the slot lookup), checked
  bit for bit against the reference route (tests/serve/test_vllm_plugin_decode.py). Methods the
  layout cannot run are refused by one check, `rotated_refusal`.
- unrotated layout: `_DecodeGroup`s, decode requests grouped by the length of their compressed
  cache (`lcx.hf.bounded_cache.kept_slots`, the one eviction rule), and `_MultiQueryGroup`s,
  prefills / chunks of equal shape run as one call over their whole caches.

Index arithmetic runs in numpy on views of the metadata: a step's plan is a few dozen ops on
arrays of ~B x K entries, where torch's per-op dispatch would cost more than a short batch's
attention.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from lcx.attention import Rotary
from lcx.hf.bounded_cache import kept_slots
from lcx.kernels.cpu.relative_attention import load_extension
from lcx.methods import AttentionMethod
from lcx.methods.last_query import LastQueryPlan, RelativeKeys
from lcx.methods.plan import RuleShifts, step_plan_ref
from lcx.rope import rope_cos_sin


def _memo_basis(store: list, kind: str, inv_freq: torch.Tensor, dtype: torch.dtype, build):
    """`build()` once per (kind, rotary basis, dtype) in `store`: tables built by the first layer
    of a step serve every layer whose rotary has equal values (each layer holds its own inv_freq)."""
    for (inv, dt, kd), value in store:
        if kd == kind and dt == dtype and (inv is inv_freq or torch.equal(inv, inv_freq)):
            return value
    value = build()
    store.append(((inv_freq, dtype, kind), value))
    return value


class _RotationRows:
    """cos / sin rows (half width, float32, unit scale) of rotations by the given positions, kept
    across steps: a step's deltas are mostly the previous step's (LM-Infinite's globals move by
    one position per step once past the cap, sinks' not at all), and float64 cos/sin of a few
    dozen positions costs more than the rest of the step's plan. Rows come from `rope_cos_sin`
    itself (the same bits as computing them afresh); at most `limit` positions are kept."""

    def __init__(self, inv_freq: torch.Tensor, limit: int = 1 << 16):
        self.inv_freq, self.limit = inv_freq.detach().clone(), limit
        self.row: dict[float, int] = {}
        h = inv_freq.shape[-1]
        self.cos, self.sin = np.empty((0, h), np.float32), np.empty((0, h), np.float32)

    def __call__(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions [U]` float64 -> cos, sin `[U, r/2]`."""
        new = [p for p in positions.tolist() if p not in self.row]
        if new:
            if len(self.row) + len(new) > self.limit:
                self.row, self.cos, self.sin = {}, self.cos[:0], self.sin[:0]
                new = positions.tolist()
            cos, sin = rope_cos_sin(torch.tensor(new, dtype=torch.float64), self.inv_freq, 1.0, torch.float32)
            h = cos.shape[-1] // 2
            base = len(self.row)
            self.row.update((p, base + i) for i, p in enumerate(new))
            self.cos = np.concatenate((self.cos, cos[:, :h].numpy()))
            self.sin = np.concatenate((self.sin, sin[:, :h].numpy()))
        rows = np.fromiter((self.row[p] for p in positions.tolist()), np.int64, positions.shape[0])
        return torch.from_numpy(self.cos[rows]), torch.from_numpy(self.sin[rows])


_ROTATION_ROWS: dict[bytes, _RotationRows] = {}  # inv_freq's bytes -> its rows (a few bases per model)


def _rotation_rows(inv_freq: torch.Tensor) -> _RotationRows:
    key = inv_freq.detach().cpu().to(torch.float64).numpy().tobytes()
    rows = _ROTATION_ROWS.get(key)
    if rows is None:
        if len(_ROTATION_ROWS) >= 64:  # a process serving many models: start again
            _ROTATION_ROWS.clear()
        rows = _ROTATION_ROWS[key] = _RotationRows(inv_freq)
    return rows


def _delta_keys(visible: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> RelativeKeys:
    """`RelativeKeys` that re-rotate keys cached rotated at their true positions by `delta`
    `[Bd, Tq, Tk]` float64 (the method's position - the true one; 0: read as cached), where
    `visible`; unit scale (the attention factor is already in the cached keys and the query).
    Table row 0 is the identity (most visible keys are read as cached), rows 1.. the distinct
    non-zero deltas."""
    vis = visible.numpy()
    d = delta.numpy()
    moved = vis & (d != 0)
    values = d[moved]
    uniq = np.unique(values)
    cos, sin = _rotation_rows(inv_freq)(np.concatenate(([0.0], uniq)))  # [U, r/2]; row 0: cos 1, sin 0
    index = np.where(vis, 0, -1)
    index[moved] = 1 + np.searchsorted(uniq, values)
    return RelativeKeys(torch.from_numpy(index), cos, sin)


@dataclass(frozen=True)
class _RuleDecode:
    """The decode rows of a step in the rotated layout: each request's keys under the method's
    `DecodeRule` (window keys, then side keys), padded to the longest with invisible keys.

        LM-Infinite G=2, L=4, request with n=9 keys (query at p_q=8), K = G + L:
        keys   0  1 | 5  6  7  8         delta: globals (0 - p_k) - (min(limit, 8) - 8), window 0
    """

    rows: torch.Tensor  # [B] token rows of `query` / `output`
    blocks: torch.Tensor  # [B, K] physical block of each key
    offsets: torch.Tensor  # [B, K] offset in that block
    visible: torch.Tensor  # [B, K] bool
    delta: torch.Tensor  # [B, K] float64: re-rotation of each cached key (0: window keys, padding)
    shared: list = field(default_factory=list, compare=False)  # see `_memo_basis`
    row_index: dict = field(default_factory=dict, compare=False)  # cache shape -> `_cache_rows` [B, K, Hkv]
    # the C++ planner's `index [B, 1, K]` and distinct non-zero deltas `[U]` (None: from `delta`)
    moved: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False)

    def relative_keys(self, inv_freq: torch.Tensor, dtype: torch.dtype) -> RelativeKeys:
        """The C++ kernel's tables: `index [B, 1, K]`, unit-scale cos/sin of the distinct deltas."""
        if self.moved is not None:
            index, uniq = self.moved
            return _memo_basis(self.shared, "keys", inv_freq, dtype, lambda: RelativeKeys(
                index, *_rotation_rows(inv_freq)(np.concatenate(([0.0], uniq.numpy())))))
        return _memo_basis(self.shared, "keys", inv_freq, dtype, lambda: _delta_keys(
            self.visible[:, None], self.delta[:, None], inv_freq))

    def tables(self, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch route's cos/sin `[B, K, r]` of every key's delta (unit scale)."""
        return _memo_basis(self.shared, "tables", inv_freq, dtype,
                           lambda: rope_cos_sin(self.delta, inv_freq, 1.0, dtype))

    def cache_rows(self, cache_shape) -> torch.Tensor:
        return _memo_rows(self.row_index, cache_shape, lambda: (self.blocks, self.offsets))


def _rule_decode(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 req: list[int], method: AttentionMethod, block_size: int, cache_shape=None) -> _RuleDecode:
    """The rows under `method.decode_rule()` of the requests `req` (module docstring): each
    decode request's query, and every query of a prefill / chunk request when the rule holds for
    prefill queries too (`rule_covers_prefill`): its query at position p is read as the last
    query of a history of p + 1 keys.

    Which keys a row reads and how far each is re-rotated is the shared decode plan
    (`lcx.methods.plan.step_plan`: with a bounded rule the first min(side, n - window) keys and
    the last window, padded to the longest row with invisible keys); this function only turns
    the step's metadata into each row's key count and the plan's key positions into cache slots
    through the block table. With `cache_shape` (the C++ kernel runs the step), the same plan
    comes from one call of the extension's `rule_plan` (the plan's "cpp" backend, here fused
    with the block-table lookup and the cache rows for that shape; tests/serve/
    test_vllm_plugin_decode.py checks it against this code bit for bit)."""
    rule = rotated_rule(method)
    if cache_shape is not None:
        return _rule_decode_cpp(query_start_loc, seq_lens, block_table, req, method, rule, block_size,
                                tuple(cache_shape))
    qsl = query_start_loc.numpy().astype(np.int64, copy=False)
    req_a = np.asarray(req, dtype=np.int64)
    start = qsl[req_a]
    n_q = qsl[req_a + 1] - start  # [R] queries of each request this step
    first = np.repeat(np.cumsum(n_q) - n_q, n_q)  # [B] each row's request's first row
    t = np.arange(first.shape[0]) - first  # [B] the row's query index inside its request
    rows = np.repeat(start, n_q) + t  # [B] token rows of `query` / `output`
    n = np.repeat(seq_lens.numpy().astype(np.int64)[req_a] - n_q, n_q) + t + 1  # [B] keys each row sees
    row_req = np.repeat(req_a, n_q)  # [B] each row's request
    plan = step_plan_ref(rule, n, _rule_maps(method))
    idx = plan.keys.numpy()  # [B, K] key positions (padding: 0, a real slot, never used: invisible)
    table = block_table.numpy()
    blocks = np.take(table.reshape(-1), row_req[:, None] * table.shape[1] + idx // block_size).astype(np.int64)
    return _RuleDecode(torch.from_numpy(rows), torch.from_numpy(blocks), torch.from_numpy(idx % block_size),
                       plan.visible, plan.delta)


def _rule_decode_cpp(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                     req: list[int], method: AttentionMethod, rule, block_size: int, cache_shape) -> _RuleDecode:
    """`_rule_decode` by the C++ extension's `rule_plan` (one call), for a cache of `cache_shape`."""
    W = -1 if rule.window is None else rule.window
    S = -1 if rule.side is None else rule.side
    n_max = int(seq_lens.numpy().max()) if seq_lens.numel() else 0  # covers every row's keys
    a, b = (torch.from_numpy(x) for x in _rule_maps(method).tables(n_max))
    rows, blocks, offsets, visible, delta, cache_rows, index, uniq = load_extension().rule_plan(
        query_start_loc.contiguous(), seq_lens.contiguous(), block_table.contiguous(),
        torch.tensor(req, dtype=torch.int64), W, S, a, b, block_size, cache_shape[1])
    return _RuleDecode(rows, blocks, offsets, visible, delta, row_index={cache_shape: cache_rows},
                       moved=(index, uniq))


@dataclass(frozen=True)
class _DecodeGroup:
    """Decode requests whose compressed caches have the same length K."""

    rows: torch.Tensor  # [B] token rows of `query` / `output`
    blocks: torch.Tensor  # [B, K] physical block of each kept key
    offsets: torch.Tensor  # [B, K] offset in that block
    positions: torch.Tensor  # [B, K] rotary position of each kept key
    # ((inv_freq, attention factor, dtype, kind), value): tables built by the first layer of the
    # step and reused by every layer whose rotary has equal values (each layer holds its own
    # inv_freq tensor); kind "plan" (LastQueryPlan or None) or "keys" (RelativeKeys or None)
    shared: list = field(default_factory=list, compare=False)
    row_index: dict = field(default_factory=dict, compare=False)  # cache shape -> `_cache_rows` [B, K, Hkv]

    def _shared(self, kind: str, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype, build):
        for (inv, af, dt, kd), value in self.shared:
            if kd == kind and af == attention_factor and dt == dtype and (inv is inv_freq or torch.equal(inv, inv_freq)):
                return value
        value = build(Rotary(inv_freq, self.positions, attention_factor))
        self.shared.append(((inv_freq, attention_factor, dtype, kind), value))
        return value

    def plan(self, method: AttentionMethod, inv_freq: torch.Tensor, attention_factor: float,
             dtype: torch.dtype) -> LastQueryPlan | None:
        """The torch route's plan (None: not plain softmax, use the method's attend)."""
        B, K = self.blocks.shape
        return self._shared("plan", inv_freq, attention_factor, dtype, lambda rot: LastQueryPlan.build(
            method, rot, n_keys=K, batch=B, device=inv_freq.device, dtype=dtype))

    def relative_keys(self, method: AttentionMethod, inv_freq: torch.Tensor, attention_factor: float,
                      dtype: torch.dtype) -> RelativeKeys | None:
        """The C++ kernel's tables (None: not plain softmax)."""
        return self._shared("keys", inv_freq, attention_factor, dtype, lambda rot: RelativeKeys.build(
            method, rot, n_keys=self.blocks.shape[1], device=inv_freq.device, dtype=dtype))

    def cache_rows(self, cache_shape) -> torch.Tensor:
        return _memo_rows(self.row_index, cache_shape, lambda: (self.blocks, self.offsets))


@dataclass(frozen=True)
class _MultiQueryGroup:
    """Requests with the same number of queries and of keys (prefills of equal length, chunks of
    a chunked prefill; decode rows of an unbounded method): one batched call on their whole caches."""

    requests: tuple[int, ...]
    n_queries: int
    n_keys: int
    token_rows: torch.Tensor  # [B * n_queries] rows of `query` / `output`, request by request
    blocks: torch.Tensor  # [B, ceil(n_keys / block_size)] their block tables
    row_index: dict = field(default_factory=dict, compare=False)  # cache shape -> rows [B, n_keys, Hkv]

    def cache_rows(self, cache_shape) -> torch.Tensor:
        """Cache rows (`_cache_rows`) of every key of each request, `[B, n_keys, Hkv]`."""
        j, block_size = torch.arange(self.n_keys), cache_shape[2]
        return _memo_rows(self.row_index, cache_shape, lambda: (
            self.blocks[:, j // block_size], (j % block_size).expand(self.blocks.shape[0], -1)))


@dataclass(frozen=True)
class _StepPlan:
    decode_groups: tuple[_DecodeGroup, ...]  # unrotated layout
    multi_query_groups: tuple[_MultiQueryGroup, ...]
    rule_decode: _RuleDecode | None = None  # rotated layout: every decode row (+ banded prefill rows)

    @property
    def multi_query(self) -> tuple[int, ...]:
        """The requests that take the whole-cache path (prefill, chunked prefill; unbounded methods)."""
        return tuple(sorted(i for g in self.multi_query_groups for i in g.requests))


_PLAN_ATTR = "_lcx_step_plan"


def _step_plan(attn_metadata, method: AttentionMethod, block_size: int, rotated: bool = False,
               cpp_cache_shape=None) -> _StepPlan:
    """The step's plan, built by the first layer and cached on the metadata object (vLLM passes
    the same one to every layer of a KV-cache group in a step, and a new one the next step).
    `cpp_cache_shape`: the cache's shape where the C++ kernel runs the step (the rotated
    layout's plan then comes from the C++ planner, see `_rule_decode`)."""
    key = (method, block_size, rotated, cpp_cache_shape)
    cached = getattr(attn_metadata, _PLAN_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = _build_plan(attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.block_table,
                       method, block_size, rotated, cpp_cache_shape)
    try:
        setattr(attn_metadata, _PLAN_ATTR, (key, plan))
    except AttributeError:  # a metadata class with __slots__: every layer rebuilds the plan
        pass
    return plan


def _cache_rows(blocks: torch.Tensor, offsets: torch.Tensor, cache_shape) -> torch.Tensor:
    """Row indices `[..., Hkv]` into the cache viewed as `[num_blocks * Hkv * block_size, 2D]` of the
    slots (blocks, offsets) `[...]`, every kv head (int64, contiguous)."""
    _, hkv, block_size, _ = cache_shape
    if blocks.device.type == "cpu":  # numpy: one fused expression, no per-op dispatch
        b, o = blocks.numpy().astype(np.int64, copy=False), offsets.numpy().astype(np.int64, copy=False)
        first = b * (hkv * block_size) + o  # head 0's row; head g's is g * block_size further
        return torch.from_numpy(first[..., None] + np.arange(0, hkv * block_size, block_size))
    heads = torch.arange(hkv, device=blocks.device)
    return ((blocks[..., None] * hkv + heads) * block_size) + offsets[..., None]


def _memo_rows(store: dict, cache_shape, slots) -> torch.Tensor:
    """`_cache_rows` of the slots `(blocks, offsets) = slots()`, computed once per cache shape (a
    group's rows serve every layer of the step)."""
    key = tuple(cache_shape)
    if key not in store:
        store[key] = _cache_rows(*slots(), cache_shape).contiguous()
    return store[key]


def _bounded(method: AttentionMethod) -> bool:
    """Whether decode may run on the compressed cache (`AttentionMethod.check_bounded`)."""
    try:
        method.check_bounded()
    except ValueError:
        return False
    return True


def _build_plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                method: AttentionMethod, block_size: int, rotated: bool = False, cpp_cache_shape=None) -> _StepPlan:
    """Split the step's requests into decode rows and multi-query requests.

    Rotated layout: every decode row goes to one `_RuleDecode`. Unrotated layout: decode rows
    are grouped by the length of their compressed cache: a request with n cached keys (its own
    included) keeps, for a method with `cache_window` (G, L), key indices [0, G) and [n - L, n)
    when n >= G + L (K = G + L keys), else all of [0, n) (K = n); rotary positions are those
    indices, or 0..K-1 where the method renumbers positions inside its cache (StreamingLLM).
    """
    bounded = not rotated and _bounded(method)
    n_first, n_recent = method.cache_window if bounded else (0, 0)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode: dict[int, list[int]] = {}  # K -> request indices
    banded = rotated and rule_covers_prefill(method)  # prefill queries under the rule too: a band of keys
    rule_rows = []  # rotated layout: every decode row (and prefill / chunk request where `banded`)
    multi = []  # and unbounded methods' decode requests: the per-request path
    for i in range(len(starts) - 1):
        n_q = starts[i + 1] - starts[i]
        if (n_q == 1 or banded) and rotated:
            rule_rows.append(i)
        elif n_q == 1 and bounded:
            decode.setdefault(min(int(lens[i]), n_first + n_recent), []).append(i)
        elif n_q >= 1:
            multi.append(i)
    rule_decode = None
    if rule_rows:
        rule_decode = _rule_decode(query_start_loc, seq_lens, block_table, rule_rows, method,
                                   block_size, cpp_cache_shape)
    groups = []
    for k_len, reqs in sorted(decode.items()):
        req = torch.tensor(reqs, dtype=torch.long)
        n = seq_lens.long()[req][:, None]  # [B, 1]
        cand = torch.arange(int(n.max()))[None]  # [1, N] key indices
        # the one eviction rule of lcx's bounded caches; the query is the last key (index n - 1)
        keep = kept_slots(cand, n - 1, n_first, n_recent) & (cand < n)  # [B, N], K per row
        idx = cand.expand(len(reqs), -1)[keep].view(len(reqs), k_len)  # [B, K]
        blocks = block_table.long()[req[:, None], idx // block_size]  # [B, K]
        positions = torch.arange(k_len).expand(len(reqs), -1) if method.renumber_in_cache else idx
        rows = query_start_loc.long()[req]
        groups.append(_DecodeGroup(rows, blocks, idx % block_size, positions))
    shapes: dict[tuple[int, int], list[int]] = {}  # (n_queries, n_keys) -> request indices
    for i in multi:
        shapes.setdefault((starts[i + 1] - starts[i], int(lens[i])), []).append(i)
    multi_groups = []
    for (n_q, n_keys), reqs in sorted(shapes.items()):
        token_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in reqs])
        blocks = block_table.long()[torch.tensor(reqs)][:, : -(-n_keys // block_size)]
        multi_groups.append(_MultiQueryGroup(tuple(reqs), n_q, n_keys, token_rows, blocks))
    return _StepPlan(tuple(groups), tuple(multi_groups), rule_decode)


@functools.lru_cache(maxsize=64)
def _rule_maps(method: AttentionMethod) -> RuleShifts:
    """The rule's shift tables (`lcx.methods.plan.RuleShifts`), kept per method across steps."""
    return RuleShifts(rotated_rule(method))


def rotated_refusal(method: AttentionMethod) -> str | None:
    """Why the rotated layout cannot run `method`, or None: the one check of that layout.

    It runs the decode plan's fixed set of keys per row (`lcx.methods.plan.StepPlan.visible`,
    window + side) as one softmax. A method without a rule (SWAT's sigmoid) is not softmax over
    rotated keys; LM-Infinite's top-k middle keys are chosen per query head by their scores
    (the plan's `middle` candidates), a selection the plugin's kernels (C++ and torch) do not
    make, so such a method runs on the unrotated layout (`attend` over the request's keys)."""
    rule = method.decode_rule()
    if rule is None:
        return f"{method.name} has no decode rule (not softmax over keys rotated once)"
    if rule.top_k:
        return (f"{method.name}'s top-k middle keys are picked per query head by score; the rotated "
                "layout's kernels attend a fixed set of keys per row")
    return None


def rotated_rule(method: AttentionMethod):
    """The method's `DecodeRule` if the rotated layout runs it (`rotated_refusal` is None), else None."""
    return None if rotated_refusal(method) is not None else method.decode_rule()


@functools.lru_cache(maxsize=64)
def rule_covers_prefill(method: AttentionMethod) -> bool:
    """Whether the rotated layout may run prefill and chunk queries under the method's bounded
    decode rule (`_rule_decode`: each query reads only its side + window keys, O(side + window)
    per query to plan and to attend), instead of tables from `query_keys` over every key of the
    call (O(Tq * Tk) to build per call shape).

    That holds where every query of a call sees its keys as the last query of its own prefix
    would, i.e. the method's `query_keys` rows do not depend on the keys after the query.
    LM-Infinite with a distance cap past its window is the exception: a global key is scored at
    min(limit, Tk - 1) of the whole call (`LMInfinite.query_keys`), not of the query's prefix.
    Checked against `query_keys` itself, query by query, for a whole prompt and a chunk of a
    prompt long enough to pass every edge of a window + side rule (the window filling, the side
    branch appearing, the window sliding past the side keys, caps up to that length): True
    only where they agree exactly (visibility and relative positions)."""
    rule = rotated_rule(method)
    if rule is None or rule.window is None or rule.side is None or rule.top_k:
        return False
    P = 2 * (rule.side + rule.window) + 9  # odd, past every edge twice
    pos = torch.arange(P)[None]  # [1, Tk]
    for n_queries in (P, P // 2 + 1):  # a whole prompt; its second half as a chunk
        keys = method.query_keys(pos, n_queries)
        if keys is None:
            return False
        vis = torch.ones(keys.key_positions.shape[1:], dtype=torch.bool) if keys.visible is None \
            else keys.visible[0]  # [Tq, Tk]
        p_q = torch.arange(P - n_queries, P, dtype=torch.float64)[:, None]  # [Tq, 1]
        rel = keys.key_positions[0].to(torch.float64) - p_q  # [Tq, Tk] key - query
        for t in range(n_queries):
            n = P - n_queries + t + 1
            want_vis, want_rel = rule.relative_positions(n)
            if vis[t, n:].any() or not torch.equal(vis[t, :n], want_vis) \
                    or not torch.equal(rel[t, :n][want_vis], want_rel[want_vis]):
                return False
    return True
