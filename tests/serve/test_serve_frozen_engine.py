"""A frozen engine (issue #75): `lcx serve` with its engine process stopped (SIGSTOP).

- While the engine does not answer (no heartbeat for --engine-heartbeat-timeout-s), a new request
  gets 503 with Retry-After at once instead of waiting on it.
- A pause shorter than --engine-timeout-s costs nothing: the request in flight completes with
  the reference's tokens, the engine process is the same.
- A freeze longer than --engine-timeout-s: the requests in flight end with 503 `engine_timeout`
  (a stream: an error event, then [DONE]) about --engine-timeout-s after the freeze, the frozen
  process is killed and a new one serves the next request.

One real server on 127.0.0.1 (tiny model, float64) with small timeouts, so the test takes seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from lcx.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from lcx.serve.cli import add_arguments, check_engine_process_flags  # noqa: E402

from _servers import lcx_serve, wait_healthy  # noqa: E402

MAX_MODEL_LEN = 1024
HEARTBEAT_TIMEOUT_S = 1.5  # --engine-heartbeat-timeout-s
ENGINE_TIMEOUT_S = 5.0  # --engine-timeout-s
SHORT_PAUSE_S = 3.0  # between the two: not responding, not yet hung
FAST_S = 1.0  # a refused request is answered within this
LONG = MAX_MODEL_LEN - 24  # max_tokens of a request that outlives the pause (~3 ms a token)
GEN = 6
TIMEOUT_S = 120


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--model", "m", *argv])


@pytest.mark.parametrize("argv,flag", [
    (("--engine-timeout-s", "1", "--engine-heartbeat-timeout-s", "2"), "--engine-timeout-s"),
    (("--engine-timeout-s", "-1"), "--engine-timeout-s"),
    (("--engine-heartbeat-timeout-s", "0.1"), "--engine-heartbeat-timeout-s"),
    (("--engine-heartbeat-timeout-s", "nan"), "--engine-heartbeat-timeout-s"),
    (("--no-engine-process", "--engine-timeout-s", "7"), "--engine-timeout-s"),
    (("--no-engine-process", "--engine-heartbeat-timeout-s", "3"), "--engine-heartbeat-timeout-s"),
], ids=["timeout-below-heartbeat", "negative", "heartbeat-below-period", "heartbeat-nan", "thread-timeout",
        "thread-heartbeat"])
def test_bad_engine_timeout_flags_are_refused_by_name(argv, flag):
    with pytest.raises(ValueError, match=flag):
        check_engine_process_flags(_parse(*argv))


@pytest.mark.parametrize("flag", ["--engine-timeout-s", "--engine-heartbeat-timeout-s"])
def test_engine_vllm_refuses_the_engine_process_flags(flag):
    from lcx.serve.cli import run_vllm

    with pytest.raises(ValueError, match=f"{flag} is for the built-in engine"):
        run_vllm(_parse("--engine", "vllm", flag, "7"))


def test_engine_timeout_flags_accepted_and_documented():
    check_engine_process_flags(_parse())
    check_engine_process_flags(_parse("--engine-timeout-s", "0"))  # never
    check_engine_process_flags(_parse("--engine-timeout-s", "2", "--engine-heartbeat-timeout-s", "2"))
    p = argparse.ArgumentParser()
    add_arguments(p)
    text = " ".join(p.format_help().split())
    assert "--engine-timeout-s S" in text and "--engine-heartbeat-timeout-s S" in text
    assert "503 engine_timeout" in text and "Retry-After" in text


def _sse(lines) -> list[dict]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def _wait(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


def _health(url) -> int:
    return httpx.get(url + "/health", timeout=10).status_code


def _open(url) -> int:
    """Requests the server has handed to the engine process and not seen finish."""
    return httpx.get(url + "/stats", timeout=10).json()["engine_process"]["open_requests"]


def _refused_fast(url) -> None:
    """A new request while the engine is frozen: 503 with Retry-After, within FAST_S."""
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": "new", "max_tokens": 2}, timeout=10)
    took = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert r.headers.get("retry-after", "").isdigit(), r.headers
    err = r.json()["error"]
    assert err["code"] == "engine_unavailable" and "not responding" in err["message"], err
    assert took < FAST_S, f"a request to a frozen engine took {took:.2f} s to be refused"


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_model_len=MAX_MODEL_LEN), dtype="float64")


@pytest.mark.slow  # a real server frozen past its deadline and restarted: ~25 s (#76 item 7)
def test_frozen_engine_fast_503_then_deadline_and_restart(tiny_model_dir, ref, tmp_path):
    log = tmp_path / "server.log"
    with lcx_serve(tiny_model_dir, log, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float64", "--threads",
                   "1", "--engine-heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), "--engine-timeout-s",
                   str(ENGINE_TIMEOUT_S)) as (url, server):
        wait_healthy(url, server, log)
        pid = httpx.get(url + "/stats", timeout=10).json()["engine_process"]["pid"]
        assert psutil.Process(pid).ppid() == server.pid

        # 1. a pause shorter than the deadline: fast 503s meanwhile, the request in flight completes
        body = {"prompt": "ROMEO:", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            lines = r.iter_lines()
            first = next(lines)
            os.kill(pid, signal.SIGSTOP)
            try:
                _wait(lambda: _health(url) == 503, HEARTBEAT_TIMEOUT_S + 5, "/health 503 after SIGSTOP")
                _refused_fast(url)
                assert _open(url) == 1  # the stream is still in flight
                time.sleep(max(0.0, SHORT_PAUSE_S - HEARTBEAT_TIMEOUT_S))
            finally:
                os.kill(pid, signal.SIGCONT)
            chunks = _sse([first, *lines])
        assert all("error" not in c for c in chunks), chunks[-1:]
        want = ref.generate([ref.encode("ROMEO:")], SamplingParams(max_tokens=LONG, ignore_eos=True))[0].text
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        _wait(lambda: _health(url) == 200, 10, "/health 200 after SIGCONT")
        snap = httpx.get(url + "/stats", timeout=10).json()["engine_process"]
        assert (snap["pid"], snap["timeouts"], snap["restarts"]) == (pid, 0, 0), snap

        # 2. a freeze past the deadline: requests in flight get 503 engine_timeout, the engine is restarted
        results: dict[str, object] = {}

        def plain() -> None:
            r = httpx.post(url + "/v1/completions", json={"prompt": "plain", "max_tokens": LONG, "ignore_eos": True,
                                                          "temperature": 0}, timeout=TIMEOUT_S)
            results["plain"] = (r, time.monotonic())

        body = {"prompt": "long", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            lines = r.iter_lines()
            first = next(lines)  # generating
            t = threading.Thread(target=plain)
            t.start()
            _wait(lambda: _open(url) == 2, 10, "both requests in flight")
            os.kill(pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                rest = list(lines)
                stream_ended = time.monotonic() - frozen_at
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        chunks = _sse([first, *rest])
        assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""], rest[-3:]
        err = chunks[-1]["error"]
        assert err["code"] == "engine_timeout" and "--engine-timeout-s" in err["message"], err
        assert ENGINE_TIMEOUT_S - 0.5 < stream_ended < ENGINE_TIMEOUT_S + 5, stream_ended
        t.join(TIMEOUT_S)
        r, ended = results["plain"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_timeout", r.text
        assert r.headers.get("retry-after", "").isdigit()
        assert ended - frozen_at < ENGINE_TIMEOUT_S + 5
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

        # a new engine process serves the next request
        _wait(lambda: _health(url) == 200, TIMEOUT_S, "the restarted engine")
        snap = httpx.get(url + "/stats", timeout=10).json()["engine_process"]
        assert snap["pid"] != pid and snap["timeouts"] == 1 and snap["restarts"] == 1, snap
        r = httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": GEN, "temperature": 0},
                       timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.generate([ref.encode("ROMEO:")],
                                                              SamplingParams(max_tokens=GEN))[0].text
    text = log.read_text()
    assert "no heartbeat for" in text and "killing it" in text
