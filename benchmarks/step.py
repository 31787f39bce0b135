"""`lcx bench step`: where a step of lcx's engine spends its time on the CPU (issue #75, item 3).

    lcx bench step                                   # tiny-5m and SmolLM2-135M -> results/engine_step_profile_cpu.json
    lcx bench step --models tiny-5m --prefill-tokens 256 --out /tmp/step.json

Per model: a prefill of `--prefill-tokens` tokens (one request, one generated token) and decode
steps of the engine with 1 and 32 rows running (128-token prompts, `--steps` steps each, after 4
untimed), timed by wall clock, then profiled once more by cProfile, whose own time per function
is grouped as

- linear: the linear layers (oneDNN's packed GEMM, `torch._ops.mkldnn._linear_pointwise`, or
  `F.linear`);
- attention: the attention kernels (SDPA, the decode step's matmuls and softmax);
- other: everything else (Python, transformers' module code, RoPE, norms, activations, the KV
  store, small tensor ops).

The engine runs as `lcx serve` runs it (its defaults: packed linears, the lean decode forward
where the family has one), one torch thread (`--threads`). The step times are wall times: on a
machine shared with other jobs they move with the load, which is recorded; the shares are what
the profile is for.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import Benchmark

DESCRIPTION = "where a step of lcx's engine spends its CPU time: prefill and decode at 1 and 32 rows, by cProfile"
BENCH = Benchmark("step", DESCRIPTION, __doc__, out="results/engine_step_profile_cpu.json", threads=1)
LINEAR = ("_linear_pointwise", "_nn.linear")
ATTENTION = ("scaled_dot_product", "torch.matmul", "softmax", "_scaled_dot_product_flash")
DECODE_ROWS = (1, 32)


@dataclass(frozen=True)
class Config:
    models: tuple[str, ...]
    prefill_tokens: int
    decode_prompt_tokens: int
    steps: int
    threads: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(parser)
    parser.add_argument("--models", default="tiny-5m,smollm2-135m",
                        help="comma-separated model presets or directories (default: %(default)s)")
    parser.add_argument("--prefill-tokens", type=int, default=2048,
                        help="tokens of the profiled prefill (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed, then profiled (default: %(default)s)")


def shares(pr: cProfile.Profile) -> dict[str, float]:
    """cProfile's own time grouped into linear / attention / other, as fractions of the total."""
    out = {"linear": 0.0, "attention": 0.0, "other": 0.0}
    for (_file, _line, name), (_cc, _nc, tt, _ct, _callers) in pstats.Stats(pr).stats.items():
        key = "linear" if any(x in name for x in LINEAR) else "attention" if any(x in name for x in ATTENTION) else "other"
        out[key] += tt
    total = sum(out.values()) or 1.0
    return {k: round(v / total, 3) for k, v in out.items()}


def profile_model(name: str, cfg: Config) -> dict[str, Any]:
    from benchmarks.prefix import _ids
    from lcx.engine import Engine, EngineConfig, SamplingParams
    from lcx.models import load_model

    model, tok = load_model(name)
    V = int(model.config.vocab_size)
    need = max(cfg.prefill_tokens + 1, cfg.decode_prompt_tokens + 4 + 2 * cfg.steps + 1)
    eng = Engine(model, tok, EngineConfig(max_model_len=need, prefix_caching=False, max_batch=max(DECODE_ROWS)))
    res: dict[str, Any] = {"model": name, "lean_decode": eng.runner.lean is not None, "packed_linear": eng.runner.packed}
    prompt = _ids(cfg.prefill_tokens, 7, V)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.generate([prompt], one)  # untimed: first-call costs
    t = time.perf_counter()
    eng.generate([prompt], one)
    res[f"prefill_{cfg.prefill_tokens}_s"] = round(time.perf_counter() - t, 3)
    pr = cProfile.Profile()
    pr.enable()
    eng.generate([prompt], one)
    pr.disable()
    res[f"prefill_{cfg.prefill_tokens}_share"] = shares(pr)
    for rows in DECODE_ROWS:
        sp = SamplingParams(max_tokens=4 + 2 * cfg.steps, ignore_eos=True)
        for i in range(rows):
            eng.add_request(_ids(cfg.decode_prompt_tokens, 100 + i, V), sp)
        for _ in range(4):  # the prefill, then steps with every row decoding
            eng.step()
        t = time.perf_counter()
        for _ in range(cfg.steps):
            eng.step()
        res[f"decode_b{rows}_step_ms"] = round((time.perf_counter() - t) / cfg.steps * 1e3, 2)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(cfg.steps):
            eng.step()
        pr.disable()
        res[f"decode_b{rows}_share"] = shares(pr)
        eng.reset()
    return res


def run(args: argparse.Namespace) -> int:
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if not models:
        raise ValueError("--models: name at least one model")
    for flag in ("prefill_tokens", "steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    threads = BENCH.resolve_threads(args)
    cfg = Config(models, args.prefill_tokens, 128, args.steps, threads)
    rec = BENCH.start(args, cfg, environment={"loadavg_before": os.getloadavg()[0]})
    results = []
    for name in rec.progress(list(models), unit="model"):
        results.append(profile_model(name, cfg))
        rec.log(f"{name}: {results[-1]}")
        rec.save(results)
    rec.environment["loadavg_after"] = os.getloadavg()[0]
    rec.finish(results)
    return 0


main = BENCH.command(add_arguments, run)
