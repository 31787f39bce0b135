"""`lcx report`'s RULER part: which lengths get RULER cells, the config it records (earlier
reports unchanged), per-task Wilson intervals, the headline (mean over tasks), paired tests per
task and for the headline, the README section and the heatmap, from hand-made cells."""

from __future__ import annotations

import pytest

from lcx.report import ReportConfig
from lcx.report.config import LMEVAL_TASKS, RULER_MIN_LENGTH, RULER_TASKS, TASKS
from lcx.report.ruler import markdown_section, plot_heatmap, ruler_intervals, ruler_paired

LENGTHS = (256, 512, 1024, 2048)
N = 4  # prompts per task


def test_ruler_runs_only_at_lengths_that_fit_its_scaffold():
    cfg = ReportConfig(lengths=LENGTHS).resolved(256)
    assert cfg.tasks == TASKS and cfg.ruler_lengths == tuple(L for L in LENGTHS if L >= RULER_MIN_LENGTH) == (1024, 2048)
    assert cfg.cell_lengths("lmeval") == LENGTHS and cfg.cell_lengths("decode") == LENGTHS
    only = ReportConfig(lengths=LENGTHS, tasks=("ruler",)).resolved(256)
    assert only.cell_lengths("lmeval") == () and only.cell_lengths("ruler") == (1024, 2048)
    assert ReportConfig(lengths=(256, 512)).resolved(256).ruler_lengths == ()


def test_tasks_are_checked_by_name():
    with pytest.raises(ValueError, match="subset of"):
        ReportConfig(tasks=("passkey", "ppl", "qa"))
    with pytest.raises(ValueError, match="passkey and ppl are measured together"):
        ReportConfig(tasks=("passkey",))
    with pytest.raises(ValueError, match="ruler_samples"):
        ReportConfig(ruler_samples=0)


def test_a_report_without_ruler_records_the_config_as_before():
    """Committed reports (passkey + ppl) resume and render as they did: no new config keys."""
    old = ReportConfig(tasks=LMEVAL_TASKS).to_dict()
    assert "tasks" not in old and "ruler_samples" not in old
    assert ReportConfig().to_dict()["tasks"] == list(TASKS) and ReportConfig().to_dict()["ruler_samples"] == 10


def _cell(correct_by_task: dict[str, list[bool]], skipped: dict[str, str] | None = None) -> dict:
    tasks = {t: {"samples": [{"index": i, "score": float(c), "correct": c, "prompt_tokens": 900, "output": "x"}
                             for i, c in enumerate(cs)]} for t, cs in correct_by_task.items()}
    tasks.update({t: {"skipped": why} for t, why in (skipped or {}).items()})
    return {"tasks": tasks}


T1, T2, CWE = RULER_TASKS[0], RULER_TASKS[1], "ruler_cwe"
RECORD = {
    "config": {"model": "m", "context": 256, "lengths": list(LENGTHS), "ruler_lengths": [1024, 2048], "ruler_samples": N},
    "results": {
        "vanilla": {"lmeval": {}, "ruler": {"1024": _cell({T1: [True, True, False, False], T2: [False] * N},
                                                          {CWE: "no room"})}},
        "yarn": {"lmeval": {}, "ruler": {"1024": _cell({T1: [True] * N, T2: [True, True, True, False]},
                                                       {CWE: "no room"})}},
    },
}


def test_intervals_per_task_and_the_headline_mean_over_tasks():
    iv = ruler_intervals(RECORD)
    v, y = iv["vanilla"]["1024"], iv["yarn"]["1024"]
    assert (v["tasks"][T1]["k"], v["tasks"][T1]["n"]) == (2, N) and v["tasks"][T2]["k"] == 0
    assert v["skipped"] == {CWE: "no room"} and CWE not in v["tasks"]
    assert v["headline"]["acc"] == pytest.approx((2 / 4 + 0 / 4) / 2) and v["headline"]["tasks"] == 2
    assert (v["headline"]["k"], v["headline"]["n"]) == (2, 2 * N)
    assert y["headline"]["acc"] == pytest.approx((1 + 3 / 4) / 2)
    for e in (v, y):
        h = e["headline"]
        assert 0 <= h["lo"] <= h["k"] / h["n"] <= h["hi"] <= 1


def test_paired_tests_per_task_and_for_the_headline():
    p = ruler_paired(RECORD)["1024"]
    (head,) = p["headline"]
    assert (head["a"], head["b"]) == ("vanilla", "yarn")
    # pooled over (task, index): vanilla only 0, yarn only 5 (2 in T1, 3 in T2)
    assert (head["x_only"], head["y_only"]) == (0, 5) and head["diff"] == pytest.approx(-5 / 8)
    (t2,) = p[T2]
    assert (t2["x_only"], t2["y_only"]) == (0, 3)
    assert CWE not in p


def test_markdown_section_and_heatmap(tmp_path):
    text = "\n".join(markdown_section(RECORD))
    assert "## RULER" in text and "| yarn | 0.88 [" in text and "n=8 | — |" in text
    assert f"`{CWE}` (no room)" in text
    assert "| yarn | 4/4 (+0.50, 2:0, p=0.500) | 3/4 (+0.75, 3:0, p=0.250) | 0.88 (+0.62, 5:0, p=0.062) |" in text
    plot_heatmap({**RECORD, "ruler_intervals": ruler_intervals(RECORD)}, tmp_path)
    assert (tmp_path / "ruler_heatmap.png").stat().st_size > 0


def test_headline_picture_puts_ruler_beside_passkey(tmp_path):
    """headline.png (the README's first picture): RULER's headline by length beside passkey where the
    report has both, RULER alone in a RULER-only report; a method with no RULER cell yet is left out."""
    from lcx.report.render import plot_headline

    only = {**RECORD, "config": {**RECORD["config"], "tasks": ["ruler"]}}
    assert plot_headline(only, tmp_path) == ["RULER"] and (tmp_path / "headline.png").stat().st_size > 0
    both = {**RECORD, "config": {**RECORD["config"], "tasks": list(TASKS)}}
    (tmp_path / "headline.png").unlink()
    assert plot_headline(both, tmp_path / "") == ["passkey", "RULER"]
    assert (tmp_path / "headline.png").stat().st_size > 0


def test_ruler_tasks_subset_is_checked_recorded_and_rendered(tmp_path):
    """`--ruler-tasks`: a subset of RULER_TASKS (named errors otherwise), kept in RULER_TASKS' order,
    in the RULER cells' settings and the run's config only when it is not all of them (so the
    committed RULER cells still match), and the README section and heatmap show just those tasks."""
    from lcx.presets import PresetRun
    from lcx.method_config import MethodConfig
    from lcx.report.cells import cell_settings

    with pytest.raises(ValueError, match="ruler_tasks must be a non-empty subset"):
        ReportConfig(ruler_tasks=("niah_single_1", "qa_squad"))
    with pytest.raises(ValueError, match="ruler_tasks"):
        ReportConfig(ruler_tasks=())
    sub = ReportConfig(lengths=LENGTHS, ruler_tasks=(T2, T1)).resolved(256)
    assert sub.ruler_tasks == (T1, T2) and sub.to_dict()["ruler_tasks"] == [T1, T2]
    full = ReportConfig(lengths=LENGTHS).resolved(256)
    assert "ruler_tasks" not in full.to_dict()
    run = PresetRun("vanilla", "tiny-ret-5m", MethodConfig())
    assert cell_settings("ruler", "tiny-ret-5m", "vanilla", run, full, 1024)["tasks"] == list(RULER_TASKS)
    assert cell_settings("ruler", "tiny-ret-5m", "vanilla", run, sub, 1024)["tasks"] == [T1, T2]
    rec = {**RECORD, "config": {**RECORD["config"], "ruler_tasks": [T1, T2]}}
    text = "\n".join(markdown_section(rec))
    assert "2 tasks" in text and "--ruler-tasks" in text
    plot_heatmap({**rec, "ruler_intervals": ruler_intervals(rec)}, tmp_path)
    assert (tmp_path / "ruler_heatmap.png").stat().st_size > 0


@pytest.mark.slow
def test_ruler_prompts_do_not_depend_on_what_ran_before():
    """RULER's generators draw from Python's global `random` when a task is built; a cell's
    prompts are seeded just before (`seed_as_lm_eval`), so they are the same whatever drew from
    it earlier in the process (before the fix, the first RULER cell of a process got others)."""
    import random

    from lcx.report.ruler import load_ruler_tasks

    def prompts():
        task = load_ruler_tasks("tiny-ret-5m", 1024, ["niah_single_1"])[2]["niah_single_1"]
        return [d["input"] for d in list(task.eval_docs)[:5]]

    first = prompts()
    random.seed(12345)
    random.random()
    assert prompts() == first


def test_equivalent_check_option_is_checked_and_recorded_only_when_set():
    with pytest.raises(ValueError, match="ruler_equivalent_check"):
        ReportConfig(ruler_equivalent_check=0)
    assert "ruler_equivalent_check" not in ReportConfig().to_dict()  # the default: records as before
    assert ReportConfig(ruler_equivalent_check=None).to_dict()["ruler_equivalent_check"] is None
    from lcx.report.cli import _count

    assert _count("--equivalent-check", "3") == 3
    for bad in ("0", "-3", "x", ""):
        with pytest.raises(ValueError, match="--equivalent-check must be an integer >= 1 or 'all'"):
            _count("--equivalent-check", bad)


def test_cells_taken_from_vanilla_are_named_in_the_readme():
    taken = {**RECORD["results"]["vanilla"]["ruler"]["1024"],
             "equivalent_to": {"method": "vanilla", "identity_up_to": 2048, "longest_sequence": 1000, "checked_prompts": 4}}
    rec = {**RECORD, "results": {**RECORD["results"], "wide": {"lmeval": {}, "ruler": {"1024": taken}}}}
    text = "\n".join(markdown_section(rec))
    assert "wide at 1024 (≤ 1000 of its 2048 tokens, 4 prompts checked)" in text
    assert "--equivalent-check all" in text
    assert "not measured again" not in "\n".join(markdown_section(RECORD))


@pytest.mark.slow
def test_a_cell_equal_to_vanilla_by_construction_takes_vanillas_answers(tmp_path):
    """On the bundled model at 1024 tokens: a sliding window of 2048 keys covers every prompt with
    its answer, so its RULER cell checks 2 prompts per task and takes vanilla's answers; measured in
    full (`ruler_equivalent_check=None`) it answers the same. A window of 512 does not cover them:
    measured. Dynamic NTK beyond the context (256) rescales: measured."""
    import dataclasses

    from lcx.report.run import run_report

    wide = {"attention": {"type": "sliding_window", "window": 2048}}
    cfg = ReportConfig(model="tiny-ret-5m", methods=("vanilla",), lengths=(1024,), decode_lengths=(), tasks=("ruler",),
                       ruler_tasks=("niah_single_1", "niah_multikey_1_pd"), ruler_samples=3,
                       custom_methods={"wide": wide, "narrow": {"attention": {"type": "sliding_window", "window": 512}},
                                       "dyn": {"rope": {"rope_type": "dynamic", "factor": 4}}})
    lines: list[str] = []
    rec = run_report(cfg, tmp_path / "a", progress=False, log=lines.append)
    res = rec["results"]
    assert res["wide"]["ruler"]["1024"]["equivalent_to"]["checked_prompts"] == 4
    assert res["wide"]["ruler"]["1024"]["equivalent_to"]["identity_up_to"] == 2048
    for other in ("narrow", "dyn"):
        assert "equivalent_to" not in res[other]["ruler"]["1024"]
    assert res["wide"]["ruler"]["1024"]["tasks"] == res["vanilla"]["ruler"]["1024"]["tasks"]
    assert "wide at 1024" in (tmp_path / "a" / "README.md").read_text()
    full = run_report(dataclasses.replace(cfg, ruler_equivalent_check=None, custom_methods={"wide": wide}),
                      tmp_path / "b", progress=False, log=lines.append)["results"]["wide"]["ruler"]["1024"]
    assert "equivalent_to" not in full and full["tasks"] == res["vanilla"]["ruler"]["1024"]["tasks"]
