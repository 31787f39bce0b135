"""`lcx bench kernels`: the regression compare (pure, synthetic JSON), the result schema, the
registry of per-kernel cases, the CLI, and a CPU smoke run of a few cases. The GPU benchmark
itself runs in scripts/gpu_session.sh."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import kernels as bk
from benchmarks.kernels.common import bandwidth_goal
from benchmarks.kernels.lambda_prefill import prefill_goal

ROOT = Path(__file__).resolve().parents[2]


def _result(gpu="NVIDIA H100 80GB HBM3", **medians) -> dict:
    rows = {}
    for name, ms in medians.items():
        key = name.replace("__", "/")
        if ms is None:
            rows[key] = {"group": "g", "impl": "i", "size": "s", "skipped": "triton is not installed"}
        else:
            rows[key] = {"group": "g", "impl": "i", "size": "s", "median_ms": ms, "min_ms": ms, "times_ms": [ms],
                         "bytes": 1e6, "flops": 0.0, "GBps": 1e6 / ms / 1e6, "TFLOPs": 0.0}
    return {"schema": bk.SCHEMA, "gpu": gpu, "gpu_slug": bk.gpu_slug(gpu), "device": "cuda", "smoke": False,
            "timing": "cuda_events", "config": {}, "environment": {}, "ceilings": {}, "kernels": rows}


def test_compare_flags_only_kernels_more_than_10_percent_slower():
    base = _result(a=1.0, b=2.0, c=3.0)
    new = _result(a=1.099, b=2.21, c=2.0)  # a +9.9% (ok), b +10.5% (fail), c faster
    cmp = bk.compare(new, base)
    assert [k for k, *_ in cmp.regressions] == ["b"] and not cmp.ok
    assert cmp.compared == 3 and "REGRESSION b" in cmp.report() and "FAILED" in cmp.report()
    assert bk.compare(_result(a=1.1, b=2.0, c=3.0), base).ok  # exactly +10% is not "more than"


def test_compare_missing_and_new_kernels():
    base = _result(a=1.0, b=2.0, c=5.0)
    new = _result(a=1.0, b=None, d=4.0)  # b now skipped, c gone, d new
    cmp = bk.compare(new, base)
    assert cmp.missing == ["b", "c"] and cmp.new == ["d"] and not cmp.ok
    assert "MISSING b" in cmp.report()
    # a kernel skipped in the baseline and timed now is new, not a failure
    assert bk.compare(_result(a=1.0, b=2.0), _result(a=1.0, b=None)).ok


def test_compare_refuses_other_gpus_and_smoke_runs():
    with pytest.raises(ValueError, match="same GPU"):
        bk.compare(_result(gpu="NVIDIA H200", a=1.0), _result(a=1.0))
    smoke = _result(a=1.0)
    smoke["smoke"] = True
    with pytest.raises(ValueError, match="smoke"):
        bk.compare(smoke, _result(a=1.0))


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r.pop("gpu"), "'gpu'"),
    (lambda r: r.update(schema="other/0"), "schema"),
    (lambda r: r["kernels"]["a"].pop("bytes"), "lacks 'bytes'"),
    (lambda r: r["kernels"]["a"].update(median_ms=0.0), "median_ms"),
])
def test_validate_names_the_bad_field(mutate, match):
    r = _result(a=1.0)
    mutate(r)
    with pytest.raises(ValueError, match=match):
        bk.validate(r)


def test_gpu_slug_and_registry():
    assert bk.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    names = [c.name for c in bk.CASES]
    assert len(names) == len(set(names))
    for c in bk.CASES:  # every baseline a case names exists
        assert not c.baseline or c.baseline in names, c.name
    groups = {c.group for c in bk.CASES}
    assert groups == {"rerotate", "lambda_prefill", "lambda_decode", "swat", "rope"}
    # one module per kernel, each in the registry (KERNELS) and holding exactly its own group's cases
    modules = {p.stem for p in (ROOT / "benchmarks" / "kernels").glob("*.py")} - {"__init__", "__main__", "common",
                                                                                    "baseline", "tune"}
    assert {m.__name__.rsplit(".", 1)[1] for m in bk.KERNELS} == modules == groups
    for m in bk.KERNELS:
        assert {c.group for c in m.CASES} == {m.__name__.rsplit(".", 1)[1]}
    assert {c.impl for c in bk.CASES if c.group == "lambda_decode"} >= {"cuda", "triton_backend", "sdpa_full_cache"}


def test_goals():
    rows = {"p/sdpa": {"median_ms": 100.0},
            "p/tri": {"median_ms": 10.0, "baseline": "p/sdpa", "shape": {"T": 32768, "G": 64, "L": 4096}}}
    g = prefill_goal(rows["p/tri"], rows)
    assert g["target"] == pytest.approx(0.6 * 32768 / (2 * 4160), abs=1e-3) and g["met"]  # 10x >= 2.36
    assert bandwidth_goal({"pct_bandwidth": 69.9}, {})["met"] is False


def test_python_m_runs_the_same_command():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--list"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split()[0] for line in proc.stdout.splitlines()] == [c.name for c in bk.CASES]


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "lcx.cli", "bench", "kernels", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _main(*args) -> int:
    """The CLI in-process (lcx.cli.main: ValueError -> one line on stderr, exit 2)."""
    from lcx.cli import main

    return main(["bench", "kernels", *args])


def test_cli_help_and_no_gpu_error(capsys):
    with pytest.raises(SystemExit) as e:
        _main("--help")
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--check" in out and "--device" in out
    import torch

    if not torch.cuda.is_available():
        assert _main() == 2
        err = capsys.readouterr().err
        assert "no CUDA GPU" in err and "--device cpu" in err


def test_cpu_smoke_run_writes_valid_json_and_check_exit_codes(tmp_path, capsys):
    out = tmp_path / "smoke.json"
    proc = _cli("--device", "cpu", "--only", "rope/ref", "lambda_decode/", "--repeats", "2", "--warmup", "1",
                "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    bk.validate(res)
    assert res["smoke"] is True and res["device"] == "cpu" and res["timing"].startswith("wall_clock")
    assert set(res["kernels"]) == {"rope/ref/32k", "lambda_decode/sdpa_full_cache/32k", "lambda_decode/blockwise/G64+L4096"}
    for row in res["kernels"].values():
        assert row["median_ms"] > 0 and row["bytes"] > 0 and len(row["times_ms"]) == 2
    assert res["ceilings"]["copy_GBps"] > 0 and res["environment"]["git"]["sha"]
    # a CPU smoke run is never compared
    assert _main("--check", str(out), "--new", str(out)) == 2 and "smoke" in capsys.readouterr().err
    # two stored GPU results: exit 0 when within 10%, 1 (naming the kernel) when slower
    base, slow = tmp_path / "base.json", tmp_path / "slow.json"
    base.write_text(json.dumps(_result(a=1.0, b=2.0)))
    slow.write_text(json.dumps(_result(a=1.0, b=3.0)))
    assert _main("--check", str(base), "--new", str(base)) == 0
    assert _main("--check", str(base), "--new", str(slow)) == 1 and "REGRESSION b" in capsys.readouterr().out
    assert _main("--check", str(tmp_path / "none.json"), "--new", str(base)) == 2  # no baseline file


def test_skips_are_recorded_not_raised():
    """A case whose implementation cannot run is a row {"skipped": reason}; checkpoints after each case."""
    case = bk.Case("rope", "cuda_only", "x", lambda device, tiny: (_ for _ in ()).throw(bk.Skip("needs a CUDA GPU")),
                   cpu=True)
    broken = bk.Case("rope", "broken", "x", lambda device, tiny: 1 / 0, cpu=True)
    seen = []
    res = bk.run_cases([case, broken], "cpu", warmup=0, repeats=1, progress=False,
                       checkpoint=lambda r: seen.append((r["complete"], len(r["kernels"]))))
    assert seen == [(False, 1), (False, 2)] and res["complete"] is True  # partial results after every case
    assert res["kernels"]["rope/cuda_only/x"]["skipped"] == "needs a CUDA GPU"
    assert res["kernels"]["rope/broken/x"]["skipped"].startswith("ZeroDivisionError")
    copied = copy.deepcopy(res)
    bk.validate(copied)


# ----------------------------------------------------------------------------- --tune
@pytest.mark.slow
def test_tune_smoke_under_the_interpreter(tmp_path):
    """`lcx bench kernels --tune --device cpu` (Triton's interpreter, tiny shape): the default
    configuration first, every configuration checked against its output and timed, a best."""
    out = tmp_path / "tune.json"
    env = dict(__import__("os").environ, TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([sys.executable, "-m", "lcx.cli", "bench", "kernels", "--tune", "--device", "cpu",
                        "--warmup", "1", "--repeats", "1", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["smoke"] is True and rec["complete"] is True and rec["gpu_slug"] == "cpu"
    from benchmarks.kernels import tune

    assert len(rec["configs"]) == len(tune.grid(tune.CPU_GRID_AXES)) + 1  # + the default, first
    assert rec["configs"][0]["config"] == rec["default"]
    assert all(r["matches_default"] and r["median_ms"] > 0 for r in rec["configs"])
    assert rec["best"] in [r["config"] for r in rec["configs"]] and rec["speedup_vs_default"] >= 1.0
    assert "best {'block_m'" in p.stdout
    assert rec["decode_splits"] == {"skipped": "the CUDA decode kernel needs a CUDA GPU"}


def test_tune_refuses_the_cpu_without_the_interpreter():
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "lcx.cli", "bench", "kernels", "--tune", "--device", "cpu"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "TRITON_INTERPRET=1" in p.stderr


def test_tuned_launch_configs_are_the_committed_tune_results():
    """lcx.kernels.triton.lambda_attention.TUNED (and the CUDA decode kernel's
    TUNED_BLOCKS_PER_SM) hold, per GPU, the best of that GPU's committed
    results/kernels/<gpu>.tune.json, and nothing else."""
    from lcx.kernels.triton.lambda_attention import TUNED, FwdConfig

    committed = {p.name.removesuffix(".tune.json"): json.loads(p.read_text())
                 for p in (ROOT / "results" / "kernels").glob("*.tune.json")}
    from lcx.kernels.cuda.lambda_decode import TUNED_BLOCKS_PER_SM

    assert set(TUNED) == set(committed)
    for slug, rec in committed.items():
        assert rec["smoke"] is False and rec["complete"] is True and rec["gpu_slug"] == slug
        assert TUNED[slug] == FwdConfig(**rec["best"]), slug
    decode = {slug: rec["decode_splits"]["best_blocks_per_sm"] for slug, rec in committed.items()
              if (rec.get("decode_splits") or {}).get("best_blocks_per_sm") is not None}
    assert TUNED_BLOCKS_PER_SM == decode


def test_launch_config_overrides_and_the_cpu_default():
    import torch

    from lcx.kernels.triton.lambda_attention import DEFAULT_CONFIG, FwdConfig, config_for, launch_config

    cpu = torch.device("cpu")
    assert config_for(cpu) == DEFAULT_CONFIG
    a, b = FwdConfig(16, 16, 4, 1), FwdConfig(32, 16, 4, 1)
    with launch_config(a):
        assert config_for(cpu) == a
        with launch_config(b):
            assert config_for(cpu) == b
        assert config_for(cpu) == a
    assert config_for(cpu) == DEFAULT_CONFIG
