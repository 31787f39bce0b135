"""`lcx bench <name>`: every benchmark is a module with one interface and one run record.

The heavy benchmarks are not run here (they take minutes to hours); what is checked: the
interface of every `bench` module, that importing them pulls no optional package, the method
rows that are `lcx.presets`, and one tiny end-to-end run of the cheapest subprocess benchmark
(`lcx bench attention`) for the record's shape.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import import_module

import pytest

from lcx.cli import COMMANDS, main

BENCH = [(path[1], module) for path, module, _ in COMMANDS if path[0] == "bench"]
# The `lcx bench` commands each script under scripts/ became (issue #15 item 6).
MOVED = ("attention", "decode", "extrapolation", "serving", "swat", "lmeval")


def test_moved_scripts_are_bench_commands():
    assert set(MOVED) <= {name for name, _ in BENCH}


@pytest.mark.parametrize("name,module", BENCH, ids=[n for n, _ in BENCH])
def test_bench_module_interface(name, module):
    mod = import_module(module)
    for attr in ("add_arguments", "run", "main"):
        assert callable(getattr(mod, attr, None)), f"{module} has no {attr}()"
    assert isinstance(getattr(mod, "DESCRIPTION", None), str), f"{module} has no DESCRIPTION"


def test_moved_benchmarks_import_without_optional_packages():
    """vLLM (and httpx, torch, transformers) stay unimported until one of these benchmarks runs."""
    code = ("import sys; " + "; ".join(f"import benchmarks.{m}" for m in MOVED)
            + "; print([m for m in ('vllm', 'httpx', 'torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_extrapolation_rows_that_are_presets():
    from lcx import presets
    from benchmarks.extrapolation import TRAIN_LEN, methods

    rows = methods(16)
    assert rows["vanilla"] == {}
    assert rows["sliding_window_256"] == presets.config("sliding_window", L0=TRAIN_LEN, factor=1).to_dict()
    assert rows["yarn_x32"] == {"rope": {"rope_type": "yarn", "factor": 32.0}}
    # Not presets (documented in methods()): the committed numbers use G = 16 and 4 + 256 keys.
    assert rows["lm_infinite_G16_L256"]["attention"]["n_global"] == 16
    assert rows["sinks_4_256"]["attention"]["window"] == 256


def test_swat_methods_are_presets_but_dynamic():
    from lcx import presets
    from benchmarks.swat import METHODS, TRAIN_LENGTH, method_config

    for name, preset in METHODS.items():
        if preset is not None:
            assert method_config(name, 32.0) == presets.config(preset, L0=TRAIN_LENGTH, factor=32.0).to_dict()
    assert method_config("dynamic", 32.0) == {"rope": {"rope_type": "dynamic", "factor": 1.0}}
    assert method_config("default", 32.0) == {}


def test_bench_attention_tiny_run_writes_one_record(tmp_path):
    out = tmp_path / "a.json"
    assert main(["bench", "attention", "--lengths", "64", "--repeats", "1", "--budget-s", "1",
                 "--cases", "dense_sdpa", "lambda/blockwise", "--global", "4", "--local", "16",
                 "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert list(rec) == ["description", "config", "environment", "wall_s", "summary", "results"]
    assert rec["environment"]["git"]["sha"]
    assert all(rec["results"][c]["64"]["status"] == "ok" for c in ("dense_sdpa", "lambda/blockwise"))
    assert rec["summary"]["64"]["dense_sdpa"]["speedup_vs_dense_sdpa"] == 1.0
    assert out.with_suffix(".png").exists()


def test_bench_unknown_case_is_one_line_error(capsys):
    assert main(["bench", "attention", "--cases", "nope", "--out", "/nonexistent/a.json"]) == 2
    assert "lcx: error: --cases: unknown ['nope']" in capsys.readouterr().err
