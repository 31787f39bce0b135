"""Loader and public wrapper of the CPU relative-position attention (`relative_attention.cpp`).

    paged_relative_attention_cpu(query [N, H, D], kv [R, 2D], rows [B, K, Hkv], q_rows [B, Tq],
                                 keys: RelativeKeys, *, scale, out [N, H, D]) -> out

Softmax attention of Tq queries per request over K keys read from a paged cache, each key
rotated to its position relative to the query (`lcx.methods.last_query.RelativeKeys`: which keys
a query sees and at what relative position, from the method itself). `kv` is the cache viewed as
rows of [key | value] (vLLM's CPU layout `[num_blocks, Hkv, block_size, 2D]` viewed as
`[-1, 2D]`); `rows[b, k, g]` is the row of request b's k-th key for kv head g; `q_rows[b, t]` the
row of `query`/`out` of request b's t-th query. Keys and queries are UNROTATED (the tables hold
positions relative to the query), or both rotated at their true positions (the tables hold the
method's position minus the true one, unit scale: identity rows, read without rotating, for keys
the method leaves in place; the vLLM plugin's rotated layout). Writes `out[q_rows]` only. Equal, within `lcx.testing`'s budget, to the method's `attend` on the gathered keys
(tests/kernels/test_relative_attention_cpu.py).

The extension compiles on first use (torch.utils.cpp_extension.load: a C++ compiler and ninja,
~30-60 s, cached under torch's extensions directory). `unavailable()` says why it cannot be used.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
CPP_SOURCE = _HERE / "relative_attention.cpp"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def load_extension(verbose: bool = False):
    """Compile (first call; torch caches the build across processes) and import the extension."""
    from torch.utils.cpp_extension import load

    # -fopenmp-simd: honour the `omp simd` reductions (vectorised dot products) without OpenMP
    return load(name="lcx_relative_attention_cpu", sources=[str(CPP_SOURCE)], extra_cflags=["-O3", "-fopenmp-simd"],
                verbose=verbose)


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """None if the extension builds and loads here, else the reason (no compiler, no ninja, ...)."""
    try:
        load_extension()
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch route
        msg = str(e).strip()
        return f"{type(e).__name__}: {msg.splitlines()[0] if msg else ''}"
    return None


def paged_relative_attention_cpu(query: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, q_rows: torch.Tensor,
                                 keys, *, scale: float | None, out: torch.Tensor) -> torch.Tensor:
    """See the module docstring; `keys` a `lcx.methods.last_query.RelativeKeys` (float32 tables);
    `scale` None: head_dim ** -0.5 (SDPA's default). Returns `out`."""
    if query.dtype not in DTYPES:
        raise ValueError(f"paged_relative_attention_cpu takes {DTYPES}, got {query.dtype}")
    load_extension().paged_relative_attention(
        query, kv, rows.contiguous(), q_rows.contiguous(), keys.index, keys.cos, keys.sin,
        float(query.shape[-1] ** -0.5 if scale is None else scale), out)
    return out


__all__ = ["CPP_SOURCE", "DTYPES", "load_extension", "paged_relative_attention_cpu", "unavailable"]
