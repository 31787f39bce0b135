"""lcx.kernels: Triton and CUDA implementations of lcx's hot paths (installed as `lcx.kernels`).

Kernel modules import triton lazily; nothing here queries a device at import time.
"""

import re


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3': how lcx names a GPU in file names
    (results/kernels/<slug>.json) and in per-GPU tables (the Triton kernels' tuned launch
    configurations)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"
