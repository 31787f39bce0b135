"""lcx attention methods that need *unrotated* keys (LM-Infinite, StreamingLLM sinks) inside vLLM.

LM-Infinite scores its global keys at a capped distance (global keys unrotated, the query rotated
to min(limit, Tk - 1)) and StreamingLLM renumbers positions inside its cache; neither fits vLLM's
kernels, which attend over keys cached *after* RoPE with causal + sliding-window masks only.
This module runs them exactly instead:

- the layer skips vLLM's rotary embedding, so q and k arrive unrotated and the cache holds
  unrotated keys;
- the layer's attention implementation (vLLM's CPU impl: its KV-cache shape and metadata
  builder are kept) gets `_MethodAttention`'s forward and cache update, with its own layout,
  which writes k/v into the paged cache with plain indexing and, per request, gathers the
  request's keys through its block table and calls the lcx method itself:
  `method.attend(q, k, v, rotary=Rotary(inv_freq, attention_factor=...))` — lcx's semantics,
  RoPE included, with the queries the last Tq of the request's Tk keys (lcx's convention,
  which is also how vLLM schedules prefill, chunked prefill and decode).

Cost: a Python loop over requests and lcx's blockwise backend, O(Tq * (G + L)) memory per
request: an exact path for evaluation and serving small models, not a fast kernel. The KV cache
keeps every block (vLLM's manager sees full attention); a bounded cache is not implemented.
Limits: vLLM's CPU backend only (its `[num_blocks, kv_heads, block_size, 2 * head]` cache shape);
the switch uses the `impl` attribute of vLLM's `Attention` layer (an internal, pinned to
vllm 0.32: on CPU the platform always picks CPU_ATTN, so a registered custom backend cannot be
selected through the documented `--attention-backend` route).
"""

from __future__ import annotations

import types

import torch

from lcx.attention import Rotary
from lcx.methods import AttentionMethod


class _MethodAttention:
    """What a switched layer's impl runs: `forward` and `do_kv_cache_update` are bound onto the
    impl instance (as `lcx.methods.patch_attention` does for HF layers); `lcx_method`,
    `lcx_inv_freq`, `lcx_attention_factor` are set on it by `switch_to_method`."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        # kv_cache: [num_blocks, Hkv, block_size, 2 * D]; keys in [..., :D], values in [..., D:].
        block_size, d = kv_cache.shape[2], key.shape[-1]
        slots = slot_mapping[: key.shape[0]].long()
        keep = slots >= 0  # -1: padding tokens
        blk, off = slots[keep] // block_size, slots[keep] % block_size
        kv_cache[blk, :, off, :d] = key[: slots.shape[0]][keep].to(kv_cache.dtype)  # [N, Hkv, D]
        kv_cache[blk, :, off, d:] = value[: slots.shape[0]][keep].to(kv_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        """query `[N, H, D]` (unrotated, requests concatenated) -> output `[N, H, D]`."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by lcx methods")
        if attn_metadata is None:  # warm-up
            return output
        num_blocks, hkv, block_size, two_d = kv_cache.shape
        d = two_d // 2
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        rotary = Rotary(self.lcx_inv_freq, None, self.lcx_attention_factor)
        for i in range(len(starts) - 1):
            s, e, n_keys = starts[i], starts[i + 1], int(seq_lens[i])
            if e <= s:
                continue
            n_blk = -(-n_keys // block_size)
            blocks = attn_metadata.block_table[i, :n_blk].long()
            kv = kv_cache[blocks].permute(0, 2, 1, 3).reshape(n_blk * block_size, hkv, two_d)[:n_keys]  # [Tk, Hkv, 2D]
            k, v = kv[..., :d], kv[..., d:]
            q = query[s:e]  # [Tq, H, D], the last Tq of the Tk keys
            out = self.lcx_method.attend(q[None], k[None], v[None], rotary=rotary, scale=self.scale)  # [1, Tq, H, D]
            output[s:e] = out[0].to(output.dtype)
        return output


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
    impl.lcx_inv_freq = inv_freq
    impl.lcx_attention_factor = float(attention_factor)
