"""`lcx report`'s cells: the fingerprint of what produced a number (code of the modules that
compute it, models, environment), a cell's settings, loading a stored cell only when both match,
which earlier run a new one may resume (`plan_run`), and the cell store: one xz-compressed JSON
Lines file per report folder, `cells/cells.jsonl.xz`, written atomically under a lock, that
also reads the one-file-per-cell layout of earlier versions (below, "The cell store": the layout
and why)."""

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
# the same task code, another question (#76); and lcx.engine, which decodes the answers (the lcx
# lm-eval model's generate_until) though "lmeval" does not list it (its cells keep their fingerprint)
NUMERICS_MODULES["passkey_primed"] = NUMERICS_MODULES["lmeval"] + ("lcx.engine",)


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
    if kind == "passkey_primed":
        return {**common, "depths": cfg.to_dict()["depths"], "samples_per_depth": cfg.samples_per_depth}
    if kind == "lmeval":
        ppl = length in cfg.ppl_lengths
        return {**common, "window_tokens": cfg.ppl_window if ppl else None, "depths": cfg.to_dict()["depths"],
                "samples_per_depth": cfg.samples_per_depth, "ppl_docs": cfg.ppl_docs if ppl else 0}
    return {**common, "decode_tokens": cfg.decode_tokens, "timing": DECODE_TIMING}


def cell_path(out: Path, name: str, kind: str, length: int) -> Path:
    """A cell's address, `out`/cells/`<method>.<kind>.<length>`: the record of that name in the
    folder's store (`store_path`), not a file of its own. `read_cell`/`write_cell`/`load_cell`
    take it (or an earlier version's file name, `<stem>.json.gz`/`<stem>.json`, which they read too)."""
    return out / "cells" / f"{cell_stem(name)}.{kind}.{length}"


def read_cell(path: Path) -> Any:
    """A stored cell by its address (`cell_path`): the folder's store first, then the file an
    earlier version wrote (`<stem>.json.gz`, else plain `<stem>.json`; `path` may name either).
    Raises OSError (FileNotFoundError when it is nowhere)/ValueError when it does not read."""
    cells, stem = _split(path)
    text = _read_store(cells)["cells"].get(stem)
    if text is not None:
        return json.loads(text)["data"]
    from ..data.io import read_json

    for legacy in _legacy_files(cells, stem, Path(path).name):
        if legacy.exists():
            return read_json(legacy)
    raise FileNotFoundError(f"no cell {stem!r} in {store_path(cells.parent)} (nor {cells / (stem + '.json.gz')})")


def write_cell(path: Path, cell: dict[str, Any]) -> None:
    """Store a cell at its address (`cell_path`), atomically (`update_store`)."""
    cells, stem = _split(path)
    update_store(cells.parent, cells={stem: cell})


def remove_cell(path: Path) -> bool:
    """Drop a stored cell (from the store and any earlier version's file); True if it was there."""
    cells, stem = _split(path)
    had = stem in read_cells(cells.parent)
    update_store(cells.parent, drop=(stem,))
    return had


def load_cell(path: Path, settings: dict[str, Any], fingerprint: dict[str, Any],
              runs: "set[str] | str | None" = None, *, other_code: bool = False) -> dict[str, Any] | None:
    """A completed cell with exactly these settings and fingerprint (and measured by one of the
    run ids `runs`, if given), or None (missing, corrupt or different). `other_code=True`
    (`--keep-other-code`) compares the fingerprint without its code part: models, environment
    and cell version must still match."""
    try:
        d = read_cell(path)
    except CellStoreError:
        raise  # a damaged store: said, never taken for missing cells
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
        prev = read_run(out)
    except (OSError, ValueError, EOFError):
        prev = None
    if prev is None:
        return new_id, set(), "no earlier run here: every cell is measured"
    if prev.get("finished"):
        return new_id, set(), (f"the last run here ({prev.get('run_id')}) finished: every cell is measured "
                               "again (--reuse keeps matching cells)")
    if prev.get("config") != cfg.to_dict():
        return new_id, set(), (f"the interrupted run {prev.get('run_id')} had other settings "
                               f"({', '.join(diff_values(prev.get('config'), cfg.to_dict()))}): every cell is measured")
    before = (prev.get("fingerprint") or {}).get("code") or {}
    # (a cell kind newer than the interrupted run, e.g. passkey_primed, has no cells in it: no change)
    changed = [c for c in diff_values(prev.get("fingerprint"), fingerprint)
               if not (c.startswith("code.") and c.split(".")[1] not in before)]
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


# The cell store
# ============================================================================================
#
# One file per report folder, `cells/cells.jsonl.xz`: JSON Lines compressed with xz (stdlib lzma).
# Line 1 names the format, then the run manifest (`{"run": ...}`, what `cells/run.json` held),
# then one line per cell, `{"cell": "<method>.<kind>.<length>", "data": <the cell>}`, sorted by
# name, so the same cells give the same bytes. Why this layout (docs/report.md, "The cell store"):
# what a report commits is one file, not a file per cell; xz over all of a report's cells shares
# what cells repeat (settings, fingerprints, prompts, answers): results/report's 121 cells took
# 274 KB as per-cell gzip, 169 KB as one gzip and 89 KB as one xz; lines stay greppable
# (`xzcat cells/cells.jsonl.xz | grep '"cell":"vanilla.'`) and need nothing beyond the standard
# library. A columnar file (Parquet) would need pyarrow and suits tables, and a cell is a nested
# record (per-prompt answers, settings, fingerprints). Each write rewrites the whole store (0.3 s
# for results/report's, against cells that take minutes): atomically (a temporary file, then
# os.replace: a writer killed mid-write leaves the previous store whole) and under an exclusive
# flock of the `cells/` folder, so writers in several processes (a driver and a second
# `lcx report` on the same folder) lose nothing. Today one process writes a report's cells:
# the driver (`--jobs` workers and Ray tasks return their results to it). Readers take no lock.
# Cells an earlier version wrote one per file (`cells/<stem>.json.gz`, plain `<stem>.json`,
# `cells/run.json`) are still read (the store first); the first write into such a folder
# moves them into the store and deletes the files (`migrate_cells`, `lcx report --compact-cells`).

STORE_NAME = "cells.jsonl.xz"
STORE_HEADER = {"format": "lcx report cells", "version": 1}
_RUN_JSON = "run.json"
_STORE_CACHE: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}  # path -> (stat, parsed)


class CellStoreError(ValueError):
    """A report's cell store that does not read (not written by lcx, or damaged): raised, never
    treated as empty, so no write replaces the cells it holds."""


def store_path(out: str | Path) -> Path:
    """The cell store of the report folder `out`."""
    return Path(out) / "cells" / STORE_NAME


def _split(path: str | Path) -> tuple[Path, str]:
    """(the cells folder, the cell's name) of a cell address or an earlier version's cell file."""
    path = Path(path)
    name = path.name
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix):
            return path.parent, name[: -len(suffix)]
    return path.parent, name


def _legacy_files(cells: Path, stem: str, given: str = "") -> list[Path]:
    """An earlier version's files of a cell, in the order they are read (`given`: a file name the
    caller named, read first)."""
    names = [f"{stem}.json.gz", f"{stem}.json"]
    if given in names:
        names.remove(given)
        names.insert(0, given)
    return [cells / n for n in names]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _read_store(cells: Path, *, fresh: bool = False) -> dict[str, Any]:
    """The store in the folder `cells`, parsed: {"run": its line or None, "cells": {name: line}}
    (each line kept as text: a reader parses only the cell it asks for). Cached while the file is
    the same (a write replaces it: another inode); `fresh`: read it whatever the cache holds (a
    writer, under the lock). Missing: empty."""
    path = cells / STORE_NAME
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return {"run": None, "cells": {}}
    with f:  # (the stat and the bytes of one file, whatever replaces it meanwhile)
        st = os.fstat(f.fileno())
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        key = str(path.resolve())
        hit = _STORE_CACHE.get(key)
        if hit is not None and hit[0] == sig and not fresh:
            return hit[1]
        data = f.read()
    import lzma

    try:
        text = lzma.decompress(data).decode("utf-8")
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if not lines or json.loads(lines[0]) != STORE_HEADER:
            raise ValueError(f"its first line is not {_dumps(STORE_HEADER)}")
        parsed: dict[str, Any] = {"run": None, "cells": {}}
        for line in lines[1:]:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError(f"a line that is not an object: {line[:80]!r}")
            if "run" in rec:
                parsed["run"] = line
            elif isinstance(rec.get("cell"), str) and "data" in rec:
                parsed["cells"][rec["cell"]] = line
            else:
                raise ValueError(f"a line that is neither a cell nor the run: {line[:80]!r}")
    except (lzma.LZMAError, EOFError, UnicodeDecodeError, ValueError) as e:
        raise CellStoreError(f"{path}: not a readable lcx cell store ({e})") from None
    if len(_STORE_CACHE) >= 16:
        _STORE_CACHE.clear()
    _STORE_CACHE[key] = (sig, parsed)
    return parsed


def _legacy_cells(cells: Path) -> dict[str, list[Path]]:
    """An earlier version's cell files in `cells`, by cell name (gzipped first)."""
    out: dict[str, list[Path]] = {}
    if not cells.is_dir():
        return out
    for f in sorted(cells.iterdir()):
        if f.name == _RUN_JSON or f.name.startswith(".") or not f.name.endswith((".json", ".json.gz")):
            continue
        _, stem = _split(f)
        out.setdefault(stem, []).append(f)
    for files in out.values():
        files.sort(key=lambda f: not f.name.endswith(".gz"))
    return out


class _Locked:
    """An exclusive flock of a folder (released on exit, or when the process dies)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __enter__(self) -> "_Locked":
        import fcntl

        self.fd = os.open(self.folder, os.O_RDONLY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)  # (closing the last descriptor releases the lock)


def update_store(out: str | Path, *, cells: dict[str, dict[str, Any]] | None = None,
                 run: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """Add or replace `cells` (name -> cell) and the `run` manifest, drop the cells named in `drop`,
    in the store of the report folder `out`: read, change and replace it under an exclusive lock
    of `out`/cells (module comment above). An earlier version's cell files there are moved into
    the store in the same write (a cell already in the store keeps the store's; a file that does
    not read stays where it is). Returns {"cells": cells now stored, "moved": files moved in,
    "unreadable": files left, "written": whether the store was rewritten}."""
    from ..data.io import atomic_write, read_json

    folder = Path(out) / "cells"
    folder.mkdir(parents=True, exist_ok=True)
    with _Locked(folder):
        for tmp in folder.glob(f".{STORE_NAME}.*.tmp"):  # a writer killed mid-write (writers hold the lock)
            tmp.unlink(missing_ok=True)
        store = _read_store(folder, fresh=True)
        lines = dict(store["cells"])
        run_line = store["run"]
        moved: list[Path] = []
        unreadable: list[str] = []
        for stem, files in _legacy_cells(folder).items():
            if stem not in lines:
                try:
                    lines[stem] = _dumps({"cell": stem, "data": read_json(files[0])})
                except (OSError, ValueError, EOFError):
                    unreadable += [str(f) for f in files]
                    continue
            moved += files
        legacy_run = folder / _RUN_JSON
        if legacy_run.exists():
            if run_line is None and run is None:
                try:
                    run_line = _dumps({"run": json.loads(legacy_run.read_text())})
                except (OSError, ValueError):
                    unreadable.append(str(legacy_run))
                    legacy_run = None
            if legacy_run is not None:
                moved.append(legacy_run)
        for stem, cell in (cells or {}).items():
            lines[stem] = _dumps({"cell": stem, "data": cell})
        for stem in drop:
            lines.pop(stem, None)
        if run is not None:
            run_line = _dumps({"run": run})
        changed = lines != store["cells"] or run_line != store["run"] or not (folder / STORE_NAME).exists()
        if changed:
            import lzma

            body = "\n".join([_dumps(STORE_HEADER)] + ([run_line] if run_line else [])
                             + [lines[k] for k in sorted(lines)]) + "\n"
            data = lzma.compress(body.encode("utf-8"), format=lzma.FORMAT_XZ, preset=6)
            atomic_write(folder / STORE_NAME, lambda tmp: Path(tmp).write_bytes(data))
        for f in moved + [f for stem in drop for f in _legacy_files(folder, stem)]:
            f.unlink(missing_ok=True)
    return {"cells": len(lines), "moved": len(moved), "unreadable": unreadable, "written": changed}


def read_cells(out: str | Path) -> dict[str, dict[str, Any]]:
    """Every cell stored in the report folder `out`, by name (`<method>.<kind>.<length>`): the
    store's, then an earlier version's files not in it (a file that does not read is left out)."""
    from ..data.io import read_json

    folder = Path(out) / "cells"
    got = {stem: json.loads(line)["data"] for stem, line in _read_store(folder)["cells"].items()}
    for stem, files in _legacy_cells(folder).items():
        if stem not in got:
            try:
                got[stem] = read_json(files[0])
            except (OSError, ValueError, EOFError):
                pass
    return dict(sorted(got.items()))


def read_run(out: str | Path) -> dict[str, Any] | None:
    """The run manifest of the report folder `out` (`run_report`: run id, config, fingerprint,
    kept runs, finished): the store's, else an earlier version's `cells/run.json`, else None."""
    folder = Path(out) / "cells"
    line = _read_store(folder)["run"]
    if line is not None:
        return json.loads(line)["run"]
    try:
        return json.loads((folder / _RUN_JSON).read_text())
    except FileNotFoundError:
        return None


def write_run(out: str | Path, manifest: dict[str, Any]) -> None:
    """Store the run manifest of the report folder `out`, atomically (`update_store`)."""
    update_store(out, run=manifest)


def migrate_cells(out: str | Path) -> dict[str, Any]:
    """Move an earlier version's per-cell files of the report folder `out` (`cells/<stem>.json.gz`,
    `<stem>.json`, `cells/run.json`) into its store and delete them (`update_store`); the cells
    read back equal. A folder already compact is left as it is. `lcx report --compact-cells`."""
    if not (Path(out) / "cells").is_dir():
        raise ValueError(f"{out}: no cells/ folder (not an lcx report folder)")
    return update_store(out)


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
