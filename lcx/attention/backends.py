"""Attention backends: same keyword signature, same semantics as `lcx.attention.reference`.

Every backend function is

    attention_<name>(q, k, v, spec, *, q_offset=None, rotary=None, return_lse=False)
        -> out [B, Tq, H, Dv]   or   (out, lse [B, H, Tq])

and every `Backend` has `supports(spec, call=None) -> reason | None` (`call`: a `CallInfo`
with the tensors' facts; without it only the method is checked). `attention(...)` is the
dispatcher: it raises `NotImplementedError` naming the reason, or with `fallback=True` logs
and runs the first backend of `FALLBACK_ORDER` that can.

- ref:           the reference (O(Tq*Tk) memory; any dtype, autograd).
- sdpa:          `torch.nn.functional.scaled_dot_product_attention` with a materialised mask;
                 softmax only, no soft-capping; ALiBi as an additive float mask (computed in float32 for
                 fp16/bf16 inputs: a bf16 bias of 500 is off by up to 1); LM-Infinite by
                 the one-pass head-dim concatenation (`lambda_concat_inputs`). No lse.
- blockwise:     pure PyTorch over blocks of BLOCK_Q queries, reading only the keys a
                 block can see (the mask's `KeySpan`; LM-Infinite: G global + the window),
                 so memory is O(Tq * (G + L + BLOCK_Q)) for Λ/window masks instead of
                 O(Tq * Tk); autograd; float32 math for fp16/bf16 inputs.
- flex:          `flex_attention` (eager) with a block mask from the mask_mod and a
                 score_mod for ALiBi and soft-capping; sigmoid by score_mod `logsigmoid` and the lse
                 correction o = o_softmax * exp(lse) (Z = sum sigmoid); LM-Infinite by the
                 same concatenation as sdpa. No backward on CPU.
- flex_compiled: the same through `torch.compile(flex_attention)`; lengths are padded to
                 buckets (`flex_bucket`) so a length sweep compiles once per bucket; on CPU
                 it returns no lse (torch 2.13), so no sigmoid and no return_lse there.

Optional backends (flash, triton) register with `register_backend` from their own module,
importing their packages lazily inside the functions.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from lcx.masks import mask_matrix, mask_span
from lcx.masks.base import mask_block

from .alibi import alibi_bias
from .reference import attention_ref_spec, normalize_scores
from .rotary import lambda_concat_inputs, lambda_inputs, rotate_qk
from .spec import AttentionSpec, CallInfo, Rotary, check_call, scale_of, soft_cap

logger = logging.getLogger(__name__)

Supports = Callable[[AttentionSpec, "CallInfo | None"], "str | None"]
LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    supports: Supports
    summary: str = ""

    def __call__(self, q, k, v, spec, **kw):
        return self.fn(q, k, v, spec, **kw)


def call_info(q, k, v, q_offset, rotary, return_lse) -> CallInfo:
    return CallInfo.from_call(q, k, v, q_offset=q_offset, rotary=rotary, return_lse=return_lse)


def refuse(name: str, supports: Supports, spec: AttentionSpec, call: CallInfo) -> None:
    reason = supports(spec, call)
    if reason is not None:
        raise NotImplementedError(f"attention backend {name!r} cannot run {spec.name}: {reason}")


# ----------------------------------------------------------------------------- ref
def _ref_supports(spec: AttentionSpec, call: CallInfo | None = None) -> str | None:
    return None


# ----------------------------------------------------------------------------- sdpa
def _sdpa_supports(spec: AttentionSpec, call: CallInfo | None = None) -> str | None:
    if spec.softcap is not None:
        return "scaled_dot_product_attention has no logit soft-capping"
    if spec.activation != "softmax":
        return f"scaled_dot_product_attention is softmax-only (activation={spec.activation!r})"
    if call is not None and call.return_lse:
        return "scaled_dot_product_attention returns no log-sum-exp"
    return None


def attention_sdpa(q, k, v, spec, *, q_offset=None, rotary=None, return_lse=False):
    off = check_call(q, k, v, spec, q_offset, rotary)
    refuse("sdpa", _sdpa_supports, spec, call_info(q, k, v, off, rotary, return_lse))
    scale, mask, dtype = scale_of(spec, q.shape[-1]), spec.mask, q.dtype
    if spec.lambda_params is not None:
        li = lambda_inputs(q, k, rotary, spec.lambda_params, off)
        q, k, v, mask = lambda_concat_inputs(li, v, spec.lambda_params)  # head dim 2D
    elif rotary is not None:
        q, k = rotate_qk(q, k, rotary, off)
    (B, Tq, H, _), Tk, Hkv = q.shape, k.shape[1], k.shape[2]
    visible = mask_matrix(mask, Tq, Tk, q_offset=off, device=q.device)  # [Tq, Tk]
    empty = ~visible.any(dim=-1, keepdim=True)  # [Tq, 1]: would be NaN rows in sdpa
    visible = visible | empty
    work = dtype
    if spec.alibi_slopes is not None:
        work = torch.float32 if dtype in LOW_PRECISION else dtype
        slopes = torch.tensor(spec.alibi_slopes, dtype=torch.float64, device=q.device)
        i = torch.arange(off, off + Tq, device=q.device)
        bias = alibi_bias(slopes, i, torch.arange(Tk, device=q.device), work)  # [H, Tq, Tk]
        attn_mask = bias.masked_fill(~visible, float("-inf"))[None]
    else:
        attn_mask = visible
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).to(work), k.transpose(1, 2).to(work), v.transpose(1, 2).to(work),
        attn_mask=attn_mask, scale=scale, enable_gqa=H != Hkv,
    ).transpose(1, 2)  # fmt: skip  # [B, Tq, H, Dv]
    out = out.masked_fill(empty.view(1, Tq, 1, 1), 0.0)
    return out.to(dtype)


# ----------------------------------------------------------------------------- blockwise
BLOCK_Q = 128  # queries per block: scores of one block are [B, H, BLOCK_Q, G + L + BLOCK_Q]


def _block_scores(qb: torch.Tensor, kb: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """qb `[B, bq, H, D]`, kb `[B, n, Hkv, D]` -> `[B, H, bq, n]`, GQA without copying k."""
    B, bq, H, D = qb.shape
    Hkv, n = kb.shape[2], kb.shape[1]
    qg = qb.to(wide).reshape(B, bq, Hkv, H // Hkv, D)  # head h = kv_head * g + i
    s = torch.einsum("bqkgd,bnkd->bkgqn", qg, kb.to(wide))  # [B, Hkv, g, bq, n]
    return s.reshape(B, H, bq, n)


def _block_values(w: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
    """w `[B, H, bq, n]`, vb `[B, n, Hkv, Dv]` -> `[B, bq, H, Dv]`."""
    B, H, bq, n = w.shape
    Hkv, Dv = vb.shape[2], vb.shape[3]
    wg = w.reshape(B, Hkv, H // Hkv, bq, n)
    o = torch.einsum("bkgqn,bnkd->bqkgd", wg, vb.to(w.dtype))  # [B, bq, Hkv, g, Dv]
    return o.reshape(B, bq, H, Dv)


def _blockwise_supports(spec: AttentionSpec, call: CallInfo | None = None) -> str | None:
    return None


def attention_blockwise(q, k, v, spec, *, q_offset=None, rotary=None, return_lse=False):
    off = check_call(q, k, v, spec, q_offset, rotary)
    (B, Tq, H, D), Tk = q.shape, k.shape[1]
    wide, sc, lp = torch.promote_types(q.dtype, torch.float32), scale_of(spec, D), spec.lambda_params
    if lp is not None:
        li = lambda_inputs(q, k, rotary, lp, off)
    elif rotary is not None:
        q, k = rotate_qk(q, k, rotary, off)
    slopes = None
    if spec.alibi_slopes is not None:
        slopes = torch.tensor(spec.alibi_slopes, dtype=torch.float64, device=q.device)
    span = mask_span(spec.mask)
    dev = q.device
    outs, lses = [], []
    for t0 in range(0, Tq, BLOCK_Q):
        t1 = min(Tq, t0 + BLOCK_Q)
        i0, i1 = off + t0, off + t1
        i = torch.arange(i0, i1, device=dev)
        parts = []  # (scores [B, H, bq, n], visible [bq, n], values [B, n, Hkv, Dv])
        if lp is not None:
            n_glob = li.k_glob.shape[1]
            j = torch.arange(n_glob, device=dev)
            s = soft_cap(_block_scores(li.q_cap[:, t0:t1], li.k_glob, wide) * sc, spec.softcap)
            parts.append((s, i[:, None] - j[None, :] >= lp.n_local, v[:, :n_glob]))
            lo, hi = max(0, i0 - lp.n_local + 1), min(Tk, i1)
            j = torch.arange(lo, hi, device=dev)
            d = i[:, None] - j[None, :]
            s = soft_cap(_block_scores(li.q_rot[:, t0:t1], li.k_rot[:, lo:hi], wide) * sc, spec.softcap)
            parts.append((s, (d >= 0) & (d < lp.n_local), v[:, lo:hi]))
        else:
            ranges = span.key_ranges(i0, i1, Tk) if span is not None else [(0, Tk)]
            for lo, hi in ranges or [(0, 0)]:
                j = torch.arange(lo, hi, device=dev)
                s = soft_cap(_block_scores(q[:, t0:t1], k[:, lo:hi], wide) * sc, spec.softcap)
                if slopes is not None:
                    s = s + alibi_bias(slopes, i, j, wide)
                parts.append((s, mask_block(spec.mask, i, j), v[:, lo:hi]))
        s = torch.cat([p[0] for p in parts], dim=-1)
        visible = torch.cat([p[1] for p in parts], dim=-1)
        w, lse = normalize_scores(s, visible, spec.activation)
        outs.append(_block_values(w, torch.cat([p[2] for p in parts], dim=1)))
        lses.append(lse)
    out = torch.cat(outs, dim=1).to(q.dtype)  # [B, Tq, H, Dv]
    return (out, torch.cat(lses, dim=-1)) if return_lse else out


# ----------------------------------------------------------------------------- flex
def flex_bucket(n: int) -> int:
    """Padded length for flex: a multiple of 128 up to 1024, then of 1024 (one compile each)."""
    if n <= 1024:
        return max(128, -(-n // 128) * 128)
    return -(-n // 1024) * 1024


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_import_error() -> str | None:
    try:
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # noqa: F401
    except ImportError as e:  # torch too old
        return f"torch.nn.attention.flex_attention unavailable ({e})"
    return None


def _flex_supports_impl(spec: AttentionSpec, call: CallInfo | None = None, *, compiled: bool) -> str | None:
    err = _flex_import_error()
    if err is not None or call is None:
        return err
    if call.device_type == "cpu" and call.requires_grad:
        return "flex_attention has no backward on CPU"
    if compiled and call.device_type == "cpu" and call.dtype == torch.float64:
        return "compiled flex_attention on CPU takes float32/float16/bfloat16 only"
    if compiled and call.device_type == "cpu" and (call.return_lse or spec.activation == "sigmoid"):
        return (
            "compiled flex_attention on CPU returns no log-sum-exp (needed for return_lse "
            "and the sigmoid correction); use backend 'flex' (eager)"
        )
    return None


def _flex_kernel(q, k, v, *, mask, q_offset, scale, activation, slopes=None, compiled=False, need_lse=True,
                 softcap=None):
    """One flex_attention call on `[B, T, H, D]` tensors; returns (out, lse or None).

    q/k/v are zero-padded to `flex_bucket` lengths; the offset and the true Tk enter the
    mask_mod as captured tensors, so new lengths inside a bucket do not recompile.
    """
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    (B, Tq, H, _), (Tk, Hkv) = q.shape, k.shape[1:3]
    Tqp, Tkp = flex_bucket(Tq), flex_bucket(Tk)
    dev = q.device
    off_t = torch.tensor(q_offset, device=dev)
    tk_t = torch.tensor(Tk, device=dev)

    def padded_mask(b, h, q_idx, kv_idx):
        ok = kv_idx < tk_t
        if mask is not None:
            ok = ok & mask(b, h, q_idx + off_t, kv_idx)
        return ok

    block_mask = create_block_mask(padded_mask, None, None, Tqp, Tkp, device=dev)
    sigmoid = activation == "sigmoid"
    wide = torch.promote_types(q.dtype, torch.float32)
    slopes_t = None if slopes is None else torch.tensor(slopes, dtype=wide, device=dev)
    score_mod = None
    if slopes_t is not None or sigmoid or softcap is not None:

        def score_mod(score, b, h, q_idx, kv_idx):  # (score: scale * q.k)
            if softcap is not None:
                score = soft_cap(score, softcap)
            if slopes_t is not None:
                score = score - slopes_t[h] * (q_idx + off_t - kv_idx).abs()
            if sigmoid:  # exp(logsigmoid(s)) = sigmoid(s): flex computes sum sigmoid * v / Z
                score = F.logsigmoid(score)
            return score

    def pad(x, n):  # [B, T, H, D] -> [B, H, n, D]
        return F.pad(x, (0, 0, 0, 0, 0, n - x.shape[1])).transpose(1, 2)

    fn = _compiled_flex() if compiled else flex_attention
    kw = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=H != Hkv)
    if need_lse or sigmoid:
        kw["return_aux"] = AuxRequest(lse=True)
    with warnings.catch_warnings():
        # backend "flex" is eager on purpose (it runs on CPU with lse); not a misuse to report
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        res = fn(pad(q, Tqp), pad(k, Tkp), pad(v, Tkp), **kw)
    out, lse = (res[0], res[1].lse[..., :Tq]) if "return_aux" in kw else (res, None)  # lse: [B, H, Tq], ln
    out = out.transpose(1, 2)[:, :Tq]  # [B, Tq, H, Dv]
    if sigmoid:  # undo the softmax normalisation: o = o_softmax * Z
        out = (out.to(wide) * lse.to(wide).exp().transpose(1, 2).unsqueeze(-1)).to(q.dtype)
    return out, lse


def _flex_impl(q, k, v, spec, *, q_offset, rotary, return_lse, compiled):
    name = "flex_compiled" if compiled else "flex"
    off = check_call(q, k, v, spec, q_offset, rotary)
    call = call_info(q, k, v, off, rotary, return_lse)
    refuse(name, functools.partial(_flex_supports_impl, compiled=compiled), spec, call)
    scale, mask = scale_of(spec, q.shape[-1]), spec.mask
    if spec.lambda_params is not None:
        li = lambda_inputs(q, k, rotary, spec.lambda_params, off)
        q, k, v, mask = lambda_concat_inputs(li, v, spec.lambda_params)  # head dim 2D
    elif rotary is not None:
        q, k = rotate_qk(q, k, rotary, off)
    out, lse = _flex_kernel(
        q, k, v, mask=mask, q_offset=off, scale=scale, activation=spec.activation,
        slopes=spec.alibi_slopes, compiled=compiled, need_lse=return_lse, softcap=spec.softcap,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def attention_flex(q, k, v, spec, *, q_offset=None, rotary=None, return_lse=False):
    return _flex_impl(q, k, v, spec, q_offset=q_offset, rotary=rotary, return_lse=return_lse, compiled=False)


def attention_flex_compiled(q, k, v, spec, *, q_offset=None, rotary=None, return_lse=False):
    return _flex_impl(q, k, v, spec, q_offset=q_offset, rotary=rotary, return_lse=return_lse, compiled=True)


# ----------------------------------------------------------------------------- registry
BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    if backend.name in BACKENDS and not replace:
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    BACKENDS[backend.name] = backend
    return backend


for _b in (
    Backend("ref", attention_ref_spec, _ref_supports, "exact reference, O(Tq*Tk) memory"),
    Backend("sdpa", attention_sdpa, _sdpa_supports, "torch SDPA with a materialised mask"),
    Backend("blockwise", attention_blockwise, _blockwise_supports, "query blocks, span-limited keys, autograd"),
    Backend("flex", attention_flex, functools.partial(_flex_supports_impl, compiled=False), "flex_attention, eager"),
    Backend(
        "flex_compiled", attention_flex_compiled, functools.partial(_flex_supports_impl, compiled=True),
        "flex_attention under torch.compile, bucketed lengths",
    ),
):
    register_backend(_b)

FALLBACK_ORDER = ("blockwise", "ref")


def backend_for(backend: str, spec: AttentionSpec, call: CallInfo | None = None) -> str:
    """`backend` when it `supports(spec, call)`, else `blockwise`, which runs every spec (a speed
    choice, not a numerics one: backends compute the same thing). For the callers that hand
    one spec a backend cannot cut or cap (soft-capping on the fused kernels, a mask that reads
    only sink keys) to the backend that can, without a warning per call."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not known; known: {list(BACKENDS)}")
    return backend if BACKENDS[backend].supports(spec, call) is None else "blockwise"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    *,
    backend: str,
    fallback: bool = False,
    q_offset: int | None = None,
    rotary: Rotary | None = None,
    return_lse: bool = False,
):
    """Run `spec` on `backend`; see the module docstring. Shapes: `lcx.attention.spec`."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not known; known: {list(BACKENDS)}")
    off = check_call(q, k, v, spec, q_offset, rotary)
    call = call_info(q, k, v, off, rotary, return_lse)
    reason = BACKENDS[backend].supports(spec, call)
    if reason is not None:
        msg = f"attention backend {backend!r} cannot run {spec.name}: {reason}"
        if not fallback:
            raise NotImplementedError(msg)
        name = next(n for n in FALLBACK_ORDER if BACKENDS[n].supports(spec, call) is None)
        logger.warning("%s; falling back to %r", msg, name)
        backend = name
    return BACKENDS[backend].fn(q, k, v, spec, q_offset=off, rotary=rotary, return_lse=return_lse)
