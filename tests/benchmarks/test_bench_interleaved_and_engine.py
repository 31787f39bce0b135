"""Tiny end-to-end runs of two benchmark modes of issue #46: `lcx bench attention --interleave`
(all cases in one process, paired ratios, the FLOP ceiling, a profile) and `lcx bench prefill
--engine` (prefill through lcx's engine with default settings, ratios against vanilla)."""

from __future__ import annotations

import json

from lcx.cli import main


def test_bench_attention_interleaved_record(tmp_path):
    out = tmp_path / "a.json"
    T, G, L = 300, 4, 64
    assert main(["bench", "attention", "--lengths", str(T), "--cases", "dense_sdpa", "lambda/flash",
                 "--global", str(G), "--local", str(L), "--interleave", "3", "--out", str(out), "--no-plot"]) == 0
    rec = json.loads(out.read_text())
    assert rec["config"]["interleave"] == 3 and "not measured" in rec["config"]["memory_measure"]
    lam = rec["results"]["lambda/flash"][str(T)]
    dense = rec["results"]["dense_sdpa"][str(T)]
    assert len(lam["cpu_s_list"]) == len(dense["cpu_s_list"]) == 3 and len(lam["loadavg_1min"]) == 4
    assert lam["paired_speedup_list"] == [d / x for d, x in zip(dense["cpu_s_list"], lam["cpu_s_list"])]
    assert rec["summary"][str(T)]["lambda/flash"]["paired_speedup_vs_dense_sdpa"] == lam["paired_speedup"]
    c = rec["ceiling"][str(T)]
    per_key = 4 * 8 * 64  # B * H * (2 matmuls x 2 flops) * D
    assert c["dense_gflop"] * 1e9 == per_key * T * (T + 1) / 2
    # the mask's (query, key) pairs: min(i + 1, L) window keys + the globals outside the window
    pairs = sum(min(i + 1, L) + min(max(i - L + 1, 0), G) for i in range(T))
    assert abs(c["lambda_mask_gflop"] * 1e9 - per_key * pairs) < 1
    assert c["flop_ratio"] > 1 and c["lambda_flash_computed_gflop"] >= c["lambda_mask_gflop"]
    shares = rec["profile"][str(T)]["lambda/flash"]["self_cpu_share"]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in shares and 0 < sum(shares.values()) <= 1.0001


def test_bench_prefill_engine_record(tmp_path):
    out = tmp_path / "e.json"
    assert main(["bench", "prefill", "--engine", "--model", "tiny-5m", "--lengths", "64", "300", "--window", "128",
                 "--presets", "lm_infinite,sliding_window", "--repeats", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["config"]["lengths"] == [64, 300] and rec["config"]["window"] == 128
    assert list(rec["results"]) == ["vanilla", "lm_infinite", "sliding_window"]
    for name in ("lm_infinite", "sliding_window"):
        # default settings: no backend in the config asked for; the engine picked flash
        assert "backend" not in rec["results"][name]["config"]
        assert rec["results"][name]["engine_methods"]["backend"] == "flash"
        assert rec["summary"]["64"][name]["inside_window"] is True
        assert rec["summary"]["300"][name]["inside_window"] is False
    for n in ("64", "300"):
        assert rec["summary"][n]["vanilla"]["ratio_vs_vanilla"] == 1.0
        van = rec["summary"][n]["vanilla"]["cpu_s"]
        for name in ("lm_infinite", "sliding_window"):
            row = rec["summary"][n][name]
            assert abs(row["ratio_vs_vanilla"] - row["cpu_s"] / van) < 0.01 + 1e-3 / van


def test_bench_prefill_engine_profile(tmp_path):
    """`--profile`: one profiled prefill per method at the longest length, operators' shares and
    the GEMMs' / vanilla's attention kernel's throughput beside the process's sgemm."""
    out = tmp_path / "p.json"
    assert main(["bench", "prefill", "--engine", "--model", "tiny-5m", "--lengths", "64", "300", "--window", "128",
                 "--presets", "vanilla,lm_infinite", "--repeats", "1", "--profile", "--out", str(out)]) == 0
    prof = json.loads(out.read_text())["profile"]
    assert prof["length"] == 300 and prof["gemm_2048_gflops"] > 0
    for name in ("vanilla", "lm_infinite"):
        shares = prof[name]["self_cpu_share"]
        assert ("aten::mm" in shares or "mkldnn::_linear_pointwise" in shares) and 0 < sum(shares.values()) <= 1.0001
        assert prof[name]["gemm_gflops"] > 0 and prof[name]["self_cpu_s_total"] > 0
    assert prof["vanilla"]["attention_useful_gflops"] > 0 and "attention_useful_gflops" not in prof["lm_infinite"]
