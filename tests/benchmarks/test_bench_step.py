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


@pytest.mark.vllm
def test_bench_step_vs_vllm(tmp_path, vllm_python):
    """`--vs-vllm`: both engines profiled on the system-prompt load, without and with their prefix
    cache: the same tokens, the same prompt tokens computed without the cache, self time grouped
    the same way for both (linear and attention present in each)."""
    out = tmp_path / "s.json"
    assert main(["bench", "step", "--vs-vllm", "--models", "tiny-5m", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["model"] == "tiny-5m" and row["load"] == "system_prompt" and row["vllm"]["vllm"]
    assert set(row["settings"]) == {"no_cache", "cache"}
    for setting, r in row["settings"].items():
        assert r["same_tokens"] is True, setting
        for eng in ("lcx", "vllm"):
            assert set(r[eng]["self_s"]) == {"linear", "attention", "other"}
            assert r[eng]["self_s"]["linear"] > 0 and r[eng]["self_s"]["attention"] > 0, (setting, eng, r[eng])
            assert r[eng]["gen_tok_s"] > 0 and r[eng]["top_ops_self_s"]
        assert set(r["vllm_vs_lcx_self_s"]) == {"linear", "attention", "other"}
    none = row["settings"]["no_cache"]
    assert none["lcx"]["prompt_tokens_computed"] == none["vllm"]["prompt_tokens_computed"] == 16 * 544


@pytest.mark.slow  # tiny-5m, 2 loads x 2 engines x 2 rounds (~20 s)
def test_bench_step_mixed_ab(tmp_path, monkeypatch):
    """`--mixed-ab`: the mixed step on and off give the same tokens; it mixes some steps, more
    when requests finish apart; the ratios are recorded, by default in the mode's own record
    (not over the step profile's)."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "step", "--mixed-ab", "--models", "tiny-5m", "--steps", "1"]) == 0
    out = tmp_path / "results" / "mixed_step_ab_tiny-5m.json"
    assert out.exists() and not (tmp_path / "results" / "engine_step_profile_cpu.json").exists()
    (row,) = json.loads(out.read_text())["results"]
    together, apart = row["loads"]["together"], row["loads"]["apart"]
    for load in (together, apart):
        assert load["same_tokens"] is True
        assert load["runs"]["off"][0]["mixed_steps"] == 0 and load["runs"]["on"][0]["mixed_steps"] > 0
        assert set(load["on_vs_off"]) == {"gen_tok_s", "ttft_p50_s"}
    assert apart["runs"]["on"][0]["mixed_steps"] > together["runs"]["on"][0]["mixed_steps"]
