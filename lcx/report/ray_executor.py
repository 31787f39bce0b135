"""`lcx report --ray [ADDRESS]`: a report's cells as Ray tasks, on a cluster of one or many machines.

Each cell is one Ray task that declares what it uses (`cell_resources`): `--threads` CPUs, one
GPU with `--device cuda` (8 GPUs run 8 cells, each on its own device: Ray sets the task's
`CUDA_VISIBLE_DEVICES`), and its memory estimate (`cell_memory`). The driver (the `lcx report`
process) keeps what a serial run guarantees:

- the same numbers: a task measures with `lcx.report.jobs.measure_cell`, the function the serial
  run and `--jobs` call, and first checks that its node computes what the driver fingerprinted (the
  cell's code, models and environment, `lcx.report.cells.cell_fingerprint`): a node with other
  code or another library version fails the cell with the difference named instead of writing a
  number the fingerprint does not describe;
- the order: cells start in the report's length-major order (no more in flight than the cluster
  holds, so Ray's queue cannot reorder them), the vanilla-equivalent RULER cells wait for vanilla's
  cell as under `--jobs` (`waits_for`), and the record lists the cells in the serial order;
- timed cells (decode) run alone on their node: the task asks for every CPU (and GPU) of one node,
  pinned there, and nothing later in the order is submitted until it has started;
- the cell store: the driver writes every cell (`finish`, atomically) and owns every journal.

Where journals live: on the driver, in its lcx cache (`lcx.report.cells.journal_dir`) exactly as in a serial run
(so a sweep may move between serial, `--jobs` and `--ray` runs). A task gets the cell's journal
as data (its answered requests), seeds a scratch journal in its node's temporary directory with
them, and streams every answer back as lm-eval's request cache commits it (a Ray streaming
generator, polled every `POLL_S` seconds); the driver appends them to its journal at once. So no
node needs the driver's disk, and the scratch copy is deleted when the task ends.

Faults:
- a worker or node that dies mid-cell (a system error: `WorkerCrashedError`, `NodeDiedError`,
  ...) costs the cell's unanswered prompts and the answers of its last `POLL_S` seconds: the
  driver resubmits the cell (Ray's own retries are off: `max_retries=0`), elsewhere if its node
  is gone, with the journal as it stands, up to `MAX_ATTEMPTS` attempts;
- a cell that fails in its own code (`RayTaskError`: deterministic, a retry would fail again) is
  reported with its error (`fail`) and the sweep goes on; the run is then not finished, so the
  same command measures the failed cells again;
- a driver killed mid-sweep loses nothing written: the same command resumes the run as any
  interrupted `lcx report` (finished cells kept, the others resumed from their journals).

Network: a cluster started for the run binds every Ray process to 127.0.0.1 (`ray.init(
_node_ip_address="127.0.0.1", include_dashboard=False)` with `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`:
on Linux Ray otherwise replaces a loopback node address with the machine's interface address,
`ray._private.services.resolve_ip_for_localhost`). An address given connects to that cluster as
Ray does (its nodes need this lcx, same code, installed: the fingerprint check says when not).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import sqlite3
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Sequence

from .jobs import cell_memory  # noqa: F401  (the estimate Ray schedules by; `--jobs auto` uses it too)

LOOPBACK = "127.0.0.1"
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
POLL_S = 0.2  # how often a task sends the answers its scratch journal committed
MAX_ATTEMPTS = 3  # per cell, counting system failures (a node or worker lost), not the cell's own errors
_TABLE = "unnamed"  # sqlitedict's default table: lm-eval's CachingLM journal (lcx.report.lm.journal_db)


# Ray, bound to loopback where we start it
# ============================================================================================

def is_loopback(address: str) -> bool:
    """Whether a Ray address (`host:port`, `ray://host:port`) names this machine's loopback."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def import_ray(*, loopback: bool) -> Any:
    """`import ray`, with `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` first when the cluster is on
    loopback (Ray reads it once, at import: with it, a node given 127.0.0.1 stays on 127.0.0.1)."""
    if loopback:
        os.environ[RAY_CLUSTER_ENV] = "0"
    try:
        import ray
    except ImportError as e:
        raise ImportError("lcx report --ray needs Ray: pip install 'lcx[ray]' (ray==2.60.0)") from e
    if loopback:
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER:
            raise RuntimeError(f"ray was imported before {RAY_CLUSTER_ENV}=0 was set: its nodes would bind to the "
                               f"machine's interface address, not {LOOPBACK}; set {RAY_CLUSTER_ENV}=0 in the "
                               "environment before Python starts")
    return ray


@contextlib.contextmanager
def ray_session(address: str | None, *, num_cpus: int | None = None, num_gpus: int | None = None) -> Iterator[Any]:
    """A connection to Ray for one run -> the `ray` module. `address` None: a cluster started here
    for the run (every process on 127.0.0.1, no dashboard, `num_cpus`/`num_gpus` its resources),
    shut down after; else that cluster's address (`host:port`, `auto`)."""
    ray = import_ray(loopback=address is None or is_loopback(address))
    if ray.is_initialized():
        raise RuntimeError("lcx report --ray: this process is already connected to Ray; a report connects itself")
    kw: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
    if address is None:
        ray.init(address="local", _node_ip_address=LOOPBACK, include_dashboard=False, num_cpus=num_cpus,
                 num_gpus=num_gpus, **kw)
    else:
        ray.init(address=address, **({"_node_ip_address": LOOPBACK} if is_loopback(address) else {}), **kw)
    try:
        yield ray
    finally:
        ray.shutdown()


# What a cell asks for
# ============================================================================================

def cell_resources(*, threads: int, gpu: bool, memory: int) -> dict[str, Any]:
    """A cell task's `ray.remote` options: `threads` CPUs, one GPU when the cells run on CUDA,
    its memory estimate."""
    if threads < 1 or memory < 1:
        raise ValueError(f"cell_resources: threads and memory must be >= 1, got {threads}, {memory}")
    return {"num_cpus": threads, "num_gpus": 1 if gpu else 0, "memory": memory}


# Journals: the driver's file, a task's scratch copy, the answers in between
# ============================================================================================

def _connect(db: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(db), timeout=30)
    conn.execute(f'CREATE TABLE IF NOT EXISTS "{_TABLE}" (key TEXT PRIMARY KEY, value BLOB)')  # = sqlitedict's
    return conn


def journal_rows(db: Path, after: int = 0) -> tuple[list[tuple[str, bytes]], int]:
    """The answers a journal file (`lcx.report.lm.journal_db`) holds past row `after` ->
    ((key, pickled answer) in the order written, the last row id). A missing file holds none."""
    if not db.exists():
        return [], after
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = conn.execute(f'SELECT rowid, key, value FROM "{_TABLE}" WHERE rowid > ? ORDER BY rowid',
                            (after,)).fetchall()
    except sqlite3.OperationalError:  # the table is not created yet
        rows = []
    finally:
        conn.close()
    return [(k, bytes(v)) for _, k, v in rows], (rows[-1][0] if rows else after)


def append_rows(db: Path, rows: Sequence[tuple[str, bytes]]) -> None:
    """Add answers to a journal file, byte for byte as lm-eval's cache wrote them, committed."""
    db.parent.mkdir(parents=True, exist_ok=True)
    conn = _connect(db)
    try:
        with conn:
            conn.executemany(f'REPLACE INTO "{_TABLE}" (key, value) VALUES (?, ?)',
                             [(k, sqlite3.Binary(v)) for k, v in rows])
    finally:
        conn.close()


# The task (runs on a node)
# ============================================================================================

def cell_task(call: dict[str, Any], answers: list[tuple[str, bytes]], threads: int,
              expect: dict[str, Any] | None) -> Iterator[tuple]:
    """One cell on a Ray worker, as a stream of messages: ("started", node id, host, pid), then
    ("answers", rows) as its journal grows, ("log", text), and last ("result", result, seconds).
    `call`: `measure_cell`'s arguments (its `journal` names the driver's; this task journals to a
    scratch copy seeded with `answers`); `expect`: the cell's fingerprint as the driver computed it
    (None: not checked)."""
    import socket

    import ray
    import torch

    from ..allocator import reuse_freed_memory
    from .cells import diff_values, cell_fingerprint, run_fingerprint
    from .jobs import measure_cell
    from .lm import journal_db

    yield ("started", ray.get_runtime_context().get_node_id(), socket.gethostname(), os.getpid())
    reuse_freed_memory()
    torch.set_num_threads(threads)
    if expect is not None:
        have = cell_fingerprint(run_fingerprint(sorted(expect["models"])), call["kind"])
        differ = diff_values(have, expect)
        if differ:
            raise ValueError(f"node {socket.gethostname()} would measure under another fingerprint than the driver's "
                             f"({', '.join(differ[:8])}): the code changed since the run started, or this node "
                             "has another lcx, library or model installed (every node needs the driver's)")
    scratch_dir = None
    db = None
    if call.get("journal") is not None:
        scratch_dir = Path(tempfile.mkdtemp(prefix="lcx-cell-"))
        scratch = scratch_dir / Path(call["journal"]).name
        db = journal_db(scratch)
        append_rows(db, answers)
        call = {**call, "journal": scratch}
    try:
        seen = journal_rows(db)[1] if db is not None else 0
        events: queue.Queue = queue.Queue()

        def body() -> None:
            torch.set_num_threads(threads)  # (per thread: this one computes the cell)
            try:
                events.put(("done", measure_cell(**call, log=lambda s: events.put(("log", s)))))
            except BaseException as e:  # noqa: BLE001 - re-raised in the task's thread below
                events.put(("error", e))

        worker = threading.Thread(target=body, name="lcx-cell", daemon=True)
        worker.start()
        while True:
            try:
                event = events.get(timeout=POLL_S)
            except queue.Empty:
                event = None
            if db is not None:
                rows, seen = journal_rows(db, seen)
                if rows:
                    yield ("answers", rows)
            if event is None:
                continue
            if event[0] == "log":
                yield event
                continue
            worker.join()
            if event[0] == "error":
                raise event[1]
            yield ("result", *event[1])
            return
    finally:
        if scratch_dir is not None:
            shutil.rmtree(scratch_dir, ignore_errors=True)


# The driver
# ============================================================================================

@dataclass
class _Cell:
    item: Any
    call: dict[str, Any]
    gen: Any = None
    attempt: int = 0
    node: str | None = None
    started: bool = False
    answers: int = 0
    submitted: float = 0.0
    errors: list[str] = field(default_factory=list)


def _alive_nodes(ray: Any) -> list[dict[str, Any]]:
    return sorted((n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= 1),
                  key=lambda n: n["NodeID"])


def unfit(nodes: Sequence[dict[str, Any]], resources: dict[str, Any]) -> str | None:
    """None when one of `nodes` can run a task asking for `resources` (`cell_resources`), else
    why not (Ray would queue such a task for ever)."""
    for n in nodes:
        r = n.get("Resources", {})
        if (r.get("CPU", 0) >= resources["num_cpus"] and r.get("GPU", 0) >= resources["num_gpus"]
                and r.get("memory", float("inf")) >= resources["memory"]):
            return None
    have = "; ".join(f"{n['Resources'].get('CPU', 0):g} CPU, {n['Resources'].get('GPU', 0):g} GPU, "
                     f"{n['Resources'].get('memory', 0) / 2**30:.1f} GiB" for n in nodes) or "no node alive"
    return (f"no node of the cluster fits a cell of {resources['num_cpus']} CPU, {resources['num_gpus']} GPU and "
            f"{resources['memory'] / 2**30:.1f} GiB (nodes: {have})")


def cluster_capacity(nodes: Sequence[dict[str, Any]], *, threads: int, gpu: bool) -> int:
    """How many cells of `threads` CPUs (and one GPU each with `gpu`) the nodes run at once."""
    total = 0
    for n in nodes:
        r = n.get("Resources", {})
        fit = int(r.get("CPU", 0)) // threads
        total += min(fit, int(r.get("GPU", 0))) if gpu else fit
    return total


def run_cells_ray(items: Sequence[Any], *, ray: Any, threads: int, gpu: bool, key: Callable[[Any], Hashable],
                  prepare: Callable[[Any], dict[str, Any]], finish: Callable[[Any, dict[str, Any], float], None],
                  fail: Callable[[Any, str], None], exclusive: Callable[[Any], bool],
                  waits_for: Callable[[Any], Hashable | None], memory: Callable[[Any], int],
                  expect: Callable[[Any], dict[str, Any] | None],
                  status: Callable[[list[dict[str, Any]]], None] = lambda s: None,
                  log: Callable[[str], None] = print, jobs: int | None = None, max_attempts: int = MAX_ATTEMPTS
                  ) -> dict[Hashable, dict[str, Any]]:
    """Measure `items` (in order) as Ray tasks on the connected cluster (`ray`, the module).
    `prepare(item)` -> `measure_cell`'s arguments (called once per item, when it first starts;
    its `journal` is the driver's, see the module docstring); `finish(item, result, seconds)` and
    `fail(item, error)` record an item (here, one at a time); `exclusive(item)`: a timed cell, alone
    on its node; `waits_for(item)`: the key of an earlier item it must follow (a failed one counts
    as done), or None; `memory(item)`: its estimate in bytes; `expect(item)`: the fingerprint its
    node must compute, or None; `status(cells)`: the cells in flight at every change, each
    {"cell", "node" (Ray node id, None while queued), "answers" (in its journal), "attempt"}
    (`describe` words it);
    `jobs`: at most this many cells in flight (default: as many as the cluster holds).
    -> per finished item: the node that measured it, its attempts, `task_s` (its last attempt's
    submission to its result, seconds) and `overhead_s` (that less the measurement's own seconds:
    what the task, its queue, its journal and its node's checks added)."""
    from ray.exceptions import RayTaskError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .lm import journal_db

    task = ray.remote(cell_task)
    todo = list(items)
    done: set[Hashable] = set()
    running: dict[Hashable, _Cell] = {}
    calls: dict[Hashable, dict[str, Any]] = {}
    lost: dict[Hashable, _Cell] = {}  # cells whose worker or node was lost, to be submitted again
    stats: dict[Hashable, dict[str, Any]] = {}

    def submit(cell: _Cell) -> str | None:
        """Submit `cell`'s next attempt; -> why it cannot run anywhere (not submitted), or None."""
        why = unfit(_alive_nodes(ray), cell_resources(threads=threads, gpu=gpu, memory=memory(cell.item)))
        if why is not None:
            return why
        journal = cell.call.get("journal")
        answers = journal_rows(journal_db(journal))[0] if journal is not None else []
        opts: dict[str, Any] = {**cell_resources(threads=threads, gpu=gpu, memory=memory(cell.item)),
                                "num_returns": "streaming", "max_retries": 0}
        if exclusive(cell.item):  # every CPU and GPU of the node that has the fewest of our cells
            where: dict[str, int] = {}
            for c in running.values():
                if c.node is not None:
                    where[c.node] = where.get(c.node, 0) + 1
            nodes = _alive_nodes(ray)
            if not nodes:
                raise RuntimeError("lcx report --ray: no node with a CPU is alive")
            node = min(nodes, key=lambda n: (where.get(n["NodeID"], 0), -n["Resources"]["CPU"]))
            opts.update(num_cpus=node["Resources"]["CPU"], num_gpus=node["Resources"].get("GPU", 0) if gpu else 0,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
        cell.gen = task.options(**opts).remote(cell.call, answers, threads, expect(cell.item))
        cell.attempt += 1
        cell.node, cell.started, cell.answers, cell.submitted = None, False, len(answers), time.perf_counter()
        return None

    def show() -> None:
        status([{"cell": c.item, "node": c.node if c.started else None, "answers": c.answers, "attempt": c.attempt}
                for c in running.values()])

    while todo or running:
        limit = max(1, cluster_capacity(_alive_nodes(ray), threads=threads, gpu=gpu))
        if jobs is not None:
            limit = min(limit, jobs)
        i = 0
        while i < len(todo) and len(running) < limit:
            item = todo[i]
            if any(exclusive(c.item) and not c.started for c in running.values()):
                break  # nothing after a timed cell is submitted before it has its node
            dep = waits_for(item)
            if dep is not None and dep not in done and (running or i > 0):
                i += 1
                continue
            todo.pop(i)
            k = key(item)
            if k not in calls:
                calls[k] = prepare(item)
            cell = lost.pop(k, None) or _Cell(item, calls[k])
            why = submit(cell)
            if why is not None:  # (a task no node fits would wait for ever)
                done.add(k)
                fail(item, why)
                continue
            running[k] = cell
            show()
        if not running:
            continue
        ready, _ = ray.wait([c.gen for c in running.values()], num_returns=1, timeout=1.0)
        for gen in ready:
            k = next(k for k, c in running.items() if c.gen is gen)
            cell = running[k]
            try:
                msg = ray.get(next(gen))
            except StopIteration:
                msg, err = None, "the task ended without a result"
            except RayTaskError as e:  # the cell's own error: a retry would fail the same way
                del running[k]
                done.add(k)
                fail(cell.item, f"{type(e.cause).__name__ if e.cause else 'error'}: {e.cause or e}")
                show()
                continue
            except ray.exceptions.RayError as e:  # the worker or its node was lost
                msg, err = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if msg is None:
                del running[k]
                cell.errors.append(err)
                if cell.attempt >= max_attempts:
                    done.add(k)
                    fail(cell.item, f"lost {cell.attempt} times: {'; '.join(cell.errors)}")
                else:
                    log(f"  {cell.item}: {err}; retrying (attempt {cell.attempt + 1} of {max_attempts}) from its "
                        f"journal")
                    lost[k] = cell
                    todo.insert(0, cell.item)
                show()
                continue
            if msg[0] == "started":
                cell.node, cell.started = msg[1], True
            elif msg[0] == "answers":
                append_rows(journal_db(cell.call["journal"]), msg[1])
                cell.answers += len(msg[1])
            elif msg[0] == "log":
                log(msg[1])
            elif msg[0] == "result":
                del running[k]
                done.add(k)
                task_s = time.perf_counter() - cell.submitted
                stats[k] = {"node": cell.node, "attempts": cell.attempt, "task_s": round(task_s, 3),
                            "overhead_s": round(task_s - msg[2], 3)}
                finish(cell.item, msg[1], msg[2])
            show()
    return stats


def describe(cells: Sequence[dict[str, Any]]) -> str:
    """What each node is doing, for a progress bar: `node: cell (answers)`, `?` for a queued cell."""
    parts = []
    for c in cells:
        item = c["cell"]
        text = f"{(c['node'] or '?')[:6]}: {'/'.join(map(str, item)) if isinstance(item, tuple) else item}"
        if c["answers"]:
            text += f" ({c['answers']} answers)"
        parts.append(text if c["node"] else text + " (queued)")
    return " | ".join(parts)


def wait_for_nodes(ray: Any, n: int, timeout_s: float = 60.0) -> None:
    """Block until `n` nodes are alive (a cluster being assembled), or raise TimeoutError."""
    t0 = time.monotonic()
    while len(_alive_nodes(ray)) < n:
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"only {len(_alive_nodes(ray))} of {n} Ray nodes alive after {timeout_s:.0f} s")
        time.sleep(0.2)
