"""`lcx report`'s cells: the fingerprint of what produced a number (code of the modules that
compute it, models, environment), a cell's settings, loading a stored cell only when both match,
and which earlier run a new one may resume (`plan_run`)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

from ..presets import PresetRun
from .config import CELL_KINDS, RULER_PROMPTS, ReportConfig, cell_stem, run_settings
from .measure import DECODE_TIMING

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
    "ruler": _COMMON_MODULES + ("lcx.lmeval_model", "lcx.engine", "lcx._lmeval_hook", "lcx.eval_tasks.ruler_pd"),
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
    from ..models import resolve_source

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


def diff_values(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys where two nested dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in diff_values(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def cell_settings(kind: str, model: str, name: str, run: PresetRun, cfg: ReportConfig, length: int) -> dict[str, Any]:
    """What a cell's numbers depend on besides the fingerprint."""
    common = {"kind": kind, "model": run.model, "method": name, "run": run_settings(run, model), "seed": cfg.seed,
              "length": length, "device": cfg.device, "dtype": cfg.dtype,
              "attn_backend": cfg.attn_backend if run.config.attention else None}
    if kind == "ruler":
        return {**common, "tasks": list(cfg.ruler_tasks), "samples": cfg.ruler_samples, "prompts": RULER_PROMPTS}
    if kind == "lmeval":
        ppl = length in cfg.ppl_lengths
        return {**common, "window_tokens": cfg.ppl_window if ppl else None, "depths": cfg.to_dict()["depths"],
                "samples_per_depth": cfg.samples_per_depth, "ppl_docs": cfg.ppl_docs if ppl else 0}
    return {**common, "decode_tokens": cfg.decode_tokens, "timing": DECODE_TIMING}


def cell_path(out: Path, name: str, kind: str, length: int) -> Path:
    """Where a cell is written: gzipped JSON (cells hold every prompt's output; the repository must
    fit a GPU call's payload, docs/contributing.md). `read_cell` also reads the plain `.json` that
    earlier versions wrote."""
    return out / "cells" / f"{cell_stem(name)}.{kind}.{length}.json.gz"


def read_cell(path: Path) -> Any:
    """A stored cell: `path` (`X.json.gz`), or the plain `X.json` beside it when only that exists
    (cells written before cells were compressed). Raises OSError/ValueError when neither reads."""
    from ..data.io import read_json

    plain = path.with_name(path.name.removesuffix(".gz"))
    return read_json(plain if not path.exists() and plain.exists() else path)


def write_cell(path: Path, cell: dict[str, Any]) -> None:
    """Write a cell atomically (gzipped by its name) and drop a plain-JSON copy an earlier version left."""
    from ..data.io import atomic_write_json

    atomic_write_json(path, cell)
    plain = path.with_name(path.name.removesuffix(".gz"))
    if plain != path:
        plain.unlink(missing_ok=True)


def load_cell(path: Path, settings: dict[str, Any], fingerprint: dict[str, Any],
              runs: "set[str] | str | None" = None, *, other_code: bool = False) -> dict[str, Any] | None:
    """A completed cell with exactly these settings and fingerprint (and measured by one of the
    run ids `runs`, if given), or None (missing, corrupt or different). `other_code=True`
    (`--keep-other-code`) compares the fingerprint without its code part: models, environment
    and cell version must still match."""
    try:
        d = read_cell(path)
    except (OSError, ValueError, EOFError):
        return None
    if not isinstance(d, dict) or d.get("settings") != settings or "result" not in d or not isinstance(d.get("fingerprint"), dict):
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
                               f"({', '.join(diff_values(prev.get('config'), cfg.to_dict()))}): every cell is measured")
    changed = diff_values(prev.get("fingerprint"), fingerprint)
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


def state_dir(out: str | Path) -> Path:
    """Where a report folder's in-progress state lives (#74): its cells' request journals
    (`journal/`) and what runs now (`running.json`), in lcx's cache (`$LCX_CACHE_DIR`, else
    ~/.cache/lcx) under `report-state/<folder>-<hash of its absolute path>`, never in the tracked
    tree: only finished cells are written into `out`/cells/. A sweep resumes on the machine (and
    cache) that holds its journals; under `--ray` the driver's."""
    from ..models.store import cache_root

    out = Path(out).resolve()
    return cache_root() / "report-state" / f"{out.name}-{hashlib.sha256(str(out).encode()).hexdigest()[:12]}"


def journal_dir(out: str | Path) -> Path:
    """The folder of a report's cell journals (`state_dir`)."""
    return state_dir(out) / "journal"


def running_path(out: str | Path) -> Path:
    """`running.json` of a report: the cells in flight (`state_dir`)."""
    return state_dir(out) / "running.json"
