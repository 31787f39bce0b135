"""`lcx bench kernels`: time every GPU kernel against its baseline; roofline; regression check.

    lcx bench kernels                       # GPU: run all cases, write results/kernels/<gpu>.json
    lcx bench kernels --check               # run, write <gpu>.latest.json, compare with <gpu>.json
    lcx bench kernels --check BASE --new NEW.json   # compare two stored runs, no timing
    lcx bench kernels --device cpu --only rope      # CPU smoke (wall clock; never a baseline)

Cases (`CASES`, one registry; each names its implementation and the baseline it races):
    rerotate            PIE re-rotation of a key cache in place: triton, cuda
    lambda_prefill      Λ-attention prefill (G=64, L=4096) at 8k/32k/128k: triton vs torch
                        flash SDPA causal (goal: speedup >= 0.6 n / (2 (G + L)))
    lambda_decode       one token over a bounded cache (G + L keys): cuda kernel, cuda/triton
                        backends, vs flash SDPA decode over the full 32k/128k cache
    swat                sigmoid window attention fwd+bwd (SWAT): triton (and lcx's flex_compiled
                        backend) vs torch's compiled flex_attention with the same mask and
                        ALiBi, its block mask built once
    rope                fused RoPE application: triton vs apply_rotary_ref
Each case has a bytes and a FLOPs formula (the minimum traffic / useful work), so a row
reports GB/s and TFLOP/s and their fraction of the ceilings measured in the same run:
device-to-device copy bandwidth (read + write) and a bf16 matmul.

Timing (GPU): `triton.testing.do_bench` (CUDA events per call, the L2 cache flushed before
each), after `warmup` calls of our own (compilation, autotuning: kept out of do_bench's estimate
of a call's time); its time budget is at least 100 ms and about `repeats` calls; the row keeps
every call's time and their median. Inputs also rotate over enough buffers that together exceed
4x the L2 cache. A case whose implementation is missing or refuses the shape is recorded as
`{"skipped": reason}`, never an error. The JSON is rewritten after every case (`"complete": false`
until the end), so a run cut off by a time limit keeps what it measured. CPU (`--device cpu`):
tiny shapes, wall clock of `repeats` calls, for tests of this module only; the JSON says
`"smoke": true` and the compare refuses it.

Regression check (`compare`, a pure function): a kernel more than `threshold` (10%) slower
in median than in the baseline of the SAME GPU fails, as does a baseline kernel the new run
no longer has; runs on different GPUs are refused.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Benchmark
from benchmarks.harness import progress as _progress

SCHEMA = "benchmarks.kernels/1"
THRESHOLD = 0.10
# Relative to the working directory (the repository root when run from a checkout), never to
# this file: an installed lcx lives in site-packages, where results do not belong.
RESULTS_DIR = Path("results") / "kernels"
G_LAMBDA, L_LAMBDA = 64, 4096  # the Λ configuration the kernel speed goals are stated for

DESCRIPTION = "time every GPU kernel against its baseline; roofline; regression check"
BENCH = Benchmark("kernels", DESCRIPTION, __doc__, out_help=(
    "where to write the result JSON (default: results/kernels/<gpu>.json; with --check <gpu>.latest.json; "
    "--device cpu writes only with --out)"))


# ----------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Prepared:
    """What a case's setup returns: a call over buffer `i`, and its roofline numbers."""

    run: Callable[[int], Any]  # run(i): one call on input set i % n_buffers
    n_buffers: int
    bytes: float  # minimum HBM traffic of one call
    flops: float  # useful FLOPs of one call (0 for pure data movement)
    shape: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One row: `group` (the op), `impl` (who runs it), `size` (a label), `setup(device, tiny)`.

    `baseline`: the row of the same group and size this one is compared with ("" = none);
    `goal(row, rows) -> dict | None` states the row's performance goal, if any.
    """

    group: str
    impl: str
    size: str
    setup: Callable[[str, bool], Prepared]
    baseline: str = ""
    goal: Callable[[dict, dict], dict | None] | None = None
    cpu: bool = False  # runs in the CPU smoke configuration

    @property
    def name(self) -> str:
        return f"{self.group}/{self.impl}/{self.size}"


class Skip(Exception):
    """Raised by a setup when its implementation is unavailable or refuses the shape."""


def _n_buffers(nbytes: float, device: str) -> int:
    """Input sets to rotate over so that together they exceed 4 x L2 (at most 16)."""
    if device != "cuda":
        return 1
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    return int(min(16, max(1, math.ceil(4 * l2 / max(nbytes, 1)))))


def _randn(shape, dtype, device, n, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype) for _ in range(n)]


def _need_cuda(device: str, what: str) -> None:
    if device != "cuda":
        raise Skip(f"{what} needs a CUDA GPU")


def _need_triton(device: str) -> None:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise Skip("triton is not installed")
    _need_cuda(device, "triton")


def _rope(D: int):
    from lcx.rope import RopeSpec, compute_inv_freq

    inv, _ = compute_inv_freq(RopeSpec(rope_theta=5e5), D)
    return inv


# --- rerotate: k [B, T, Hkv, D] <- R(delta) k, in place
def _rerotate(impl: str):
    def setup(device: str, tiny: bool) -> Prepared:
        B, T, H, D = (1, 64, 2, 64) if tiny else (1, 32768, 8, 128)
        dt = torch.bfloat16
        if impl == "triton":
            _need_triton(device)
            from lcx.kernels.triton.rerotate import rerotate_triton as fn
        elif impl == "cuda":
            _need_cuda(device, "the CUDA extension")
            from lcx.kernels.cuda import rerotate_cuda as fn
        else:
            from lcx.cache.rerotate import rerotate_ref as fn
        nbytes = 2 * B * T * H * D * 2 + T * 8  # read + write the keys, read delta
        n = _n_buffers(nbytes, device)
        ks = _randn((B, T, H, D), dt, device, n)
        delta = torch.randint(-1000, 1000, (T,), device=device)
        inv = _rope(D).to(device)
        return Prepared(lambda i: fn(ks[i % n], delta, inv), n, nbytes, 6.0 * B * T * H * D / 2,
                        dict(B=B, T=T, Hkv=H, D=D, dtype="bfloat16"))

    return setup


# --- Λ prefill: Tq = Tk = n; triton Λ kernel vs flash SDPA causal (no Λ: the dense baseline)
def _sdpa_call(q, k, v, *, causal: bool, device: str):
    """SDPA restricted to flash (GPU; memory-efficient as the second choice for decode shapes) or
    math (CPU). GQA natively (`enable_gqa`) when the kernel takes it, else with K/V heads
    repeated once here (outside the timed call). Returns (run(q, k, v), gqa_native)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = ([SDPBackend.FLASH_ATTENTION] if causal else [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
                ) if device == "cuda" else [SDPBackend.MATH]
    gqa = q.shape[1] != k.shape[1]

    def run(q, k, v, enable_gqa=gqa):
        with sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=enable_gqa)

    if not gqa:
        return run, True
    try:
        run(q, k, v)
        return run, True
    except RuntimeError:  # this torch's kernel has no native GQA: dense MHA with repeated K/V
        return None, False


def _prefill(impl: str, n: int):
    def setup(device: str, tiny: bool) -> Prepared:
        from lcx.attention import AttentionSpec, Rotary, attention

        B, H, Hkv, D = (1, 2, 1, 32) if tiny else (1, 32, 8, 128)
        T, G, L = (96, 4, 16) if tiny else (n, G_LAMBDA, L_LAMBDA)
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        if impl == "sdpa_flash_causal":
            nbytes = B * T * (2 * H + 2 * Hkv) * D * 2  # q, out + k, v
            m = _n_buffers(nbytes, device)
            qs = _randn((B, H, T, D), dt, device, m)
            kvs = _randn((B, Hkv, T, D), dt, device, m, seed=1)
            call, native = _sdpa_call(qs[0], kvs[0], kvs[0], causal=True, device=device)
            if not native:
                kvs = [x.repeat_interleave(H // Hkv, dim=1) for x in kvs]
                call, _ = _sdpa_call(qs[0], kvs[0], kvs[0], causal=True, device=device)
            run = lambda i: call(qs[i % m], kvs[i % m], kvs[i % m])  # noqa: E731
            return Prepared(run, m, nbytes, 2.0 * B * H * T * T * D,
                            dict(B=B, T=T, H=H, Hkv=Hkv, D=D, gqa_native=native))
        _need_triton(device)
        spec = AttentionSpec.lm_infinite(n_global=G, n_local=L)
        nbytes = B * T * (2 * H + 2 * Hkv) * D * 2
        m = _n_buffers(nbytes, device)
        qs = _randn((B, T, H, D), dt, device, m)
        kvs = _randn((B, T, Hkv, D), dt, device, m, seed=1)
        rot = Rotary(_rope(D).to(device))
        run = lambda i: attention(qs[i % m], kvs[i % m], kvs[i % m], spec, backend="triton", rotary=rot)  # noqa: E731
        visible = min(T, G + L)  # keys per query (most rows)
        return Prepared(run, m, nbytes, 4.0 * B * H * T * visible * D, dict(B=B, T=T, H=H, Hkv=Hkv, D=D, G=G, L=L))

    return setup


def _prefill_goal(row: dict, rows: dict) -> dict | None:
    base = rows.get(row.get("baseline", ""), {})
    if "median_ms" not in row or "median_ms" not in base:
        return None
    n = row["shape"]["T"]
    target = 0.6 * n / (2 * (row["shape"]["G"] + row["shape"]["L"]))
    speedup = base["median_ms"] / row["median_ms"]
    return {"what": "speedup over flash SDPA causal >= 0.6 n / (2 (G + L))", "target": round(target, 3),
            "value": round(speedup, 3), "met": speedup >= target}


# --- Λ decode: one query over the bounded cache (G + L keys, unrotated, true positions)
def _decode(impl: str, full_len: int = 0):
    def setup(device: str, tiny: bool) -> Prepared:
        from lcx.attention import AttentionSpec, Rotary, attention

        B, H, Hkv, D = (2, 4, 2, 64) if tiny else (4, 32, 8, 128)
        G, L = (4, 32) if tiny else (G_LAMBDA, L_LAMBDA)
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        if impl == "sdpa_full_cache":  # vanilla decode over the whole (rotated) cache
            T = 300 if tiny else full_len
            nbytes = 2 * B * T * Hkv * D * 2 + 2 * B * H * D * 2
            m = _n_buffers(nbytes, device)
            qs = _randn((B, H, 1, D), dt, device, m)
            ks = _randn((B, Hkv, T, D), dt, device, m, seed=1)
            call, native = _sdpa_call(qs[0], ks[0], ks[0], causal=False, device=device)
            if not native:  # the repeated heads are read too: bytes as a dense cache
                ks = [x.repeat_interleave(H // Hkv, dim=1) for x in ks]
                call, _ = _sdpa_call(qs[0], ks[0], ks[0], causal=False, device=device)
                nbytes = 2 * B * T * H * D * 2 + 2 * B * H * D * 2
            run = lambda i: call(qs[i % m], ks[i % m], ks[i % m])  # noqa: E731
            return Prepared(run, m, nbytes, 4.0 * B * H * T * D, dict(B=B, Tk=T, H=H, Hkv=Hkv, D=D, gqa_native=native))
        Tk = G + L
        spec = AttentionSpec.lm_infinite(n_global=G, n_local=L)
        pos = torch.cat((torch.arange(G), torch.arange(10**6 - L + 1, 10**6 + 1))).to(device)
        rot = Rotary(_rope(D).to(device), pos)
        half = rot.inv_freq.numel()
        nbytes = 2 * B * Tk * Hkv * D * 2 + 2 * Tk * half * 4 + 2 * B * H * D * 2  # k, v, tables, q, out
        m = _n_buffers(nbytes, device)
        qs = _randn((B, 1, H, D), dt, device, m)
        ks = _randn((B, Tk, Hkv, D), dt, device, m, seed=1)
        vs = _randn((B, Tk, Hkv, D), dt, device, m, seed=2)
        shape = dict(B=B, Tk=Tk, H=H, Hkv=Hkv, D=D, G=G, L=L)
        flops = 4.0 * B * H * Tk * D
        if impl == "cuda":
            _need_cuda(device, "the CUDA extension")
            from lcx.attention.cuda_backend import decode_keys
            from lcx.kernels.cuda.lambda_decode import decode_tables, lambda_decode_cuda

            tabs = decode_tables(rot.inv_freq, pos, Tk - 1, spec.lambda_params.effective_limit(Tk))
            keys = decode_keys(spec, Tk, Tk - 1)
            run = lambda i: lambda_decode_cuda(qs[i % m], ks[i % m], vs[i % m], keys=keys, scale=D**-0.5, tables=tabs)  # noqa: E731
            return Prepared(run, m, nbytes, flops, shape)
        backend = {"cuda_backend": "cuda", "triton_backend": "triton", "blockwise": "blockwise"}[impl]
        if backend == "cuda":
            _need_cuda(device, "the CUDA extension")
        elif backend == "triton":
            _need_triton(device)
        run = lambda i: attention(qs[i % m], ks[i % m], vs[i % m], spec, backend=backend, rotary=rot)  # noqa: E731
        return Prepared(run, m, nbytes, flops, shape)

    return setup


# --- SWAT: sigmoid, window w, balanced ALiBi; forward + backward
def _swat(impl: str, T: int):
    def setup(device: str, tiny: bool) -> Prepared:
        from lcx.attention import AttentionSpec, attention

        B, H, D, W = (1, 2, 32, 16) if tiny else (1, 16, 128, 512)
        n = 64 if tiny else T
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        spec = AttentionSpec.swat(window=W, n_heads=H)
        nbytes = 2 * 4 * B * n * H * D * 2  # fwd: q, k, v, out; bwd: the same again plus grads (approx. x2)
        m = _n_buffers(nbytes, device)
        layout = (B, H, n, D) if impl == "flex_attention" else (B, n, H, D)
        qkv = [[t.requires_grad_() for t in _randn(layout, dt, device, 3, seed=s)] for s in range(m)]
        grad = _randn(layout, dt, device, 1, seed=99)[0]
        if impl == "flex_attention":
            # torch's flex_attention itself, compiled, block mask built once (not per call as the
            # lcx "flex_compiled" backend does): sigmoid as logsigmoid score_mod + o = o_softmax * Z
            _need_cuda(device, "compiled flex_attention backward")
            from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

            block_mask = create_block_mask(spec.mask, None, None, n, n, device=device)
            slopes = torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=device)

            def score_mod(score, b, h, q_idx, kv_idx):
                return torch.nn.functional.logsigmoid(score - slopes[h] * (q_idx - kv_idx).abs())

            flex = torch.compile(flex_attention, dynamic=False)

            def run(i):
                q, k, v = qkv[i % m]  # [B, H, n, D]
                o, aux = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, return_aux=AuxRequest(lse=True))
                out = o * aux.lse.exp().unsqueeze(-1).to(o.dtype)
                return torch.autograd.grad(out, (q, k, v), grad)
        else:
            backend = {"triton": "triton", "flex_compiled": "flex_compiled", "blockwise": "blockwise"}[impl]
            if backend == "triton":
                _need_triton(device)
            elif backend == "flex_compiled":
                _need_cuda(device, "compiled flex_attention backward")

            def run(i):
                q, k, v = qkv[i % m]  # [B, n, H, D]
                out = attention(q, k, v, spec, backend=backend)
                return torch.autograd.grad(out, (q, k, v), grad)

        visible = min(n, W)
        flops = 14.0 * B * H * n * visible * D  # fwd 4 (QK^T, PV) + bwd 10 (recompute S, dP, dV, dQ, dK)
        return Prepared(run, m, nbytes, flops, dict(B=B, T=n, H=H, D=D, window=W))

    return setup


def _faster_than_baseline(what: str):
    def goal(row: dict, rows: dict) -> dict | None:
        base = rows.get(row.get("baseline", ""), {})
        if "median_ms" not in row or "median_ms" not in base:
            return None
        speedup = base["median_ms"] / row["median_ms"]
        return {"what": what, "target": 1.0, "value": round(speedup, 3), "met": speedup > 1.0}

    return goal


def _bandwidth_goal(row: dict, rows: dict) -> dict | None:
    if row.get("pct_bandwidth") is None:
        return None
    return {"what": ">= 70% of measured copy bandwidth", "target": 70.0, "value": row["pct_bandwidth"],
            "met": row["pct_bandwidth"] >= 70.0}


# --- fused RoPE: y = x cos + J(x) sin
def _rope_case(impl: str):
    def setup(device: str, tiny: bool) -> Prepared:
        from lcx.rope import apply_rotary_ref, rope_cos_sin

        B, T, H, D = (1, 64, 2, 32) if tiny else (1, 32768, 32, 128)
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        if impl == "triton":
            _need_triton(device)
            from lcx.kernels.triton.rope import apply_rotary_triton as fn
        else:
            fn = apply_rotary_ref
        cos, sin = rope_cos_sin(torch.arange(T, device=device), _rope(D).to(device), 1.0, torch.float32)
        nbytes = 2 * B * T * H * D * 2 + 2 * T * D * 4
        m = _n_buffers(nbytes, device)
        xs = _randn((B, T, H, D), dt, device, m)
        return Prepared(lambda i: fn(xs[i % m], cos, sin), m, nbytes, 3.0 * B * T * H * D,
                        dict(B=B, T=T, H=H, D=D))

    return setup


def _build_cases() -> list[Case]:
    # cheap bandwidth-bound cases first, long compiles (flex) and the 128k prefill last, so a run
    # cut off by a time limit keeps the most rows
    cases = [
        Case("rerotate", "triton", "32k", _rerotate("triton"), goal=_bandwidth_goal),
        Case("rerotate", "cuda", "32k", _rerotate("cuda"), goal=_bandwidth_goal),
        Case("rerotate", "ref", "32k", _rerotate("ref"), cpu=True),
        Case("rope", "ref", "32k", _rope_case("ref"), cpu=True),
        Case("rope", "triton", "32k", _rope_case("triton"), baseline="rope/ref/32k", goal=_bandwidth_goal),
        Case("lambda_decode", "sdpa_full_cache", "32k", _decode("sdpa_full_cache", 32768), cpu=True),
        Case("lambda_decode", "sdpa_full_cache", "128k", _decode("sdpa_full_cache", 131072)),
    ]
    for impl in ("cuda", "cuda_backend", "triton_backend"):
        cases.append(Case("lambda_decode", impl, "G64+L4096", _decode(impl),
                          baseline="lambda_decode/sdpa_full_cache/32k",
                          goal=_bandwidth_goal if impl == "cuda" else None))
    cases.append(Case("lambda_decode", "blockwise", "G64+L4096", _decode("blockwise"),
                      baseline="lambda_decode/sdpa_full_cache/32k", cpu=True))
    for n, label in ((8192, "8k"), (32768, "32k"), (131072, "128k")):
        base = f"lambda_prefill/sdpa_flash_causal/{label}"
        cases += [
            Case("lambda_prefill", "sdpa_flash_causal", label, _prefill("sdpa_flash_causal", n), cpu=label == "8k"),
            Case("lambda_prefill", "triton", label, _prefill("triton", n), baseline=base, goal=_prefill_goal),
        ]
    for T, label in ((8192, "8k"), (32768, "32k")):
        base = f"swat/flex_attention/{label}"
        cases += [
            Case("swat", "flex_attention", label, _swat("flex_attention", T)),
            Case("swat", "flex_compiled", label, _swat("flex_compiled", T), baseline=base),
            Case("swat", "triton", label, _swat("triton", T), baseline=base,
                 goal=_faster_than_baseline("fwd+bwd faster than flex_attention with the same masks")),
        ]
    return cases


CASES: list[Case] = _build_cases()


# ----------------------------------------------------------------------------- timing
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


DO_BENCH_MIN_MS = 100.0  # do_bench's time budget at the least (its default `rep`)


def time_case(prep: Prepared, device: str, *, warmup: int, repeats: int,
              do_bench: Callable[..., Any] | None = None) -> list[float]:
    """Milliseconds of the timed calls, after `warmup` calls: on CUDA through
    `triton.testing.do_bench` (module docstring), on the CPU the wall clock of `repeats` calls.
    `do_bench` stands in for triton's (tests drive the CUDA path's logic on the CPU with it)."""
    for i in range(warmup):
        prep.run(i)
    _sync(device)
    if device == "cuda" or do_bench is not None:
        if do_bench is None:
            from triton.testing import do_bench  # triton comes with torch's CUDA builds
        return _time_do_bench(prep, do_bench, warmup=warmup, repeats=repeats)
    times = []
    for i in range(warmup, warmup + repeats):
        t0 = time.perf_counter()
        prep.run(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _time_do_bench(prep: Prepared, do_bench: Callable[..., Any], *, warmup: int, repeats: int) -> list[float]:
    """do_bench counts in milliseconds, this benchmark in calls: a probe (do_bench's one timed call)
    gives a call's time t, then the budget is max(100 ms, (repeats + 1) t), i.e. about `repeats`
    calls for slow kernels and more for fast ones. Each call takes the next input buffer."""
    calls = iter(range(warmup, 1 << 62))

    def fn() -> Any:
        return prep.run(next(calls))

    t = float(do_bench(fn, warmup=0, rep=0, return_mode="median"))
    times = do_bench(fn, warmup=0, rep=max(DO_BENCH_MIN_MS, (repeats + 1) * t), return_mode="all")
    return [float(x) for x in times]


def measure_ceilings(device: str, *, tiny: bool = False) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write counted) and bf16 matmul TFLOP/s, medians of 10."""
    n = 2**20 if tiny else 2**28  # 1 GiB of float32 on the GPU
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy = Prepared(lambda i: dst.copy_(src), 1, 2.0 * n * 4, 0.0)
    t_copy = statistics.median(time_case(copy, device, warmup=3, repeats=10))
    s = 256 if tiny else 8192
    mm_dt = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(s, s, device=device).to(mm_dt) for _ in range(2))
    mm = Prepared(lambda i: a @ b, 1, 0.0, 2.0 * s**3)
    t_mm = statistics.median(time_case(mm, device, warmup=3, repeats=10))
    return {"copy_GBps": round(copy.bytes / t_copy / 1e6, 1), "matmul_TFLOPs": round(mm.flops / t_mm / 1e9, 2),
            "matmul_dtype": str(mm_dt).removeprefix("torch.")}


def _row(case: Case, prep: Prepared, times: list[float], ceilings: dict[str, float]) -> dict:
    med = statistics.median(times)
    row: dict[str, Any] = {
        "group": case.group, "impl": case.impl, "size": case.size, "shape": prep.shape,
        "median_ms": round(med, 5), "min_ms": round(min(times), 5), "times_ms": [round(t, 5) for t in times],
        "n_buffers": prep.n_buffers, "bytes": prep.bytes, "flops": prep.flops,
        "GBps": round(prep.bytes / med / 1e6, 1), "TFLOPs": round(prep.flops / med / 1e9, 3),
    }
    row["pct_bandwidth"] = round(100 * row["GBps"] / ceilings["copy_GBps"], 1) if ceilings.get("copy_GBps") else None
    row["pct_matmul"] = round(100 * row["TFLOPs"] / ceilings["matmul_TFLOPs"], 1) if ceilings.get("matmul_TFLOPs") else None
    if case.baseline:
        row["baseline"] = case.baseline
    return row


# ----------------------------------------------------------------------------- run + JSON
def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (the baseline file's name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


def versions() -> dict[str, Any]:
    """`lcx.data.io.environment()` plus triton and CUDA versions; degrades to the essentials on
    a machine without transformers/tokenizers (GPU machines may have only torch + triton)."""
    import platform

    from lcx.data.io import environment, git_info

    try:
        env = environment()
    except ImportError as e:
        env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
               "git": git_info(), "note": f"partial environment ({e})"}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        env["triton"] = f"unavailable ({type(e).__name__})"
    env["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env


def select(cases: list[Case], only: list[str] | None, device: str) -> list[Case]:
    out = [c for c in cases if device == "cuda" or c.cpu]
    if only:
        out = [c for c in out if any(p in c.name for p in only)]
    return out


def run_cases(cases: list[Case], device: str, *, warmup: int, repeats: int, progress: bool = True,
              checkpoint: Callable[[dict], Any] | None = None) -> dict:
    """Time `cases` on `device`; returns the result dict (see the module docstring).

    `checkpoint(partial_result)` is called after every case (`"complete": false` until the
    last), so a run cut off by a time limit still leaves the cases it finished.
    """
    tiny = device == "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA GPU here (torch.cuda.is_available() is False); "
                         "use --device cpu for the CPU smoke configuration")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    ceilings = measure_ceilings(device, tiny=tiny)
    env = versions()
    timing = ("triton.testing.do_bench (L2 flushed per call)" if device == "cuda"
              else "wall_clock (CPU smoke, tiny shapes)")
    rows: dict[str, dict] = {}

    def assemble(complete: bool) -> dict:
        for case in cases:
            row = rows.get(case.name, {})
            if case.goal is not None and "median_ms" in row:
                goal = case.goal(row, rows)
                if goal is not None:
                    row["goal"] = goal
        return {
            "schema": SCHEMA,
            "gpu": name,
            "gpu_slug": gpu_slug(name),
            "device": device,
            "smoke": device != "cuda",
            "complete": complete,
            "timing": timing,
            "config": {"warmup": warmup, "repeats": repeats, "statistic": "median",
                       "input_rotation": "buffers until > 4 x L2", "threshold": THRESHOLD},
            "environment": env,
            "ceilings": ceilings,
            "kernels": rows,
        }

    bar = _progress(cases, desc="kernels", unit="case", enabled=progress)
    for case in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(case.name)
        try:
            prep = case.setup(device, tiny)
            times = time_case(prep, device, warmup=warmup, repeats=repeats)
            rows[case.name] = _row(case, prep, times, ceilings)
        except Skip as e:
            rows[case.name] = {"group": case.group, "impl": case.impl, "size": case.size, "skipped": str(e)}
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run this shape is a recorded skip
            msg = str(e).splitlines()[0][:300] if str(e) else ""
            rows[case.name] = {"group": case.group, "impl": case.impl, "size": case.size,
                               "skipped": f"{type(e).__name__}: {msg}"}
        finally:
            prep = None  # free this case's buffers before the next one allocates
            if device == "cuda":
                torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(assemble(False))
    return assemble(True)


def validate(result: dict) -> None:
    """Raise ValueError naming the first field a result JSON lacks or has wrong."""
    for key, typ in (("schema", str), ("gpu", str), ("device", str), ("smoke", bool), ("kernels", dict),
                     ("environment", dict), ("ceilings", dict), ("config", dict)):
        if not isinstance(result.get(key), typ):
            raise ValueError(f"kernel benchmark result: {key!r} missing or not {typ.__name__}")
    if result["schema"] != SCHEMA:
        raise ValueError(f"kernel benchmark result: schema {result['schema']!r}, expected {SCHEMA!r}")
    for name, row in result["kernels"].items():
        if "skipped" in row:
            continue
        for key in ("median_ms", "bytes", "flops", "GBps", "TFLOPs", "times_ms"):
            if key not in row:
                raise ValueError(f"kernel benchmark result: kernel {name!r} lacks {key!r}")
        if not (isinstance(row["median_ms"], (int, float)) and row["median_ms"] > 0):
            raise ValueError(f"kernel benchmark result: kernel {name!r} has median_ms={row['median_ms']!r}")


@dataclass(frozen=True)
class Comparison:
    regressions: list[tuple[str, float, float]]  # (kernel, baseline ms, new ms)
    missing: list[str]  # timed in the baseline, absent or skipped now
    new: list[str]  # timed now, not in the baseline
    compared: int

    @property
    def ok(self) -> bool:
        return not self.regressions and not self.missing

    def report(self, threshold: float = THRESHOLD) -> str:
        lines = [f"compared {self.compared} kernels against the baseline (fail: > {threshold:.0%} slower)"]
        lines += [f"REGRESSION {k}: {b:.4g} ms -> {n:.4g} ms (+{100 * (n / b - 1):.1f}%)" for k, b, n in self.regressions]
        lines += [f"MISSING {k}: timed in the baseline, not in this run" for k in self.missing]
        lines += [f"new {k} (no baseline)" for k in self.new]
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def compare(new: dict, baseline: dict, threshold: float = THRESHOLD) -> Comparison:
    """Kernels more than `threshold` slower (median) than in `baseline`, and those gone missing.

    Refuses (ValueError) runs of different GPUs and CPU smoke runs.
    """
    validate(new)
    validate(baseline)
    for which, r in (("new run", new), ("baseline", baseline)):
        if r["smoke"]:
            raise ValueError(f"the {which} is a CPU smoke run, not a measurement to compare")
    if new["gpu"] != baseline["gpu"]:
        raise ValueError(f"baseline is from {baseline['gpu']!r}, this run from {new['gpu']!r}: "
                         "compare only runs of the same GPU")
    timed = lambda r: {k: v["median_ms"] for k, v in r["kernels"].items() if "median_ms" in v}  # noqa: E731
    tn, tb = timed(new), timed(baseline)
    regressions = [(k, tb[k], tn[k]) for k in sorted(tb) if k in tn and tn[k] > tb[k] * (1 + threshold)]
    missing = sorted(k for k in tb if k not in tn)
    return Comparison(regressions, missing, sorted(k for k in tn if k not in tb), len(set(tn) & set(tb)))


def _table(result: dict) -> str:
    lines = [f"{result['gpu']} ({result['timing']}); ceilings: copy {result['ceilings']['copy_GBps']} GB/s, "
             f"{result['ceilings']['matmul_dtype']} matmul {result['ceilings']['matmul_TFLOPs']} TFLOP/s"]
    lines.append(f"{'kernel':48s} {'median ms':>10s} {'GB/s':>8s} {'%bw':>6s} {'TFLOP/s':>8s} {'%mm':>6s}  goal")
    for name, r in result["kernels"].items():
        if "skipped" in r:
            lines.append(f"{name:48s} skipped: {r['skipped']}")
            continue
        g = r.get("goal")
        goal = "" if g is None else f"{'met' if g['met'] else 'NOT met'} ({g['value']} vs {g['target']})"
        lines.append(f"{name:48s} {r['median_ms']:10.4f} {r['GBps']:8.1f} {r['pct_bandwidth'] or 0:6.1f} "
                     f"{r['TFLOPs']:8.3f} {r['pct_matmul'] or 0:6.1f}  {goal}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(p)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): the benchmark; cpu: tiny smoke configuration, wall clock, never a baseline")
    p.add_argument("--only", nargs="+", metavar="PATTERN", help="run the cases whose name contains a pattern")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per case first (default 5)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per case; the median is kept (default 20)")
    p.add_argument("--check", nargs="?", const="", metavar="BASELINE",
                   help=f"compare with a baseline JSON (default results/kernels/<gpu>.json); exit 1 if a kernel "
                        f"is > {round(100 * THRESHOLD)}%% slower or missing")
    p.add_argument("--new", type=Path, metavar="RESULT",
                   help="with --check: compare this stored result instead of running the benchmark")
    p.add_argument("--list", action="store_true", help="list the cases and exit")


def _load(path: Path) -> dict:
    import json

    if not path.is_file():
        raise FileNotFoundError(f"no kernel benchmark result at {path}")
    return json.loads(path.read_text())


def run(args: argparse.Namespace) -> int:
    if args.list:
        for c in CASES:
            print(f"{c.name:48s} {'cpu-smoke ' if c.cpu else ''}{('vs ' + c.baseline) if c.baseline else ''}")
        return 0
    if args.new is not None and args.check is None:
        raise ValueError("--new compares a stored result: give --check too")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats}, {args.warmup}")
    if args.new is not None:
        result = _load(args.new)
    else:
        cases = select(CASES, args.only, args.device)
        if not cases:
            raise ValueError(f"no case matches --only {args.only} on {args.device}; see --list")
        if args.device == "cpu":
            torch.set_num_threads(1)
        out = args.out
        if out is None and args.device == "cuda" and torch.cuda.is_available():
            slug = gpu_slug(torch.cuda.get_device_name())
            out = RESULTS_DIR / f"{slug}{'.latest' if args.check is not None else ''}.json"
        rec = BENCH.start(args, out=out)  # the record is run_cases' own schema (stored baselines)
        result = run_cases(cases, args.device, warmup=args.warmup, repeats=args.repeats,
                           checkpoint=None if out is None else rec.write)
        print(_table(result))
        if out is not None:
            rec.write(result, quiet=False)
    if args.check is None:
        return 0
    base_path = Path(args.check) if args.check else RESULTS_DIR / f"{result.get('gpu_slug', 'cpu')}.json"
    cmp = compare(result, _load(base_path))
    print(cmp.report())
    return 0 if cmp.ok else 1


main = BENCH.command(add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
