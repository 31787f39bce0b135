"""`lcx report`: one command from install to an extrapolation report.

    lcx report                                   # bundled tiny-ret-5m (retrieves at L0 = 256), ~10 min on 2 CPU cores
    lcx report --model smollm2-135m --lengths 2048,4096,8192 --methods vanilla,yarn,lm_infinite
    lcx report --quick --out /tmp/r              # plumbing check in a minute or two

For each context-extension method (vanilla, linear/PI, NTK, dynamic NTK, YaRN, Giraffe
truncation, LM-Infinite (also with the paper's top-k middle keys), sliding window, StreamingLLM sinks, LM-Infinite + YaRN, Self-Extend, and SWAT;
a preset with sibling models, like SWAT's, runs on the model's sibling trained with the method,
e.g. tiny-5m -> tiny-swat-5m, and is skipped for a model without one) it measures, beyond the
model's training context L0:

- passkey accuracy by context length x needle depth and perplexity by context length, through
  lm-eval's `simple_evaluate` on the lcx tasks `passkey` and `lcx_ppl` with the `lcx` lm-eval
  model (`lcx.lmeval_model.LcxLM`, the same model class as `lm_eval --model lcx`);
- decoding speed (tokens/s after a prompt of L tokens) and KV-cache memory by context length,
  through `lcx.engine.Engine` with the method as an engine method (`rope` / `attention`), i.e.
  the engine `lcx serve` runs (LM-Infinite / windows keep bounded caches there).

No method is re-implemented here: each is a `{"rope": ..., "attention": ...}` config handed to
those two components (`lcx.presets`); a sibling model runs the method its config records. Defaults scale with the model: RoPE factor s =
max(lengths) / L0, LM-Infinite n_global = 10 (the paper's default) and n_local = L0, windows L0.

Output (`--out`, default results/report/): `report.json` (resolved config, environment, every
number; `passkey_intervals`: each passkey cell's correct count k, prompts n and Wilson 95%
interval, recomputed from the stored per-prompt results at every render), `passkey_heatmap.png`
(k/n per depth cell), `passkey_by_length.png` (accuracy with Wilson 95% error bars),
`ppl_by_length.png`, `decode_by_length.png`, `README.md` (the summary tables + images), and `cells/` — one JSON per (method, measurement, length), written
atomically as it finishes, plus `cells/run.json`, the run they belong to.

Measure, not replay. A cell records its settings and a fingerprint of what produced its numbers:
the source of the modules that compute them (`NUMERICS_MODULES`, per measurement), the model's
files, and the environment (python, torch, transformers, lm-eval, tokenizers, device). A
`lcx report` whose last run in `--out` finished starts a new run and recomputes every cell. Only
an interrupted run with the same settings is resumed, and of its completed cells only those whose
own fingerprint is unchanged are kept: the modules of that cell's measurement, the models, the
environment (an engine change re-measures the decode cells, not the lm-eval ones). What was reused
and why is printed, and recorded in report.json. `--reuse` also
keeps cells of finished runs whose settings and fingerprint match (e.g. to redraw plots);
`--fresh` recomputes everything. The cell order is length-major (every method at the shortest
length first), so an interrupted sweep already has complete tables at the shorter lengths.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .method_config import INFERENCE_BACKEND
from .presets import PRESETS, PresetRun
from .presets import resolve as resolve_preset

DEFAULT_METHODS = tuple(name for name, p in PRESETS.items() if p.in_report)  # a new preset runs by default
PPL_METRIC = "word_perplexity"
CELL_KINDS = ("lmeval", "decode")


# ============================================================================================
# Config
# ============================================================================================

@dataclass(frozen=True)
class ReportConfig:
    """What `lcx report` measures. Lengths default to L0 x (1, 2, 4, 8) of the model's context L0."""

    model: str = "tiny-ret-5m"
    methods: tuple[str, ...] = DEFAULT_METHODS
    lengths: tuple[int, ...] | None = None
    depths: int | tuple[float, ...] = 5  # a grid size over [0, 1], or explicit fractions
    samples_per_depth: int = 2  # keys per (depth, length): 10 passkey prompts per cell by default
    ppl_docs: int = 4
    decode_lengths: tuple[int, ...] | None = None
    decode_tokens: int = 32
    seed: int = 0
    device: str = "cpu"  # where the model runs ("cuda" for the GPU report)
    dtype: str = "float32"  # the model's parameter dtype (float32, bfloat16, float16)
    attn_backend: str = INFERENCE_BACKEND  # lcx.attention backend of the attention methods (prefill and decode)

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in PRESETS]
        if unknown:
            raise ValueError(f"unknown report method(s) {unknown}; known: {list(PRESETS)}")
        if not self.methods:
            raise ValueError("methods must name at least one method")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        from .attention import BACKENDS

        if self.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend {self.attn_backend!r} is not an lcx.attention backend; "
                             f"known: {sorted(BACKENDS)}")
        for name in ("lengths", "decode_lengths"):
            v = getattr(self, name)
            if v is not None and (not v or any(not isinstance(x, int) or x < 16 for x in v)):
                raise ValueError(f"{name} must be integers >= 16, got {v!r}")
        if isinstance(self.depths, (list, tuple)):
            d = tuple(self.depths)
            if not d or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1 for x in d):
                raise ValueError(f"depths must be a grid size or fractions in [0, 1], got {self.depths!r}")
            object.__setattr__(self, "depths", tuple(sorted({float(x) for x in d})))
        for name, lo in (("samples_per_depth", 1), ("ppl_docs", 1), ("decode_tokens", 2)) + (
                (("depths", 1),) if not isinstance(self.depths, tuple) else ()):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")

    def resolved(self, context: int) -> "ReportConfig":
        lengths = self.lengths or tuple(context * m for m in (1, 2, 4, 8))
        return dataclasses.replace(self, lengths=tuple(sorted(lengths)),
                                   decode_lengths=tuple(sorted(self.decode_lengths or lengths)))

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


# ============================================================================================
# Methods: name -> config of the components that run them
# ============================================================================================

def run_settings(run: PresetRun, model: str) -> dict[str, Any]:
    """What a cell records of its method: the config's RoPE and attention, and the model it runs
    on when that is not the report's (a preset's sibling, e.g. SWAT's trained model)."""
    d = run.config.to_dict()
    return {"rope": d.get("rope"), "attention": d.get("attention"), "model": run.model if run.model != model else None}


def model_hf_config(model: str) -> dict[str, Any]:
    """The model's config.json (no weights loaded when possible)."""
    from .models import gguf_cache_dir, is_gguf_cached, load_model, resolve_source

    kind, path = resolve_source(model)
    if kind == "gguf":
        if not is_gguf_cached(path):
            load_model(path)  # builds lcx's dequantization cache once
        path = gguf_cache_dir(path)
    return json.loads((Path(path) / "config.json").read_text())


def model_context(model: str) -> int:
    """The model's `max_position_embeddings`, from its config."""
    return int(model_hf_config(model)["max_position_embeddings"])


# ============================================================================================
# Cells
# ============================================================================================

def _tasks_dir() -> str:
    from lcx.eval_tasks import TASKS_DIR

    return str(TASKS_DIR)


def run_lmeval_cell(model: str, run: PresetRun, cfg: ReportConfig, length: int) -> dict[str, Any]:
    """passkey + lcx_ppl at one context length through lm-eval's `simple_evaluate` with the
    `lcx` model. Perplexity windows are cut at max(cfg.lengths) tokens (`window_tokens`), so a
    length scores the same text whether it runs alone or in a sweep."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from .lmeval_model import LcxLM

    lm = LcxLM(pretrained=run.model, batch_size=1, dtype=cfg.dtype, device=cfg.device,
               **run.config.with_default_backend(cfg.attn_backend).to_flat())
    meta = {"tokenizer": run.model, "max_seq_lengths": [length], "window_tokens": max(cfg.lengths),
            "depths": list(cfg.depths) if isinstance(cfg.depths, tuple) else cfg.depths,
            "samples_per_depth": cfg.samples_per_depth, "max_docs": cfg.ppl_docs, "seed": cfg.seed}
    t0 = time.perf_counter()
    tm = TaskManager(include_path=_tasks_dir(), include_defaults=False, metadata=meta)
    res = simple_evaluate(model=lm, tasks=["passkey", "lcx_ppl"], task_manager=tm,
                          metadata=meta, log_samples=True, verbosity="WARNING")
    wall = time.perf_counter() - t0
    L = str(length)
    by_depth: dict[str, list[float]] = {}
    samples = []
    for smp in res["samples"]["passkey"]:
        d = f"{smp['doc']['depth']:.3f}"
        by_depth.setdefault(d, []).append(float(smp[L]))
        resps = smp.get("filtered_resps") or [None]  # one generation per request (one length)
        samples.append({"depth": smp["doc"]["depth"], "key": smp["doc"]["key"], "correct": float(smp[L]),
                        "output": resps[0]})
    ppl = res["results"]["lcx_ppl"]
    return {
        "passkey": res["results"]["passkey"][f"{L},none"],
        "passkey_by_depth": {d: sum(v) / len(v) for d, v in sorted(by_depth.items(), key=lambda kv: float(kv[0]))},
        "passkey_docs": len(samples),
        "passkey_samples": samples,
        "ppl": {m: ppl[f"{m}_{L},none"] for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")},
        "ppl_docs": res["n-samples"]["lcx_ppl"]["effective"],
        "wall_s": round(wall, 2),
    }


def _prompt_ids(tokenizer: Any, n: int) -> list[int]:
    """n tokens of held-out text (the lcx corpus validation split, documents concatenated)."""
    from .data.corpus import load_corpus

    ids: list[int] = []
    for doc in load_corpus("validation"):
        ids += tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the held-out corpus has only {len(ids)} tokens; asked for {n}")


def run_decode_cell(model: str, run: PresetRun, cfg: ReportConfig, length: int) -> dict[str, Any]:
    """Prefill `length` tokens of held-out text, then greedy-decode `decode_tokens` with lcx's
    engine (batch 1): prefill time, decode tokens/s and the peak KV-cache size."""
    import torch

    from .engine import Engine, EngineConfig, SamplingParams
    from .models import load_model

    m, tok = load_model(run.model, dtype=cfg.dtype, device=cfg.device)
    engine = Engine(m, tok, EngineConfig(methods=run.config.with_default_backend(cfg.attn_backend), max_batch=1,
                                         max_model_len=length + cfg.decode_tokens + 1))
    prompt = _prompt_ids(tok, length)
    # one CPU thread: tokens/s from this process's CPU time, which the other processes of a shared
    # machine do not inflate (wall time is recorded too); otherwise (threads, GPU) wall time
    cpu_timed = cfg.device == "cpu" and torch.get_num_threads() == 1
    with torch.inference_mode():
        engine.add_request(prompt, SamplingParams(max_tokens=cfg.decode_tokens, ignore_eos=True))
        t0 = time.perf_counter()
        engine.step()  # prefill + first token
        prefill = time.perf_counter() - t0
        peak, steps, t1, c1 = engine.kv_cache_bytes, 0, time.perf_counter(), time.process_time()
        while engine.has_work():
            engine.step()
            steps += 1
            peak = max(peak, engine.kv_cache_bytes)
        decode, decode_cpu = time.perf_counter() - t1, time.process_time() - c1
    timed = decode_cpu if cpu_timed else decode
    return {"prefill_s": round(prefill, 4), "decode_s": round(decode, 4), "decode_cpu_s": round(decode_cpu, 4),
            "decode_steps": steps, "tokens_per_s": steps / timed if timed > 0 else float("nan"),
            "timing": "process CPU time (1 thread)" if cpu_timed else "wall", "kv_cache_mb": peak / 2**20,
            "threads": torch.get_num_threads()}


CELL_RUNNERS = {"lmeval": run_lmeval_cell, "decode": run_decode_cell}
# How a decode cell times (its settings carry it: cells timed otherwise are measured again).
DECODE_TIMING = "cpu time with one CPU thread, else wall"

# Bump when what a cell measures changes in this file (the modules below are fingerprinted).
CELL_VERSION = 2
# The modules whose source determines a cell's numbers, per measurement (packages: every .py;
# "lcx.hf", the HF adapter, covers lcx.hf.rope_patch, lcx.hf.attention_patch, lcx.hf.recorded, lcx.hf.swat).
_COMMON_MODULES = ("lcx.rope", "lcx.attention", "lcx.masks", "lcx.methods", "lcx.method_config", "lcx.presets",
                   "lcx.hf", "lcx.models", "lcx.cache.kv", "lcx.data.corpus")
NUMERICS_MODULES: dict[str, tuple[str, ...]] = {
    "lmeval": _COMMON_MODULES + ("lcx.lmeval_model", "lcx.eval_tasks.common", "lcx.eval_tasks.base",
                                 "lcx.eval_tasks.passkey", "lcx.eval_tasks.lcx_ppl"),
    "decode": _COMMON_MODULES + ("lcx.engine",),
}


def _module_files(name: str) -> list[Path]:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"fingerprint: module {name!r} not found")
    origin = Path(spec.origin)
    if origin.name == "__init__.py":
        return sorted(origin.parent.rglob("*.py"))
    return [origin]


def code_fingerprint(kind: str) -> dict[str, str]:
    """sha256 (12 hex) of each numerics module's source, for cells of `kind`."""
    out = {}
    for name in NUMERICS_MODULES[kind]:
        h = hashlib.sha256()
        for f in _module_files(name):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        out[name] = h.hexdigest()[:12]
    return out


def model_fingerprint(model: str) -> str:
    """sha256 (12 hex) of a model's files as `lcx.load_model` finds them (config, tokenizer, weights)."""
    from .models import resolve_source

    kind, path = resolve_source(model)
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and p.name != "state.pt")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def env_fingerprint() -> dict[str, str]:
    """The library versions and the device the numbers come from (not the thread count)."""
    import platform
    from importlib import metadata

    import torch

    out = {"python": platform.python_version(), "device": "cpu" if not torch.cuda.is_available()
           else torch.cuda.get_device_name()}
    for pkg in ("torch", "transformers", "lm_eval", "tokenizers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def run_fingerprint(models: list[str]) -> dict[str, Any]:
    return {"cell_version": CELL_VERSION, "code": {k: code_fingerprint(k) for k in CELL_KINDS},
            "models": {m: model_fingerprint(m) for m in sorted(set(models))}, "environment": env_fingerprint()}


def cell_fingerprint(fingerprint: dict[str, Any], kind: str) -> dict[str, Any]:
    """The part of a run's fingerprint that a cell of `kind` depends on: its measurement's code
    (a change to the engine re-measures decode cells, not lm-eval ones), the models, the environment."""
    code = fingerprint.get("code") or {}
    return {**fingerprint, "code": code.get(kind)}


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys where two nested dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def cell_settings(kind: str, model: str, name: str, run: PresetRun, cfg: ReportConfig, length: int) -> dict[str, Any]:
    """What a cell's numbers depend on besides the fingerprint."""
    common = {"kind": kind, "model": run.model, "method": name, "run": run_settings(run, model), "seed": cfg.seed,
              "length": length, "device": cfg.device, "dtype": cfg.dtype,
              "attn_backend": cfg.attn_backend if run.config.attention else None}
    if kind == "lmeval":
        return {**common, "window_tokens": max(cfg.lengths), "depths": cfg.to_dict()["depths"],
                "samples_per_depth": cfg.samples_per_depth, "ppl_docs": cfg.ppl_docs}
    return {**common, "decode_tokens": cfg.decode_tokens, "timing": DECODE_TIMING}


def _cell_path(out: Path, name: str, kind: str, length: int) -> Path:
    return out / "cells" / f"{name.replace('+', '_plus_')}.{kind}.{length}.json"


def load_cell(path: Path, settings: dict[str, Any], fingerprint: dict[str, Any],
              runs: "set[str] | str | None" = None, *, other_code: bool = False) -> dict[str, Any] | None:
    """A completed cell with exactly these settings and fingerprint (and measured by one of the
    run ids `runs`, if given), or None (missing, corrupt or different). `other_code=True`
    (`--keep-other-code`) compares the fingerprint without its code part: models, environment
    and cell version must still match."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if d.get("settings") != settings or "result" not in d or not isinstance(d.get("fingerprint"), dict):
        return None
    kind = settings["kind"]
    have, want = cell_fingerprint(d["fingerprint"], kind), cell_fingerprint(fingerprint, kind)
    if other_code:
        have, want = {**have, "code": None}, {**want, "code": None}
    if have != want:
        return None
    if isinstance(runs, str):
        runs = {runs}
    return d if runs is None or d.get("run_id") in runs else None


def plan_run(out: Path, cfg: ReportConfig, fingerprint: dict[str, Any], *, fresh: bool, reuse: bool
             ) -> tuple[str, "set[str] | None", str]:
    """(run id, the run ids whose stored cells may be kept — None: any matching cell, an empty
    set: none —, why). An interrupted run with the same settings is resumed (its own cells and
    those it kept), cell by cell: a cell is kept only if what it depends on (`cell_fingerprint`)
    is unchanged; anything else starts a new run."""
    new_id = time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
    if fresh:
        return new_id, set(), "--fresh: every cell is recomputed"
    if reuse:
        return new_id, None, "--reuse: cells of any earlier run with the same settings and fingerprint are kept"
    try:
        prev = json.loads((out / "cells" / "run.json").read_text())
    except (OSError, ValueError):
        prev = None
    if prev is None:
        return new_id, set(), "no earlier run here: every cell is measured"
    if prev.get("finished"):
        return new_id, set(), (f"the last run here ({prev.get('run_id')}) finished: every cell is measured "
                               "again (--reuse keeps matching cells)")
    if prev.get("config") != cfg.to_dict():
        return new_id, set(), (f"the interrupted run {prev.get('run_id')} had other settings "
                               f"({', '.join(_diff(prev.get('config'), cfg.to_dict()))}): every cell is measured")
    changed = _diff(prev.get("fingerprint"), fingerprint)
    shared = [c for c in changed if not c.startswith("code.")]
    if shared:
        return new_id, set(), (f"the interrupted run {prev.get('run_id')} ran other models/environment "
                               f"({', '.join(shared)}): every cell is measured")
    keep = {prev["run_id"], *prev.get("kept_runs", [])}
    if changed:
        kinds = sorted({c.split(".")[1] for c in changed})
        return new_id, keep, (f"resuming the interrupted run {prev['run_id']} (same settings); its "
                              f"{'/'.join(kinds)} cells ran other code ({', '.join(changed)}) and are measured again")
    return prev["run_id"], keep, f"resuming the interrupted run {prev['run_id']} (same settings and fingerprint)"


# ============================================================================================
# The run
# ============================================================================================

def run_report(cfg: ReportConfig, out: Path, *, fresh: bool = False, reuse: bool = False, render: bool = False,
               keep_other_code: bool = False, progress: bool = True,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every (method, measurement, length) cell not kept from an interrupted run (see the
    module docstring), then write the report. `render=True` measures nothing: it writes the
    report from the stored cells whose settings and fingerprint match (missing ones show as —),
    e.g. to publish a long sweep's progress."""
    from tqdm.auto import tqdm

    from .data.io import atomic_write_json, environment, git_info

    t_start = time.perf_counter()
    hf_config = model_hf_config(cfg.model)
    context, n_layers = int(hf_config["max_position_embeddings"]), hf_config.get("num_hidden_layers")
    cfg = cfg.resolved(context)
    factor = max(cfg.lengths) / context
    runs: dict[str, PresetRun] = {}
    skipped: dict[str, str] = {}
    for name in cfg.methods:
        r = resolve_preset(name, cfg.model, L0=context, factor=max(1.0, factor), n_layers=n_layers)
        if isinstance(r, str):
            skipped[name] = r
            log(f"skipping {name}: {r}")
        else:
            runs[name] = r
    fingerprint = run_fingerprint([cfg.model] + [r.model for r in runs.values() if r.model != cfg.model])
    if render:
        run_id, keep, why = "render", None, "--render: stored cells with matching settings and fingerprint"
    else:
        run_id, keep, why = plan_run(out, cfg, fingerprint, fresh=fresh, reuse=reuse)
    log(f"lcx report: {why}")
    manifest = {"run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "finished": False,
                "config": cfg.to_dict(), "fingerprint": fingerprint,
                "kept_runs": sorted(keep - {run_id}) if keep else []}
    if not render:
        atomic_write_json(out / "cells" / "run.json", manifest)
    cells: dict[str, dict[str, dict[str, Any]]] = {name: {k: {} for k in CELL_KINDS} for name in runs}
    todo = [(name, kind, L) for L in sorted(set(cfg.lengths) | set(cfg.decode_lengths)) for name in runs
            for kind in CELL_KINDS if L in (cfg.lengths if kind == "lmeval" else cfg.decode_lengths)]
    bar = tqdm(todo, desc="report cells", unit="cell", disable=not progress)
    reused: list[str] = []
    other_code: dict[str, dict[str, Any]] = {}  # kept cells measured by other code (--keep-other-code)
    measured_s = 0.0
    for name, kind, L in bar:
        bar.set_postfix_str(f"{name}/{kind}/{L}")
        settings = cell_settings(kind, cfg.model, name, runs[name], cfg, L)
        path = _cell_path(out, name, kind, L)
        stored = (load_cell(path, settings, fingerprint, keep, other_code=keep_other_code)
                  if keep is None or keep else None)
        if stored is not None:
            cells[name][kind][str(L)] = stored["result"]
            reused.append(f"{name}/{kind}/{L}")
            code_diff = _diff(cell_fingerprint(stored["fingerprint"], kind)["code"],
                              cell_fingerprint(fingerprint, kind)["code"])
            if code_diff:
                other_code[f"{name}/{kind}/{L}"] = {"run_id": stored.get("run_id"), "modules": code_diff}
            if stored.get("run_id") != run_id and stored.get("run_id") not in manifest["kept_runs"]:
                manifest["kept_runs"].append(stored["run_id"])
                if not render:  # a resumed run keeps what this one kept
                    atomic_write_json(out / "cells" / "run.json", manifest)
            continue
        if render:
            continue
        t0 = time.perf_counter()
        result = CELL_RUNNERS[kind](cfg.model, runs[name], cfg, L)
        dt = time.perf_counter() - t0
        measured_s += dt
        atomic_write_json(path, {"settings": settings, "fingerprint": fingerprint, "run_id": run_id,
                                 "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": round(dt, 2),
                                 "result": result})
        cells[name][kind][str(L)] = result
        if kind == "lmeval":
            bar.write(f"  {name} @ {L}: passkey {result['passkey']:.2f}, {PPL_METRIC} "
                      f"{result['ppl'][PPL_METRIC]:.1f} ({dt:.0f} s)")
        else:
            bar.write(f"  {name} @ {L}: decode {result['tokens_per_s']:.1f} tok/s, KV {result['kv_cache_mb']:.1f} MB "
                      f"({dt:.0f} s)")
    if reused:
        log(f"kept {len(reused)} of {len(todo)} cells from run {run_id} ({why.split(':')[0]}); measured "
            f"{len(todo) - len(reused)}")
    if other_code:
        log("lcx report:" + _other_code_note({"cells_kept_with_other_code": other_code}))
    if not render:
        atomic_write_json(out / "cells" / "run.json", {**manifest, "finished": True,
                                                       "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    record = {
        "description": "lcx report: context-extension methods beyond the training context",
        "config": {**cfg.to_dict(), "context": context, "rope_factor": factor,
                   "methods_resolved": {n: r.to_dict() for n, r in runs.items()}, "methods_skipped": skipped,
                   "tasks": ["passkey", "lcx_ppl"], "ppl_metric": PPL_METRIC},
        "environment": environment(), "git": git_info(Path(__file__).resolve().parents[1]),
        "fingerprint": fingerprint, "run_id": run_id,
        "wall_s": round(time.perf_counter() - t_start, 1), "measured_s": round(measured_s, 1),
        "cells_total": len(todo), "cells_reused": len(reused), "reuse_reason": why if reused else None,
        "cells_kept_with_other_code": other_code,
        "results": cells,
    }
    record["passkey_intervals"] = passkey_intervals(record)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", record)
    plot_report(record, out)
    from .data.io import atomic_write_text

    atomic_write_text(out / "README.md", markdown(record))
    return record


# ============================================================================================
# Plots and Markdown
# ============================================================================================

def _cell(record: dict[str, Any], name: str, kind: str, L: Any) -> dict[str, Any] | None:
    return record["results"].get(name, {}).get(kind, {}).get(str(L))


def _get(record: dict[str, Any], name: str, kind: str, L: Any, *keys: str) -> float:
    """A number of a cell, NaN where the cell was not measured (a report rendered mid-run)."""
    v: Any = _cell(record, name, kind, L)
    for k in keys:
        if v is None:
            break
        v = v.get(k)
    return float("nan") if v is None else float(v)


def passkey_counts(cell: dict[str, Any] | None, depth: str | None = None) -> tuple[int, int] | None:
    """(correct, prompts) of a passkey cell (of its prompts at `depth`, a "%.3f" key of
    passkey_by_depth, if given), from its per-prompt results; a cell stored without them falls
    back to accuracy x prompts. None: not measured."""
    if not cell:
        return None
    smp = cell.get("passkey_samples")
    if smp:
        if depth is not None:
            smp = [x for x in smp if f"{x['depth']:.3f}" == depth]
        return (round(sum(float(x["correct"]) for x in smp)), len(smp)) if smp else None
    if depth is not None:
        return None
    n, acc = cell.get("passkey_docs"), cell.get("passkey")
    return (round(acc * n), n) if n and acc is not None else None


def passkey_interval(cell: dict[str, Any] | None) -> dict[str, Any] | None:
    """{"k", "n", "acc", "lo", "hi"}: a passkey cell's accuracy k/n with its Wilson 95% interval."""
    from .stats import wilson_interval

    c = passkey_counts(cell)
    if c is None or c[1] == 0:
        return None
    (k, n), (lo, hi) = c, wilson_interval(*c)
    return {"k": k, "n": n, "acc": k / n, "lo": lo, "hi": hi}


def passkey_intervals(record: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """method -> length -> `passkey_interval` of every measured passkey cell."""
    return {name: {str(L): iv for L in record["config"]["lengths"]
                   if (iv := passkey_interval(_cell(record, name, "lmeval", L))) is not None}
            for name in record["results"]}


def format_interval(iv: dict[str, Any] | None) -> str:
    """`0.75 [0.30, 0.95] n=4` (accuracy, Wilson 95% interval, prompts); — when not measured."""
    return "—" if iv is None else f"{iv['acc']:.2f} [{iv['lo']:.2f}, {iv['hi']:.2f}] n={iv['n']}"


def plot_report(record: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .data.io import atomic_savefig

    res, ctx = record["results"], record["config"]["context"]
    names = list(res)
    lengths = [int(L) for L in record["config"]["lengths"]]
    ncol = min(4, len(names))
    nrow = math.ceil(len(names) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.1 * ncol, 2.6 * nrow), squeeze=False, constrained_layout=True)
    im = None
    for ax, name in zip(axes.flat, names):
        depths = sorted({d for L in lengths for d in (_cell(record, name, "lmeval", L) or {}).get("passkey_by_depth", {})},
                        key=float)
        grid = [[_get(record, name, "lmeval", L, "passkey_by_depth", d) for L in lengths] for d in depths]
        if depths:
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for (r, d), (c, L) in ((rd, cl) for rd in enumerate(depths) for cl in enumerate(lengths)):
                kn = passkey_counts(_cell(record, name, "lmeval", L), d)
                if kn is not None:  # k/n: the prompts behind each colour
                    ax.text(c, r, f"{kn[0]}/{kn[1]}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(lengths)), lengths, fontsize=7, rotation=45)
        ax.set_yticks(range(len(depths)), [f"{float(d):.0%}" for d in depths], fontsize=7)
        if ctx in lengths:
            ax.axvline(lengths.index(ctx) + 0.5, color="k", lw=1, ls="--")
        ax.set_title(name, fontsize=9)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.6, label="passkey accuracy")
    fig.suptitle(f"passkey accuracy: needle depth x context length ({record['config']['model']}, "
                 f"trained context {ctx}, dashed; k/n correct per cell)", fontsize=10)
    atomic_savefig(fig, out / "passkey_heatmap.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.5), constrained_layout=True)
    ivs = passkey_intervals(record)
    for i, name in enumerate(names):
        pts = [(L, ivs[name][str(L)]) for L in lengths if str(L) in ivs.get(name, {})]
        if not pts:
            continue
        xs = [L * 2 ** (0.2 * (i - (len(names) - 1) / 2) / max(1, len(names) - 1)) for L, _ in pts]  # dodge
        acc = [iv["acc"] for _, iv in pts]
        err = [[a - iv["lo"] for a, (_, iv) in zip(acc, pts)], [iv["hi"] - a for a, (_, iv) in zip(acc, pts)]]
        ax.errorbar(xs, acc, yerr=err, marker="o", ms=4, capsize=2, lw=1, label=name,
                    ls="-" if i < 10 else "--", color=f"C{i % 10}")
    ax.axvline(ctx, color="k", lw=1, ls=":", label=f"trained context {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(L) for L in lengths])
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("passkey accuracy (Wilson 95% interval)")
    ns = sorted({iv["n"] for m in ivs.values() for iv in m.values()})
    ax.set_title(f"passkey accuracy by context length · {record['config']['model']} · n = "
                 f"{', '.join(map(str, ns)) or '—'} prompts per point", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    atomic_savefig(fig, out / "passkey_by_length.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for i, name in enumerate(names):
        ax.plot(lengths, [_get(record, name, "lmeval", L, "ppl", PPL_METRIC) for L in lengths], marker="o",
                label=name, ls="-" if i < 10 else "--", color=f"C{i % 10}")
    ax.axvline(ctx, color="k", lw=1, ls=":", label=f"trained context {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"{PPL_METRIC.replace('_', ' ')} (lcx_ppl, lower is better)")
    ax.set_title(f"perplexity by context length · {record['config']['model']}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    atomic_savefig(fig, out / "ppl_by_length.png", dpi=110)
    plt.close(fig)

    dl = [int(L) for L in record["config"]["decode_lengths"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for i, name in enumerate(names):
        style = dict(marker="o", label=name, ls="-" if i < 10 else "--", color=f"C{i % 10}")
        a1.plot(dl, [_get(record, name, "decode", L, "tokens_per_s") for L in dl], **style)
        a2.plot(dl, [_get(record, name, "decode", L, "kv_cache_mb") for L in dl], **style)
    for a, label in ((a1, "decode tokens / s"), (a2, "KV cache (MB, peak)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("prompt length (tokens)")
        a.set_ylabel(label)
        a.axvline(ctx, color="k", lw=1, ls=":")
    if any(math.isfinite(x) and x > 0 for n in names for L in dl for x in [_get(record, n, "decode", L, "kv_cache_mb")]):
        a2.set_yscale("log")  # (a report rendered before any decode cell has nothing to log-scale)
    a1.legend(fontsize=7, ncol=2)
    fig.suptitle(f"decoding with lcx.engine after a prompt of L tokens · {record['config']['model']}", fontsize=10)
    atomic_savefig(fig, out / "decode_by_length.png", dpi=110)
    plt.close(fig)


def _fmt(x: float, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _other_code_note(record: dict[str, Any]) -> str:
    oc = record.get("cells_kept_with_other_code") or {}
    if not oc:
        return ""
    mods = sorted({m for c in oc.values() for m in c["modules"]})
    return (f" Kept with `--keep-other-code`: {len(oc)} cell(s) measured by lcx code that differs from this "
            f"checkout's in {', '.join(f'`{m}`' for m in mods)} (listed in report.json).")


def markdown(record: dict[str, Any]) -> str:
    c, res = record["config"], record["results"]
    lengths, dl = c["lengths"], c["decode_lengths"]
    env = record["environment"]
    n_pk = max([(_cell(record, n, "lmeval", L) or {}).get("passkey_docs", 0) for n in res for L in lengths] or [0])
    done = sum(1 for n in res for k in CELL_KINDS for _ in res[n][k])
    status = ("" if done == record.get("cells_total", done) else
              f" **Partial: {done} of {record['cells_total']} cells measured so far** (— = not yet).")
    lines = [f"# lcx report · {c['model']}", "",
             f"Trained context L0 = {c['context']}; lengths {lengths}; RoPE factor s = {c['rope_factor']:g} "
             + (f"(max length / L0). Rendered by `lcx report --render` from {record['cells_reused']} of "
                f"{record.get('cells_total', '?')} stored cells (each cell's run id and wall time are in cells/)."
                if record.get("run_id") == "render" else
                f"(max length / L0). Produced by `lcx report` in {record['wall_s']:.0f} s wall "
                f"({record.get('measured_s', record['wall_s']):.0f} s measuring; {record['cells_reused']} of "
                f"{record.get('cells_total', '?')} cells kept from run {record.get('run_id', '?')}).") + status
             + _other_code_note(record), "",
             f"## Passkey accuracy by context length ({n_pk} prompts per cell: depths {c['depths']} x "
             f"{c['samples_per_depth']} keys)", "",
             "Each cell: accuracy [Wilson 95% interval] n=prompts. Two methods differ only where their "
             "intervals say so (the same prompts run for every method; non-overlapping intervals are a "
             "conservative test).", "",
             "| method | " + " | ".join(str(L) for L in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for name in res:
        lines.append(f"| {name} | " + " | ".join(format_interval(passkey_interval(_cell(record, name, "lmeval", L)))
                                                 for L in lengths) + " |")
    lines += ["", "![passkey accuracy by length](passkey_by_length.png)", "",
              "![passkey heatmap](passkey_heatmap.png)", "",
              f"## Perplexity ({PPL_METRIC}, `lcx_ppl`: {c['ppl_docs']} windows of held-out text per length)", "",
              "| method | " + " | ".join(str(L) for L in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for name in res:
        lines.append(f"| {name} | " + " | ".join(_fmt(_get(record, name, "lmeval", L, "ppl", PPL_METRIC), ".1f")
                                                 for L in lengths) + " |")
    lines += ["", "![perplexity by length](ppl_by_length.png)", "",
              f"## Decoding ({c['decode_tokens']} greedy tokens after a prompt of L tokens, lcx.engine, batch 1)", "",
              "| method | " + " | ".join(f"{L} tok/s" for L in dl) + " | " + " | ".join(f"{L} KV MB" for L in dl) + " |",
              "|---|" + "---:|" * (2 * len(dl))]
    def tps(name: str, L: Any) -> str:
        x, base = _get(record, name, "decode", L, "tokens_per_s"), _get(record, "vanilla", "decode", L, "tokens_per_s")
        ratio = f" ({x / base:.2f}×)" if "vanilla" in res and math.isfinite(x) and math.isfinite(base) and base else ""
        return _fmt(x, ".1f") + ratio

    for name in res:
        lines.append(f"| {name} | " + " | ".join(tps(name, L) for L in dl) + " | "
                     + " | ".join(_fmt(_get(record, name, "decode", L, "kv_cache_mb"), ".2f") for L in dl) + " |")
    timing = {(_cell(record, n, "decode", L) or {}).get("timing") for n in res for L in dl} - {None}
    lines += ["", "tok/s (× vanilla at the same length); each cell measured on its own, one after another, "
              f"timed by {' / '.join(sorted(timing)) or 'wall clock'}: compare ratios with the noise of one "
              "run in mind (`lcx bench decode` interleaves the methods for a controlled comparison).", "",
              "![decoding by length](decode_by_length.png)", "", "## Methods (resolved)", ""]
    for name, m in c["methods_resolved"].items():
        lines.append(f"- **{name}**: `{json.dumps({k: v for k, v in m.items() if v})}`")
    for name, why in c["methods_skipped"].items():
        lines.append(f"- **{name}**: skipped — {why}")
    wall = {n: sum((_cell(record, n, k, L) or {}).get("wall_s", 0) for k in ("lmeval",) for L in lengths) for n in res}
    lines += ["", "## Settings and environment", "", "```json",
              json.dumps({k: v for k, v in c.items() if k not in ("methods_resolved", "methods_skipped")}, indent=1),
              "```", "",
              f"torch {env.get('torch')}, transformers {env.get('transformers')}, python {env.get('python')}, "
              f"{env.get('cpu_count', '?')} CPUs; git {record['git'].get('sha', '?')[:12]}"
              f"{' (dirty)' if record['git'].get('dirty') else ''}. lm-eval seconds per method (all lengths): "
              + ", ".join(f"{n} {w:.0f}" for n, w in wall.items()) + ".",
              "Timings come from whatever machine ran the report; compare methods within one report.", ""]
    return "\n".join(lines)


# ============================================================================================
# CLI
# ============================================================================================

QUICK = dict(depths=2, samples_per_depth=1, ppl_docs=1, decode_tokens=8)


def _depths(s: str) -> int | tuple[float, ...]:
    try:
        return int(s) if "," not in s and "." not in s else tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a grid size or comma-separated fractions, got {s!r}") from None


def _int_list(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n", 2)[2].split("Output")[0]
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--model", default="tiny-ret-5m", help="preset, HF directory or .gguf (default: %(default)s)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated subset of: " + ", ".join(PRESETS) + " (default: all)")
    p.add_argument("--lengths", type=_int_list, default=None,
                   help="context lengths for passkey/perplexity (default: L0 x 1,2,4,8)")
    p.add_argument("--decode-lengths", type=_int_list, default=None, help="prompt lengths for decoding (default: --lengths)")
    p.add_argument("--depths", type=_depths, default=ReportConfig.depths,
                   help="needle depths per length: a grid size over [0, 1] (default: %(default)s) or "
                        "comma-separated fractions, e.g. 0.1,0.37,0.63,0.9")
    p.add_argument("--samples-per-depth", type=int, default=ReportConfig.samples_per_depth)
    p.add_argument("--ppl-docs", type=int, default=ReportConfig.ppl_docs, help="held-out documents for perplexity")
    p.add_argument("--decode-tokens", type=int, default=ReportConfig.decode_tokens)
    p.add_argument("--seed", type=int, default=0)
    from .threads import add_threads_argument

    add_threads_argument(p)
    p.add_argument("--device", default=ReportConfig.device, help="cpu or cuda[:N] (default: %(default)s)")
    p.add_argument("--dtype", default=ReportConfig.dtype, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default: %(default)s)")
    p.add_argument("--attn-backend", default=ReportConfig.attn_backend,
                   help="lcx.attention backend of the attention methods' prefill and decode (default: "
                        "%(default)s: torch's fused flash kernels composed into the windowed mask; e.g. "
                        "triton on a GPU, blockwise, sdpa)")
    p.add_argument("--out", type=Path, default=Path("results/report"), help="output folder (default: %(default)s)")
    p.add_argument("--fresh", action="store_true",
                   help="recompute every cell, even of an interrupted run (default: resume an interrupted run "
                        "with the same settings and code; a finished one is measured again)")
    p.add_argument("--keep-other-code", action="store_true",
                   help="keep stored cells (of the interrupted run; with --reuse/--render, any matching ones) even "
                        "if the lcx code that measured them differs from this checkout's -- for a change you know "
                        "does not touch the numbers (a refactor, a new preset) in a sweep too long to redo. Settings, "
                        "models and environment must still match; the report lists every such cell and the modules "
                        "that differ (report.json: cells_kept_with_other_code)")
    p.add_argument("--reuse", action="store_true",
                   help="keep stored cells of any earlier run whose settings and code/model/environment "
                        "fingerprint match (e.g. to redraw plots)")
    p.add_argument("--render", action="store_true",
                   help="measure nothing: write the report from the stored matching cells (a sweep's progress)")
    p.add_argument("--quick", action="store_true", help="plumbing check: 2 depths, 1 ppl doc, 8 decode tokens")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    extra = dict(QUICK) if args.quick else {}
    try:
        cfg = ReportConfig(
            model=args.model, methods=tuple(m for m in args.methods.split(",") if m), lengths=args.lengths,
            decode_lengths=args.decode_lengths,
            depths=extra.get("depths", args.depths), samples_per_depth=args.samples_per_depth,
            ppl_docs=extra.get("ppl_docs", args.ppl_docs), decode_tokens=extra.get("decode_tokens", args.decode_tokens),
            seed=args.seed, device=args.device, dtype=args.dtype, attn_backend=args.attn_backend)
    except ValueError as e:
        print(f"lcx report: {e}", file=sys.stderr)
        return 2
    from .threads import resolve_threads

    resolve_threads(args.threads)
    if args.render and (args.fresh or args.reuse):
        print("lcx report: --render measures nothing; it cannot be combined with --fresh/--reuse", file=sys.stderr)
        return 2
    record = run_report(cfg, args.out, fresh=args.fresh, reuse=args.reuse, render=args.render,
                        keep_other_code=args.keep_other_code)
    print(markdown(record).split("## Methods")[0])
    print(f"wrote {args.out / 'README.md'}, report.json and 4 PNGs")
    return 0
