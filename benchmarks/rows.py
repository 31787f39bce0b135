"""`lcx bench rows`: the attention paths of a model as loaded, per row of a prefill, on the CPU.

    lcx bench rows                                   # -> results/loaded_rows_cpu.json
    lcx bench rows --heads 9/3 --shapes 544/544,32/544 --rounds 3 --out /tmp/r.json

When lcx's engine prefills (or continues after a prefix-cache hit) a model as loaded, each group
of rows with the same numbers of new queries nq and keys n runs one of these paths
(`lcx.hf.attention_call.attend_loaded_rows`): `cpp` where it builds, else one picked by nq, with
limits measured here:

- `fused`:   torch's fused CPU kernel (`scaled_dot_product_attention(is_causal=True)`; nq = n only);
- `flash`:   lcx's flash backend, an unmasked pass over the held keys and a causal one over the
             new tokens, merged by their log-sum-exp (`lcx.attention`; the path above the others' limits);
- `masked`:  torch's SDPA with the rows' [nq, n] mask (`MASKED_SDPA_MAX_QUERIES`);
- `blocks`:  `block_causal`, two matmuls per block of 64 queries up to the block's diagonal
             (`BLOCK_CAUSAL_QUERIES`);
- `cpp`:     lcx's C++ kernel (`lcx.kernels.cpu.causal_attention`, flash-style blocks of 64 keys,
             AVX-512 register tiles), which every float32 CPU row runs where it builds
             (`native_rows`); the paths above are the fallback without it.

Every shape `nq/n` runs every path that applies, in `--rounds` interleaved rounds (the best of
each round's `--repeats` calls, then the median over rounds), float32, one thread; ratios are
against `fused` where nq = n, else `masked`; GFLOP/s counts the causal part only (the work a
path must do); `max_err` is each path's largest deviation from a float64 reference.

`--decode B/C`: the engine's decode step (`lcx.engine.decode_step.decode_attention`, one query per
row over a slot store of C slots, the last eighth invisible), its matmul path against the C++
kernel, rows with `decode_rows` in the record.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from benchmarks.harness import Benchmark

DESCRIPTION = "the attention paths of a model as loaded per prefill row (fused, flash, masked, blocks, cpp) -> ratios"
BENCH = Benchmark("rows", DESCRIPTION, __doc__, out="results/loaded_rows_cpu.json", threads="1",
                  record_description="per-row attention paths of lcx's engine for a model as loaded, CPU, "
                                     "float32: time per call, causal GFLOP/s, ratio to torch's fused kernel")
SHAPES = "1/544,1/2048,32/32,128/128,256/256,544/544,1024/1024,2048/2048,32/544,128/2048,512/2048"
HEADS = "9/3,4/2"
DECODE = "1/544,32/544,32/2048"


@dataclass(frozen=True)
class Config:
    heads: list[str]
    shapes: list[str]
    decode: list[str]
    head_dim: int
    rounds: int
    repeats: int


def _pairs(text: str, what: str, *, ordered: bool) -> list[tuple[int, int]]:
    """'a/b,c/d' -> [(a, b), (c, d)], every number >= 1 (`ordered`: a <= b)."""
    out = []
    for part in text.split(","):
        try:
            a, b = (int(x) for x in part.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: {part!r} is not two integers a/b") from None
        if min(a, b) < 1 or (ordered and b < a):
            raise argparse.ArgumentTypeError(f"{what}: {part!r} needs 1 <= a{' <= b' if ordered else ' and b >= 1'}")
        out.append((a, b))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(parser)
    parser.add_argument("--heads", default=HEADS, type=lambda t: _pairs(t, "--heads", ordered=False),
                        help="query/kv heads, comma-separated (default: %(default)s: SmolLM2-135M, tiny-5m)")
    parser.add_argument("--shapes", default=SHAPES, type=lambda t: _pairs(t, "--shapes", ordered=True),
                        help="new queries/keys per row nq/n, comma-separated (default: %(default)s)")
    parser.add_argument("--decode", default=DECODE, type=lambda t: _pairs(t, "--decode", ordered=False),
                        help="decode steps rows/slots B/C, comma-separated: the engine's decode step over a slot "
                             "store, its matmul path against the C++ kernel (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is kept (default: 3)")
    parser.add_argument("--repeats", type=int, default=3, help="calls per path per round; the best is kept (default: 3)")


def paths(nq: int, n: int) -> dict[str, Callable[..., Any]]:
    """The paths that run a row of nq new queries over n keys: name -> f(q, k, v) with q
    `[1, nq, H, D]`, k/v `[1, n, Hkv, D]` -> `[1, nq, H, D]`."""
    import torch.nn.functional as F

    from lcx.attention import AttentionSpec, attention, backend_for
    from lcx.hf.attention_call import _masked_sdpa, block_causal
    from lcx.masks import causal_mask

    spec = AttentionSpec(mask=causal_mask)
    flash = backend_for("flash", spec)
    out = {}
    if nq == n:
        out["fused"] = lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    out["flash"] = lambda q, k, v: attention(q, k, v, spec, backend=flash)
    out["masked"] = lambda q, k, v: _masked_sdpa(q, k, v, None, None)
    out["blocks"] = lambda q, k, v: block_causal(q, k, v, None)
    from lcx.kernels.cpu.causal_attention import causal_attention_cpu, unavailable

    if unavailable() is None:
        out["cpp"] = lambda q, k, v: causal_attention_cpu(q, k, v)
    return out


def _best(f: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(H: int, Hkv: int, nq: int, n: int, D: int, rounds: int, repeats: int) -> dict[str, Any]:
    import torch

    from lcx.hf.attention_call import _masked_sdpa

    g = torch.Generator().manual_seed(nq * 7919 + n)
    q, k, v = (torch.randn(1, t, h, D, generator=g) for t, h in ((nq, H), (n, Hkv), (n, Hkv)))
    ref = _masked_sdpa(q.double(), k.double(), v.double(), None, None)
    fns = paths(nq, n)
    err = {name: float((f(q, k, v) - ref).abs().max()) for name, f in fns.items()}  # (also a warm-up)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            times[name].append(_best(lambda: f(q, k, v), repeats))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    flop = 4 * nq * (n - (nq - 1) / 2) * D * H  # the causal part: QK^T and PV
    base = "fused" if "fused" in ms else "masked"
    return {"heads": f"{H}/{Hkv}", "nq": nq, "n": n, "ms": {k: round(t, 3) for k, t in ms.items()},
            "gflop_s": {k: round(flop / t / 1e6, 1) for k, t in ms.items()},
            "ratio_vs": base, "ratio": {k: round(ms[base] / t, 3) for k, t in ms.items()},
            "fastest": min(ms, key=ms.get), "max_err": {k: float(f"{e:.2e}") for k, e in err.items()}}


def measure_decode(H: int, Hkv: int, B: int, C: int, D: int, rounds: int, repeats: int) -> dict[str, Any] | None:
    """The engine's decode step (`lcx.engine.decode_step.decode_attention`) over a slot store of C
    slots, the last eighth invisible: its matmul path (`LCX_NATIVE_ROWS=0`) against the C++
    kernel; None where the kernel does not build."""
    import os

    import torch

    from lcx.engine.decode_step import decode_attention
    from lcx.kernels.cpu.causal_attention import decode_attention_cpu, unavailable

    if unavailable() is not None:
        return None
    g = torch.Generator().manual_seed(B * 7919 + C)
    q = torch.randn(B, 1, H, D, generator=g)
    k, v = (torch.randn(B, Hkv, C, D, generator=g) for _ in range(2))
    visible = torch.ones(B, C, dtype=torch.bool)
    visible[:, C - C // 8:] = False

    def matmul():
        old = os.environ.get("LCX_NATIVE_ROWS")
        os.environ["LCX_NATIVE_ROWS"] = "0"
        try:
            return decode_attention(q, k, v, visible)
        finally:
            os.environ.pop("LCX_NATIVE_ROWS") if old is None else os.environ.__setitem__("LCX_NATIVE_ROWS", old)

    fns = {"matmul": matmul, "cpp": lambda: decode_attention_cpu(q, k, v, visible)}
    ref = decode_attention(q.double(), k.double(), v.double(), visible)
    err = {name: float((f() - ref).abs().max()) for name, f in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            times[name].append(_best(f, repeats))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"heads": f"{H}/{Hkv}", "decode_rows": B, "slots": C, "visible": C - C // 8,
            "ms": {k: round(t, 3) for k, t in ms.items()}, "ratio_vs": "matmul",
            "ratio": {k: round(ms["matmul"] / t, 3) for k, t in ms.items()},
            "max_err": {k: float(f"{e:.2e}") for k, e in err.items()}}


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.repeats < 1:
        raise ValueError("--rounds and --repeats must be >= 1")
    for H, Hkv in args.heads:
        if H % Hkv:
            raise ValueError(f"--heads {H}/{Hkv}: query heads must be a multiple of kv heads")
    BENCH.resolve_threads(args)
    cfg = Config(heads=[f"{a}/{b}" for a, b in args.heads], shapes=[f"{a}/{b}" for a, b in args.shapes],
                 decode=[f"{a}/{b}" for a, b in args.decode], head_dim=args.head_dim, rounds=args.rounds,
                 repeats=args.repeats)
    rec = BENCH.start(args, cfg)
    rows = []
    cases = [(H, Hkv, nq, n) for H, Hkv in args.heads for nq, n in args.shapes]
    for H, Hkv, nq, n in rec.progress(cases, unit="shape"):
        r = measure(H, Hkv, nq, n, args.head_dim, args.rounds, args.repeats)
        rows.append(r)
        rec.log(f"{H}/{Hkv} {nq:>5}/{n:<5} " + "  ".join(f"{k} {t:.2f} ms ({r['ratio'][k]:.2f}x)"
                                                          for k, t in r["ms"].items()))
        rec.save(rows)
    for H, Hkv, B, C in [(H, Hkv, B, C) for H, Hkv in args.heads for B, C in args.decode]:
        r = measure_decode(H, Hkv, B, C, args.head_dim, args.rounds, args.repeats)
        if r is None:
            continue
        rows.append(r)
        rec.log(f"{H}/{Hkv} decode {B:>3} rows x {C:<5} slots " + "  ".join(
            f"{k} {t:.2f} ms ({r['ratio'][k]:.2f}x)" for k, t in r["ms"].items()))
        rec.save(rows)
    rec.finish(rows)
    return 0


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
