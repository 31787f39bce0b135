"""The one loader of lcx's CUDA torch extensions: compile on first use (torch caches the build
per name and source hash), import, and keep the module for the process."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def load_cuda_extension(name: str, sources: tuple[str, ...], verbose: bool = False):
    """`torch.utils.cpp_extension.load` of `sources` (file names in this folder, headers found
    here too) as the module `name`. CUDA only: raises RuntimeError without a GPU build."""
    if not torch.cuda.is_available():
        raise RuntimeError("lcx.kernels.cuda needs a CUDA build of torch and a GPU "
                           "(torch.cuda.is_available() is False)")
    from .._torch_build import load

    return load(name=name, sources=[str(HERE / s) for s in sources], extra_include_paths=[str(HERE)],
                extra_cuda_cflags=["-O3"], verbose=verbose)
