"""`lcx bench kernels --tune`: the Triton Λ-attention forward kernel's launch configuration
(block_m, block_n, num_warps, num_stages), and the CUDA Λ decode kernel's split-K factor
(`tune_decode`), measured on this GPU.

The kernel has one default configuration (`lcx.kernels.triton.lambda_attention.DEFAULT_CONFIG`,
chosen without a GPU); the first H100 run measured its Λ prefill at ~10% of the bf16 matmul
ceiling (docs/kernels.md). This times every configuration of `GRID` on the lambda_prefill
benchmark's shape (Llama-3-8B attention: 32 query / 8 KV heads, head dim 128, bf16; Λ with
G = 64, L = 4096; 32k tokens by default) through the same `attention(..., backend="triton")` call
as the benchmark, with the same timer, and checks each configuration's output against the
default's (a configuration that computes something else is rejected, not ranked). A
configuration the GPU cannot launch (shared memory, registers) is recorded with its error.

Writes results/kernels/<gpu>.tune.json: every configuration's median, the default's, the best
and its speedup (and "decode_splits"). The kernels use the winners once they are entered in
`lambda_attention.TUNED` and `lambda_decode.TUNED_BLOCKS_PER_SM` (by hand, in the same commit as
the JSON; a test keeps them equal). On the CPU (`--device cpu`) a tiny shape and two
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


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """How far `out` is from the default configuration's output, and whether that is the same
    computation (within MISMATCH_REL of its largest value)."""
    diff = float((out - ref).abs().max())
    return {"max_abs_diff_vs_default": diff,
            "matches_default": bool(diff <= MISMATCH_REL * max(1.0, float(ref.abs().max())))}


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
    # the default first: every other configuration is checked against its output
    configs = [DEFAULT_CONFIG] + [c for c in grid(axes or (GRID_AXES if device == "cuda" else CPU_GRID_AXES))
                                  if c != DEFAULT_CONFIG]
    qs, kvs, rot, spec, shape = _inputs(device, length)
    m = len(qs)
    flops = 4.0 * shape["B"] * shape["H"] * shape["T"] * min(shape["T"], shape["G"] + shape["L"]) * shape["D"]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    env = versions()
    rows: list[dict[str, Any]] = []
    decode: dict[str, Any] = {}
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
            "environment": env, "configs": rows, "decode_splits": decode.get("result"),
        }

    bar = _progress(configs, desc="tune", unit="config", enabled=progress)
    for cfg in bar:
        row: dict[str, Any] = {"config": dataclasses.asdict(cfg)}
        try:
            with launch_config(cfg):
                out = call(0).float()
                ref = out if ref is None else ref
                row.update(_compare(out, ref))
                times = time_case(Prepared(call, m, 0.0, flops), device, warmup=warmup, repeats=repeats)
            row["median_ms"] = float(statistics.median(times))
            row["TFLOPs"] = round(flops / row["median_ms"] / 1e9, 3)
        except Exception as e:  # noqa: BLE001 - a configuration this GPU cannot launch is a recorded result
            row["error"] = _error(e)
            if ref is None:  # the default itself failed: nothing to compare with
                raise
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        if checkpoint is not None:
            checkpoint(record(False))
    try:  # its own failure must not lose the Triton configurations measured above
        decode["result"] = tune_decode(device, warmup=warmup, repeats=repeats)
    except Exception as e:  # noqa: BLE001
        decode["result"] = {"error": _error(e)}
    return record(True)


# blocks per SM the CUDA decode kernel's split-K factor aims at (its default is 2)
DECODE_BLOCKS_PER_SM = (1, 2, 4, 8, 16, 32)


def tune_decode(device: str, *, warmup: int = 2, repeats: int = 5) -> dict[str, Any]:
    """The CUDA Λ decode kernel (`lcx.kernels.cuda.lambda_decode`) at the lambda_decode
    benchmark's shape (batch 4, 32/8 heads, head dim 128, bf16, G = 64 + L = 4096 visible keys):
    its split-K factor for each of DECODE_BLOCKS_PER_SM blocks per SM, each output checked against
    the default's. The kernel's default aims at DEFAULT_BLOCKS_PER_SM; the first H100 run measured
    it at 17% of the copy bandwidth."""
    if device != "cuda":
        return {"skipped": "the CUDA decode kernel needs a CUDA GPU"}
    from benchmarks.harness import Prepared
    from lcx.attention import AttentionSpec, Rotary
    from lcx.attention.cuda_backend import decode_keys
    from lcx.kernels.cuda.lambda_decode import (
        DEFAULT_BLOCKS_PER_SM, _sm_count, decode_tables, default_splits, heads_per_block, lambda_decode_cuda)

    B, H, Hkv, D, G, L = 4, 32, 8, 128, G_LAMBDA, L_LAMBDA
    Tk = G + L
    spec = AttentionSpec.lm_infinite(n_global=G, n_local=L)
    pos = torch.cat((torch.arange(G), torch.arange(10**6 - L + 1, 10**6 + 1))).to(device)
    rot = Rotary(rope_inv_freq(D).to(device), pos)
    nbytes = 2 * B * Tk * Hkv * D * 2
    m = n_buffers(nbytes, device)
    qs = randn((B, 1, H, D), torch.bfloat16, device, m)
    ks = randn((B, Tk, Hkv, D), torch.bfloat16, device, m, seed=1)
    vs = randn((B, Tk, Hkv, D), torch.bfloat16, device, m, seed=2)
    tabs = decode_tables(rot.inv_freq, pos, Tk - 1, spec.lambda_params.effective_limit(Tk))
    keys = decode_keys(spec, Tk, Tk - 1)
    n_sms, hpb = _sm_count(torch.cuda.current_device()), heads_per_block(H, Hkv)
    rows, ref = [], None
    for per_sm in sorted(set(DECODE_BLOCKS_PER_SM) | {DEFAULT_BLOCKS_PER_SM}, key=lambda x: x != DEFAULT_BLOCKS_PER_SM):
        splits = default_splits(B, H, hpb, keys.n_visible, n_sms, per_sm)
        row: dict[str, Any] = {"blocks_per_sm": per_sm, "n_splits": splits}
        if any(r["n_splits"] == splits for r in rows):  # capped by keys per split: the same launch
            row["same_as"] = next(r["blocks_per_sm"] for r in rows if r["n_splits"] == splits)
            rows.append(row)
            continue
        call = (lambda n: lambda i: lambda_decode_cuda(qs[i % m], ks[i % m], vs[i % m], keys=keys, scale=D**-0.5,
                                                      tables=tabs, n_splits=n))(splits)
        try:
            out = call(0)[0].float()
            ref = out if ref is None else ref
            row.update(_compare(out, ref))
            row["median_ms"] = float(statistics.median(time_case(Prepared(call, m, nbytes, 0.0), device,
                                                                 warmup=warmup, repeats=repeats)))
            row["GBps"] = round(nbytes / row["median_ms"] / 1e6, 1)
        except Exception as e:  # noqa: BLE001
            row["error"] = _error(e)
            if ref is None:
                raise
        rows.append(row)
    ok = [r for r in rows if r.get("matches_default") and "median_ms" in r]
    best = min(ok, key=lambda r: r["median_ms"]) if ok else None
    default = rows[0] if "median_ms" in rows[0] else None
    return {"shape": dict(B=B, Tk=Tk, H=H, Hkv=Hkv, D=D, G=G, L=L, dtype="bfloat16"), "sms": n_sms,
            "bytes_per_call": nbytes, "default_blocks_per_sm": DEFAULT_BLOCKS_PER_SM,
            "best_blocks_per_sm": best and best["blocks_per_sm"], "best_ms": best and best["median_ms"],
            "speedup_vs_default": round(default["median_ms"] / best["median_ms"], 4) if best and default else None,
            "settings": rows}


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
    dec = rec.get("decode_splits") or {}
    if dec.get("settings"):
        lines.append(f"CUDA decode split-K at {dec['shape']} on {dec['sms']} SMs:")
        for r in dec["settings"]:
            what = (f"same launch as {r['same_as']}" if "same_as" in r else r.get("error")
                    or f"{r['median_ms']:.4f} ms {r['GBps']:8.1f} GB/s"
                    + ("" if r.get("matches_default") else f" MISMATCH {r['max_abs_diff_vs_default']:.3g}"))
            lines.append(f"  {r['blocks_per_sm']:3d} blocks/SM ({r['n_splits']:4d} splits): {what}")
        lines.append(f"  decode best {dec['best_blocks_per_sm']} blocks/SM, {dec['speedup_vs_default']}x the default")
    if rec.get("best"):
        lines.append(f"best {rec['best']}: {rec['best_ms']:.4f} ms, {rec['speedup_vs_default']}x the default")
    return "\n".join(lines)


def default_path(rec: dict[str, Any], results_dir: Path) -> Path | None:
    return None if rec["smoke"] else results_dir / f"{rec['gpu_slug']}.tune.json"
