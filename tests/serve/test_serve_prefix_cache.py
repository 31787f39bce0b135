"""`lcx serve`'s prefix cache: on by default, `--no-prefix-caching` turns it off, `/stats` shows
its hit counters, and answers are the same with and without it (the engine's exactness grid is
tests/engine/test_prefix_cache.py)."""

from __future__ import annotations

import argparse

import pytest

from lcx.engine import Engine, EngineConfig, SamplingParams

MODEL = "tiny"
PREFIX = "You are a terse assistant. Answer in one word. " * 2




def test_prefix_caching_flag_defaults_on():
    from lcx.serve.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--model", "m"]).prefix_caching is True
    assert p.parse_args(["--model", "m", "--no-prefix-caching"]).prefix_caching is False
    assert p.parse_args(["--model", "m", "--prefix-cache-mb", "8"]).prefix_cache_mb == 8
    assert p.parse_args(["--model", "m"]).prefix_cache_mb is None  # auto: the engine sizes it
    assert p.parse_args(["--model", "m", "--prefix-cache-mb", "Auto"]).prefix_cache_mb is None
    for bad in ("-1", "lots", "inf", "nan"):
        with pytest.raises(SystemExit):
            p.parse_args(["--model", "m", "--prefix-cache-mb", bad])


@pytest.mark.parametrize("caching", [True, False])
def test_stats_show_prefix_cache_hits(tiny_model, caching):
    from starlette.testclient import TestClient

    from lcx.serve.app import create_app

    model, tok = tiny_model
    eng = Engine(model, tok, EngineConfig(max_batch=4, prefix_caching=caching, prefix_block_size=8))
    ref = Engine(model, tok, EngineConfig(prefix_caching=False))
    app = create_app(eng, model_name=MODEL, batch_window_s=0.0)
    with TestClient(app) as client:
        texts = []
        for q in ("Colour of the sky?", "Colour of grass?"):
            r = client.post("/v1/completions", json={"prompt": PREFIX + q, "max_tokens": 6, "temperature": 0,
                                                     "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        stats = client.get("/stats").json()
    want = [o.text for o in ref.generate([ref.encode(PREFIX + q) for q in ("Colour of the sky?", "Colour of grass?")],
                                         SamplingParams(max_tokens=6, ignore_eos=True))]
    assert texts == want
    pc, es = stats["prefix_cache"], stats["engine"]
    assert pc["enabled"] is caching
    if caching:
        n = len(ref.encode(PREFIX)) // 8 * 8
        assert pc["hits"] == 1 and pc["hit_tokens"] >= n - 8 and 0 < pc["hit_rate"] < 1 and pc["bytes"] > 0
        assert es["prefix_cache_hits"] == 1 and es["prefix_cache_hit_rate"] == pytest.approx(pc["hit_rate"])
    else:
        assert "no-prefix-caching" in pc["reason"] and es["prefix_cache_hits"] == 0


def test_scheduler_groups_an_api_calls_samples():
    """The engine's fair scheduler counts the n samples of one API call as one client: the server
    tags them `<http request id>.<index>`, so they share a group; other ids are their own group."""
    from lcx.serve.scheduler import _group

    assert _group("r5-abc123.0") == _group("r6-abc123.17") == "abc123"  # r<n>: the scheduler's counter
    assert _group("r5-abc123.0") != _group("r6-xyz.0")
    assert _group("r7") == "r7" and _group("req-3") == "req-3" and _group("r8-v1.2x") == "r8-v1.2x"


def test_scheduler_passes_groups_to_the_engine(tiny_model):
    """Requests submitted as the server submits an n-sample call land in one engine group."""
    from lcx.serve.scheduler import Scheduler

    model, tok = tiny_model
    eng = Engine(model, tok, EngineConfig(max_batch=4))
    sched = Scheduler(eng)  # not started: requests are handed to the engine by hand below
    sp = SamplingParams(max_tokens=2)
    rids = [sched.submit([5, 6, 7], sp, lambda ev: None, tag=f"req9.{i}") for i in range(3)]
    rids.append(sched.submit([5, 6, 7], sp, lambda ev: None, tag="other.0"))
    while not sched._inbox.empty():
        sched._handle(*sched._inbox.get())
    groups = {s.rid: s.group for s in eng._waiting}
    assert len({groups[r] for r in rids[:3]}) == 1 and groups[rids[3]] != groups[rids[0]]
