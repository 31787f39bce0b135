"""The OpenAI-compatible HTTP API over `lcx.engine` (FastAPI).

    app = create_app(engine, model_name="tiny-5m", api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)           # what `lcx serve` does

Endpoints:
    POST /v1/completions        prompt: str | [str] | [int] | [[int]]; echo + logprobs give prompt
                                logprobs (lm-eval `local-completions` loglikelihood); max_tokens=0
                                only with echo (scores the prompt); stream=true for SSE
    POST /v1/chat/completions   messages rendered with the tokenizer's chat template; stream=true
    GET  /v1/models             the one served model (+ max_model_len)
    GET  /health                200 while the engine worker is alive
    GET  /stats                 scheduler and engine counters (batch-size histogram, ...) and the
                                HTTP counters: requests, errors by status and by code, disconnects
    GET  /tokenizer_info        POST /tokenize  POST /detokenize   (vLLM's shapes; lm-eval's
                                `tokenizer_backend=remote` uses them)

The API key (`api_key`): every route but /health needs `Authorization: Bearer KEY` (vLLM checks
it only under its API prefixes such as /v1; lcx guards the tokenizer routes and /stats too).
lm-eval sends the key to the completions routes from $OPENAI_API_KEY and to the tokenizer routes
(`tokenizer_backend=remote`, also what `auto` probes) from `auth_token=KEY` in `--model_args`:
give both.

Never a 5xx for the client's input. A request is read with a size limit (`max_body_bytes`, 413)
and must be JSON (415 for another Content-Type; none is taken as JSON); its fields are
range-checked (400 naming the field, `param`) before anything is queued. Parsing, tokenization
and response rendering run in a small thread pool, off the event loop, so one huge request does
not stall /health or other clients; a string prompt longer than `max_model_len` tokens could
possibly cover (`prompt_char_limit`) is refused before it is tokenized. A client that goes away
has its requests aborted at once (streaming or not): the engine frees their batch slots.

Every request goes through the `Scheduler` (one worker thread, continuous batching). A request the
engine fails gets a 500 error object (or, mid-stream, an `error` event before `[DONE]`) and other
requests go on. Every error response (and every disconnect) is counted in /stats and logged with
the request's id, which each response carries in `X-Request-Id` (a client's own, if it sends a
short one, else a fresh one).
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from lcx.engine import INT64_MAX, INT64_MIN, ContextLengthError, Engine, SamplingParams, StepEvent, TokenLogprob

from .protocol import (
    MAX_PROMPTS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    validation_error,
)
from .cli import DEFAULT_MAX_BODY_BYTES
from .scheduler import Scheduler

log = logging.getLogger("lcx.serve")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A body over the limit is still read (and dropped) up to here, so the client gets the 413 instead
# of a reset connection; a bigger one is not read and its connection closes after the 413.
DRAIN_LIMIT_BYTES = 64 << 20
# A prompt of more than `margin x longest token (characters) x max_model_len` characters cannot fit
# max_model_len tokens: every token covers at most the longest token's characters. That is exact
# for tokenizers whose normaliser never shortens text (byte-level BPE, Llama's SentencePiece);
# the margin leaves room for ones that do (Unicode composition). Only the bound is approximate:
# a prompt under it is tokenized and checked exactly.
PROMPT_CHARS_MARGIN = 2
CPU_WORKERS = 2  # parsing / tokenization / rendering threads
OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
TOKENIZER_PATHS = frozenset({"/tokenizer_info", "/tokenize", "/detokenize"})
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
LOGPROB_FLOOR = -9999.0  # what a -inf logprob is sent as (JSON has no -inf; vLLM does the same)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_EXCEPTION_GROUP = getattr(builtins, "BaseExceptionGroup", ())  # Python >= 3.11


class ClientGone(Exception):
    """The client closed the connection before its response was complete."""


class HttpStats:
    """HTTP counters for /stats. Touched only on the event loop thread."""

    def __init__(self) -> None:
        self.requests = 0
        self.client_disconnects = 0
        self.by_status: dict[int, int] = {}
        self.by_code: dict[str, int] = {}

    def error(self, status: int, code: str | None) -> None:
        self.by_status[status] = self.by_status.get(status, 0) + 1
        key = code or f"http_{status}"
        self.by_code[key] = self.by_code.get(key, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "client_disconnects": self.client_disconnects,
                "errors": sum(self.by_status.values()),
                "errors_by_status": {str(k): v for k, v in sorted(self.by_status.items())},
                "errors_by_code": dict(sorted(self.by_code.items()))}


def request_id(request: Request) -> str:
    return request.scope.get("lcx.request_id", "-")


def _note_error(scope: dict[str, Any], err: APIError) -> None:
    """Tell the gate which error a response carries (it counts and logs it)."""
    scope["lcx.error"] = err


def _client_gone(e: BaseException) -> bool:
    if isinstance(e, _EXCEPTION_GROUP):  # anyio task groups may wrap it
        return all(_client_gone(x) for x in e.exceptions)
    return isinstance(e, ClientGone)


class _Gate:
    """Pure ASGI middleware around the app: request ids, the API key, counting and logging every
    error response and every client that left before its response was complete (`ClientGone`
    from a handler, or a stream cut off), and a 500 error object for an unexpected exception.
    (Not `@app.middleware`: Starlette's BaseHTTPMiddleware would stand between the handlers and
    the client's disconnect.)"""

    def __init__(self, app: Any, *, api_key: str | None, stats: HttpStats):
        self.app, self.stats = app, stats
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]
        scope["lcx.request_id"] = rid
        self.stats.requests += 1
        status: int | None = None
        complete = gone = failed = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message, headers=[*message.get("headers", []), (b"x-request-id", rid.encode())])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        async def send_error(err: APIError) -> None:
            _note_error(scope, err)
            await JSONResponse(err.body(), status_code=err.status)(scope, receive, send_with_id)

        path = scope.get("path", "")
        try:
            if self.expected is not None and path not in OPEN_PATHS:
                got = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not secrets.compare_digest(got, self.expected):
                    msg = "missing API key: send 'Authorization: Bearer <key>'" if not got else "invalid API key"
                    if path in TOKENIZER_PATHS:
                        msg += " (lm-eval's tokenizer_backend=remote sends it from auth_token=<key> in --model_args)"
                    await send_error(APIError(401, msg, code="invalid_api_key"))
                    return
            await self.app(scope, receive, send_with_id)
        except Exception as e:  # noqa: BLE001 - a bug: the client gets a 500 object, the log the traceback
            if _client_gone(e):
                gone = True
                return
            failed = True
            log.exception("request %s: %s %s failed", rid, scope.get("method"), path)
            if status is not None:
                raise  # mid-response: nothing to send; the server closes the connection
            await send_error(APIError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error",
                                      code="internal_error"))
        finally:
            if failed:
                self.stats.error(500, "internal_error")
            elif gone or (status is not None and not complete):
                # a handler saw the disconnect, or Starlette cut the stream when it did
                self.stats.client_disconnects += 1
                log.info("request %s: %s %s: the client left before its response was complete; its requests "
                         "were aborted", rid, scope.get("method"), path)
            elif status is not None and status >= 400:
                err = scope.get("lcx.error")
                code = err.code if isinstance(err, APIError) else None
                self.stats.error(status, code)
                msg = err.message if isinstance(err, APIError) else ""
                level = logging.ERROR if 500 <= status < 600 else logging.INFO
                log.log(level, "request %s: %s %s -> %d %s: %s", rid, scope.get("method"), path, status,
                        code or "", msg[:300])


def max_token_chars(tok: Any) -> int:
    """The most characters one token of `tok` stands for (its raw string or its decoded text,
    special tokens included): the bound behind `PROMPT_CHARS_MARGIN`."""
    ids = list(range(len(tok)))
    raw = tok.convert_ids_to_tokens(ids)
    decoded = tok.batch_decode([[i] for i in ids], skip_special_tokens=False)
    return max(1, max((len(t) for t in raw if t), default=1), max((len(t) for t in decoded), default=1))


def _finite(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN (never expected) to the floor


@dataclass
class _Job:
    """One choice: a prompt run once with its sampling params."""

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


def create_app(engine: Engine, *, model_name: str, api_key: str | None = None,
               batch_window_s: float = 0.01, scheduler: Scheduler | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name`. The scheduler's worker thread and the CPU
    thread pool start with the app (lifespan) and stop with it. `max_body_bytes`: the largest
    request body accepted (413 above)."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    sched = scheduler or Scheduler(engine, batch_window_s=batch_window_s)
    pool = concurrent.futures.ThreadPoolExecutor(CPU_WORKERS, thread_name_prefix="lcx-cpu")
    stats = HttpStats()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not sched.alive:
            sched.start()
        log.info("serving %s (max_model_len %d, max_batch %d, prompts of at most %d characters are tokenized, "
                 "bodies of at most %d bytes)", model_name, engine.max_model_len, engine.config.max_batch,
                 prompt_char_limit, max_body_bytes)
        yield
        sched.stop()
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="lcx", lifespan=lifespan)
    app.state.scheduler, app.state.engine, app.state.model_name = sched, engine, model_name
    app.state.http_stats = stats
    app.add_middleware(_Gate, api_key=api_key, stats=stats)
    tok = engine.tokenizer
    token_chars = max_token_chars(tok)
    prompt_char_limit = PROMPT_CHARS_MARGIN * token_chars * engine.max_model_len
    app.state.prompt_char_limit = prompt_char_limit

    # ---------------------------------------------------------------- errors
    def error_response(request: Request, err: APIError) -> JSONResponse:
        _note_error(request.scope, err)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(request, APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                                code=code))

    # ---------------------------------------------------------------- helpers
    async def cpu(fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the CPU thread pool (tokenization, parsing, rendering: off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    async def read_body(request: Request) -> bytes:
        """The body, at most `max_body_bytes` (413 above, after reading the rest up to
        DRAIN_LIMIT_BYTES so the client sees the answer); JSON only (415)."""
        declared = request.headers.get("content-length", "")
        size, chunks = 0, []
        if declared.isdigit() and int(declared) > DRAIN_LIMIT_BYTES:
            size = int(declared)
        else:
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size <= max_body_bytes:
                        chunks.append(chunk)
                    elif size > DRAIN_LIMIT_BYTES:
                        break
            except ClientDisconnect:
                raise ClientGone() from None
        if size > max_body_bytes:
            raise APIError(413, f"the request body has {size}{'+' if size > DRAIN_LIMIT_BYTES else ''} bytes; this "
                           f"server accepts at most {max_body_bytes} (lcx serve --max-body-mb)",
                           code="request_too_large")
        ctype = request.headers.get("content-type")
        if ctype is not None:
            mime = ctype.split(";", 1)[0].strip().lower()
            if mime != "application/json" and not (mime.startswith("application/") and mime.endswith("+json")):
                raise APIError(415, f"Content-Type must be application/json, got {ctype!r}",
                               code="unsupported_media_type")
        return b"".join(chunks)

    def from_json(model: type, body: bytes):
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e) from None

    async def parse(model: type, request: Request):
        body = await read_body(request)
        if not body.strip():
            raise bad_request("the request body is empty; send a JSON object", None, "invalid_json")
        return await cpu(from_json, model, body)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def check_chars(text: str, param: str, what: str) -> None:
        """Refuse, before tokenizing, a text too long for max_model_len tokens (`PROMPT_CHARS_MARGIN`)."""
        if len(text) > prompt_char_limit:
            raise bad_request(f"{what} has {len(text)} characters, more than {engine.max_model_len} tokens "
                              f"(max_model_len) of this tokenizer can hold (at most {prompt_char_limit}); "
                              "shorten it (lcx never truncates)", param, "context_length_exceeded")

    def sampling(req: Any, prompt_ids: list[int], max_tokens: int, *, logprobs: int | None,
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
            engine.validate(prompt_ids, params)
        except ContextLengthError as e:
            raise bad_request(str(e), rename.get(e.param, e.param), "context_length_exceeded") from None
        except ValueError as e:  # SamplingParams name the field first; the engine's errors are the prompt's
            first = str(e).split(" ", 1)[0]
            param = first if first in SAMPLING_FIELDS else "prompt"
            raise bad_request(str(e), rename.get(param, param)) from None
        if max_tokens == 0 and not allow_empty:
            raise bad_request(f"the prompt ({len(prompt_ids)} tokens) fills max_model_len {engine.max_model_len}: "
                              "no room to generate", rename.get("prompt", "prompt"), "context_length_exceeded")
        return params

    def check_n_and_seed(req: Any, n_prompts: int) -> None:
        n = req.n
        if n < 1:
            raise bad_request(f"n must be >= 1, got {n}", "n")
        if n * n_prompts > MAX_PROMPTS:
            raise bad_request(f"{n_prompts} prompt(s) x n={n} exceeds the limit of {MAX_PROMPTS} choices "
                              "per request", "n")
        if req.seed is not None and not (INT64_MIN <= req.seed and req.seed + n - 1 <= INT64_MAX):
            extra = f"; with n={n} the choices use seed .. seed + {n - 1}, which must fit too" if n > 1 else ""
            raise bad_request(f"seed must be an integer in [-2**63, 2**63 - 1] (64-bit signed){extra}, "
                              f"got {req.seed}", "seed")

    async def events(jobs: Sequence[_Job], request: Request) -> AsyncIterator[tuple[_Job, StepEvent]]:
        """Submit every job to the scheduler and yield `(job, event)` as they come. Raises
        `ClientGone` as soon as the client disconnects; jobs still open when the consumer stops
        (error, client gone, cancelled) are aborted, which frees their batch slots."""
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

    async def run_all(jobs: Sequence[_Job], request: Request) -> None:
        async with contextlib.aclosing(events(jobs, request)) as stream:
            async for job, ev in stream:
                if ev.finish_reason == "error":
                    raise engine_error(ev)
                job.add(ev)

    def engine_error(ev: StepEvent) -> APIError:
        e = ev.error
        return APIError(500, f"the engine failed on this request: {type(e).__name__}: {e}", type="server_error",
                        code="engine_error")

    def usage(jobs: Sequence[_Job]) -> dict[str, int]:
        prompt = sum(len(j.prompt_ids) for j in {j.prompt_index: j for j in jobs}.values())
        gen = sum(len(j.token_ids) for j in jobs)
        return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen}

    def top_dict(lp: TokenLogprob) -> dict[str, float]:
        d = {engine.token_str(t): _finite(v) for t, v in lp.top}
        d.setdefault(engine.token_str(lp.token_id), _finite(lp.logprob))  # the chosen token, as vLLM
        return d

    def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                            offset: int) -> tuple[dict[str, Any], int]:
        """OpenAI's completion logprobs of `token_ids`, the first at character `offset` of the
        choice's whole text; also returns the offset after the last token."""
        tokens = [engine.token_str(t) for t in token_ids]
        offsets = []
        for t in token_ids:  # character offsets into the returned text (partial UTF-8 counts 0)
            offsets.append(offset)
            offset += len(engine.token_bytes(t).decode("utf-8", errors="ignore"))
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else _finite(e.logprob) for e in entries],
                "top_logprobs": [None if e is None else top_dict(e) for e in entries],
                "text_offset": offsets}, offset

    def chat_logprobs(entries: Sequence[TokenLogprob], k: int) -> dict[str, Any]:
        def one(t: int, v: float) -> dict[str, Any]:
            return {"token": engine.token_str(t), "logprob": _finite(v), "bytes": list(engine.token_bytes(t))}
        return {"content": [dict(one(e.token_id, e.logprob), top_logprobs=[one(t, v) for t, v in e.top[:k]])
                            for e in entries]}

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def render_json(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

    async def json_response(obj: Any) -> Response:
        return Response(await cpu(render_json, obj), media_type="application/json")

    def want_usage(req: Any) -> bool:
        return req.stream_options is not None and req.stream_options.include_usage

    def sse_response(request: Request, jobs: Sequence[_Job],
                     on_event: Callable[[_Job, StepEvent], Iterable[dict[str, Any]]], *,
                     first: Iterable[dict[str, Any]] = (), usage_head: dict[str, Any] | None = None):
        """The event stream of both endpoints: the `first` chunks, then for every engine event
        (after `job.add`) the chunks `on_event` makes; an engine failure ends the stream with an
        error object and [DONE] (jobs still open are aborted by `events`); then a usage chunk
        when `usage_head` is given, and [DONE]. A client that leaves ends it at once."""
        rid = request_id(request)

        async def body() -> AsyncIterator[str]:
            for c in first:
                yield sse(c)
            async with contextlib.aclosing(events(jobs, request)) as evs:  # ClientGone propagates to _Gate
                async for j, ev in evs:
                    if ev.finish_reason == "error":
                        err = engine_error(ev)
                        stats.error(err.status, err.code)
                        log.error("request %s: stream ended by an engine error: %s", rid, err.message)
                        yield sse(err.body())
                        yield "data: [DONE]\n\n"
                        return
                    j.add(ev)
                    for c in on_event(j, ev):
                        yield sse(c)
            if usage_head is not None:
                yield sse(dict(usage_head, choices=[], usage=usage(jobs)))
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ---------------------------------------------------------------- /v1/completions
    def completion_jobs(req: CompletionRequest) -> list[_Job]:
        """Validate, tokenize and make one job per (prompt, choice). Runs on the CPU pool."""
        req.check_unsupported()
        check_model(req.model)
        prompts = req.prompts()
        check_n_and_seed(req, len(prompts))
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens=0 generates nothing: it is allowed only with echo=true (to score the "
                              "prompt)", "max_tokens")
        jobs: list[_Job] = []
        for pi, p in enumerate(prompts):
            if isinstance(p, str):
                check_chars(p, "prompt", f"prompt {pi}" if len(prompts) > 1 else "the prompt")
                ids, text = engine.encode(p), p
                if not ids:
                    raise bad_request(f"prompt {pi} tokenizes to no tokens", "prompt")
            else:
                ids, text = list(p), None
            remaining = engine.max_model_len - len(ids)
            max_tokens = req.max_tokens if req.max_tokens is not None else \
                max(0, min(DEFAULT_COMPLETION_MAX_TOKENS, remaining))
            plp = req.logprobs if req.echo and req.logprobs is not None else None
            for c in range(req.n):
                params = sampling(req, ids, max_tokens, logprobs=req.logprobs, prompt_logprobs=plp, choice=c,
                                  allow_empty=req.echo)
                if text is None:
                    text = tok.decode(ids, skip_special_tokens=False)
                jobs.append(_Job(len(jobs), pi, ids, text, params))
        return jobs

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse(CompletionRequest, request)
        jobs = await cpu(completion_jobs, req)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": model_name}

        def echo_part(j: _Job) -> tuple[str, dict[str, Any] | None]:
            if not req.echo:
                return "", None
            lp = None
            if req.logprobs is not None:
                lp, _ = completion_logprobs(j.prompt_ids, j.prompt_logprobs or [None] * len(j.prompt_ids), 0)
            return j.prompt_text, lp

        if not req.stream:
            await run_all(jobs, request)

            def choices() -> dict[str, Any]:
                out = []
                for j in jobs:
                    etext, elp = echo_part(j)
                    lp = None
                    if req.logprobs is not None:
                        gen, _ = completion_logprobs(j.token_ids, j.logprobs, len(etext))
                        lp = gen if elp is None else {k: elp[k] + gen[k] for k in gen}
                    out.append({"index": j.index, "text": etext + "".join(j.text), "logprobs": lp,
                                "finish_reason": j.finish_reason})
                return dict(head, choices=out, usage=usage(jobs))

            return await json_response(await cpu(choices))

        def on_event(j: _Job, ev: StepEvent) -> Iterator[dict[str, Any]]:
            if not j.started:
                j.started = True
                etext, elp = echo_part(j)
                j.text_offset = len(etext)  # generated tokens' offsets continue after the echoed prompt
                if etext:
                    yield dict(head, choices=[{"index": j.index, "text": etext, "logprobs": elp,
                                               "finish_reason": None}])
            if ev.text or ev.token_ids or ev.finished:
                lp = None
                if req.logprobs is not None:
                    # offsets into the choice's whole text, continuing from the previous chunks (vLLM)
                    lp, j.text_offset = completion_logprobs(ev.token_ids, ev.logprobs, j.text_offset)
                yield dict(head, choices=[{"index": j.index, "text": ev.text, "logprobs": lp,
                                           "finish_reason": ev.finish_reason if ev.finished else None}])

        return sse_response(request, jobs, on_event, usage_head=head if want_usage(req) else None)

    # ---------------------------------------------------------------- /v1/chat/completions
    def render_chat(messages: list[Any], add_generation_prompt: bool, kwargs: dict[str, Any] | None) -> list[int]:
        """The chat prompt's token ids (runs on the CPU pool)."""
        if not getattr(tok, "chat_template", None):
            raise bad_request(f"the model {model_name!r} has no chat template in its tokenizer; use "
                              "/v1/completions", "messages", "no_chat_template")
        try:
            text = tok.apply_chat_template([m.as_template_dict() for m in messages], tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad kwargs) are the client's
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
        if not isinstance(text, str):
            raise bad_request("the chat template did not render to text", "messages")
        check_chars(text, "messages", "the rendered chat prompt")
        ids = engine.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("the rendered chat prompt is empty", "messages")
        return ids

    def chat_jobs(req: ChatCompletionRequest) -> tuple[list[_Job], int]:
        """Validate, render, tokenize; one job per choice, and the top_logprobs k. On the CPU pool."""
        req.check_unsupported()
        check_model(req.model)
        check_n_and_seed(req, 1)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if asked is not None and asked < 1:
            raise bad_request(f"{param} must be >= 1, got {asked}", param)
        ids = render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        max_tokens = asked if asked is not None else max(0, engine.max_model_len - len(ids))
        k = req.top_logprobs or 0
        rename = {"prompt": "messages", "max_tokens": param}
        jobs = [_Job(c, 0, ids, "", sampling(req, ids, max_tokens, logprobs=k if req.logprobs else None,
                                             prompt_logprobs=None, choice=c, rename=rename))
                for c in range(req.n)]
        return jobs, k

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req: ChatCompletionRequest = await parse(ChatCompletionRequest, request)
        jobs, k = await cpu(chat_jobs, req)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "created": created, "model": model_name}

        if not req.stream:
            await run_all(jobs, request)

            def choices() -> dict[str, Any]:
                out = [{"index": j.index, "message": {"role": "assistant", "content": "".join(j.text)},
                        "logprobs": chat_logprobs(j.logprobs, k) if req.logprobs else None,
                        "finish_reason": j.finish_reason} for j in jobs]
                return dict(head, object="chat.completion", choices=out, usage=usage(jobs))

            return await json_response(await cpu(choices))

        chunk = dict(head, object="chat.completion.chunk")

        def on_event(j: _Job, ev: StepEvent) -> Iterator[dict[str, Any]]:
            if ev.text or ev.token_ids or ev.finished:
                delta = {"content": ev.text} if ev.text else {}
                yield dict(chunk, choices=[{
                    "index": j.index, "delta": delta,
                    "logprobs": chat_logprobs(ev.logprobs, k) if req.logprobs else None,
                    "finish_reason": ev.finish_reason if ev.finished else None}])

        first = [dict(chunk, choices=[{"index": j.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]) for j in jobs]
        return sse_response(request, jobs, on_event, first=first, usage_head=chunk if want_usage(req) else None)

    # ---------------------------------------------------------------- the rest
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "lcx",
            "max_model_len": engine.max_model_len,
            "lcx_methods": {k: _jsonable(v) for k, v in engine.resolved_methods.items()}}]}

    @app.get("/health")
    async def health():
        if not sched.alive:
            return JSONResponse({"status": "engine worker is not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/stats")
    async def stats_route():
        return dict(sched.snapshot(), http=stats.to_dict())

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": engine.max_model_len, "vocab_size": engine.vocab_size}

    def tokenize_ids(req: TokenizeRequest) -> list[int]:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            check_chars(req.prompt, "prompt", "the prompt")
            return engine.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return render_chat(req.messages, req.add_generation_prompt, None)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req: TokenizeRequest = await parse(TokenizeRequest, request)
        ids = await cpu(tokenize_ids, req)
        return await json_response({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

    def detokenize_text(req: DetokenizeRequest) -> str:
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise bad_request(f"tokens must be token ids in [0, {engine.vocab_size}); got {bad[:5]}", "tokens")
        return tok.decode(req.tokens, skip_special_tokens=False)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req: DetokenizeRequest = await parse(DetokenizeRequest, request)
        return await json_response({"prompt": await cpu(detokenize_text, req)})

    return app


def _jsonable(x: Any) -> Any:
    if hasattr(x, "to_dict"):
        return x.to_dict()
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)
