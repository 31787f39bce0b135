"""`studies/ruler_budget.py`: a RULER cell's answers re-scored from rebuilt prompts reproduce the
stored scores, and the scores of answers cut to a budget change monotonically to none at the
task's own budget."""

from __future__ import annotations

import json

import pytest

from lcx.report import ReportConfig, run_report
from studies.ruler_budget import main, rescore


@pytest.mark.slow
def test_rescored_cells_reproduce_their_scores(tmp_path, capsys):
    cfg = ReportConfig(model="tiny-ret-5m", methods=("vanilla", "yarn"), lengths=(1024,), tasks=("ruler",),
                       ruler_tasks=("niah_single_1", "niah_multivalue_pd"), ruler_samples=3)
    run_report(cfg, tmp_path, progress=False, log=lambda _: None)
    rec = rescore(tmp_path, [4, 16, 128])
    assert rec["cells"] == 2 and len(rec["rows"]) == 4
    for row in rec["rows"]:
        assert row["n"] == 3 and row["rescored_equal"] == 3  # the rebuilt prompts are the cell's
        changed = [row["changed"][b] for b in ("4", "16", "128")]
        assert changed == sorted(changed, reverse=True) and changed[-1] == 0  # 128: the task's own budget
    assert rec["per_task"]["niah_single_1"]["task_budget"] == 128
    assert main(["--report", str(tmp_path), "--budgets", "8", "--out", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["summary"]["8"]["prompts"] == 12
