"""CUDA C++ kernels of lcx (installed as `lcx.kernels.cuda`; the .cu/.cpp sources ship as package data).

- `rerotate.cu`: PIE re-rotation of cached keys (`rerotate_cuda`);
- `lambda_decode.cu`: Λ-attention decode over unrotated cached keys (`lambda_decode_cuda`,
  served as attention backend "cuda" by `lcx.attention.cuda_backend`).

Each `.cu` is self-contained (a raw `__global__` kernel and an `extern "C"` launcher over raw
pointers and strides) so it compiles with a bare `nvcc -arch=sm_80 -c` anywhere;
its `<name>_binding.cpp` is the thin torch binding, compiled together with it only on a CUDA
machine by `load_extension()` (torch.utils.cpp_extension.load, cached per process).
Importing this package compiles nothing and queries no device.
"""

from pathlib import Path

from .lambda_decode import DecodeKeys, DecodeTables, decode_tables, lambda_decode_cuda
from .rerotate import CU_SOURCE, CUDA_SOURCES, NVCC_ARCHS, load_extension, rerotate_cuda

# Every CUDA translation unit of this package (each compiles alone with nvcc; tests check it).
CU_FILES = tuple(sorted(Path(__file__).resolve().parent.glob("*.cu")))

__all__ = [
    "CU_FILES",
    "CU_SOURCE",
    "CUDA_SOURCES",
    "DecodeKeys",
    "DecodeTables",
    "NVCC_ARCHS",
    "decode_tables",
    "lambda_decode_cuda",
    "load_extension",
    "rerotate_cuda",
]
