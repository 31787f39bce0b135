"""The ASGI gate in front of every route: request ids, the API key, counting and logging every
error response and every client that leaves early (`HttpStats`, shown by /stats), and closing the
connection of a request whose body was refused before it was read (`linger_close`)."""

from __future__ import annotations

import asyncio
import builtins
import logging
import re
import secrets
import struct
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from .protocol import APIError

log = logging.getLogger("lcx.serve")

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
TOKENIZER_PATHS = frozenset({"/tokenizer_info", "/tokenize", "/detokenize"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_EXCEPTION_GROUP = getattr(builtins, "BaseExceptionGroup", ())  # Python >= 3.11
LINGER_S = 2.0  # at most this long a refused connection waits for the client to acknowledge the answer
LINGER_POLL_S = 0.005


class ClientGone(Exception):
    """The client closed the connection before its response was complete."""


class HttpStats:
    """HTTP counters for /stats. Touched only on the event loop thread."""

    def __init__(self) -> None:
        self.requests = 0
        self.client_disconnects = 0
        self.by_status: dict[int, int] = {}
        self.by_code: dict[str, int] = {}

    @property
    def activity(self) -> int:
        """Grows with every request that starts and every error response that ends."""
        return self.requests + sum(self.by_status.values())

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


def note_error(scope: dict[str, Any], err: APIError) -> None:
    """Tell the gate which error a response carries (it counts and logs it). Kept without its
    traceback: the scope holding the error whose frames hold the scope would be a reference cycle
    only a full garbage collection frees (a client error needs no traceback)."""
    err.__traceback__ = None
    scope["lcx.error"] = err


def _has_body(scope: dict[str, Any]) -> bool:
    headers = dict(scope.get("headers") or [])
    return headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers


def server_transport(receive: Any) -> Any | None:
    """The connection's asyncio transport behind uvicorn's `receive` (a method of its per-request
    cycle, which Starlette passes down unwrapped), else None (another server, a test client)."""
    t = getattr(getattr(receive, "__self__", None), "transport", None)
    needed = ("pause_reading", "write_eof", "can_write_eof", "abort", "is_closing", "get_write_buffer_size",
              "get_extra_info")
    return t if all(hasattr(t, a) for a in needed) else None


def _unacknowledged(transport: Any) -> int:
    """Bytes the peer has not acknowledged yet: the transport's buffer + the socket's send queue
    (SIOCOUTQ, Linux); -1 where the queue cannot be read."""
    n = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    try:
        import fcntl
        import termios

        return n + struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except (ImportError, OSError, AttributeError, ValueError):
        return -1


def linger_close(transport: Any) -> None:
    """Close a connection whose request body was left unread, so that the client still reads the
    answer already sent: stop reading (the rest of the body stays in the kernel, costing the
    server nothing), send FIN after the answer, and once the client has acknowledged it (or after
    LINGER_S) abort. The abort resets the connection (unread data), which ends a client still
    sending its body; the answer is already in its receive buffer, where clients that read after
    a failed send find it (httpx/httpcore, curl). Reading the rest of the body instead (nginx's
    lingering close) would cost ~30 ms of server CPU per 30 MB: what a hostile client wants."""
    if transport.is_closing():
        return
    transport.pause_reading()
    if transport.can_write_eof():
        transport.write_eof()  # after the buffered answer
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_S

    def check() -> None:
        if transport.is_closing():
            return
        left = _unacknowledged(transport)
        if left == 0 or loop.time() >= deadline:
            transport.abort()
        else:  # -1 (unknown): wait out LINGER_S
            loop.call_later(LINGER_POLL_S, check)

    check()


class _LingerOnClose:
    """Stands for a connection's transport in uvicorn's request cycle when the answer comes before
    the whole body was read: the answer carries `Connection: close` (a keep-alive client must not
    send its next request on a connection the server is about to reset), and uvicorn's close at
    the end of it becomes `linger_close`, run on the next turn of the loop (after uvicorn's own
    end-of-response bookkeeping, which resumes reading). Everything else goes to the transport."""

    def __init__(self, transport: Any):
        self._transport = transport
        self.closing = False

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(linger_close, self._transport)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _linger_on_close(receive: Any, transport: Any) -> _LingerOnClose | None:
    """Put a `_LingerOnClose` in place of `transport` in uvicorn's request cycle (the object whose
    method `receive` is); None where the cycle has no such attribute (another server)."""
    cycle = getattr(receive, "__self__", None)
    if getattr(cycle, "transport", None) is not transport:
        return None
    proxy = _LingerOnClose(transport)
    cycle.transport = proxy
    return proxy


def error_response(request: Request, err: APIError) -> JSONResponse:
    note_error(request.scope, err)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _client_gone(e: BaseException) -> bool:
    if isinstance(e, _EXCEPTION_GROUP):  # anyio task groups may wrap it
        return all(_client_gone(x) for x in e.exceptions)
    return isinstance(e, ClientGone)


class Gate:
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
        transport = server_transport(receive)
        body_read = not _has_body(scope)
        lingering: _LingerOnClose | None = None

        async def receive_and_track() -> dict[str, Any]:
            nonlocal body_read
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_read = True
            return message

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status, complete, lingering
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                if not body_read:
                    # An answer before the whole body (refused, 401, 404, ...): the connection
                    # closes after it without the rest being read (linger_close, where uvicorn's
                    # transport is reachable; else the server's own close).
                    headers.append((b"connection", b"close"))
                    if transport is not None:
                        lingering = _linger_on_close(receive, transport)
                message = dict(message, headers=headers)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        async def send_error(err: APIError) -> None:
            note_error(scope, err)
            await JSONResponse(err.body(), status_code=err.status)(scope, receive_and_track, send_with_id)

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
            await self.app(scope, receive_and_track, send_with_id)
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
            if not body_read and transport is not None and complete and not (lingering and lingering.closing):
                # An early answer uvicorn did not close (its cycle without the proxy): close the
                # connection without reading the rest of the body. Never uvicorn's plain close: a
                # close with unread data resets the connection, possibly before the client has
                # the answer.
                linger_close(transport)
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
