"""`lcx bench decode`'s DCA and STRING rows (issue #77 item 5) at toy scale: both run through the
engine beside vanilla and Self-Extend when `--cases` names them (they are not in the default run),
DCA on the unrotated cache (no decode rule: `fast_path` false), STRING on the rotated one (its
window + side rule); at a prompt inside DCA's first chunk DCA decodes vanilla's tokens."""

from __future__ import annotations

import json
import math

from benchmarks.decode import CASES, default_cases, main


def test_dca_and_string_rows(tmp_path):
    assert {"dca", "string"}.isdisjoint(default_cases("smollm2-135m"))
    assert {c.name for c in CASES} >= {"vanilla", "self_extend", "dca", "string"}
    out = tmp_path / "d.json"
    assert main(["--lengths", "45", "--layers", "2", "--tokens", "3", "--no-plot", "--cases", "vanilla",
                 "self_extend", "dca", "string", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    cases = rec["config"]["cases"]
    assert cases["dca"] == {"attention": {"type": "dca", "chunk_size": 6144, "local_size": 512}}  # L0 = 8192
    assert cases["string"]["attention"]["type"] == "string" and cases["string"]["rope"]["rope_type"] == "yarn"
    row = rec["results"]["45"]
    assert set(row) == {"vanilla", "self_extend", "dca", "string"}
    assert row["dca"]["fast_path"] is False and row["string"]["fast_path"] is True
    for name, r in row.items():
        assert len(r["cpu_s"]) == 3 and r["tokens_per_s"] > 0 and math.isfinite(r["ratio"]), name
    # 45 + 3 positions inside DCA's first chunk (c = 5632): exactly causal attention
    assert row["dca"]["tokens"] == row["vanilla"]["tokens"]
