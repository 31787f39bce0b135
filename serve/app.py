"""The OpenAI-compatible HTTP API over `lcx.engine` (FastAPI).

    app = create_app(engine, model_name="tiny-5m", api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)           # what `lcx serve` does

Endpoints:
    POST /v1/completions        prompt: str | [str] | [int] | [[int]]; echo + logprobs give prompt
                                logprobs (lm-eval `local-completions` loglikelihood); max_tokens=0
                                with echo scores the prompt only; stream=true for SSE
    POST /v1/chat/completions   messages rendered with the tokenizer's chat template; stream=true
    GET  /v1/models             the one served model (+ max_model_len)
    GET  /health                200 while the engine worker is alive (no API key needed)
    GET  /stats                 scheduler and engine counters (batch-size histogram, ...)
    GET  /tokenizer_info        POST /tokenize  POST /detokenize   (vLLM's shapes; lm-eval's
                                `tokenizer_backend=remote` uses them)

Every request goes through the `Scheduler` (one worker thread, continuous batching). Bad input
gets a 4xx OpenAI error object and nothing is queued; a request the engine fails gets a 500
error object (or, mid-stream, an `error` event before `[DONE]`) and other requests go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lcx.engine import ContextLengthError, Engine, SamplingParams, StepEvent, TokenLogprob

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
from .scheduler import Scheduler

log = logging.getLogger("lcx.serve")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


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
               batch_window_s: float = 0.01, scheduler: Scheduler | None = None) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name`. The scheduler's worker thread starts with
    the app (lifespan) and stops with it."""
    sched = scheduler or Scheduler(engine, batch_window_s=batch_window_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not sched.alive:
            sched.start()
        log.info("serving %s (max_model_len %d, max_batch %d)", model_name, engine.max_model_len,
                 engine.config.max_batch)
        yield
        sched.stop()

    app = FastAPI(title="lcx", lifespan=lifespan)
    app.state.scheduler, app.state.engine, app.state.model_name = sched, engine, model_name
    tok = engine.tokenizer

    # ---------------------------------------------------------------- errors and auth
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error",
                       code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.url.path not in OPEN_PATHS:
                got = request.headers.get("authorization", "").encode()
                if not secrets.compare_digest(got, expected):
                    msg = ("missing API key: send 'Authorization: Bearer <key>'" if not got
                           else "invalid API key")
                    err = APIError(401, msg, param=None, code="invalid_api_key")
                    return JSONResponse(err.body(), status_code=401)
            return await call_next(request)

    # ---------------------------------------------------------------- helpers
    async def parse(model: type, request: Request):
        body = await request.body()
        if not body:
            raise bad_request("the request body is empty; send a JSON object", None, "invalid_json")
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e) from None

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def sampling(req: Any, prompt_ids: list[int], max_tokens: int, *, logprobs: int | None,
                 prompt_logprobs: int | None, choice: int) -> SamplingParams:
        seed = None if req.seed is None else req.seed + choice
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=seed,
                stop=tuple(req.stop_list()), stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
            engine.validate(prompt_ids, params)
        except ContextLengthError as e:
            raise bad_request(str(e), e.param, "context_length_exceeded") from None
        except ValueError as e:  # SamplingParams name the field first; the engine's errors are the prompt's
            first = str(e).split(" ", 1)[0]
            raise bad_request(str(e), first if first in SAMPLING_FIELDS else "prompt") from None
        return params

    def check_n(n: int, n_prompts: int) -> None:
        if n < 1:
            raise bad_request(f"n must be >= 1, got {n}", "n")
        if n * n_prompts > MAX_PROMPTS:
            raise bad_request(f"{n_prompts} prompt(s) x n={n} exceeds the limit of {MAX_PROMPTS} choices "
                              "per request", "n")

    async def events(jobs: Sequence[_Job]) -> AsyncIterator[tuple[_Job, StepEvent]]:
        """Submit every job to the scheduler and yield `(job, event)` as they come; jobs still
        open when the consumer stops (error, client gone) are aborted."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple[int, StepEvent]] = asyncio.Queue()
        rids: dict[int, str] = {}
        for j in jobs:
            def sink(ev: StepEvent, idx: int = j.index) -> None:
                loop.call_soon_threadsafe(q.put_nowait, (idx, ev))
            rids[j.index] = sched.submit(j.prompt_ids, j.params, sink)
        open_ = set(rids)
        by_index = {j.index: j for j in jobs}
        try:
            while open_:
                idx, ev = await q.get()
                if ev.finished:
                    open_.discard(idx)
                yield by_index[idx], ev
        finally:
            for idx in open_:
                sched.abort(rids[idx])

    async def run_all(jobs: Sequence[_Job]) -> None:
        async with contextlib.aclosing(events(jobs)) as stream:
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
        d = {engine.token_str(t): v for t, v in lp.top}
        d.setdefault(engine.token_str(lp.token_id), lp.logprob)  # the chosen token, as vLLM
        return d

    def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                            offset: int) -> dict[str, Any]:
        tokens = [engine.token_str(t) for t in token_ids]
        offsets = []
        for t in token_ids:  # character offsets into the returned text (partial UTF-8 counts 0)
            offsets.append(offset)
            offset += len(engine.token_bytes(t).decode("utf-8", errors="ignore"))
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else top_dict(e) for e in entries],
                "text_offset": offsets}

    def chat_logprobs(entries: Sequence[TokenLogprob], k: int) -> dict[str, Any]:
        def one(t: int, v: float) -> dict[str, Any]:
            return {"token": engine.token_str(t), "logprob": v, "bytes": list(engine.token_bytes(t))}
        return {"content": [dict(one(e.token_id, e.logprob), top_logprobs=[one(t, v) for t, v in e.top[:k]])
                            for e in entries]}

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def want_usage(req: Any) -> bool:
        return req.stream_options is not None and req.stream_options.include_usage

    def sse_response(jobs: Sequence[_Job], on_event: Callable[[_Job, StepEvent], Iterable[dict[str, Any]]], *,
                     first: Iterable[dict[str, Any]] = (), usage_head: dict[str, Any] | None = None):
        """The event stream of both endpoints: the `first` chunks, then for every engine event
        (after `job.add`) the chunks `on_event` makes; an engine failure ends the stream with an
        error object and [DONE] (jobs still open are aborted by `events`); then a usage chunk
        when `usage_head` is given, and [DONE]."""

        async def body() -> AsyncIterator[str]:
            for c in first:
                yield sse(c)
            async with contextlib.aclosing(events(jobs)) as evs:
                async for j, ev in evs:
                    if ev.finish_reason == "error":
                        yield sse(engine_error(ev).body())
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
    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse(CompletionRequest, request)
        req.check_unsupported()
        check_model(req.model)
        prompts = req.prompts()
        check_n(req.n, len(prompts))
        jobs: list[_Job] = []
        for pi, p in enumerate(prompts):
            if isinstance(p, str):
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
                params = sampling(req, ids, max_tokens, logprobs=req.logprobs, prompt_logprobs=plp, choice=c)
                if text is None:
                    text = tok.decode(ids, skip_special_tokens=False)
                jobs.append(_Job(len(jobs), pi, ids, text, params))
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": model_name}

        def echo_part(j: _Job) -> tuple[str, dict[str, Any] | None]:
            if not req.echo:
                return "", None
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(j.prompt_ids, j.prompt_logprobs or [None] * len(j.prompt_ids), 0)
            return j.prompt_text, lp

        if not req.stream:
            await run_all(jobs)
            choices = []
            for j in jobs:
                etext, elp = echo_part(j)
                text = etext + "".join(j.text)
                lp = None
                if req.logprobs is not None:
                    gen = completion_logprobs(j.token_ids, j.logprobs, len(etext))
                    lp = gen if elp is None else {k: elp[k] + gen[k] for k in gen}
                choices.append({"index": j.index, "text": text, "logprobs": lp, "finish_reason": j.finish_reason})
            return JSONResponse(dict(head, choices=choices, usage=usage(jobs)))

        def on_event(j: _Job, ev: StepEvent) -> Iterator[dict[str, Any]]:
            if not j.started:
                j.started = True
                etext, elp = echo_part(j)
                if etext:
                    yield dict(head, choices=[{"index": j.index, "text": etext, "logprobs": elp,
                                               "finish_reason": None}])
            if ev.text or ev.token_ids or ev.finished:
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(ev.token_ids, ev.logprobs, 0)
                yield dict(head, choices=[{"index": j.index, "text": ev.text, "logprobs": lp,
                                           "finish_reason": ev.finish_reason if ev.finished else None}])

        return sse_response(jobs, on_event, usage_head=head if want_usage(req) else None)

    # ---------------------------------------------------------------- /v1/chat/completions
    def render_chat(messages: list[Any], add_generation_prompt: bool, kwargs: dict[str, Any] | None) -> list[int]:
        if not getattr(tok, "chat_template", None):
            raise bad_request(f"the model {model_name!r} has no chat template in its tokenizer; use "
                              "/v1/completions", "messages", "no_chat_template")
        try:
            text = tok.apply_chat_template([m.as_template_dict() for m in messages], tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad kwargs) are the client's
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
        ids = engine.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("the rendered chat prompt is empty", "messages")
        return ids

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req: ChatCompletionRequest = await parse(ChatCompletionRequest, request)
        req.check_unsupported()
        check_model(req.model)
        check_n(req.n, 1)
        ids = render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if asked is not None and asked < 1:
            raise bad_request(f"{param} must be >= 1, got {asked}", param)
        max_tokens = asked if asked is not None else engine.max_model_len - len(ids)
        k = req.top_logprobs or 0
        jobs = [_Job(c, 0, ids, "", sampling(req, ids, max_tokens, logprobs=k if req.logprobs else None,
                                             prompt_logprobs=None, choice=c)) for c in range(req.n)]
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "created": created, "model": model_name}

        if not req.stream:
            await run_all(jobs)
            choices = [{"index": j.index, "message": {"role": "assistant", "content": "".join(j.text)},
                        "logprobs": chat_logprobs(j.logprobs, k) if req.logprobs else None,
                        "finish_reason": j.finish_reason} for j in jobs]
            return JSONResponse(dict(head, object="chat.completion", choices=choices, usage=usage(jobs)))

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
        return sse_response(jobs, on_event, first=first, usage_head=chunk if want_usage(req) else None)

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
    async def stats():
        return sched.snapshot()

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": engine.max_model_len, "vocab_size": engine.vocab_size}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req: TokenizeRequest = await parse(TokenizeRequest, request)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            ids = engine.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = render_chat(req.messages, req.add_generation_prompt, None)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req: DetokenizeRequest = await parse(DetokenizeRequest, request)
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise bad_request(f"token ids must be in [0, {engine.vocab_size}); got {bad[:5]}", "tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    return app


def _jsonable(x: Any) -> Any:
    if hasattr(x, "to_dict"):
        return x.to_dict()
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)
