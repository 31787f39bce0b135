"""`lcx.threads`: `--threads N|auto` on every command, LCX_THREADS, and the measured `auto` choice."""

from __future__ import annotations

import argparse

import pytest
import torch

import lcx.threads as th


@pytest.mark.parametrize("text,expected", [("auto", "auto"), ("AUTO", "auto"), ("3", 3), (2, 2), (None, None)])
def test_parse(text, expected):
    assert th.parse_threads(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "two", "1.5", 0])
def test_parse_rejects(text):
    with pytest.raises(ValueError, match="threads must be"):
        th.parse_threads(text)


def test_argparse_flag_names_the_error(capsys):
    p = argparse.ArgumentParser()
    th.add_threads_argument(p)
    assert p.parse_args([]).threads == "auto"
    assert p.parse_args(["--threads", "1"]).threads == 1
    with pytest.raises(SystemExit):
        p.parse_args(["--threads", "zero"])
    assert "threads must be a positive integer or 'auto'" in capsys.readouterr().err


@pytest.mark.parametrize("timings,expected", [
    ({1: 1.0, 2: 0.95}, 1),   # within the margin: the fewer threads
    ({1: 1.0, 2: 0.5}, 2),
    ({1: 0.3, 2: 1.2}, 1),    # a busy 2-core machine
    ({1: 1.0, 4: 0.85, 8: 0.6}, 8),
])
def test_choose(timings, expected):
    assert th.choose(timings) == expected


def test_resolve_explicit_env_and_auto(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv(th.ENV_VAR, raising=False)
        assert th.resolve_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv(th.ENV_VAR, "1")
        assert th.resolve_threads("auto", apply=False) == 1
        assert th.resolve_threads(None, apply=False) == 1
        monkeypatch.setenv(th.ENV_VAR, "many")
        with pytest.raises(ValueError, match="LCX_THREADS: threads must be"):
            th.resolve_threads("auto")
        monkeypatch.delenv(th.ENV_VAR)
        monkeypatch.setattr(th, "_decision", None)
        monkeypatch.setattr(th, "measure", lambda c: {1: 0.2, c[-1]: 0.1})
        monkeypatch.setattr(th, "available_cores", lambda: 4)
        assert th.resolve_threads("auto", apply=False) == 4
        monkeypatch.setattr(th, "measure", lambda c: pytest.fail("measured twice"))
        assert th.resolve_threads("auto", apply=False) == 4  # once per process
        monkeypatch.setattr(th, "measure", lambda c: {1: 0.1, c[-1]: 0.2})  # the load changed
        assert th.auto_threads(refresh=True)["threads"] == 1 and th.resolve_threads("auto", apply=False) == 1
    finally:
        torch.set_num_threads(before)


def test_measure_times_each_count_and_restores_torch():
    before = torch.get_num_threads()
    t = th.measure((1, th.available_cores()), rounds=1, reps=1)
    assert set(t) == {1, th.available_cores()} and all(v > 0 for v in t.values())
    assert torch.get_num_threads() == before


def test_contention_names_threads_that_outnumber_the_free_cores():
    from lcx.threads import contention

    assert contention(1, 2, 3.0) is None  # one thread never waits on another
    assert contention(2, 2, 0.1) is None  # an idle 2-core machine
    assert contention(4, 16, 3.0) is None  # cores to spare
    why = contention(2, 2, 1.2)  # one core busy elsewhere
    assert why is not None and "2 threads on 2 cores" in why and "resolve_threads('auto')" in why


def test_the_engine_warns_once_about_torch_default_threads_on_a_busy_machine(monkeypatch, caplog):
    import logging

    import lcx.threads as th
    from lcx.engine import Engine, EngineConfig
    from lcx.hf.models import tiny_model
    from lcx.models.tiny import byte_tokenizer

    monkeypatch.setattr(th, "_resolved", False)
    monkeypatch.setattr(th, "_warned", False)
    monkeypatch.delenv(th.ENV_VAR, raising=False)
    monkeypatch.setattr(th, "contention", lambda threads: "torch runs 2 threads on 2 cores ...")
    with caplog.at_level(logging.WARNING, logger="lcx.threads"):
        for _ in range(2):
            Engine(tiny_model("llama", seed=1), byte_tokenizer(), EngineConfig(max_model_len=32))
    assert [r.message for r in caplog.records if r.name == "lcx.threads"] == ["torch runs 2 threads on 2 cores ..."]
    caplog.clear()
    monkeypatch.setattr(th, "_warned", False)
    monkeypatch.setattr(th, "_resolved", True)  # lcx chose the threads (every lcx command does): quiet
    Engine(tiny_model("llama", seed=1), byte_tokenizer(), EngineConfig(max_model_len=32))
    assert not [r for r in caplog.records if r.name == "lcx.threads"]
