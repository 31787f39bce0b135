"""`ServerContext`: the state the routes share (`app.state.ctx`) and what it is made of.

The request plumbing lives in one module per job, each a part of the context:
- `body` (`lcx.serve.body.BodyReader`): reading a body off the connection, scanned as it
  arrives, and parsing it on the CPU pool with bounded work;
- `checks` (`lcx.serve.sampling.RequestChecks`): validating the model name, prompts and each
  choice's sampling fields against the engine, and the per-request work bound;
- `render` (`lcx.serve.render.Renderer`): chat prompts through the chat template, and logprobs
  in OpenAI's completion and chat forms;
- `jobs` (`lcx.serve.jobs.JobRunner`): running the choices through the scheduler with
  disconnect = abort, collected or as an event stream.
The context itself holds the engine, the scheduler, the CPU pool (`cpu`, with the inline rule
for small requests), the HTTP counters and the pacer, and starts and stops them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import logging
from typing import Any, Callable, Sequence

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from lcx.engine import Engine

from .body import DEFAULT_BODY_TIMEOUT_S, INLINE_BYTES, BodyReader, Limits, cap_mmap_threshold, release_memory
from .chat_template import DEFAULT_CHAT_TEMPLATE, resolve_chat_template
from .engine_process import EngineProcess, EngineView
from .gate import HttpStats
from .jobs import Job, JobRunner
from .pacing import DEFAULT_SHARE, LoopPacer
from .render import Renderer
from .sampling import DEFAULT_MAX_N, RequestChecks
from .scheduler import Scheduler

log = logging.getLogger("lcx.serve")

CPU_WORKERS = 2  # parsing / tokenization / rendering threads
INLINE_TOKENS = 256  # responses of small requests are rendered on the event loop when they hold at most this many tokens
TIDY_QUIET_S = 1.0  # `_tidy_after_bursts`: a second without a new request ...
TIDY_MIN_REQUESTS = 256  # ... after at least this many since the last tidy


class ServerContext:
    """The state the routes share (`app.state.ctx`): the engine, scheduler, CPU pool, counters,
    and the parts `body`, `checks`, `render`, `jobs` (see the module docstring)."""

    def __init__(self, engine: Engine | EngineView, scheduler: Scheduler | EngineProcess, *, model_name: str,
                 max_body_bytes: int,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, max_stop: int | None = None,
                 chat_template: str | None = DEFAULT_CHAT_TEMPLATE, loop_share: float = DEFAULT_SHARE,
                 max_model_len_source: str | None = None, max_request_tokens: int | None = None,
                 max_n: int = DEFAULT_MAX_N):
        self.engine, self.sched, self.model_name = engine, scheduler, model_name
        self.max_model_len_source = max_model_len_source or "the engine's (lcx.engine.EngineConfig.max_model_len)"
        self.stats = HttpStats()
        self.tok = engine.tokenizer
        self.checks = RequestChecks(engine, model_name=model_name, max_request_tokens=max_request_tokens,
                                    max_n=max_n)
        self.prompt_char_limit = self.checks.prompt_char_limit
        limits = Limits.for_engine(engine.max_model_len, **({} if max_stop is None else {"max_stop": max_stop}),
                                   max_prompt_chars=self.prompt_char_limit)
        self.body = BodyReader(limits, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, cpu=self.cpu)
        # the tokenizer's own template, else (unless chat_template is None) lcx's documented default
        template, self.chat_template_source = resolve_chat_template(self.tok, chat_template)
        self.render = Renderer(engine, self.checks, model_name=model_name, chat_template=template)
        self.jobs = JobRunner(scheduler, self.stats)
        self.pool = concurrent.futures.ThreadPoolExecutor(CPU_WORKERS, thread_name_prefix="lcx-cpu")
        self.pacer = LoopPacer(engine.has_work, share=loop_share)
        self._tidy_task: asyncio.Task | None = None
        self.tidied = 0  # times `_tidy_after_bursts` collected and trimmed (for /stats)

    def start(self) -> None:
        cap_mmap_threshold()
        # Everything allocated so far (torch, transformers, the model: ~10^6 objects) lives as
        # long as the server: out of the collector's sight, a full collection no longer walks it.
        # It took 0.4-0.6 s with them, stalling every client (a flood of connections triggers
        # one every few seconds); now it sees only what requests allocate.
        gc.collect()
        gc.freeze()
        self._tidy_task = asyncio.get_running_loop().create_task(self._tidy_after_bursts(), name="lcx-tidy")
        if not self.sched.alive:
            self.sched.start()
        self.pacer.start()
        log.info("serving %s (max_model_len %d, max_batch %d, prompts of at most %d characters are tokenized, "
                 "bodies of at most %d bytes)", self.model_name, self.engine.max_model_len,
                 self.engine.config.max_batch, self.prompt_char_limit, self.body.max_body_bytes)

    def stop(self) -> None:
        self.pacer.stop()
        if self._tidy_task is not None:
            self._tidy_task.cancel()
        gc.unfreeze()  # an app embedded in a longer process (tests, notebooks) leaves it as it was
        self.sched.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _tidy_after_bursts(self) -> None:
        """After a burst of requests (a flood of refused or timed-out bodies, thousands of
        connections) and then a quiet `TIDY_QUIET_S`: collect the garbage they left (transports
        and protocols in reference cycles wait for a full collection) and give freed heap pages
        back to the OS, so that the server's memory comes back when the burst is over."""
        seen = tidied = self.stats.activity
        while True:
            await asyncio.sleep(TIDY_QUIET_S)
            now = self.stats.activity
            if now == seen and now - tidied >= TIDY_MIN_REQUESTS:
                await self.cpu(_collect_and_trim)
                tidied = now
                self.tidied += 1
            seen = now

    # ------------------------------------------------------------------ the CPU pool
    async def cpu(self, fn: Callable[..., Any], *args: Any, inline: bool = False) -> Any:
        """`fn(*args)` on the CPU thread pool (tokenization, parsing, rendering: off the event loop);
        `inline=True`: here, for the small work of a small request (`small_request`,
        `small_result`), where the two thread hops cost more than the work: under a flood each
        hop waits for the GIL (a steady 8-token request's p50 65 -> 54 ms under the slow tier's
        storm)."""
        if inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    async def json_response(self, obj: BaseModel, inline: bool = False) -> Response:
        """`obj` rendered on the CPU pool (`inline`: here, see `cpu`)."""
        return Response(await self.cpu(obj.model_dump_json, inline=inline), media_type="application/json")

    @staticmethod
    def small_request(request: Request) -> bool:
        """The request's body (read by `parse`) was under INLINE_BYTES: its parse and
        tokenization are cheaper than a thread hop."""
        return getattr(request.state, "lcx_body_bytes", INLINE_BYTES) < INLINE_BYTES

    def small_result(self, request: Request, jobs: Sequence[Job]) -> bool:
        """A small request whose jobs hold at most INLINE_TOKENS tokens in all, prompts included
        (an echo with prompt logprobs renders every prompt token): rendering its response is
        cheaper than a thread hop."""
        return (self.small_request(request)
                and sum(len(j.prompt_ids) + len(j.token_ids) for j in jobs) <= INLINE_TOKENS)


def _collect_and_trim() -> None:
    gc.collect()
    release_memory()


async def ctx(request: Request) -> ServerContext:
    """The routes' dependency: the app's `ServerContext`. `async`: FastAPI runs a plain `def`
    dependency in its thread pool, a thread hop (and GIL hand-overs with the engine thread) per
    request for an attribute read; under a storm of refused bodies that hop was ~40% of the
    event loop's time."""
    return request.app.state.ctx
