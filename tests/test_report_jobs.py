"""`lcx report --jobs N` (`lcx.report.jobs`): cells in worker processes, in the report's order,
timed cells alone, vanilla-equivalent RULER cells after vanilla's; the same numbers as one at a time."""

from __future__ import annotations

import json

import pytest

from lcx.report import ReportConfig, run_report
from lcx.report.jobs import run_cells


class _InProcessPool:
    """A pool whose `apply_async` runs the call at once in this process (its result is still
    collected by `run_cells` as a worker's would be): start order and concurrency are observable."""

    def __init__(self, jobs: int, threads: int):
        self.jobs, self.threads = jobs, threads
        self.terminated = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.terminated = True
        return False

    def apply_async(self, fn, kwds, callback, error_callback):
        try:
            r = fn(**kwds)
        except Exception as e:  # noqa: BLE001 - what a worker's failure looks like
            error_callback(e)
        else:
            callback(r)


def _schedule(items, jobs, *, exclusive=(), waits=None, fail=None):
    """Run `run_cells` over named items; -> (events, the pool): ("start"/"finish", item, running)."""
    waits = waits or {}
    events, running, pools = [], set(), []

    def prepare(it):
        running.add(it)
        events.append(("start", it, frozenset(running)))
        return {"item": it}

    def measure(item):
        if item == fail:
            raise ValueError("boom")
        return {"v": item}, 0.0

    def finish(it, result, dt):
        assert result == {"v": it}
        running.discard(it)
        events.append(("finish", it, frozenset(running)))

    def pool(j, t):
        pools.append(_InProcessPool(j, t))
        return pools[-1]

    run_cells(items, jobs=jobs, threads=1, key=lambda it: it, prepare=prepare, finish=finish,
              exclusive=lambda it: it in exclusive, waits_for=lambda it: waits.get(it), measure=measure, pool=pool)
    return events, pools[0]


def test_cells_start_in_order_up_to_jobs_at_once():
    events, pool = _schedule(["a", "b", "c", "d", "e"], jobs=2)
    starts = [e[1] for e in events if e[0] == "start"]
    assert starts == ["a", "b", "c", "d", "e"]
    assert max(len(e[2]) for e in events) == 2 and [e[1] for e in events if e[0] == "finish"] == starts
    assert pool.jobs == 2 and pool.terminated


def test_a_timed_cell_runs_alone_and_nothing_after_it_starts_before_it():
    events, _ = _schedule(["a", "b", "D", "c", "d"], jobs=3, exclusive={"D"})
    start_d = next(i for i, e in enumerate(events) if e[:2] == ("start", "D"))
    assert events[start_d][2] == {"D"}  # nothing else running when it starts
    assert events[start_d + 1][:2] == ("finish", "D")  # ... or while it runs
    assert all(e[1] in "ab" for e in events[:start_d])  # a and b finished before, c and d start after


def test_a_cell_that_may_take_vanillas_answers_waits_for_vanilla_and_others_pass_it():
    events, _ = _schedule(["vanilla", "dyn", "yarn", "sinks"], jobs=2, waits={"dyn": "vanilla", "sinks": "vanilla"})
    pos = {(e[0], e[1]): i for i, e in enumerate(events)}
    assert pos[("start", "dyn")] > pos[("finish", "vanilla")]
    assert pos[("start", "sinks")] > pos[("finish", "vanilla")]
    assert pos[("start", "yarn")] < pos[("finish", "vanilla")]  # yarn did not wait behind dyn


def test_a_failing_cell_stops_the_run_naming_the_cell_and_terminates_the_workers():
    with pytest.raises(RuntimeError, match="cell b failed in its worker.*boom"):
        _schedule(["a", "b", "c", "d"], jobs=2, fail="b")


def test_ruler_cells_wait_for_vanilla_only_where_its_answers_may_be_taken(monkeypatch):
    """`_vanilla_cell_first`: a method whose identity bound covers the cell's longest prompt waits
    for vanilla's cell when vanilla comes first; a method with no bound (YaRN), vanilla itself, or
    a cell before vanilla does not."""
    import importlib

    run_module = importlib.import_module("lcx.report.run")  # (lcx.report.run is also the CLI's function)

    cfg = ReportConfig(model="tiny-ret-5m", methods=("yarn", "dynamic", "vanilla", "lm_infinite", "sinks"),
                       lengths=(1024,), tasks=("ruler",), ruler_tasks=("niah_single_1",), ruler_samples=2)
    cfg, runs, _, context, _ = run_module.plan_runs(cfg)
    assert context == 256
    order = [(n, "ruler", 1024) for n in runs]
    longest = {"value": 200}
    monkeypatch.setattr(run_module, "longest_sequence", lambda *a, **k: longest["value"])
    first = {n: run_module._vanilla_cell_first(runs, cfg, order, (n, "ruler", 1024)) for n in runs}
    # dynamic comes before vanilla: a sequential run would not have vanilla's cell yet either
    assert first == {"yarn": None, "dynamic": None, "vanilla": None,
                     "lm_infinite": ("vanilla", "ruler", 1024), "sinks": ("vanilla", "ruler", 1024)}
    longest["value"] = 257  # beyond the windows of L0 = 256 keys: they would be measured in full
    assert all(run_module._vanilla_cell_first(runs, cfg, order, (n, "ruler", 1024)) is None for n in runs)


def _numbers(rec):
    """A record's results without its wall times (which a shared machine changes)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in {"wall_s", "prefill_s", "decode_s", "decode_cpu_s",
                                                                    "tokens_per_s", "threads"}}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip(json.loads(json.dumps(rec["results"])))


@pytest.mark.slow
def test_jobs_measure_the_same_cells_as_one_at_a_time(tiny_model_dir, tmp_path):
    """Two worker processes (spawned) measure the lm-eval cells of two methods, the decode cells
    run alone here: every number but the timings equals the sequential run's; the cells are written
    and a rerun with --reuse keeps all of them."""
    cfg = ReportConfig(model=str(tiny_model_dir), methods=("vanilla", "lm_infinite"), lengths=(384,),
                       depths=(0.25, 0.75), samples_per_depth=1, ppl_docs=1, decode_tokens=3)
    one = run_report(cfg, tmp_path / "one", progress=False, log=lambda s: None)
    two = run_report(cfg, tmp_path / "two", progress=False, jobs=2, job_threads=1, log=lambda s: None)
    assert two["cells_total"] == 4 and two["cells_reused"] == 0
    assert _numbers(two) == _numbers(one)
    assert all(d["threads"] == one["results"]["vanilla"]["decode"]["384"]["threads"]
               for r in two["results"].values() for d in r["decode"].values())
    from lcx.report.cells import read_cells

    assert len(read_cells(tmp_path / "two")) == 4
    again = run_report(cfg, tmp_path / "two", reuse=True, progress=False, jobs=2, log=lambda s: None)
    assert again["cells_reused"] == 4


def test_jobs_flag_is_checked_and_sets_each_jobs_threads(monkeypatch, tmp_path, capsys):
    """`--jobs 0` is refused with a named error (exit 2); with `--threads auto` each job gets
    cores // N threads, with a number that number."""
    import argparse

    from lcx.report import cli

    seen = {}
    monkeypatch.setattr(cli, "run_report", lambda cfg, out, **kw: seen.update(kw) or {"results": {}})
    monkeypatch.setattr(cli, "markdown", lambda rec: "")
    monkeypatch.setattr("lcx.threads.available_cores", lambda: 8)
    monkeypatch.setattr("lcx.threads.resolve_threads", lambda t, **k: 1)  # (auto would time the machine)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--jobs", "0", "--out", str(tmp_path)])) == 2
    assert "--jobs must be an integer >= 1 or 'auto'" in capsys.readouterr().err
    assert cli.run(p.parse_args(["--jobs", "many", "--out", str(tmp_path)])) == 2
    assert "got 'many'" in capsys.readouterr().err
    assert cli.run(p.parse_args(["--jobs", "3", "--threads", "1", "--out", str(tmp_path)])) == 0
    assert (seen["jobs"], seen["job_threads"]) == (3, 1)
    assert cli.run(p.parse_args(["--jobs", "3", "--out", str(tmp_path)])) == 0
    assert (seen["jobs"], seen["job_threads"]) == (3, 2)
    # the default, auto: a job per core as far as memory holds the cells (lcx.report.jobs.auto_jobs)
    monkeypatch.setattr("lcx.report.jobs.auto_jobs", lambda cfg: 4)
    assert cli.run(p.parse_args(["--out", str(tmp_path)])) == 0
    assert (seen["jobs"], seen["job_threads"]) == (4, 2)


def test_auto_jobs_by_cores_and_memory(monkeypatch):
    from lcx.report import jobs
    from lcx.report.config import ReportConfig

    monkeypatch.setattr("lcx.threads.available_cores", lambda: 8)
    monkeypatch.setattr("lcx.engine.memory.available_memory", lambda device: 64 << 30)
    assert jobs.auto_jobs(ReportConfig()) == 8  # tiny-ret-5m: a cell needs ~2 GiB
    monkeypatch.setattr("lcx.engine.memory.available_memory", lambda device: 5 << 30)
    assert 1 <= jobs.auto_jobs(ReportConfig()) < 8  # the memory bounds it
    monkeypatch.setattr("lcx.engine.memory.available_memory", lambda device: 1 << 20)
    assert jobs.auto_jobs(ReportConfig()) == 1
    assert jobs.auto_jobs(ReportConfig(device="cuda")) == 1  # the cells share the GPU
    monkeypatch.setattr("lcx.threads.available_cores", lambda: 1)
    monkeypatch.setattr("lcx.engine.memory.available_memory", lambda device: 64 << 30)
    assert jobs.auto_jobs(ReportConfig()) == 1
