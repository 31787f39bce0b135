"""The OpenAI-compatible HTTP API over `lcx.engine` (FastAPI).

    app = create_app(engine, model_name="tiny-5m", api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)           # what `lcx serve` does

Endpoints:
    POST /v1/completions        prompt: str | [str] | [int] | [[int]]; echo + logprobs give prompt
                                logprobs (lm-eval `local-completions` loglikelihood); max_tokens=0
                                only with echo (scores the prompt); stream=true for SSE
    POST /v1/chat/completions   messages rendered with the tokenizer's chat template (lcx's default,
                                `lcx.serve.chat_template`, when it has none); stream=true
    GET  /v1/models             the one served model (+ max_model_len); GET /v1/models/{id}: that one
    GET  /health                200 while the engine runs and responds (its process's heartbeat);
                                503 with the reason otherwise (HEAD too)
    GET  /openapi.json          every route's request body, response and error objects
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
and a time limit (`body_timeout_s`, 408) and must be JSON (415 for another Content-Type; none is
taken as JSON). Its cost is bounded before it is parsed (`lcx.serve.body`: a scan counts its
values, then structural limits: prompts, token ids against max_model_len, stop strings, messages;
413 or 400), then its fields are range-checked (400 naming the field, `param`) before anything is
queued. Parsing, tokenization and response rendering run in a small thread pool, off the event
loop, so one huge request does not stall /health or other clients; a string prompt longer than
`max_model_len` tokens could possibly cover (`prompt_char_limit`) is refused before it is
tokenized. A client that goes away
has its requests aborted at once (streaming or not): the engine frees their batch slots.

Layout: `protocol` (request and response models, errors), `gate` (the ASGI middleware: request
ids, the API key, counting and logging errors), `context` (`ServerContext`: the engine, scheduler,
CPU pool and counters every route shares, with its parts `body`, `sampling`, `render`, `jobs`: one
module per job of the request plumbing), `routes/` (one router per concern: completions, chat,
tokenizer, admin). This module only assembles them.

Every request goes through a scheduler (continuous batching): by default here the `Scheduler`, one
worker thread of this process; `lcx serve` passes an `EngineProcess` instead (`scheduler=`, with
its `EngineView` as `engine`), which runs the same loop in a process of its own so that the event
loop and the engine do not share a GIL (`lcx.serve.engine_process`). A request the engine fails
gets a 500 error object (or, mid-stream, an `error` event before `[DONE]`) and other requests go
on; if the engine process dies, requests in flight get 503 and new ones 503 with Retry-After while it is
restarted (`lcx.serve.engine_process`: bounded restarts, then `lcx serve` exits non-zero), and
/health answers 503 meanwhile. While the engine process does not respond (no heartbeat), /health
answers 503 and new requests get 503 with Retry-After at once; requests in flight get 503
`engine_timeout` once it has been silent for `lcx serve --engine-timeout-s`, and it is killed and
restarted. Every error
response (and every disconnect) is counted in /stats and logged with
the request's id, which each response carries in `X-Request-Id` (a client's own, if it sends a
short one, else a fresh one).
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from lcx.engine import Engine

from .body import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_STOP
from .chat_template import AUTO
from .context import ServerContext
from .engine_process import EngineProcess, EngineView
from .gate import Gate, error_response
from .openapi import install_openapi
from .pacing import DEFAULT_SHARE
from .sampling import DEFAULT_MAX_N
from .protocol import APIError
from .routes import ROUTERS
from .scheduler import Scheduler


def create_app(engine: Engine | EngineView, *, model_name: str, api_key: str | None = None,
               batch_window_s: float = 0.01, scheduler: Scheduler | EngineProcess | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               max_stop: int = DEFAULT_MAX_STOP, chat_template: str | None = AUTO,
               loop_share: float = DEFAULT_SHARE, max_model_len_source: str | None = None,
               max_request_tokens: int | None = None, max_n: int = DEFAULT_MAX_N) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name`. The scheduler (by default a `Scheduler` over
    `engine` in a worker thread; or `scheduler`, e.g. a started `EngineProcess` with its `engine`
    view) and the CPU thread pool start with the app (lifespan) and stop with it. `max_body_bytes`: the largest
    request body accepted (413 above); `body_timeout_s`: the time a body may take to arrive (408
    after); `max_stop`: stop strings per request; `chat_template`: "auto" (the tokenizer's, else
    lcx's default), "none" (the tokenizer's only) or a Jinja template (`lcx.serve.chat_template`);
    `loop_share`: the event loop's most share of CPU time while the engine works (`lcx.serve.pacing`);
    `max_model_len_source`: how the engine's max_model_len was derived, for /v1/models
    (`lcx.serve.lengths`); `max_request_tokens` (default: 4 x max_model_len) and `max_n`: the
    per-request work bound (prompt + max_tokens summed over the choices; n), 400 above."""
    ctx = ServerContext(engine, scheduler or Scheduler(engine, batch_window_s=batch_window_s),
                        model_name=model_name, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                        max_stop=max_stop, chat_template=chat_template, loop_share=loop_share,
                        max_model_len_source=max_model_len_source, max_request_tokens=max_request_tokens,
                        max_n=max_n)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.start()
        yield
        ctx.stop()

    app = FastAPI(title="lcx", lifespan=lifespan)
    app.state.ctx = ctx
    # what tests and tools read
    app.state.scheduler, app.state.engine, app.state.model_name = ctx.sched, engine, model_name
    app.state.http_stats, app.state.prompt_char_limit = ctx.stats, ctx.prompt_char_limit
    app.add_middleware(Gate, api_key=api_key, stats=ctx.stats)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(request, APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                                code=code))

    for router in ROUTERS:
        app.include_router(router)
    install_openapi(app, description=__doc__.split("\n\nLayout:")[0])
    return app
