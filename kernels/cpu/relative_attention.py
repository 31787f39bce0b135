"""Loader and public wrapper of the CPU relative-position attention (`relative_attention.cpp`).

    paged_relative_attention_cpu(query [N, H, D], kv [R, 2D], rows [B, K, Hkv], q_rows [B, Tq],
                                 keys: RelativeKeys, *, scale, out [N, H, D], cols=None) -> out
    cols, index = compact_index(keys.index)   # only the visible keys of each query: [Bd, Tq, Kc]

Softmax attention of Tq queries per request over K keys read from a paged cache, each key
rotated to its position relative to the query (`lcx.methods.last_query.RelativeKeys`: which keys
a query sees and at what relative position, from the method itself). `kv` is the cache viewed as
rows of [key | value] (vLLM's CPU layout `[num_blocks, Hkv, block_size, 2D]` viewed as
`[-1, 2D]`); `rows[b, k, g]` is the row of request b's k-th key for kv head g; `q_rows[b, t]` the
row of `query`/`out` of request b's t-th query. Keys and queries are UNROTATED (the tables hold
positions relative to the query), or both rotated at their true positions (the tables hold the
method's position minus the true one, unit scale: identity rows, read without rotating, for keys
the method leaves in place; the vLLM plugin's rotated layout). Writes `out[q_rows]` only. Equal,
within `lcx.testing`'s budget, to the method's `attend` on the gathered keys
(tests/kernels/test_relative_attention_cpu.py).

Compacted index (`cols`, from `compact_index`): query t reads only keys `cols[.., t, c]` (-1:
none) with table rows `index[.., t, c]`, so a bounded method's prefill (each query sees
side + window keys of Tk) costs O(Tq * (side + window)), not O(Tq * Tk): the kernel does not
walk the invisible keys. Same result as the full index (the same keys, in the same order).

Build flags: the ISA torch detected at run time (`torch.backends.cpu.get_cpu_capability()`:
AVX512 / AVX2) selects `-m` flags so the dot products and rotations use wide vectors; the
extension's name carries the ISA, so a cached build is never loaded on a CPU without it. If the
compiler refuses the flags, the portable build (no ISA flags) is used.

The extension compiles on first use (torch.utils.cpp_extension.load: a C++ compiler and ninja,
~30-60 s, cached under torch's extensions directory; behind `lcx.kernels._torch_build`'s lock,
so a build killed half-way never stalls the next one). `unavailable()` says why it cannot be used.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
CPP_SOURCE = _HERE / "relative_attention.cpp"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# -m flags per ISA torch reports (its own kernels dispatch on the same detection); x86-64 only.
ISA_FLAGS = {
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"],
    "AVX2": ["-mavx2", "-mfma"],
}
BASE_FLAGS = ["-O3", "-fopenmp-simd", "-fno-trapping-math"]  # `omp simd` loops vectorised, no OpenMP runtime


def isa() -> str:
    """The ISA the extension is built for here: a key of `ISA_FLAGS`, or "portable"."""
    import platform

    cap = torch.backends.cpu.get_cpu_capability()
    return cap if platform.machine().lower() in ("x86_64", "amd64") and cap in ISA_FLAGS else "portable"


def build_args(target: str) -> dict:
    """`load`'s arguments for the build of ISA `target` (a key of `ISA_FLAGS` or "portable")."""
    suffix = "" if target == "portable" else f"_{target.lower()}"
    return {"name": f"lcx_relative_attention_cpu{suffix}", "sources": [str(CPP_SOURCE)],
            "extra_cflags": BASE_FLAGS + ISA_FLAGS.get(target, [])}


def load_for_isa(build_args_of, what: str, verbose: bool = False):
    """Compile (first call; torch caches the build across processes) and import the extension
    whose `load` arguments `build_args_of(target)` gives: with this CPU's ISA flags (`isa()`),
    else, if that build fails, the portable one (logged, naming `what`)."""
    from .._torch_build import load

    target = isa()
    if target != "portable":
        try:
            return load(**build_args_of(target), verbose=verbose)
        except Exception as e:  # noqa: BLE001 - an old compiler without the flags: the portable build
            import logging

            logging.getLogger(__name__).warning("lcx: the %s build of the %s failed (%s); building without ISA "
                                                "flags", target, what, str(e).splitlines()[0])
    return load(**build_args_of("portable"), verbose=verbose)


@functools.lru_cache(maxsize=None)
def load_extension(verbose: bool = False):
    """The extension for this CPU (`load_for_isa`)."""
    return load_for_isa(build_args, "CPU attention kernel", verbose)


def compact_index(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`index [Bd, Tq, Tk]` (-1: not visible) -> `(cols, index)`, both `[Bd, Tq, Kc]` with Kc the
    most keys any query sees: each query's visible keys first, in key order (`cols`: the key,
    -1 past the query's last), and their table rows. Build once per shape: O(Tq * Tk)."""
    visible = index >= 0
    kc = max(int(visible.sum(-1).max()), 1) if index.numel() else 1
    # a stable sort of "not visible" puts the visible keys first, each group in key order
    order = torch.sort((~visible).to(torch.uint8), dim=-1, stable=True).indices[..., :kc]  # [Bd, Tq, Kc]
    keep = visible.gather(-1, order)
    return torch.where(keep, order, -1).contiguous(), torch.where(keep, index.gather(-1, order), -1).contiguous()


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """None if the extension builds and loads here, else the reason (no compiler, no ninja, ...)."""
    try:
        load_extension()
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch route
        msg = str(e).strip()
        return f"{type(e).__name__}: {msg.splitlines()[0] if msg else ''}"
    return None


_NO_COLS = torch.empty(0, dtype=torch.long)


def paged_relative_attention_cpu(query: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, q_rows: torch.Tensor,
                                 keys, *, scale: float | None, out: torch.Tensor,
                                 cols: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """See the module docstring; `keys` a `lcx.methods.last_query.RelativeKeys` (float32 tables;
    with `cols`, its index compacted by `compact_index`); `scale` None: head_dim ** -0.5 (SDPA's
    default); `softcap`: a model's attention-logit cap on every scaled logit (`lcx.attention.soft_cap`).
    Returns `out`."""
    if query.dtype not in DTYPES:
        raise ValueError(f"paged_relative_attention_cpu takes {DTYPES}, got {query.dtype}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (None: no cap), got {softcap}")
    load_extension().paged_relative_attention(
        query, kv, rows.contiguous(), q_rows.contiguous(), keys.index, _NO_COLS if cols is None else cols,
        keys.cos, keys.sin, float(query.shape[-1] ** -0.5 if scale is None else scale), out, float(softcap or 0.0))
    return out


__all__ = ["BASE_FLAGS", "CPP_SOURCE", "DTYPES", "ISA_FLAGS", "compact_index", "isa", "load_extension", "load_for_isa",
           "paged_relative_attention_cpu", "unavailable"]
