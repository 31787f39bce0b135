"""The README's headline table quotes the committed reports exactly: every passkey cell is the
report's count with its Wilson interval (`lcx.report.format_interval`), every perplexity the
report's word perplexity to one decimal, and "—" stands only where the report has no such cell.
A report re-rendered with new cells, or a README edited by hand, fails here until they agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lcx.report import PPL_METRIC, format_interval, passkey_interval
from lcx.data.io import read_json
from lcx.report.ruler import ruler_intervals

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the model named in a column header -> the committed report its numbers come from
REPORTS = {"tiny-ret-5m": "results/report", "SmolLM2": "results/report/smollm2-135m-n16"}
# RULER columns ("<model> RULER <length>": the headline, mean over tasks) come from these reports
RULER_REPORTS = {"tiny-ret-5m": "results/report"}
HEADER = re.compile(r"(?P<model>\S+) (?P<metric>passkey|ppl|RULER) (?P<length>\d+)")


def headline_table() -> tuple[list[str], list[list[str]]]:
    """The header cells and the rows of the first table under '## Headline results'."""
    lines = README.read_text().split("\n")
    start = lines.index("## Headline results")
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("| method |"))
    rows = []
    for line in lines[first + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return [c.strip() for c in lines[first].strip("|").split("|")], rows


def _columns():
    header, _ = headline_table()
    cols = []
    for i, h in enumerate(header[1:], 1):
        m = HEADER.match(h)
        known = RULER_REPORTS if m and m["metric"] == "RULER" else REPORTS
        assert m and m["model"] in known, f"README headline column {h!r}: no report known for it ({known})"
        cols.append(pytest.param(i, known[m["model"]], m["metric"], m["length"], id=h))
    return cols


@pytest.mark.parametrize("col,report,metric,length", _columns())
def test_headline_column_quotes_its_report(col, report, metric, length):
    record = read_json(ROOT / report / "report.json.gz")
    results = record["results"]
    ruler = ruler_intervals(record) if metric == "RULER" else {}
    _, rows = headline_table()
    wrong = []
    for row in rows:
        method, shown = row[0], row[col]
        cell = results.get(method, {}).get("ruler" if metric == "RULER" else "lmeval", {}).get(length)
        if cell is None:
            want = "—"
        elif metric == "RULER":
            want = format_interval(ruler[method][length].get("headline"))
        elif metric == "passkey":
            want = format_interval(passkey_interval(cell))
        else:
            want = f"{cell['ppl'][PPL_METRIC]:.1f}"
        if shown != want:
            wrong.append(f"{method}: README {shown!r}, {report}/report.json.gz {want!r}")
    assert rows and not wrong, wrong
