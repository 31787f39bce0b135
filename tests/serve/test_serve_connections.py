"""Connections that never finish their headers are closed (issue #44, item 7).

`lcx.serve.connections.header_timeout_protocol` under uvicorn's h11 protocol (and httptools where
installed), in-process: a connection that sends nothing, one that trickles a header block without
ending it (slowloris), and a second request on a kept-alive connection left unfinished each get
408 and are closed within the limit (+ slack); a request whose headers come slowly but within
the limit, and requests on a kept-alive connection, are served.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from lcx.engine import Engine, EngineConfig  # noqa: E402
from lcx.serve.connections import header_timeout_protocol  # noqa: E402

from _servers import free_port, wait_healthy  # noqa: E402


LIMIT_S = 1.0
SLACK_S = 1.5  # the close may come this much after the limit on a busy machine
HTTP = ["h11", "httptools"]


@pytest.fixture(scope="module")
def engine(tiny_model):
    model, tok = tiny_model
    return Engine(model, tok, EngineConfig(max_model_len=128))


@contextlib.contextmanager
def _server(engine, http: str):
    from lcx.serve.app import create_app

    if http == "httptools":
        pytest.importorskip("httptools")
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model_name="tiny"), host="127.0.0.1", port=port,
                                           http=header_timeout_protocol(LIMIT_S, base), log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


def _closed_within(sock: socket.socket, trickle: bytes = b"", every_s: float = 0.2) -> tuple[float, bytes]:
    """Send `trickle` a byte every `every_s` s until the server closes; (seconds until then, what it sent)."""
    t0 = time.monotonic()
    got = b""
    sock.settimeout(every_s)
    i = 0
    while time.monotonic() - t0 < LIMIT_S + SLACK_S + 5:
        if i < len(trickle):
            try:
                sock.sendall(trickle[i:i + 1])
            except OSError:
                break
            i += 1
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            continue
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    return time.monotonic() - t0, got


@pytest.mark.parametrize("http", HTTP)
def test_unfinished_headers_are_closed(engine, http):
    with _server(engine, http) as port:
        silent = socket.create_connection(("127.0.0.1", port))
        dt, got = _closed_within(silent)
        assert dt < LIMIT_S + SLACK_S and got.startswith(b"HTTP/1.1 408"), (dt, got)
        assert b"--header-timeout-s" in got

        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        dt, got = _closed_within(slow, b"X-Slow: " + b"a" * 100)  # never the blank line
        assert dt < LIMIT_S + SLACK_S and got.startswith(b"HTTP/1.1 408"), (dt, got)

        # a kept-alive connection: the first request is served, the unfinished second one cut off
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        kept.settimeout(10)
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += kept.recv(4096)
        assert first.startswith(b"HTTP/1.1 200"), first
        kept.sendall(b"GET /health HTTP/1.1\r\n")
        dt, got = _closed_within(kept)
        assert dt < LIMIT_S + SLACK_S and got.startswith(b"HTTP/1.1 408"), (dt, got)


@pytest.mark.parametrize("http", HTTP)
def test_slow_but_timely_headers_and_keep_alive_are_served(engine, http):
    with _server(engine, http) as port:
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(10)
        req = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        for i in range(0, len(req), 8):  # the whole block in ~0.4 s
            s.sendall(req[i:i + 8])
            time.sleep(0.08)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            for _ in range(3):  # one kept-alive connection, idle gaps shorter than uvicorn's keep-alive
                assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
                time.sleep(LIMIT_S / 2)
            time.sleep(LIMIT_S * 1.5)  # an idle kept-alive connection past the limit: a new request still works
            assert c.get("/health").status_code == 200


def test_the_limit_must_be_positive():
    with pytest.raises(ValueError, match="header timeout"):
        header_timeout_protocol(0)
