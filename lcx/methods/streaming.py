"""StreamingLLM attention over a whole sequence (arXiv 2309.17453; mit-han-lab/streaming-llm).

StreamingLLM decodes with a cache of S sink keys + the last w - 1 keys, caches keys BEFORE
RoPE, and rotates them by their slot index in the cache at every step (`enable_pos_shift`);
the query takes the last slot. Relative distances inside the window are therefore the true
ones, and a sink s sits at distance (S + w - 1) - s: just before the window. Written for
query i (key index, `lcx.masks` convention) over the full sequence, with p the keys' RoPE
positions and c_i = min(i, S + w - 1) (before the cache fills, nothing is renumbered):

    window key j  (i - w < j <= i):           s_ij = scale * R(p_i) q_i . R(p_j) k_j
    sink key j    (j < S, i - j >= w):        s_ij = scale * R(p_{c_i}) q_i . R(p_j) k_j
    every other key: masked (the `attention_sinks(S, w - 1)` mask); one softmax over both.

Example, S = 2, w = 3, Tk = 8, query i = 7: keys 5, 6, 7 at their positions, sinks 0, 1
scored as if the query sat at position 4 (distances 4 and 3; true distances 7 and 6).

So decoding with StreamingLLM's bounded cache equals this full-sequence attention (and
perplexity can be measured in one forward). `streaming_attention_ref` is the definition
(dense); `streaming_attention` computes it from two `lcx.attention` passes merged by their
log-sum-exp (window pass, then a sink pass with per-query positions), so it runs on any
backend that returns lse (ref, blockwise, flex) with the backend's memory profile.
"""

from __future__ import annotations

import torch

from lcx.attention import AttentionSpec, Rotary, attention, backend_for, merge_attention, normalize_scores, soft_cap
from lcx.attention.reference import gqa_scores, gqa_weighted_values
from lcx.attention.rotary import lambda_global_mask, rotate_qk, table_dtype
from lcx.masks import attention_sinks, mask_matrix, sliding_window
from lcx.masks.base import check_count, default_q_offset
from lcx.rope import apply_rotary_ref, rope_cos_sin


def _sink_query_positions(rotary: Rotary, n_keys: int, q_offset: int, n_queries: int, cap: int,
                          device) -> torch.Tensor:
    """RoPE positions `[(B,) Tq]` of the queries in the sink branch: p[min(i, cap)]."""
    pos = rotary.key_positions(n_keys, device)  # [(B,) Tk]
    idx = torch.arange(q_offset, q_offset + n_queries, device=device).clamp(max=cap)
    return pos[..., idx]


def _rotate(x: torch.Tensor, rotary: Rotary, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = rope_cos_sin(positions, rotary.inv_freq.to(x.device), rotary.attention_factor, table_dtype(x.dtype))
    return apply_rotary_ref(x, cos, sin)


def _check(q, k, n_sink, window, q_offset):
    check_count("n_sink", n_sink, 0)
    check_count("window", window, 1)
    off = default_q_offset(q.shape[1], k.shape[1], q_offset)
    if off + q.shape[1] > k.shape[1]:
        raise ValueError(f"queries must be keys: q_offset + Tq = {off + q.shape[1]} > Tk = {k.shape[1]}")
    return off


def streaming_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rotary: Rotary,
    n_sink: int,
    window: int,
    scale: float | None = None,
    q_offset: int | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
):
    """The definition (module docstring), dense: UNROTATED q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`,
    v `[B, Tk, Hkv, Dv]` -> out `[B, Tq, H, Dv]` (and lse `[B, H, Tq]`). O(Tq * Tk) memory.
    `softcap`: logits soft-capped (`lcx.attention.AttentionSpec.softcap`)."""
    off = _check(q, k, n_sink, window, q_offset)
    (_, Tq, H, D), Tk = q.shape, k.shape[1]
    sc = scale if scale is not None else D ** -0.5
    wide = torch.promote_types(q.dtype, torch.float32)
    q_rot, k_rot = rotate_qk(q, k, rotary, off)  # true positions
    q_sink = _rotate(q, rotary, _sink_query_positions(rotary, Tk, off, Tq, n_sink + window - 1, q.device))
    s_win = soft_cap(gqa_scores(q_rot, k_rot).to(wide) * sc, softcap)  # [B, H, Tq, Tk]
    s_sink = soft_cap(gqa_scores(q_sink, k_rot).to(wide) * sc, softcap)
    i = torch.arange(off, off + Tq, device=q.device)[:, None]
    j = torch.arange(Tk, device=q.device)[None, :]
    is_sink = (j < n_sink) & (i - j >= window)  # [Tq, Tk]
    s = torch.where(is_sink, s_sink, s_win)
    visible = mask_matrix(attention_sinks(n_sink, window - 1), Tq, Tk, q_offset=off, device=q.device)
    w, lse = normalize_scores(s, visible, "softmax")
    return gqa_weighted_values(w, lse, v, H, return_lse)


def streaming_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rotary: Rotary,
    n_sink: int,
    window: int,
    backend: str = "blockwise",
    scale: float | None = None,
    q_offset: int | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
):
    """`streaming_attention_ref`'s result from two `lcx.attention` passes merged by lse.

    pass A: `sliding_window(left=window - 1)`, q and k rotated at their true positions;
    pass B: the first S' = min(n_sink, Tk) keys at their positions, queries at p[min(i, S+w-1)],
            mask `j < n_sink and i - j >= window` (sinks inside the window stay in pass A).
    `backend` must return lse (ref, blockwise, flex, flash); others raise NotImplementedError.
    Pass B runs on `backend` when it supports its mask, else on blockwise.
    """
    off = _check(q, k, n_sink, window, q_offset)
    Tq, Tk = q.shape[1], k.shape[1]
    o_a, lse_a = attention(q, k, v, AttentionSpec(mask=sliding_window(left=window - 1), scale=scale, softcap=softcap),
                           backend=backend, q_offset=off, rotary=rotary, return_lse=True)
    n_s = min(n_sink, Tk)
    first = max(0, window - off)  # queries before key index `window` see no sink outside their window
    if n_s == 0 or first >= Tq:
        return (o_a, lse_a) if return_lse else o_a
    key_pos = rotary.key_positions(Tk, k.device)
    k_sink = _rotate(k[:, :n_s], rotary, key_pos[..., :n_s])  # [B, S', Hkv, D]
    q_sink = _rotate(q[:, first:], rotary,
                     _sink_query_positions(rotary, Tk, off + first, Tq - first, n_sink + window - 1, q.device))
    spec_b = AttentionSpec(mask=lambda_global_mask(n_sink, window), scale=scale, softcap=softcap)
    # pass B reads only the S' sink keys (O(Tq * S') work): a backend that cannot cut its mask
    # hands it to blockwise, which computes the same thing (flash cuts it: `global_outside_window`)
    backend_b = backend_for(backend, spec_b)
    o_b, lse_b = attention(q_sink, k_sink, v[:, :n_s], spec_b, backend=backend_b, q_offset=off + first,
                           return_lse=True)
    o_t, lse_t = merge_attention(o_a[:, first:], lse_a[..., first:], o_b, lse_b)
    out, lse = torch.cat((o_a[:, :first], o_t), 1), torch.cat((lse_a[..., :first], lse_t), -1)
    return (out, lse) if return_lse else out


__all__ = ["streaming_attention", "streaming_attention_ref"]
