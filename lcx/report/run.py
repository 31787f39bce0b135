"""`run_report`: the cells of a report in length-major order, measured or reused, written as they
finish, then report.json.gz, the plots and README.md."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

from ..method_config import MethodConfig
from ..presets import PresetRun
from ..presets import resolve as resolve_preset
from .cells import (
    cell_fingerprint,
    cell_path,
    cell_settings,
    diff_values,
    journal_dir,
    load_cell,
    plan_run,
    run_fingerprint,
    running_path,
    write_cell,
    write_run,
)
from .config import CELL_KINDS, PPL_METRIC, ReportConfig, model_hf_config, run_settings
from .jobs import measure_cell, run_cells
from .lm import journal_count, journal_db
from .render import other_code_note, markdown, passkey_intervals, passkey_paired, plot_report
from .ruler import longest_sequence, ruler_cell_summary, ruler_intervals, ruler_paired

# The run
# ============================================================================================

JOURNALED = ("lmeval", "ruler", "passkey_primed")  # cell kinds answered request by request through lm-eval


def cell_journal(out: Path, name: str, kind: str, length: int, settings: dict[str, Any],
                 fingerprint: dict[str, Any], log: Callable[[str], None] | None = None) -> Path:
    """The request journal of one cell (`lcx.report.lm.evaluate`): in `journal_dir(out)` (lcx's cache),
    named by the cell and a hash of its settings and `cell_fingerprint`, so answers given under
    other settings, models, environment or numerics code are never read back (a cell resumes
    only what the same measurement answered). Beside it, `<journal>.key.json` holds what the hash
    covers and the commit the journal was started at. Journals of the same cell under another
    hash are deleted here, and `log` names what a deleted one held (its answers, what differs,
    its commit: a journal committed mid-sweep resumes only from a checkout of the code that
    made it); the cell's own is deleted once the cell is written (`drop_journal`)."""
    from ..data.io import atomic_write_json, git_info

    key_obj = {"settings": settings, "fingerprint": cell_fingerprint(fingerprint, kind)}
    key = json.dumps(key_obj, sort_keys=True, default=str)
    stem = f"{name}.{kind}.{length}"
    journal = journal_dir(out) / f"{stem}.{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    for old in sorted(journal.parent.glob(f"{stem}.*_rank0.db")):
        if not old.name.startswith(journal.name) and log is not None:
            note = stale_journal_note(Path(str(old).removesuffix("_rank0.db")), key_obj)
            if note:
                log(f"  {name} @ {length}: {note}")
    for old in journal.parent.glob(f"{stem}.*"):
        if not old.name.startswith(journal.name):  # (sqlite's own side files stay with their db)
            old.unlink(missing_ok=True)
    side = Path(f"{journal}.key.json")
    if not side.exists():
        atomic_write_json(side, {**json.loads(key), "git": git_info()})
    return journal


def stale_journal_note(journal: Path, key: dict[str, Any]) -> str | None:
    """What a journal that `key` does not resume held (None: no answers): its answer count, the
    keys of its settings/fingerprint that differ (from its `.key.json`, when it has one) and the
    commit it was started at."""
    try:
        answered = journal_count(journal)
    except Exception:  # noqa: BLE001 - a journal that cannot be read is stale either way
        answered = 0
    if not answered:
        return None
    side = Path(f"{journal}.key.json")
    try:
        old = json.loads(side.read_text())
    except (OSError, ValueError):
        old = None
    if old is None:
        why = "under other settings or code (its key was not recorded)"
    else:
        differ = diff_values({k: old.get(k) for k in key}, json.loads(json.dumps(key, default=str)))
        sha = ((old.get("git") or {}).get("sha") or "?")[:12]
        why = f"under other {', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''} (started at git {sha})"
    return (f"a journal of {answered} answers made {why} is not resumed and is deleted: answers resume only "
            f"under the settings and code that gave them (run the cell from that checkout to finish it; a "
            f"committed journal is still in git)")


def drop_journal(journal: Path) -> None:
    """Delete a cell's journal and its key (the cell is written)."""
    journal_db(journal).unlink(missing_ok=True)
    Path(f"{journal}.key.json").unlink(missing_ok=True)


def _as_loaded_cell(runs: dict[str, PresetRun], cells: dict[str, Any], name: str, length: int
                    ) -> tuple[str, dict[str, Any]] | None:
    """(name, RULER cell at `length`) of a run of this report that is the model of `name`'s run as
    loaded (vanilla), when that cell is already measured or kept; else None."""
    model = runs[name].model
    return next(((n, c) for n, r in runs.items() if n != name and r.model == model and r.config.is_identity
                 and (c := cells[n]["ruler"].get(str(length))) is not None), None)


def _vanilla_cell_first(runs: dict[str, PresetRun], cfg: ReportConfig, order: list[tuple[str, str, int]],
                        item: tuple[str, str, int]) -> tuple[str, str, int] | None:
    """The cell `item` waits for under `--jobs`: vanilla's (the model as loaded) RULER cell at its
    length, when that comes before it in `order` and `item`'s method may take its answers
    (`vanilla_equivalent`'s bound covers the cell's prompts); else None."""
    name, kind, L = item
    run = runs[name]
    if kind != "ruler" or cfg.ruler_equivalent_check is None or run.config.is_identity:
        return None
    before = order[:order.index(item)]
    ref = next(((n, k, ln) for n, k, ln in before if k == "ruler" and ln == L and n != name
                and runs[n].model == run.model and runs[n].config.is_identity), None)
    if ref is None:
        return None
    from types import SimpleNamespace

    bound = run.config.identity_up_to(SimpleNamespace(**model_hf_config(run.model)))
    if bound <= 0 or longest_sequence(run.model, L, cfg.ruler_tasks, cfg.ruler_samples) > bound:
        return None
    return ref


class _Live:
    """`running.json` (`running_path`, in lcx's cache): the cells in flight (where, answers in their journals, since when),
    rewritten atomically when a cell starts or ends and at most once a second otherwise; deleted
    when the run ends. A driver killed leaves it behind: `driver` (host, pid) and `updated` tell."""

    def __init__(self, path: Path, run_id: str, *, enabled: bool):
        self.path, self.run_id, self.enabled = path, run_id, enabled
        self.cells: dict[str, dict[str, Any]] = {}
        self.written = 0.0

    def _write(self, force: bool) -> None:
        if not self.enabled or (not force and time.monotonic() - self.written < 1.0):
            return
        from ..data.io import atomic_write_json

        atomic_write_json(self.path, {"run_id": self.run_id, "driver": {"host": socket.gethostname(), "pid": os.getpid()},
                                      "updated": time.strftime("%Y-%m-%dT%H:%M:%S"), "cells": self.cells})
        self.written = time.monotonic()

    def start(self, cell: str, where: str, answers: int) -> None:
        self.cells[cell] = {"where": where, "answers": answers,
                            "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self._write(force=True)

    def update(self, in_flight: dict[str, tuple[str, int]]) -> None:
        """The executor's view: cell -> (where, answers)."""
        changed = False
        for cell, (where, answers) in in_flight.items():
            entry = self.cells.setdefault(cell, {"since": time.strftime("%Y-%m-%dT%H:%M:%S")})
            changed |= entry.get("where") != where
            entry.update(where=where, answers=answers)
        self._write(force=changed)

    def end(self, cell: str) -> None:
        self.cells.pop(cell, None)
        self._write(force=True)

    def close(self) -> None:
        if self.enabled:
            self.path.unlink(missing_ok=True)


def plan_runs(cfg: ReportConfig) -> tuple[ReportConfig, dict[str, PresetRun], dict[str, str], int, float]:
    """What a report of `cfg` runs: (cfg with its lengths resolved, name -> preset run, name ->
    why it is skipped, the model's context L0, the RoPE factor max(lengths) / L0)."""
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
        else:
            runs[name] = r
    for name, conf in cfg.custom_methods.items():  # the user's own configs, on the report's model
        runs[name] = PresetRun(name, cfg.model, MethodConfig.from_dict(conf))
    return cfg, runs, skipped, context, factor


def run_report(cfg: ReportConfig, out: Path, *, fresh: bool = False, reuse: bool = False, render: bool = False,
               keep_other_code: bool = False, progress: bool = True, jobs: int | None = 1, job_threads: int | None = None,
               ray: bool = False, ray_address: str | None = None, ray_cpus: int | None = None,
               order: Callable[[tuple[str, str, int]], Any] | None = None, sweep: str | None = None,
               cells_from: tuple[Path, ...] = (), log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every (method, measurement, length) cell not kept from an interrupted run (see the
    module docstring), then write the report. `render=True` measures nothing: it writes the
    report from the stored cells whose settings and fingerprint match (missing ones show as —),
    e.g. to publish a long sweep's progress. `jobs` > 1 measures up to that many cells at once in
    worker processes of `job_threads` torch threads each (`lcx.report.jobs`: same numbers, same
    order; decode cells alone). `ray=True` measures each cell as a Ray task (`lcx.report.ray_executor`)
    on the cluster at `ray_address`, or on one started for the run with `ray_cpus` CPUs (None: every
    core): `job_threads` CPUs per cell, at most `jobs` cells at once (None: as many as the cluster
    holds); a cell that fails is reported (`cells_failed`) and the others go on. `order`: a sort key
    over (name, kind, length) that measures some cells first (`lcx sweep`'s `first`; stable: the
    length-major order among equals). While cells run, `running.json` (`running_path`) says which, where,
    and how many answers each has (`lcx sweep status` reads it). `cells_from`: other report folders
    whose stored cells are kept when this folder has none with the same settings and fingerprint
    (any run of theirs; not with `fresh`): read there, not copied nor measured again, and named in
    the record (`cells_read_from`) and the README (`lcx sweep`'s `run.cells_from`)."""
    from tqdm.auto import tqdm

    from ..data.io import atomic_write_json, environment, git_info

    t_start = time.perf_counter()
    if ray and cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"--ray: device must be 'cpu' or 'cuda' (Ray gives each cell its own GPU), got {cfg.device!r}")
    cfg, runs, skipped, context, factor = plan_runs(cfg)
    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
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
        write_run(out, manifest)
    # (no "ruler" or "passkey_primed" key where a report has none: as before those kinds)
    kinds = [k for k in CELL_KINDS if (k != "ruler" or cfg.ruler_lengths) and (k != "passkey_primed" or cfg.primed_lengths)]
    cells: dict[str, dict[str, dict[str, Any]]] = {name: {k: {} for k in kinds} for name in runs}
    # length-major; at each length every method's untimed cells, then the timed decode cells together
    # (each runs alone: with --jobs / --ray one barrier per length instead of one per method)
    todo = [(name, kind, L) for L in sorted(set(cfg.lengths) | set(cfg.decode_lengths))
            for timed in (False, True) for name in runs
            for kind in CELL_KINDS if (kind == "decode") == timed and L in cfg.cell_lengths(kind)]
    bar = tqdm(total=len(todo), desc="report cells", unit="cell", disable=not progress)
    reused: list[str] = []
    read_from: dict[str, str] = {}  # cells kept from a `cells_from` folder -> that folder
    other_code: dict[str, dict[str, Any]] = {}  # kept cells measured by other code (--keep-other-code)
    pending: list[tuple[str, str, int]] = []  # the cells to measure, in order
    for name, kind, L in todo:
        settings = cell_settings(kind, cfg.model, name, runs[name], cfg, L)
        stored = (load_cell(cell_path(out, name, kind, L), settings, fingerprint, keep, other_code=keep_other_code)
                  if keep is None or keep else None)
        for src in cells_from if stored is None and not fresh else ():
            stored = load_cell(cell_path(Path(src), name, kind, L), settings, fingerprint, None, other_code=keep_other_code)
            if stored is not None:
                read_from[f"{name}/{kind}/{L}"] = str(src)
                break
        if stored is None:
            if render:
                bar.update(1)
            else:
                pending.append((name, kind, L))
            continue
        bar.update(1)
        cells[name][kind][str(L)] = stored["result"]
        reused.append(f"{name}/{kind}/{L}")
        code_diff = diff_values(cell_fingerprint(stored["fingerprint"], kind)["code"],
                          cell_fingerprint(fingerprint, kind)["code"])
        if code_diff:
            other_code[f"{name}/{kind}/{L}"] = {"run_id": stored.get("run_id"), "modules": code_diff}
        if stored.get("run_id") != run_id and stored.get("run_id") not in manifest["kept_runs"]:
            manifest["kept_runs"].append(stored["run_id"])
            if not render:  # a resumed run keeps what this one kept
                write_run(out, manifest)
    if order is not None:
        pending.sort(key=order)
    measured_s = 0.0
    journals: dict[tuple[str, str, int], Path | None] = {}
    live = _Live(running_path(out), run_id, enabled=not render)
    here = f"{socket.gethostname()} pid {os.getpid()}"
    mode = "serial"  # (set below: "serial", "jobs" or "ray")

    def prepare(item: tuple[str, str, int]) -> dict[str, Any]:
        """`measure_cell`'s arguments for a cell about to start (its journal, vanilla's cell)."""
        name, kind, L = item
        bar.set_postfix_str(f"{name}/{kind}/{L}")
        settings = cell_settings(kind, cfg.model, name, runs[name], cfg, L)
        journal = cell_journal(out, name, kind, L, settings, fingerprint, log=bar.write) if kind in JOURNALED else None
        if journal is not None and fresh:  # --fresh: every answer too
            journal_db(journal).unlink(missing_ok=True)
        journals[item] = journal
        answered = journal_count(journal)
        live.start(f"{name}/{kind}/{L}", "queued" if mode == "ray" else "a --jobs worker"
                   if mode == "jobs" and kind != "decode" else here, answered)
        if answered:
            bar.write(f"  {name} @ {L}: resuming {kind} from its journal ({answered} answers)")
        return {"kind": kind, "model": cfg.model, "run": runs[name], "cfg": cfg, "length": L, "journal": journal,
                "reference": _as_loaded_cell(runs, cells, name, L) if kind == "ruler" else None}

    def finish(item: tuple[str, str, int], result: dict[str, Any], dt: float) -> None:
        """Write a measured cell (and drop its journal)."""
        nonlocal measured_s
        name, kind, L = item
        measured_s += dt
        write_cell(cell_path(out, name, kind, L),
                   {"settings": cell_settings(kind, cfg.model, name, runs[name], cfg, L), "fingerprint": fingerprint,
                    "run_id": run_id, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": round(dt, 2),
                    "result": result})
        if (journal := journals.pop(item, None)) is not None:
            drop_journal(journal)
        live.end(f"{name}/{kind}/{L}")
        cells[name][kind][str(L)] = result
        bar.update(1)
        if kind == "ruler":
            bar.write(f"  {name} @ {L}: RULER {ruler_cell_summary(result)} ({dt:.0f} s)")
        elif kind == "lmeval":
            ppl = f", {PPL_METRIC} {result['ppl'][PPL_METRIC]:.1f}" if "ppl" in result else ""  # --ppl-max-length
            bar.write(f"  {name} @ {L}: passkey {result['passkey']:.2f}{ppl} ({dt:.0f} s)")
        elif kind == "passkey_primed":
            bar.write(f"  {name} @ {L}: passkey_primed {result['passkey']:.2f} ({dt:.0f} s)")
        else:
            bar.write(f"  {name} @ {L}: decode {result['tokens_per_s']:.1f} tok/s, KV {result['kv_cache_mb']:.1f} MB "
                      f"({dt:.0f} s)")

    failed: dict[str, str] = {}  # cells that failed under --ray (the others went on)
    ray_cells: dict[Any, dict[str, Any]] = {}  # per cell measured under --ray: node, attempts, task and overhead s

    def fail(item: tuple[str, str, int], error: str) -> None:
        name, kind, L = item
        failed[f"{name}/{kind}/{L}"] = error
        live.end(f"{name}/{kind}/{L}")
        bar.update(1)
        bar.write(f"  {name} @ {L}: {kind} cell FAILED: {error}")

    in_workers = sum(1 for it in pending if it[1] != "decode")  # (decode cells run here, alone)
    mode = "ray" if ray and pending else "serial" if (jobs or 1) <= 1 or in_workers <= 1 else "jobs"
    if mode == "ray":
        from .ray_executor import cell_memory, describe, ray_session, run_cells_ray

        def status(in_flight: list[dict[str, Any]]) -> None:
            bar.set_postfix_str(describe(in_flight))
            live.update({"/".join(map(str, c["cell"])): (f"ray node {c['node']}" if c["node"] else "queued",
                                                         c["answers"]) for c in in_flight})

        first = {it: _vanilla_cell_first(runs, cfg, pending, it) for it in pending}
        hf_configs = {r.model: model_hf_config(r.model) for r in runs.values()}
        extra = {"decode": cfg.decode_tokens + 1}
        with ray_session(ray_address, num_cpus=ray_cpus) as ray_module:
            ray_cells = run_cells_ray(pending, ray=ray_module, threads=job_threads or 1, gpu=cfg.device == "cuda", key=lambda it: it,
                          prepare=prepare, finish=finish, fail=fail, exclusive=lambda it: it[1] == "decode",
                          waits_for=first.get, jobs=jobs,
                          memory=lambda it: cell_memory(hf_configs[runs[it[0]].model], cfg.dtype,
                                                        it[2] + extra.get(it[1], 0)),
                          expect=lambda it: cell_fingerprint(fingerprint, it[1]),
                          status=status, log=bar.write)
    elif mode == "serial":
        for item in pending:
            finish(item, *measure_cell(**prepare(item), log=bar.write))
    else:
        # which cell each waits for, decided once (it may build the cell's RULER prompts; the
        # scheduler asks again at every turn)
        first = {it: _vanilla_cell_first(runs, cfg, pending, it) for it in pending}
        run_cells(pending, jobs=min(jobs or 1, in_workers), threads=job_threads or 1, key=lambda it: it, prepare=prepare,
                  finish=finish, exclusive=lambda it: it[1] == "decode", waits_for=first.get)
    bar.close()
    live.close()
    # the serial order whatever order the cells finished in (and kept cells among measured ones)
    cells = {name: {k: dict(sorted(c.items(), key=lambda kv: int(kv[0]))) for k, c in by_kind.items()}
             for name, by_kind in cells.items()}
    if failed:
        log(f"lcx report: {len(failed)} cell(s) failed (the same command measures them again): "
            + "; ".join(f"{c}: {e}" for c, e in failed.items()))
    if reused:
        log(f"kept {len(reused)} of {len(todo)} cells from run {run_id} ({why.split(':')[0]}); measured "
            f"{len(todo) - len(reused)}")
    if other_code:
        log("lcx report:" + other_code_note({"cells_kept_with_other_code": other_code}))
    if failed:  # not finished: the same command resumes it, measuring the failed cells again
        write_run(out, {**manifest, "cells_failed": failed})
    elif not render:
        write_run(out, {**manifest, "finished": True, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    record = {
        "description": "lcx report: context-extension methods beyond the training context",
        "config": {**cfg.to_dict(), "context": context, "rope_factor": factor,
                   "methods_resolved": {n: run_settings(r, cfg.model) for n, r in runs.items()}, "methods_skipped": skipped,
                   "tasks": (["passkey", "lcx_ppl"] if cfg.lmeval_lengths else []) + list(
                       cfg.ruler_tasks if cfg.ruler_lengths else ()) + (["passkey_primed"] if cfg.primed_lengths else []),
                   "ppl_metric": PPL_METRIC,
                   **({"ruler_lengths": list(cfg.ruler_lengths)} if cfg.ruler_lengths else {})},
        "environment": environment(), "git": git_info(Path(__file__).resolve().parents[2]),
        "fingerprint": fingerprint, "run_id": run_id,
        **({"sweep": sweep, "sweep_link": os.path.relpath(Path(sweep).resolve(), out.resolve())} if sweep else {}),
        "wall_s": round(time.perf_counter() - t_start, 1), "measured_s": round(measured_s, 1),
        "cells_total": len(todo), "cells_reused": len(reused), "reuse_reason": why if reused else None,
        "cells_kept_with_other_code": other_code,
        **({"cells_read_from": read_from} if read_from else {}),
        **({"cells_failed": failed} if failed else {}),
        **({"ray_cells": {"/".join(map(str, k)): v for k, v in ray_cells.items()}} if ray_cells else {}),
        "results": cells,
    }
    record["passkey_intervals"] = passkey_intervals(record)
    record["passkey_paired"] = passkey_paired(record)
    if cfg.primed_lengths:
        from .primed import primed_paired

        record["passkey_primed_paired"] = primed_paired(record)
    if cfg.ruler_lengths:
        record["ruler_intervals"] = ruler_intervals(record)
        record["ruler_paired"] = ruler_paired(record)
    from .effective import report_effective_lengths

    record["effective_length"] = report_effective_lengths(record)
    out.mkdir(parents=True, exist_ok=True)
    # every prompt's output makes the record large: always gzipped (results/README.md, "Budget");
    # `lcx.data.io.read_json` reads it, `zcat report.json.gz` shows it
    atomic_write_json(out / "report.json.gz", record)
    (out / "report.json").unlink(missing_ok=True)  # a plain record an earlier version wrote
    plot_report(record, out)
    from ..data.io import atomic_write_text

    atomic_write_text(out / "README.md", markdown(record))
    from .page import write_page

    write_page(record, out)  # index.html: the tables, pictures and every answer (lcx.report.page)
    return record


# ============================================================================================
