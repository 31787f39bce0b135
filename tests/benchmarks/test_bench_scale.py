"""`lcx bench scale`: the GPU-scale sweep's code at CPU scale (what CI runs), its formulas and
its cell order."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import scale

CPU_CASES = [c.name for c in scale.CASES]
# The CPU run of the test: SmolLM2's shape cut to 2 layers, 512 tokens beyond a 128-token
# context, 3 decode steps (seconds on one core).
SMOKE = ["--shape", "smollm2-135m", "--layers", "2", "--lengths", "512", "--context", "128",
         "--decode-tokens", "3", "--threads", "1"]


@pytest.fixture(scope="module")
def smoke_record(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale") / "cpu.json"
    assert scale.main([*SMOKE, "--out", str(out), "--device", "cpu"]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow  # the CPU smoke run (~12 s): the slow tier
def test_cpu_run_measures_every_case_or_says_why(smoke_record):
    cells = smoke_record["results"]
    assert smoke_record["complete"] is True
    assert set(cells) == {f"smollm2-135m|512|{c}" for c in CPU_CASES}
    measured = {k.rsplit("|", 1)[1]: v for k, v in cells.items() if "prefill_s" in v}
    # triton needs CUDA; SWAT's balanced ALiBi needs an even head count (SmolLM2: 9): both say so
    assert "needs CUDA" in cells["smollm2-135m|512|lm_infinite/triton"]["skipped"]
    assert "even number of heads" in cells["smollm2-135m|512|swat"]["skipped"]
    assert set(measured) == set(CPU_CASES) - {"lm_infinite/triton", "swat"}
    for name, row in measured.items():
        assert row["prefill_s"] > 0 and row["decode_steps"] == 2, name  # 3 tokens: the first comes with the prefill
        for k in ("decode_tok_s", "prefill_TFLOPs", "decode_GBps"):
            assert math.isfinite(row[k]) and row[k] > 0, (name, k)
        ratios = row["vs_vanilla"]
        assert all(math.isfinite(v) and v > 0 for v in ratios.values()), (name, ratios)
    assert measured["vanilla"]["vs_vanilla"]["prefill_speedup"] == 1.0


@pytest.mark.slow  # the CPU smoke run (~12 s): the slow tier
def test_cpu_run_bounded_methods_keep_their_window(smoke_record):
    """KV bytes: vanilla keeps all 512 + 3 positions, the windowed methods their window (128 keys
    plus LM-Infinite's 10 global ones), and the ideal ratios follow from those counts."""
    cells = smoke_record["results"]
    per_key = 2 * 2 * 3 * 64 * 4  # layers x (K, V) x kv heads x head dim x float32
    van = cells["smollm2-135m|512|vanilla"]
    assert van["kv_cache_bytes"] >= 514 * per_key
    for name, keys in (("sinks", 128), ("sliding_window", 128), ("lm_infinite/flash", 138)):
        row = cells[f"smollm2-135m|512|{name}"]
        assert row["kv_cache_bytes"] <= keys * per_key, name
        assert row["decode_kv_bytes_per_step"] == keys * per_key, name
        assert row["vs_vanilla"]["ideal_decode_speedup"] > 1
        assert row["vs_vanilla"]["ideal_prefill_speedup"] > 1
    assert smoke_record["config"]["context"] == 128 and smoke_record["environment"]["device"] == "cpu"


def test_resume_keeps_cells_and_time_limit_stops_early(tmp_path):
    out = tmp_path / "r.json"
    args = [*SMOKE, "--cases", "vanilla,sinks", "--out", str(out), "--device", "cpu", "--no-ceilings"]
    assert scale.main([*args, "--time-limit", "0"]) == 0
    rec = json.loads(out.read_text())
    assert rec["complete"] is False and all("not_run" in v for v in rec["results"].values())
    assert scale.main([*args, "--resume"]) == 0
    rec = json.loads(out.read_text())
    assert rec["complete"] is True and all("prefill_s" in v for v in rec["results"].values())
    before = out.read_text()
    assert scale.main([*args, "--resume"]) == 0  # nothing left to run: the cells are kept as they were
    assert json.loads(out.read_text())["results"] == json.loads(before)["results"]


def test_profile_decode_writes_operator_tables_per_cell(tmp_path):
    """--profile-decode: one extra, untimed run per cell; its decode steps' operators by self CPU
    time (and device time on CUDA) in DIR/decode_<cell>.txt, named in the cell's row."""
    out, prof = tmp_path / "p.json", tmp_path / "prof"
    args = [*SMOKE, "--decode-tokens", "4", "--cases", "vanilla,sinks", "--out", str(out), "--device", "cpu",
            "--no-ceilings", "--profile-decode", str(prof)]
    assert scale.main(args) == 0
    rows = json.loads(out.read_text())["results"]
    for key, row in rows.items():
        path = prof / f"decode_{key.replace('|', '_')}.txt"
        assert row["decode_profile"] == str(path) and path.is_file()
        text = path.read_text()
        assert text.startswith("decode steps profiled: 2, wall ")  # 4 tokens: prefill's, one warm step, 2 profiled
        assert "== by self CPU time" in text and "aten::mm" in text
        assert "device busy" not in text  # no device on the CPU
    assert sorted(p.name for p in prof.iterdir()) == ["decode_smollm2-135m_512_sinks.txt",
                                                      "decode_smollm2-135m_512_vanilla.txt"]


def test_gpu_order_runs_the_key_cells_first():
    cases = list(scale.CASES)
    order = scale.cell_order(list(scale.GPU_SHAPES), list(scale.GPU_LENGTHS), cases)
    first = [(s, T, c.name) for s, T, c in order[:6]]
    assert {x[0] for x in first} == {"llama-3-8b"}
    assert {x[1] for x in first} == {32768, 131072}
    assert {x[2] for x in first} == set(scale.KEY_CASES)
    assert order[-1][0] == "smollm2-135m"
    assert len(order) == len(scale.SHAPES) * len(scale.GPU_LENGTHS) * len(cases)


def test_shape_facts_match_the_published_parameter_counts():
    """The shapes are the models they are named after (parameter counts within 1%)."""
    from transformers import LlamaConfig

    published = {"smollm2-135m": 134.5e6, "llama-3.2-1b": 1.236e9, "llama-3-8b": 8.03e9}
    for name, n in published.items():
        facts = scale.shape_facts(LlamaConfig(**scale.SHAPES[name]))
        assert abs(facts["params"] / n - 1) < 0.01, (name, facts["params"])


def test_ideal_formulas_by_hand():
    """llama-3-8b at 128k, bf16: vanilla reads 15 GiB of weights + 16 GiB of KV per decode step;
    LM-Infinite (10 + 8192 keys) 1/16 of that KV; prefill attention pairs T(T+1)/2 vs the window's."""
    from transformers import LlamaConfig

    from lcx import presets

    facts = scale.shape_facts(LlamaConfig(**scale.SHAPES["llama-3-8b"]))
    T = 131072
    van = scale.ideal(facts, None, T, 2)
    lmi = presets.config("lm_infinite", L0=8192, factor=16).attention
    win = scale.ideal(facts, lmi, T, 2)
    assert van["decode_kv_bytes_per_step"] == 32 * 2 * 8 * 128 * T * 2 == 16 * 2**30
    assert win["decode_kv_bytes_per_step"] == 32 * 2 * 8 * 128 * (8192 + 10) * 2
    assert scale.attention_pairs(None, 5) == 15
    W = 8202
    assert scale.attention_pairs(lmi, T) == W * (W + 1) // 2 + (T - W) * W
    matmul = 2 * facts["params_per_token"] * T + 2 * facts["lm_head_params"]
    assert van["prefill_flops"] == matmul + 4 * 32 * 32 * 128 * T * (T + 1) // 2
    assert 2.5 < van["prefill_flops"] / win["prefill_flops"] < 3  # attention: 71% of vanilla's FLOPs at 128k
