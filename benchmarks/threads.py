"""`lcx bench threads`: which torch thread count is fastest on this machine, idle and under load.

    lcx bench threads                          # -> results/threads_cpu.json (run from the repo root)
    lcx bench threads --out /tmp/t.json --repeats 3

For each load condition — `idle`, and `busy` (one extra process spinning 1-thread matmuls, i.e.
one core taken by a neighbour, the usual state of a shared 2-core machine) — and each thread
count (1, every available core, and lcx's `auto`), it times through `lcx.engine.Engine` (the
engine `lcx serve` and the report's decode cells run) on the bundled tiny-5m:

- decode: one request, 32 prompt tokens, 64 greedy new tokens -> tokens/s;
- batched decode: 8 requests of the same shape together -> tokens/s;
- prefill: 4 prompts of 240 tokens, 1 new token -> prompt tokens/s.

Medians over `--repeats` runs; ratios are against 1 thread under the same load in the same run.
The thread count under test is set in-process (`torch.set_num_threads`); the `auto` row is
what `lcx.threads.resolve_threads("auto")` picks under that load, measured afresh.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness import Benchmark

DESCRIPTION = "which torch thread count is fastest on this machine, idle and under load"
BENCH = Benchmark("threads", DESCRIPTION, __doc__, out="results/threads_cpu.json",
                  record_description="torch thread count vs throughput of lcx's engine (tiny model), idle and "
                                     "with one core busy")
SHAPES = {"decode_tok_s": (1, 32, 64), "batched_decode_tok_s": (8, 32, 64), "prefill_tok_s": (4, 240, 1)}


@dataclass(frozen=True)
class Config:
    model: str
    repeats: int
    cores: int
    shapes: dict[str, str] = field(default_factory=lambda: {
        "decode": "1 x (32 prompt + 64 new)", "batched_decode": "8 x (32 + 64)", "prefill": "4 x 240 prompt tokens"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the median is kept (default 3)")
    parser.add_argument("--model", default="tiny-5m", help="model preset or directory (default: %(default)s)")


def _spin(stop: Any) -> None:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def _time_engine(engine: Any, batch: int, prompt_len: int, new_tokens: int) -> float:
    from lcx.engine import SamplingParams

    prompts = [[(7 * i + 3 * j) % 200 + 10 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - t0


def _cases(engine: Any, repeats: int) -> dict[str, float]:
    out = {}
    for name, (b, p, n) in SHAPES.items():
        _time_engine(engine, b, p, min(n, 4))  # warm-up
        t = statistics.median(_time_engine(engine, b, p, n) for _ in range(repeats))
        out[name] = round((b * (n if n > 1 else p)) / t, 1)
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    import lcx.threads as th
    from lcx.engine import Engine

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    cores = th.available_cores()
    rec = BENCH.start(args, Config(model=args.model, repeats=args.repeats, cores=cores))
    engine = Engine.from_pretrained(args.model)
    rows: dict[str, Any] = {}
    for load in rec.progress(("idle", "busy"), unit="load"):
        stop, proc = None, None
        if load == "busy":
            stop = mp.Event()
            proc = mp.get_context("fork").Process(target=_spin, args=(stop,), daemon=True)
            proc.start()
            time.sleep(0.5)
        try:
            auto = th.auto_threads(refresh=True)  # what auto picks under this load
            res: dict[str, Any] = {"auto_choice": auto}
            for n in sorted({1, cores}):
                torch.set_num_threads(n)
                res[f"threads_{n}"] = _cases(engine, args.repeats)
                rec.log(f"{load:5s} threads={n}: {res[f'threads_{n}']}")
            base = res["threads_1"]
            res["ratio_vs_1_thread"] = {f"threads_{n}": {k: round(res[f"threads_{n}"][k] / base[k], 3) for k in base}
                                        for n in sorted({1, cores})}
            rows[load] = res
        finally:
            if proc is not None:
                stop.set()
                proc.join(timeout=5)
    rec.finish(rows)
    return 0


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
