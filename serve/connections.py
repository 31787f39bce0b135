"""A time limit on a request's headers (uvicorn has one for idle keep-alive connections and lcx
one for bodies, `--body-timeout-s`, but none for headers).

    uvicorn.run(app, http=header_timeout_protocol(10.0))          # what `lcx serve` does

A connection must deliver a request's complete header block within `timeout_s` of the moment
the server starts waiting for it: when the connection is made, and when the first byte of a
further request arrives on a kept-alive connection. Otherwise the server answers 408 and closes
it. Without the limit a client that sends `GET / HTTP/1.1\\r\\n` and then one header byte a minute
(slowloris) holds a connection, its buffers and a file descriptor for as long as it likes.
The timer is per connection and costs one `call_later` per request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("lcx.serve")

DEFAULT_HEADER_TIMEOUT_S = 10.0  # `lcx serve --header-timeout-s`
TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s")
TIMEOUT_BODY = (b'{"error": {"message": "the request headers were not received within %g s (lcx serve '
                b'--header-timeout-s)", "type": "invalid_request_error", "param": null, "code": "request_timeout"}}')


def base_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol as its "auto" picks it: httptools where installed, else h11."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


def header_timeout_protocol(timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                            base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """`base` (default: `base_protocol()`) with the header time limit (module docstring). Works
    with uvicorn's h11 and httptools protocols: both start a new `cycle` when a request's headers
    are complete, which is what ends the wait."""
    if not timeout_s > 0:
        raise ValueError(f"the header timeout must be > 0 s, got {timeout_s}")
    base = base or base_protocol()

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        header_timeout_s = timeout_s

        def connection_made(self, transport: Any) -> None:
            self._lcx_header_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._lcx_wait_for_headers()

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            if before is None or before.response_complete:
                self._lcx_wait_for_headers()  # a new request starts (or goes on arriving)
            super().data_received(data)
            if self.cycle is not before:  # its headers are complete
                self._lcx_stop_waiting()

        def connection_lost(self, exc: Exception | None) -> None:
            self._lcx_stop_waiting()
            super().connection_lost(exc)

        def _lcx_wait_for_headers(self) -> None:
            if self._lcx_header_timer is None:
                self._lcx_header_timer = self.loop.call_later(self.header_timeout_s, self._lcx_headers_late)

        def _lcx_stop_waiting(self) -> None:
            if self._lcx_header_timer is not None:
                self._lcx_header_timer.cancel()
                self._lcx_header_timer = None

        def _lcx_headers_late(self) -> None:
            self._lcx_header_timer = None
            t = self.transport
            if t is None or t.is_closing():
                return
            body = TIMEOUT_BODY % self.header_timeout_s
            t.write(TIMEOUT_RESPONSE % (len(body), body))
            t.close()
            client = getattr(self, "client", None)
            log.info("closed a connection%s: its request headers did not arrive within %g s (--header-timeout-s)",
                     f" from {client[0]}:{client[1]}" if client else "", self.header_timeout_s)

    HeaderTimeoutProtocol.__name__ = HeaderTimeoutProtocol.__qualname__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol
