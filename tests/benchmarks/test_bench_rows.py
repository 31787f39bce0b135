"""`lcx bench rows`: a tiny grid end to end (the record's shape, every path within float32 error of
the float64 reference, the ratios against the right baseline) and its refusals."""

from __future__ import annotations

import json

import pytest

from lcx.cli import main
from lcx.kernels.cpu.causal_attention import unavailable


def test_bench_rows_writes_its_record(tmp_path):
    out = tmp_path / "rows.json"
    assert main(["bench", "rows", "--heads", "4/2", "--shapes", "9/9,5/37,70/70", "--decode", "3/40", "--rounds", "1",
                 "--repeats", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    rows = rec["results"]
    decode = [r for r in rows if "decode_rows" in r]
    rows = [r for r in rows if "decode_rows" not in r]
    assert [(r["nq"], r["n"]) for r in rows] == [(9, 9), (5, 37), (70, 70)]
    if unavailable() is None:  # the decode step's matmul path against the C++ kernel
        assert [(r["decode_rows"], r["slots"], set(r["ms"])) for r in decode] == [(3, 40, {"matmul", "cpp"})]
        assert all(e < 1e-5 for e in decode[0]["max_err"].values()) and decode[0]["ratio"]["matmul"] == 1.0
    cpp = {"cpp"} if unavailable() is None else set()  # the C++ kernel, where it builds
    assert set(rows[0]["ms"]) == {"fused", "flash", "masked", "blocks"} | cpp and rows[0]["ratio_vs"] == "fused"
    assert set(rows[1]["ms"]) == {"flash", "masked", "blocks"} | cpp and rows[1]["ratio_vs"] == "masked"
    for r in rows:
        assert r["ratio"][r["ratio_vs"]] == 1.0
        assert all(e < 1e-5 for e in r["max_err"].values()), r["max_err"]
    assert rec["config"]["heads"] == ["4/2"] and rec["environment"]


@pytest.mark.parametrize("args", [["--heads", "9/2"], ["--shapes", "10/5"], ["--shapes", "x"], ["--rounds", "0"]])
def test_bench_rows_refuses_bad_arguments(args, tmp_path, capsys):
    try:
        rc = main(["bench", "rows", *args, "--out", str(tmp_path / "r.json")])
    except SystemExit as e:  # argparse's refusal
        rc = e.code
    assert rc not in (0, None)
    assert args[0] in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
