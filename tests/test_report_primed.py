"""`lcx report`'s passkey_primed cells (issue #76, item 4; `lcx.report.primed`): the task in a
report's config (earlier reports' settings unchanged), the paired table from hand-made cells
(McNemar, prose shares), and on the bundled tiny model a report that measures primed cells beside
passkey's, renders the paired table, resumes, and a second folder that reads the published-prompt
cells from the first (`cells_from`) instead of measuring them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lcx.report import ReportConfig, run_report
from lcx.report.config import LMEVAL_TASKS, TASKS
from lcx.report.primed import markdown_section, primed_paired

LENGTHS = (383, 611)  # odd sizes (the byte tokenizer: the scaffold alone takes ~300 tokens)
MEASURED = (611,)  # the tiny-model report's lengths (one: the default tier's time)


# Config
# ============================================================================================

def test_passkey_primed_is_asked_for_and_never_a_default():
    assert "passkey_primed" not in ReportConfig().tasks and ReportConfig().tasks == TASKS
    both = ReportConfig(lengths=LENGTHS, tasks=("passkey_primed", "ppl", "passkey")).resolved(256)
    assert both.tasks == ("passkey", "ppl", "passkey_primed")  # the canonical order
    assert both.cell_lengths("passkey_primed") == both.cell_lengths("lmeval") == LENGTHS
    assert both.to_dict()["tasks"] == ["passkey", "ppl", "passkey_primed"] and "ruler_samples" not in both.to_dict()
    alone = ReportConfig(lengths=LENGTHS, tasks=("passkey_primed",)).resolved(256)
    assert alone.cell_lengths("lmeval") == () and alone.primed_lengths == LENGTHS
    assert ReportConfig(lengths=LENGTHS).resolved(256).primed_lengths == ()
    # a committed passkey + perplexity report's settings: as before the task existed
    assert "tasks" not in ReportConfig(tasks=LMEVAL_TASKS).to_dict()
    with pytest.raises(ValueError, match="subset of"):
        ReportConfig(tasks=("passkey_primd",))


def test_a_primed_cell_has_the_passkey_prompt_settings_and_the_lmeval_and_engine_code():
    from lcx.presets import resolve
    from lcx.report.cells import NUMERICS_MODULES, cell_settings

    cfg = ReportConfig(model="tiny-ret-5m", lengths=LENGTHS, tasks=("passkey", "ppl", "passkey_primed"), depths=3)
    run = resolve("vanilla", "tiny-ret-5m", L0=256, factor=2.0)
    s = cell_settings("passkey_primed", "tiny-ret-5m", "vanilla", run, cfg, 611)
    assert s["kind"] == "passkey_primed" and s["depths"] == 3 and s["samples_per_depth"] == cfg.samples_per_depth
    assert "window_tokens" not in s and "ppl_docs" not in s
    assert NUMERICS_MODULES["passkey_primed"] == NUMERICS_MODULES["lmeval"] + ("lcx.engine",)


# The paired table from hand-made cells
# ============================================================================================

def _samples(verdicts: list[tuple[str, str]]) -> list[dict]:
    """(key, output) per prompt at depths 0, 1/7, ...; correct by the task's rule (first number)."""
    import re

    out = []
    for i, (key, output) in enumerate(verdicts):
        first = re.findall(r"\d+", output)
        out.append({"depth": i / 7, "key": key, "output": output, "correct": float(bool(first) and first[0] == key)})
    return out


def _cell(samples: list[dict]) -> dict:
    return {"passkey": sum(s["correct"] for s in samples) / len(samples), "passkey_docs": len(samples),
            "passkey_samples": samples}


KEYS = ["11111", "22222", "33333", "44444", "55555", "66666", "77777"]
# published: 2 right, 4 prose, 1 wrong number; primed: 5 right (3 of them prose before), 1 wrong number
# (prose before), 1 missed that the published prompt retrieved
PUBLISHED = [" 11111.", " 22222", " the pass key.", " the key.", " hidden.", " the end.", " 12345."]
PRIMED = [" 11111", " the pass key", " 33333.", " 44444", " 55555", " 99999", " 77777"]


def _record(tasks=("passkey", "lcx_ppl", "passkey_primed")) -> dict:
    pub, pri = _cell(_samples(list(zip(KEYS, PUBLISHED)))), _cell(_samples(list(zip(KEYS, PRIMED))))
    return {"config": {"lengths": [611], "tasks": list(tasks)},
            "results": {"vanilla": {"lmeval": {"611": pub}, "passkey_primed": {"611": pri}},
                        "yarn": {"lmeval": {"611": pub}}}}


def test_the_paired_rows_count_discordant_prompts_and_prose_misses():
    rows = primed_paired(_record())["611"]
    assert [r["method"] for r in rows] == ["vanilla", "yarn"]
    # yarn has no primed cell (yet): its published side alone, nothing paired
    y = rows[1]
    assert y["primed"] is None and y["published"]["k"] == 2 and y["n"] == 0 and y["diff"] is None
    assert y["published_misses"] == {"prose": 4, "wrong_number": 1} and "primed_misses" not in y
    r = rows[0]
    assert (r["primed"]["k"], r["published"]["k"], r["n"]) == (5, 2, 7)
    assert (r["x_only"], r["y_only"], r["both"], r["neither"]) == (4, 1, 1, 1)
    assert r["diff"] == pytest.approx(3 / 7) and r["mcnemar_p"] == pytest.approx(2 * (1 + 5) / 2 ** 5)
    assert r["published_misses"] == {"prose": 4, "wrong_number": 1} and r["primed_misses"] == {"prose": 1, "wrong_number": 1}
    assert r["prose_fixed"] == 3 and r["prose_to_number"] == 1 and r["unpaired"] == 0


def test_prompts_in_one_cell_only_are_left_out_of_the_pairing():
    rec = _record()
    rec["results"]["vanilla"]["passkey_primed"]["611"]["passkey_samples"][0]["key"] = "10101"
    r = primed_paired(rec)["611"][0]
    assert r["n"] == 6 and r["unpaired"] == 2
    assert "2 prompts ran in only one" in "\n".join(markdown_section(rec))


def test_the_section_is_a_table_per_length_and_says_how_much_was_format():
    text = "\n".join(markdown_section(_record()))
    assert "### 611 tokens" in text
    row = next(x for x in text.splitlines() if x.startswith("| vanilla |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1].startswith("0.29 [") and cells[2].startswith("0.71 [") and cells[3].startswith("+0.43 [")
    assert cells[4] == "4 : 1" and cells[5] == "0.375 (7)" and cells[6] == "4/5 (80%)" and cells[7] == "1/2 (50%)"
    assert "the published prompt missed 5, 4/5 (80%) of them in prose" in text
    assert "4 prompts were retrieved that the published prompt missed (3 of them prose misses there)" in text
    assert "1 published prose misses became a wrong number" in text
    assert "Over the 1 (method, length) pair measured both ways" in text  # (yarn's row is not paired)
    yarn = next(x for x in text.splitlines() if x.startswith("| yarn |"))
    assert [c.strip() for c in yarn.strip("|").split("|")][2:] == ["—", "—", "—", "—", "4/5 (80%)", "—"]
    assert markdown_section(_record(tasks=("passkey", "lcx_ppl"))) == []  # no primed task: no section


# On the tiny model: measured, rendered, resumed; read from another folder
# ============================================================================================

@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A report of passkey + perplexity + passkey_primed, two methods, two lengths, 3 prompts a cell."""
    out = tmp_path_factory.mktemp("primed") / "report"
    cfg = ReportConfig(model="tiny-ret-5m", methods=("vanilla", "yarn"), lengths=MEASURED, decode_lengths=(),
                       tasks=("passkey", "ppl", "passkey_primed"), depths=3, samples_per_depth=1, ppl_docs=1)
    lines: list[str] = []
    rec = run_report(cfg, out, progress=False, log=lines.append)
    return cfg, out, rec, lines


@pytest.mark.slow  # a real 2-length report run (~20 s in all): the slow tier
def test_a_report_measures_primed_cells_with_every_prompts_answer(measured):
    from lcx.eval_tasks.common import first_int
    from lcx.eval_tasks.passkey.data import ANSWER_BUDGET, SPARE_TOKENS

    cfg, out, rec, _ = measured
    assert rec["cells_total"] == 4 and rec["config"]["tasks"] == ["passkey", "lcx_ppl", "passkey_primed"]
    for name in ("vanilla", "yarn"):
        for L in MEASURED:
            pub, pri = rec["results"][name]["lmeval"][str(L)], rec["results"][name]["passkey_primed"][str(L)]
            assert "ppl" in pub and "ppl" not in pri and pri["passkey_docs"] == 3
            # the same prompts (depth, key) as the passkey cell, each with its answer and size
            assert sorted((s["depth"], s["key"]) for s in pri["passkey_samples"]) == sorted(
                (s["depth"], s["key"]) for s in pub["passkey_samples"])
            for s in pri["passkey_samples"]:
                assert isinstance(s["output"], str) and s["correct"] == float(first_int(s["output"]) == s["key"])
                assert s["prompt_tokens"] + SPARE_TOKENS + ANSWER_BUDGET <= L and s["filler_sentences"] > 0
    paired = rec["passkey_primed_paired"]
    assert set(paired) == {str(L) for L in MEASURED}
    assert all(r["n"] == 3 and r["unpaired"] == 0 and r["mcnemar_p"] is not None for rows in paired.values() for r in rows)


@pytest.mark.slow  # a real 2-length report run (~20 s in all): the slow tier
def test_the_readme_and_the_page_show_the_primed_answers(measured):
    from lcx.data.io import read_json
    from lcx.report.page import answers, kind_counts

    _, out, rec, _ = measured
    readme = (out / "README.md").read_text()
    assert "## Passkey with a primed answer (`passkey_primed`)" in readme
    for L in MEASURED:
        assert f"### {L} tokens" in readme
    assert sum(1 for x in readme.splitlines() if x.startswith(("| vanilla | 0.", "| vanilla | 1."))) >= 2
    assert "How much of the verdict was format" in readme
    data = answers(read_json(out / "report.json.gz"))
    assert data["tasks"] == ["passkey", "passkey_primed"] and data["suites"][-1] == "passkey_primed"
    assert sum(v for c in kind_counts(data)["passkey_primed"]["yarn"].values() for v in c.values()) == 3


@pytest.mark.slow  # a real 2-length report run (~20 s in all): the slow tier
def test_a_report_with_primed_cells_resumes_them(measured):
    """As `lcx sweep run` resumes (`reuse=True`): every stored cell is kept and only a method added
    since is measured, its primed cells too; --render measures nothing and writes the same table."""
    cfg, out, rec, _ = measured
    more = ReportConfig(**{**{k: getattr(cfg, k) for k in ("model", "lengths", "decode_lengths", "tasks", "depths",
                                                            "samples_per_depth", "ppl_docs")},
                           "methods": ("vanilla", "yarn", "lm_infinite")})
    again = run_report(more, out, reuse=True, progress=False, log=lambda _: None)
    assert again["cells_total"] == 6 and again["cells_reused"] == 4
    for name in ("vanilla", "yarn"):
        assert again["results"][name] == json.loads(json.dumps(rec["results"][name]))
    assert set(again["results"]["lm_infinite"]["passkey_primed"]) == {str(L) for L in MEASURED}
    assert [r["method"] for r in again["passkey_primed_paired"]["611"]] == ["vanilla", "yarn", "lm_infinite"]
    shown = run_report(more, out, render=True, progress=False, log=lambda _: None)
    assert shown["cells_reused"] == 6
    assert shown["passkey_primed_paired"] == json.loads(json.dumps(again["passkey_primed_paired"]))


@pytest.mark.slow  # a real 2-length report run (~20 s in all): the slow tier
def test_cells_from_reads_the_published_prompt_cells_of_another_folder(measured, tmp_path):
    """A second folder reads the cells it shares with the first (`cells_from`: same settings and
    fingerprint) instead of measuring them, says so in its README, and measures the rest."""
    from lcx.data.io import read_json

    cfg, first, rec, _ = measured
    second = tmp_path / "second"
    got = run_report(cfg, second, cells_from=(first,), progress=False, log=lambda _: None)
    assert got["cells_reused"] == 4 and set(got["cells_read_from"].values()) == {str(first)}
    stored = read_json(first / "report.json.gz")["results"]
    assert got["results"] == {n: stored[n] for n in ("vanilla", "yarn")}
    readme = (second / "README.md").read_text()
    assert f"4 cells are read from `{first}`" in readme and "`vanilla/lmeval/611`" in readme
    assert "## Passkey with a primed answer" in readme
    # a method the first folder has not: its cells are measured here, vanilla's read there
    third = tmp_path / "third"
    cfg3 = ReportConfig(**{**{k: getattr(cfg, k) for k in ("model", "lengths", "decode_lengths", "tasks", "depths",
                                                             "samples_per_depth", "ppl_docs")},
                           "methods": ("vanilla", "sinks")})
    got = run_report(cfg3, third, cells_from=(tmp_path / "missing", first), progress=False, log=lambda _: None)
    assert got["cells_total"] == 4 and got["cells_reused"] == 2
    assert sorted(got["cells_read_from"]) == sorted(f"vanilla/{k}/{L}" for k in ("lmeval", "passkey_primed")
                                                    for L in MEASURED)
    assert got["results"]["sinks"]["passkey_primed"]["611"]["passkey_docs"] == 3


def test_a_sweep_file_names_the_folders_it_reads(tmp_path):
    from lcx.report.sweep import load_sweep

    f = tmp_path / "s.toml"
    body = ('out = "{out}"\n[report]\nmodel = "tiny-ret-5m"\ntasks = ["passkey", "ppl", "passkey_primed"]\n'
            "[run]\ncells_from = {src}\n")
    f.write_text(body.format(out="r", src='["results/report/a"]'))
    s = load_sweep(f)
    assert s.cells_from == (Path("results/report/a"),) and "passkey_primed" in s.config.tasks
    f.write_text(body.format(out="r", src='"results/report/a"'))
    with pytest.raises(ValueError, match="run.cells_from must be a list"):
        load_sweep(f)
    f.write_text(body.format(out="r", src='["r"]'))
    with pytest.raises(ValueError, match="names the sweep's own folder"):
        load_sweep(f)


@pytest.mark.slow  # a real 2-length report run (~20 s in all): the slow tier
def test_a_sweep_with_cells_from_counts_and_renders_the_cells_it_reads(measured, tmp_path, capsys):
    """`lcx sweep status` counts the cells a sweep reads from `cells_from` as done (and says where
    from); `lcx sweep render` writes the report from them, the paired table included."""
    from lcx.cli import main

    cfg, first, _, _ = measured
    f = tmp_path / "s.toml"
    out = tmp_path / "r"
    f.write_text(f'out = "{out}"\n[report]\nmodel = "tiny-ret-5m"\nmethods = ["vanilla", "yarn"]\n'
                 f"lengths = {list(MEASURED)}\ndecode_lengths = []\n"
                 'tasks = ["passkey", "ppl", "passkey_primed"]\ndepths = 3\nsamples_per_depth = 1\nppl_docs = 1\n'
                 f'[run]\ncells_from = ["{first}"]\n')
    assert main(["sweep", "status", str(f), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["counts"] == {"done": 4, "running": 0, "todo": 0}
    assert {c["cell"]: c.get("read_from") for c in st["cells"]} == {
        f"{m}/{k}/{L}": str(first) for m in ("vanilla", "yarn") for k in ("lmeval", "passkey_primed") for L in MEASURED}
    assert main(["sweep", "render", str(f)]) == 0
    readme = (out / "README.md").read_text()
    assert "## Passkey with a primed answer" in readme and f"4 cells are read from `{first}`" in readme


def test_a_run_interrupted_before_the_primed_kind_existed_resumes_as_it_did(tmp_path):
    """The run fingerprint gained the passkey_primed cells' code; an interrupted run recorded without
    it still resumes under its own id (no cell of that kind can be in it)."""
    from lcx.report.cells import plan_run, run_fingerprint, write_run

    cfg = ReportConfig(model="tiny-ret-5m", methods=("vanilla",), lengths=MEASURED, tasks=LMEVAL_TASKS)
    fp = run_fingerprint(["tiny-ret-5m"])
    old = {**fp, "code": {k: v for k, v in fp["code"].items() if k != "passkey_primed"}}
    write_run(tmp_path, {"run_id": "r0", "finished": False, "config": cfg.to_dict(), "fingerprint": old,
                         "kept_runs": []})
    run_id, keep, why = plan_run(tmp_path, cfg, fp, fresh=False, reuse=False)
    assert (run_id, keep) == ("r0", {"r0"}) and "same settings and fingerprint" in why
    changed = {**old, "code": {**old["code"], "lmeval": {**old["code"]["lmeval"], "lcx.rope": "x"}}}
    write_run(tmp_path, {"run_id": "r0", "finished": False, "config": cfg.to_dict(), "fingerprint": changed,
                         "kept_runs": []})
    run_id, keep, why = plan_run(tmp_path, cfg, fp, fresh=False, reuse=False)
    assert run_id != "r0" and keep == {"r0"} and "lmeval cells ran other code" in why
