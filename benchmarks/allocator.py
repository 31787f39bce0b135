"""`lcx bench allocator`: glibc's default allocator vs freed memory kept for reuse (`lcx.allocator`).

    lcx bench allocator                                   # -> results/allocator_cpu.json
    lcx bench allocator --cases smollm2-135m:4096 --repeats 3 --out /tmp/a.json

Each case is a model and a prompt length: one greedy request of that many prompt tokens (fixed
ids, 8 new tokens, prefix cache off) through `lcx.engine` on one thread, after a 256-token warm-up
request. The two settings must be measured in separate processes (an allocator's settings last
for the life of a process), so every (case, setting) run is a fresh process (`LCX_MALLOC=system`
or `reuse`), and the settings alternate within each repeat, the first one swapped from repeat to
repeat, so that a machine whose load drifts loads both alike. Measured in the worker around the
request (the model load is not counted): user and system CPU seconds (`getrusage`), minor page
faults, wall seconds, the process's peak RSS (the load included), the generated token ids.
Medians over `--repeats`; ratios are reuse / system; `same_tokens` says the two settings generated
the same tokens in every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import Benchmark

DESCRIPTION = "glibc's default allocator vs freed memory kept for reuse (lcx.allocator): CPU, page faults, peak RSS"
BENCH = Benchmark("allocator", DESCRIPTION, __doc__, out="results/allocator_cpu.json")
SETTINGS = ("system", "reuse")
DEFAULT_CASES = "smollm2-135m:4096,gemma3-270m:8192"
NEW_TOKENS = 8

WORKER = r'''
import json, resource, sys, time
import torch
from lcx.allocator import reuse_freed_memory
state = reuse_freed_memory()
torch.set_num_threads(1)
from lcx.engine import Engine, EngineConfig, SamplingParams
model, length, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = Engine.from_pretrained(model, EngineConfig(prefix_caching=False, max_model_len=length + new))
vocab = min(engine.vocab_size, 32000)
engine.generate([[(7 * j) % (vocab - 100) + 100 for j in range(256)]], SamplingParams(max_tokens=2, temperature=0))
prompt = [(7919 * j + 13) % (vocab - 100) + 100 for j in range(length)]
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
out = engine.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"allocator": state["allocator"], "user_s": r1.ru_utime - r0.ru_utime,
                  "sys_s": r1.ru_stime - r0.ru_stime, "minor_faults": r1.ru_minflt - r0.ru_minflt,
                  "wall_s": wall, "peak_rss_mb": r1.ru_maxrss / 1024, "tokens": out[0].token_ids}))
'''


@dataclass(frozen=True)
class Config:
    cases: list[str]
    repeats: int
    new_tokens: int
    threads: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(parser)
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help="MODEL:LENGTH,... (model presets or directories; default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per (case, setting); medians kept (default 2)")


def parse_cases(text: str) -> list[tuple[str, int]]:
    cases = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        model, _, length = item.rpartition(":")
        if not model or not length.isdigit() or int(length) < 1:
            raise ValueError(f"--cases: each case is MODEL:LENGTH with LENGTH >= 1, got {item!r}")
        cases.append((model, int(length)))
    if not cases:
        raise ValueError("--cases: no case given")
    return cases


def _worker(model: str, length: int, setting: str) -> dict[str, Any]:
    from lcx.allocator import ENV

    env = {**os.environ, "LCX_MALLOC": setting, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for name in ENV:  # the worker's setting is LCX_MALLOC's alone
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", WORKER, model, str(length), str(NEW_TOKENS)], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"worker {model}:{length} ({setting}) failed:\n{out.stderr[-3000:]}")
    run = json.loads(out.stdout.strip().splitlines()[-1])
    if run["allocator"] != setting:
        raise RuntimeError(f"worker {model}:{length}: asked for {setting}, ran {run['allocator']}")
    return run


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    keys = ("user_s", "sys_s", "minor_faults", "wall_s", "peak_rss_mb")
    med = {s: {k: round(statistics.median(r[k] for r in runs[s]), 3) for k in keys} for s in SETTINGS}
    for s in SETTINGS:
        med[s]["cpu_s"] = round(statistics.median(r["user_s"] + r["sys_s"] for r in runs[s]), 3)
        med[s]["sys_share"] = round(statistics.median(r["sys_s"] / max(1e-9, r["user_s"] + r["sys_s"])
                                                      for r in runs[s]), 3)
    ratio = {k: round(med["reuse"][k] / med["system"][k], 3) if med["system"][k] else None
             for k in ("cpu_s", "user_s", "sys_s", "minor_faults", "wall_s", "peak_rss_mb")}
    tokens = {json.dumps(r["tokens"]) for s in SETTINGS for r in runs[s]}
    return {**med, "ratio_reuse_vs_system": ratio, "same_tokens": len(tokens) == 1,
            "runs": {s: [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "tokens"}
                         for r in runs[s]] for s in SETTINGS}}


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    cases = parse_cases(args.cases)
    rec = BENCH.start(args, Config(cases=[f"{m}:{n}" for m, n in cases], repeats=args.repeats,
                                   new_tokens=NEW_TOKENS, threads=1))
    results: dict[str, Any] = {}
    for model, length in rec.progress(cases, unit="case"):
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
        for r in range(args.repeats):
            for setting in (SETTINGS if r % 2 == 0 else SETTINGS[::-1]):
                runs[setting].append(_worker(model, length, setting))
                rec.log(f"{model}:{length} {setting}: " + ", ".join(
                    f"{k} {runs[setting][-1][k]:.4g}" for k in ("user_s", "sys_s", "minor_faults", "peak_rss_mb")))
        results[f"{model}:{length}"] = summarize(runs)
        rec.save(results)
    def x(r: float | None, digits: int) -> str:  # a ratio, or "n/a" where the default's value was 0
        return "n/a" if r is None else f"{r:.{digits}f}x"

    for case, res in results.items():
        ratio = res["ratio_reuse_vs_system"]
        print(f"{case}: CPU {res['system']['cpu_s']:.1f} -> {res['reuse']['cpu_s']:.1f} s "
              f"({x(ratio['cpu_s'], 2)}; system share {res['system']['sys_share']:.0%} -> "
              f"{res['reuse']['sys_share']:.0%}), faults {x(ratio['minor_faults'], 3)}, "
              f"peak RSS {x(ratio['peak_rss_mb'], 2)}, same tokens: {res['same_tokens']}")
    rec.finish(results)
    return 0


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
