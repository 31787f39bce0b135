"""Attention backend "cuda": the Λ-decode CUDA C++ kernel (`lcx.kernels.cuda.lambda_decode`).

    attention_cuda(q [B, 1, H, D], k [B, Tk, Hkv, D], v [B, Tk, Hkv, D], spec, *,
                   q_offset=None, rotary=None, return_lse=False)

It serves the bounded-cache decode call (`lcx.hf.bounded_cache`): one query token per
row, keys UNROTATED with their true positions in `rotary.positions`, rotated inside the
kernel; every visible key and value is read once (GQA heads share the read). Methods:
LM-Infinite (`AttentionSpec.lm_infinite`, global keys at the capped distance), and softmax
with the causal, sliding-window, attention-sink or Λ mask (or no mask), with or without
`rotary`. Everything else is refused by `supports` with the reason: other activations,
ALiBi, Tq > 1, autograd, devices other than CUDA, dtypes other than fp32/fp16/bf16, head
dims outside `HEAD_DIMS`. The extension is compiled on the first call, never at import.
"""

from __future__ import annotations

import torch

from lcx.kernels.cuda.lambda_decode import DTYPES, HEAD_DIMS, DecodeKeys, decode_tables, lambda_decode_cuda

from lcx.masks import KeySpan, window_shape

from .backends import Backend, call_info, refuse, register_backend
from .spec import AttentionSpec, CallInfo, Rotary, check_call, scale_of

def _mask_shape(spec: AttentionSpec) -> KeySpan | str | None:
    """"full" (no mask), the mask's window shape with a window (causal, sliding window, Λ,
    sinks), or None (a mask the kernel cannot read as key ranges)."""
    if spec.mask is None:
        return "full"
    shape = window_shape(spec.mask)
    return None if shape is None or shape.left == -1 else shape


def decode_keys(spec: AttentionSpec, n_keys: int, q_index: int) -> DecodeKeys:
    """The visible key ranges of query `q_index` under `spec.mask` (Tq = 1; `lcx.masks` rules)."""
    shape = _mask_shape(spec)
    i = q_index
    if shape == "full":
        return DecodeKeys(0, 0, n_keys)
    if shape is None:
        raise ValueError(f"mask {spec.mask.__name__} is not one the cuda decode kernel knows")
    # the first n_global keys, then the window i - left .. i (left None: causal, every j <= i)
    w_lo = 0 if shape.left is None else max(0, i - shape.left)
    return DecodeKeys(min(shape.n_global, w_lo), w_lo, i + 1, capped=spec.lambda_params is not None)


def _cuda_supports(spec: AttentionSpec, call: CallInfo | None = None) -> str | None:
    if spec.softcap is not None:
        return "the cuda decode kernel has no logit soft-capping"
    if spec.activation != "softmax":
        return f"the cuda decode kernel is softmax-only (activation={spec.activation!r})"
    if spec.alibi_slopes is not None:
        return "the cuda decode kernel has no ALiBi bias"
    if _mask_shape(spec) is None:
        return (f"mask {spec.mask.__name__} is not causal, sliding_window, lambda or attention_sinks "
                "(the masks the cuda decode kernel reads by key ranges)")
    if call is None:
        return None
    if call.device_type != "cuda":
        return f"the cuda decode kernel needs CUDA tensors (got {call.device_type})"
    if call.n_queries != 1:
        return f"the cuda kernel decodes one query token per row (Tq={call.n_queries}); use it for decode steps"
    if call.requires_grad:
        return "the cuda decode kernel has no backward"
    if call.dtype not in DTYPES:
        return f"the cuda decode kernel takes {[str(d) for d in DTYPES]}, got {call.dtype}"
    if call.head_dim not in HEAD_DIMS:
        return f"the cuda decode kernel is built for head dims {HEAD_DIMS}, got {call.head_dim}"
    return None


def attention_cuda(q, k, v, spec, *, q_offset=None, rotary: Rotary | None = None, return_lse=False):
    """Backend signature (`lcx.attention.backends`); out `[B, 1, H, D]`, lse `[B, H, 1]`."""
    off = check_call(q, k, v, spec, q_offset, rotary)
    refuse("cuda", _cuda_supports, spec, call_info(q, k, v, off, rotary, return_lse))
    if v.shape[-1] != q.shape[-1]:
        raise NotImplementedError(f"attention backend 'cuda' needs Dv == D, got {v.shape[-1]} != {q.shape[-1]}")
    Tk = k.shape[1]
    keys = decode_keys(spec, Tk, off)
    tables = None
    if rotary is not None:
        lp = spec.lambda_params
        cap = lp.effective_limit(Tk) if lp is not None else 0
        tables = decode_tables(rotary.inv_freq.to(q.device), rotary.key_positions(Tk, q.device), off, cap,
                               rotary.attention_factor)
    with torch.no_grad():
        out, lse = lambda_decode_cuda(q, k, v, keys=keys, scale=scale_of(spec, q.shape[-1]), tables=tables)
    return (out, lse) if return_lse else out


BACKEND = register_backend(Backend(
    "cuda", attention_cuda, _cuda_supports,
    "CUDA C++ decode (Tq = 1): Λ / window / causal softmax, keys rotated on the fly, split-K",
))

__all__ = ["BACKEND", "attention_cuda", "decode_keys"]
