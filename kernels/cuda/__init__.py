"""CUDA C++ kernels of lcx (installed as `lcx.kernels.cuda`; the .cu/.cpp sources ship as package data).

`rerotate.cu` is self-contained (a raw `__global__` kernel and an `extern "C"` launcher over raw
pointers and strides) so it compiles with a bare `nvcc -arch=sm_80 -c` anywhere;
`rerotate_binding.cpp` is the thin torch binding, compiled together with it only on a CUDA
machine by `load_extension()` (torch.utils.cpp_extension.load, cached per process).
Importing this package compiles nothing and queries no device.
"""

from .rerotate import CU_SOURCE, CUDA_SOURCES, NVCC_ARCHS, load_extension, rerotate_cuda

__all__ = ["CU_SOURCE", "CUDA_SOURCES", "NVCC_ARCHS", "load_extension", "rerotate_cuda"]
