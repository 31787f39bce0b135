"""The `flash` backend: fused flash-attention kernels that return a log-sum-exp, composed
into causal / sliding-window / Λ-mask / LM-Infinite attention without ever forming scores.

Kernels (chosen by device; imported lazily, nothing is queried at import time):

- CPU:  `aten._scaled_dot_product_flash_attention_for_cpu` (torch's fused CPU flash kernel;
        returns (out, lse); takes `is_causal` and an optional additive mask).
- CUDA: `flash_attn.flash_attn_func` when flash-attn is importable (its `window_size` does the
        local window in one call, `return_attn_probs=True` gives the lse); otherwise torch's
        bundled flash kernel (`aten._scaled_dot_product_flash_attention`) for the unmasked and
        causal calls and the memory-efficient kernel (`aten._scaled_dot_product_efficient_attention`,
        `compute_log_sumexp=True`) for the few calls that need an explicit mask.

A mask with G global keys and a window of W = left + 1 keys (causal: W = inf, G = 0; sliding
window: G = 0; Λ / attention sinks: G > 0) is cut into pieces that each take a kernel's fast
path (no mask, or `is_causal`), merged by their lse (`lcx.attention.merge`):

  The window, queries grouped in chunks of W consecutive indices [cW, cW + W): a query of
  chunk c sees keys in chunks c - 1 and c only, so ALL chunks go into the batch dimension of
  two calls:

      current chunk   keys [cW, cW + W)        query t sees key s iff s <= t   -> is_causal
      previous chunk  keys [cW - W, cW)        query t sees key s iff s >= t + 1 (strictly
                                               anti-causal): reverse queries and keys, drop the
                                               first reversed query (t = W-1 sees none) and the
                                               last reversed key (s = 0 is seen by none); what is
                                               left is top-left causal -> is_causal

      chunk c-1         chunk c            e.g. W = 4, query t = 1 of chunk c (index cW + 1)
      . . x x   |   x x . .                sees keys cW-2, cW-1 (previous) and cW, cW+1

  (On the CPU the window body is the chunked, strided form of this in `_window_body`: query
  chunks of C, each reading the r + 1 key chunks of its window through one shared mask.)

  The global keys (j < G, outside the query's window: i - j > left): queries i >= G + left
  see all G of them -> one unmasked call; the first G + left queries take one masked call.
  On the CPU's chunked body they are instead two thin matmuls per block of rows with the lse
  merge folded in (`_add_global_keys`; at G = 64 a kernel call over 64 keys plus a merge cost
  twice as much). LM-Infinite runs this pass with its capped query and unrotated global keys
  (`lcx.attention.rotary.lambda_inputs`), exactly as `lambda_two_pass` does.

Queries that do not start at a chunk boundary (chunked prefill) are padded in front to one;
the tail is padded to a whole chunk (padded keys sit after every real query, so causality
hides them). Few queries (Tq < W, e.g. decode) take one masked call over the keys in their span
(`KeySpan.key_ranges`), which reads G + W + Tq keys, not Tk.

Work: ~T * (W + G) multiply-adds per head instead of T^2 / 2 for dense causal attention, at
the speed of the fused kernel. Softmax only, no ALiBi, forward only (no autograd through the
lse merge): `supports` says so, and `sdpa` / `blockwise` cover the rest.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

from lcx.masks import window_shape

from .backends import Backend, call_info, refuse, register_backend
from .merge import merge_many
from .rotary import lambda_inputs, rotate_qk
from .spec import AttentionSpec, CallInfo, check_call, scale_of

NEG_INF = float("-inf")
CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CUDA_DTYPES = (torch.float16, torch.bfloat16)


class Structure(NamedTuple):
    """A mask as G global keys + a causal window of `left + 1` keys (`left=None`: unbounded)."""

    n_global: int
    left: int | None


def mask_structure(spec: AttentionSpec) -> Structure | None:
    """The exact (G, left) of the spec's mask, or None for masks this backend cannot cut."""
    if spec.lambda_params is not None:
        return Structure(spec.lambda_params.n_global, spec.lambda_params.n_local - 1)
    # no mask at all (not causal) has no shape: a plain unmasked call would do, but rare
    shape = window_shape(spec.mask)
    if shape is None or shape.left == -1:  # global tokens alone (no window): not cut here
        return None
    return Structure(shape.n_global, shape.left)


# ----------------------------------------------------------------------------- kernels
# Every kernel call below works on [B', H, T, D] tensors and returns (out [B', H, Tq, Dv],
# lse [B', H, Tq] float32). `mask` is a bool [Tq, Tk] (True = visible); rows with no visible
# key come back as out = 0, lse = -inf.


def _flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _kernel(q, k, v, *, causal: bool, scale: float, mask: torch.Tensor | None = None):
    if q.shape[2] == 0 or k.shape[2] == 0:
        B, H, Tq = q.shape[:3]
        wide = torch.promote_types(q.dtype, torch.float32)
        return q.new_zeros(B, H, Tq, v.shape[-1]), q.new_full((B, H, Tq), NEG_INF, dtype=wide)
    empty = None
    if mask is not None:
        empty = ~mask.any(-1)  # [Tq]
        mask = mask | empty[:, None]
        Tq, Tk = mask.shape
        # padded to a multiple of 8 columns: the CUDA memory-efficient kernel wants aligned rows
        bias = torch.zeros(Tq, -(-Tk // 8) * 8, dtype=q.dtype, device=q.device)[:, :Tk]
        bias.masked_fill_(~mask, NEG_INF)
    if q.device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        if mask is None:
            out, lse = op(q, k, v, 0.0, causal, scale=scale)
        else:
            out, lse = op(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    elif mask is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        B, H = q.shape[:2]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias.expand(B, H, Tq, Tk), True, 0.0, False, scale=scale
        )[:2]
        lse = lse[..., :Tq]  # some versions pad the lse to a multiple of 32 rows
    lse = lse.to(torch.promote_types(lse.dtype, torch.float32))
    if empty is not None and bool(empty.any()):
        out = out.masked_fill(empty[:, None], 0.0)
        lse = lse.masked_fill(empty, NEG_INF)
    return out, lse


def _heads_first(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, Hkv, D] -> [B, H, T, D], kv heads repeated for GQA (h reads h // (H // Hkv))."""
    B, T, Hkv, D = x.shape
    if Hkv != n_heads:
        x = x[:, :, :, None].expand(B, T, Hkv, n_heads // Hkv, D).reshape(B, T, n_heads, D)
    return x.transpose(1, 2)


def _pad_time(x: torch.Tensor, front: int, back: int) -> torch.Tensor:
    """Zero-pad [B, H, T, D] along T."""
    if front == 0 and back == 0:
        return x
    B, H, T, D = x.shape
    out = x.new_zeros(B, H, front + T + back, D)
    out[:, :, front : front + T] = x
    return out


def chunk_size(W: int) -> int:
    """Query chunk C for a window of W keys. A query chunk reads r + 1 key chunks, r = ceil(W / C),
    so the work per query is (r + 1) C ~ W + C: smaller chunks waste less on the two masked
    triangles, but torch's CPU flash kernel splits the C queries of a call into blocks of 32
    rows when C < 192, 64 when C < 768 and 256 from 768 on, and its big blocks run ~1.2x
    faster per flop (measured at T = 32k, one thread, this repo's Λ benchmark shape):

        W = 1024:  C = 64 (1088 keys/query) 1.44 s,  C = 128 (1152) 1.51 s,  C = 32 1.50 s
        W = 8192:  C = 1024 (9216 keys/query) 8.6 s, C = 512 9.9 s,  C = 256 9.6 s

    so C = 64 (r = W / 64: small waste, small blocks) below W = 4096, and from there W / 8
    rounded up to 64, at least 768 (big blocks; W = 8188 and 8192 get C = 1024). W <= 64: C = W."""
    if W <= 64:
        return W
    if W < 4096:
        return 64
    return max(768, -(-W // 512) * 64)


def _window_body(q, k, v, *, b0: int, W: int, C: int, scale: float):
    """Causal window of W keys for the queries at indices [b0, b0 + Tq) over keys [0, b0 + Tq);
    b0 >= rC (r = ceil(W / C)) and on the chunk grid. q, k, v [B, H, T, D]; returns (out, lse).

    Query chunk c (indices [cC, cC + C)) reads the r + 1 key chunks c-r .. c, a strided view of
    the keys (`unfold`, no copy), with ONE mask [C, (r+1)C] that is the same for every chunk:
    query t of the chunk sees key s of the span iff rC + t - W < s <= rC + t. For W = rC:

        chunk c-r         chunks c-r+1 .. c-1     chunk c
        s >= t + 1        all                     s <= t          (query t, key s of a chunk)

    so every chunk of every row goes into the batch dimension of a single kernel call.
    (Prepending the global keys to every chunk would save the merge but copy ~(r+1)x the
    keys; they get their own call instead.)
    """
    B, H, Tq, D = q.shape
    Dv = v.shape[-1]
    r, n = -(-W // C), -(-Tq // C)
    back = n * C - Tq
    qc = _pad_time(q, 0, back).view(B, H, n, C, D).transpose(1, 2).reshape(B * n, H, C, D)

    def windows(x):  # [B, H, T, D] -> [B * n, H, (r+1)C, D], overlapping views (B = 1: no copy)
        xp = _pad_time(x[:, :, b0 - r * C :], 0, back)  # [B, H, (r+n)C, D]
        xw = xp.unfold(2, (r + 1) * C, C).permute(0, 2, 1, 4, 3)  # [B, n, H, (r+1)C, D]
        return xw.reshape(B * n, H, (r + 1) * C, x.shape[-1])

    t = torch.arange(C, device=q.device)[:, None]
    s = torch.arange((r + 1) * C, device=q.device)[None, :]
    vis = (s > r * C + t - W) & (s <= r * C + t)  # [C, (r+1)C]
    o, lse = _kernel(qc, windows(k), windows(v), causal=False, scale=scale, mask=vis)
    o = o.view(B, n, H, C, Dv).transpose(1, 2).reshape(B, H, n * C, Dv)[:, :, :Tq]
    lse = lse.view(B, n, H, C).transpose(1, 2).reshape(B, H, n * C)[:, :, :Tq]
    return o, lse


def _merge_bhtd(*parts):
    """Merge (out [B, H, T, Dv], lse [B, H, T]) parts over disjoint keys (`merge_many`)."""
    if len(parts) == 1:
        return parts[0]
    return merge_many([o for o, _ in parts], [lse for _, lse in parts], dim=2)


def _global_pass(q, k, v, *, q0: int, G: int, left: int, scale: float):
    """Global keys j < G that are OUTSIDE query i's window (i - j > left), queries [q0, q0+Tq).
    q [B, H, Tq, D], k/v the G global keys [B, H, G, D]. Rows i >= G + left: one unmasked call."""
    B, H, Tq, _ = q.shape
    Dv = v.shape[-1]
    split = min(Tq, max(0, G + left - q0))  # rows [0, split) see only some globals
    outs, lses = [], []
    if split:
        i = torch.arange(q0, q0 + split, device=q.device)[:, None]
        j = torch.arange(G, device=q.device)[None, :]
        o, lse = _kernel(q[:, :, :split], k, v, causal=False, scale=scale, mask=(i - j > left) & (j <= i))
        outs.append(o), lses.append(lse)
    if split < Tq:
        o, lse = _kernel(q[:, :, split:], k, v, causal=False, scale=scale)
        outs.append(o), lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _add_global_keys(o_w, l_w, q, k, v, *, q0: int, left: int, scale: float, out, lse, rows: int | None = None):
    """Merge the G global keys OUTSIDE each query's window (i - j > left) into a window pass
    (o_w [B, H, Tq, Dv], l_w [B, H, Tq]) of queries [q0, q0 + Tq); writes out [B, H, Tq, Dv]
    (any strides, e.g. a view of the [B, T, H, Dv] result) and lse [B, H, Tq] in place.

    With G ~ 64 keys the global part is two thin matmuls per block of rows, and folding the
    merge into them saves what a kernel call + `merge_many` cost (a flash call over 64 keys
    runs at half the kernel's speed, and every full-size temporary is a pass over memory):

        s = scale q k^T,  m = max(max_j s, l_w),  p = exp(s - m),  z = sum_j p + exp(l_w - m)
        out = (exp(l_w - m) o_w + p v) / z,   lse = m + log z

    Row blocks keep s [B, H, rows, G] in cache. Every query of the chunked body sees its own
    key, so l_w and m are finite. Computed in float32 (or wider)."""
    B, H, Tq, _ = q.shape
    G = k.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    kT, v = k.to(wide).transpose(-1, -2).contiguous(), v.to(wide).contiguous()  # [B, H, D, G], [B, H, G, Dv]
    rows = rows or max(64, (1 << 19) // (B * H * max(G, v.shape[-1])))
    j = torch.arange(G, device=q.device)
    for a in range(0, Tq, rows):
        b = min(Tq, a + rows)
        s = torch.matmul(q[:, :, a:b].to(wide), kT).mul_(scale)  # [B, H, n, G]
        split = min(b, G + left - q0) - a  # rows [a, a + split) see only the globals j < i - left
        if split > 0:
            i = torch.arange(q0 + a, q0 + a + split, device=q.device)[:, None]
            s[:, :, :split].masked_fill_(i - j <= left, NEG_INF)
        lw = l_w[:, :, a:b].to(wide)
        m = torch.maximum(s.amax(-1), lw)  # [B, H, n]
        p = s.sub_(m.unsqueeze(-1)).exp_()
        zw = torch.exp(lw - m)
        z = p.sum(-1).add_(zw)
        o = torch.matmul(p, v).addcmul_(o_w[:, :, a:b].to(wide), zw.unsqueeze(-1)).div_(z.unsqueeze(-1))
        out[:, :, a:b] = o
        lse[:, :, a:b] = m.add_(z.log_())


def _span_call(q, k, v, *, q0: int, st: Structure, scale: float, k_glob=None, q_glob=None):
    """Few queries (decode, short chunks): masked calls over the keys of their span only.

    Plain Λ: one call over [0, G) u [lo, Tk) with the exact visibility. LM-Infinite (k_glob,
    q_glob given): a window call over [lo, Tk), and the global keys outside each query's window
    in a second call with the capped query."""
    Tq, Tk = q.shape[2], k.shape[2]
    G, left = st.n_global, st.left
    if q0 + Tq - 1 <= left:  # every query's window reaches key 0: plain causal (skips the
        return _causal(q, k[:, :, : q0 + Tq], v[:, :, : q0 + Tq], q0=q0, scale=scale)  # upper triangle)
    if q0 <= left:  # the rows whose window reaches key 0 first (causal), then the others
        n1 = left + 1 - q0
        o1, l1 = _causal(q[:, :, :n1], k[:, :, : left + 1], v[:, :, : left + 1], q0=q0, scale=scale)
        o2, l2 = _span_call(q[:, :, n1:], k, v, q0=left + 1, st=st, scale=scale, k_glob=k_glob,
                            q_glob=None if q_glob is None else q_glob[:, :, n1:])
        return torch.cat((o1, o2), 2), torch.cat((l1, l2), 2)
    i = torch.arange(q0, q0 + Tq, device=q.device)[:, None]
    lo = max(0, q0 - left)  # the window keys of these queries lie in [lo, Tk)
    j = torch.arange(lo, Tk, device=q.device)[None, :]
    if k_glob is None:
        g = min(G, lo)  # global keys before lo (those after lo are in j already)
        jj = torch.cat((torch.arange(g, device=q.device)[None, :], j), 1)
        keys, vals = torch.cat((k[:, :, :g], k[:, :, lo:]), 2), torch.cat((v[:, :, :g], v[:, :, lo:]), 2)
        vis = (jj <= i) & ((jj < G) | (i - jj <= left))
        return _kernel(q, keys, vals, causal=False, scale=scale, mask=vis)
    o_a, l_a = _kernel(q, k[:, :, lo:], v[:, :, lo:], causal=False, scale=scale, mask=(j <= i) & (i - j <= left))
    g = k_glob.shape[2]  # min(n_global, Tk)
    jg = torch.arange(g, device=q.device)[None, :]
    vis_g = (jg <= i) & (i - jg > left)
    if not bool(vis_g.any()):
        return o_a, l_a
    o_b, l_b = _kernel(q_glob, k_glob, v[:, :, :g], causal=False, scale=scale, mask=vis_g)
    return _merge_bhtd((o_a, l_a), (o_b, l_b))


# ----------------------------------------------------------------------------- backend
def _outside_window(spec: AttentionSpec) -> tuple[int, int] | None:
    """(G, L) of a `lambda_global_mask(G, L)` (keys j < G with i - j >= L: LM-Infinite's global
    branch, StreamingLLM's sink pass), or None."""
    return getattr(spec.mask, "global_outside_window", None) if spec.lambda_params is None else None


def _flash_supports(spec: AttentionSpec, call: CallInfo | None = None) -> str | None:
    if spec.softcap is not None:
        return "torch's fused flash kernels have no logit soft-capping (use blockwise or flex)"
    if spec.activation != "softmax":
        return f"flash kernels are softmax-only (activation={spec.activation!r})"
    if spec.alibi_slopes is not None:
        return "ALiBi is not supported by the flash backend (use sdpa, blockwise or triton)"
    if mask_structure(spec) is None and _outside_window(spec) is None:
        name = getattr(spec.mask, "__name__", spec.mask)
        return f"mask {name!r} is not causal, sliding_window, lambda or attention_sinks"
    if call is None:
        return None
    if call.requires_grad:
        return "the flash backend is forward-only (no autograd through the lse merge); use sdpa or blockwise to train"
    if call.device_type == "cpu":
        if call.dtype not in CPU_DTYPES:
            return f"dtype {call.dtype} is not supported by the CPU flash kernel"
    elif call.device_type == "cuda":
        if call.dtype not in CUDA_DTYPES:
            return f"the CUDA flash kernels take float16/bfloat16, not {call.dtype}"
        if call.head_dim % 8 or call.head_dim > 256:
            return f"head dim {call.head_dim} is not a multiple of 8 up to 256 (flash kernels)"
    else:
        return f"no flash kernel for device type {call.device_type!r}"
    return None


def attention_flash(q, k, v, spec, *, q_offset=None, rotary=None, return_lse=False):
    """Same signature and semantics as `lcx.attention.attention_ref`; see the module docstring."""
    off = check_call(q, k, v, spec, q_offset, rotary)
    refuse("flash", _flash_supports, spec, call_info(q, k, v, off, rotary, return_lse))
    st = mask_structure(spec)
    scale = scale_of(spec, q.shape[-1])
    H = q.shape[2]
    q_glob = k_glob = None
    if spec.lambda_params is not None:
        li = lambda_inputs(q, k, rotary, spec.lambda_params, off)
        q, k = li.q_rot, li.k_rot
        q_glob, k_glob = _heads_first(li.q_cap, H), _heads_first(li.k_glob, H)
    elif rotary is not None:
        q, k = rotate_qk(q, k, rotary, off)
    Tq, Tk = q.shape[1], k.shape[1]
    qh, kh, vh = q.transpose(1, 2), _heads_first(k, H), _heads_first(v, H)  # [B, H, T, D]
    ow = _outside_window(spec)
    if ow is not None:  # global keys outside the window only: one masked + one unmasked call
        G = min(ow[0], Tk)
        out, lse = _global_pass(qh, kh[:, :, :G], vh[:, :, :G], q0=off, G=G, left=ow[1] - 1, scale=scale)
        out = out.transpose(1, 2).to(q.dtype)
        return (out, lse) if return_lse else out
    left = st.left if st.left is not None and st.left < Tk - 1 else None  # window covers all
    if off + Tq < Tk:
        # queries that are not the last keys (no rotary): keys after the last query are
        # never visible under these masks; drop them
        kh, vh = kh[:, :, : off + Tq], vh[:, :, : off + Tq]
        Tk = off + Tq
        k_glob = None if k_glob is None else k_glob[:, :, : min(st.n_global, Tk)]
    if left is None:
        out, lse = _causal(qh, kh, vh, q0=off, scale=scale)
    elif qh.device.type == "cuda" and _flash_attn_available():
        parts = [_flash_attn_window(qh, kh, vh, q0=off, W=left + 1, scale=scale)]
        G = min(st.n_global, max(0, Tk - left - 1))
        if G:
            gq = qh if q_glob is None else q_glob
            gk = kh[:, :, :G] if k_glob is None else k_glob[:, :, :G]
            parts.append(_global_pass(gq, gk, vh[:, :, :G], q0=off, G=G, left=left, scale=scale))
        out, lse = _merge_bhtd(*parts)
    else:
        W = left + 1
        C = chunk_size(W)
        st = Structure(st.n_global, left)
        G = min(st.n_global, max(0, Tk - W))  # global keys that can fall outside a window
        b0 = -(-max(off, W) // C) * C  # first query of the chunked body, on the chunk grid (>= rC)
        if b0 >= Tk:  # few queries (decode, short chunks, short prefill)
            out, lse = _span_call(qh, kh, vh, q0=off, st=st, scale=scale, k_glob=k_glob, q_glob=q_glob)
        else:  # [B, Tq, H, Dv], the layout returned; every part below writes its rows in place
            out = qh.new_empty(qh.shape[0], Tq, H, vh.shape[-1])
            lse = torch.empty(qh.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
            h = b0 - off  # head rows [off, b0): masked span calls over keys [0, b0)
            o_w, l_w = _window_body(qh[:, :, h:], kh, vh, b0=b0, W=W, C=C, scale=scale)
            if G:  # global keys outside the window (LM-Infinite: capped query, unrotated keys)
                gq = qh if q_glob is None else q_glob
                gk = kh[:, :, :G] if k_glob is None else k_glob[:, :, :G]
                _add_global_keys(o_w, l_w, gq[:, :, h:], gk, vh[:, :, :G], q0=b0, left=left, scale=scale,
                                 out=out[:, h:].transpose(1, 2), lse=lse[:, :, h:])
            else:
                out[:, h:] = o_w.transpose(1, 2)
                lse[:, :, h:] = l_w
            if h:
                o_h, l_h = _span_call(
                    qh[:, :, :h], kh[:, :, :b0], vh[:, :, :b0], q0=off, st=st, scale=scale,
                    k_glob=None if k_glob is None else k_glob[:, :, : min(st.n_global, b0)],
                    q_glob=None if q_glob is None else q_glob[:, :, :h],
                )  # fmt: skip
                out[:, :h] = o_h.transpose(1, 2)
                lse[:, :, :h] = l_h
            return (out, lse) if return_lse else out
    out = out.transpose(1, 2).to(q.dtype)  # [B, Tq, H, Dv]
    return (out, lse) if return_lse else out


def _causal(q, k, v, *, q0: int, scale: float):
    """Plain causal attention of queries [q0, q0 + Tq) over keys [0, q0 + Tq)."""
    if q0 == 0:
        return _kernel(q, k, v, causal=True, scale=scale)
    Tq = q.shape[2]
    if Tq == 1:
        return _kernel(q, k, v, causal=False, scale=scale)
    o_a, l_a = _kernel(q, k[:, :, :q0], v[:, :, :q0], causal=False, scale=scale)
    o_b, l_b = _kernel(q, k[:, :, q0:], v[:, :, q0:], causal=True, scale=scale)
    return _merge_bhtd((o_a, l_a), (o_b, l_b))


def _flash_attn_window(q, k, v, *, q0: int, W: int, scale: float):
    """flash-attn's own window: window_size=(W - 1, 0), bottom-right aligned like lcx masks."""
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=True,
        window_size=(W - 1, 0), return_attn_probs=True,
    )  # fmt: skip
    return out.transpose(1, 2), lse.float()


FLASH_BACKEND = register_backend(
    Backend("flash", attention_flash, _flash_supports,
            "fused flash kernels (CPU flash / torch or flash-attn on CUDA), Λ by chunked passes + lse merge")
)  # fmt: skip

