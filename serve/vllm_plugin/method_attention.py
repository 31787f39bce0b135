"""lcx attention methods vLLM's kernels cannot run (LM-Infinite, StreamingLLM sinks, Self-Extend, SWAT) inside vLLM.

LM-Infinite scores its global keys at a capped distance, StreamingLLM renumbers positions inside
its cache, Self-Extend groups far positions, SWAT is a sigmoid; vLLM's kernels attend over keys
cached *after* RoPE with causal + sliding-window masks only. This module runs them exactly: the
layer's attention implementation (vLLM's CPU impl: its KV-cache shape and metadata builder are
kept) gets `_MethodAttention`'s forward and cache update, with its own layout (rows of
[key | value], written with plain indexing), and computes the lcx method itself, with the
queries the last Tq of the keys (lcx's convention, which is also how vLLM schedules prefill,
chunked prefill and decode).

Two cache layouts (`switch_to_method(..., rotated=)`, chosen by the model class from the method):

- **rotated** (every method with a window + side `DecodeRule`, `rotated_refusal`: LM-Infinite
  without top-k, sinks, Self-Extend).
  The layer runs its rotary embedding as plain vLLM does (lcx's cos/sin table, `.model`), so q
  and k arrive rotated at their true positions and the paged cache holds keys rotated ONCE, when
  written. A decode step follows the method's rule (`lcx.methods.base`, "Decode rule"): one
  softmax over the window branch (the last `window` keys, read as they are: the query is already
  rotated at p_q) and the side branch (LM-Infinite's G global keys, the S sinks, Self-Extend's
  grouped keys), where a side key cached at a(R(p_k))k is re-rotated by
  delta = (side_key(p_k) - p_k) - (side_query(p_q) - p_q): only the method's few moved keys are
  rotated per step (all the keys past the window for Self-Extend, whose grouped positions move
  every key). Prefill and chunked prefill: where the rule holds for every query of a call
  (`rule_covers_prefill`: LM-Infinite with its cap at the window, sinks), each query is a row of
  the same call, read as the last query of its own prefix: it reads its side + window keys only
  (a band), planned in O(side + window) per query. Otherwise (LM-Infinite capped past its
  window, Self-Extend) with `AttentionMethod.query_keys` over the call's keys, each key
  re-rotated by (the position the method gives it - its true position), zero inside windows.
- **unrotated** (SWAT's sigmoid: no rule; LM-Infinite with top-k middle keys: its rule's top-k
  branch picks keys by score, not a fixed subset). The layer skips
  vLLM's rotary, the cache holds unrotated keys, and every call rotates the keys it reads
  relative to the unrotated query (`AttentionMethod.query_keys` through
  `lcx.methods.last_query.RelativeKeys`), or runs the method's own `attend`:
  `method.attend(q, k, v, rotary=Rotary(inv_freq, positions, attention_factor))`.

The step's plan (which keys each request reads, from which blocks; built from the step's
metadata only) is built once per step by the first layer and shared by every layer, as are the
rotation tables: `step_plan` (where the C++ kernel runs the step, the rotated layout's plan is
one call of the extension's `rule_plan`, ~45 µs per step for 16 staggered requests; elsewhere
numpy index arithmetic, the C++ planner's reference). Decode rows (one query) of the rotated layout, and its banded prefill rows, are
one call for the whole batch (compressed caches of different lengths padded with invisible keys); the unrotated layout groups
them by compressed length (`lcx.hf.bounded_cache`: the first n_first and last n_recent keys,
rotated by their true positions or, for StreamingLLM's renumbering, by their slot in the
compressed set). Prefills with equal numbers of queries and keys are one call over their whole
caches.

Each call runs on `lcx.kernels.cpu.paged_relative_attention_cpu` (C++, compiled on first use;
`attention_kernel()`): softmax over a subset of keys read straight from the paged cache, each
rotated by a small table row relative to the query (identity rows, the window keys of the
rotated layout, are read without rotating), masked softmax in one pass, one call per group and
layer; prefill tables from `query_keys` are compacted (`compact_index`) so each query walks only
the keys it sees, not every key of its prefix. Where the extension cannot build (no compiler or ninja; logged), or for SWAT's sigmoid,
the torch route runs instead: rotated decode gathers the kept keys, re-rotates them and runs one
SDPA; rotated prefill un-rotates q and k and calls the method's `attend`; the unrotated layout
gathers + `LastQueryPlan.attend` for decode and `attend` on `prefill_backend(method)` for
prefill. Every route is tested against `method.attend` (tests/serve/test_vllm_plugin_decode.py).

A layer whose vLLM attention soft-caps its logits (Gemma 2's `logits_soft_cap`) passes the cap to
every route: the C++ kernel, `lcx.attention.sdpa`, `LastQueryPlan.attend`, the method's `attend`
(on `blockwise`: torch's flash kernels have no cap).

Tensor parallelism: each rank holds its own heads (H / tp query heads, their kv heads) and its
own cache; everything here is per head, so a rank runs the same code on its slice, with per-head
parameters (SWAT's ALiBi slopes) cut to its heads (`method_for_rank`).

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

import dataclasses
import logging
import types

import torch

from lcx.attention import Rotary, sdpa
from lcx.attention.rotary import table_dtype
from lcx.method_config import INFERENCE_BACKEND
from lcx.methods import AttentionMethod
from lcx.kernels.cpu import compact_index, paged_relative_attention_cpu
from lcx.kernels.cpu.relative_attention import DTYPES as FUSED_DTYPES, load_extension
from lcx.methods.last_query import RelativeKeys
from lcx.rope import apply_rotary_ref, rope_cos_sin

from .step_plan import _cache_rows, _delta_keys, _RuleDecode, _step_plan, rotated_refusal

_log = logging.getLogger(__name__)


class _MethodAttention:
    """What a switched layer's impl runs: `forward` and `do_kv_cache_update` are bound onto the
    impl instance (as `lcx.hf.attention_patch.patch_attention` does for HF layers); `lcx_method`,
    `lcx_rotated`, `lcx_inv_freq`, `lcx_attention_factor`, `lcx_backend` are set on it by
    `switch_to_method`."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        # kv_cache: [num_blocks, Hkv, block_size, 2 * D]; keys in [..., :D], values in [..., D:].
        slots = slot_mapping[: key.shape[0]].long()
        if getattr(self, "lcx_kernel", None) == "cpp" and key.dtype == value.dtype == kv_cache.dtype \
                and key.dtype in FUSED_DTYPES:  # one C++ pass, no temporaries
            load_extension().write_kv(key, value, kv_cache.view(-1, kv_cache.shape[-1]), slots.contiguous(),
                                      kv_cache.shape[2], kv_cache.shape[1])
            return
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
        """query `[N, H, D]` (requests concatenated; rotated at its true positions in the rotated
        layout, else unrotated) -> output `[N, H, D]`."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by lcx methods")
        if attn_metadata is None:  # warm-up
            return output
        num_blocks, hkv, block_size, two_d = kv_cache.shape
        d = two_d // 2
        fused = (self.lcx_kernel == "cpp" and query.dtype == kv_cache.dtype == output.dtype
                 and query.dtype in FUSED_DTYPES)
        plan = _step_plan(attn_metadata, self.lcx_method, block_size, self.lcx_rotated,
                          tuple(kv_cache.shape) if fused else None)
        flat = kv_cache.view(-1, two_d)  # rows (block, head, offset): index_select gathers fast
        if plan.rule_decode is not None:  # rotated layout: every decode (+ banded prefill) row in one call
            _rule_decode_attend(self, plan.rule_decode, query, flat, kv_cache.shape, output, fused)
        for g in plan.decode_groups:  # one batched call per group of equally long compressed caches
            B, K = g.blocks.shape
            rows = g.cache_rows(kv_cache.shape)  # [B, K, Hkv]
            if fused:  # gather + relative rotation + masked softmax in one C++ call
                keys = g.relative_keys(self.lcx_method, self.lcx_inv_freq, self.lcx_attention_factor, query.dtype)
                if keys is not None:
                    paged_relative_attention_cpu(query, flat, rows, g.rows[:, None], keys, scale=self.scale,
                                                 out=output, softcap=self.lcx_softcap)
                    continue
            kv = flat.index_select(0, rows.flatten()).view(B, K, hkv, two_d)
            q = query[g.rows][:, None]  # [B, 1, H, D]
            lq = g.plan(self.lcx_method, self.lcx_inv_freq, self.lcx_attention_factor, query.dtype)
            if lq is None:  # not plain softmax attention (SWAT): the method's own path
                out = self.lcx_method.attend(q, kv[..., :d], kv[..., d:], scale=self.scale,
                                             rotary=Rotary(self.lcx_inv_freq, g.positions, self.lcx_attention_factor),
                                             layer_idx=self.lcx_layer_idx, softcap=self.lcx_softcap)
            else:
                out = lq.attend(q, kv[..., :d], kv[..., d:], scale=self.scale, softcap=self.lcx_softcap)
            output[g.rows] = out[:, 0].to(output.dtype)
        rotary = Rotary(self.lcx_inv_freq, None, self.lcx_attention_factor)
        for g in plan.multi_query_groups:  # one batched call per group of equally shaped requests
            B, n_blk = g.blocks.shape
            if fused:
                keys = _prefill_keys(self, g.n_keys, g.n_queries, query.dtype)
                if keys is not None:  # each query walks only the keys it sees (window + side: a band)
                    paged_relative_attention_cpu(query, flat, g.cache_rows(kv_cache.shape),
                                                 g.token_rows.view(B, g.n_queries), keys[0], scale=self.scale,
                                                 out=output, cols=keys[1], softcap=self.lcx_softcap)
                    continue
            kv = kv_cache[g.blocks].permute(0, 1, 3, 2, 4).reshape(B, n_blk * block_size, hkv, two_d)[:, :g.n_keys]
            q = query[g.token_rows].view(B, g.n_queries, *query.shape[1:])  # the last Tq of the Tk keys
            k = kv[..., :d]
            if self.lcx_rotated:  # back to the method's inputs: q and k un-rotated (lcx's tables)
                cos, sin = rope_cos_sin(torch.arange(g.n_keys), self.lcx_inv_freq, self.lcx_attention_factor,
                                        table_dtype(query.dtype))
                k = apply_rotary_ref(k, cos, sin, inverse=True)
                q = apply_rotary_ref(q, cos[g.n_keys - g.n_queries:], sin[g.n_keys - g.n_queries:], inverse=True)
            out = self.lcx_method.attend(q, k, kv[..., d:], rotary=rotary, scale=self.scale,
                                         backend=self.lcx_backend, layer_idx=self.lcx_layer_idx,
                                         softcap=self.lcx_softcap)
            output[g.token_rows] = out.reshape(B * g.n_queries, *out.shape[2:]).to(output.dtype)
        return output


def _rule_decode_attend(impl, dec: "_RuleDecode", query: torch.Tensor, flat: torch.Tensor, cache_shape,
                        output: torch.Tensor, fused: bool) -> None:
    """The decode rows of a step in the rotated layout: rotated query `[N, H, D]`, the cache as
    rows `flat [R, 2D]`; writes `output[dec.rows]`."""
    rows = dec.cache_rows(cache_shape)  # [B, K, Hkv]
    if fused:  # window keys read as they are, side keys re-rotated by their table row: one C++ call
        keys = dec.relative_keys(impl.lcx_inv_freq, query.dtype)
        paged_relative_attention_cpu(query, flat, rows, dec.rows[:, None], keys, scale=impl.scale, out=output,
                                     softcap=impl.lcx_softcap)
        return
    B, K = dec.visible.shape
    d = flat.shape[1] // 2
    wide = table_dtype(query.dtype)
    kv = flat.index_select(0, rows.flatten()).view(B, K, -1, 2 * d).to(wide)  # [B, K, Hkv, 2D]
    cos, sin = dec.tables(impl.lcx_inv_freq, wide)  # [B, K, r]: identity for window keys
    k = apply_rotary_ref(kv[..., :d], cos, sin).transpose(1, 2)  # [B, Hkv, K, D]
    q = query[dec.rows][:, :, None].to(wide)  # [B, H, 1, D]
    out = sdpa(q, k, kv[..., d:].transpose(1, 2), attn_mask=dec.visible[:, None, None, :], scale=impl.scale,
               softcap=impl.lcx_softcap)
    output[dec.rows] = out[:, :, 0].to(output.dtype)


def prefill_backend(method: AttentionMethod, softcap: float | None = None) -> str:
    """The `lcx.attention` backend of multi-query calls: lcx's fastest exact CPU route
    (`INFERENCE_BACKEND`) where the method runs on it (with the layer's logit cap `softcap`),
    else blockwise (SWAT's sigmoid, a soft-capped layer)."""
    return INFERENCE_BACKEND if method.supports(INFERENCE_BACKEND, softcap=softcap) is None else "blockwise"


_PREFILL_KEYS_MAX = 64  # shapes of prefill/chunk calls remembered per layer


def _prefill_keys(impl, n_keys: int, n_queries: int,
                  dtype: torch.dtype) -> tuple[RelativeKeys, torch.Tensor] | None:
    """`RelativeKeys` of a prefill or chunk of `n_queries` queries over `n_keys` keys at positions
    0..n_keys-1, compacted to the keys each query sees (`compact_index`: `(keys, cols)`, index and
    cols `[1, Tq, Kc]`), remembered per layer (prompts of a workload repeat a few shapes).
    Unrotated layout: each key's position relative to its query (`RelativeKeys.build`); rotated
    layout: the position `query_keys` gives the key minus its true one (0 inside windows)."""
    cache = impl.lcx_prefill_keys
    key = (n_keys, n_queries, dtype)
    if key not in cache:
        if len(cache) >= _PREFILL_KEYS_MAX:
            cache.pop(next(iter(cache)))
        if impl.lcx_rotated:
            pos = torch.arange(n_keys)[None]  # [1, Tk]
            keys = impl.lcx_method.query_keys(pos, n_queries)  # [1, Tq, Tk]
            visible = torch.ones(keys.key_positions.shape, dtype=torch.bool) if keys.visible is None \
                else keys.visible
            full = _delta_keys(visible, keys.key_positions.to(torch.float64) - pos[:, None], impl.lcx_inv_freq)
        else:
            full = RelativeKeys.build(impl.lcx_method, Rotary(impl.lcx_inv_freq, None, impl.lcx_attention_factor),
                                      n_keys=n_keys, n_queries=n_queries, device=impl.lcx_inv_freq.device,
                                      dtype=dtype)
        if full is None:
            cache[key] = None
        else:
            cols, index = compact_index(full.index)
            cache[key] = (RelativeKeys(index, full.cos, full.sin), cols)
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


def method_for_rank(method: AttentionMethod, total_heads: int, n_heads: int, rank: int) -> AttentionMethod:
    """`method` as tensor-parallel rank `rank` runs it on its `n_heads` of the model's
    `total_heads` query heads (heads [rank * n_heads, (rank + 1) * n_heads)). The same method for
    every method without per-head parameters; SWAT's per-head ALiBi slopes are resolved for the
    whole model (`SWAT.for_heads`) and cut to the rank's heads, so each head keeps its slope."""
    if n_heads == total_heads or not hasattr(method, "for_heads"):
        return method
    full = method.for_heads(total_heads)
    return dataclasses.replace(full, alibi_slopes=full.alibi_slopes[rank * n_heads:(rank + 1) * n_heads])


def switch_to_method(attn_layer, method: AttentionMethod, inv_freq: torch.Tensor, attention_factor: float,
                     *, rotated: bool = False) -> None:
    """Make vLLM `Attention` layer `attn_layer` run `method` (see module doc): on q/k rotated at
    their true positions by the layer's rotary embedding (`rotated`, the method must have a
    `decode_rule`), or on unrotated q/k. `inv_freq`, `attention_factor`: the layer's RoPE basis."""
    if rotated and (reason := rotated_refusal(method)) is not None:
        raise ValueError(f"attention method {method.describe()} cannot run on rotated keys: {reason}")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = attn_layer.impl
    if not isinstance(impl, CPUAttentionBackendImpl):
        raise ValueError(f"attention method {method.name!r} runs inside vLLM on the CPU backend only; "
                         f"this layer uses {type(impl).__name__}")
    # Terms of the layer's own attention that lcx's methods have none for: refused, never dropped.
    # (Its logit soft-capping, Gemma 2's, every lcx method takes: `softcap` below.)
    own = {"attention sinks (s_aux)": getattr(impl, "sinks", None) is not None,
           "ALiBi slopes": getattr(impl, "alibi_slopes", None) is not None}
    if any(own.values()):
        raise ValueError(f"attention method {method.name!r} cannot run on {attn_layer.layer_name}: the layer has "
                         f"{', '.join(k for k, v in own.items() if v)}, which lcx's methods do not compute")
    impl.forward = types.MethodType(_MethodAttention.forward, impl)
    impl.do_kv_cache_update = types.MethodType(_MethodAttention.do_kv_cache_update, impl)
    impl.lcx_method = method
    impl.lcx_rotated = bool(rotated)
    impl.lcx_softcap = float(getattr(impl, "logits_soft_cap", 0) or 0) or None  # vLLM: 0 means none
    impl.lcx_backend = prefill_backend(method, impl.lcx_softcap)
    impl.lcx_kernel = attention_kernel()
    impl.lcx_prefill_keys = {}  # (n_keys, n_queries, dtype) -> (RelativeKeys, cols), see `_prefill_keys`
    impl.lcx_inv_freq = inv_freq
    impl.lcx_attention_factor = float(attention_factor)
    # the model layer (methods that differ per layer: LM-Infinite's top-k) from vLLM's layer name
    impl.lcx_layer_idx = layer_index(getattr(attn_layer, "layer_name", ""))


def layer_index(layer_name: str) -> int | None:
    """The decoder layer of a vLLM attention layer's name ("model.layers.3.self_attn.attn" -> 3)."""
    import re

    m = re.search(r"(?:^|\.)layers\.(\d+)\.", layer_name)
    return int(m.group(1)) if m else None
