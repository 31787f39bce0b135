"""`lcx bench prefix`: lcx's engine with and without its prefix cache on two loads that share prefixes,
beside vLLM's automatic prefix caching on the same loads.

    lcx bench prefix                 # -> results/prefix_cpu.json (run from the repo root)
    LCX_VLLM_VENV=DIR lcx bench prefix   # vLLM from that environment (scripts/install_vllm_cpu.sh --venv DIR)
    lcx bench prefix --model tiny-5m --passkey-length 2048 --repeats 3 --no-vllm   # lcx only

Loads (token ids drawn from a fixed generator, so every run sends the same prompts):

- `system_prompt`: `--requests` requests, each a shared system prompt (`--system-tokens`) plus
  its own question (`--question-tokens`), `--max-tokens` greedy tokens each, `--concurrency`
  requests in flight (a new one joins as one finishes), as a chat server sees them.
- `passkey_sweep`: `--depths` prompts of one length (`--passkey-length`): an instruction, then a
  haystack with a needle at depth d (uniform grid), so two prompts share the instruction and the
  haystack up to the shallower needle, run one at a time deepest needle first (what a sweep
  ordered for reuse sends), `--max-tokens` tokens each.
- `concurrent`: a plain serving load with nothing shared: `--concurrent-requests` prompts of
  `--concurrent-prompt-tokens` own tokens, `--concurrent-in-flight` in flight (32), each generating
  `--concurrent-max-tokens` tokens, so decode steps of a large batch carry most of its time (the
  cache has nothing to reuse here; both settings are measured as on the other loads).

For each load and each setting (`cache`: `EngineConfig.prefix_caching`; `no_cache`) it reports
throughput (generated tokens / s, prompt tokens / s), median and p90 time to first token, the
prompt tokens the model computed and the cache's hit rate, medians over `--repeats` interleaved
runs (an engine per setting, built once; the cache is emptied before each run), and the ratios
cache / no_cache from the same run. Both settings give the same tokens (checked; the exactness
tests are tests/engine/test_prefix_cache.py).

The record's `vllm` section runs the same prompts (token ids) through vLLM's offline engine
(`vllm.LLMEngine`, plain vLLM: its own Llama, float32, eager) with `enable_prefix_caching` True
and False: two engines in subprocesses of the python `lcx.serve.vllm_plugin.launch.vllm_python()`
finds (LCX_VLLM_VENV, or vLLM in this environment, or .venv-vllm), each running its engine core
in that one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as lcx's engine runs in the benchmark's)
with `--threads` OMP threads, interleaved with lcx's runs in every repeat. Both
engines are driven by the same loop (`_drive`: `--concurrency` in flight, TTFT from a request's
submission to the step that returned its first token), greedy, `--max-tokens`, ignore_eos; vLLM
keeps its own scheduler (chunked prefill, a token budget per step) and its block size (128 on
CPU, `--vllm-block-size`), against lcx's 16. Per load: the same metrics (hit rate and prompt
tokens computed from vLLM's own counters), ratios cache / no_cache, ratios vLLM / lcx per setting,
whether vLLM gave the same tokens with and without its cache (recorded, not enforced) and how many
requests got lcx's tokens. Where vLLM is not installed, or with `--no-vllm`, the section is
`{"skipped": "<why>"}` and the lcx part runs as before.

`--cell PRESET` measures instead what the cache saves a report cell: the passkey part of an
`lcx report` cell (lm-eval's `simple_evaluate` on lcx's `passkey` task through `--model lcx`,
batch size 1, `--passkey-length`, `--depths` x `--samples-per-depth` prompts, the report's preset
`PRESET` with the RoPE factor of that length) run once with the prefix cache and once without,
each in its own process, the two at the same time (so both see the machine's load alike): each
process's CPU seconds (user + system, model load included), wall time and answers. The two must answer identically, and equal `--compare CELL` (a committed
report cell, e.g. results/report/smollm2-135m-n16/cells/self_extend.lmeval.16384.json.gz) where
given. -> results/prefix_cell_<model>_<preset>_<length>.json

    lcx bench prefix --cell self_extend --model smollm2-135m --passkey-length 16384 \
        --compare results/report/smollm2-135m-n16/cells/self_extend.lmeval.16384.json.gz

`--baseline-at REV` runs the no-cache setting on the code of a past commit instead (a `git archive`
of REV in a temporary directory, its CPU kernel built before anything is timed; the record names
REV's full sha), the cache setting on this checkout: what a cell costs now against what it cost
at REV, every change since included (the prefix cache, `lcx.allocator`'s freed-memory reuse, ...).
Each setting's allocator is recorded beside its CPU seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import Benchmark

DESCRIPTION = ("lcx's engine with vs without its prefix cache, beside vLLM's prefix caching: shared system prompt "
               "and passkey-sweep loads")
BENCH = Benchmark("prefix", DESCRIPTION, __doc__, out="results/prefix_cpu.json", threads="1",
                  record_description="prefix caching in lcx's engine (results) and in vLLM (vllm): throughput and "
                                     "time to first token with and without the cache on a shared-system-prompt "
                                     "and a passkey-sweep load")
SETTINGS = ("no_cache", "cache")
VLLM_CPU_MAX_NUM_SEQS = 128  # vLLM 0.32's CPU defaults (its engine reports them; used without vLLM)
VLLM_CPU_MAX_NUM_BATCHED_TOKENS = 2048
ROOT = Path(__file__).resolve().parents[1]  # the repository this module runs from


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
    concurrent_requests: int = 64
    concurrent_in_flight: int = 32
    concurrent_prompt_tokens: int = 128
    concurrent_max_tokens: int = 32
    vllm: bool = True  # run the vLLM section (False: --no-vllm)
    vllm_block_size: int | None = None  # vLLM's KV block size (None: vLLM's default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(parser)
    parser.add_argument("--model", default="tiny-5m", help="model preset or directory (default: %(default)s)")
    parser.add_argument("--allocator", choices=("reuse", "system"), default="reuse",
                        help="glibc's allocator settings in both engines' processes: reuse (freed memory kept for "
                             "reuse, lcx.allocator: as lcx serve's engine process and lcx report run; vLLM's "
                             "process gets the same settings through MALLOC_* variables) or system (glibc's "
                             "defaults, as records before 2026-12-07 ran) (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=16, help="system_prompt load: requests (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=4, help="system_prompt load: requests in flight "
                        "(default: %(default)s)")
    parser.add_argument("--system-tokens", type=int, default=512, help="shared system prompt length (default: %(default)s)")
    parser.add_argument("--question-tokens", type=int, default=32, help="each request's own tokens (default: %(default)s)")
    parser.add_argument("--passkey-length", type=int, default=2048, help="passkey_sweep prompt length (default: %(default)s)")
    parser.add_argument("--depths", type=int, default=8, help="passkey_sweep needle depths (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default: %(default)s)")
    parser.add_argument("--concurrent-requests", type=int, default=64,
                        help="concurrent load: requests, each with its own prompt (default: %(default)s)")
    parser.add_argument("--concurrent-in-flight", type=int, default=32,
                        help="concurrent load: requests in flight (default: %(default)s)")
    parser.add_argument("--concurrent-prompt-tokens", type=int, default=128,
                        help="concurrent load: prompt tokens per request (default: %(default)s)")
    parser.add_argument("--concurrent-max-tokens", type=int, default=32,
                        help="concurrent load: tokens generated per request (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs per setting and engine "
                        "(default: %(default)s)")
    parser.add_argument("--no-vllm", action="store_true",
                        help="leave out the vLLM section (recorded as skipped; it is skipped anyway where "
                             "lcx.serve.vllm_plugin.launch.vllm_python() finds no vLLM)")
    parser.add_argument("--vllm-block-size", type=int, default=None,
                        help="vLLM's KV cache block size, the unit its prefix cache reuses (default: vLLM's own, "
                             "128 on CPU, where it takes multiples of 32; lcx's engine uses 16)")
    parser.add_argument("--cell", metavar="PRESET", default=None,
                        help="measure a report passkey cell of this preset (lcx report --presets) with and "
                             "without the cache instead of the two loads (see the description)")
    parser.add_argument("--samples-per-depth", type=int, default=2,
                        help="--cell: passkey prompts per depth (default: %(default)s; the n16 sweep's 16 prompts)")
    parser.add_argument("--compare", type=Path, default=None,
                        help="--cell: a committed report cell, FOLDER/cells/<preset>.lmeval.<length> (from FOLDER's "
                             "cell store, cells/cells.jsonl.xz; a .json.gz suffix is ignored), whose passkey answers "
                             "must be reproduced")
    parser.add_argument("--baseline-at", metavar="REV", default=None,
                        help="--cell: run the no-cache setting on the code of this git commit (a `git archive` "
                             "of it, glibc's allocator defaults where it predates lcx.allocator) and the cache "
                             "setting on this checkout: what a cell costs now against what it cost at REV, "
                             "the two processes at the same time as always")


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


def concurrent_load(cfg: Config, vocab: int) -> list[list[int]]:
    """Prompts that share nothing (each drawn from its own seed)."""
    return [_ids(cfg.concurrent_prompt_tokens, 1000 + i, vocab) for i in range(cfg.concurrent_requests)]


def _drive(add: Any, step: Any, prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
    """Send `prompts` with `concurrency` in flight (a new one joins as one finishes) through an
    engine's step loop: `add(prompt, i) -> request id`, `step() -> [(request id, new token ids,
    finished)]`. Time to first token per request (from its submission to the step that returned its
    first token), wall time, tokens in prompt order. lcx's engine and vLLM's run through this one
    loop, so both are timed the same way."""
    queue = list(enumerate(prompts))
    t_add: dict[str, float] = {}
    ttft: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    index: dict[str, int] = {}
    t0 = time.perf_counter()

    def push() -> None:
        i, p = queue.pop(0)
        t = time.perf_counter()
        rid = add(p, i)
        t_add[rid], index[rid], tokens[rid] = t, i, []

    for _ in range(min(concurrency, len(queue))):
        push()
    done = 0
    while done < len(prompts):
        for rid, ids, finished in step():
            if ids and rid not in ttft:
                ttft[rid] = time.perf_counter() - t_add[rid]
            tokens[rid] += ids
            if finished:
                done += 1
                if queue:
                    push()
    wall = time.perf_counter() - t0
    first = sorted(ttft.values())
    return {"wall_s": wall, "gen_tok_s": sum(len(t) for t in tokens.values()) / wall,
            "prompt_tok_s": sum(map(len, prompts)) / wall, "ttft_p50_s": statistics.median(first),
            "ttft_p90_s": first[min(len(first) - 1, int(0.9 * len(first)))],
            "tokens": [tokens[r] for r in sorted(tokens, key=index.get)]}


def _run_load(engine: Any, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """`prompts` through lcx's engine (`_drive`), its prefix cache emptied first; adds the prompt
    tokens the model computed and the cache's hit rate (hit / looked-up prompt tokens)."""
    from lcx.engine import SamplingParams

    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    stats0 = engine.stats.to_dict()
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    res = _drive(lambda p, i: engine.add_request(p, sp),
                 lambda: [(ev.request_id, ev.token_ids, ev.finished) for ev in engine.step()], prompts, concurrency)
    stats1 = engine.stats.to_dict()
    looked = stats1["prefix_cache_query_tokens"] - stats0["prefix_cache_query_tokens"]
    hit = stats1["prefix_cache_hit_tokens"] - stats0["prefix_cache_hit_tokens"]
    steps = {k: stats1[k] - stats0[k] for k in ("decode_steps", "prefill_batches", "mixed_steps")}
    return {**res, "prompt_tokens_computed": stats1["prompt_tokens_computed"] - stats0["prompt_tokens_computed"],
            "hit_rate": hit / looked if looked else 0.0,
            # steps with decode rows, prefill calls, and the steps that ran both in one forward
            "steps": steps}


# --- vLLM: its offline engine (`LLMEngine`, in the python that has vLLM) on the same loads ---------

def _vllm_counters(engine: Any) -> dict[str, float]:
    """vLLM's prefix-cache counters (its Prometheus metrics, `LLMEngine.get_metrics`): looked-up and
    hit prompt tokens, and the prompt tokens it computed."""
    out = {"queries": 0.0, "hits": 0.0, "computed": 0.0}
    for m in engine.get_metrics():
        if m.name == "vllm:prefix_cache_queries":
            out["queries"] += m.value
        elif m.name == "vllm:prefix_cache_hits":
            out["hits"] += m.value
        elif m.name == "vllm:prompt_tokens_by_source" and m.labels.get("source") == "local_compute":
            out["computed"] += m.value
    return out


def _vllm_run_load(engine: Any, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """`_run_load` for vLLM's `LLMEngine`: the same loop, greedy, ignore_eos; its prefix cache reset first."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    if not engine.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache")
    c0 = _vllm_counters(engine)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    def add(p: list[int], i: int) -> str:
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), sp)
        return str(i)  # outputs carry the id given here (vLLM's internal id adds a suffix)

    res = _drive(add, lambda: [(o.request_id, list(o.outputs[0].token_ids), o.finished) for o in engine.step()],
                 prompts, concurrency)
    c1 = _vllm_counters(engine)
    looked = c1["queries"] - c0["queries"]
    return {**res, "prompt_tokens_computed": int(c1["computed"] - c0["computed"]),
            "hit_rate": (c1["hits"] - c0["hits"]) / looked if looked else 0.0}


def vllm_worker(spec_json: str) -> None:
    """In the python that has vLLM (`VllmEngine` starts it): one vLLM engine, then one load per
    line of stdin (JSON {"prompts", "concurrency", "max_tokens"}; {"quit": true} ends), one JSON
    line back per load. Replies go to the original stdout; vLLM's own prints go to stderr."""
    import gc

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    spec = json.loads(spec_json)
    import vllm
    from vllm import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"], hf_overrides=spec["overrides"],
        enforce_eager=True, seed=0, enable_prefix_caching=spec["cache"], disable_log_stats=False,
        **({"block_size": spec["block_size"]} if spec["block_size"] else {})))
    vc = engine.vllm_config
    proto.write(json.dumps({"vllm": vllm.__version__, "block_size": vc.cache_config.block_size,
                            "enable_prefix_caching": bool(vc.cache_config.enable_prefix_caching),
                            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
                            "max_num_seqs": vc.scheduler_config.max_num_seqs,
                            "chunked_prefill": bool(vc.scheduler_config.enable_chunked_prefill)}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if cmd.get("profile"):  # (`lcx bench step --vs-vllm`: torch.profiler's self time per op)
            from benchmarks.step import profiled

            import functools

            res, ops = profiled(functools.partial(_vllm_run_load, engine, cmd["prompts"], cmd["concurrency"],
                                                  cmd["max_tokens"]))
            res["ops_self_s"] = ops
        else:
            res = _vllm_run_load(engine, cmd["prompts"], cmd["concurrency"], cmd["max_tokens"])
        proto.write(json.dumps(res) + "\n")
    # shut the engine down while the interpreter is whole (lcx.serve.vllm_plugin.score does the same)
    del engine
    gc.collect()


class VllmEngine:
    """vLLM's offline engine in a subprocess of the python `vllm_python()` finds (with
    `vllm_env`'s CPU settings, as `lcx bench serving` and `lcx serve --engine vllm` run it): plain
    vLLM (its own Llama; the length limit raised to `max_model_len`, default RoPE), float32,
    eager, in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core and caller in one
    process, as lcx's engine runs in the benchmark's), prefix caching on or off. `run` sends one
    load and returns `_vllm_run_load`'s numbers."""

    def __init__(self, python: Path, model_dir: str, max_model_len: int, overrides: dict[str, Any], cache: bool,
                 threads: int, log: Path, block_size: int | None = None, env: dict[str, str] | None = None):
        self.python, self.log, self.extra_env = python, log, dict(env or {})
        self.spec = {"model": model_dir, "max_model_len": max_model_len, "overrides": overrides, "cache": cache,
                     "block_size": block_size}
        self.threads = threads
        self.info: dict[str, Any] = {}

    def start(self) -> "VllmEngine":
        from lcx.serve.vllm_plugin.launch import vllm_env

        self.private = tempfile.mkdtemp(prefix="lcx-vllm-")
        env = {**vllm_env(self.private, threads=self.threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               **self.extra_env}
        root = str(ROOT)
        # the repository goes last on sys.path: vLLM finds the installed lcx's metadata first, and the
        # cwd is the private directory (lcx.serve.vllm_plugin.launch says why)
        code = (f"import sys; sys.path.append({root!r}); from benchmarks.prefix import vllm_worker; "
                "vllm_worker(sys.argv[1])")
        self.proc = subprocess.Popen([str(self.python), "-c", code, json.dumps(self.spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(self.log, "w"), env=env, cwd=self.private,
                                     text=True)
        return self

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"the vLLM worker exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def ready(self) -> dict[str, Any]:
        self.info = self._reply()
        return self.info

    def run(self, prompts: list[list[int]], concurrency: int, max_tokens: int, *, profile: bool = False) -> dict[str, Any]:
        """One load; `profile`: under torch.profiler, its self time per op added (`ops_self_s`)."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "concurrency": concurrency,
                                          "max_tokens": max_tokens, "profile": profile}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        import shutil

        if getattr(self, "proc", None) is not None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        shutil.rmtree(getattr(self, "private", ""), ignore_errors=True)


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
    from lcx.allocator import allocator_state

    res["allocator"] = allocator_state()  # the lcx model keeps freed memory for reuse (lcx.allocator)
    atomic_write_json(Path(out), res)


def _children(specs: dict[str, dict[str, Any]], roots: dict[str, Path] | None = None) -> dict[str, dict[str, Any]]:
    """Run `cell_worker` for each spec in its own fresh process, all at once (the settings share
    the machine's conditions: on a shared machine, sequential runs see different loads); each
    process's CPU seconds (user + system) from the kernel's accounting of that child (`wait4`).
    `roots`: a setting's source tree other than this checkout (`--baseline-at`)."""
    with tempfile.TemporaryDirectory() as tmp:
        procs: dict[int, tuple[str, str, float]] = {}
        for name, spec in specs.items():
            root = (roots or {}).get(name, ROOT)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
            out = os.path.join(tmp, f"{name}.json")
            code = (f"import json; from benchmarks.prefix import cell_worker; "
                    f"cell_worker(json.loads({json.dumps(spec)!r}), {out!r})")
            p = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env)
            procs[p.pid] = (name, out, time.perf_counter())
        results: dict[str, dict[str, Any]] = {}
        failed = []
        while procs:
            pid, status, usage = os.wait4(-1, 0)
            if pid not in procs:
                continue
            name, out, t0 = procs.pop(pid)
            if os.waitstatus_to_exitcode(status) != 0:
                failed.append(f"{name} (exit {os.waitstatus_to_exitcode(status)})")
                continue
            res = json.loads(Path(out).read_text())
            res["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)
            res["process_wall_s"] = round(time.perf_counter() - t0, 2)
            results[name] = res
    if failed:
        raise RuntimeError(f"cell worker(s) failed: {', '.join(failed)}")
    return results


def _baseline_tree(rev: str, stack: contextlib.ExitStack) -> tuple[str, Path]:
    """(full sha, a temporary source tree of `rev`): `git archive` of this repository's commit,
    laid out as its pyproject's `package-dir` installs it (lcx.kernels, lcx.eval_tasks, lcx.serve
    live at the top of the repository: linked into lcx/, else those imports would fall through to
    the editable install's current code), checked to import from the tree, and its CPU kernel built
    there before anything is timed (that build is not the cell's cost)."""
    import tomllib

    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                             capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise ValueError(f"--baseline-at: {rev!r} is not a commit of this repository") from e
    tree = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lcx-baseline-")))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    dirs = tomllib.loads((tree / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {}).get(
        "package-dir", {})
    mapped = [pkg for pkg, src in dirs.items() if pkg.startswith("lcx.") and src != pkg.replace(".", "/")]
    for pkg in mapped:
        link = tree / pkg.replace(".", "/")
        if not link.exists():
            link.symlink_to(tree / dirs[pkg], target_is_directory=True)
    check = ("import importlib, json, sys\n"
             f"mods = {['lcx', *mapped]!r}\n"
             "print(json.dumps({m: importlib.import_module(m).__file__ for m in mods}))\n"
             "try:\n    from lcx.kernels.cpu import unavailable\nexcept ImportError:  # a commit without it\n"
             "    unavailable = lambda: None\n"
             "unavailable()\n")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    found = json.loads(subprocess.run([sys.executable, "-c", check], cwd=tree, env=env, check=True,
                                      capture_output=True, text=True).stdout.splitlines()[0])
    outside = {m: f for m, f in found.items() if not Path(f).resolve().is_relative_to(tree.resolve())}
    if outside:
        raise RuntimeError(f"--baseline-at {rev}: these modules do not import from its tree: {outside}")
    return sha, tree


def _answers(cell: dict[str, Any]) -> list[tuple[float, str, float, Any]]:
    return sorted((float(s["depth"]), str(s["key"]), float(s["correct"]), s["output"]) for s in cell["passkey_samples"])


def run_cell(args: argparse.Namespace, threads: int) -> int:
    """`--cell PRESET`: a report passkey cell with and without the prefix cache (module doc)."""
    for name in ("passkey_length", "depths", "samples_per_depth"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _cell_run(args.model, args.cell, args.passkey_length, args.depths, args.samples_per_depth)  # validate
    committed = None
    if args.compare is not None:
        from lcx.report.cells import read_cell  # (the report folder's cell store; read_cell takes the file name too)

        committed = read_cell(args.compare)
    cfg = {"model": args.model, "preset": args.cell, "length": args.passkey_length, "depths": args.depths,
           "samples_per_depth": args.samples_per_depth, "threads": threads,
           "compare": str(args.compare) if args.compare else None}
    out = args.out if args.out != Path(BENCH.out) else Path(
        f"results/prefix_cell_{args.model}_{args.cell}_{args.passkey_length}.json")
    specs = {s: {"model": args.model, "preset": args.cell, "length": args.passkey_length, "depths": args.depths,
                 "per_depth": args.samples_per_depth, "cache": s == "cache", "threads": threads}
             for s in ("no_cache", "cache")}
    roots: dict[str, Path] = {}
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if args.baseline_at is not None:
            sha, roots["no_cache"] = _baseline_tree(args.baseline_at, stack)
            cfg["baseline_at"] = {"rev": args.baseline_at, "sha": sha,
                                  "what": "the no_cache setting ran on the code of this commit, the cache setting "
                                          "on this checkout"}
        rec = BENCH.start(args, cfg, out=out)
        if roots:
            rec.log(f"no_cache runs at {cfg['baseline_at']['sha'][:12]} ({args.baseline_at}), cache on this checkout")
        rec.log("running the cell with and without the prefix cache, one process each, at the same time")
        children = _children(specs, roots)
    for s, r in children.items():
        results[s] = {k: r[k] for k in ("cpu_s", "process_wall_s", "wall_s", "passkey", "passkey_docs",
                                        "prompt_tokens_computed", "prefix_cache_hit_rate", "prefix_cache_on")}
        # a worker older than lcx.allocator (--baseline-at) kept glibc's defaults
        results[s]["allocator"] = r.get("allocator", {"allocator": "system", "reason": "the code predates lcx.allocator"})
        results[s]["answers"] = _answers(r)
        rec.log(f"{s}: {results[s]['cpu_s']} CPU s, passkey {r['passkey']:.3f}")
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


METRICS = ("wall_s", "gen_tok_s", "prompt_tok_s", "ttft_p50_s", "ttft_p90_s", "prompt_tokens_computed", "hit_rate")


def _row(prompts: list[list[int]], conc: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One engine's row of a load: medians over the repeats per setting, the ratios cache / no_cache,
    whether every run gave the same tokens."""
    same = all(r["tokens"] == runs["no_cache"][0]["tokens"] for s in SETTINGS for r in runs[s])
    row: dict[str, Any] = {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                           "concurrency": conc, "same_tokens": same}
    for s in SETTINGS:
        row[s] = {k: round(statistics.median(r[k] for r in runs[s]), 5) for k in METRICS}
        if "steps" in runs[s][0]:  # (lcx's engine: its step counts, the same in every repeat)
            row[s]["steps"] = runs[s][0]["steps"]
    c, n = row["cache"], row["no_cache"]
    row["ratio_cache_vs_no_cache"] = {"gen_tok_s": round(c["gen_tok_s"] / n["gen_tok_s"], 3),
                                      "ttft_p50": round(c["ttft_p50_s"] / n["ttft_p50_s"], 3),
                                      "prompt_tokens_computed": round(c["prompt_tokens_computed"]
                                                                      / n["prompt_tokens_computed"], 3)}
    return row


def _vs_lcx(row: dict[str, Any], lcx_row: dict[str, Any], tokens: list[list[int]],
            lcx_tokens: list[list[int]]) -> dict[str, Any]:
    """vLLM's row beside lcx's from the same run: the ratios vLLM / lcx per setting, and how many
    requests got lcx's greedy tokens (all of them / the first token)."""
    return {
        "ratio_vllm_vs_lcx": {s: {"gen_tok_s": round(row[s]["gen_tok_s"] / lcx_row[s]["gen_tok_s"], 3),
                                  "ttft_p50": round(row[s]["ttft_p50_s"] / lcx_row[s]["ttft_p50_s"], 3),
                                  "prompt_tokens_computed": round(row[s]["prompt_tokens_computed"]
                                                                  / lcx_row[s]["prompt_tokens_computed"], 3)}
                              for s in SETTINGS},
        "same_tokens_as_lcx": tokens == lcx_tokens,
        "requests_same_as_lcx": sum(a == b for a, b in zip(tokens, lcx_tokens)),
        "requests_same_first_token_as_lcx": sum(a[:1] == b[:1] for a, b in zip(tokens, lcx_tokens)),
    }


def _start_vllm(args: argparse.Namespace, max_model_len: int, mpe: int, threads: int,
                log_dir: Path) -> tuple[dict[str, VllmEngine] | None, dict[str, Any]]:
    """vLLM's two engines (cache / no_cache) started side by side, or None and the record's
    `{"skipped": why}` where vLLM is not installed or `--no-vllm` was given."""
    from lcx.models import resolve_source
    from lcx.serve.vllm_plugin.launch import VllmNotInstalled, vllm_python

    if args.no_vllm:
        return None, {"skipped": "--no-vllm"}
    try:
        python = vllm_python()
    except VllmNotInstalled as e:
        print(f"skipping vLLM: {e}", file=sys.stderr)
        return None, {"skipped": str(e)}
    kind, model_dir = resolve_source(args.model)
    if kind == "gguf":  # the weights lcx runs: its dequantized copy, a Hugging Face directory
        from lcx.models import gguf_cache_dir, is_gguf_cached, load_model

        if not is_gguf_cached(model_dir):
            load_model(str(model_dir))
        model_dir = gguf_cache_dir(model_dir)
    elif kind != "hf":
        print(f"skipping vLLM: --model {args.model} is a {kind} file", file=sys.stderr)
        return None, {"skipped": f"--model {args.model} is a {kind} file; the vLLM section runs Hugging Face "
                                 "model directories"}
    overrides = {"max_position_embeddings": max_model_len} if max_model_len > mpe else {}
    from lcx.allocator import ENV as MALLOC_ENV

    env = MALLOC_ENV if getattr(args, "allocator", "system") == "reuse" else {}
    engines = {s: VllmEngine(python, str(model_dir), max_model_len, overrides, s == "cache", threads,
                             log_dir / f"vllm-{s}.log", args.vllm_block_size, env) for s in SETTINGS}
    try:
        for e in engines.values():  # both start at once, then both are waited for
            e.start()
        info = {s: e.ready() for s, e in engines.items()}
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    if not info["cache"]["enable_prefix_caching"] or info["no_cache"]["enable_prefix_caching"]:
        raise RuntimeError(f"vLLM's prefix caching is not as asked: {info}")
    engine = {k: v for k, v in info["cache"].items() if k != "enable_prefix_caching"}
    engine.update(model=str(model_dir), dtype="float32", enforce_eager=True, hf_overrides=overrides,
                  max_model_len=max_model_len, threads=threads, multiprocessing=False)
    return engines, {"engine": engine, "notes": _vllm_notes(engine), "loads": {}}


def _vllm_notes(engine: dict[str, Any]) -> list[str]:
    """How to read the vLLM section (the record's `vllm.notes`)."""
    from lcx.engine import EngineConfig

    return [
        f"vLLM {engine['vllm']} (CPU), its offline engine (vllm.LLMEngine) in a subprocess of the python "
        "lcx.serve.vllm_plugin.launch.vllm_python() finds, with vllm_env's settings: plain vLLM (its own Llama, "
        "no lcx plugin), float32, --enforce-eager, OMP threads = --threads without core binding, "
        "VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core and step loop in one process, as lcx's engine runs "
        "in the benchmark's). Two engines, enable_prefix_caching True and False, alive together; every "
        "repeat runs lcx no_cache, lcx cache, vLLM no_cache, vLLM cache in turn.",
        "The same prompts (token ids, TokensPrompt), greedy, max_tokens, ignore_eos, sent through the same "
        "loop (benchmarks.prefix._drive): `concurrency` requests in flight, a new one added when one "
        "finishes, TTFT from a request's submission to the step that returned its first token. Both "
        "engines run chunked prefill under the same token budget per step "
        f"(max_num_batched_tokens {engine['max_num_batched_tokens']}) and batch limit (max_num_seqs "
        f"{engine['max_num_seqs']}; lcx's engine reads both from vLLM's), each with its own scheduler: vLLM "
        "runs a step's decode rows and prefill chunks in one forward, and so does lcx's engine where its lean "
        "forward runs the model (environment.lcx_engine.mixed_step: EngineConfig.mixed_step; Llama, Mistral, "
        "Qwen2, Qwen3 decoders, tiny-5m and SmolLM2 among them; before 2026-12-07 it ran two); in both, "
        "prompts admitted together reuse each other's shared blocks.",
        f"vLLM's prefix cache works in blocks of {engine['block_size']} tokens (--vllm-block-size; vLLM's CPU "
        f"default is 128), lcx's in blocks of {EngineConfig().prefix_block_size} (EngineConfig.prefix_block_size): "
        "a prompt reuses whole blocks only, so the larger block leaves up to a block more of a shared prefix "
        "to compute. vLLM's hit_rate: its counters vllm:prefix_cache_hits / "
        "vllm:prefix_cache_queries; prompt_tokens_computed: vllm:prompt_tokens_by_source{source=local_compute}.",
        "same_tokens: vLLM with and without its cache gave the same greedy tokens in every run (recorded, not "
        "enforced); same_tokens_as_lcx / requests_same_as_lcx compare vLLM's tokens to lcx's (float32 on both "
        "sides, but different kernels and summation orders: a near-tie on this small model may flip).",
    ]


def run(args: argparse.Namespace) -> int:
    from lcx.engine import Engine, EngineConfig
    from lcx.models import load_model

    if args.cell is not None:
        return run_cell(args, BENCH.resolve_threads(args))
    if args.baseline_at is not None:
        raise ValueError("--baseline-at goes with --cell (it sets where the cell's no-cache setting runs)")

    for name in ("requests", "concurrency", "system_tokens", "question_tokens", "passkey_length", "depths",
                 "max_tokens", "repeats", "concurrent_requests", "concurrent_in_flight", "concurrent_prompt_tokens",
                 "concurrent_max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.vllm_block_size is not None and args.vllm_block_size < 1:
        raise ValueError(f"--vllm-block-size must be >= 1, got {args.vllm_block_size}")
    threads = BENCH.resolve_threads(args)
    cfg = Config(args.model, args.requests, args.concurrency, args.system_tokens, args.question_tokens,
                 args.passkey_length, args.depths, args.max_tokens, args.repeats, threads,
                 args.concurrent_requests, args.concurrent_in_flight, args.concurrent_prompt_tokens,
                 args.concurrent_max_tokens, not args.no_vllm, args.vllm_block_size)
    loadavg: list[float] = []
    rec = BENCH.start(args, cfg, environment={"loadavg_before": os.getloadavg()[0], "loadavg_after_each_load": loadavg})
    if args.allocator == "reuse":  # lcx's engine as `lcx serve` runs it; vLLM's process the same (_start_vllm)
        from lcx.allocator import allocator_state, reuse_freed_memory

        reuse_freed_memory()
        rec.environment["allocator"] = {"setting": "reuse", "lcx": allocator_state(), "vllm_env": "MALLOC_MMAP_MAX_=0, "
                                        "MALLOC_TRIM_THRESHOLD_=2147483647"}
    else:
        rec.environment["allocator"] = {"setting": "system"}
    model, tok = load_model(args.model)
    need = max(max(cfg.system_tokens + cfg.question_tokens, cfg.passkey_length) + cfg.max_tokens,
               cfg.concurrent_prompt_tokens + cfg.concurrent_max_tokens)
    mpe = int(model.config.max_position_embeddings)
    max_model_len = max(need, mpe)
    vocab = int(model.config.vocab_size)
    loads = {"system_prompt": (system_prompt_load(cfg, vocab), cfg.concurrency, cfg.max_tokens),
             "passkey_sweep": (passkey_load(cfg, vocab), 1, cfg.max_tokens),
             "concurrent": (concurrent_load(cfg, vocab), cfg.concurrent_in_flight, cfg.concurrent_max_tokens)}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lcx-prefix-") as logs:
        vllm_engines, vsec = _start_vllm(args, max_model_len, mpe, threads, Path(logs))
        # lcx's engine schedules under vLLM's limits where vLLM runs (its batch limit, max_num_seqs,
        # and its token budget per step, max_num_batched_tokens: chunked prefill), else under
        # the same values as vLLM's CPU defaults, so neither engine waits on a smaller batch
        sched = vsec.get("engine", {})
        max_batch, budget = int(sched.get("max_num_seqs", VLLM_CPU_MAX_NUM_SEQS)), int(
            sched.get("max_num_batched_tokens", VLLM_CPU_MAX_NUM_BATCHED_TOKENS))
        engines = {s: Engine(model, tok, EngineConfig(max_model_len=max_model_len, prefix_caching=(s == "cache"),
                                                      max_batch=max_batch, max_num_batched_tokens=budget))
                   for s in SETTINGS}
        rec.environment["lcx_engine"] = {
            "max_batch": max_batch, "max_num_batched_tokens": budget,
            "packed_linear": engines["cache"].runner.packed, "lean_decode": engines["cache"].runner.lean is not None,
            "mixed_step": engines["cache"].config.mixed_step and engines["cache"].runner.lean is not None}
        try:
            for load in rec.progress(list(loads), unit="load"):
                prompts, conc, max_tokens = loads[load]
                runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
                vruns: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
                for _ in range(cfg.repeats):
                    for s in SETTINGS:  # interleaved
                        runs[s].append(_run_load(engines[s], prompts, conc, max_tokens))
                    for s in SETTINGS if vllm_engines else ():
                        vruns[s].append(vllm_engines[s].run(prompts, conc, max_tokens))
                row = _row(prompts, conc, runs)
                if not row["same_tokens"]:
                    raise RuntimeError(f"{load}: tokens with and without the prefix cache differ")
                results[load] = row
                rec.log(f"{load}: lcx {row['ratio_cache_vs_no_cache']} hit rate {row['cache']['hit_rate']:.2f}")
                if vllm_engines:
                    vrow = _row(prompts, conc, vruns)
                    vrow.update(_vs_lcx(vrow, row, vruns["no_cache"][0]["tokens"], runs["no_cache"][0]["tokens"]))
                    vsec["loads"][load] = vrow
                    rec.log(f"{load}: vLLM {vrow['ratio_cache_vs_no_cache']} hit rate {vrow['cache']['hit_rate']:.2f}, "
                            f"same tokens with/without its cache {vrow['same_tokens']}, as lcx's "
                            f"{vrow['requests_same_as_lcx']}/{len(prompts)}")
                loadavg.append(os.getloadavg()[0])
                rec.save(results, vllm=vsec)
        finally:
            for e in (vllm_engines or {}).values():
                e.close()
    print(f"{'load':15s} {'engine':6s} {'gen tok/s (cache / none)':>26s} {'ttft p50 s (cache / none)':>28s} "
          f"{'hit rate':>9s}")
    for load, row in results.items():
        for name, r in [("lcx", row)] + ([("vLLM", vsec["loads"][load])] if "loads" in vsec else []):
            c, n = r["cache"], r["no_cache"]
            print(f"{load:15s} {name:6s} {c['gen_tok_s']:12.1f} / {n['gen_tok_s']:<11.1f} {c['ttft_p50_s']:13.4f} / "
                  f"{n['ttft_p50_s']:<12.4f} {c['hit_rate']:9.2f}")
    if "skipped" in vsec:
        print(f"vLLM skipped: {vsec['skipped']}")
    rec.finish(results, vllm=vsec)
    return 0


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
