"""Attention: the exact reference, backends with one signature, and the Λ two-pass merge.

>>> from lcx.attention import AttentionSpec, attention
>>> spec = AttentionSpec.swat(window=128, n_heads=8)  # sigmoid + window + balanced ALiBi
>>> out = attention(q, k, v, spec, backend="blockwise")  # doctest: +SKIP

Layout `[B, T, H, D]`; the window convention is in `lcx.masks`.
"""

from .alibi import alibi_bias, alibi_slopes, balanced_alibi_slopes
from .backends import (
    BACKENDS,
    BLOCK_Q,
    FALLBACK_ORDER,
    Backend,
    attention,
    attention_blockwise,
    attention_flex,
    attention_flex_compiled,
    attention_sdpa,
    backend_for,
    flex_bucket,
    register_backend,
)
from .cuda_backend import attention_cuda  # registers the "cuda" backend (compiled on first call)
from .merge import lambda_two_pass, merge_attention
from .flash_backend import attention_flash  # registers the "flash" backend
from .triton_backend import attention_triton  # registers the "triton" backend
from .reference import (
    attention_ref,
    attention_ref_spec,
    lambda_attention_ref,
    lambda_topk_attention_ref,
    normalize_scores,
)
from .rotary import LambdaInputs, lambda_concat_inputs, lambda_global_mask, lambda_inputs, rotate_qk
from .spec import ACTIVATIONS, AttentionSpec, CallInfo, LambdaParams, Rotary, sdpa, soft_cap

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "BLOCK_Q",
    "FALLBACK_ORDER",
    "AttentionSpec",
    "Backend",
    "CallInfo",
    "LambdaInputs",
    "LambdaParams",
    "Rotary",
    "alibi_bias",
    "alibi_slopes",
    "attention",
    "attention_blockwise",
    "attention_flash",
    "attention_flex",
    "attention_flex_compiled",
    "attention_ref",
    "attention_ref_spec",
    "attention_sdpa",
    "backend_for",
    "balanced_alibi_slopes",
    "flex_bucket",
    "lambda_attention_ref",
    "lambda_concat_inputs",
    "lambda_global_mask",
    "lambda_inputs",
    "lambda_topk_attention_ref",
    "lambda_two_pass",
    "merge_attention",
    "normalize_scores",
    "register_backend",
    "rotate_qk",
    "sdpa",
    "soft_cap",
]
