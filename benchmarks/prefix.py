"""`lcx bench prefix`: lcx's engine with and without its prefix cache on two loads that share prefixes.

    lcx bench prefix                               # -> results/prefix_cpu.json (run from the repo root)
    lcx bench prefix --model tiny-5m --passkey-length 2048 --repeats 3

Loads (token ids drawn from a fixed generator, so every run sends the same prompts):

- `system_prompt`: `--requests` requests, each a shared system prompt (`--system-tokens`) plus
  its own question (`--question-tokens`), `--max-tokens` greedy tokens each, `--concurrency`
  requests in flight (a new one joins as one finishes), as a chat server sees them.
- `passkey_sweep`: `--depths` prompts of one length (`--passkey-length`): an instruction, then a
  haystack with a needle at depth d (uniform grid), so two prompts share the instruction and the
  haystack up to the shallower needle, run one at a time deepest needle first (what a sweep
  ordered for reuse sends), `--max-tokens` tokens each.

For each load and each setting (`cache`: `EngineConfig.prefix_caching`; `no_cache`) it reports
throughput (generated tokens / s, prompt tokens / s), median and p90 time to first token, the
prompt tokens the model computed and the cache's hit rate, medians over `--repeats` interleaved
runs (an engine per setting, built once; the cache is emptied before each run), and the ratios
cache / no_cache from the same run. Both settings give the same tokens (checked; the exactness
tests are tests/engine/test_prefix_cache.py). vLLM's prefix caching on the same loads is not run
here yet.

`--cell PRESET` measures instead what the cache saves a report cell: the passkey part of an
`lcx report` cell (lm-eval's `simple_evaluate` on lcx's `passkey` task through `--model lcx`,
batch size 1, `--passkey-length`, `--depths` x `--samples-per-depth` prompts, the report's preset
`PRESET` with the RoPE factor of that length) run once with the prefix cache and once without,
each in its own process: the process's CPU seconds (user + system, model load included), wall
time and answers. The two must answer identically, and equal `--compare CELL` (a committed
report cell, e.g. results/report/smollm2-135m-n16/cells/self_extend.lmeval.16384.json.gz) where
given. -> results/prefix_cell_<model>_<preset>_<length>.json

    lcx bench prefix --cell self_extend --model smollm2-135m --passkey-length 16384 \
        --compare results/report/smollm2-135m-n16/cells/self_extend.lmeval.16384.json.gz
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import Benchmark

DESCRIPTION = "lcx's engine with vs without its prefix cache: shared system prompt and passkey-sweep loads"
BENCH = Benchmark("prefix", DESCRIPTION, __doc__, out="results/prefix_cpu.json", threads="1",
                  record_description="prefix caching in lcx's engine: throughput and time to first token with "
                                     "and without the cache on a shared-system-prompt and a passkey-sweep load")
SETTINGS = ("no_cache", "cache")


@dataclass(frozen=True)
class Config:
    model: str
    requests: int
    concurrency: int
    system_tokens: int
    question_tokens: int
    passkey_length: int
    depths: int
    max_tokens: int
    repeats: int
    threads: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(parser)
    parser.add_argument("--model", default="tiny-5m", help="model preset or directory (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=16, help="system_prompt load: requests (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=4, help="system_prompt load: requests in flight "
                        "(default: %(default)s)")
    parser.add_argument("--system-tokens", type=int, default=512, help="shared system prompt length (default: %(default)s)")
    parser.add_argument("--question-tokens", type=int, default=32, help="each request's own tokens (default: %(default)s)")
    parser.add_argument("--passkey-length", type=int, default=2048, help="passkey_sweep prompt length (default: %(default)s)")
    parser.add_argument("--depths", type=int, default=8, help="passkey_sweep needle depths (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per setting (default: %(default)s)")
    parser.add_argument("--cell", metavar="PRESET", default=None,
                        help="measure a report passkey cell of this preset (lcx report --presets) with and "
                             "without the cache instead of the two loads (see the description)")
    parser.add_argument("--samples-per-depth", type=int, default=2,
                        help="--cell: passkey prompts per depth (default: %(default)s; the n16 sweep's 16 prompts)")
    parser.add_argument("--compare", type=Path, default=None,
                        help="--cell: a committed report cell (.json.gz) whose passkey answers must be reproduced")


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(3, max(4, vocab - 1), (n,), generator=g)]


def system_prompt_load(cfg: Config, vocab: int) -> list[list[int]]:
    system = _ids(cfg.system_tokens, 1, vocab)
    return [system + _ids(cfg.question_tokens, 100 + i, vocab) for i in range(cfg.requests)]


def passkey_load(cfg: Config, vocab: int) -> list[list[int]]:
    """Prompts of one length: instruction + haystack with a needle at each depth, deepest first."""
    instruction, needle = _ids(48, 2, vocab), _ids(16, 3, vocab)
    hay = _ids(cfg.passkey_length, 4, vocab)
    room = cfg.passkey_length - len(instruction) - len(needle)
    if room < 1:
        raise ValueError(f"--passkey-length {cfg.passkey_length} leaves no room for the haystack")
    depths = [1 - i / max(1, cfg.depths - 1) for i in range(cfg.depths)]  # 1.0 ... 0.0
    out = []
    for d in depths:
        at = int(round(d * room))
        out.append(instruction + hay[:at] + needle + hay[at:room])
    return out


def _run_load(engine: Any, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Send `prompts` with `concurrency` in flight through `engine.step`; time to first token per
    request, wall time, tokens."""
    from lcx.engine import SamplingParams

    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    stats0 = engine.stats.to_dict()
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    queue = list(enumerate(prompts))
    t_add: dict[str, float] = {}
    ttft: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    index: dict[str, int] = {}
    t0 = time.perf_counter()

    def add() -> None:
        i, p = queue.pop(0)
        rid = engine.add_request(p, sp)
        t_add[rid], index[rid], tokens[rid] = time.perf_counter(), i, []

    while queue and len(t_add) - len([r for r in tokens if r in ttft and len(tokens[r]) >= max_tokens]) < concurrency:
        add()
    done = 0
    while done < len(prompts):
        for ev in engine.step():
            if ev.token_ids and ev.request_id not in ttft:
                ttft[ev.request_id] = time.perf_counter() - t_add[ev.request_id]
            tokens[ev.request_id] += ev.token_ids
            if ev.finished:
                done += 1
                if queue:
                    add()
    wall = time.perf_counter() - t0
    stats1 = engine.stats.to_dict()
    looked = stats1["prefix_cache_query_tokens"] - stats0["prefix_cache_query_tokens"]
    hit = stats1["prefix_cache_hit_tokens"] - stats0["prefix_cache_hit_tokens"]
    first = sorted(ttft.values())
    return {"wall_s": wall, "gen_tok_s": sum(len(t) for t in tokens.values()) / wall,
            "prompt_tok_s": sum(map(len, prompts)) / wall, "ttft_p50_s": statistics.median(first),
            "ttft_p90_s": first[min(len(first) - 1, int(0.9 * len(first)))],
            "prompt_tokens_computed": stats1["prompt_tokens_computed"] - stats0["prompt_tokens_computed"],
            "hit_rate": hit / looked if looked else 0.0,
            "tokens": [tokens[r] for r in sorted(tokens, key=index.get)]}


def _cell_run(model: str, preset: str, length: int, depths: int, per_depth: int) -> tuple[Any, Any]:
    """The report's (config, preset run) of one passkey cell."""
    from lcx.report import ReportConfig
    from lcx.report.run import plan_runs

    cfg, runs, skipped, _, _ = plan_runs(ReportConfig(model=model, methods=(preset,), lengths=(length,), depths=depths,
                                                      samples_per_depth=per_depth, decode_lengths=()))
    if preset not in runs:
        raise ValueError(f"--cell {preset}: {skipped[preset]}")
    return cfg, runs[preset]


def cell_worker(spec: dict[str, Any], out: str) -> None:
    """In a child process: one passkey cell (`spec`), its answers and engine counters -> `out`."""
    import torch

    from lcx.data.io import atomic_write_json
    from lcx.report.measure import lmeval_model, run_lmeval_cell

    torch.set_num_threads(spec["threads"])
    cfg, run = _cell_run(spec["model"], spec["preset"], spec["length"], spec["depths"], spec["per_depth"])
    lm = lmeval_model(run, cfg, prefix_caching=spec["cache"])
    res = run_lmeval_cell(spec["model"], run, cfg, spec["length"], lm=lm, ppl=False)
    st = lm.lcx_engine.stats
    res["prompt_tokens_computed"] = st.prompt_tokens_computed
    res["prefix_cache_hit_rate"] = round(st.prefix_cache_hit_rate, 4)
    res["prefix_cache_on"] = lm.lcx_engine.prefix_cache is not None
    res["method"] = run.config.to_dict()
    atomic_write_json(Path(out), res)


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run `cell_worker` in a fresh process; its CPU seconds from the kernel's child accounting."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cell.json")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        code = f"import json; from benchmarks.prefix import cell_worker; cell_worker(json.loads({json.dumps(spec)!r}), {out!r})"
        root = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = json.loads(Path(out).read_text())
    res["cpu_s"] = round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2)
    res["process_wall_s"] = round(wall, 2)
    return res


def _answers(cell: dict[str, Any]) -> list[tuple[float, str, float, Any]]:
    return sorted((float(s["depth"]), str(s["key"]), float(s["correct"]), s["output"]) for s in cell["passkey_samples"])


def run_cell(args: argparse.Namespace, threads: int) -> int:
    """`--cell PRESET`: a report passkey cell with and without the prefix cache (module doc)."""
    import gzip

    for name in ("passkey_length", "depths", "samples_per_depth"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _cell_run(args.model, args.cell, args.passkey_length, args.depths, args.samples_per_depth)  # validate
    committed = None
    if args.compare is not None:
        opener = gzip.open if args.compare.suffix == ".gz" else open
        with opener(args.compare, "rt") as f:
            committed = json.load(f)
    cfg = {"model": args.model, "preset": args.cell, "length": args.passkey_length, "depths": args.depths,
           "samples_per_depth": args.samples_per_depth, "threads": threads,
           "compare": str(args.compare) if args.compare else None}
    out = args.out if args.out != Path(BENCH.out) else Path(
        f"results/prefix_cell_{args.model}_{args.cell}_{args.passkey_length}.json")
    rec = BENCH.start(args, cfg, out=out)
    results: dict[str, Any] = {}
    for s in rec.progress(["no_cache", "cache"], unit="setting"):
        spec = {"model": args.model, "preset": args.cell, "length": args.passkey_length, "depths": args.depths,
                "per_depth": args.samples_per_depth, "cache": s == "cache", "threads": threads}
        r = _child(spec)
        results[s] = {k: r[k] for k in ("cpu_s", "process_wall_s", "wall_s", "passkey", "passkey_docs",
                                        "prompt_tokens_computed", "prefix_cache_hit_rate", "prefix_cache_on")}
        results[s]["answers"] = _answers(r)
        rec.log(f"{s}: {results[s]['cpu_s']} CPU s, passkey {r['passkey']:.3f}")
        rec.save(results)
    same = results["cache"]["answers"] == results["no_cache"]["answers"]
    results["same_answers"] = same
    if committed is not None:
        results["same_as_committed"] = _answers(committed["result"]) == results["cache"]["answers"]
        results["committed_wall_s"] = committed["result"].get("wall_s")
    results["ratio_cache_vs_no_cache"] = {
        "cpu_s": round(results["cache"]["cpu_s"] / results["no_cache"]["cpu_s"], 3),
        "prompt_tokens_computed": round(results["cache"]["prompt_tokens_computed"]
                                        / max(1, results["no_cache"]["prompt_tokens_computed"]), 3)}
    rec.log(f"cache / no cache: {results['ratio_cache_vs_no_cache']}, same answers {same}"
            + (f", as committed {results['same_as_committed']}" if committed is not None else ""))
    rec.finish(results)
    if not same or results.get("same_as_committed") is False:
        print("the answers differ (see the record)", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from lcx.engine import Engine, EngineConfig
    from lcx.models import load_model

    if args.cell is not None:
        return run_cell(args, BENCH.resolve_threads(args))

    for name in ("requests", "concurrency", "system_tokens", "question_tokens", "passkey_length", "depths",
                 "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    threads = BENCH.resolve_threads(args)
    cfg = Config(args.model, args.requests, args.concurrency, args.system_tokens, args.question_tokens,
                 args.passkey_length, args.depths, args.max_tokens, args.repeats, threads)
    rec = BENCH.start(args, cfg)
    model, tok = load_model(args.model)
    need = max(cfg.system_tokens + cfg.question_tokens, cfg.passkey_length) + cfg.max_tokens
    engines = {s: Engine(model, tok, EngineConfig(max_model_len=max(need, model.config.max_position_embeddings),
                                                  prefix_caching=(s == "cache"))) for s in SETTINGS}
    vocab = int(model.config.vocab_size)
    loads = {"system_prompt": (system_prompt_load(cfg, vocab), cfg.concurrency),
             "passkey_sweep": (passkey_load(cfg, vocab), 1)}
    results: dict[str, Any] = {}
    for load in rec.progress(list(loads), unit="load"):
        prompts, conc = loads[load]
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
        for _ in range(cfg.repeats):
            for s in SETTINGS:  # interleaved
                runs[s].append(_run_load(engines[s], prompts, conc, cfg.max_tokens))
        same = all(r["tokens"] == runs["no_cache"][0]["tokens"] for s in SETTINGS for r in runs[s])
        if not same:
            raise RuntimeError(f"{load}: tokens with and without the prefix cache differ")
        row: dict[str, Any] = {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                               "concurrency": conc, "same_tokens": same}
        for s in SETTINGS:
            row[s] = {k: round(statistics.median(r[k] for r in runs[s]), 5)
                      for k in ("wall_s", "gen_tok_s", "prompt_tok_s", "ttft_p50_s", "ttft_p90_s",
                                "prompt_tokens_computed", "hit_rate")}
        c, n = row["cache"], row["no_cache"]
        row["ratio_cache_vs_no_cache"] = {"gen_tok_s": round(c["gen_tok_s"] / n["gen_tok_s"], 3),
                                          "ttft_p50": round(c["ttft_p50_s"] / n["ttft_p50_s"], 3),
                                          "prompt_tokens_computed": round(c["prompt_tokens_computed"]
                                                                          / n["prompt_tokens_computed"], 3)}
        results[load] = row
        rec.log(f"{load}: {row['ratio_cache_vs_no_cache']} hit rate {c['hit_rate']:.2f}")
        rec.save(results)
    print(f"{'load':15s} {'gen tok/s (cache / none)':>26s} {'ttft p50 s (cache / none)':>28s} {'hit rate':>9s}")
    for load, row in results.items():
        c, n = row["cache"], row["no_cache"]
        print(f"{load:15s} {c['gen_tok_s']:12.1f} / {n['gen_tok_s']:<11.1f} {c['ttft_p50_s']:13.4f} / "
              f"{n['ttft_p50_s']:<12.4f} {c['hit_rate']:9.2f}")
    rec.finish(results)
    return 0


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
