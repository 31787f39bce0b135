"""`lcx bench step`: where a step of lcx's engine spends its time on the CPU (issue #75, item 3).

    lcx bench step                                   # tiny-5m and SmolLM2-135M -> results/engine_step_profile_cpu.json
    lcx bench step --models tiny-5m --prefill-tokens 256 --out /tmp/step.json
    lcx bench step --vs-vllm                         # both models -> results/engine_vs_vllm_profile_cpu.json
    lcx bench step --mixed-ab --models smollm2-135m --steps 3   # -> results/mixed_step_ab_smollm2-135m.json

Per model: a prefill of `--prefill-tokens` tokens (one request, one generated token) and decode
steps of the engine with 1 and 32 rows running (128-token prompts, `--steps` steps each, after 4
untimed), timed by wall clock, then profiled once more by cProfile, whose own time per function
is grouped as

- linear: the linear layers (oneDNN's packed GEMM, `torch._ops.mkldnn._linear_pointwise`, or
  `F.linear`);
- attention: the attention kernels (SDPA, the decode step's matmuls and softmax);
- other: everything else (Python, transformers' module code, RoPE, norms, activations, the KV
  store, small tensor ops).

`--vs-vllm`: instead, lcx's engine and plain vLLM's (`lcx bench prefix`'s, in the python that has
vLLM) each run `lcx bench prefix`'s system-prompt load (16 requests of 512 shared + 32 own tokens,
4 in flight, 8 tokens each) once without and once with their prefix cache, under the same limits
(vLLM's batch limit and token budget), after an untimed run; both profiled by torch.profiler, whose
self CPU time per operator is grouped the same way for both engines (linear: oneDNN's GEMMs,
`_linear_pointwise` / vLLM's `onednn_mm`, `addmm`, `mm`; attention: SDPA, vLLM's
`cpu_attention_with_kv_cache`, `bmm`, softmax, lcx's C++ kernels; other: the rest), with each engine's top operators.
The same work in both: the same prompts, greedy, the same tokens computed.

`--mixed-ab`: instead, what one forward per step (`EngineConfig.mixed_step`) changes on the same
system-prompt load with the prefix cache (vLLM's batch limit and token budget): two engines on one
model in one process, mixed step on and off, run in turn (`--steps` rounds after an untimed one),
on the load as `lcx bench prefix` runs it (8 tokens per request: requests start and finish
together) and with requests that finish apart (max_tokens 4-19): each run's tokens/s, median
TTFT and step counts, the medians and the on/off ratios, whether the tokens agree.

The engine runs as `lcx serve` runs it (its defaults: packed linears, the lean decode forward
where the family has one), one torch thread (`--threads`). The step times are wall times: on a
machine shared with other jobs they move with the load, which is recorded; the shares are what
the profile is for.
"""

from __future__ import annotations

import argparse
import cProfile
import os
from pathlib import Path
import pstats
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import Benchmark

DESCRIPTION = "where a step of lcx's engine spends its CPU time: prefill and decode at 1 and 32 rows, by cProfile"
BENCH = Benchmark("step", DESCRIPTION, __doc__, out="results/engine_step_profile_cpu.json", threads=1)
LINEAR = ("_linear_pointwise", "_nn.linear")
# torch.profiler operator names, both engines (`--vs-vllm`)
OP_LINEAR = ("_linear_pointwise", "onednn_mm", "aten::addmm", "aten::mm")
OP_ATTENTION = ("scaled_dot_product", "cpu_attention", "aten::bmm", "softmax", "lcx::causal_attention_cpu",
                "lcx::decode_attention_cpu")
# cProfile's names: lcx's C++ kernels are the extension's `causal_attention` / `decode_attention`
ATTENTION = ("scaled_dot_product", "torch.matmul", "softmax", "_scaled_dot_product_flash", "causal_attention",
             "decode_attention")
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
    parser.add_argument("--vs-vllm", action="store_true",
                        help="profile lcx's engine and plain vLLM's on `lcx bench prefix`'s system-prompt load instead, "
                             "without and with the prefix cache (needs vLLM: `lcx bench prefix` says where it looks)")
    parser.add_argument("--mixed-ab", action="store_true",
                        help="instead, the mixed step (EngineConfig.mixed_step) on vs off on the system-prompt load, "
                             "requests together and finishing apart, --steps interleaved rounds")


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


def profiled(fn: Any) -> tuple[Any, dict[str, float]]:
    """`fn()` under torch.profiler (CPU): (its result, self CPU seconds per operator, largest first;
    operators under 1 ms left out)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    ops = sorted(((e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()), key=lambda x: -x[1])
    return out, {k: round(v, 4) for k, v in ops if v >= 1e-3}


def op_groups(ops: dict[str, float]) -> dict[str, float]:
    """Self CPU seconds per operator (`profiled`) grouped into linear / attention / other."""
    out = {"linear": 0.0, "attention": 0.0, "other": 0.0}
    for name, sec in ops.items():
        key = ("linear" if any(x in name for x in OP_LINEAR) else
               "attention" if any(x in name for x in OP_ATTENTION) else "other")
        out[key] += sec
    return {k: round(v, 3) for k, v in out.items()}


def vs_vllm(name: str, threads: int, log_dir: str) -> dict[str, Any]:
    """lcx's engine and vLLM's on the system-prompt load, profiled (module docstring, `--vs-vllm`)."""
    from pathlib import Path

    from benchmarks import prefix
    from lcx.allocator import reuse_freed_memory
    from lcx.engine import Engine, EngineConfig
    from lcx.models import load_model

    reuse_freed_memory()  # (as lcx serve's engine process; vLLM's gets the same MALLOC_* settings)
    model, tok = load_model(name)
    cfg = prefix.Config(name, 16, 4, 512, 32, 2048, 8, 8, 1, threads)
    prompts = prefix.system_prompt_load(cfg, int(model.config.vocab_size))
    mpe = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    max_model_len = max(mpe, 4096)
    args = argparse.Namespace(no_vllm=False, model=name, allocator="reuse", vllm_block_size=None)
    engines, vsec = prefix._start_vllm(args, max_model_len, mpe, threads, Path(log_dir))
    if engines is None:
        return {"model": name, "skipped": vsec["skipped"]}
    sched = vsec["engine"]
    out: dict[str, Any] = {"model": name, "load": "system_prompt", "vllm": sched, "settings": {}}
    try:
        for setting in prefix.SETTINGS:
            lcx = Engine(model, tok, EngineConfig(max_model_len=max_model_len, prefix_caching=(setting == "cache"),
                                                  max_batch=int(sched["max_num_seqs"]),
                                                  max_num_batched_tokens=int(sched["max_num_batched_tokens"])))
            run = (prompts, cfg.concurrency, cfg.max_tokens)
            row: dict[str, Any] = {}
            for eng in ("lcx", "vllm"):
                if eng == "lcx":
                    prefix._run_load(lcx, *run)  # untimed: first-call costs
                    res, ops = profiled(lambda: prefix._run_load(lcx, *run))
                else:  # (profiled in vLLM's own process)
                    engines[setting].run(*run)
                    res = engines[setting].run(*run, profile=True)
                    ops = res.pop("ops_self_s")
                row[eng] = {"wall_s": round(res["wall_s"], 3), "gen_tok_s": round(res["gen_tok_s"], 3),
                            "ttft_p50_s": round(res["ttft_p50_s"], 4), "tokens": res["tokens"],
                            "prompt_tokens_computed": res["prompt_tokens_computed"],
                            "self_s": op_groups(ops), "top_ops_self_s": dict(list(ops.items())[:15])}
            row["same_tokens"] = row["lcx"].pop("tokens") == row["vllm"].pop("tokens")
            row["vllm_vs_lcx_self_s"] = {k: round(row["vllm"]["self_s"][k] / row["lcx"]["self_s"][k], 3)
                                         for k in row["lcx"]["self_s"] if row["lcx"]["self_s"][k]}
            out["settings"][setting] = row
    finally:
        for e in engines.values():
            e.close()
    return out


def mixed_ab(name: str, rounds: int) -> dict[str, Any]:
    """The mixed step on and off (module docstring, `--mixed-ab`)."""
    import statistics

    from benchmarks import prefix
    from lcx.allocator import reuse_freed_memory
    from lcx.engine import Engine, EngineConfig, SamplingParams
    from lcx.models import load_model

    reuse_freed_memory()  # (as lcx serve's engine process and `lcx bench prefix` run it)
    model, tok = load_model(name)
    cfg = prefix.Config(name, 16, 4, 512, 32, 2048, 8, 8, rounds, 1)
    prompts = prefix.system_prompt_load(cfg, int(model.config.vocab_size))
    engines = {on: Engine(model, tok, EngineConfig(max_model_len=4096, max_batch=prefix.VLLM_CPU_MAX_NUM_SEQS,
                                                   max_num_batched_tokens=prefix.VLLM_CPU_MAX_NUM_BATCHED_TOKENS,
                                                   mixed_step=on)) for on in (False, True)}

    def once(engine: Any, max_tokens: list[int]) -> dict[str, Any]:
        engine.prefix_cache.clear()
        s0 = engine.stats.to_dict()
        sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
        res = prefix._drive(lambda p, i: engine.add_request(p, sps[i]),
                            lambda: [(ev.request_id, ev.token_ids, ev.finished) for ev in engine.step()],
                            prompts, cfg.concurrency)
        s1 = engine.stats.to_dict()
        return {"gen_tok_s": round(res["gen_tok_s"], 3), "ttft_p50_s": round(res["ttft_p50_s"], 4),
                "decode_steps": s1["decode_steps"] - s0["decode_steps"],
                "mixed_steps": s1["mixed_steps"] - s0["mixed_steps"], "tokens": res["tokens"]}

    out: dict[str, Any] = {"model": name, "load": "system_prompt, prefix cache on", "rounds": rounds, "loads": {}}
    for load, max_tokens in (("together", [cfg.max_tokens] * len(prompts)),
                             ("apart", [4 + (i * 7) % 16 for i in range(len(prompts))])):
        for e in engines.values():
            once(e, max_tokens)  # untimed: first-call costs
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for _ in range(rounds):
            for on, e in engines.items():
                runs["on" if on else "off"].append(once(e, max_tokens))
        same = all(r["tokens"] == runs["off"][0]["tokens"] for v in runs.values() for r in v)
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("gen_tok_s", "ttft_p50_s")} for k, v in runs.items()}
        for v in runs.values():
            for r in v:
                del r["tokens"]
        out["loads"][load] = {"max_tokens": max_tokens, "same_tokens": same, "runs": runs, "median": med,
                              "on_vs_off": {m: round(med["on"][m] / med["off"][m], 3) for m in ("gen_tok_s", "ttft_p50_s")}}
    return out


def run(args: argparse.Namespace) -> int:
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if not models:
        raise ValueError("--models: name at least one model")
    for flag in ("prefill_tokens", "steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    threads = BENCH.resolve_threads(args)
    cfg = Config(models, args.prefill_tokens, 128, args.steps, threads)
    out = args.out
    if out is not None and Path(out) == Path(BENCH.out) and (args.vs_vllm or args.mixed_ab):
        # (each mode has its own record: the step profile's default is not overwritten)
        out = ("results/engine_vs_vllm_profile_cpu.json" if args.vs_vllm
               else f"results/mixed_step_ab_{'_'.join(Path(m).name for m in models)}.json")
    rec = BENCH.start(args, cfg, out=out, environment={"loadavg_before": os.getloadavg()[0]})
    results = []
    for name in rec.progress(list(models), unit="model"):
        if args.mixed_ab:
            results.append(mixed_ab(name, args.steps))
        elif args.vs_vllm:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="lcx-step-") as logs:
                results.append(vs_vllm(name, threads, logs))
        else:
            results.append(profile_model(name, cfg))
        rec.log(f"{name}: {results[-1]}")
        rec.save(results)
    rec.environment["loadavg_after"] = os.getloadavg()[0]
    rec.finish(results)
    return 0


main = BENCH.command(add_arguments, run)
