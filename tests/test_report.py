"""`lcx report`: config validation, method resolution, and a small end-to-end run on a random
tiny model (through lm-eval and the engine for real) that is then resumed from its cells."""

from __future__ import annotations

from lcx.report.cells import cell_path, journal_dir, read_cells, read_run, remove_cell, running_path, write_run  # noqa: E402,F401 (#74: the cache, not the report folder)

import json
import random
from pathlib import Path

import pytest

from lcx.report import (
    DEFAULT_METHODS,
    run_settings,
    ReportConfig,
    cell_settings,
    code_fingerprint,
    load_cell,
    markdown,
    plan_run,
    read_cell,
    run_report,
)


def method_run(name, model, L0, factor):
    from lcx.presets import resolve

    return resolve(name, model, L0=L0, factor=factor)


def test_every_default_method_is_a_preset():
    from lcx.presets import PRESETS

    assert set(DEFAULT_METHODS) <= set(PRESETS)


@pytest.mark.parametrize("kwargs,match", [
    ({"methods": ("vanilla", "nope")}, r"unknown report method\(s\) \['nope'\]"),
    ({"methods": ()}, "at least one method"),
    ({"lengths": (8,)}, "lengths must be integers >= 16"),
    ({"depths": 0}, "depths must be an integer >= 1"),
    ({"depths": (0.5, 1.5)}, r"depths must be a grid size or fractions in \[0, 1\]"),
    ({"depths": ()}, r"depths must be a grid size or fractions"),
    ({"decode_tokens": 1}, "decode_tokens must be an integer >= 2"),
    ({"dtype": "int8"}, "dtype must be float32, bfloat16 or float16"),
    ({"device": "tpu"}, "device must be 'cpu' or 'cuda"),
    ({"attn_backend": "nope"}, "attn_backend 'nope' is not an lcx.attention backend"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReportConfig(**kwargs)


def test_methods_resolve_to_component_configs():
    runs = {n: method_run(n, "tiny-5m", 256, 8.0) for n in DEFAULT_METHODS}
    assert run_settings(runs["vanilla"], "tiny-5m") == {"rope": None, "attention": None, "model": None}
    assert run_settings(runs["yarn"], "tiny-5m")["rope"] == {"rope_type": "yarn", "factor": 8.0}
    assert run_settings(runs["lm_infinite"], "tiny-5m")["attention"] == {"type": "lm_infinite", "n_global": 10,
                                                                         "n_local": 256}
    both = runs["lm_infinite+yarn"]
    # LM-Infinite + YaRN: the `yarn` row's YaRN under LM-Infinite's window
    assert both.config.to_dict() == {"rope": {"rope_type": "yarn", "factor": 8.0},
                                     "attention": {"type": "lm_infinite", "n_global": 10, "n_local": 256}}
    assert both.config.to_flat() == {"rope_type": "yarn", "factor": 8.0, "attention": "lm_infinite",
                                     "n_global": 10, "n_local": 256}
    assert runs["swat"].model == "tiny-swat-5m" and run_settings(runs["swat"], "tiny-5m")["model"] == "tiny-swat-5m"
    assert "no swat model" in method_run("swat", "smollm2-135m", 8192, 2.0)
    # every resolved config is accepted by the components that run it, in their formats
    from lcx.engine import EngineConfig
    from lcx.lmeval_model import split_model_args

    for r in runs.values():
        for backend in (None, "flash"):
            c = r.config.with_default_backend(backend)
            assert EngineConfig(methods=c).methods == EngineConfig(methods=c.to_dict()).methods == c
            split_model_args(c.to_flat())
    assert both.config.with_default_backend("flash").to_dict()["backend"] == "flash"
    assert both.config.with_default_backend("flash").to_flat()["attn_backend"] == "flash"
    assert "backend" not in both.config.to_dict()  # the run's own config is not changed
    assert runs["yarn"].config.with_default_backend("flash").to_flat() == {"rope_type": "yarn", "factor": 8.0}


def test_depth_fractions_are_sorted_and_recorded():
    cfg = ReportConfig(depths=(0.9, 0.1, 0.37))
    assert cfg.depths == (0.1, 0.37, 0.9) and cfg.to_dict()["depths"] == [0.1, 0.37, 0.9]


FP = {"cell_version": 2, "code": {"lmeval": {"lcx.rope": "abc"}}, "models": {"m": "123"}, "environment": {"torch": "x"}}


def test_stored_cells_are_reused_only_with_equal_settings_fingerprint_and_run(tmp_path):
    cfg = ReportConfig(lengths=(64, 128)).resolved(64)
    s = cell_settings("lmeval", "m", "yarn", method_run("yarn", "m", 32, 2.0), cfg, 64)
    p = tmp_path / "c.json"
    cell = {"settings": s, "fingerprint": FP, "run_id": "r1", "result": {"x": 1}}
    p.write_text(json.dumps(cell))
    assert load_cell(p, s, FP) == cell
    assert load_cell(p, s, FP, "r1") == cell
    assert load_cell(p, s, FP, "r2") is None  # another run's cell
    assert load_cell(p, s, FP, {"r2", "r1"}) == cell
    assert load_cell(p, {**s, "depths": 7}, FP) is None
    assert load_cell(p, {**s, "length": 128}, FP) is None
    assert load_cell(p, s, {**FP, "environment": {"torch": "y"}}) is None
    assert load_cell(p, s, {**FP, "code": {"lmeval": {"lcx.rope": "abd"}}}) is None
    # a change to another measurement's code (e.g. the engine, for decode cells) keeps this cell
    assert load_cell(p, s, {**FP, "code": {**FP["code"], "decode": {"lcx.engine": "new"}}}) == cell
    p.write_text("{truncated")
    assert load_cell(p, s, FP) is None
    assert load_cell(tmp_path / "missing.json", s, FP) is None


def test_only_an_interrupted_run_with_equal_settings_resumes_and_keeps_cells_of_unchanged_code(tmp_path):
    cfg = ReportConfig(lengths=(64, 128)).resolved(64)
    (tmp_path / "cells").mkdir()
    run_json = tmp_path / "cells" / "run.json"

    def plan(**kw):
        return plan_run(tmp_path, cfg, FP, fresh=kw.get("fresh", False), reuse=kw.get("reuse", False))

    rid, keep, why = plan()
    assert keep == set() and "no earlier run" in why
    run_json.write_text(json.dumps({"run_id": "r1", "finished": False, "config": cfg.to_dict(), "fingerprint": FP,
                                    "kept_runs": ["r0"]}))
    rid, keep, why = plan()
    assert (rid, keep) == ("r1", {"r1", "r0"}) and "resuming" in why
    assert plan(fresh=True)[1] == set()
    run_json.write_text(json.dumps({"run_id": "r1", "finished": False, "config": cfg.to_dict(),
                                    "fingerprint": {**FP, "code": {"lmeval": {"lcx.rope": "zzz"}}}}))
    rid, keep, why = plan()  # resumed under a new id; load_cell re-measures the lmeval cells
    assert rid != "r1" and keep == {"r1"} and "code.lmeval.lcx.rope" in why and "lmeval cells" in why
    run_json.write_text(json.dumps({"run_id": "r1", "finished": False, "config": cfg.to_dict(),
                                    "fingerprint": {**FP, "models": {"m": "456"}}}))
    rid, keep, why = plan()
    assert rid != "r1" and keep == set() and "models.m" in why
    run_json.write_text(json.dumps({"run_id": "r1", "finished": False, "config": {**cfg.to_dict(), "seed": 1},
                                    "fingerprint": FP}))
    assert "other settings (seed)" in plan()[2]
    run_json.write_text(json.dumps({"run_id": "r1", "finished": True, "config": cfg.to_dict(), "fingerprint": FP}))
    rid, keep, why = plan()
    assert rid != "r1" and keep == set() and "finished" in why
    assert plan(reuse=True)[1] is None  # any matching cell


def test_code_fingerprint_follows_the_source(tmp_path, monkeypatch):
    import lcx.report as report

    fp = code_fingerprint("lmeval")
    assert set(fp) == set(report.NUMERICS_MODULES["lmeval"]) and all(len(v) == 12 for v in fp.values())
    assert fp == code_fingerprint("lmeval")
    assert "lcx.engine" in code_fingerprint("decode") and "lcx.engine" not in fp
    pkg = tmp_path / "fpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "sub.py").write_text("y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(report.NUMERICS_MODULES, "lmeval", ("fpkg",))
    a = code_fingerprint("lmeval")
    (pkg / "sub.py").write_text("y = 3\n")
    assert code_fingerprint("lmeval") != a


@pytest.mark.slow
def test_report_end_to_end_and_resume(tiny_model_dir, tmp_path):
    """Two methods on a random tiny model: numbers exist and are finite, the files are written;
    a finished run is measured again, an interrupted one resumes with its cells, --reuse keeps
    matching cells, --render measures nothing."""
    cap = {"attention": {"type": "lm_infinite", "n_global": 10, "n_local": 128, "limit_distance": 64}}
    cfg = ReportConfig(model=str(tiny_model_dir), methods=("vanilla", "lm_infinite", "swat"), lengths=(320, 384),
                       depths=(0.25, 0.75), samples_per_depth=1, ppl_docs=1, decode_tokens=3,
                       custom_methods={"lmi_cap": cap})
    lines: list[str] = []
    rec = run_report(cfg, tmp_path, progress=False, log=lines.append)
    assert "swat" in rec["config"]["methods_skipped"] and any("skipping swat" in x for x in lines)
    assert rec["config"]["lengths"] == [320, 384] and rec["cells_reused"] == 0 and rec["cells_total"] == 12
    # a custom method runs on the report's model after the presets, with its config as given
    assert list(rec["results"]) == ["vanilla", "lm_infinite", "lmi_cap"]
    assert rec["config"]["methods_resolved"]["lmi_cap"] == {"rope": None, "attention": cap["attention"], "model": None}
    assert rec["results"]["lmi_cap"]["lmeval"]["384"]["ppl"] != rec["results"]["lm_infinite"]["lmeval"]["384"]["ppl"]
    assert "lmi_cap.lmeval.384" in read_cells(tmp_path)  # (the folder's cell store)
    cfg = ReportConfig(model=str(tiny_model_dir), methods=("vanilla", "lm_infinite", "swat"), lengths=(320, 384),
                       depths=(0.25, 0.75), samples_per_depth=1, ppl_docs=1, decode_tokens=3)
    for stem in read_cells(tmp_path):
        if stem.startswith("lmi_cap."):
            assert remove_cell(tmp_path / "cells" / stem)
    rec = run_report(cfg, tmp_path, progress=False, log=lines.append)
    assert rec["cells_total"] == 8
    for name in ("vanilla", "lm_infinite"):
        r = rec["results"][name]
        assert set(r["lmeval"]) == {"320", "384"} and set(r["decode"]) == {"320", "384"}
        assert all(c["ppl"]["word_perplexity"] > 1 and c["passkey_docs"] == 2 for c in r["lmeval"].values())
        assert all(set(c["passkey_by_depth"]) == {"0.250", "0.750"} for c in r["lmeval"].values())
        from lcx.eval_tasks.common import first_int  # each sample keeps the whole generation it was scored on

        for c in r["lmeval"].values():
            for smp in c["passkey_samples"]:
                assert isinstance(smp["output"], str) and smp["correct"] == float(first_int(smp["output"]) == smp["key"])
        assert all(d["decode_steps"] == 2 and d["kv_cache_mb"] > 0 for d in r["decode"].values())
    # LM-Infinite keeps n_global 10 + n_local 128 - 1 = 137 < 384 keys; vanilla keeps all
    by = {n: rec["results"][n]["decode"] for n in ("vanilla", "lm_infinite")}
    assert by["lm_infinite"]["384"]["kv_cache_mb"] < 0.5 * by["vanilla"]["384"]["kv_cache_mb"]
    for f in ("report.json.gz", "README.md", "index.html", "passkey_heatmap.png", "ppl_by_length.png", "decode_by_length.png"):
        assert (tmp_path / f).stat().st_size > 0
    assert markdown(rec).startswith("# lcx report") and "Partial" not in markdown(rec)

    # a finished run is not replayed: measured again
    again = run_report(cfg, tmp_path, progress=False, log=lines.append)
    assert again["cells_reused"] == 0 and any("finished: every cell is measured again" in x for x in lines)
    # ... unless --reuse; numbers then identical
    kept = run_report(cfg, tmp_path, reuse=True, progress=False, log=lines.append)
    assert kept["cells_reused"] == 8 and kept["results"] == json.loads(json.dumps(again["results"]))
    # an interrupted run (its manifest unfinished) resumes with its own cells and those it kept
    state = read_run(tmp_path)
    write_run(tmp_path, {**state, "finished": False})
    assert remove_cell(cell_path(tmp_path, "lm_infinite", "decode", 384))
    resumed = run_report(cfg, tmp_path, progress=False, log=lines.append)
    assert resumed["cells_reused"] == 7 and resumed["run_id"] == state["run_id"]
    # --render measures nothing; a missing cell shows as a gap, the report says it is partial
    assert remove_cell(cell_path(tmp_path, "vanilla", "lmeval", 384))
    rendered = run_report(cfg, tmp_path, render=True, progress=False, log=lines.append)
    assert rendered["cells_reused"] == 7 and "384" not in rendered["results"]["vanilla"]["lmeval"]
    assert "Partial: 7 of 8 cells" in markdown(rendered)
    # a cell measured by other code: not kept by default; kept and listed with --keep-other-code
    p = cell_path(tmp_path, "vanilla", "decode", 384)
    d = read_cell(p)
    d["fingerprint"]["code"]["decode"]["lcx.engine"] = "0" * 12
    # written as an earlier version wrote cells (a plain JSON file of its own): still read
    assert remove_cell(p)
    (tmp_path / "cells" / "vanilla.decode.384.json").write_text(json.dumps(d))
    assert run_report(cfg, tmp_path, render=True, progress=False, log=lines.append)["cells_reused"] == 6
    other = run_report(cfg, tmp_path, render=True, keep_other_code=True, progress=False, log=lines.append)
    assert other["cells_reused"] == 7 and list(other["cells_kept_with_other_code"]) == ["vanilla/decode/384"]
    assert other["cells_kept_with_other_code"]["vanilla/decode/384"]["modules"] == ["lcx.engine"]
    note = "Kept with `--keep-other-code`: 1 cell(s) measured by lcx code that differs from this checkout's in `lcx.engine`"
    assert note in markdown(other) and any(note in x for x in lines)


def test_keep_other_code_keeps_cells_whose_only_difference_is_code(tmp_path):
    cfg = ReportConfig(lengths=(64, 128)).resolved(64)
    s = cell_settings("lmeval", "m", "yarn", method_run("yarn", "m", 32, 2.0), cfg, 64)
    p = tmp_path / "c.json"
    cell = {"settings": s, "fingerprint": FP, "run_id": "r1", "result": {"x": 1}}
    p.write_text(json.dumps(cell))
    new_code = {**FP, "code": {"lmeval": {"lcx.rope": "abd"}}}
    assert load_cell(p, s, new_code) is None
    assert load_cell(p, s, new_code, other_code=True) == cell
    # models, environment and settings must still match
    assert load_cell(p, s, {**new_code, "environment": {"torch": "y"}}, other_code=True) is None
    assert load_cell(p, s, {**new_code, "models": {"m": "9"}}, other_code=True) is None
    assert load_cell(p, {**s, "length": 128}, new_code, other_code=True) is None


@pytest.mark.parametrize("kwargs,match", [
    ({"custom_methods": {"yarn": {"rope": {"rope_type": "yarn", "factor": 2}}}}, "is a preset's"),
    ({"custom_methods": {"lm_infinite_plus_yarn": {}}}, "is a preset's"),  # its cell files would collide
    ({"custom_methods": {"a/b": {}}}, "custom method name 'a/b'"),
    ({"custom_methods": {"x": {"attention": {"type": "lm_infinite", "n_glob": 1}}}}, "custom method 'x': .*n_glob"),
    ({"custom_methods": {"x": {"rope": {"rope_type": "nope"}}}}, "custom method 'x'"),
    ({"methods": (), "custom_methods": {}}, "at least one method"),
])
def test_custom_method_errors_name_the_method(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReportConfig(**kwargs)


def test_custom_methods_from_the_command_line():
    """`--method NAME=CONFIG` takes JSON or lm-eval's flat form, stores the canonical nested dict,
    and runs after the presets; `--presets none` runs only custom methods; a finished config's
    to_dict leaves the field out when empty (older interrupted runs still resume)."""
    import argparse

    from lcx.report.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--presets", "vanilla", "--method",
                      'cap={"attention": {"type": "lm_infinite", "n_global": 10, "n_local": 64, "limit_distance": 16}}',
                      "--method", "y4=rope_type=yarn,factor=4"])
    from lcx.report.cli import _custom_methods

    custom = _custom_methods(a.method)
    assert custom == {"cap": {"attention": {"type": "lm_infinite", "n_global": 10, "n_local": 64, "limit_distance": 16}},
                      "y4": {"rope": {"rope_type": "yarn", "factor": 4}}}
    cfg = ReportConfig(methods=("vanilla",), custom_methods=custom)
    assert cfg.methods == ("vanilla",) and list(cfg.custom_methods) == ["cap", "y4"]  # order kept
    assert cfg.to_dict()["custom_methods"] == custom
    assert "custom_methods" not in ReportConfig().to_dict()
    for bad in ("cap", "cap=", 'cap={"attention": 1', "cap=attention=nope"):
        with pytest.raises(SystemExit):
            p.parse_args(["--method", bad])
    with pytest.raises(ValueError, match="given twice"):
        _custom_methods([("a", {}), ("a", {})])
    assert p.parse_args(["--presets", "none", "--method", "v={}"]).presets == "none"


def test_ppl_max_length_limits_perplexity_to_the_shorter_cells():
    """Gemma 3's tokenizer makes no held-out work 48k tokens long: cells beyond --ppl-max-length
    measure passkey alone, and the windows are cut at the longest perplexity length."""
    run = method_run("yarn", "m", 32, 2.0)
    plain = ReportConfig(lengths=(64, 128)).resolved(64)
    assert plain.ppl_lengths == (64, 128) and plain.ppl_window == 128 and "ppl_max_length" not in plain.to_dict()
    # unchanged settings without the option: committed cells stay reusable
    assert cell_settings("lmeval", "m", "yarn", run, plain, 64)["window_tokens"] == 128
    cfg = ReportConfig(lengths=(64, 128, 256), ppl_max_length=128).resolved(64)
    assert cfg.ppl_lengths == (64, 128) and cfg.ppl_window == 128 and cfg.to_dict()["ppl_max_length"] == 128
    s64, s256 = (cell_settings("lmeval", "m", "yarn", run, cfg, L) for L in (64, 256))
    assert (s64["window_tokens"], s64["ppl_docs"]) == (128, cfg.ppl_docs)
    assert (s256["window_tokens"], s256["ppl_docs"]) == (None, 0)
    with pytest.raises(ValueError, match="ppl_max_length"):
        ReportConfig(ppl_max_length=8)


def test_report_runs_cells_beyond_ppl_max_length(tiny_model_dir, tmp_path):
    """A run with --ppl-max-length measures, logs and renders a cell beyond it (passkey alone):
    the Gemma 3 sweep died logging its first 32k cell before this was tested."""
    cfg = ReportConfig(model=str(tiny_model_dir), methods=("vanilla",), lengths=(320, 384), decode_lengths=(),
                       depths=(0.5,), samples_per_depth=1, ppl_docs=1, ppl_max_length=320)
    lines: list[str] = []
    rec = run_report(cfg, tmp_path, progress=False, log=lines.append)
    cells = rec["results"]["vanilla"]["lmeval"]
    assert "ppl" in cells["320"] and "ppl" not in cells["384"] and cells["384"]["passkey_docs"] == 1
    assert (tmp_path / "README.md").exists()
    assert run_report(cfg, tmp_path, render=True, progress=False, log=lines.append)["cells_reused"] == 2


def _kill_at_the_third_answer(monkeypatch) -> list[int]:
    """Make lm-eval's HFLM.generate_until raise at its third call (a run killed mid-cell); returns
    the calls' request counts."""
    from lm_eval.models.huggingface import HFLM

    real, calls = HFLM.generate_until, []

    def dies_at_the_third(self, requests, disable_tqdm=False):
        calls.append(len(requests))
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(self, requests, disable_tqdm=disable_tqdm)

    monkeypatch.setattr(HFLM, "generate_until", dies_at_the_third)
    return calls


def test_a_cell_killed_half_way_resumes_from_its_journal(tiny_model_dir, tmp_path, monkeypatch):
    """Every answer of an lm-eval cell is journaled as it is given (`lcx.report.lm.evaluate`): a
    run killed mid-cell resumes that cell from its last answer, with the answers an uninterrupted
    run gives; the journal is deleted once the cell is written, and a journal kept under other
    settings is never read back (it is deleted)."""
    from lm_eval.models.huggingface import HFLM

    from lcx.report.lm import journal_count, journal_db
    from lcx.report.run import cell_journal

    import lcx.report.lm

    # one prompt at a time, so the kill lands between answers (batched generation journals per
    # chunk of requests: tests/eval_tasks/test_lmeval_reuse.py)
    monkeypatch.setattr(lcx.report.lm, "generation_batch", lambda *a, **k: 1)
    cfg = ReportConfig(model=str(tiny_model_dir), methods=("vanilla",), lengths=(320,), decode_lengths=(),
                       depths=(0.2, 0.5, 0.8), samples_per_depth=1, ppl_docs=1)
    want = run_report(cfg, tmp_path / "whole", progress=False, log=lambda _: None)["results"]["vanilla"]["lmeval"]["320"]
    assert "resumed_requests" not in want and not list(journal_dir(tmp_path / "whole").glob("*"))

    real = HFLM.generate_until
    calls = _kill_at_the_third_answer(monkeypatch)
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        run_report(cfg, out, progress=False, log=lambda _: None)
    assert calls == [1, 1, 1]  # one prompt at a time, in reuse order
    journals = list(journal_dir(out).glob("*_rank0.db"))
    assert len(journals) == 1 and journal_count(str(journals[0]).removesuffix("_rank0.db")) == 2
    monkeypatch.setattr(HFLM, "generate_until", real)
    got = run_report(cfg, out, progress=False, log=lambda _: None)["results"]["vanilla"]["lmeval"]["320"]
    assert got.pop("resumed_requests") == 2
    for key in ("passkey", "passkey_samples", "ppl"):
        assert got[key] == want[key]
    assert not list(journal_dir(out).glob("*"))
    # --fresh recomputes every answer: a journal left by an interrupted run is discarded
    _kill_at_the_third_answer(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run_report(cfg, out, fresh=True, progress=False, log=lambda _: None)
    monkeypatch.setattr(HFLM, "generate_until", real)
    fresh = run_report(cfg, out, fresh=True, progress=False, log=lambda _: None)["results"]["vanilla"]["lmeval"]["320"]
    assert "resumed_requests" not in fresh and fresh["passkey_samples"] == want["passkey_samples"]
    # another cell's settings name another journal; the stale one is deleted, not read
    settings = {"kind": "lmeval", "depths": [0.5]}
    a = cell_journal(out, "vanilla", "lmeval", 320, settings, {})
    journal_db(a).write_bytes(b"")
    b = cell_journal(out, "vanilla", "lmeval", 320, {**settings, "depths": [0.25]}, {})
    assert a != b and not journal_db(a).exists() and not Path(f"{a}.key.json").exists()
    # ... and what a stale journal with answers held is said, with what differs and its commit
    from sqlitedict import SqliteDict

    with SqliteDict(str(journal_db(b)), autocommit=True) as db:
        db["q1"], db["q2"] = "a1", "a2"
    key = json.loads(Path(f"{b}.key.json").read_text())
    assert key["settings"] == {**settings, "depths": [0.25]} and "sha" in key["git"]
    said: list[str] = []
    c = cell_journal(out, "vanilla", "lmeval", 320, settings, {"code": {"lmeval": {"lcx.rope": "x"}}}, log=said.append)
    assert not journal_db(b).exists() and len(said) == 1, said
    assert "2 answers" in said[0] and "settings.depths" in said[0] and "fingerprint.code" in said[0], said
    assert f"git {(key['git']['sha'] or '?')[:12]}" in said[0]
    said.clear()  # an empty stale journal goes without a word
    cell_journal(out, "vanilla", "lmeval", 320, settings, {}, log=said.append)
    assert said == [] and not journal_db(c).exists()


def test_every_journaled_cell_kind_takes_a_journal():
    import inspect

    from lcx.report.measure import CELL_RUNNERS
    from lcx.report.run import JOURNALED

    for kind in JOURNALED:
        assert "journal" in inspect.signature(CELL_RUNNERS[kind]).parameters, kind


@pytest.mark.slow
def test_a_ruler_cell_resumes_from_its_journal(tmp_path, monkeypatch):
    """The same for a RULER cell (tiny-ret-5m, one task, 3 prompts): killed at its third answer,
    resumed with the first two from the journal, the same prompts and answers as an uninterrupted
    run, whatever drew from Python's global generator before (`seed_as_lm_eval`)."""
    from lm_eval.models.huggingface import HFLM

    import lcx.report.lm

    monkeypatch.setattr(lcx.report.lm, "generation_batch", lambda *a, **k: 1)  # (as above: one prompt at a time)
    cfg = ReportConfig(model="tiny-ret-5m", methods=("vanilla",), lengths=(1024,), tasks=("ruler",),
                       ruler_tasks=("niah_single_1",), ruler_samples=3)
    want = run_report(cfg, tmp_path / "whole", progress=False, log=lambda _: None)["results"]["vanilla"]["ruler"]["1024"]
    real = HFLM.generate_until
    _kill_at_the_third_answer(monkeypatch)
    random.seed(99)  # RULER draws its needles from the global `random`: a cell seeds it itself
    with pytest.raises(KeyboardInterrupt):
        run_report(cfg, tmp_path / "killed", progress=False, log=lambda _: None)
    monkeypatch.setattr(HFLM, "generate_until", real)
    got = run_report(cfg, tmp_path / "killed", progress=False, log=lambda _: None)["results"]["vanilla"]["ruler"]["1024"]
    assert got.pop("resumed_requests") == 2 and got["tasks"] == want["tasks"]


def test_journals_and_running_state_live_in_the_cache_not_the_report(tmp_path, monkeypatch):
    """#74: a report folder holds finished cells only; journals and `running.json` live in lcx's
    cache, one state folder per report folder (by its absolute path)."""
    from lcx.report.cells import state_dir

    monkeypatch.setenv("LCX_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "results" / "report", tmp_path / "other" / "report"
    assert journal_dir(a).is_relative_to(tmp_path / "cache") and not journal_dir(a).is_relative_to(a)
    assert running_path(a).parent == journal_dir(a).parent == state_dir(a)
    assert state_dir(a) != state_dir(b) and state_dir(a).name.startswith("report-")
    assert state_dir(tmp_path / "results" / ".." / "results" / "report") == state_dir(a)
