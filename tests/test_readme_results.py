"""The README's headline tables (every table under "## Headline results" whose first column is
"method") quote the committed reports exactly: every passkey cell is the report's count with its
Wilson interval (`lcx.report.format_interval`), every RULER cell the report's headline interval,
every perplexity the report's word perplexity to one decimal, and "—" stands only where the
report has no such cell. A report re-rendered with new cells (a sweep's cell landing), or a README
edited by hand, fails here until they agree."""

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
REPORTS = {"tiny-ret-5m": "results/report", "SmolLM2": "results/report/smollm2-135m-n16",
           "Gemma": "results/report/gemma3-270m"}
# RULER columns ("<model> RULER <length>": the headline, mean over tasks) come from these reports
RULER_REPORTS = {"tiny-ret-5m": "results/report", "SmolLM2": "results/report/smollm2-135m-ruler",
                 "Gemma": "results/report/gemma3-270m-ruler"}
HEADER = re.compile(r"(?P<model>\S+) (?P<metric>passkey|ppl|RULER) (?P<length>\d+)")


def headline_tables() -> list[tuple[list[str], list[list[str]]]]:
    """(header cells, rows) of every "| method |" table between '## Headline results' and the next
    section."""
    lines = README.read_text().split("\n")
    start = lines.index("## Headline results")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tables = []
    for first in (i for i in range(start, end) if lines[i].startswith("| method |")):
        rows = []
        for line in lines[first + 2:end]:
            if not line.startswith("|"):
                break
            rows.append([c.strip() for c in line.strip("|").split("|")])
        tables.append(([c.strip() for c in lines[first].strip("|").split("|")], rows))
    return tables


def _columns():
    cols = []
    for t, (header, _) in enumerate(headline_tables()):
        for i, h in enumerate(header[1:], 1):
            m = HEADER.match(h)
            known = RULER_REPORTS if m and m["metric"] == "RULER" else REPORTS
            assert m and m["model"] in known, f"README headline column {h!r}: no report known for it ({known})"
            cols.append(pytest.param(t, i, known[m["model"]], m["metric"], m["length"], id=h))
    return cols


def test_headline_tables_found():
    """The README keeps both headline tables (the bundled model + SmolLM2, and the real models
    beyond L0 with RULER), each with a row per method."""
    tables = headline_tables()
    assert len(tables) >= 2 and all(rows for _, rows in tables), [h for h, _ in tables]


@pytest.mark.parametrize("table,col,report,metric,length", _columns())
def test_headline_column_quotes_its_report(table, col, report, metric, length):
    record = read_json(ROOT / report / "report.json.gz")
    results = record["results"]
    ruler = ruler_intervals(record) if metric == "RULER" else {}
    _, rows = headline_tables()[table]
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
