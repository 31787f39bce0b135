"""Shared by the `lcx serve` test modules: run the server as a subprocess and wait for it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

START_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, log: Path | None = None,
                 timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll `/health` until it answers 200; fail with the server's log if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server not healthy after {timeout_s} s:\n{log.read_text()[-3000:] if log else ''}")


@contextlib.contextmanager
def lcx_serve(model_dir: str | Path, log: Path, *args: str, cwd: str | None = None,
              stop_timeout_s: float = 15) -> Iterator[tuple[str, subprocess.Popen]]:
    """`lcx serve --model MODEL_DIR --port <free> ARGS...` as a subprocess writing `log`; yields
    (base URL, process) as soon as it started (call `wait_healthy`), stops it on exit (SIGTERM,
    then SIGKILL after `stop_timeout_s`)."""
    port = free_port()
    cmd = [sys.executable, "-m", "lcx.cli", "serve", "--model", str(model_dir), "--port", str(port), *args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
