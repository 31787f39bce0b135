"""`lcx report --jobs N`: up to N cells measured at once, each in a worker process of its own.

A report's cells are independent measurements (each builds its model and its prompts), so a
machine with cores to spare can run several at once instead of giving one cell more threads (whose
gain is partial on an idle machine and negative on a busy one: results/threads_cpu.json). What
stays as in a sequential run:

- the order: cells start in the report's length-major order, and what one measures does not
  depend on what else runs (every number is a function of the cell's settings; only wall times
  grow under the shared load, and `wall_s` says what it was);
- the timed cells: a decode cell (tokens/s, timed in this process as in a sequential run) starts
  only when no other cell is running, and no cell starts while it runs (a barrier in the order;
  the order puts a length's decode cells together after its other cells, so a report waits at one
  barrier per length, not one per method);
- the vanilla-equivalent RULER cells: a cell that may take vanilla's answers
  (`lcx.report.ruler.vanilla_equivalent`: its method's `identity_up_to` covers every prompt)
  waits for vanilla's cell at its length when that comes earlier in the order, exactly the cell
  a sequential run would have had by then; other cells start past it.

Workers are spawned (a fresh interpreter: safe with CUDA, no forked torch state), each with
`threads` torch threads, and reused from cell to cell. A cell that fails stops the run: the
other workers are terminated, every finished cell is already written and every journaled answer
kept, so the same command resumes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

from ..presets import PresetRun
from .config import ReportConfig


def auto_jobs(cfg: ReportConfig) -> int:
    """`--jobs auto`: on a CPU, one job per core this process may use, as many as the memory
    available now holds cells of the report's longest length (`lcx.report.ray_executor.cell_memory`,
    the estimate Ray schedules by); on a GPU, one (the cells share the device)."""
    from ..engine.memory import available_memory
    from ..threads import available_cores
    from .config import model_context, model_hf_config
    from .ray_executor import cell_memory

    if cfg.device != "cpu":
        return 1
    cores = available_cores()
    if cores < 2:
        return 1
    longest = max(cfg.resolved(model_context(cfg.model)).lengths)
    need = cell_memory(model_hf_config(cfg.model), cfg.dtype, longest)
    return max(1, min(cores, available_memory("cpu") // max(1, need)))


def measure_cell(kind: str, model: str, run: PresetRun, cfg: ReportConfig, length: int, *,
                 journal: Path | None = None, reference: tuple[str, dict[str, Any]] | None = None,
                 log: Callable[[str], None] = print) -> tuple[dict[str, Any], float]:
    """One cell's measurement -> (result, seconds). `reference` = (name, vanilla's RULER cell at
    this length) lets a RULER cell take vanilla's answers (`vanilla_equivalent`); `journal`: the
    cell's request journal (lm-eval cells)."""
    from .measure import CELL_RUNNERS
    from .quiet import quiet
    from .ruler import vanilla_equivalent

    t0 = time.perf_counter()
    result = None
    with quiet():  # lm-eval's per-cell warnings about lcx's own use and its bars (`--verbose` shows them)
        if kind == "ruler" and reference is not None:
            result = vanilla_equivalent(model, run, cfg, length, reference, log=log)
        if result is None:
            result = CELL_RUNNERS[kind](model, run, cfg, length, **({"journal": journal} if journal else {}))
    return result, time.perf_counter() - t0


def _init_worker(threads: int) -> None:
    import torch

    from ..allocator import reuse_freed_memory

    torch.set_num_threads(threads)
    reuse_freed_memory()


def _spawn_pool(jobs: int, threads: int) -> Any:
    import multiprocessing

    return multiprocessing.get_context("spawn").Pool(jobs, initializer=_init_worker, initargs=(threads,))


def run_cells(items: Sequence[Any], *, jobs: int, threads: int, key: Callable[[Any], Hashable],
              prepare: Callable[[Any], dict[str, Any]], finish: Callable[[Any, dict[str, Any], float], None],
              exclusive: Callable[[Any], bool], waits_for: Callable[[Any], Hashable | None],
              measure: Callable[..., tuple[dict[str, Any], float]] = measure_cell,
              pool: Callable[[int, int], Any] | None = None) -> None:
    """Measure `items` (in order) on `jobs` spawned workers. `prepare(item)` -> `measure`'s
    arguments (called in this process when the item starts: journals, the reference cell);
    `finish(item, result, seconds)` records a finished item (in this process, one at a time);
    `exclusive(item)`: run it here, alone (a barrier); `waits_for(item)`: the key of an earlier
    item it must follow, or None. `pool(jobs, threads)`: the worker pool, a context manager with
    `multiprocessing.Pool`'s `apply_async` (default: spawned processes; the tests' is in-process)."""
    import queue

    if pool is None:
        pool = _spawn_pool

    todo = list(items)
    done: set[Hashable] = set()
    running: dict[Hashable, Any] = {}
    results: queue.Queue = queue.Queue()
    with pool(jobs, threads) as workers:
        while todo or running:
            i = 0
            while i < len(todo) and len(running) < jobs:
                item = todo[i]
                if exclusive(item):
                    if running:
                        break  # nothing after a barrier starts before it
                    todo.pop(i)
                    finish(item, *measure(**prepare(item)))
                    done.add(key(item))
                    continue
                dep = waits_for(item)
                if dep is not None and dep not in done and (running or i > 0):
                    i += 1  # (with nothing running and nothing before it, it starts: no deadlock)
                    continue
                todo.pop(i)
                k = key(item)
                running[k] = item
                workers.apply_async(measure, kwds=prepare(item),
                                    callback=lambda r, k=k: results.put((k, r, None)),
                                    error_callback=lambda e, k=k: results.put((k, None, e)))
            if not running:
                continue
            k, r, err = results.get()
            item = running.pop(k)
            if err is not None:  # leaving the block terminates the other workers
                raise RuntimeError(f"lcx report: cell {k} failed in its worker: {err!r}") from err
            finish(item, *r)
            done.add(k)
