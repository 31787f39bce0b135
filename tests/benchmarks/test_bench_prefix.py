"""`lcx bench prefix`: one tiny end-to-end run (the record's shape, ratios from the same run,
the same tokens with and without the cache, hits on the shared prefixes) and its loads' sharing;
with vLLM (marker `vllm`), its section: vLLM's prefix caching on the same loads."""

from __future__ import annotations

import json

import pytest

from benchmarks.prefix import Config, passkey_load, system_prompt_load
from lcx.cli import main

CFG = Config("tiny-5m", requests=6, concurrency=2, system_tokens=48, question_tokens=5, passkey_length=120,
             depths=4, max_tokens=2, repeats=1, threads=1)


# the concurrent load, small: 5 prompts of 9 tokens, 3 in flight, 2 tokens each
CONCURRENT = ["--concurrent-requests", "5", "--concurrent-in-flight", "3", "--concurrent-prompt-tokens", "9",
              "--concurrent-max-tokens", "2"]


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
                 "--repeats", "1", "--no-vllm", *CONCURRENT, "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["config"]["requests"] == 6 and rec["environment"]["git"]["sha"]
    assert rec["config"]["vllm"] is False and rec["vllm"] == {"skipped": "--no-vllm"}
    for load in ("system_prompt", "passkey_sweep"):
        row = rec["results"][load]
        assert row["same_tokens"] is True
        assert row["no_cache"]["hit_rate"] == 0 and row["cache"]["hit_rate"] > 0
        assert row["cache"]["prompt_tokens_computed"] < row["no_cache"]["prompt_tokens_computed"]
        assert set(row["ratio_cache_vs_no_cache"]) == {"gen_tok_s", "ttft_p50", "prompt_tokens_computed"}
    row = rec["results"]["concurrent"]  # nothing shared: nothing reused, all prompts in flight at once
    assert row["same_tokens"] is True and row["cache"]["hit_rate"] == 0 and row["concurrency"] == 3
    assert row["prompts"] == 5 and row["prompt_tokens"] == 5 * 9
    assert rec["environment"]["lcx_engine"]["max_batch"] >= 3
    assert rec["environment"]["lcx_engine"]["mixed_step"] is True  # (tiny-5m: a Llama decoder, the lean forward)
    for load, row in rec["results"].items():  # lcx's step counts: decode steps, prefill calls, mixed steps
        for s in ("no_cache", "cache"):
            st = row[s]["steps"]
            assert st["decode_steps"] > 0 and st["prefill_batches"] > 0, (load, s, st)
            assert 0 <= st["mixed_steps"] <= min(st["decode_steps"], st["prefill_batches"])


@pytest.mark.parametrize("flag", ["--requests", "--concurrency", "--passkey-length", "--repeats", "--vllm-block-size",
                                  "--concurrent-requests", "--concurrent-in-flight", "--concurrent-max-tokens"])
def test_bench_prefix_refuses_bad_sizes(flag, tmp_path, capsys):
    """A size below 1 is a clear error naming the flag, before any model or vLLM starts."""
    assert main(["bench", "prefix", flag, "0", "--out", str(tmp_path / "x.json")]) == 2
    assert flag in capsys.readouterr().err and not (tmp_path / "x.json").exists()


@pytest.mark.slow
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


@pytest.mark.parametrize("argv, says", [
    (["--baseline-at", "HEAD"], "--baseline-at goes with --cell"),
    (["--cell", "lm_infinite", "--model", "tiny-ret-5m", "--baseline-at", "no-such-rev"], "not a commit"),
])
def test_bench_prefix_baseline_at_refuses_misuse(argv, says, tmp_path, capsys):
    """`--baseline-at` without `--cell`, or naming no commit: a clear error before any model runs."""
    assert main(["bench", "prefix", *argv, "--no-vllm", "--out", str(tmp_path / "x.json")]) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_bench_prefix_cell_baseline_at_a_commit(tmp_path):
    """`--cell --baseline-at REV`: the no-cache setting runs on REV's code (a `git archive` of it),
    recorded by its full sha; at HEAD both settings answer alike."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    out = tmp_path / "cell.json"
    assert main(["bench", "prefix", "--cell", "lm_infinite", "--model", "tiny-ret-5m", "--passkey-length", "1024",
                 "--depths", "2", "--samples-per-depth", "1", "--baseline-at", "HEAD", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["config"]["baseline_at"]["sha"] == sha and rec["config"]["baseline_at"]["rev"] == "HEAD"
    res = rec["results"]
    assert res["same_answers"] is True and len(res["cache"]["answers"]) == 2
    assert res["no_cache"]["cpu_s"] > 0 and not res["no_cache"]["prefix_cache_on"]
    assert res["cache"]["allocator"]["allocator"] in ("reuse", "system") and "allocator" in res["no_cache"]


# The vLLM test's load: a system prompt longer than vLLM's CPU block (128 tokens, the unit its
# prefix cache reuses) and passkey prompts whose shared prefixes span a block, so both loads can hit.
VLLM_LOAD = ["--requests", "4", "--concurrency", "2", "--system-tokens", "160", "--question-tokens", "8",
             "--passkey-length", "400", "--depths", "3", "--max-tokens", "3", "--repeats", "1",
             "--concurrent-requests", "5", "--concurrent-in-flight", "3", "--concurrent-prompt-tokens", "9",
             "--concurrent-max-tokens", "3"]


@pytest.mark.vllm
def test_bench_prefix_vllm_section(tmp_path, vllm_python):
    """The record's `vllm` section end to end on a tiny load: vLLM with and without its prefix
    cache on lcx's prompts, the same tokens both ways, hits only with the cache, the ratios."""
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", *VLLM_LOAD, "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    sec = rec["vllm"]
    assert "skipped" not in sec, sec
    assert sec["engine"]["vllm"] and sec["engine"]["block_size"] <= 128 and sec["engine"]["multiprocessing"] is False
    assert sec["notes"] and set(sec["loads"]) == set(rec["results"]) == {"system_prompt", "passkey_sweep", "concurrent"}
    assert rec["environment"]["lcx_engine"]["max_batch"] == sec["engine"]["max_num_seqs"]
    assert rec["environment"]["lcx_engine"]["max_num_batched_tokens"] == sec["engine"]["max_num_batched_tokens"]
    assert sec["loads"]["concurrent"]["cache"]["hit_rate"] == 0
    for load, row in ((k, v) for k, v in sec["loads"].items() if k != "concurrent"):
        lcx_row = rec["results"][load]
        assert row["prompts"] == lcx_row["prompts"] and row["prompt_tokens"] == lcx_row["prompt_tokens"]
        assert row["same_tokens"] is True, load  # vLLM with and without its cache
        assert row["no_cache"]["hit_rate"] == 0 and row["cache"]["hit_rate"] > 0, (load, row)
        assert row["no_cache"]["prompt_tokens_computed"] == row["prompt_tokens"]
        assert row["cache"]["prompt_tokens_computed"] < row["no_cache"]["prompt_tokens_computed"]
        assert min(row[s][k] for s in ("cache", "no_cache") for k in ("wall_s", "gen_tok_s", "ttft_p50_s")) > 0
        assert set(row["ratio_cache_vs_no_cache"]) == {"gen_tok_s", "ttft_p50", "prompt_tokens_computed"}
        for s in ("cache", "no_cache"):
            r = row["ratio_vllm_vs_lcx"][s]
            assert r["gen_tok_s"] == pytest.approx(row[s]["gen_tok_s"] / lcx_row[s]["gen_tok_s"], rel=1e-2)
        assert isinstance(row["same_tokens_as_lcx"], bool)
        assert 0 <= row["requests_same_as_lcx"] <= row["requests_same_first_token_as_lcx"] <= row["prompts"]
