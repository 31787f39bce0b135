"""The engine in its own process (`lcx.serve.engine_process`): the same outputs as the in-thread
`Scheduler`, aborts that reach the engine, a killed engine process that fails what is in flight
(never a hang) and turns /health to 503, and shutdowns that leave no process behind.

Engines are on the tiny model in float64, so batched and unbatched greedy decoding agree token for
token and the process and the thread must give identical outputs.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from lcx.engine import Engine, EngineConfig, SamplingParams, StepEvent  # noqa: E402
from lcx.serve.jobs import engine_error  # noqa: E402
from lcx.serve.engine_process import (  # noqa: E402
    EngineDeadError,
    EngineProcess,
    EngineRecipe,
    RemoteEngineError,
    _picklable,
)
from lcx.serve.scheduler import Scheduler  # noqa: E402

from _servers import lcx_serve, wait_healthy  # noqa: E402


MAX_MODEL_LEN = 256
MAX_BATCH = 4
PROMPTS = ["ROMEO:", "a", "the quick brown fox " * 3, "0123456789", "x y", "JULIET: o"]  # 6 > MAX_BATCH: some wait
GEN = 12
LONG = MAX_MODEL_LEN - 20  # a request that runs for hundreds of steps
EVENT_TIMEOUT_S = 60


def _config() -> EngineConfig:
    return EngineConfig(max_model_len=MAX_MODEL_LEN, max_batch=MAX_BATCH)


def _start(model_dir) -> EngineProcess:
    return EngineProcess(EngineRecipe(str(model_dir), _config(), dtype="float64", threads=1),
                         batch_window_s=0.05).start()


class Collector:
    """Sinks that keep each request's events; `wait` until every request has finished."""

    def __init__(self):
        self.events: dict[str, list[StepEvent]] = {}
        self.finished: set[str] = set()
        self.cond = threading.Condition()

    def sink(self, ev: StepEvent) -> None:
        with self.cond:
            self.events.setdefault(ev.request_id, []).append(ev)
            if ev.finished:
                assert ev.request_id not in self.finished, f"two finished events for {ev.request_id}"
                self.finished.add(ev.request_id)
            self.cond.notify_all()

    def wait(self, rids, timeout=EVENT_TIMEOUT_S) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: set(rids) <= self.finished, timeout), \
                f"not finished after {timeout} s: {set(rids) - self.finished}"

    def wait_first(self, rid, timeout=EVENT_TIMEOUT_S) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: rid in self.events, timeout), f"no event for {rid} in {timeout} s"

    def tokens(self, rid) -> list[int]:
        return [t for ev in self.events[rid] for t in ev.token_ids]

    def last(self, rid) -> StepEvent:
        return self.events[rid][-1]


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return Engine.from_pretrained(str(tiny_model_dir), _config(), dtype="float64")


@pytest.fixture(scope="module")
def proc(tiny_model_dir):
    p = _start(tiny_model_dir)
    yield p
    p.stop()


def _run(sched, prompts, params) -> Collector:
    c = Collector()
    rids = [sched.submit(p, params, c.sink) for p in prompts]
    c.wait(rids)
    c.rids = rids
    return c


def test_view_is_the_engines_text_side(proc, ref):
    view = proc.engine
    assert (view.max_model_len, view.vocab_size, view.config.max_batch) == (MAX_MODEL_LEN, ref.vocab_size, MAX_BATCH)
    assert view.methods_info() == ref.methods_info()
    for text in PROMPTS:
        assert view.encode(text) == ref.encode(text)
    assert [view.token_str(t) for t in range(ref.vocab_size)] == [ref.token_str(t) for t in range(ref.vocab_size)]
    with pytest.raises(ValueError, match="max_model_len"):
        view.validate([1] * 10, SamplingParams(max_tokens=MAX_MODEL_LEN))
    with pytest.raises(ValueError, match="token ids"):
        view.validate([ref.vocab_size], SamplingParams())


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=GEN, temperature=0, logprobs=2),
                                    SamplingParams(max_tokens=GEN, temperature=0.9, top_p=0.9, seed=7)],
                         ids=["greedy-logprobs", "seeded-sampling"])
def test_outputs_equal_the_in_thread_scheduler(proc, ref, params):
    prompts = [ref.encode(p) for p in PROMPTS]
    sched = Scheduler(ref, batch_window_s=0.05).start()
    try:
        want = _run(sched, prompts, params)
    finally:
        sched.stop()
    got = _run(proc, prompts, params)
    for w, g in zip(want.rids, got.rids):
        assert got.tokens(g) == want.tokens(w)
        assert "".join(e.text for e in got.events[g]) == "".join(e.text for e in want.events[w])
        assert [lp for e in got.events[g] for lp in e.logprobs] == [lp for e in want.events[w] for lp in e.logprobs]
        assert got.last(g).finish_reason == want.last(w).finish_reason
    snap = proc.snapshot()
    assert snap["scheduler"]["batches_over_1"] > 0 and snap["engine"]["max_batch_size"] == MAX_BATCH
    assert snap["scheduler"]["finished"] >= len(PROMPTS) and snap["engine_process"]["alive"]
    assert not proc.engine.has_work() and proc.engine.num_running == 0


def test_abort_reaches_the_engine(proc, ref):
    c = Collector()
    rid = proc.submit(ref.encode("abort me"), SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True), c.sink)
    c.wait_first(rid)
    assert proc.engine.has_work()
    proc.abort(rid)
    c.wait([rid], timeout=10)
    assert c.last(rid).finish_reason == "abort" and len(c.tokens(rid)) < LONG
    assert not proc.engine.has_work()


def test_a_failing_request_gets_its_error_and_others_go_on(proc, ref):
    c = Collector()
    bad = proc.submit([ref.vocab_size + 5], SamplingParams(max_tokens=2), c.sink)  # skipped validation
    good = proc.submit(ref.encode("fine"), SamplingParams(max_tokens=3, temperature=0), c.sink)
    c.wait([bad, good])
    err = c.last(bad).error
    assert c.last(bad).finish_reason == "error" and isinstance(err, ValueError) and "token ids" in str(err)
    assert c.last(good).finish_reason == "length" and len(c.tokens(good)) == 3


class _Unpicklable(Exception):
    def __init__(self, code, why):  # not the args Exception pickles: pickles, but does not unpickle
        super().__init__(f"{code}: {why}")


def test_an_exception_that_does_not_pickle_crosses_as_a_stand_in():
    ev = _picklable(StepEvent("r1", finished=True, finish_reason="error", error=_Unpicklable(3, "bad")))
    err = pickle.loads(pickle.dumps(ev)).error
    assert isinstance(err, RemoteEngineError) and err.type_name == "_Unpicklable" and str(err) == "3: bad"
    api = engine_error(ev)
    assert api.status == 500 and "_Unpicklable: 3: bad" in api.message
    plain = StepEvent("r2", finished=True, finish_reason="error", error=ValueError("v"))
    assert _picklable(plain) is plain
    dead = engine_error(StepEvent("r3", finished=True, finish_reason="error", error=EngineDeadError("gone")))
    assert dead.status == 503 and dead.code == "engine_unavailable"


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_killed_engine_fails_in_flight_requests_and_new_ones(tiny_model_dir, ref):
    p = _start(tiny_model_dir)
    try:
        c = Collector()
        params = SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)
        rids = [p.submit(ref.encode(f"doomed {i}"), params, c.sink) for i in range(3)]
        c.wait_first(rids[0])
        os.kill(p.pid, signal.SIGKILL)
        c.wait(rids, timeout=10)
        for rid in rids:
            ev = c.last(rid)
            assert ev.finish_reason == "error" and isinstance(ev.error, EngineDeadError), ev
            assert "SIGKILL" in str(ev.error)
        assert not p.alive and p.snapshot()["engine_process"]["alive"] is False
        late = p.submit(ref.encode("late"), params, c.sink)
        c.wait([late], timeout=1)  # at once, on this thread
        assert isinstance(c.last(late).error, EngineDeadError)
        assert not p.engine.has_work()
    finally:
        p.stop()


@pytest.mark.slow
def test_stop_ends_the_process_and_fails_what_is_open(tiny_model_dir, ref):
    p = _start(tiny_model_dir)
    pid = p.pid
    c = Collector()
    rid = p.submit(ref.encode("cut short"), SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True), c.sink)
    c.wait_first(rid)
    t = time.monotonic()
    p.stop(timeout=5)
    assert time.monotonic() - t < 15
    assert _gone(pid, timeout=1) and not p.alive
    c.wait([rid], timeout=1)
    assert c.last(rid).finish_reason in ("error", "abort")  # the child may still have sent its last step


# ================================================================================ through lcx serve
def _sse(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.slow  # a real server whose engine process is killed: ~10 s (#76 item 7)
def test_lcx_serve_engine_process_streams_and_survives_a_dead_engine(tiny_model_dir, ref, tmp_path):
    """`lcx serve` (engine process by default): a stream equals the reference; after the engine
    process is killed, the request in flight ends with a 503 error event, /health answers 503,
    a new request gets 503 at once; stopping the server leaves no engine process behind."""
    log = tmp_path / "server.log"
    with lcx_serve(tiny_model_dir, log, "--max-model-len", str(MAX_MODEL_LEN), "--max-batch", str(MAX_BATCH),
                   "--dtype", "float64", "--threads", "1") as (url, server):
        wait_healthy(url, server, log)
        stats = httpx.get(url + "/stats", timeout=10).json()
        engine_pid = stats["engine_process"]["pid"]
        assert engine_pid != server.pid and psutil.Process(engine_pid).ppid() == server.pid

        body = {"prompt": "stream me", "max_tokens": GEN, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=EVENT_TIMEOUT_S) as r:
            assert r.status_code == 200
            text = "".join(c["choices"][0]["text"] for c in _sse(r))
        assert text == ref.generate([ref.encode("stream me")], SamplingParams(max_tokens=GEN))[0].text

        body = {"prompt": "long", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=EVENT_TIMEOUT_S) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # generating
            os.kill(engine_pid, signal.SIGKILL)
            rest = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
        assert rest and rest[-1]["error"]["code"] == "engine_unavailable", rest[-1:]
        assert "SIGKILL" in rest[-1]["error"]["message"]

        assert httpx.get(url + "/health", timeout=10).status_code == 503
        r = httpx.post(url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        server.terminate()
        server.wait(15)
    assert _gone(engine_pid), "the engine process outlived the server"


@pytest.mark.slow
def test_a_killed_server_leaves_no_engine_process(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with lcx_serve(tiny_model_dir, log, "--max-model-len", str(MAX_MODEL_LEN), "--threads", "1") as (url, server):
        wait_healthy(url, server, log)
        engine_pid = httpx.get(url + "/stats", timeout=10).json()["engine_process"]["pid"]
        server.kill()  # no shutdown: the engine process sees its pipe close
        server.wait(15)
    assert _gone(engine_pid, timeout=15), "the engine process outlived a killed server"


# ================================================================================ healing (issue #44, item 5)
def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_dead_engine_is_restarted_then_a_crash_loop_gives_up(tiny_model_dir, ref):
    """kill -9: requests in flight fail (503), new ones fail at once while the child restarts,
    then the new child serves them (the reference's tokens); with max_restarts=1 the second death
    makes the EngineProcess give up (on_give_up called, /health's reason says so)."""
    gave_up: list[str] = []
    p = EngineProcess(EngineRecipe(str(tiny_model_dir), _config(), dtype="float64", threads=1), batch_window_s=0.05,
                      max_restarts=1, on_give_up=gave_up.append).start()
    try:
        c = Collector()
        params = SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)
        doomed = p.submit(ref.encode("doomed"), params, c.sink)
        c.wait_first(doomed)
        first_pid = p.pid
        os.kill(first_pid, signal.SIGKILL)
        c.wait([doomed], timeout=10)
        assert isinstance(c.last(doomed).error, EngineDeadError)
        assert p.health() is not None
        _wait(lambda: p.alive, 240, "the restarted engine process")
        assert p.pid != first_pid and p.health() is None and p.snapshot()["engine_process"]["restarts"] == 1
        again = p.submit(ref.encode("ROMEO:"), SamplingParams(max_tokens=GEN, temperature=0), c.sink)
        c.wait([again], timeout=EVENT_TIMEOUT_S)
        want = ref.generate([ref.encode("ROMEO:")], SamplingParams(max_tokens=GEN))[0]
        assert [t for ev in c.events[again] for t in ev.token_ids] == want.token_ids
        os.kill(p.pid, signal.SIGKILL)  # a second death within the window: give up
        _wait(lambda: bool(gave_up), 30, "on_give_up")
        assert "restart(s) within" in gave_up[0] and not p.alive
        assert "gave up" in p.health() and p.snapshot()["engine_process"]["gave_up"]
        late = p.submit(ref.encode("late"), params, c.sink)
        c.wait([late], timeout=1)
        assert isinstance(c.last(late).error, EngineDeadError)
    finally:
        p.stop()


@pytest.mark.slow
def test_lcx_serve_heartbeat_and_exit_after_repeated_failures(tiny_model_dir, tmp_path):
    """`lcx serve`: SIGSTOP on the engine process turns /health to 503 ("not responding") within
    the heartbeat timeout, SIGCONT back to 200; with --engine-restarts 0 a kill -9 makes the
    server exit with status 3 (a supervisor restarts it), taking no engine process along."""
    from lcx.serve.cli import GAVE_UP_EXIT
    from lcx.serve.engine_process import HEARTBEAT_TIMEOUT_S

    log = tmp_path / "server.log"
    with lcx_serve(tiny_model_dir, log, "--max-model-len", str(MAX_MODEL_LEN), "--threads", "1",
                   "--engine-restarts", "0") as (url, server):
        wait_healthy(url, server, log)
        engine_pid = httpx.get(url + "/stats", timeout=10).json()["engine_process"]["pid"]
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            _wait(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, HEARTBEAT_TIMEOUT_S + 10,
                  "/health 503 after SIGSTOP")
            r = httpx.get(url + "/health", timeout=10)
            assert "not responding" in r.json()["status"], r.text
            assert httpx.head(url + "/health", timeout=10).status_code == 503
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        _wait(lambda: httpx.get(url + "/health", timeout=10).status_code == 200, 10, "/health 200 after SIGCONT")
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          timeout=30).status_code == 200
        os.kill(engine_pid, signal.SIGKILL)
        assert server.wait(60) == GAVE_UP_EXIT, log.read_text()[-2000:]
    assert "giving up on the engine process" in log.read_text()
