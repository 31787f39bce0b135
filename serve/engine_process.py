"""The engine in its own process (the design of vLLM V1's EngineCore): the server process does
HTTP, parsing, tokenization and rendering; a child process owns the model and steps it.

    server process                                         engine process (spawned)
    handlers (event loop) --submit/abort--> pipe -------->  main thread: recv -> Scheduler inbox
    sinks <-- call_soon_threadsafe -- reader thread <-----  Scheduler worker: step(), one message
                                                            of events per loop iteration

Why: in one process the engine's worker thread and the event loop share the GIL. The engine
gives it up at each of its hundreds of small torch ops per step and must win it back; under a
flood of hostile bodies the busy loop makes each of those hand-overs wait (issue #34: a steady
client's p99 1.6-2.4x its solo p99 with the loop capped at 30% of CPU, `lcx.serve.pacing`).
In its own process the engine has its own GIL; the server process takes the GIL once per step,
to hand the step's events (one pickled message) to the event loop.

`EngineProcess` offers the interface of `lcx.serve.scheduler.Scheduler` (`submit`, `abort`,
`snapshot`, `start`, `stop`, `alive`; sinks are called in the server process, on its reader
thread) and `EngineProcess.engine`, an `EngineView`: what the server uses of an `Engine`
(tokenizer, `max_model_len`, `config.max_batch`, `validate`, `encode`, `token_str`, ...,
`has_work` for the `LoopPacer`) without the model's weights. The child builds the engine from
an `EngineRecipe` (picklable: the model's name, the `EngineConfig`, dtype, device, threads) and
sends back the tokenizer and what it resolved (max_model_len, vocabulary size, methods).

Failures. Every submitted request still ends with exactly one finished event. If the child
dies (killed, out of memory, a crash in native code), the reader thread sees its pipe close and
fails every request in flight with `EngineDeadError` (the server answers 503); `alive` turns
False (/health answers 503) and a new request fails at once with the same error. An exception
in a `StepEvent` that does not survive pickling is sent as a `RemoteEngineError` carrying its
type name and message. `stop` asks the child to finish, then terminates and kills it if it has
not within the timeout. The child exits by itself when the server process goes away (its pipe
closes), so a killed server leaves no engine behind. The child ignores SIGINT: Ctrl-C reaches
the whole process group, and the server shuts the engine down itself, after the last response.

The child is started with multiprocessing's "spawn" (no forked torch or thread state), which
re-imports the parent's main module: a script that starts an `EngineProcess` itself needs the
usual `if __name__ == "__main__":` guard (`lcx serve`, `python -m lcx.cli` and pytest have it).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import pickle
import signal
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from lcx.engine import Engine, EngineConfig, SamplingParams, StepEvent
from lcx.engine.detok import Detokenizer

from .scheduler import Scheduler, Sink

log = logging.getLogger("lcx.serve.engine_process")

START_TIMEOUT_S = 600.0  # loading a large model on a busy CPU takes minutes
STOP_TIMEOUT_S = 10.0  # `stop`: the child's own shutdown, before terminate, then kill


class EngineDeadError(RuntimeError):
    """The engine process is gone: the request could not run (the server answers 503)."""


class RemoteEngineError(RuntimeError):
    """Stands in for an exception raised in the engine process that does not pickle: its type's
    name (`type_name`, which error messages show) and its message."""

    def __init__(self, type_name: str, message: str):
        super().__init__(type_name, message)
        self.type_name, self.message = type_name, message

    def __str__(self) -> str:
        return self.message


def error_type_name(e: BaseException) -> str:
    """The name to show for `e`: an exception's own type, or the one a `RemoteEngineError` stands in for."""
    return e.type_name if isinstance(e, RemoteEngineError) else type(e).__name__


@dataclass(frozen=True)
class EngineRecipe:
    """How to build the engine in the child: what `lcx serve` would pass to `Engine.from_pretrained`.
    `threads`: torch's thread count in the child (resolved by the server: `lcx.threads`)."""

    model: str
    config: EngineConfig
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1
    log_level: str = "info"

    def build(self) -> tuple[Engine, str]:
        """The engine and how its max_model_len was derived (`lcx.serve.lengths.build_engine`)."""
        import torch

        from .lengths import build_engine

        torch.set_num_threads(int(self.threads))
        return build_engine(self.model, self.config, dtype=self.dtype, device=self.device)


class EngineView:
    """The server process's side of an engine that runs in the engine process: its tokenizer and
    what the child resolved, with `Engine`'s own text and validation methods (the same code, so
    a request refused here is one the engine would refuse). `has_work`, `num_waiting` and
    `num_running` read the live state `EngineProcess` keeps."""

    # Engine's methods that need only the tokenizer, `vocab_size` and `max_model_len`
    validate = Engine.validate
    encode = Engine.encode
    decode = Engine.decode
    token_bytes = Engine.token_bytes
    token_str = Engine.token_str

    def __init__(self, proc: "EngineProcess", info: dict[str, Any]):
        self._proc = proc
        self.tokenizer = info["tokenizer"]
        self.config: EngineConfig = info["config"]
        self.max_model_len: int = info["max_model_len"]
        self.max_model_len_source: str = info["max_model_len_source"]
        self.vocab_size: int = info["vocab_size"]
        self._methods_info: dict[str, Any] = info["methods_info"]
        self._detok = Detokenizer(self.tokenizer)

    def methods_info(self) -> dict[str, Any]:
        return dict(self._methods_info)

    def has_work(self) -> bool:
        return self._proc.has_work()

    @property
    def num_waiting(self) -> int:
        return self._proc.counts[0]

    @property
    def num_running(self) -> int:
        return self._proc.counts[1]


class EngineProcess:
    """The `Scheduler` interface over an engine process (see the module docstring).

    `start()` spawns the child and waits until its engine is built (raising the child's error if
    it could not be); then `engine` is its `EngineView`."""

    def __init__(self, recipe: EngineRecipe, *, batch_window_s: float = 0.01,
                 start_timeout_s: float = START_TIMEOUT_S):
        if batch_window_s < 0:
            raise ValueError(f"batch_window_s must be >= 0, got {batch_window_s}")
        self.recipe, self.batch_window_s, self.start_timeout_s = recipe, batch_window_s, start_timeout_s
        self._mp = mp.get_context("spawn")  # no forked torch, thread or event-loop state in the child
        self.counts = self._mp.RawArray("q", 2)  # the child's engine.num_waiting, num_running
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards _open, _dead, and sending on the pipe
        self._open: dict[str, Sink] = {}  # submitted, not finished
        self._dead: str | None = None  # why requests can no longer run (None while they can)
        self._snapshot: dict[str, Any] = {}
        self._proc: Any = None
        self._conn: Any = None
        self._reader: threading.Thread | None = None
        self.engine: EngineView | None = None

    # ------------------------------------------------------------------ control
    def start(self) -> "EngineProcess":
        if self._proc is not None:
            return self
        parent, child = self._mp.Pipe(duplex=True)
        self._proc = self._mp.Process(target=_child_main, name="lcx-engine",
                                      args=(self.recipe, self.batch_window_s, child, self.counts), daemon=True)
        self._proc.start()
        child.close()  # else the pipe never reports the child's end closing
        self._conn = parent
        try:
            if not parent.poll(self.start_timeout_s):
                raise RuntimeError(f"the engine process did not start within {self.start_timeout_s:g} s")
            kind, payload, _ = parent.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            kind, payload = "failed", f"the engine process exited while starting ({_exit_text(self._proc.exitcode)})"
        except BaseException:
            self._kill()
            raise
        if kind != "ready":
            self._kill()
            raise RuntimeError(f"the engine process could not build the engine: {payload}")
        self.engine = EngineView(self, payload)
        self._snapshot = payload["snapshot"]
        self._reader = threading.Thread(target=self._read, name="lcx-engine-reader", daemon=True)
        self._reader.start()
        log.info("engine process %d ready (max_model_len %d, max_batch %d)", self._proc.pid,
                 self.engine.max_model_len, self.engine.config.max_batch)
        return self

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the child to finish, wait up to `timeout`, then terminate (and kill) it; requests
        still open end with an error event."""
        if self._proc is None:
            return
        with self._lock:
            if self._dead is None:
                self._dead = "the server is shutting down"
            try:
                self._conn.send(("stop",))
            except (OSError, ValueError):
                pass  # already gone
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("engine process %d did not stop within %g s: terminating it", self._proc.pid, timeout)
            self._kill()
        self._conn.close()  # ends the reader (if the child's end is not closed yet)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)
        self._fail_open()

    def _kill(self) -> None:
        self._proc.terminate()
        self._proc.join(2)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(2)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def has_work(self) -> bool:
        """Requests submitted and not finished (the `LoopPacer` holds the loop back while there are)."""
        return bool(self._open)

    # ------------------------------------------------------------------ thread-safe API
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, tag: str | None = None) -> str:
        """As `Scheduler.submit`: `sink` gets the request's events on the reader thread."""
        rid = f"r{next(self._ids)}" + (f"-{tag}" if tag else "")
        with self._lock:
            dead = self._dead
            if dead is None:
                self._open[rid] = sink
                try:
                    self._conn.send(("add", rid, list(prompt_ids), params))
                except (OSError, ValueError):
                    pass  # the child is gone: the reader sees the pipe close and fails `rid` with the rest
        if dead is not None:
            Scheduler._emit(sink, _dead_event(rid, dead))
        return rid

    def abort(self, rid: str) -> None:
        with self._lock:
            if self._dead is None and rid in self._open:
                try:
                    self._conn.send(("abort", rid))
                except (OSError, ValueError):
                    pass

    def snapshot(self) -> dict[str, Any]:
        """The scheduler's and engine's counters as of the child's last finished request (sent with
        the events), waiting/running as of its last step, and the process's state."""
        snap = {k: dict(v) if isinstance(v, dict) else v for k, v in self._snapshot.items()}
        sched = snap.setdefault("scheduler", {})
        sched["waiting"], sched["running"] = self.counts[0], self.counts[1]
        snap["engine_process"] = {"pid": self.pid, "alive": self.alive, "open_requests": len(self._open),
                                  "exitcode": None if self._proc is None else self._proc.exitcode,
                                  "dead": self._dead}
        return snap

    # ------------------------------------------------------------------ reader thread
    def _read(self) -> None:
        while True:
            try:
                _, events, snap = self._conn.recv()
            except (EOFError, OSError, ValueError):
                break
            except Exception:  # noqa: BLE001 - a message that does not unpickle: the protocol is broken
                log.exception("unreadable message from the engine process; failing what is in flight")
                break
            if snap is not None:
                self._snapshot = snap
            for ev in events:
                with self._lock:
                    sink = self._open.pop(ev.request_id, None) if ev.finished else self._open.get(ev.request_id)
                if sink is not None:
                    Scheduler._emit(sink, ev)
        if self._dead is None:
            self._proc.join(1)
            reason = f"the engine process exited ({_exit_text(self._proc.exitcode)})"
            log.error("%s; failing %d request(s) in flight; new requests get 503", reason, len(self._open))
            with self._lock:
                self._dead = reason
        self._fail_open()

    def _fail_open(self) -> None:
        with self._lock:
            open_, self._open = self._open, {}
            reason = self._dead or "the engine process is gone"
        for rid, sink in open_.items():
            Scheduler._emit(sink, _dead_event(rid, reason))


def _dead_event(rid: str, reason: str) -> StepEvent:
    return StepEvent(rid, finished=True, finish_reason="error", error=EngineDeadError(reason))


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ============================================================================================
# The child
# ============================================================================================

def _child_main(recipe: EngineRecipe, batch_window_s: float, conn: Any, counts: Any) -> None:
    """The engine process: build the engine, run the `Scheduler` loop in its worker thread, feed
    it from the pipe on this (main) thread until told to stop or the server process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops us (see the module docstring)
    logging.basicConfig(level=recipe.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[engine %(process)d]: %(message)s")
    try:
        engine, max_model_len_source = recipe.build()
    except BaseException as e:  # noqa: BLE001 - reported to the server, which refuses to start
        conn.send(("failed", f"{type(e).__name__}: {e}", None))
        return
    pending: list[StepEvent] = []

    def flush(sched: Scheduler) -> None:
        """After each iteration of the worker's loop (on the worker thread): the events it
        delivered, as one message; the counters with them when a request finished."""
        counts[0], counts[1] = engine.num_waiting, engine.num_running
        if not pending:
            return
        events = [_picklable(ev) for ev in pending]
        pending.clear()
        snap = sched.snapshot() if any(ev.finished for ev in events) else None
        try:
            conn.send(("events", events, snap))
        except (OSError, ValueError):
            pass  # the server is gone; the main thread sees it too and ends this process

    sched = Scheduler(engine, batch_window_s=batch_window_s, after_iteration=flush)
    conn.send(("ready", {"tokenizer": engine.tokenizer, "config": engine.config,
                         "max_model_len": engine.max_model_len, "max_model_len_source": max_model_len_source,
                         "vocab_size": engine.vocab_size,
                         "methods_info": engine.methods_info(), "snapshot": sched.snapshot()}, None))
    sched.start()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break  # the server process is gone
        if msg[0] == "add":
            _, rid, prompt_ids, params = msg
            sched.submit(prompt_ids, params, pending.append, request_id=rid)
        elif msg[0] == "abort":
            sched.abort(msg[1])
        elif msg[0] == "stop":
            break
    sched.stop()
    conn.close()
    # and return: a normal exit (os._exit would leave the semaphores made here to the resource tracker)


def _picklable(ev: StepEvent) -> StepEvent:
    """`ev`, with an exception that would not survive the pipe replaced by a `RemoteEngineError`."""
    e = ev.error
    if e is None:
        return ev
    try:
        pickle.loads(pickle.dumps(e))  # some exceptions pickle but do not unpickle (other __init__ args)
        return ev
    except Exception:  # noqa: BLE001
        return dataclasses.replace(ev, error=RemoteEngineError(type(e).__name__, str(e)))
