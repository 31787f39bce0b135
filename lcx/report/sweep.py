"""`lcx sweep`: a report sweep as a small declarative file (TOML, in `sweeps/`), run, watched, rendered.

    lcx sweep run sweeps/smollm2-135m-ruler.toml              # measure what is missing (resumable)
    lcx sweep run sweeps/smollm2-135m-ruler.toml --ray        # ... as Ray tasks (lcx report --ray)
    lcx sweep status sweeps/smollm2-135m-ruler.toml           # cells done, in progress (where), time left
    lcx sweep render sweeps/smollm2-135m-ruler.toml           # the report from the cells measured so far

A sweep file names what `lcx report` measures and where it writes, nothing else:

    description = "SmolLM2-135M on RULER beyond its 8k context"
    out = "results/report/smollm2-135m-ruler"     # relative to the working directory, as --out

    [report]                                      # lcx.report.ReportConfig's fields, by name
    model = "smollm2-135m"
    methods = ["self_extend", "yarn", "vanilla"]
    lengths = [4096, 8192, 12288, 16384]
    decode_lengths = []
    tasks = ["ruler"]
    ruler_tasks = ["niah_single_1", "niah_single_2_pd"]
    ruler_samples = 16

    [report.custom_methods.lmi_cap2k]             # optional: your own method configs
    attention = {type = "lm_infinite", n_global = 10, n_local = 8192, limit_distance = 2048}

    [run]                                         # how it runs, not what it measures (optional)
    threads = 1                                   # torch threads per cell
    keep_other_code = true                        # keep cells of other lcx code (lcx report --keep-other-code)
    first = [{lengths = [16384]}, {lengths = [12288]}]   # these cells first, in this order
    cells_from = ["results/report/smollm2-135m-n16"]     # keep matching cells stored there (not copied)

`run` measures every cell not stored yet with these settings (`lcx report --reuse`: a stored
cell whose settings and fingerprint match is kept, and a cell's journal resumes it), so the same
command continues an interrupted sweep and a finished one measures nothing. `cells_from` names
other report folders whose stored cells with the same settings and fingerprint are kept rather
than measured (read there; the report lists them), e.g. the published-prompt passkey cells that
a sweep of `passkey_primed` pairs with. Unknown keys, at any
level, raise ValueError naming them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ReportConfig

_TOP = {"description", "out", "report", "run"}
_RUN = {"threads", "keep_other_code", "first", "cells_from"}
_FIRST = {"lengths", "methods", "kinds"}
_TUPLES = {"methods", "lengths", "decode_lengths", "tasks", "ruler_tasks"}


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file."""

    path: Path
    description: str
    out: Path
    config: ReportConfig
    threads: int = 1
    keep_other_code: bool = False
    first: tuple[dict[str, tuple], ...] = field(default_factory=tuple)
    cells_from: tuple[Path, ...] = ()

    @property
    def name(self) -> str:
        """The file as the report names it: relative to the working directory when inside it."""
        try:
            return str(self.path.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            return str(self.path)

    def order(self, item: tuple[str, str, int]) -> int:
        """`run_report`'s sort key: the index of the first `first` entry the cell matches (name,
        kind, length), len(first) for the rest."""
        name, kind, L = item
        for i, sel in enumerate(self.first):
            if all(v in sel.get(k, (v,)) for k, v in (("methods", name), ("kinds", kind), ("lengths", L))):
                return i
        return len(self.first)


def load_sweep(path: str | Path) -> Sweep:
    """Read and validate a sweep file (module docstring)."""
    import tomllib

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not TOML: {e}") from None
    _known(path, "", data, _TOP)
    for key in ("out", "report"):
        if key not in data:
            raise ValueError(f"{path}: missing `{key}`")
    report = data["report"]
    if not isinstance(report, dict):
        raise ValueError(f"{path}: [report] must be a table")
    import dataclasses

    _known(path, "report.", report, {f.name for f in dataclasses.fields(ReportConfig)})
    try:
        config = ReportConfig(**{k: tuple(v) if k in _TUPLES and isinstance(v, list) else
                                 tuple(v) if k == "depths" and isinstance(v, list) else v for k, v in report.items()})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: [report]: {e}") from None
    run = data.get("run", {})
    _known(path, "run.", run, _RUN)
    threads = run.get("threads", 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{path}: run.threads must be an integer >= 1, got {threads!r}")
    keep = run.get("keep_other_code", False)
    if not isinstance(keep, bool):
        raise ValueError(f"{path}: run.keep_other_code must be true or false, got {keep!r}")
    first = []
    for i, sel in enumerate(run.get("first", [])):
        if not isinstance(sel, dict) or not sel:
            raise ValueError(f"{path}: run.first[{i}] must be a table of lengths/methods/kinds")
        _known(path, f"run.first[{i}].", sel, _FIRST)
        first.append({k: tuple(v) for k, v in sel.items()})
    cells_from = run.get("cells_from", [])
    if not isinstance(cells_from, list) or not all(isinstance(x, str) and x for x in cells_from):
        raise ValueError(f"{path}: run.cells_from must be a list of report folders, got {cells_from!r}")
    if Path(data["out"]) in {Path(x) for x in cells_from}:
        raise ValueError(f"{path}: run.cells_from names the sweep's own folder {data['out']!r}")
    return Sweep(path=path, description=str(data.get("description", "")), out=Path(data["out"]), config=config,
                 threads=threads, keep_other_code=keep, first=tuple(first),
                 cells_from=tuple(Path(x) for x in cells_from))


def _known(path: Path, prefix: str, table: Any, keys: set[str]) -> None:
    unknown = sorted(set(table) - keys) if isinstance(table, dict) else []
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(prefix + k for k in unknown)}; known: "
                         f"{', '.join(sorted(keys))}")


# Status
# ============================================================================================

def sweep_status(sweep: Sweep) -> dict[str, Any]:
    """Where a sweep stands, from its folder: every cell `done` (stored with matching settings and
    fingerprint, as `run` would keep it), `running` (in `running.json`, `lcx.report.cells.running_path`: where, answers), or
    `todo` (with its journal's answers, if any); the seconds the done cells took; an estimate of
    the seconds left (each missing cell at the mean of the done cells of its kind and length, else
    of its kind scaled by length, else unknown)."""
    from .cells import cell_path, cell_settings, journal_dir, load_cell, run_fingerprint, running_path
    from .config import CELL_KINDS
    from .lm import journal_count
    from .run import plan_runs

    cfg, runs, skipped, _, _ = plan_runs(sweep.config)
    fingerprint = run_fingerprint([cfg.model] + [r.model for r in runs.values() if r.model != cfg.model])
    try:
        live = json.loads(running_path(sweep.out).read_text())
    except (OSError, ValueError):
        live = {"cells": {}}
    cells = []
    for L in sorted(set(cfg.lengths) | set(cfg.decode_lengths)):
        for name, run in runs.items():
            for kind in CELL_KINDS:
                if L not in cfg.cell_lengths(kind):
                    continue
                key = f"{name}/{kind}/{L}"
                settings = cell_settings(kind, cfg.model, name, run, cfg, L)
                for folder in (sweep.out, *sweep.cells_from):  # (as run_report keeps them)
                    stored = load_cell(cell_path(folder, name, kind, L), settings, fingerprint, None,
                                       other_code=sweep.keep_other_code)
                    if stored is not None:
                        break
                entry: dict[str, Any] = {"cell": key, "kind": kind, "length": L}
                if stored is not None:
                    entry.update(state="done", wall_s=stored.get("wall_s"),
                                 **({"read_from": str(folder)} if folder != sweep.out else {}))
                else:
                    # (named as lcx.report.run.cell_journal names them; a running cell's count in
                    # running.json is the one it started with, its journal grows with every answer)
                    journals = sorted(journal_dir(sweep.out).glob(f"{name}.{kind}.{L}.*_rank0.db"))
                    answers = max((journal_count(str(j).removesuffix("_rank0.db")) for j in journals), default=0)
                    if key in live["cells"]:
                        info = live["cells"][key]
                        entry.update(state="running", **{**info, "answers": max(answers, info.get("answers") or 0)})
                    else:
                        entry.update(state="todo", **({"answers": answers} if answers else {}))
                cells.append(entry)
    done = [c for c in cells if c["state"] == "done" and c.get("wall_s")]
    by_cell: dict[tuple[str, int], list[float]] = {}
    by_kind: dict[str, list[tuple[int, float]]] = {}
    for c in done:
        by_cell.setdefault((c["kind"], c["length"]), []).append(c["wall_s"])
        by_kind.setdefault(c["kind"], []).append((c["length"], c["wall_s"]))
    left, unknown = 0.0, 0
    for c in cells:
        if c["state"] == "done":
            continue
        same = by_cell.get((c["kind"], c["length"]))
        if same:
            left += sum(same) / len(same)
        elif by_kind.get(c["kind"]):
            left += sum(w * c["length"] / n for n, w in by_kind[c["kind"]]) / len(by_kind[c["kind"]])
        else:
            unknown += 1
    counts = {s: sum(c["state"] == s for c in cells) for s in ("done", "running", "todo")}
    return {"sweep": str(sweep.path), "out": str(sweep.out), "cells": cells, "counts": counts,
            "skipped_methods": skipped, "done_s": round(sum(c["wall_s"] for c in done), 1),
            "estimated_left_s": round(left, 1), "cells_without_estimate": unknown,
            "driver": live.get("driver"), "updated": live.get("updated")}


def format_status(st: dict[str, Any]) -> str:
    n = st["counts"]
    lines = [f"{st['sweep']} -> {st['out']}: {n['done']} of {len(st['cells'])} cells done, {n['running']} running, "
             f"{n['todo']} to do"]
    for c in st["cells"]:
        if c["state"] == "running":
            lines.append(f"  running  {c['cell']} on {c.get('where')} ({c.get('answers', 0)} answers, since "
                         f"{c.get('since')})")
        elif c["state"] == "todo":
            lines.append(f"  to do    {c['cell']}" + (f" ({c['answers']} answers journaled)" if c.get("answers") else ""))
    if st.get("updated"):
        d = st["driver"] or {}
        lines.append(f"  (running cells as of {st['updated']}, driver {d.get('host')} pid {d.get('pid')})")
    left = st["estimated_left_s"]
    lines.append(f"measured {st['done_s'] / 3600:.1f} h of cells; about {left / 3600:.1f} h of one worker left"
                 + (f" (+ {st['cells_without_estimate']} cells of a kind not measured yet)"
                    if st["cells_without_estimate"] else ""))
    return "\n".join(lines)


# CLI
# ============================================================================================

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n", 1)[1]
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    r = sub.add_parser("run", help="measure the sweep's missing cells (resumes; a finished sweep measures nothing)")
    r.add_argument("file", type=Path)
    r.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="as Ray tasks, as `lcx report --ray` (default ADDRESS: $RAY_ADDRESS, else a local cluster)")
    r.add_argument("--jobs", type=int, default=None, metavar="N", help="cells at once, as `lcx report --jobs`")
    r.add_argument("--threads", type=int, default=None, help="torch threads per cell (default: the file's run.threads)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    s = sub.add_parser("status", help="cells done, running (where, answers) and to do; time left")
    s.add_argument("file", type=Path)
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    d = sub.add_parser("render", help="write the report from the cells measured so far (measures nothing)")
    d.add_argument("file", type=Path)


def run(args: argparse.Namespace) -> int:
    from .run import run_report

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sweep = load_sweep(args.file)
    if args.action == "status":
        st = sweep_status(sweep)
        print(json.dumps(st, indent=1) if args.json else format_status(st))
        return 0
    if args.action == "render":
        run_report(sweep.config, sweep.out, render=True, keep_other_code=sweep.keep_other_code, sweep=sweep.name,
                   cells_from=sweep.cells_from)
        print(f"wrote {sweep.out / 'README.md'}")
        return 0
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    import torch

    from ..allocator import reuse_freed_memory

    threads = args.threads or sweep.threads
    torch.set_num_threads(threads)
    reuse_freed_memory()
    kw: dict[str, Any] = {"jobs": args.jobs or 1, "job_threads": threads}
    if args.ray is not None:
        kw.update(ray=True, ray_address=args.ray or os.environ.get("RAY_ADDRESS") or None, jobs=args.jobs,
                  ray_cpus=args.jobs * threads if args.jobs else None)
    record = run_report(sweep.config, sweep.out, reuse=True, keep_other_code=sweep.keep_other_code,
                        order=sweep.order, progress=not args.no_progress, sweep=sweep.name, cells_from=sweep.cells_from,
                        **kw)
    if record.get("cells_failed"):
        print(f"lcx sweep: {len(record['cells_failed'])} cell(s) failed; `lcx sweep run` measures them again",
              file=sys.stderr)
        return 1
    return 0
