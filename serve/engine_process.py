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
fails every request in flight with `EngineDeadError` (the server answers 503 with Retry-After);
`alive` turns False (/health answers 503) and a new request fails at once with the same error
while a new child is started (healing): after RESTART_BACKOFF_S[0] s, then with a doubling
backoff; the new child loads the model again and, once ready, takes new requests. At most
`max_restarts` restarts within RESTART_WINDOW_S: one more death (or a failed restart) makes the
`EngineProcess` give up: `on_give_up(reason)` is called (`lcx serve` then exits non-zero, so
that a supervisor restarts it) and requests keep getting 503.

Heartbeat. A thread of the child writes the time (`time.monotonic`, one clock for all processes
on Linux) to shared memory every HEARTBEAT_S; `responsive` is False once it is older than
`heartbeat_timeout_s` (the child is stopped, SIGSTOP, or frozen), and /health answers 503 until
it beats again (SIGCONT); meanwhile a new request gets 503 with Retry-After at once, before it
is queued (`lcx.serve.jobs.JobRunner.check_engine`). It is a thread of its own, not the engine
loop, so a long prefill does not look like a hang; torch releases the GIL in its ops, so the
thread beats during steps.

Hang deadline. A watchdog thread of the server process gives a silent child `engine_timeout_s`
(`lcx serve --engine-timeout-s`, 60 s by default as vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S; 0:
never): no heartbeat for that long and the child is taken for hung, killed (SIGKILL, which a
stopped process receives too) and healed as after any death: every request in flight ends with
`EngineTimeoutError` (the server answers 503 `engine_timeout` with Retry-After; a stream gets an
error event and [DONE]), and a new child is started. So no request waits on a frozen engine for
more than `engine_timeout_s`, and the server comes back by itself. The deadline is on the
engine's silence, not on a request's age: a long generation on a live engine is never cut. An exception
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
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from lcx.engine import Engine, EngineConfig, SamplingParams, StepEvent
from lcx.engine.detok import Detokenizer

from .scheduler import Scheduler, Sink

log = logging.getLogger("lcx.serve.engine_process")

START_TIMEOUT_S = 600.0  # loading a large model on a busy CPU takes minutes
STOP_TIMEOUT_S = 10.0  # `stop`: the child's own shutdown, before terminate, then kill
HEARTBEAT_S = 0.25  # the child's heartbeat period
HEARTBEAT_TIMEOUT_S = 5.0  # no heartbeat for this long: the engine is not responding (/health 503, new requests 503)
ENGINE_TIMEOUT_S = 60.0  # no heartbeat for this long: the engine is hung, killed and restarted (0: never)
MAX_RESTARTS = 3  # restarts of a dead engine process within RESTART_WINDOW_S before giving up
RESTART_WINDOW_S = 300.0
RESTART_BACKOFF_S = (0.5, 30.0)  # first wait before a restart, and the most (doubling in between)


class EngineDeadError(RuntimeError):
    """The engine process is gone: the request could not run (the server answers 503)."""


class EngineTimeoutError(EngineDeadError):
    """The engine process did not respond within `engine_timeout_s` and was killed, to be
    restarted: the request was stopped (the server answers 503 `engine_timeout`)."""


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

        from lcx.allocator import reuse_freed_memory

        torch.set_num_threads(int(self.threads))
        reuse_freed_memory()  # this process runs the model (the server's own process does not: lcx.allocator)
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
                 start_timeout_s: float = START_TIMEOUT_S, max_restarts: int = MAX_RESTARTS,
                 restart_window_s: float = RESTART_WINDOW_S, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 engine_timeout_s: float = ENGINE_TIMEOUT_S, on_give_up: Callable[[str], None] | None = None):
        if batch_window_s < 0:
            raise ValueError(f"batch_window_s must be >= 0, got {batch_window_s}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if not heartbeat_timeout_s > HEARTBEAT_S:
            raise ValueError(f"heartbeat_timeout_s must be > {HEARTBEAT_S}, got {heartbeat_timeout_s}")
        if engine_timeout_s != 0 and not engine_timeout_s >= heartbeat_timeout_s:
            raise ValueError(f"engine_timeout_s must be 0 (never) or >= heartbeat_timeout_s ({heartbeat_timeout_s:g}), "
                             f"got {engine_timeout_s}")
        self.recipe, self.batch_window_s, self.start_timeout_s = recipe, batch_window_s, start_timeout_s
        self.max_restarts, self.restart_window_s = max_restarts, restart_window_s
        self.heartbeat_timeout_s, self.on_give_up = heartbeat_timeout_s, on_give_up
        self.engine_timeout_s = engine_timeout_s
        self._mp = mp.get_context("spawn")  # no forked torch, thread or event-loop state in the child
        self.counts = self._mp.RawArray("q", 2)  # the child's engine.num_waiting, num_running
        self.heartbeat = self._mp.RawValue("d", 0.0)  # the child's last beat (time.monotonic)
        self._restarts: list[float] = []  # when each restart began (within the window)
        self.restarting = False  # a restart is under way
        self.gave_up: str | None = None  # why the EngineProcess gave up (None while it heals)
        self._stopping = False
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards _open, _dead, and sending on the pipe
        self._open: dict[str, Sink] = {}  # submitted, not finished
        self._dead: str | None = None  # why requests can no longer run (None while they can)
        self._snapshot: dict[str, Any] = {}
        self._proc: Any = None
        self._conn: Any = None
        self._reader: threading.Thread | None = None
        self.engine: EngineView | None = None
        self._watching = False  # the watchdog may kill the child (it is serving: ready, reader running)
        self._hung: str | None = None  # why the watchdog killed the child (read by the reader thread)
        self.timeouts = 0  # children killed by the watchdog
        self._stop_watchdog = threading.Event()

    # ------------------------------------------------------------------ control
    def start(self) -> "EngineProcess":
        if self._proc is not None:
            return self
        self._spawn()
        if self.engine_timeout_s:
            threading.Thread(target=self._watchdog, name="lcx-engine-watchdog", daemon=True).start()
        return self

    def _spawn(self) -> None:
        """Start a child and wait until its engine is built; then a reader thread serves it."""
        parent, child = self._mp.Pipe(duplex=True)
        self.heartbeat.value = time.monotonic()
        self._proc = self._mp.Process(target=_child_main, name="lcx-engine",
                                      args=(self.recipe, self.batch_window_s, child, self.counts, self.heartbeat),
                                      daemon=True)
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
        if self.engine is None:
            self.engine = EngineView(self, payload)
        self._snapshot = payload["snapshot"]
        self._reader = threading.Thread(target=self._read, args=(self._conn, self._proc), name="lcx-engine-reader",
                                        daemon=True)
        self._reader.start()
        with self._lock:
            self._watching = True
        log.info("engine process %d ready (max_model_len %d, max_batch %d)", self._proc.pid,
                 self.engine.max_model_len, self.engine.config.max_batch)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the child to finish, wait up to `timeout`, then terminate (and kill) it; requests
        still open end with an error event."""
        if self._proc is None:
            return
        self._stopping = True
        self._stop_watchdog.set()
        with self._lock:
            self._watching = False
            if self._dead is None or self.restarting:
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
    def responsive(self) -> bool:
        """The child's heartbeat is recent (False while it is stopped or frozen; see the module docstring)."""
        return time.monotonic() - self.heartbeat.value < self.heartbeat_timeout_s

    def health(self) -> str | None:
        """None when the engine can take requests, else why not (for /health)."""
        if self.gave_up is not None:
            return f"the engine process failed repeatedly and the server gave up: {self.gave_up}"
        if self.restarting:
            return f"the engine process is restarting ({self._dead})"
        if not self.alive:
            return "the engine process is not running" + (f" ({self._dead})" if self._dead else "")
        if not self.responsive:
            return (f"the engine process is not responding (no heartbeat for "
                    f"{time.monotonic() - self.heartbeat.value:.1f} s)")
        return None

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
                                  "dead": self._dead, "responsive": self.responsive,
                                  "restarts": len(self._restarts), "restarting": self.restarting,
                                  "gave_up": self.gave_up, "timeouts": self.timeouts,
                                  "engine_timeout_s": self.engine_timeout_s,
                                  "heartbeat_timeout_s": self.heartbeat_timeout_s}
        return snap

    # ------------------------------------------------------------------ reader thread
    def _read(self, conn: Any, proc: Any) -> None:
        while True:
            try:
                _, events, snap = conn.recv()
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
        died = timed_out = False
        with self._lock:
            self._watching = False
            if self._dead is None and not self._stopping:
                proc.join(1)
                timed_out = self._hung is not None
                self._dead = self._hung or f"the engine process exited ({_exit_text(proc.exitcode)})"
                died = True
            self._hung = None
        if died:
            log.error("%s; failing %d request(s) in flight; new requests get 503 until it is restarted",
                      self._dead, len(self._open))
        self._fail_open(EngineTimeoutError if timed_out else EngineDeadError)
        if died:
            self._heal()

    # ------------------------------------------------------------------ watchdog
    def _watchdog(self) -> None:
        """Kill a child whose heartbeat is older than `engine_timeout_s` (see the module
        docstring); the reader thread then sees its pipe close and fails what is in flight with
        `EngineTimeoutError`, and the child is healed as after any death."""
        period = min(HEARTBEAT_S, self.engine_timeout_s / 8)
        while not self._stop_watchdog.wait(period):
            silent = time.monotonic() - self.heartbeat.value
            if silent <= self.engine_timeout_s:
                continue
            with self._lock:
                proc = self._proc if self._watching and self._dead is None and not self._stopping else None
                if proc is None:
                    continue
                self._watching = False
                self._hung = (f"the engine process did not respond for {silent:.1f} s (no heartbeat; lcx serve "
                              f"--engine-timeout-s {self.engine_timeout_s:g}): it was killed and is restarted")
                self.timeouts += 1
            log.error("engine process %d: no heartbeat for %.1f s (engine timeout %g s): killing it, failing %d "
                      "request(s) in flight", proc.pid, silent, self.engine_timeout_s, len(self._open))
            try:
                proc.kill()  # SIGKILL: a stopped (SIGSTOP) process receives it too
            except (OSError, ValueError):
                pass  # already gone: the reader handles it

    # ------------------------------------------------------------------ healing
    def _heal(self) -> None:
        """Restart the child after a death, with backoff, unless the restarts within the window
        are used up: then give up (`on_give_up`)."""
        self.restarting = True
        wait = RESTART_BACKOFF_S[0]
        while not self._stopping:
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < self.restart_window_s]
            if len(self._restarts) >= self.max_restarts:
                self._give_up(f"{self._dead}; {len(self._restarts)} restart(s) within {self.restart_window_s:g} s "
                              "already")
                return
            self._restarts.append(now)
            log.warning("restarting the engine process in %.1f s (restart %d of at most %d within %g s)", wait,
                        len(self._restarts), self.max_restarts, self.restart_window_s)
            time.sleep(wait)
            if self._stopping:
                break
            try:
                self._spawn()
            except Exception as e:  # noqa: BLE001 - counted as a failure; the loop decides
                log.error("the engine process could not be restarted: %s", e)
                with self._lock:
                    self._dead = f"the engine process could not be restarted: {e}"
                wait = min(2 * wait, RESTART_BACKOFF_S[1])
                continue
            with self._lock:
                if not self._stopping:
                    self._dead = None
            log.warning("engine process restarted (pid %d)", self._proc.pid)
            break
        self.restarting = False

    def _give_up(self, reason: str) -> None:
        self.gave_up = reason
        self.restarting = False
        log.critical("giving up on the engine process: %s", reason)
        if self.on_give_up is not None:
            self.on_give_up(reason)

    def _fail_open(self, error: type[EngineDeadError] = EngineDeadError) -> None:
        with self._lock:
            open_, self._open = self._open, {}
            reason = self._dead or "the engine process is gone"
        for rid, sink in open_.items():
            Scheduler._emit(sink, _dead_event(rid, reason, error))


def _dead_event(rid: str, reason: str, error: type[EngineDeadError] = EngineDeadError) -> StepEvent:
    return StepEvent(rid, finished=True, finish_reason="error", error=error(reason))


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

def _beat(heartbeat: Any) -> None:
    while True:
        heartbeat.value = time.monotonic()
        time.sleep(HEARTBEAT_S)


def _child_main(recipe: EngineRecipe, batch_window_s: float, conn: Any, counts: Any, heartbeat: Any) -> None:
    """The engine process: build the engine, run the `Scheduler` loop in its worker thread, feed
    it from the pipe on this (main) thread until told to stop or the server process is gone; a
    daemon thread beats the heartbeat throughout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops us (see the module docstring)
    threading.Thread(target=_beat, args=(heartbeat,), name="lcx-heartbeat", daemon=True).start()
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
