"""What every route shares: `ServerContext` (the engine, its scheduler, the CPU pool, the HTTP
counters, the limits) and the request plumbing built on it — reading and parsing bodies off the
event loop, validating prompts and sampling fields against the engine, running jobs through the
scheduler with disconnect = abort, and rendering logprobs and event streams."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from lcx.engine import INT64_MAX, INT64_MIN, ContextLengthError, Engine, SamplingParams, StepEvent, TokenLogprob

from .body import TRIM_BYTES, Limits, Scanner, cap_mmap_threshold, parse_body, release_memory
from .chat_template import DEFAULT_CHAT_TEMPLATE, resolve_chat_template
from .engine_process import EngineDeadError, EngineProcess, EngineView, error_type_name
from .gate import ClientGone, HttpStats, request_id
from .pacing import DEFAULT_SHARE, LoopPacer
from .protocol import (
    LENGTH_HINT,
    MAX_PROMPTS,
    APIError,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    Usage,
    bad_request,
)
from .scheduler import Scheduler

log = logging.getLogger("lcx.serve")

# A prompt of more than `margin x longest token (characters) x max_model_len` characters cannot fit
# max_model_len tokens: every token covers at most the longest token's characters. That is exact
# for tokenizers whose normaliser never shortens text (byte-level BPE, Llama's SentencePiece);
# the margin leaves room for ones that do (Unicode composition). Only the bound is approximate:
# a prompt under it is tokenized and checked exactly.
PROMPT_CHARS_MARGIN = 2
CPU_WORKERS = 2  # parsing / tokenization / rendering threads
INLINE_BYTES = 16 << 10  # bodies under this are parsed and tokenized on the event loop (`ServerContext.cpu`)
INLINE_TOKENS = 256  # ... and their responses rendered there when they hold at most this many tokens
TIDY_QUIET_S = 1.0  # `_tidy_after_bursts`: a second without a new request ...
TIDY_MIN_REQUESTS = 256  # ... after at least this many since the last tidy
DEFAULT_BODY_TIMEOUT_S = 60.0  # a body must arrive within this (`lcx serve --body-timeout-s`)
# The per-request work bound (`lcx serve --max-request-tokens`, `--max-n`): a request's choices may
# together ask for at most WORK_FACTOR x max_model_len tokens of prompt + max_tokens, and n is at
# most DEFAULT_MAX_N (OpenAI's limit), so that one request cannot hold the engine for minutes
# while others wait (issue #44: n=256 x 32 tokens made a 4-token request wait 8.5 s).
WORK_FACTOR = 4
DEFAULT_MAX_N = 128
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
LOGPROB_FLOOR = -9999.0  # what a -inf logprob is sent as (JSON has no -inf; vLLM does the same)


def max_token_chars(tok: Any) -> int:
    """The most characters one token of `tok` stands for (its raw string or its decoded text,
    special tokens included): the bound behind `PROMPT_CHARS_MARGIN`."""
    ids = list(range(len(tok)))
    raw = tok.convert_ids_to_tokens(ids)
    decoded = tok.batch_decode([[i] for i in ids], skip_special_tokens=False)
    return max(1, max((len(t) for t in raw if t), default=1), max((len(t) for t in decoded), default=1))


def finite(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN (never expected) to the floor


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


RETRY_AFTER_S = 5  # the Retry-After of a 503 while the engine process is down or restarting


def engine_error(ev: StepEvent) -> APIError:
    """The error a request the engine failed gets: 503 when the engine is gone (its process died
    or the server is stopping: the request could not run, another try may), else 500."""
    e = ev.error
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running: {e}", type="server_error", code="engine_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(500, f"the engine failed on this request: {error_type_name(e)}: {e}", type="server_error",
                    code="engine_error")


def sse(obj: BaseModel | dict[str, Any]) -> str:
    text = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj, ensure_ascii=False)
    return f"data: {text}\n\n"


class ServerContext:
    """The state the routes share (`app.state.ctx`) and the plumbing they build on."""

    def __init__(self, engine: Engine | EngineView, scheduler: Scheduler | EngineProcess, *, model_name: str,
                 max_body_bytes: int,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, max_stop: int | None = None,
                 chat_template: str | None = DEFAULT_CHAT_TEMPLATE, loop_share: float = DEFAULT_SHARE,
                 max_model_len_source: str | None = None, max_request_tokens: int | None = None,
                 max_n: int = DEFAULT_MAX_N):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if not body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
        self.max_request_tokens = WORK_FACTOR * engine.max_model_len if max_request_tokens is None \
            else max_request_tokens
        if self.max_request_tokens < 1:
            raise ValueError(f"max_request_tokens must be >= 1, got {max_request_tokens}")
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        self.max_n = max_n
        self.engine, self.sched, self.model_name = engine, scheduler, model_name
        self.max_model_len_source = max_model_len_source or "the engine's (lcx.engine.EngineConfig.max_model_len)"
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.stats = HttpStats()
        self.pool = concurrent.futures.ThreadPoolExecutor(CPU_WORKERS, thread_name_prefix="lcx-cpu")
        self.tok = engine.tokenizer
        # the tokenizer's own template, else (unless chat_template is None) lcx's documented default
        self.chat_template, self.chat_template_source = resolve_chat_template(self.tok, chat_template)
        self.prompt_char_limit = PROMPT_CHARS_MARGIN * max_token_chars(self.tok) * engine.max_model_len
        self.limits = Limits.for_engine(engine.max_model_len, **({} if max_stop is None else {"max_stop": max_stop}),
                                        max_prompt_chars=self.prompt_char_limit)
        self.pacer = LoopPacer(engine.has_work, share=loop_share)
        self._tidy_task: asyncio.Task | None = None
        self.tidied = 0  # times `_tidy_after_bursts` collected and trimmed (for /stats)
        # prompts that passed validation (for /stats): what the server received, e.g. to check
        # that a client (lm-eval's local-completions) did not cut them
        self.prompt_stats = {"prompts": 0, "tokens": 0, "longest": 0}

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
                 self.engine.config.max_batch, self.prompt_char_limit, self.max_body_bytes)

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

    # ------------------------------------------------------------------ bodies
    async def cpu(self, fn: Callable[..., Any], *args: Any, inline: bool = False) -> Any:
        """`fn(*args)` on the CPU thread pool (tokenization, parsing, rendering: off the event loop);
        `inline=True`: here, for the small work of a small request (`small_request`,
        `small_result`), where the two thread hops cost more than the work: under a flood each
        hop waits for the GIL (a steady 8-token request's p50 65 -> 54 ms under the slow tier's
        storm)."""
        if inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    async def read_body(self, request: Request) -> bytes:
        """The body, scanned as it arrives (`lcx.serve.body.Scanner`). Refused without reading the
        rest: another Content-Type than JSON (415), more than `max_body_bytes` (413, declared or
        counted), a scan limit crossed (413), not all of it within `body_timeout_s` of the first
        read (408). The gate closes the connection of a body left unread after the answer
        (`lcx.serve.gate.linger_close`): reading a hostile body to its end would cost the server
        more than the client."""
        ctype = request.headers.get("content-type")
        if ctype is not None:
            mime = ctype.split(";", 1)[0].strip().lower()
            if mime != "application/json" and not (mime.startswith("application/") and mime.endswith("+json")):
                raise APIError(415, f"Content-Type must be application/json, got {ctype!r}",
                               code="unsupported_media_type")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(int(declared), "")
        scanner = Scanner(self.limits)
        chunks = None
        try:
            # one task for the whole body (a timeout per chunk would make a task per chunk)
            chunks = await asyncio.wait_for(self._receive_body(request, scanner), self.body_timeout_s)
        except asyncio.TimeoutError:
            pass  # raised below, outside this block: no chain of the cancelled task's frames
        except APIError as e:
            # Without its traceback: the frames would hold the request, the scanner and the chunks
            # in a reference cycle (the error is kept in the request's scope) that only a full
            # garbage collection frees. Under a flood of refused and timed-out bodies those
            # collections came seconds apart and took 0.1-0.6 s each, stalling every client.
            raise e.with_traceback(None) from None
        if chunks is None:
            raise APIError(408, f"the request body was not received within {self.body_timeout_s:g} s "
                           f"({scanner.size} bytes came; lcx serve --body-timeout-s)", code="request_timeout")
        body = b"".join(chunks)
        chunks.clear()
        return body

    def _too_large(self, size: int, more: str) -> APIError:
        return APIError(413, f"the request body has {size}{more} bytes; this server accepts at most "
                        f"{self.max_body_bytes} (lcx serve --max-body-mb)", code="request_too_large")

    async def _receive_body(self, request: Request, scanner: Scanner) -> list[bytes]:
        """The body's chunks, each scanned as it comes; APIError (413) at the first one over a limit."""
        chunks = []
        try:
            async for chunk in request.stream():
                if scanner.size + len(chunk) > self.max_body_bytes:
                    raise self._too_large(scanner.size + len(chunk), "+")
                scanner.feed(chunk)
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
        return chunks

    async def parse(self, model: type[BaseModel], request: Request) -> Any:
        """The request's body as `model`: read and scanned here (`read_body`), parsed and validated
        on the CPU pool with bounded work (`lcx.serve.body`)."""
        body = await self.read_body(request)
        big = len(body) >= TRIM_BYTES
        request.state.lcx_body_bytes = len(body)
        try:
            return await self.cpu(functools.partial(parse_body, scanned=True), model, body, self.limits,
                                  inline=len(body) < INLINE_BYTES)
        except APIError as e:
            # Its traceback holds the parse frames, and so the body; the error ends up in the
            # request's scope, which the handler frames also hold: a cycle that would keep the
            # body until the next garbage collection. Cut it here.
            raise e.with_traceback(None) from None
        finally:
            del body
            if big:
                await self.cpu(release_memory)

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

    # ------------------------------------------------------------------ validation
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_chars(self, text: str, param: str, what: str) -> None:
        """Refuse, before tokenizing, a text too long for max_model_len tokens (`PROMPT_CHARS_MARGIN`)."""
        if len(text) > self.prompt_char_limit:
            raise bad_request(f"{what} has {len(text)} characters, more than {self.engine.max_model_len} tokens "
                              f"(max_model_len) of this tokenizer can hold (at most {self.prompt_char_limit}); "
                              f"shorten it (lcx never truncates){LENGTH_HINT}", param, "context_length_exceeded")

    def sampling(self, req: Any, prompt_ids: list[int], max_tokens: int, *, logprobs: int | None,
                 prompt_logprobs: int | None, choice: int, rename: dict[str, str] | None = None,
                 allow_empty: bool = False) -> SamplingParams:
        """The request's SamplingParams for one choice, validated against the engine. `rename` maps
        engine names to the request's (chat: prompt -> messages); `allow_empty`: max_tokens 0 is
        fine (echo scoring)."""
        rename = rename or {}
        seed = None if req.seed is None else req.seed + choice
        try:
            params = SamplingParams(max_tokens=max_tokens, seed=seed, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs, **req.sampling_kwargs())
            self.engine.validate(prompt_ids, params)
        except ContextLengthError as e:
            raise bad_request(f"{e}{LENGTH_HINT}", rename.get(e.param, e.param), "context_length_exceeded") from None
        except ValueError as e:  # SamplingParams name the field first; the engine's errors are the prompt's
            first = str(e).split(" ", 1)[0]
            param = first if first in SAMPLING_FIELDS else "prompt"
            raise bad_request(str(e), rename.get(param, param)) from None
        if max_tokens == 0 and not allow_empty:
            raise bad_request(f"the prompt ({len(prompt_ids)} tokens) fills max_model_len "
                              f"{self.engine.max_model_len}: no room to generate{LENGTH_HINT}",
                              rename.get("prompt", "prompt"),
                              "context_length_exceeded")
        return params

    def count_prompt(self, ids: Sequence[int]) -> None:
        """Count a validated prompt in /stats' `prompts` (its tokens, the longest so far)."""
        st = self.prompt_stats
        st["prompts"] += 1
        st["tokens"] += len(ids)
        if len(ids) > st["longest"]:
            st["longest"] = len(ids)

    def check_work(self, jobs: Sequence[Job], n: int) -> None:
        """The per-request work bound: prompt + max_tokens summed over every choice at most
        `max_request_tokens` (`lcx serve --max-request-tokens`); 400 naming the flag."""
        work = sum(len(j.prompt_ids) + j.params.max_tokens for j in jobs)
        if work > self.max_request_tokens:
            prompts = len({j.prompt_index for j in jobs})
            gen = any(j.params.max_tokens for j in jobs)
            raise bad_request(
                f"this request asks for {work} tokens of work ({prompts} prompt(s) x n={n}: prompt + max_tokens "
                f"summed over its {len(jobs)} choice(s)); this server runs at most {self.max_request_tokens} per "
                "request (lcx serve --max-request-tokens), so that one request cannot hold the engine while others "
                "wait: lower " + ("max_tokens or n, or " if gen else "") + "send the prompts in several requests",
                "max_tokens" if gen else "prompt", "work_limit_exceeded")

    def check_n_and_seed(self, req: Any, n_prompts: int) -> None:
        n = req.n
        if n < 1:
            raise bad_request(f"n must be >= 1, got {n}", "n")
        if n > self.max_n:
            raise bad_request(f"n={n} is more than this server's limit of {self.max_n} choices per prompt "
                              "(lcx serve --max-n)", "n", "work_limit_exceeded")
        if n * n_prompts > MAX_PROMPTS:
            raise bad_request(f"{n_prompts} prompt(s) x n={n} exceeds the limit of {MAX_PROMPTS} choices "
                              "per request", "n")
        if req.seed is not None and not (INT64_MIN <= req.seed and req.seed + n - 1 <= INT64_MAX):
            extra = f"; with n={n} the choices use seed .. seed + {n - 1}, which must fit too" if n > 1 else ""
            raise bad_request(f"seed must be an integer in [-2**63, 2**63 - 1] (64-bit signed){extra}, "
                              f"got {req.seed}", "seed")

    def render_chat(self, messages: list[Any], add_generation_prompt: bool,
                    kwargs: dict[str, Any] | None) -> list[int]:
        """The chat prompt's token ids (runs on the CPU pool)."""
        tok = self.tok
        if self.chat_template is None:
            raise bad_request(f"the model {self.model_name!r} has no chat template in its tokenizer (and the server "
                              "was started with --chat-template none); use /v1/completions", "messages",
                              "no_chat_template")
        try:
            text = tok.apply_chat_template([m.as_template_dict() for m in messages], tokenize=False,
                                           chat_template=self.chat_template,
                                           add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad kwargs) are the client's
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
        if not isinstance(text, str):
            raise bad_request("the chat template did not render to text", "messages")
        self.check_chars(text, "messages", "the rendered chat prompt")
        ids = self.engine.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("the rendered chat prompt is empty", "messages")
        return ids

    # ------------------------------------------------------------------ running jobs
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
        """503 with Retry-After before anything is queued while the engine is not running (its
        process died and is being restarted, or the server gave up on it)."""
        if not self.sched.alive:
            why = self.engine_problem() or "the engine is not running"
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

    # ------------------------------------------------------------------ logprobs
    def _top_dict(self, lp: TokenLogprob) -> dict[str, float]:
        d = {self.engine.token_str(t): finite(v) for t, v in lp.top}
        d.setdefault(self.engine.token_str(lp.token_id), finite(lp.logprob))  # the chosen token, as vLLM
        return d

    def completion_logprobs(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                            offset: int) -> tuple[CompletionLogprobs, int]:
        """OpenAI's completion logprobs of `token_ids`, the first at character `offset` of the
        choice's whole text; also returns the offset after the last token."""
        eng = self.engine
        offsets = []
        for t in token_ids:  # character offsets into the returned text (partial UTF-8 counts 0)
            offsets.append(offset)
            offset += len(eng.token_bytes(t).decode("utf-8", errors="ignore"))
        return CompletionLogprobs(
            tokens=[eng.token_str(t) for t in token_ids],
            token_logprobs=[None if e is None else finite(e.logprob) for e in entries],
            top_logprobs=[None if e is None else self._top_dict(e) for e in entries],
            text_offset=offsets), offset

    def chat_logprobs(self, entries: Sequence[TokenLogprob], k: int) -> ChatLogprobs:
        eng = self.engine

        def one(t: int, v: float) -> dict[str, Any]:
            return {"token": eng.token_str(t), "logprob": finite(v), "bytes": list(eng.token_bytes(t))}

        return ChatLogprobs(content=[
            ChatTokenLogprob(**one(e.token_id, e.logprob), top_logprobs=[ChatTopLogprob(**one(t, v)) for t, v in e.top[:k]])
            for e in entries])


def _collect_and_trim() -> None:
    gc.collect()
    release_memory()


async def ctx(request: Request) -> ServerContext:
    """The routes' dependency: the app's `ServerContext`. `async`: FastAPI runs a plain `def`
    dependency in its thread pool, a thread hop (and GIL hand-overs with the engine thread) per
    request for an attribute read; under a storm of refused bodies that hop was ~40% of the
    event loop's time."""
    return request.app.state.ctx
