"""Loader and public wrapper of the CUDA re-rotation kernel (`rerotate.cu`).

    rerotate_cuda(k_cache [B, T, H, D], delta_positions [T] | [B, T] int, inv_freq [r/2], *, out=None)

Same signature and semantics as `lcx.cache.rerotate.rerotate_ref` (in place unless `out`);
precision as in `rerotate.cu`'s header: float64 turns, reduced, float32 sincos.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from lcx.rope.rotary import check_rerotate_args

_HERE = Path(__file__).resolve().parent
CU_SOURCE = _HERE / "rerotate.cu"
BINDING_SOURCE = _HERE / "rerotate_binding.cpp"
CUDA_SOURCES = (CU_SOURCE, BINDING_SOURCE)
# Architectures the .cu is checked to compile for (tests/kernels/test_rerotate_kernels.py): A100, H100.
NVCC_ARCHS = ("sm_80", "sm_90")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def load_extension(verbose: bool = False):
    """Compile (first call; torch caches the build) and import the torch extension. CUDA only."""
    if not torch.cuda.is_available():
        raise RuntimeError("lcx.kernels.cuda needs a CUDA build of torch and a GPU "
                           "(torch.cuda.is_available() is False)")
    from torch.utils.cpp_extension import load

    return load(name="lcx_rerotate_cuda", sources=[str(BINDING_SOURCE), str(CU_SOURCE)],
                extra_cuda_cflags=["-O3"], verbose=verbose)


def rerotate_cuda(k_cache: torch.Tensor, delta_positions: torch.Tensor, inv_freq: torch.Tensor, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate `k_cache: [B, T, H, D]` (CUDA) by R(delta_positions) in the basis `inv_freq: [r/2]`;
    in place unless `out` is given."""
    check_rerotate_args(k_cache, delta_positions, inv_freq, out)
    if k_cache.device.type != "cuda":
        raise ValueError(f"rerotate_cuda needs CUDA tensors, got {k_cache.device}")
    if k_cache.dtype not in _DTYPES:
        raise ValueError(f"rerotate_cuda supports {_DTYPES}, got {k_cache.dtype}")
    if k_cache.shape[0] > 65535:
        raise ValueError(f"rerotate_cuda: batch {k_cache.shape[0]} exceeds the grid's y limit 65535")
    target = k_cache if out is None else out
    B, T = k_cache.shape[:2]
    if B == 0 or T == 0:
        return target
    delta = delta_positions.to(device=k_cache.device, dtype=torch.int64)
    if delta.dim() == 1:
        delta = delta.expand(B, T)
    inv_turns = (inv_freq.to(torch.float64) / (2 * math.pi)).contiguous().to(k_cache.device)
    load_extension().rerotate(k_cache, delta, inv_turns, target)
    return target
