"""The `triton` attention backend: `lcx.kernels.triton.lambda_attention` and `.swat` behind the
backend signature (`lcx.attention.backends`).

- LM-Infinite (`spec.lambda_params`): one Λ kernel, RoPE and the distance cap inside it
  (q/k unrotated, as the bounded cache stores them), block-skipping to the global + window
  keys; decode (few queries) splits the keys over several programs (split-K) and merges by
  log-sum-exp. Forward only.
- causal / sliding window / attention sinks / global tokens, softmax or sigmoid, ALiBi
  (SWAT): forward by the same kernel; with gradients, `WindowAttentionFunction` (RoPE, if
  any, applied first by `rotate_qk`, differentiably).

Triton and the kernel modules are imported inside the functions only; no device query at
import. CPU tensors run only under `TRITON_INTERPRET=1` (set before triton is imported; tests).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from lcx.masks import window_shape

from .backends import Backend, call_info, refuse, register_backend
from .rotary import rotate_qk
from .spec import AttentionSpec, CallInfo, check_call

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def mask_shape(mask) -> tuple[int, int | None] | None:
    """(n_global, left) of a mask the kernels run: visible `j <= i` and (`i - j <= left` or
    `j < n_global`); left None = causal, -1 = no window. None for any other mask."""
    shape = window_shape(mask)
    return None if shape is None else (shape.n_global, shape.left)


def _triton_supports(spec: AttentionSpec, call: CallInfo | None = None) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if spec.softcap is not None:
        return "the Triton kernels have no logit soft-capping"
    if spec.mask is None or mask_shape(spec.mask) is None:
        got = None if spec.mask is None else spec.mask.__name__
        return f"the Triton kernels run causal, window, sinks and Λ masks only (mask={got})"
    if call is None:
        return None
    if call.dtype not in DTYPES:
        return f"the Triton kernels take float32/float16/bfloat16, not {call.dtype}"
    if call.head_dim > MAX_HEAD_DIM:
        return f"head dim {call.head_dim} > {MAX_HEAD_DIM}"
    if call.requires_grad and spec.lambda_params is not None:
        return "the Triton Λ kernel has no backward (LM-Infinite is inference-only here)"
    if call.device_type != "cuda" and not (call.device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"Triton needs CUDA tensors ({call.device_type} tensors run only under TRITON_INTERPRET=1)"
    return None


def attention_triton(q, k, v, spec, *, q_offset=None, rotary=None, return_lse=False):
    off = check_call(q, k, v, spec, q_offset, rotary)
    refuse("triton", _triton_supports, spec, call_info(q, k, v, off, rotary, return_lse))
    if v.shape[-1] > MAX_HEAD_DIM:
        raise NotImplementedError(f"attention backend 'triton' cannot run value head dim {v.shape[-1]} > {MAX_HEAD_DIM}")
    n_global, left = mask_shape(spec.mask)
    lp = spec.lambda_params
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad:
        from lcx.kernels.triton.swat import window_attention_triton

        if rotary is not None:
            q, k = rotate_qk(q, k, rotary, off)
        res = window_attention_triton(
            q, k, v, left=left, n_global=n_global, alibi_slopes=spec.alibi_slopes,
            activation=spec.activation, scale=spec.scale, q_offset=off, return_lse=return_lse,
        )  # fmt: skip
        return res
    from lcx.kernels.triton.lambda_attention import lambda_attention_triton

    out, lse = lambda_attention_triton(
        q, k, v, n_global=n_global, left=left, limit_distance=None if lp is None else lp.limit_distance,
        rotary=rotary, alibi_slopes=spec.alibi_slopes, activation=spec.activation, scale=spec.scale,
        q_offset=off,
    )  # fmt: skip
    return (out, lse) if return_lse else out


TRITON_BACKEND = register_backend(
    Backend("triton", attention_triton, _triton_supports,
            "Triton kernels: Λ prefill/decode (split-K), window/SWAT forward+backward")
)  # fmt: skip
