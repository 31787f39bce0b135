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


_GIB = 2**30
_PROCESS_BASE = 1.5 * _GIB  # python + torch + transformers + lm-eval imported, before a model


def cell_memory(hf_config: dict[str, Any], dtype: str, length: int) -> int:
    """Bytes a cell's process needs, roughly (Ray's `memory` resource: a node runs only the cells
    whose estimates fit; not a limit): the process's imports, the weights in `dtype`, one
    sequence's KV cache, its activations and float32 logits (perplexity scores every position),
    with a quarter added."""
    h = int(hf_config.get("hidden_size", 0))
    n = int(hf_config.get("num_hidden_layers", 0))
    inter = int(hf_config.get("intermediate_size", 4 * h))
    vocab = int(hf_config.get("vocab_size", 0))
    heads = int(hf_config.get("num_attention_heads", 1)) or 1
    kv_heads = int(hf_config.get("num_key_value_heads", heads))
    head_dim = int(hf_config.get("head_dim") or h // heads)
    if min(h, n, vocab) <= 0 or length <= 0:
        raise ValueError(f"cell_memory: a config with hidden_size, num_hidden_layers and vocab_size and a length "
                         f">= 1 is needed, got h={h}, layers={n}, vocab={vocab}, length={length}")
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    params = vocab * h * (1 if hf_config.get("tie_word_embeddings", True) else 2) + n * (
        2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * inter)
    kv = 2 * n * kv_heads * head_dim * length * width
    activations = 4 * length * max(h, inter) * 4 + 2 * length * vocab * 4
    return int(1.25 * (_PROCESS_BASE + params * width + kv + activations))


def auto_jobs(cfg: ReportConfig) -> int:
    """`--jobs auto`: on a CPU, one job per core this process may use, as many as the memory
    available now holds cells of the report's longest length (`cell_memory`,
    the estimate Ray schedules by); on a GPU, one (the cells share the device)."""
    from ..engine.memory import available_memory
    from ..threads import available_cores
    from .config import model_context, model_hf_config

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
