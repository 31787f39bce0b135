"""`lcx bench prefill`: one long prefill of a whole model, per method, against the unpatched model.

    lcx bench prefill --model smollm2-135m --length 16384           # -> results/prefill_cpu.json
    lcx bench prefill --model tiny-ret-5m --length 2048 --presets vanilla,lm_infinite --out /tmp/p.json

The question it answers (issue: "a 16k prefill of a windowed method must not be slower than
dense causal attention"): how long does the forward over an L-token prompt take with each
method (`lcx.presets`, L0 = the model's context, factor L / L0), compared with the model as
loaded, whose attention is transformers' SDPA (torch's fused causal kernel)? Each method runs
through the route lcx runs it in `lcx report` and `lm_eval --model lcx`: the attention methods
on `--attn-backend` (default `flash`), RoPE methods through the patched rotary module.

Timing: `time.process_time` (CPU time of this process, all threads) around
`model(input_ids, use_cache=False, logits_to_keep=1)` in `torch.inference_mode`, after one
warm-up at a short length; the median over `--repeats`. CPU time, not wall time, because the
machine is shared: with one thread it is the work the forward did (wall medians are recorded
too). Also the process's peak RSS increase during the forward. Ratios are against `vanilla` of
the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import Benchmark

DESCRIPTION = "one long prefill of a whole model, per method, against the unpatched model"
BENCH = Benchmark("prefill", DESCRIPTION, __doc__, out="results/prefill_cpu.json", threads="1",
                  record_description="whole-model prefill time per method vs the unpatched model "
                                     "(transformers SDPA, causal)")
DEFAULT_METHODS = ("vanilla", "yarn", "lm_infinite", "sinks", "sliding_window")
TIME_MEASURE = ("median process CPU time of one forward (use_cache=False, logits_to_keep=1) after a 256-token "
                "warm-up; wall time recorded too")


@dataclass(frozen=True)
class Config:
    model: str
    length: int
    context: int  # the model's L0
    factor: float  # length / L0 (at least 1): the presets' scaling
    attn_backend: str
    repeats: int
    threads: int
    time_measure: str = TIME_MEASURE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lcx.attention import BACKENDS
    from lcx.method_config import INFERENCE_BACKEND
    from lcx.presets import add_presets_argument

    BENCH.add_arguments(parser)
    parser.add_argument("--model", default="smollm2-135m", help="model preset or directory (default: %(default)s)")
    parser.add_argument("--length", type=int, default=16384, help="prompt tokens (default: %(default)s)")
    add_presets_argument(parser, default=",".join(DEFAULT_METHODS),
                         help="comma-separated lcx.presets names (default: %(default)s)")
    parser.add_argument("--attn-backend", default=INFERENCE_BACKEND, choices=sorted(BACKENDS),
                        help="lcx.attention backend of the attention methods (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="timed forwards per method; median kept (default 1)")


def _forward_s(model: Any, ids: Any) -> tuple[float, float, float]:
    """(CPU seconds, wall seconds, peak RSS increase in MB) of one forward."""
    import torch

    from benchmarks.measure import reset_peak, status_bytes

    reset_peak()
    before = status_bytes("VmRSS")
    t0, w0 = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    return cpu, wall, max(0, status_bytes("VmHWM") - before) / 2**20


def run(args: argparse.Namespace) -> int:
    import torch

    from lcx import presets
    from lcx.models import load_model
    from lcx.report import _prompt_ids

    threads = BENCH.resolve_threads(args)
    if args.repeats < 1 or args.length < 16:
        raise ValueError("--repeats must be >= 1 and --length >= 16")
    names = [m.strip() for m in args.presets.split(",") if m.strip()]
    for m in names:
        presets.get(m)  # a clear error for an unknown name, before loading anything
    if "vanilla" not in names:
        names.insert(0, "vanilla")
    model, tok = load_model(args.model)
    L0 = int(model.config.max_position_embeddings)
    factor = max(1.0, args.length / L0)
    rec = BENCH.start(args, Config(args.model, args.length, L0, factor, args.attn_backend, args.repeats, threads))
    ids = torch.tensor([_prompt_ids(tok, args.length)])
    rows: dict[str, Any] = {}
    for name in rec.progress(names, unit="method"):
        r = presets.resolve(name, args.model, L0=L0, factor=factor)
        if isinstance(r, str) or r.model != args.model:
            rows[name] = {"skipped": r if isinstance(r, str) else f"runs on another model ({r.model})"}
            continue
        cfg = r.config.with_default_backend(args.attn_backend)
        with cfg.apply(model):
            _forward_s(model, ids[:, :256])  # warm-up (kernel selection, allocator)
            runs = [_forward_s(model, ids) for _ in range(args.repeats)]
        rows[name] = {"config": cfg.to_dict(), "cpu_s": statistics.median(x[0] for x in runs),
                      "wall_s": statistics.median(x[1] for x in runs), "peak_mb": max(x[2] for x in runs)}
        rec.log(f"{name:>18}: {rows[name]['cpu_s']:.1f} s CPU, {rows[name]['wall_s']:.1f} s wall, "
                f"peak +{rows[name]['peak_mb']:.0f} MB")
    base = rows["vanilla"]["cpu_s"]
    for row in rows.values():
        if "cpu_s" in row:
            row["speedup_vs_vanilla"] = round(base / row["cpu_s"], 3)
    rec.finish(rows)
    return 0


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
