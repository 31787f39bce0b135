"""`lcx bench prefix`: one tiny end-to-end run (the record's shape, ratios from the same run,
the same tokens with and without the cache, hits on the shared prefixes) and its loads' sharing."""

from __future__ import annotations

import json

from benchmarks.prefix import Config, passkey_load, system_prompt_load
from lcx.cli import main

CFG = Config("tiny-5m", requests=6, concurrency=2, system_tokens=48, question_tokens=5, passkey_length=120,
             depths=4, max_tokens=2, repeats=1, threads=1)


def test_loads_share_what_they_should():
    sp = system_prompt_load(CFG, 259)
    assert len(sp) == CFG.requests and all(p[:CFG.system_tokens] == sp[0][:CFG.system_tokens] for p in sp)
    assert len({tuple(p) for p in sp}) == CFG.requests
    pk = passkey_load(CFG, 259)
    assert len(pk) == CFG.depths and {len(p) for p in pk} == {CFG.passkey_length}

    def shared(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))

    # deepest needle first: each prompt shares more with the one before than with a later one
    assert [shared(pk[0], p) for p in pk[1:]] == sorted((shared(pk[0], p) for p in pk[1:]), reverse=True)


def test_bench_prefix_end_to_end(tmp_path):
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", "--requests", "6", "--concurrency", "2", "--system-tokens", "48",
                 "--question-tokens", "5", "--passkey-length", "120", "--depths", "4", "--max-tokens", "2",
                 "--repeats", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["config"]["requests"] == 6 and rec["environment"]["git"]["sha"]
    for load in ("system_prompt", "passkey_sweep"):
        row = rec["results"][load]
        assert row["same_tokens"] is True
        assert row["no_cache"]["hit_rate"] == 0 and row["cache"]["hit_rate"] > 0
        assert row["cache"]["prompt_tokens_computed"] < row["no_cache"]["prompt_tokens_computed"]
        assert set(row["ratio_cache_vs_no_cache"]) == {"gen_tok_s", "ttft_p50", "prompt_tokens_computed"}


def test_bench_prefix_cell_reproduces_a_committed_report_cell(tmp_path):
    """`--cell`: the report's passkey cell with and without the cache, each in its own process,
    answers identical to each other and to the committed cell (LM-Infinite's preset depends on the
    model's context only, not on the sweep's longest length)."""
    from pathlib import Path

    cell = Path(__file__).resolve().parents[2] / "results/report/cells/lm_infinite.lmeval.1024.json.gz"
    out = tmp_path / "cell.json"
    assert main(["bench", "prefix", "--cell", "lm_infinite", "--model", "tiny-ret-5m", "--passkey-length", "1024",
                 "--depths", "6", "--samples-per-depth", "5", "--compare", str(cell), "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert res["same_answers"] is True and res["same_as_committed"] is True
    assert res["cache"]["prefix_cache_on"] and not res["no_cache"]["prefix_cache_on"]
    assert len(res["cache"]["answers"]) == 30 and res["cache"]["prefix_cache_hit_rate"] > 0
    assert res["cache"]["prompt_tokens_computed"] < res["no_cache"]["prompt_tokens_computed"]
    assert res["cache"]["cpu_s"] > 0 and res["ratio_cache_vs_no_cache"]["cpu_s"] > 0
