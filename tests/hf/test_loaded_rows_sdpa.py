"""A prefill continuing from held keys on a model as loaded (`lcx.hf.engine_hook.loaded_rows`):
up to `MASKED_SDPA_MAX_QUERIES` new tokens per row run torch's SDPA with the rows' [Tq, Tk] mask,
causal rows of `BLOCK_CAUSAL_QUERIES` new tokens run `block_causal`, the rest lcx's flash backend
(torch's paths, without lcx's C++ kernel; with it, every float32 row runs the kernel:
tests/kernels/test_causal_attention_cpu.py); each equals the reference attention (causal and a
sliding window, GQA, odd lengths)."""

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


@pytest.mark.parametrize("nq,n", [(1, 1), (5, 5), (9, 40), (17, 17), (31, 64), (64, 64), (65, 130), (100, 333)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("block", [8, 64])
def test_block_causal_is_the_reference(nq, n, heads, block):
    H, Hkv = heads
    g = torch.Generator().manual_seed(nq * 1000 + n + H)
    q = torch.randn(2, nq, H, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, n, Hkv, 16, generator=g, dtype=torch.float64) for _ in range(2))
    want = attention(q, k, v, AttentionSpec(mask=causal_mask, scale=0.3), backend="ref")
    torch.testing.assert_close(ac.block_causal(q, k, v, 0.3, block), want, rtol=1e-10, atol=1e-10)
    # float32: within twice torch's own fused float32 error against the float64 reference
    got = ac.block_causal(q.float(), k.float(), v.float(), 0.3, block).double()
    sdpa = ac._masked_sdpa(q.float(), k.float(), v.float(), None, 0.3).double()
    assert (got - want).abs().max() <= 2 * (sdpa - want).abs().max() + 1e-7


def test_the_engine_continues_short_and_long_runs_on_each_path(monkeypatch, tiny_model):
    from lcx.engine import Engine, EngineConfig, SamplingParams

    from lcx.kernels.cpu import causal_attention as native

    model, tok = tiny_model
    calls = {"sdpa": 0, "blocks": 0, "cpp": 0}
    real, real_blocks, real_cpp = ac._masked_sdpa, ac.block_causal, native.causal_attention_cpu
    monkeypatch.setattr(ac, "_masked_sdpa", lambda *a: calls.__setitem__("sdpa", calls["sdpa"] + 1) or real(*a))
    monkeypatch.setattr(ac, "block_causal",
                        lambda *a: calls.__setitem__("blocks", calls["blocks"] + 1) or real_blocks(*a))
    monkeypatch.setattr(native, "causal_attention_cpu",
                        lambda *a: calls.__setitem__("cpp", calls["cpp"] + 1) or real_cpp(*a))
    system = [(5 * i) % 90 + 7 for i in range(300)]
    prompts = [system + [11, 12, 13], system + [21, 22] * 140]  # 3 and 280 new tokens after a cache hit
    sp = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
    outs = {}
    # every continuation on the flash backend; every one masked; every one in causal blocks (torch's
    # paths: the C++ kernel off); every one on the C++ kernel, where it builds
    cases = [("flash", 0, (0, 0)), ("masked", 10_000, (0, 0)), ("blocks", 0, (1, 10_000))]
    if native.unavailable() is None:
        cases.append(("cpp", 0, (0, 0)))
    for case, limit, blocks in cases:
        monkeypatch.setenv("LCX_NATIVE_ROWS", "1" if case == "cpp" else "0")
        monkeypatch.setattr(ac, "MASKED_SDPA_MAX_QUERIES", limit)
        monkeypatch.setattr(ac, "BLOCK_CAUSAL_QUERIES", blocks)
        before = dict(calls)
        eng = Engine(model, tok, EngineConfig(max_model_len=1024, prefix_block_size=16))
        eng.generate([system + [1]], SamplingParams(max_tokens=1, ignore_eos=True))
        outs[case] = [eng.generate([p], sp)[0] for p in prompts]
        assert eng.stats.prefix_cache_hit_tokens >= 2 * 288
        ran = {k: calls[k] - before[k] for k in calls}
        assert ran["blocks"] > 0 if case == "blocks" else ran["blocks"] == 0
        assert (ran["sdpa"] > 0) == (case == "masked") and (ran["cpp"] > 0) == (case == "cpp")
    for case, *_ in cases[1:]:
        for a, b in zip(outs["flash"], outs[case]):
            assert a.token_ids == b.token_ids
            assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-5)
