"""`lcx report`: config validation, method resolution, and a small end-to-end run on a random
tiny model (through lm-eval and the engine for real) that is then resumed from its cells."""

from __future__ import annotations

import json

import pytest

from lcx.report import (
    DEFAULT_METHODS,
    METHOD_TABLE,
    MethodRun,
    ReportConfig,
    cell_settings,
    load_cell,
    markdown,
    run_report,
)


def test_every_default_method_is_in_the_table():
    assert set(DEFAULT_METHODS) <= set(METHOD_TABLE)


@pytest.mark.parametrize("kwargs,match", [
    ({"methods": ("vanilla", "nope")}, r"unknown report method\(s\) \['nope'\]"),
    ({"methods": ()}, "at least one method"),
    ({"lengths": (8,)}, "lengths must be integers >= 16"),
    ({"depths": 0}, "depths must be an integer >= 1"),
    ({"decode_tokens": 1}, "decode_tokens must be an integer >= 2"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReportConfig(**kwargs)


def test_methods_resolve_to_component_configs():
    runs = {n: METHOD_TABLE[n]("tiny-5m", 256, 8.0) for n in DEFAULT_METHODS}
    assert runs["vanilla"] == MethodRun()
    assert runs["yarn"].rope == {"rope_type": "yarn", "factor": 8.0}
    assert runs["lm_infinite"].attention == {"type": "lm_infinite", "n_global": 10, "n_local": 256}
    both = runs["lm_infinite+yarn"]
    assert both.engine_methods() == {"rope": {"rope_type": "yarn", "factor": 4.0},
                                     "attention": {"type": "lm_infinite", "n_global": 10, "n_local": 256}}
    assert both.lmeval_kwargs() == {"rope_type": "yarn", "factor": 4.0, "attention": "lm_infinite",
                                    "n_global": 10, "n_local": 256}
    assert runs["swat"].model == "tiny-swat-5m"
    assert "no SWAT model" in METHOD_TABLE["swat"]("smollm2-135m", 8192, 2.0)
    # every resolved config is accepted by the components that run it
    from lcx.engine import EngineConfig
    from lcx.lmeval_model import split_model_args

    for r in runs.values():
        EngineConfig(methods=r.engine_methods())
        split_model_args(r.lmeval_kwargs())


def test_stored_cells_are_reused_only_with_equal_settings(tmp_path):
    cfg = ReportConfig(lengths=(64, 128)).resolved(64)
    s = cell_settings("lmeval", "m", "yarn", MethodRun(rope={"rope_type": "yarn", "factor": 2.0}), cfg)
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"settings": s, "result": {"x": 1}}))
    assert load_cell(p, s) == {"settings": s, "result": {"x": 1}}
    assert load_cell(p, {**s, "depths": 5}) is None
    p.write_text("{truncated")
    assert load_cell(p, s) is None
    assert load_cell(tmp_path / "missing.json", s) is None


@pytest.mark.slow
def test_report_end_to_end_and_resume(tiny_model_dir, tmp_path):
    """Two methods on a random tiny model: numbers exist and are finite, the files are written,
    and a second run reuses every cell (no recomputation) while a changed setting recomputes."""
    cfg = ReportConfig(model=str(tiny_model_dir), methods=("vanilla", "lm_infinite", "swat"), lengths=(256, 320),
                       depths=1, ppl_docs=1, decode_tokens=3)
    lines: list[str] = []
    rec = run_report(cfg, tmp_path, progress=False, log=lines.append)
    assert "swat" in rec["config"]["methods_skipped"] and any("skipping swat" in x for x in lines)
    assert rec["config"]["lengths"] == [256, 320] and rec["cells_reused"] == 0
    for name in ("vanilla", "lm_infinite"):
        r = rec["results"][name]
        assert set(r["lmeval"]["passkey_by_length"]) == {"256", "320"}
        assert all(v["word_perplexity"] > 1 for v in r["lmeval"]["ppl_by_length"].values())
        assert all(d["decode_steps"] == 2 and d["kv_cache_mb"] > 0 for d in r["decode"]["by_length"].values())
    # LM-Infinite keeps n_global 10 + n_local 128 - 1 = 137 < 320 keys; vanilla keeps all
    by = {n: rec["results"][n]["decode"]["by_length"] for n in ("vanilla", "lm_infinite")}
    assert by["lm_infinite"]["320"]["kv_cache_mb"] < 0.5 * by["vanilla"]["320"]["kv_cache_mb"]
    for f in ("report.json", "README.md", "passkey_heatmap.png", "ppl_by_length.png", "decode_by_length.png"):
        assert (tmp_path / f).stat().st_size > 0
    assert markdown(rec).startswith("# lcx report")

    again = run_report(cfg, tmp_path, progress=False, log=lines.append)
    assert again["cells_reused"] == 4
    assert again["results"] == json.loads(json.dumps(rec["results"]))
    changed = run_report(ReportConfig(**{**cfg.__dict__, "decode_tokens": 4}), tmp_path, progress=False,
                         log=lines.append)
    assert changed["cells_reused"] == 2  # the lmeval cells; decode cells recomputed
