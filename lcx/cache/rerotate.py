"""Re-rotation of cached keys by a per-token position delta: `k <- R(delta) k` (PIE's update).

Every backend has the keyword signature of the reference:

    rerotate_<backend>(k_cache, delta_positions, inv_freq, *, out=None) -> Tensor

- `k_cache: [B, T, H, D]` (lcx's layout; any strides, so the HF cache's `[B, H, T, D]` keys are
  passed as the view `keys.transpose(1, 2)`), float32 / float16 / bfloat16 / float64.
- `delta_positions: [T]` (shared by the batch) or `[B, T]`, an integer dtype: new minus old
  position of each slot. Positions are integers, so deltas are exact integers.
- `inv_freq: [r/2]` (float64 preferred): the basis the keys were rotated with; channels
  r..D-1 (partial rotary) are left as they are.
- `out=None` rotates `k_cache` in place and returns it; otherwise the result is written to
  `out` (same shape and dtype, any strides) and `k_cache` is not modified.

Because R(a) R(b) = R(a + b) in one basis, `R(delta) R(p) k = R(p + delta) k`: a key cached at
position p becomes exactly the key at p + delta (up to rounding), for every RoPE type whose
basis does not change between the two (see `lcx.cache.pie` for length-dependent types). The
attention factor a of cached keys (`a R(p) k`) is preserved since the rotation is linear.

Precision (all backends): the angle `delta * inv_freq` is formed in float64 (exact integer
delta for |delta| < 2^53). The reference then works entirely in float64 and rounds once. The
kernels reduce the angle in float64 to a fraction of a turn, `frac = t - round(t)` with
`t = delta * inv_freq / (2 pi)`, and evaluate cos/sin in float32 on [-pi, pi]: the float32
argument error is ~1e-7 rad whatever the delta, where a plain float32 product `delta *
inv_freq` would err by ~|delta| * 6e-8 rad (0.06 rad at delta = 1e6).
"""

from __future__ import annotations

import os
from typing import Callable

import torch

# the reference and the shared argument check live with the other rotary ops (kernels/ depends
# on lcx.rope only); this module is the backend dispatcher
from ..rope.rotary import check_rerotate_args, rerotate_ref  # noqa: F401  (re-exported)


def _triton(k_cache, delta_positions, inv_freq, *, out=None):
    from lcx.kernels.triton.rerotate import rerotate_triton

    return rerotate_triton(k_cache, delta_positions, inv_freq, out=out)


def _cuda(k_cache, delta_positions, inv_freq, *, out=None):
    from lcx.kernels.cuda import rerotate_cuda

    return rerotate_cuda(k_cache, delta_positions, inv_freq, out=out)


def _supports_ref(k: torch.Tensor) -> str | None:
    return None


def _supports_triton(k: torch.Tensor) -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:  # a broken optional package must not break lcx
        return f"triton is not importable ({type(e).__name__}: {e})"
    if k.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"tensor on {k.device.type}: triton needs CUDA tensors (or TRITON_INTERPRET=1 set before import)"
    if k.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {k.dtype} not supported by the triton kernel"
    return None


def _supports_cuda(k: torch.Tensor) -> str | None:
    if k.device.type != "cuda":
        return f"tensor on {k.device.type}: the CUDA kernel needs CUDA tensors"
    if k.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {k.dtype} not supported by the CUDA kernel"
    return None


RerotateFn = Callable[..., torch.Tensor]
# backend name -> (implementation, supports(k_cache) -> reason | None)
REROTATE_BACKENDS: dict[str, tuple[RerotateFn, Callable[[torch.Tensor], str | None]]] = {
    "ref": (rerotate_ref, _supports_ref),
    "triton": (_triton, _supports_triton),
    "cuda": (_cuda, _supports_cuda),
}


def rerotate(k_cache: torch.Tensor, delta_positions: torch.Tensor, inv_freq: torch.Tensor, *,
             out: torch.Tensor | None = None, backend: str = "ref") -> torch.Tensor:
    """Dispatch to `REROTATE_BACKENDS[backend]`; raises ValueError if it cannot run this call."""
    if backend not in REROTATE_BACKENDS:
        raise ValueError(f"unknown rerotate backend {backend!r}; known: {sorted(REROTATE_BACKENDS)}")
    fn, supports = REROTATE_BACKENDS[backend]
    reason = supports(k_cache)
    if reason is not None:
        raise ValueError(f"rerotate backend {backend!r} cannot run this call: {reason}")
    return fn(k_cache, delta_positions, inv_freq, out=out)


__all__ = ["REROTATE_BACKENDS", "check_rerotate_args", "rerotate", "rerotate_ref"]
