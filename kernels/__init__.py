"""lcx.kernels: Triton and CUDA implementations of lcx's hot paths (installed as `lcx.kernels`).

Kernel modules import triton lazily; nothing here queries a device at import time.
"""
