"""A prefill continuing from held keys on a model as loaded (`lcx.hf.engine_hook.loaded_rows`):
up to `MASKED_SDPA_MAX_QUERIES` new tokens per row run torch's SDPA with the rows' [Tq, Tk] mask,
more run lcx's flash backend; both equal the reference attention (causal and a sliding window,
GQA, odd lengths)."""

from __future__ import annotations

import pytest
import torch

from lcx.attention import AttentionSpec, attention
from lcx.hf import attention_call as ac
from lcx.masks import causal_mask, sliding_window


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("nq,n", [(1, 1), (1, 37), (7, 7), (13, 61), (33, 200)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_masked_sdpa_is_the_reference(window, nq, n, heads):
    H, Hkv = heads
    g = torch.Generator().manual_seed(nq * 1000 + n)
    q = torch.randn(2, nq, H, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, n, Hkv, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = causal_mask if window is None else sliding_window(left=window - 1)
    spec = AttentionSpec(mask=mask, scale=0.3)
    want = attention(q, k, v, spec, backend="ref")  # queries are the newest nq of the n keys
    got = ac._masked_sdpa(q, k, v, window, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_the_engine_continues_short_and_long_runs_on_each_path(monkeypatch, tiny_model):
    from lcx.engine import Engine, EngineConfig, SamplingParams

    model, tok = tiny_model
    calls = {"sdpa": 0, "flash": 0}
    real = ac._masked_sdpa
    monkeypatch.setattr(ac, "_masked_sdpa", lambda *a: calls.__setitem__("sdpa", calls["sdpa"] + 1) or real(*a))
    system = [(5 * i) % 90 + 7 for i in range(300)]
    prompts = [system + [11, 12, 13], system + [21, 22] * 140]  # 3 and 280 new tokens after a cache hit
    sp = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
    outs = {}
    for limit in (0, 10_000):  # every continuation on the flash backend; every one masked
        monkeypatch.setattr(ac, "MASKED_SDPA_MAX_QUERIES", limit)
        eng = Engine(model, tok, EngineConfig(max_model_len=1024, prefix_block_size=16))
        eng.generate([system + [1]], SamplingParams(max_tokens=1, ignore_eos=True))
        outs[limit] = [eng.generate([p], sp)[0] for p in prompts]
        assert eng.stats.prefix_cache_hit_tokens >= 2 * 288
    assert calls["sdpa"] > 0  # (the limit of 10,000 ran every continuation masked)
    for a, b in zip(outs[0], outs[10_000]):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-5)
