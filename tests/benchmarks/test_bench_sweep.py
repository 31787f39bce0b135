"""`lcx bench sweep`: bad sizes refused by name; end to end (serial and --jobs 2), every mode's
numbers equal the serial run's and cells per hour are recorded."""

import json

import pytest

from lcx.cli import main


@pytest.mark.parametrize("flag", ["--samples-per-depth", "--ppl-docs", "--repeats"])
def test_bench_sweep_refuses_bad_sizes(flag, tmp_path, capsys):
    assert main(["bench", "sweep", flag, "0", "--out", str(tmp_path / "s.json")]) == 2
    assert flag in capsys.readouterr().err and not (tmp_path / "s.json").exists()


def test_bench_sweep_refuses_unknown_modes(tmp_path, capsys):
    assert main(["bench", "sweep", "--modes", "serial,jobs3", "--out", str(tmp_path / "s.json")]) == 2
    assert "--modes" in capsys.readouterr().err


@pytest.mark.slow  # 2 x 8 small report cells, two worker processes
def test_bench_sweep_serial_and_jobs2(tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench", "sweep", "--modes", "serial,jobs2", "--repeats", "1", "--samples-per-depth", "1",
                 "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["config"]["samples_per_depth"] == 1 and rec["config"]["modes"] == ["serial", "jobs2"]
    res = rec["results"]
    assert res["serial"]["cells"] == res["jobs2"]["cells"] == 8
    assert res["jobs2"]["numbers_equal_serial"] is True
    assert res["serial"]["cells_per_hour"] > 0 and res["jobs2"]["speedup_vs_serial"] > 0
