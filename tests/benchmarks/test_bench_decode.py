"""`lcx bench decode` at toy scale: the run record's shape, every case on the engine's fast path,
ratios finite, bounded methods' KV constant across lengths (the timing itself is not a test)."""

from __future__ import annotations

import json
import math

from benchmarks.decode import CASES, default_cases, main, visible_keys
from lcx.methods import lm_infinite, self_extend, sinks, sliding_window


def test_visible_keys_per_method():
    assert visible_keys(None, 100) == 100
    assert visible_keys(lm_infinite(10, 64), 100) == 74 and visible_keys(lm_infinite(10, 64), 50) == 50
    assert visible_keys(sinks(4, 60), 100) == 64
    assert visible_keys(sliding_window(window=64), 100) == 64
    assert visible_keys(self_extend(3, 16), 100) == 100  # every key, grouped or not


def test_bench_decode_record(tmp_path):
    out = tmp_path / "d.json"
    assert main(["--lengths", "48", "96", "--layers", "2", "--tokens", "3", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec["results"]) == {"48", "96"}
    kv = {}
    for T, row in rec["results"].items():
        assert set(row) == set(default_cases("smollm2-135m")) == {c.name for c in CASES if c.layers is None and c.default}
        for name, r in row.items():
            assert r["fast_path"], name  # every case decodes on the cache of rotated keys
            assert len(r["cpu_s"]) == 3 and r["tokens_per_s"] > 0
            assert math.isfinite(r["ratio"]) and math.isfinite(r["ideal_ratio"])
            kv.setdefault(name, []).append(r["kv_bytes"])
        assert row["vanilla"]["ratio"] == 1.0
    # windows of 1024 cover both toy lengths: every cache grows with the prompt here
    assert kv["vanilla"][1] > kv["vanilla"][0]
    assert out.with_suffix(".png").exists()


def test_bench_decode_merge(tmp_path):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    assert main(["--lengths", "40", "--layers", "1", "--tokens", "3", "--cases", "vanilla", "sinks/w1024",
                 "--out", str(a)]) == 0
    assert main(["--lengths", "70", "--layers", "1", "--tokens", "3", "--cases", "vanilla", "sinks/w1024",
                 "--out", str(b)]) == 0
    assert main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert list(rec["results"]) == ["40", "70"] and rec["config"]["lengths"] == [40, 70]
    d = tmp_path / "d.json"  # another length with fewer cases joins too
    assert main(["--lengths", "90", "--layers", "1", "--tokens", "3", "--cases", "vanilla", "--out", str(d)]) == 0
    assert main(["--merge", str(a), str(b), str(d), "--out", str(out)]) == 0
    assert set(json.loads(out.read_text())["results"]["90"]) == {"vanilla"}
    c = tmp_path / "c.json"
    assert main(["--lengths", "40", "--layers", "1", "--tokens", "4", "--cases", "vanilla", "--out", str(c)]) == 0
    import pytest

    with pytest.raises(ValueError, match="only lengths"):
        main(["--merge", str(a), str(c), "--out", str(tmp_path / "x.json")])


def test_bench_decode_gemma3_shape(tmp_path):
    """Gemma 3's hybrid shape (6 of its layers: sliding 0-4, global 5; a small vocabulary): the
    record holds KV bytes per layer, and past the 512-token window vanilla's sliding layers hold
    512 slots while its global layer holds every position; the method on all layers reaches them."""
    from benchmarks.decode import DEFAULT_CASES

    assert set(DEFAULT_CASES["gemma3-270m"]) <= {c.name for c in CASES}
    out = tmp_path / "g.json"
    T, tokens = 520, 3
    assert main(["--shape", "gemma3-270m", "--layers", "6", "--vocab", "256", "--lengths", str(T), "--tokens",
                 str(tokens), "--cases", "vanilla", "sinks/w1024/all", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["config"]["shape"] == "gemma3-270m" and rec["config"]["vocab"] == 256
    row = rec["results"][str(T)]
    per_slot = 2 * 1 * 256 * 4  # k + v, 1 KV head of 256, float32
    van, every = row["vanilla"]["kv_bytes_per_layer"], row["sinks/w1024/all"]["kv_bytes_per_layer"]
    assert van[:5] == [512 * per_slot] * 5 and van[5] > T * per_slot
    assert row["vanilla"]["visible_keys_per_layer"] == [512] * 5 + [T + 1]
    assert all(b > 512 * per_slot for b in every) and row["sinks/w1024/all"]["fast_path"]
    assert sum(van) == row["vanilla"]["kv_bytes"]
