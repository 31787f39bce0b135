"""`lcx bench kernels --tune`: the Triton Λ-attention forward kernel's launch configuration
(block_m, block_n, num_warps, num_stages) measured on this GPU.

The kernel has one default configuration (`lcx.kernels.triton.lambda_attention.DEFAULT_CONFIG`,
chosen without a GPU); the first H100 run measured its Λ prefill at ~10% of the bf16 matmul
ceiling (docs/kernels.md). This times every configuration of `GRID` on the lambda_prefill
benchmark's shape (Llama-3-8B attention: 32 query / 8 KV heads, head dim 128, bf16; Λ with
G = 64, L = 4096; 32k tokens by default) through the same `attention(..., backend="triton")` call
as the benchmark, with the same timer, and checks each configuration's output against the
default's (a configuration that computes something else is rejected, not ranked). A
configuration the GPU cannot launch (shared memory, registers) is recorded with its error.

Writes results/kernels/<gpu>.tune.json: every configuration's median, the default's, the best
and its speedup. The kernel uses the winner once it is entered in `TUNED` (by hand, in the same
commit as the JSON; a test keeps the two equal). On the CPU (`--device cpu`) a tiny shape and two
configurations run under Triton's interpreter: a test of this module, never a result.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import gpu_slug, n_buffers, randn, time_case, versions

from .common import G_LAMBDA, L_LAMBDA, rope_inv_freq

SCHEMA = "lcx.bench.kernels.tune/1"
# 16 configurations (with the default, which is among them): the usual flash-attention forward
# space on Hopper/Ampere, small enough to compile and time in about a minute of a GPU session.
# One that does not fit the GPU's shared memory fails to launch and is recorded as such.
GRID_AXES = {"block_m": (64, 128), "block_n": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3)}
CPU_GRID_AXES = {"block_m": (16, 32), "block_n": (16,), "num_warps": (4,), "num_stages": (1,)}
# an output differing from the default configuration's by more than this (relative to its
# largest value) is a different computation, not a reordering of the same sums
MISMATCH_REL = 2e-2


def grid(axes: dict[str, tuple[int, ...]]):
    from lcx.kernels.triton.lambda_attention import FwdConfig

    keys = list(axes)
    return [FwdConfig(**dict(zip(keys, vals))) for vals in itertools.product(*(axes[k] for k in keys))]


def _inputs(device: str, length: int):
    from lcx.attention import AttentionSpec, Rotary

    tiny = device == "cpu"
    B, H, Hkv, D = (1, 2, 1, 32) if tiny else (1, 32, 8, 128)
    T, G, L = (min(length, 96), 4, 16) if tiny else (length, G_LAMBDA, L_LAMBDA)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    nbytes = B * T * (2 * H + 2 * Hkv) * D * 2
    m = n_buffers(nbytes, device)
    qs = randn((B, T, H, D), dt, device, m)
    kvs = randn((B, T, Hkv, D), dt, device, m, seed=1)
    rot = Rotary(rope_inv_freq(D).to(device))
    spec = AttentionSpec.lm_infinite(n_global=G, n_local=L)
    return qs, kvs, rot, spec, dict(B=B, T=T, H=H, Hkv=Hkv, D=D, G=G, L=L, dtype=str(dt).removeprefix("torch."))


def tune(device: str, *, length: int = 32768, axes: dict[str, tuple[int, ...]] | None = None,
         warmup: int = 2, repeats: int = 5, progress: bool = True, checkpoint=None) -> dict[str, Any]:
    """Time every configuration of the grid; returns the record (see the module docstring)."""
    from benchmarks.harness import Prepared
    from benchmarks.harness import progress as _progress
    from lcx.attention import attention
    from lcx.kernels.triton.lambda_attention import DEFAULT_CONFIG, launch_config

    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        raise ValueError("--tune needs triton")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA GPU here; --tune --device cpu runs the tiny interpreter smoke configuration")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--tune --device cpu runs Triton's interpreter: set TRITON_INTERPRET=1 before starting")
    configs = grid(axes or (GRID_AXES if device == "cuda" else CPU_GRID_AXES))
    if DEFAULT_CONFIG not in configs:
        configs.insert(0, DEFAULT_CONFIG)
    else:  # the default first: every other configuration is checked against its output
        configs.remove(DEFAULT_CONFIG)
        configs.insert(0, DEFAULT_CONFIG)
    qs, kvs, rot, spec, shape = _inputs(device, length)
    m = len(qs)
    flops = 4.0 * shape["B"] * shape["H"] * shape["T"] * min(shape["T"], shape["G"] + shape["L"]) * shape["D"]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    rows: list[dict[str, Any]] = []
    ref = None

    def call(i: int):
        return attention(qs[i % m], kvs[i % m], kvs[i % m], spec, backend="triton", rotary=rot)

    def record(complete: bool) -> dict[str, Any]:
        ok = [r for r in rows if "median_ms" in r and r.get("matches_default")]
        default = next((r for r in rows if r["config"] == dataclasses.asdict(DEFAULT_CONFIG) and "median_ms" in r), None)
        best = min(ok, key=lambda r: r["median_ms"]) if ok else None
        return {
            "schema": SCHEMA, "gpu": name, "gpu_slug": gpu_slug(name) if device == "cuda" else "cpu",
            "device": device, "smoke": device != "cuda", "complete": complete,
            "kernel": "lcx.kernels.triton.lambda_attention (forward)", "case": "lambda_prefill", "shape": shape,
            "timing": "triton.testing.do_bench (L2 flushed per call)" if device == "cuda" else "wall clock (CPU smoke)",
            "warmup": warmup, "repeats": repeats, "statistic": "median", "mismatch_rel": MISMATCH_REL,
            "default": dataclasses.asdict(DEFAULT_CONFIG), "default_ms": default and default["median_ms"],
            "best": best and best["config"], "best_ms": best and best["median_ms"],
            "best_TFLOPs": best and round(flops / best["median_ms"] / 1e9, 3),
            "speedup_vs_default": (round(default["median_ms"] / best["median_ms"], 4) if best and default else None),
            "environment": versions(), "configs": rows,
        }

    bar = _progress(configs, desc="tune", unit="config", enabled=progress)
    for cfg in bar:
        row: dict[str, Any] = {"config": dataclasses.asdict(cfg)}
        try:
            with launch_config(cfg):
                out = call(0).float()
                if ref is None:
                    ref = out
                diff = float((out - ref).abs().max())
                scale = max(1.0, float(ref.abs().max()))
                row["max_abs_diff_vs_default"] = diff
                row["matches_default"] = bool(diff <= MISMATCH_REL * scale)
                times = time_case(Prepared(call, m, 0.0, flops), device, warmup=warmup, repeats=repeats)
            row["median_ms"] = float(statistics.median(times))
            row["TFLOPs"] = round(flops / row["median_ms"] / 1e9, 3)
        except Exception as e:  # noqa: BLE001 - a configuration this GPU cannot launch is a recorded result
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if ref is None:  # the default itself failed: nothing to compare with
                raise
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        if checkpoint is not None:
            checkpoint(record(False))
    return record(True)


def table(rec: dict[str, Any]) -> str:
    lines = [f"{rec['gpu']}: Λ forward at {rec['shape']} ({rec['timing']})",
             f"{'block_m':>7s} {'block_n':>7s} {'warps':>5s} {'stages':>6s} {'median ms':>10s} {'TFLOP/s':>8s}  note"]
    for r in sorted(rec["configs"], key=lambda r: r.get("median_ms", float("inf"))):
        c = r["config"]
        note = r.get("error") or ("" if r.get("matches_default") else f"MISMATCH {r['max_abs_diff_vs_default']:.3g}")
        if c == rec["default"]:
            note = ("default " + note).strip()
        ms = f"{r['median_ms']:10.4f} {r['TFLOPs']:8.3f}" if "median_ms" in r else f"{'-':>10s} {'-':>8s}"
        lines.append(f"{c['block_m']:7d} {c['block_n']:7d} {c['num_warps']:5d} {c['num_stages']:6d} {ms}  {note}")
    if rec.get("best"):
        lines.append(f"best {rec['best']}: {rec['best_ms']:.4f} ms, {rec['speedup_vs_default']}x the default")
    return "\n".join(lines)


def default_path(rec: dict[str, Any], results_dir: Path) -> Path | None:
    return None if rec["smoke"] else results_dir / f"{rec['gpu_slug']}.tune.json"
