"""Loader and public wrapper of the CPU causal attention (`causal_attention.cpp`).

    causal_attention_cpu(q [b, nq, H, D], k [b, n, Hkv, D], v [b, n, Hkv, Dv], scale=None,
                         window=None, softcap=None) -> [b, nq, H, Dv]
    decode_attention_cpu(q [B, 1, H, D], k [B, Hkv, C, D], v [B, Hkv, C, Dv], visible [B, C],
                         scale=None, softcap=None) -> [B, 1, H, Dv]

The newest nq of each row's n keys attend causally (query i at position n - nq + i), or within a
sliding window of `window` keys (the query's own included), float32 only. Flash-style blocks of
64 keys up to each block of queries' diagonal, register-tiled with AVX-512 where the build
targets it (the same ISA selection as `relative_attention`: `isa()`, `ISA_FLAGS`). The engine's
prefill and mixed-step rows run it (`lcx.hf.attention_call.attend_loaded_rows`), where
`lcx bench rows` measured it fastest (results/loaded_rows_cpu.json). `decode_attention_cpu` is the
engine's decode step over a slot store (one query per row, a visibility mask with holes):
`lcx.engine.decode_step.decode_attention` without a side branch.

Compiled on first use (torch.utils.cpp_extension.load behind `lcx.kernels._torch_build`'s lock;
cached); `unavailable()` says why it cannot be used here, and callers then keep torch's kernels.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .relative_attention import BASE_FLAGS, ISA_FLAGS, load_for_isa

CPP_SOURCE = Path(__file__).resolve().parent / "causal_attention.cpp"


def build_args(target: str) -> dict:
    """`load`'s arguments for the build of ISA `target` (a key of `ISA_FLAGS` or "portable")."""
    suffix = "" if target == "portable" else f"_{target.lower()}"
    return {"name": f"lcx_causal_attention_cpu{suffix}", "sources": [str(CPP_SOURCE)],
            "extra_cflags": BASE_FLAGS + ISA_FLAGS.get(target, [])}


@functools.lru_cache(maxsize=None)
def load_extension(target: str | None = None, verbose: bool = False):
    """Compile (first call; cached across processes) and import the extension for ISA `target`
    (None: this CPU's, falling back to the portable build if that one fails: `load_for_isa`)."""
    if target is not None:
        from .._torch_build import load

        return load(**build_args(target), verbose=verbose)
    return load_for_isa(build_args, "causal CPU attention", verbose)


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """None if the extension builds and loads here, else the reason."""
    try:
        load_extension()
    except Exception as e:  # noqa: BLE001 - any build failure means: use torch's kernels
        msg = str(e).strip()
        return f"{type(e).__name__}: {msg.splitlines()[0] if msg else ''}"
    return None


def causal_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                         window: int | None = None, softcap: float | None = None, *, target: str | None = None
                         ) -> torch.Tensor:
    """See the module docstring. `scale` None: D ** -0.5; `window` None: causal; `softcap`: a
    model's attention-logit cap (Gemma 2); `target`: a given build ("portable" in the tests)."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (None: causal), got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (None: no cap), got {softcap}")
    ext = load_extension(target)
    with torch.profiler.record_function("lcx::causal_attention_cpu"):  # named in torch.profiler's tables
        return ext.causal_attention(
            q, k, v, float(q.shape[-1] ** -0.5 if scale is None else scale), int(window or 0), float(softcap or 0.0))


def decode_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                         scale: float | None = None, softcap: float | None = None, *, target: str | None = None
                         ) -> torch.Tensor:
    """One query per row over a slot store: q `[B, 1, H, D]`, k/v `[B, Hkv, C, D]`, visible
    `[B, C]` bool (the slots each row's query sees; a row with none gets zeros) -> `[B, 1, H, Dv]`,
    float32; `lcx.engine.decode_step.decode_attention`'s path without a side branch."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (None: no cap), got {softcap}")
    B, _, H, D = q.shape
    ext = load_extension(target)
    with torch.profiler.record_function("lcx::decode_attention_cpu"):
        out = ext.decode_attention(
            q.reshape(B, H, D), k, v, visible, float(D ** -0.5 if scale is None else scale), float(softcap or 0.0))
    return out.view(B, 1, H, -1)


__all__ = ["CPP_SOURCE", "build_args", "causal_attention_cpu", "decode_attention_cpu", "load_extension",
           "unavailable"]
