"""`lcx bench sweep`: cells per hour of one `lcx report` sweep run serially, with `--jobs 2`, and on
Ray (`--ray`) with 1 and 2 local workers; and what Ray adds per cell.

    lcx bench sweep                                  # -> results/sweep_cpu.json (run from the repo root)
    lcx bench sweep --modes serial,ray1 --out /tmp/s.json

The sweep: tiny-ret-5m, 4 methods x 2 lengths of passkey + perplexity cells (8 cells, one torch
thread each; no decode cells: a timed cell runs alone, which would measure that barrier rather
than the executor). One cell is measured first, untimed, so that no mode pays this process's
one-time costs (imports, the tokenizer, the corpus). Every mode measures the whole sweep in a
fresh folder:

- `serial`: one cell after another in this process (`lcx report`);
- `jobs2`: `--jobs 2`, two spawned worker processes (`lcx.report.jobs`);
- `ray1`, `ray2`: `--ray` on a cluster started for the run on 127.0.0.1 with 1 or 2 CPUs
  (`lcx.report.ray_executor`), its start-up included.

Per mode (`--repeats` rounds over the modes, alternated, so that a neighbour's load falls on all
of them alike): the median wall seconds, cells per hour, the speed-up over serial (ideal with 2 workers: 2x on two
idle cores), and whether every number equals the serial run's (a faster executor with other
numbers is no win). Ray's start-up (a local cluster up and down, timed alone) and its overhead per
cell, measured per cell by the driver (`report.json.gz`'s `ray_cells`): from the task's submission
to its result, less the measurement's own seconds (the worker's start, the node's fingerprint
check, the journal seeded and streamed back); the median, the first cell's (a fresh worker imports
torch and lm-eval) and the largest; and, as a cross-check, (ray1's wall - start-up - serial's
wall) / cells. The load average at start and end is recorded: on a
machine shared with other jobs the scaling is capped by what the neighbours leave.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import Benchmark

DESCRIPTION = "cells per hour of a report sweep: serial, --jobs 2, Ray with 1 and 2 local workers; Ray's overhead per cell"
BENCH = Benchmark("sweep", DESCRIPTION, __doc__, out="results/sweep_cpu.json")
MODES = ("serial", "jobs2", "ray1", "ray2")
TIMINGS = {"wall_s", "prefill_s", "decode_s", "decode_cpu_s", "tokens_per_s", "threads", "resumed_requests"}


@dataclass(frozen=True)
class Config:
    model: str
    methods: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    ppl_docs: int
    modes: tuple[str, ...]
    repeats: int
    threads_per_cell: int = 1
    samples_per_depth: int = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(parser)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {', '.join(MODES)} (default: all; serial is always run first, "
                             "as the baseline)")
    parser.add_argument("--model", default="tiny-ret-5m", help="model preset or directory (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds over the modes, alternated; medians (default: %(default)s)")
    parser.add_argument("--samples-per-depth", type=int, default=1,
                        help="passkey keys per depth in every cell (3 depths): longer cells, so that start-up "
                             "costs weigh less against the cells (default: %(default)s)")
    parser.add_argument("--ppl-docs", type=int, default=1,
                        help="perplexity windows per cell (default: %(default)s)")


def _numbers(results: dict[str, Any]) -> Any:
    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in TIMINGS}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip(json.loads(json.dumps(results)))


def _ray_startup_s(cpus: int) -> float:
    """A local cluster up and down, as `--ray` starts one (seconds)."""
    from lcx.report.ray_executor import ray_session

    t0 = time.perf_counter()
    with ray_session(None, num_cpus=cpus):
        pass
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    from lcx.report import ReportConfig, run_report

    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes: expected a subset of {list(MODES)}, got {args.modes!r}")
    modes = ("serial",) + tuple(m for m in modes if m != "serial")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    for flag in ("samples_per_depth", "ppl_docs"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    config = Config(model=args.model, methods=("vanilla", "yarn", "lm_infinite", "ntk"), lengths=(1024, 2048),
                    depths=(0.2, 0.5, 0.8), ppl_docs=args.ppl_docs, modes=modes, repeats=args.repeats,
                    samples_per_depth=args.samples_per_depth)
    cfg = ReportConfig(model=config.model, methods=config.methods, lengths=config.lengths, decode_lengths=(),
                       depths=config.depths, samples_per_depth=config.samples_per_depth, ppl_docs=config.ppl_docs,
                       tasks=("passkey", "ppl"))
    import torch

    torch.set_num_threads(config.threads_per_cell)  # the serial mode's cells run here: as many threads as a worker's
    rec = BENCH.start(args, config, environment={"load_average_start": list(os.getloadavg())})
    rows: dict[str, Any] = {}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    over: dict[str, list[float]] = {m: [] for m in modes}
    first: dict[str, list[float]] = {m: [] for m in modes}
    base_numbers = None
    with tempfile.TemporaryDirectory(prefix="lcx-bench-sweep-") as tmp:
        # untimed: one cell in this process first, so that the serial row does not pay the one-time
        # costs (imports of lm-eval and transformers, the tokenizer, the corpus, a kernel build)
        run_report(dataclasses.replace(cfg, methods=cfg.methods[:1], lengths=cfg.lengths[:1]), Path(tmp) / "warm-up",
                   progress=False, log=lambda s: None)
        # rounds alternate the modes, so that a neighbour's load falls on all of them alike; medians
        for r, mode in rec.progress([(r, m) for r in range(args.repeats) for m in modes], unit="sweep"):
            kw: dict[str, Any] = {"jobs": 1, "job_threads": 1}
            if mode == "jobs2":
                kw = {"jobs": 2, "job_threads": 1}
            elif mode.startswith("ray"):
                kw = {"ray": True, "ray_cpus": int(mode[3:]), "jobs": None, "job_threads": 1}
            t0 = time.perf_counter()
            out = run_report(cfg, Path(tmp) / f"{mode}-{r}", progress=False, log=lambda s: None, **kw)
            walls[mode].append(time.perf_counter() - t0)
            numbers = _numbers(out["results"])
            base_numbers = numbers if base_numbers is None else base_numbers
            if out.get("ray_cells"):
                cell_over = [c["overhead_s"] for c in out["ray_cells"].values()]
                over[mode] += cell_over
                first[mode].append(cell_over[0])
            cells = out["cells_total"] - out["cells_reused"]
            wall = statistics.median(walls[mode])
            row = rows.setdefault(mode, {"cells": cells, "failed": [], "numbers_equal_serial": True})
            row.update(wall_s=round(wall, 2), walls_s=[round(w, 2) for w in walls[mode]],
                       cells_per_hour=round(3600 * cells / wall, 1))
            row["failed"] = sorted(set(row["failed"]) | set(out.get("cells_failed", {})))
            row["numbers_equal_serial"] = row["numbers_equal_serial"] and numbers == base_numbers
            if over[mode]:
                row["overhead_per_cell_s"] = {"median": round(statistics.median(over[mode]), 3),
                                              "max": round(max(over[mode]), 3),
                                              "first_cell_median": round(statistics.median(first[mode]), 3)}
            if "serial" in rows and mode != "serial":
                row["speedup_vs_serial"] = round(rows["serial"]["wall_s"] / wall, 3)
            rec.log(f"round {r + 1} {mode:6s} {time.perf_counter() - t0:.1f} s; median so far {row}")
            rec.save(rows)
    for mode, row in rows.items():  # the serial median moved after the other modes' rows were written
        if mode != "serial":
            row["speedup_vs_serial"] = round(rows["serial"]["wall_s"] / row["wall_s"], 3)
    if "ray1" in rows:
        start = _ray_startup_s(1)
        rows["ray_overhead"] = {"startup_s": round(start, 2),
                                "per_cell_s": rows["ray1"]["overhead_per_cell_s"],
                                "per_cell_s_from_walls": round((rows["ray1"]["wall_s"] - start - rows["serial"]["wall_s"])
                                                               / rows["serial"]["cells"], 2)}
        rec.log(f"ray overhead: {rows['ray_overhead']}")
    rec.environment["load_average_end"] = list(os.getloadavg())
    rec.finish(rows)
    bad_numbers = [m for m, r in rows.items() if r.get("numbers_equal_serial") is False or r.get("failed")]
    if bad_numbers:
        print(f"lcx bench sweep: {', '.join(bad_numbers)} measured other numbers than serial, or failed cells",
              file=sys.stderr)
        return 1
    return 0


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
