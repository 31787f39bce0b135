"""`lcx bench kernels`: time every GPU kernel against its baseline; roofline; regression check.

    lcx bench kernels                       # GPU: run all cases, write results/kernels/<gpu>.json
    lcx bench kernels --check               # run, write <gpu>.latest.json, compare with <gpu>.json
    lcx bench kernels --check BASE --new NEW.json   # compare two stored runs, no timing
    lcx bench kernels --device cpu --only rope      # CPU smoke (wall clock; never a baseline)
    lcx bench kernels --tune                # GPU: the Triton Λ kernel's launch configurations -> <gpu>.tune.json

Cases (`CASES`, one registry assembled from one module per kernel; each names its implementation
and the baseline it races):
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

Regression check (`baseline.compare`, a pure function): a kernel more than `threshold` (10%) slower
in median than in the baseline of the SAME GPU fails, as does a baseline kernel the new run
no longer has; runs on different GPUs are refused.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import (DO_BENCH_MIN_MS, Benchmark, Prepared, Skip, gpu_slug, measure_ceilings, roofline,
                                time_case, versions)
from benchmarks.harness import progress as _progress

from . import lambda_decode, lambda_prefill, rerotate, rope, swat
from .baseline import SCHEMA, THRESHOLD, Comparison, compare, validate
from .common import Case

# Relative to the working directory (the repository root when run from a checkout), never to
# this file.
RESULTS_DIR = Path("results") / "kernels"

DESCRIPTION = "time every GPU kernel against its baseline; roofline; regression check"
BENCH = Benchmark("kernels", DESCRIPTION, __doc__, out_help=(
    "where to write the result JSON (default: results/kernels/<gpu>.json; with --check <gpu>.latest.json; "
    "--device cpu writes only with --out)"))

# Cheap bandwidth-bound cases first, long compiles (flex) and the 128k prefill last, so a run cut
# off by a time limit keeps the most rows. A new kernel: its module with `CASES`, one entry here.
KERNELS = (rerotate, rope, lambda_decode, lambda_prefill, swat)
CASES: list[Case] = [case for kernel in KERNELS for case in kernel.CASES]


def _row(case: Case, prep: Prepared, times: list[float], ceilings: dict[str, float]) -> dict:
    row = {"group": case.group, "impl": case.impl, "size": case.size, **roofline(prep, times, ceilings)}
    if case.baseline:
        row["baseline"] = case.baseline
    return row


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
    p.add_argument("--tune", action="store_true",
                   help="instead of the cases: time the Triton Λ forward kernel's launch configurations "
                        "(block sizes, warps, stages) at the lambda_prefill shape, each checked against the "
                        "default's output -> results/kernels/<gpu>.tune.json (enter the winner in "
                        "lcx.kernels.triton.lambda_attention.TUNED); --device cpu: interpreter smoke run")
    p.add_argument("--tune-length", type=int, default=32768, metavar="T",
                   help="with --tune: the prefill length (default 32768)")


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
    if args.tune:
        return _run_tune(args)
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


def _run_tune(args: argparse.Namespace) -> int:
    from . import tune

    if args.check is not None or args.new is not None or args.only:
        raise ValueError("--tune times launch configurations of one kernel: no --check, --new or --only")
    if args.device == "cpu":
        torch.set_num_threads(1)
    out = args.out
    if out is None and args.device == "cuda" and torch.cuda.is_available():
        out = RESULTS_DIR / f"{gpu_slug(torch.cuda.get_device_name())}.tune.json"
    rec = BENCH.start(args, out=out)
    result = tune.tune(args.device, length=args.tune_length, warmup=min(args.warmup, 3),
                       repeats=min(args.repeats, 10), checkpoint=None if out is None else rec.write)
    print(tune.table(result))
    if out is not None:
        rec.write(result, quiet=False)
    return 0 if result["best"] is not None else 1


main = BENCH.command(add_arguments, run)



__all__ = ["CASES", "DO_BENCH_MIN_MS", "KERNELS", "SCHEMA", "THRESHOLD", "Case", "Comparison", "Prepared", "Skip",
           "add_arguments", "compare", "gpu_slug", "main", "measure_ceilings", "run", "run_cases", "select",
           "time_case", "validate", "versions"]
