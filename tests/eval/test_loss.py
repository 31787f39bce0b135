"""Chunked loss (lcx.eval.loss): token log-probabilities without `[B, T, vocab]` logits equal the
full-logits computation — exactly in float64 — in `lcx eval ppl` and in the `lcx` lm-eval model
(against lm-eval's own HFLM scoring on the same instance)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from lcx.eval.loss import (
    DEFAULT_MAX_LOGITS_BYTES,
    check_head,
    chunk_tokens,
    head_logits,
    hidden_states,
    sequence_nll,
    token_logprobs,
)

# (batch, length, tokens per chunk): odd sizes, a chunk of 1, a chunk larger than B*T
CHUNK_CASES = [(1, 63, 1), (2, 17, 5), (3, 33, 64), (1, 2, 7), (2, 40, 10_000)]
# "exact" in float64: a few ulps of values ~5 nats (1 ulp = 8.9e-16); float32 rounding is ~1e-7
EXACT = 1e-13


def _tiny(dtype=torch.float64, **overrides):
    from lcx.models.tiny import tiny_llama

    model, tok = tiny_llama(seed=0, **overrides)
    return model.to(dtype).eval(), tok


def _bytes_for(model, tokens: int) -> int:
    return tokens * 4 * model.get_output_embeddings().weight.shape[0]


def _full_nll(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                           reduction="none").view(ids.shape[0], -1).double()


@pytest.mark.parametrize("B, T, chunk", CHUNK_CASES, ids=lambda v: str(v))
def test_sequence_nll_equals_full_logits_exactly_in_float64(B, T, chunk):
    model, _ = _tiny(torch.float64)
    ids = torch.randint(3, 259, (B, T), generator=torch.Generator().manual_seed(B * T))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]  # [B, T-1, V] float64
        want = -logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    got = sequence_nll(model, ids, max_logits_bytes=_bytes_for(model, chunk), softmax_dtype=None)
    assert got.dtype == torch.float64 and got.shape == (B, T - 1)
    # the head's matmul over a chunk of rows may round the last bit differently from the whole batch
    torch.testing.assert_close(got, want, rtol=0, atol=EXACT)


@pytest.mark.parametrize("B, T, chunk", CHUNK_CASES[:3], ids=lambda v: str(v))
def test_sequence_nll_matches_cross_entropy_in_float32(B, T, chunk):
    model, _ = _tiny(torch.float32)
    ids = torch.randint(3, 259, (B, T), generator=torch.Generator().manual_seed(7 + T))
    with torch.no_grad():
        want = _full_nll(model, ids)
    got = sequence_nll(model, ids, max_logits_bytes=_bytes_for(model, chunk))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_token_logprobs_greedy_flags_and_argument_checks():
    model, _ = _tiny(torch.float64)
    ids = torch.randint(3, 259, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = hidden_states(model, ids)[0]  # [30, H]
        argmax = model(input_ids=ids).logits[0].argmax(-1)
    targets = ids[0].clone()
    targets[::2] = argmax[::2]  # every other target is the greedy token
    lp, greedy = token_logprobs(model, h, targets, max_logits_bytes=_bytes_for(model, 4))
    assert torch.equal(greedy, targets == argmax) and greedy[::2].all()
    assert (lp <= 0).all()
    with pytest.raises(ValueError, match=r"hidden must be \[N, H\]"):
        token_logprobs(model, h[None], targets)
    with pytest.raises(ValueError, match="below one token's logits"):
        chunk_tokens(262_144, 1000)
    # the documented bound: Gemma 3's vocabulary -> 256 tokens per 256 MiB chunk
    assert chunk_tokens(262_144) == 256 and DEFAULT_MAX_LOGITS_BYTES == 1 << 28


def test_head_applies_gemma3_final_softcap():
    """A random gemma3_text with final_logit_softcapping: head_logits = the model's own logits."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=0.05,
                           max_position_embeddings=64)
    model = Gemma3ForCausalLM(cfg).double().eval()
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        raw = model.lm_head(hidden_states(model, ids))
    assert want.abs().max() < 0.05 < raw.abs().max()  # the cap is active
    assert torch.equal(head_logits(model, hidden_states(model, ids)), want)
    check_head(model)
    nll = sequence_nll(model, ids, max_logits_bytes=_bytes_for(model, 3), softmax_dtype=None)
    torch.testing.assert_close(nll, -want[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0], rtol=0, atol=EXACT)


def test_unknown_head_post_processing_is_refused():
    """A forward that post-processes its logits in a way the family table does not say (here a
    Llama whose forward doubles them) is refused by name, not scored wrongly. (Cohere's
    logit_scale, once refused here, is in the table: tests/hf/test_families.py.)"""
    from lcx.hf.models import tiny_model

    model = tiny_model("llama", seed=0)
    forward = model.forward

    def doubled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.forward = doubled
    with pytest.raises(ValueError, match=r"llama.*chunked loss"):
        check_head(model)
    with pytest.raises(ValueError, match="llama"):
        sequence_nll(model, torch.tensor([[1, 2, 3, 4]]))


# --------------------------------------------------------------------------------------------
# the lcx lm-eval model: its chunked _loglikelihood_tokens against HFLM's
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lcx_lm(tiny_model_dir):
    pytest.importorskip("lm_eval")
    from lcx.lmeval_model import LcxLM

    return LcxLM(pretrained=str(tiny_model_dir), dtype="float64", batch_size=3, max_length=48,
                 allow_truncation=True)  # HFLM's left truncation, compared below (lcx.truncation)


def _requests(tok):
    def enc(s):
        return tok(s, add_special_tokens=False).input_ids

    ctx = "The quick brown fox jumps over the lazy dog. " * 2
    reqs = [((ctx, c), enc(ctx), enc(c)) for c in ("a", "b", "z", " jumps", " sleeps all day")]  # one-token group
    long_ctx = "When shall we three meet again in thunder? " * 3  # > max_length: truncated on the left
    reqs.append(((long_ctx, " In rain."), enc(long_ctx), enc(" In rain.")))
    reqs.append((None, [1], enc("A rolling window with no context but the prefix token.")[:40]))
    reqs.append((("x", "y"), enc("x"), enc("y")))  # one token each
    return reqs


@pytest.mark.parametrize("logits_cache", [True, False])
def test_lcx_model_loglikelihood_equals_hflm(lcx_lm, logits_cache):
    from lm_eval.models.huggingface import HFLM

    lcx_lm.logits_cache = logits_cache
    reqs = _requests(lcx_lm.tokenizer)
    assert len(reqs[5][1]) + len(reqs[5][2]) > lcx_lm.max_length + 1
    got = lcx_lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    want = HFLM._loglikelihood_tokens(lcx_lm, reqs, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in want]
    for (a, _), (b, _) in zip(got, want):  # float64 model: equal to float64 rounding
        assert a == pytest.approx(b, rel=0, abs=EXACT)
    assert any(g for _, g in got) or all(ll < 0 for ll, _ in got)


def test_lcx_model_rolling_equals_hflm(lcx_lm, monkeypatch):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from lcx.lmeval_model import LcxLM

    text = "Now it came to pass in the days when the judges ruled, that there was a famine. " * 2
    reqs = [Instance("loglikelihood_rolling", doc={}, arguments=(text,), idx=0),
            Instance("loglikelihood_rolling", doc={}, arguments=(text[:37],), idx=1)]
    assert len(lcx_lm.tok_encode(text)) > 2 * lcx_lm.max_length  # several windows
    got = lcx_lm.loglikelihood_rolling(reqs, disable_tqdm=True)
    monkeypatch.setattr(LcxLM, "_loglikelihood_tokens", HFLM._loglikelihood_tokens)
    want = lcx_lm.loglikelihood_rolling(reqs, disable_tqdm=True)
    assert got == pytest.approx(want, rel=0, abs=EXACT)


def test_lcx_model_float32_loglikelihood_close_to_hflm(tiny_model_dir):
    from lm_eval.models.huggingface import HFLM

    from lcx.lmeval_model import LcxLM

    lm = LcxLM(pretrained=str(tiny_model_dir), batch_size=2, max_length=48, allow_truncation=True)
    reqs = _requests(lm.tokenizer)
    got = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    want = types.MethodType(HFLM._loglikelihood_tokens, lm)(reqs, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in want]
    for (a, _), (b, _) in zip(got, want):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


def test_lcx_model_scores_a_windowed_model_as_loaded_per_row(tiny_gemma3_dir, monkeypatch):
    """Gemma 3 under dynamic NTK stays as loaded (its RoPE basis follows the length), yet its
    sliding layers need no [T, T] mask: the lcx model scores loglikelihoods inside the engine's
    `forward_scope` (per row on lcx's backend, `loaded_rows`), equal to HFLM's masked forward
    on requests longer than the sliding window (32)."""
    import lcx.hf.attention_call as ac  # the per-call part, where the hooked calls look these up
    from lm_eval.models.huggingface import HFLM

    from lcx.lmeval_model import LcxLM

    lm = LcxLM(pretrained=str(tiny_gemma3_dir), dtype="float64", batch_size=3, max_length=48, allow_truncation=True,
               rope_type="dynamic", factor=2.0)
    assert lm.lcx_engine._whole_prompt_rows and lm.lcx_engine.methods.attention is None
    calls = []
    real = ac.attend_loaded_rows
    monkeypatch.setattr(ac, "attend_loaded_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    reqs = _requests(lm.tokenizer)
    assert max(len(c) + len(x) for _, c, x in reqs) > 32
    got = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    assert calls
    n = len(calls)
    want = HFLM._loglikelihood_tokens(lm, reqs, disable_tqdm=True)  # the model's own masked forward
    assert len(calls) == n
    assert [g for _, g in got] == [g for _, g in want]
    for (a, _), (b, _) in zip(got, want):
        assert a == pytest.approx(b, rel=0, abs=1e-9)
