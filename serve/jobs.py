"""Job streams: a request's choices (`Job`) run through the scheduler, with disconnect = abort,
collected (`JobRunner.run_all`) or streamed as server-sent events (`JobRunner.sse_response`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from lcx.engine import SamplingParams, StepEvent, TokenLogprob

from .engine_process import EngineDeadError, EngineProcess, EngineTimeoutError, error_type_name
from .gate import ClientGone, HttpStats, request_id
from .protocol import APIError, Usage
from .scheduler import Scheduler

log = logging.getLogger("lcx.serve")


@dataclass
class Job:
    """One choice: a prompt run once with its sampling params, and what came back so far."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    started: bool = False
    text_offset: int = 0  # streaming: character offset of the next token in the choice's whole text

    def add(self, ev: StepEvent) -> None:
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs
        if ev.text:
            self.text.append(ev.text)
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        if ev.finished:
            self.finish_reason = ev.finish_reason


def usage(jobs: Sequence[Job]) -> Usage:
    prompt = sum(len(j.prompt_ids) for j in {j.prompt_index: j for j in jobs}.values())
    gen = sum(len(j.token_ids) for j in jobs)
    return Usage(prompt_tokens=prompt, completion_tokens=gen, total_tokens=prompt + gen)


RETRY_AFTER_S = 5  # the Retry-After of a 503 while the engine process is down, restarting or not responding


def engine_error(ev: StepEvent) -> APIError:
    """The error a request the engine failed gets: 503 when the engine is gone (its process died
    or the server is stopping: the request could not run, another try may), 503 `engine_timeout`
    when the engine stopped responding and was killed to be restarted (`lcx serve
    --engine-timeout-s`), else 500.

    503 rather than 504 for the timeout: 504 says a gateway's upstream did not answer in time,
    but here the server is the origin and what failed is its own engine, which is restarting; 503
    with Retry-After says the service is briefly unavailable and when to try again (the openai
    client retries both), the same answer a request gets when the engine process dies."""
    e = ev.error
    if isinstance(e, EngineTimeoutError):
        return APIError(503, f"the engine did not finish this request: {e}; retry after it is back (see /health)",
                        type="server_error", code="engine_timeout", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running: {e}", type="server_error", code="engine_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(500, f"the engine failed on this request: {error_type_name(e)}: {e}", type="server_error",
                    code="engine_error")


def sse(obj: BaseModel | dict[str, Any]) -> str:
    text = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj, ensure_ascii=False)
    return f"data: {text}\n\n"


class JobRunner:
    """Runs a request's jobs on the scheduler (`ServerContext.jobs`); `stats` counts the errors
    a stream ends with."""

    def __init__(self, scheduler: Scheduler | EngineProcess, stats: HttpStats):
        self.sched, self.stats = scheduler, stats

    async def events(self, jobs: Sequence[Job], request: Request) -> AsyncIterator[tuple[Job, StepEvent]]:
        """Submit every job to the scheduler and yield `(job, event)` as they come. Raises
        `ClientGone` as soon as the client disconnects; jobs still open when the consumer stops
        (error, client gone, cancelled) are aborted, which frees their batch slots."""
        sched = self.sched
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple[int, StepEvent] | None] = asyncio.Queue()
        rids: dict[int, str] = {}
        for j in jobs:
            def sink(ev: StepEvent, idx: int = j.index) -> None:
                loop.call_soon_threadsafe(q.put_nowait, (idx, ev))
            rids[j.index] = sched.submit(j.prompt_ids, j.params, sink, tag=f"{request_id(request)}.{j.index}")
        open_ = set(rids)
        by_index = {j.index: j for j in jobs}

        async def watch() -> None:
            # The body is read, so the next message is the disconnect (uvicorn also sends one
            # when the response is complete; by then this task is cancelled). Abort here, not only
            # in `finally`: a stream cancelled while sending may leave this generator suspended.
            while (await request.receive())["type"] != "http.disconnect":
                pass
            for idx in open_:
                sched.abort(rids[idx])
            q.put_nowait(None)

        watcher = asyncio.ensure_future(watch())
        try:
            while open_:
                item = await q.get()
                if item is None:
                    raise ClientGone()
                idx, ev = item
                if ev.finished:
                    open_.discard(idx)
                yield by_index[idx], ev
        finally:
            watcher.cancel()
            for idx in open_:
                sched.abort(rids[idx])

    def engine_problem(self) -> str | None:
        """Why the engine cannot take requests now (/health's 503), or None: its process is down,
        restarting, or not responding (`EngineProcess.health`); the engine thread is not running."""
        health = getattr(self.sched, "health", None)
        if health is not None:
            return health()
        return None if self.sched.alive else "the engine worker is not running"

    def check_engine(self) -> None:
        """503 with Retry-After before anything is queued while the engine cannot take requests,
        as /health says: its process died and is being restarted, the server gave up on it, or it
        is not responding (no heartbeat for `heartbeat_timeout_s`: stopped or frozen). A request
        queued on a frozen engine would wait until it resumes or is restarted."""
        why = self.engine_problem()
        if why is None and not self.sched.alive:
            why = "the engine is not running"
        if why is not None:
            raise APIError(503, f"{why} (see /health and the server's log); the request was not queued",
                           type="server_error", code="engine_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def run_all(self, jobs: Sequence[Job], request: Request) -> None:
        """Run `jobs` to completion (each job collects its events)."""
        self.check_engine()
        async with contextlib.aclosing(self.events(jobs, request)) as stream:
            async for job, ev in stream:
                if ev.finish_reason == "error":
                    raise engine_error(ev)
                job.add(ev)

    def sse_response(self, request: Request, jobs: Sequence[Job],
                     on_event: Callable[[Job, StepEvent], Iterable[BaseModel]], *,
                     first: Iterable[BaseModel] = (), usage_chunk: Callable[[Usage], BaseModel] | None = None
                     ) -> StreamingResponse:
        """The event stream of both endpoints: the `first` chunks, then for every engine event
        (after `job.add`) the chunks `on_event` makes; an engine failure ends the stream with an
        error object and [DONE] (jobs still open are aborted by `events`); then the chunk
        `usage_chunk(usage)` makes, when given, and [DONE]. A client that leaves ends it at once."""
        rid = request_id(request)
        self.check_engine()

        async def body() -> AsyncIterator[str]:
            for c in first:
                yield sse(c)
            async with contextlib.aclosing(self.events(jobs, request)) as evs:  # ClientGone propagates to Gate
                async for j, ev in evs:
                    if ev.finish_reason == "error":
                        err = engine_error(ev)
                        self.stats.error(err.status, err.code)
                        log.error("request %s: stream ended by an engine error: %s", rid, err.message)
                        yield sse(err.body())
                        yield "data: [DONE]\n\n"
                        return
                    j.add(ev)
                    for c in on_event(j, ev):
                        yield sse(c)
            if usage_chunk is not None:
                yield sse(usage_chunk(usage(jobs)))
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
