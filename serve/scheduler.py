"""The batching scheduler: one worker thread owns the engine; HTTP handlers submit requests to it.

    handlers (event loop)  --submit/abort-->  inbox (queue)  -->  worker thread: engine.step() loop
             ^                                                            |
             +------------- events, via loop.call_soon_threadsafe --------+

When the engine is idle, the first request to arrive opens a batching window (`batch_window_s`):
everything that arrives within it is prefilled together. While the engine is busy, new requests
join the running batch at the next step (continuous batching), up to the engine's `max_batch`;
the rest wait in the engine's FIFO. Nothing is ever serialised per request, dropped or truncated:
every submitted request ends with exactly one finished event (stop, length, abort or error).

A failure confined to one request is isolated by the engine (`Engine.step`). If `step` itself
raises (a bug), every request in flight gets an error event, the engine's batch is reset, and
the worker keeps serving.

The same loop runs inside the engine process (`lcx.serve.engine_process`), where the
`after_iteration` hook sends each iteration's events to the server process in one message.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

from lcx.engine import Engine, SamplingParams, StepEvent

log = logging.getLogger("lcx.serve.scheduler")

Sink = Callable[[StepEvent], None]


class Scheduler:
    def __init__(self, engine: Engine, *, batch_window_s: float = 0.01,
                 after_iteration: Callable[["Scheduler"], None] | None = None):
        """`after_iteration(self)`: called on the worker thread after each turn of its loop (inbox
        drained, one step run, events delivered), e.g. to send what the sinks collected as one
        message."""
        if batch_window_s < 0:
            raise ValueError(f"batch_window_s must be >= 0, got {batch_window_s}")
        self.engine = engine
        self.batch_window_s = batch_window_s
        self.after_iteration = after_iteration
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lcx-engine", daemon=True)
        self.counters = {"submitted": 0, "finished": 0, "errors": 0, "aborted": 0, "worker_failures": 0,
                         "batches_over_1": 0}
        self._last_batch = 0

    # ------------------------------------------------------------------ control
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ thread-safe API
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, tag: str | None = None,
               *, request_id: str | None = None) -> str:
        """Queue a request (validate it first with `engine.validate`); `sink` gets its events on the
        worker thread, the last one with `finished=True`. Returns the request id, `r<n>` or
        `r<n>-<tag>` (the server tags it with the HTTP request id, so engine logs name it), or
        `request_id` when given (the engine process keeps the id its server side chose)."""
        rid = request_id or f"r{next(self._ids)}" + (f"-{tag}" if tag else "")
        self._inbox.put(("add", (rid, list(prompt_ids), params, sink)))
        return rid

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def snapshot(self) -> dict[str, Any]:
        return {"scheduler": dict(self.counters, waiting=self.engine.num_waiting, running=self.engine.num_running,
                                  batch_window_s=self.batch_window_s, max_batch=self.engine.config.max_batch),
                "engine": self.engine.stats.to_dict(), "prefix_cache": _prefix_cache_state(self.engine)}

    # ------------------------------------------------------------------ worker
    def _handle(self, kind: str, item: Any) -> None:
        if kind == "add":
            rid, prompt_ids, params, sink = item
            self.counters["submitted"] += 1
            try:
                self.engine.add_request(prompt_ids, params, request_id=rid, group=_group(rid))
            except Exception as e:  # noqa: BLE001 - validated by the handler; still never lose it
                self._emit(sink, StepEvent(rid, finished=True, finish_reason="error", error=e))
                return
            self._sinks[rid] = sink
        elif kind == "abort":
            ev = self.engine.abort(item)
            if ev is not None:
                self._deliver(ev)

    def _drain(self, block_s: float | None) -> None:
        """Handle inbox items: wait up to `block_s` for the first (None: don't wait), then take
        everything else already there."""
        try:
            if block_s is not None:
                kind, item = self._inbox.get(timeout=block_s)
                self._handle(kind, item)
            while True:
                kind, item = self._inbox.get_nowait()
                self._handle(kind, item)
        except queue.Empty:
            pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._turn()
            if self.after_iteration is not None:
                try:
                    self.after_iteration(self)
                except Exception:  # noqa: BLE001 - never kill the worker
                    log.exception("after_iteration failed")

    def _turn(self) -> None:
        """One turn of the loop: take the inbox (waiting for work when idle), run one step."""
        if not self.engine.has_work():
            self._drain(0.5)
            if not self.engine.has_work():
                return
            # Batching window: collect what arrives together before the first prefill.
            deadline = time.monotonic() + self.batch_window_s
            while (left := deadline - time.monotonic()) > 0:
                self._drain(left)
        else:
            self._drain(None)
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 - a bug in the engine: fail what is in flight, go on
            log.exception("engine step failed; failing %d in-flight request(s)", len(self._sinks))
            self.counters["worker_failures"] += 1
            self.engine.reset()
            for rid in list(self._sinks):
                self._deliver(StepEvent(rid, finished=True, finish_reason="error", error=e))
            return
        running = self.engine.num_running
        if running != self._last_batch:
            log.info("batch size %d -> %d (waiting %d)", self._last_batch, running, self.engine.num_waiting)
            self._last_batch = running
        if self.engine.stats.max_batch_size > 1:
            self.counters["batches_over_1"] = sum(
                v for k, v in self.engine.stats.batch_size_hist.items() if k > 1)
        for ev in events:
            self._deliver(ev)

    def _deliver(self, ev: StepEvent) -> None:
        sink = self._sinks.get(ev.request_id)
        if sink is None:
            return
        if ev.finished:
            del self._sinks[ev.request_id]
            self.counters["finished"] += 1
            if ev.finish_reason == "error":
                self.counters["errors"] += 1
            elif ev.finish_reason == "abort":
                self.counters["aborted"] += 1
        self._emit(sink, ev)

    @staticmethod
    def _emit(sink: Sink, ev: StepEvent) -> None:
        try:
            sink(ev)
        except Exception:  # noqa: BLE001 - e.g. the event loop closed; never kill the worker
            log.exception("could not deliver an event for %s", ev.request_id)


def _prefix_cache_state(engine: Any) -> dict[str, Any]:
    """The engine's prefix cache for /stats: its size and hit counters, or why it is off."""
    cache = getattr(engine, "prefix_cache", None)
    if cache is not None:
        return {"enabled": True, **cache.to_dict()}
    reason = getattr(engine, "prefix_cache_refusal", None)
    return {"enabled": False, "reason": reason or "turned off (--no-prefix-caching)"}


def _group(rid: str) -> str:
    """The client request an engine request belongs to, for the engine's fair scheduler: the n
    samples of one API call are tagged `<http request id>.<index>` (`submit`'s `tag`), in ids
    `r<n>-<tag>`, so the group is the tag without its index."""
    head, _, tail = rid.rpartition(".")
    counter, dash, http_id = head.partition("-")
    return http_id if dash and http_id and tail.isdigit() and counter[1:].isdigit() else rid
