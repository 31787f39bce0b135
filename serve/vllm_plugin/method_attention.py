"""lcx attention methods vLLM's kernels cannot run (LM-Infinite, StreamingLLM sinks, Self-Extend, SWAT) inside vLLM.

LM-Infinite scores its global keys at a capped distance (global keys unrotated, the query rotated
to min(limit, Tk - 1)) and StreamingLLM renumbers positions inside its cache; neither fits vLLM's
kernels, which attend over keys cached *after* RoPE with causal + sliding-window masks only.
This module runs them exactly instead:

- the layer skips vLLM's rotary embedding, so q and k arrive unrotated and the cache holds
  unrotated keys;
- the layer's attention implementation (vLLM's CPU impl: its KV-cache shape and metadata
  builder are kept) gets `_MethodAttention`'s forward and cache update, with its own layout,
  which writes k/v into the paged cache with plain indexing and calls the lcx method itself:
  `method.attend(q, k, v, rotary=Rotary(inv_freq, positions, attention_factor))` — lcx's
  semantics, RoPE included, with the queries the last Tq of the keys (lcx's convention, which is
  also how vLLM schedules prefill, chunked prefill and decode).

Two paths, both exactly the method's semantics:

- decode (one query per request), batched: every method here is bounded (`cache_window` =
  (n_first, n_recent): a query sees only the first n_first and the last n_recent keys), and on
  that compressed set of keys it computes exactly what it computes on the full cache
  (`lcx.methods.bounded_cache`: keys rotated by their true positions, or by their slot in the
  compressed set for StreamingLLM's renumbering). So the decode rows of a step are grouped by
  the length of their compressed set (shorter requests keep their whole cache) and each group
  is one call. The plan (blocks, offsets, positions of the kept keys) depends only on the step's
  metadata, so it is built once per step and shared by every layer.
- prefill and chunked prefill (several queries per request): requests with equal numbers of
  queries and keys (e.g. prompts of equal length arriving together) are one call over their
  whole caches.

Each call runs on `lcx.kernels.cpu.paged_relative_attention_cpu` (C++, compiled on first use;
`attention_kernel()`): for every method but SWAT a query's attention is plain softmax over a subset
of keys, each at a method-given position relative to the query (`AttentionMethod.query_keys`,
as `lcx.methods.last_query.RelativeKeys`: visibility and small rotation tables, built once per
step for decode and once per shape for prefill), so the kernel reads the kept keys straight
from the paged cache, rotates them relative to the unrotated query, and does the masked
softmax in one pass: no gather copy, no rotated-key temporaries, one call per group and layer.
Where the extension cannot build (no compiler or ninja; logged), or for SWAT's sigmoid, the
torch route runs instead: decode gathers the kept keys (`index_select`) and calls
`LastQueryPlan.attend` (one SDPA), prefill calls the method's `attend` on
`prefill_backend(method)` (flash where the method runs on it, else blockwise). Both routes are
tested against `method.attend` (tests/serve/test_vllm_plugin_decode.py).

KV memory: the cache keeps every block. vLLM 0.32's KV manager frees blocks only for layers
whose KV spec says so: `SlidingWindowSpec` frees everything before the window (LM-Infinite's
and StreamingLLM's first keys too, so it cannot be used), `ChunkedLocalAttentionSpec` frees whole
chunks, and `RSWASpec` keeps the whole *prompt* plus the last window of *generated* tokens
(only the decode-phase gap is freed, and it needs a backend with `supports_rswa`, which the CPU
backend lacks). None keeps "the first n_first + the last n_recent" tokens of the prompt, so
LM-Infinite / sinks layers keep a full-attention spec.
Limits: vLLM's CPU backend only (its `[num_blocks, kv_heads, block_size, 2 * head]` cache shape);
the switch uses the `impl` attribute of vLLM's `Attention` layer (an internal, pinned to
vllm 0.32: on CPU the platform always picks CPU_ATTN, so a registered custom backend cannot be
selected through the documented `--attention-backend` route).
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field

import torch

from lcx.attention import Rotary
from lcx.method_config import INFERENCE_BACKEND
from lcx.methods import AttentionMethod
from lcx.methods.bounded_cache import kept_slots
from lcx.kernels.cpu import paged_relative_attention_cpu
from lcx.kernels.cpu.relative_attention import DTYPES as FUSED_DTYPES
from lcx.methods.last_query import LastQueryPlan, RelativeKeys

_log = logging.getLogger(__name__)


class _MethodAttention:
    """What a switched layer's impl runs: `forward` and `do_kv_cache_update` are bound onto the
    impl instance (as `lcx.methods.patch_attention` does for HF layers); `lcx_method`,
    `lcx_inv_freq`, `lcx_attention_factor`, `lcx_backend` are set on it by `switch_to_method`."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        # kv_cache: [num_blocks, Hkv, block_size, 2 * D]; keys in [..., :D], values in [..., D:].
        slots = slot_mapping[: key.shape[0]].long()
        keep = slots >= 0  # -1: padding tokens
        n = slots.shape[0]
        kv = torch.cat((key[:n], value[:n]), dim=-1)  # [N, Hkv, 2D]: one indexed write
        if not bool(keep.all()):
            kv, slots = kv[keep], slots[keep]
        rows = _cache_rows(slots // kv_cache.shape[2], slots % kv_cache.shape[2], kv_cache.shape)  # [N, Hkv]
        flat = kv_cache.view(-1, kv_cache.shape[-1])  # rows (block, head, offset), as `forward` reads them
        flat.index_copy_(0, rows.flatten(), kv.reshape(-1, kv.shape[-1]).to(kv_cache.dtype))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        """query `[N, H, D]` (unrotated, requests concatenated) -> output `[N, H, D]`."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by lcx methods")
        if attn_metadata is None:  # warm-up
            return output
        num_blocks, hkv, block_size, two_d = kv_cache.shape
        d = two_d // 2
        plan = _step_plan(attn_metadata, self.lcx_method, block_size)
        flat = kv_cache.view(-1, two_d)  # rows (block, head, offset): index_select gathers fast
        fused = (self.lcx_kernel == "cpp" and query.dtype == kv_cache.dtype == output.dtype
                 and query.dtype in FUSED_DTYPES)
        for g in plan.decode_groups:  # one batched call per group of equally long compressed caches
            B, K = g.blocks.shape
            rows = g.cache_rows(kv_cache.shape)  # [B, K, Hkv]
            if fused:  # gather + relative rotation + masked softmax in one C++ call
                keys = g.relative_keys(self.lcx_method, self.lcx_inv_freq, self.lcx_attention_factor, query.dtype)
                if keys is not None:
                    paged_relative_attention_cpu(query, flat, rows, g.rows[:, None], keys, scale=self.scale,
                                                 out=output)
                    continue
            kv = flat.index_select(0, rows.flatten()).view(B, K, hkv, two_d)
            q = query[g.rows][:, None]  # [B, 1, H, D]
            lq = g.plan(self.lcx_method, self.lcx_inv_freq, self.lcx_attention_factor, query.dtype)
            if lq is None:  # not plain softmax attention (SWAT): the method's own path
                out = self.lcx_method.attend(q, kv[..., :d], kv[..., d:], scale=self.scale,
                                             rotary=Rotary(self.lcx_inv_freq, g.positions, self.lcx_attention_factor))
            else:
                out = lq.attend(q, kv[..., :d], kv[..., d:], scale=self.scale)
            output[g.rows] = out[:, 0].to(output.dtype)
        rotary = Rotary(self.lcx_inv_freq, None, self.lcx_attention_factor)
        for g in plan.multi_query_groups:  # one batched call per group of equally shaped requests
            B, n_blk = g.blocks.shape
            if fused:
                keys = _prefill_keys(self, g.n_keys, g.n_queries, query.dtype)
                if keys is not None:
                    paged_relative_attention_cpu(query, flat, g.cache_rows(kv_cache.shape),
                                                 g.token_rows.view(B, g.n_queries), keys, scale=self.scale,
                                                 out=output)
                    continue
            kv = kv_cache[g.blocks].permute(0, 1, 3, 2, 4).reshape(B, n_blk * block_size, hkv, two_d)[:, :g.n_keys]
            q = query[g.token_rows].view(B, g.n_queries, *query.shape[1:])  # the last Tq of the Tk keys
            out = self.lcx_method.attend(q, kv[..., :d], kv[..., d:], rotary=rotary, scale=self.scale,
                                         backend=self.lcx_backend)
            output[g.token_rows] = out.reshape(B * g.n_queries, *out.shape[2:]).to(output.dtype)
        return output


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
    decode_groups: tuple[_DecodeGroup, ...]
    multi_query_groups: tuple[_MultiQueryGroup, ...]

    @property
    def multi_query(self) -> tuple[int, ...]:
        """The requests that take the whole-cache path (prefill, chunked prefill; unbounded methods)."""
        return tuple(sorted(i for g in self.multi_query_groups for i in g.requests))


_PLAN_ATTR = "_lcx_step_plan"


def _step_plan(attn_metadata, method: AttentionMethod, block_size: int) -> _StepPlan:
    """The step's plan, built by the first layer and cached on the metadata object (vLLM passes
    the same one to every layer of a KV-cache group in a step, and a new one the next step)."""
    key = (method, block_size)
    cached = getattr(attn_metadata, _PLAN_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = _build_plan(attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.block_table,
                       method, block_size)
    try:
        setattr(attn_metadata, _PLAN_ATTR, (key, plan))
    except AttributeError:  # a metadata class with __slots__: every layer rebuilds the plan
        pass
    return plan


def _cache_rows(blocks: torch.Tensor, offsets: torch.Tensor, cache_shape) -> torch.Tensor:
    """Row indices `[..., Hkv]` into the cache viewed as `[num_blocks * Hkv * block_size, 2D]` of the
    slots (blocks, offsets) `[...]`, every kv head."""
    _, hkv, block_size, _ = cache_shape
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
                method: AttentionMethod, block_size: int) -> _StepPlan:
    """Split the step's requests into batched decode groups and multi-query requests.

    A decode request with n cached keys (its own included) keeps, for a method with
    `cache_window` (G, L), key indices [0, G) and [n - L, n) when n >= G + L (K = G + L keys),
    else all of [0, n) (K = n); rotary positions are those indices, or 0..K-1 where the method
    renumbers positions inside its cache (StreamingLLM).
    """
    bounded = _bounded(method)
    n_first, n_recent = method.cache_window if bounded else (0, 0)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode: dict[int, list[int]] = {}  # K -> request indices
    multi = []  # and unbounded methods' decode requests: the per-request path
    for i in range(len(starts) - 1):
        n_q = starts[i + 1] - starts[i]
        if n_q == 1 and bounded:
            decode.setdefault(min(int(lens[i]), n_first + n_recent), []).append(i)
        elif n_q >= 1:
            multi.append(i)
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
    return _StepPlan(tuple(groups), tuple(multi_groups))


def prefill_backend(method: AttentionMethod) -> str:
    """The `lcx.attention` backend of multi-query calls: lcx's fastest exact CPU route
    (`INFERENCE_BACKEND`) where the method runs on it, else blockwise (SWAT's sigmoid)."""
    return INFERENCE_BACKEND if method.supports(INFERENCE_BACKEND) is None else "blockwise"


_PREFILL_KEYS_MAX = 64  # shapes of prefill/chunk calls remembered per layer


def _prefill_keys(impl, n_keys: int, n_queries: int, dtype: torch.dtype) -> RelativeKeys | None:
    """`RelativeKeys` of a prefill or chunk of `n_queries` queries over `n_keys` keys at positions
    0..n_keys-1, remembered per layer (prompts of a workload repeat a few shapes)."""
    cache = impl.lcx_prefill_keys
    key = (n_keys, n_queries, dtype)
    if key not in cache:
        if len(cache) >= _PREFILL_KEYS_MAX:
            cache.pop(next(iter(cache)))
        cache[key] = RelativeKeys.build(impl.lcx_method, Rotary(impl.lcx_inv_freq, None, impl.lcx_attention_factor),
                                        n_keys=n_keys, n_queries=n_queries, device=impl.lcx_inv_freq.device,
                                        dtype=dtype)
    return cache[key]


def attention_kernel() -> str:
    """"cpp" (`lcx.kernels.cpu.paged_relative_attention_cpu`, compiled on first use) where the C++
    extension builds, else "torch" (gather + `LastQueryPlan.attend` for decode, the method's
    `attend` for prefill), logged with the reason."""
    from lcx.kernels.cpu import unavailable

    reason = unavailable()
    if reason is None:
        return "cpp"
    _log.warning("lcx: the C++ attention kernel is unavailable (%s); attention runs on torch ops", reason)
    return "torch"


def switch_to_method(attn_layer, method: AttentionMethod, inv_freq: torch.Tensor, attention_factor: float) -> None:
    """Make vLLM `Attention` layer `attn_layer` run `method` on unrotated q/k (see module doc)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = attn_layer.impl
    if not isinstance(impl, CPUAttentionBackendImpl):
        raise ValueError(f"attention method {method.name!r} runs inside vLLM on the CPU backend only; "
                         f"this layer uses {type(impl).__name__}")
    impl.forward = types.MethodType(_MethodAttention.forward, impl)
    impl.do_kv_cache_update = types.MethodType(_MethodAttention.do_kv_cache_update, impl)
    impl.lcx_method = method
    impl.lcx_backend = prefill_backend(method)
    impl.lcx_kernel = attention_kernel()
    impl.lcx_prefill_keys = {}  # (n_keys, n_queries, dtype) -> RelativeKeys, see `_prefill_keys`
    impl.lcx_inv_freq = inv_freq
    impl.lcx_attention_factor = float(attention_factor)
