"""`lcx bench step`: bad sizes refused by name; a small run records step times and shares that
sum to one for every model."""

import json

import pytest

from lcx.cli import main


@pytest.mark.parametrize("flag", ["--prefill-tokens", "--steps"])
def test_bench_step_refuses_bad_sizes(flag, tmp_path, capsys):
    assert main(["bench", "step", flag, "0", "--out", str(tmp_path / "s.json")]) == 2
    assert flag in capsys.readouterr().err and not (tmp_path / "s.json").exists()


@pytest.mark.slow  # loads tiny-5m and runs ~40 engine steps (~6 s)
def test_bench_step_small_run(tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench", "step", "--models", "tiny-5m", "--prefill-tokens", "64", "--steps", "2",
                 "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    (row,) = rec["results"]
    assert row["model"] == "tiny-5m" and row["lean_decode"] is True
    assert row["prefill_64_s"] > 0 and row["decode_b1_step_ms"] > 0 and row["decode_b32_step_ms"] > 0
    for key in ("prefill_64_share", "decode_b1_share", "decode_b32_share"):
        assert set(row[key]) == {"linear", "attention", "other"}
        assert sum(row[key].values()) == pytest.approx(1.0, abs=0.01) and row[key]["linear"] > 0
