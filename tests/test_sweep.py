"""`lcx sweep` (`lcx.report.sweep`): sweep files (TOML, sweeps/) parsed and checked, the committed
real-model reports reproducible from theirs (same settings), and a small sweep run, resumed,
watched and rendered through the command line."""

from __future__ import annotations

from lcx.report.cells import journal_dir, running_path  # noqa: E402,F401 (#74: the cache, not the report folder)

import json
from pathlib import Path

import pytest

from lcx.report.sweep import Sweep, load_sweep

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = sorted((ROOT / "sweeps").glob("*.toml"))
# the committed real-model reports: each is written by one sweep file
REAL_MODEL_REPORTS = ("smollm2-135m-n16", "smollm2-135m-ruler", "smollm2-135m-ruler4k", "gemma3-270m",
                      "gemma3-270m-ruler", "gemma3-270m-ruler8k")
# sweeps whose report is still being measured (hours of CPU): their settings are checked once the report
# is committed; until then the check skips them, and only them
# sweeps whose report is not committed yet: #77 item 4 (16k: ~10 CPU hours; 32k ~17.5 and Gemma 48k ~5.8
# core-hours of prefill, from one prompt each measured first: results/dca_string_cost_32k_48k.json)
IN_PROGRESS = ("smollm2-135m-dca-string", "smollm2-135m-dca-string-32k", "gemma3-270m-dca-string")

TINY = """
description = "a tiny sweep"
out = "{out}"

[report]
model = "tiny-ret-5m"
methods = ["vanilla", "lm_infinite", "yarn"]
lengths = [383, 511]
decode_lengths = []
tasks = ["passkey", "ppl"]
depths = [0.5]
samples_per_depth = 1
ppl_docs = 1

[run]
threads = 1
first = [{{lengths = [511], methods = ["yarn"]}}, {{lengths = [511]}}]
"""


def test_every_committed_real_model_report_has_its_sweep_file():
    outs = {load_sweep(f).out.as_posix(): f.name for f in SWEEPS}
    assert {f"results/report/{r}" for r in REAL_MODEL_REPORTS} <= set(outs)


@pytest.mark.parametrize("path", SWEEPS, ids=[f.stem for f in SWEEPS])
def test_a_committed_report_has_its_sweep_files_settings(path):
    """The settings of the committed report (report.json.gz's config) are the file's: every field of
    the file's ReportConfig, and the task list the report records for them."""
    from lcx.data.io import read_json

    sweep = load_sweep(path)
    if path.stem in IN_PROGRESS and not (ROOT / sweep.out / "report.json.gz").exists():
        pytest.skip(f"{sweep.out}: no report yet (`lcx sweep run {path.relative_to(ROOT)}`)")
    record = read_json(ROOT / sweep.out / "report.json.gz")["config"]
    want = sweep.config.to_dict()
    tasks = want.pop("tasks", None)
    assert {k: record.get(k) for k in want} == json.loads(json.dumps(want))
    cfg = sweep.config
    assert record["tasks"] == (["passkey", "lcx_ppl"] if cfg.lmeval_lengths else []) + (
        list(cfg.ruler_tasks) if cfg.ruler_lengths else []) + (["passkey_primed"] if cfg.primed_lengths else [])
    assert tasks is None or set(tasks) == set(cfg.tasks)


@pytest.mark.parametrize("text, match", [
    ('out = "x"\n[report]\nmodel = "tiny-ret-5m"\nlenghts = [512]\n', "unknown key.*report.lenghts"),
    ('out = "x"\nreprot = 1\n[report]\n', "unknown key.*reprot"),
    ('[report]\nmodel = "tiny-ret-5m"\n', "missing `out`"),
    ('out = "x"\n[report]\nmethods = ["nope"]\n', r"\[report\]: unknown report method"),
    ('out = "x"\n[report]\n[run]\nthreads = 0\n', "run.threads must be an integer >= 1"),
    ('out = "x"\n[report]\n[run]\nkeep_other_code = "yes"\n', "keep_other_code must be true or false"),
    ('out = "x"\n[report]\n[run]\nfirst = [{length = [512]}]\n', r"unknown key.*run.first\[0\].length"),
    ('out = "x"\n[report\n', "not TOML"),
])
def test_a_bad_sweep_file_is_refused_naming_what_is_wrong(tmp_path, text, match):
    f = tmp_path / "s.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_sweep(f)


def test_first_puts_the_named_cells_first_in_the_files_order(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(TINY.format(out=tmp_path / "r"))
    sweep = load_sweep(f)
    cells = [(n, "lmeval", L) for L in (383, 511) for n in ("vanilla", "lm_infinite", "yarn")]
    assert sorted(cells, key=sweep.order) == [("yarn", "lmeval", 511), ("vanilla", "lmeval", 511),
                                              ("lm_infinite", "lmeval", 511), ("vanilla", "lmeval", 383),
                                              ("lm_infinite", "lmeval", 383), ("yarn", "lmeval", 383)]
    assert isinstance(sweep, Sweep) and sweep.config.depths == (0.5,) and sweep.threads == 1


@pytest.mark.slow
def test_a_sweep_runs_resumes_reports_its_status_and_renders(tmp_path, capsys):
    """`lcx sweep run` measures the 6 cells (the `first` ones first), `status` then counts 6 done
    and no time left, a second `run` measures nothing, `render` writes the README; before the
    run, `status` lists every cell to do."""
    from lcx.cli import main
    from lcx.report.cells import read_cells

    f = tmp_path / "s.toml"
    out = tmp_path / "r"
    f.write_text(TINY.format(out=out))
    assert main(["sweep", "status", str(f), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["counts"] == {"done": 0, "running": 0, "todo": 6} and st["cells_without_estimate"] == 6
    capsys.readouterr()
    assert main(["sweep", "run", str(f), "--no-progress"]) == 0
    measured = [line.split(":")[0].strip() for line in capsys.readouterr().out.splitlines() if " @ " in line]
    assert measured == ["yarn @ 511", "vanilla @ 511", "lm_infinite @ 511", "vanilla @ 383", "lm_infinite @ 383",
                        "yarn @ 383"]
    stored = read_cells(out)
    assert len(stored) == 6 and all(c["result"]["passkey_docs"] == 1 for c in stored.values())
    assert not running_path(out).exists()  # nothing in flight once it ended
    capsys.readouterr()
    assert main(["sweep", "status", str(f), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["counts"] == {"done": 6, "running": 0, "todo": 0} and st["estimated_left_s"] == 0
    assert st["done_s"] > 0
    assert main(["sweep", "run", str(f), "--no-progress"]) == 0
    assert "kept 6 of 6 cells" in capsys.readouterr().out
    (out / "README.md").unlink()
    assert main(["sweep", "render", str(f)]) == 0 and (out / "README.md").exists()


def test_status_counts_a_running_cells_answers_from_its_journal(tmp_path, capsys):
    """running.json holds the answers a cell started with; `status` reads its journal, which grows
    with every answer (a cell resumed from none showed "0 answers" for hours)."""
    from sqlitedict import SqliteDict

    from lcx.cli import main

    f = tmp_path / "s.toml"
    out = tmp_path / "r"
    f.write_text(TINY.format(out=out))
    running_path(out).parent.mkdir(parents=True, exist_ok=True)
    running_path(out).write_text(json.dumps({"cells": {"yarn/lmeval/511": {
        "where": "vm pid 1", "answers": 0, "since": "2026-12-07T18:54:22"}}}))
    journal_dir(out).mkdir(parents=True, exist_ok=True)
    with SqliteDict(str(journal_dir(out) / "yarn.lmeval.511.0123456789ab_rank0.db"), autocommit=True) as db:
        for i in range(5):
            db[f"request {i}"] = f"answer {i}"
    assert main(["sweep", "status", str(f), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    running = [c for c in st["cells"] if c["state"] == "running"]
    assert [(c["cell"], c["answers"]) for c in running] == [("yarn/lmeval/511", 5)]
    assert main(["sweep", "status", str(f)]) == 0
    assert "(5 answers, since 2026-12-07T18:54:22)" in capsys.readouterr().out
