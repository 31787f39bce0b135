"""Loader and public wrapper of the CUDA re-rotation kernel (`rerotate.cu`).

    rerotate_cuda(k_cache [B, T, H, D], delta_positions [T] | [B, T] int, inv_freq [r/2], *, out=None)

Same signature and semantics as `lcx.cache.rerotate.rerotate_ref` (in place unless `out`);
precision as in `rerotate.cu`'s header: float64 turns, reduced, float32 sincos.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lcx.rope.rotary import rerotate_operands

from ._build import load_cuda_extension

_HERE = Path(__file__).resolve().parent
CU_SOURCE = _HERE / "rerotate.cu"
BINDING_SOURCE = _HERE / "rerotate_binding.cpp"
CUDA_SOURCES = (CU_SOURCE, BINDING_SOURCE)
# Architectures the .cu is checked to compile for (tests/kernels/test_rerotate_kernels.py): A100, H100.
NVCC_ARCHS = ("sm_80", "sm_90")


def load_extension(verbose: bool = False):
    """Compile (first call; torch caches the build) and import the torch extension. CUDA only."""
    return load_cuda_extension("lcx_rerotate_cuda", (BINDING_SOURCE.name, CU_SOURCE.name), verbose)


def rerotate_cuda(k_cache: torch.Tensor, delta_positions: torch.Tensor, inv_freq: torch.Tensor, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate `k_cache: [B, T, H, D]` (CUDA) by R(delta_positions) in the basis `inv_freq: [r/2]`;
    in place unless `out` is given."""
    target, delta, inv_turns = rerotate_operands(k_cache, delta_positions, inv_freq, out, kernel="rerotate_cuda")
    if k_cache.device.type != "cuda":
        raise ValueError(f"rerotate_cuda needs CUDA tensors, got {k_cache.device}")
    if k_cache.shape[0] > 65535:
        raise ValueError(f"rerotate_cuda: batch {k_cache.shape[0]} exceeds the grid's y limit 65535")
    if delta is None:
        return target
    load_extension().rerotate(k_cache, delta, inv_turns, target)
    return target
