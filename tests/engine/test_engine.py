"""lcx.engine: batched prefill/decode equals unbatched equals HF generate; prompt logprobs equal a
plain forward; RoPE methods equal the patched model; sampling, stop strings, limits, methods,
failure isolation."""

from __future__ import annotations

import pytest
import torch

from lcx.engine import (
    ContextLengthError,
    Engine,
    EngineConfig,
    SamplingParams,
)
from lcx.hf.bounded_cache import greedy_generate
from lcx.hf.generate import greedy_decode_ref
from lcx.models.tiny import tiny_llama
from lcx.rope import ROPE_TYPES, RopeSpec
from lcx.testing import example_rope_spec

PROMPT_LENS = (1, 7, 23, 63)  # bytes = tokens with the tiny byte tokenizer; odd sizes
GEN = 9
L_SMALL = 32  # original context of the RoPE test model: prompt + GEN runs past it
ROPE_PROMPT = 41
HEAD_DIM = 16  # tiny_llama's




@pytest.fixture(scope="module")
def model64():
    """A private float64 tiny Llama: batched and unbatched runs agree token for token."""
    m, tok = tiny_llama(seed=0)
    return m.double().eval(), tok


def _prompts(tok, lens=PROMPT_LENS):
    text = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs!"
    return [tok(text[:n], add_special_tokens=False)["input_ids"] for n in lens]


# -------------------------------------------------------------------------------- greedy parity
def test_batched_equals_unbatched_equals_hf_generate(model64):
    model, tok = model64
    eng = Engine(model, tok, EngineConfig(max_batch=8))
    prompts = _prompts(tok)
    sp = SamplingParams(max_tokens=GEN, logprobs=0)
    solo = [eng.generate([p], sp)[0] for p in prompts]
    batch = eng.generate(prompts, sp)
    for p, a, b in zip(prompts, solo, batch):
        assert a.token_ids == b.token_ids
        assert a.text == b.text
        torch.testing.assert_close([x.logprob for x in a.logprobs], [x.logprob for x in b.logprobs],
                                   rtol=0, atol=1e-10)
        hf = model.generate(torch.tensor([p]), max_new_tokens=GEN, do_sample=False, pad_token_id=0)
        assert hf[0, len(p):].tolist() == a.token_ids
        # the reference decode loop (bounded caches: tests/engine/test_engine_attention.py)
        assert greedy_generate(model, torch.tensor([p]), GEN).tokens[0].tolist() == a.token_ids
    assert eng.stats.max_batch_size == len(prompts)


def test_greedy_decode_ref_loop():
    """The reference loop: argmax per row, `stop` sees each token and ends the loop with it, and
    the last token returned is never fed (its forward would be wasted)."""
    V = 10
    fed: list[list[int]] = []

    def feed(tok):  # [B] -> [B, V]: next token = (fed token + 3) mod V, row 1 one ahead
        fed.append(tok.tolist())
        return torch.nn.functional.one_hot((tok + 3) % V, V).double()

    first = torch.nn.functional.one_hot(torch.tensor([1, 2]), V).double()  # [B=2, V]
    out = greedy_decode_ref(feed, first, 4)
    assert out.tolist() == [[1, 4, 7, 0], [2, 5, 8, 1]]
    assert fed == [[1, 2], [4, 5], [7, 8]]
    fed.clear()
    out = greedy_decode_ref(feed, first[:1], 50, stop=lambda tok: int(tok[0]) == 7)
    assert out.tolist() == [[1, 4, 7]] and fed == [[1], [4]]
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_decode_ref(feed, first, 0)


def test_continuous_batching_joins_and_queues(model64):
    """Requests joining a running batch mid-way, and more requests than max_batch, still give
    every request its solo output."""
    model, tok = model64
    prompts = _prompts(tok) + _prompts(tok, (5, 40))
    sp = SamplingParams(max_tokens=GEN, ignore_eos=True)
    ref = Engine(model, tok)
    solo = {i: ref.generate([p], sp)[0].token_ids for i, p in enumerate(prompts)}
    eng = Engine(model, tok, EngineConfig(max_batch=3))
    out: dict[str, list[int]] = {}
    ids: dict[str, int] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or eng.has_work():
        if pending and steps % 2 == 0:  # one new request every other step
            i, p = pending.pop(0)
            ids[eng.add_request(p, sp)] = i
        for ev in eng.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
        steps += 1
        assert eng.num_running <= 3
    assert {ids[r]: t for r, t in out.items()} == solo
    assert eng.stats.max_batch_size == 3
    assert eng.cache_len == 0  # everything released


# -------------------------------------------------------------------------------- logprobs
def test_prompt_logprobs_equal_log_softmax_of_forward(tiny_model):
    model, tok = tiny_model
    eng = Engine(model, tok)
    prompts = _prompts(tok)
    outs = eng.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=3))
    for p, o in zip(prompts, outs):
        assert o.token_ids == [] and o.finish_reason == "length"
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        if len(p) == 1:
            continue
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([p])).logits[0].double(), -1)  # [T, V]
        want = lp[:-1].gather(1, torch.tensor(p[1:])[:, None]).squeeze(1)
        got = torch.tensor([e.logprob for e in o.prompt_logprobs[1:]], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        top_v, top_i = lp[:-1].topk(3, dim=-1)
        for j, e in enumerate(o.prompt_logprobs[1:]):
            assert [t for t, _ in e.top] == top_i[j].tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in e.top], dtype=torch.float64), top_v[j],
                                       rtol=0, atol=2e-5)


# -------------------------------------------------------------------------------- RoPE methods
def _example_spec(rope_type: str) -> dict:
    """Example parameters for every registered RoPE type (a new type without an example fails)."""
    return example_rope_spec(rope_type, head_dim=HEAD_DIM, original_max_position_embeddings=L_SMALL)


ROPE_GRID = sorted(ROPE_TYPES)


@pytest.mark.parametrize("rope_type", ROPE_GRID)
def test_rope_method_equals_patched_model(rope_type):
    """Engine with methods={"rope": spec} == the model patched with the same spec: logprobs of a
    full forward for static types; greedy tokens of HF generate for length-dependent types (whose
    basis changes per forward, so a cache holds keys of several bases, as in HF)."""
    from lcx.hf.rope_patch import current_spec

    model, tok = tiny_llama(seed=1, max_position_embeddings=L_SMALL)
    model = model.double()
    spec = _example_spec(rope_type)
    prompt = _prompts(tok, (ROPE_PROMPT,))[0]
    eng = Engine(model, tok, EngineConfig(methods={"rope": spec}, max_model_len=4 * L_SMALL))
    out = eng.generate([prompt], SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=0, prompt_logprobs=0))[0]
    # the engine patched `model` itself: it now is "the patched model"
    assert current_spec(model) == RopeSpec.for_model(spec, model.config)
    if RopeSpec.for_model(spec, model.config).is_length_dependent:
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=GEN, do_sample=False, pad_token_id=0,
                            eos_token_id=None)
        assert hf[0, len(prompt):].tolist() == out.token_ids
        return
    full = prompt + out.token_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([full])).logits[0], -1)  # [T, V]
    want = lp[:-1].gather(1, torch.tensor(full[1:])[:, None]).squeeze(1)
    got = [e.logprob for e in out.prompt_logprobs[1:]] + [e.logprob for e in out.logprobs]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=1e-9)
    assert out.token_ids == lp[len(prompt) - 1:-1].argmax(-1).tolist()  # greedy


def test_rope_factor_sets_default_max_model_len():
    model, tok = tiny_llama(seed=0, max_position_embeddings=L_SMALL)
    assert Engine(model, tok).max_model_len == L_SMALL
    eng = Engine(model, tok, EngineConfig(methods={"rope": {"rope_type": "yarn", "factor": 4}}))
    assert eng.max_model_len == 4 * L_SMALL
    assert Engine(model, tok, EngineConfig(max_model_len=1000)).max_model_len == 1000


# -------------------------------------------------------------------------------- sampling
def test_seeded_sampling_is_batch_independent(model64):
    model, tok = model64
    eng = Engine(model, tok)
    prompts = _prompts(tok)
    sp = SamplingParams(max_tokens=GEN, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    solo = eng.generate([prompts[2]], sp)[0].token_ids
    assert eng.generate(prompts, sp)[2].token_ids == solo
    other = eng.generate([prompts[2]], SamplingParams(max_tokens=GEN, temperature=0.9, seed=8, ignore_eos=True))
    greedy = eng.generate([prompts[2]], SamplingParams(max_tokens=GEN, ignore_eos=True))[0].token_ids
    assert solo != greedy or other[0].token_ids != greedy  # sampling does sample
    # top_p so small that only the most likely token survives == greedy
    tiny_p = eng.generate([prompts[2]], SamplingParams(max_tokens=GEN, temperature=5.0, top_p=1e-9, seed=1,
                                                       ignore_eos=True))[0].token_ids
    assert tiny_p == greedy


@pytest.fixture(scope="module")
def tiny5m():
    from lcx.models import MODELS

    if not MODELS["tiny-5m"].is_present():
        pytest.skip("the bundled tiny-5m model is not present")
    return Engine.from_pretrained("tiny-5m")


def test_stop_strings_cut_text_and_stream_consistently(tiny5m):
    eng = tiny5m
    prompt = eng.encode("ROMEO:")
    full = eng.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]  # a 3-char string from the middle
    assert stop.strip() and "\ufffd" not in stop
    out = eng.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop, "@@never@@")))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.find(stop)]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    # event texts (what a stream sends) add up to the final text; no stop-string prefix leaked
    rid = eng.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)))
    pieces = []
    while eng.has_work():
        pieces += [ev.text for ev in eng.step() if ev.request_id == rid]
    assert "".join(pieces) == out.text


def test_eos_and_stop_token_ids(model64):
    model, tok = model64
    eng = Engine(model, tok)
    p = _prompts(tok)[1]
    free = eng.generate([p], SamplingParams(max_tokens=GEN, ignore_eos=True))[0]
    t = free.token_ids[3]
    out = eng.generate([p], SamplingParams(max_tokens=GEN, stop_token_ids=(t,)))[0]
    first = free.token_ids.index(t)
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == t


# -------------------------------------------------------------------------------- limits, config
def test_max_model_len_is_enforced_never_truncated(tiny_model):
    model, tok = tiny_model
    eng = Engine(model, tok, EngineConfig(max_model_len=20))
    with pytest.raises(ContextLengthError, match="prompt has 21 tokens but max_model_len is 20") as e:
        eng.add_request(list(range(3, 24)), SamplingParams(max_tokens=0))
    assert e.value.param == "prompt"
    with pytest.raises(ContextLengthError, match="lower max_tokens to at most 10") as e:
        eng.add_request(list(range(3, 13)), SamplingParams(max_tokens=11))
    assert e.value.param == "max_tokens"
    out = eng.generate([list(range(3, 13))], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 10
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 259\)"):
        eng.add_request([5, 999], SamplingParams())
    assert not eng.has_work()


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=-1), "max_tokens must be an integer >= 0"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(logprobs=21), r"logprobs must be an integer in \[0, 20\]"),
    (dict(stop=("",)), "stop must be non-empty strings"),
    (dict(max_tokens=True), "max_tokens"),
])
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_methods_are_rejected():
    with pytest.raises(ValueError, match=r"unknown method config key\(s\) \['nope'\]; accepted: \['rope', 'attention'"):
        EngineConfig(methods={"nope": {}})
    with pytest.raises(ValueError, match=r"unknown method config key\(s\) \['backend_x'\]"):
        EngineConfig.from_dict({"methods": {"attention": {"type": "sinks", "n_sink": 1, "window": 4}, "backend_x": 1}})
    with pytest.raises(ValueError, match="attention method type 'lm_infinit' is not known"):
        Engine(*tiny_llama(seed=0), EngineConfig(methods={"attention": {"type": "lm_infinit"}}))
    with pytest.raises(ValueError, match=r"unknown EngineConfig key\(s\) \['max_len'\]"):
        EngineConfig.from_dict({"max_len": 5})
    with pytest.raises(ValueError, match="unknown RoPE key"):
        Engine(*tiny_llama(seed=0), EngineConfig(methods={"rope": {"rope_type": "yarn", "factr": 4}}))


# -------------------------------------------------------------------------------- failures, abort
def test_failure_of_one_request_spares_the_others(model64, monkeypatch):
    model, tok = model64
    prompts = _prompts(tok)
    sp = SamplingParams(max_tokens=GEN, ignore_eos=True)
    good = [o.token_ids for o in Engine(model, tok).generate(prompts, sp)]

    # (1) sampling raises for one request
    eng = Engine(model, tok)
    orig_sample = eng._sample

    def bad_sample(s, logits, greedy=None):
        if s.prompt_ids == prompts[2] and len(s.out_ids) == 3:
            raise RuntimeError("injected sampling failure")
        return orig_sample(s, logits, greedy)

    monkeypatch.setattr(eng, "_sample", bad_sample)
    outs = eng.generate(prompts, sp)
    assert outs[2].finish_reason == "error" and "injected" in str(outs[2].error)
    assert [o.token_ids for i, o in enumerate(outs) if i != 2] == [g for i, g in enumerate(good) if i != 2]

    # (2) the batched decode forward fails whenever row 1's request is in it: row-by-row retry
    eng = Engine(model, tok)
    orig_fwd = eng._decode_forward

    def bad_fwd(store, seqs):
        if any(s.prompt_ids == prompts[1] and len(s.out_ids) >= 2 for s in seqs):
            raise RuntimeError("injected forward failure")
        return orig_fwd(store, seqs)

    monkeypatch.setattr(eng, "_decode_forward", bad_fwd)
    outs = eng.generate(prompts, sp)
    assert outs[1].finish_reason == "error"
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [g for i, g in enumerate(good) if i != 1]
    assert eng.stats.finished["error"] == 1


def test_abort(model64):
    model, tok = model64
    eng = Engine(model, tok)
    prompts = _prompts(tok)
    sp = SamplingParams(max_tokens=GEN, ignore_eos=True)
    good = [o.token_ids for o in Engine(model, tok).generate(prompts, sp)]
    rids = [eng.add_request(p, sp) for p in prompts]
    got = {r: [] for r in rids}
    for _ in range(3):
        for ev in eng.step():
            got[ev.request_id] += ev.token_ids
    ev = eng.abort(rids[0])
    assert ev.finished and ev.finish_reason == "abort"
    assert eng.abort("no-such-request") is None
    while eng.has_work():
        for ev in eng.step():
            got[ev.request_id] += ev.token_ids
    assert [got[r] for r in rids[1:]] == good[1:]
    assert got[rids[0]] == good[0][:len(got[rids[0]])]


@pytest.mark.gpu
def test_engine_on_cuda_matches_cpu():
    """The same engine code on a CUDA model: prompt logprobs and the first sampled token agree
    with the CPU run (float32; later greedy tokens may differ at near-ties)."""
    model, tok = tiny_llama(seed=0)
    gpu_model, _ = tiny_llama(seed=0)
    gpu_model = gpu_model.to("cuda")
    prompts = _prompts(tok)
    sp = SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    cpu = Engine(model, tok).generate(prompts, sp)
    gpu = Engine(gpu_model, tok).generate(prompts, sp)
    for a, b in zip(cpu, gpu):
        got = [e.logprob for e in b.prompt_logprobs[1:]] + [b.logprobs[0].logprob]
        want = [e.logprob for e in a.prompt_logprobs[1:]] + [a.logprobs[0].logprob]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)
        assert a.token_ids[0] == b.token_ids[0]
        assert len(b.token_ids) == GEN


def test_tiny_repetition_penalty_stays_finite():
    """A penalty > 0 as small as float64 allows (1e-309) with temperature > 0 samples, never
    NaN: a positive logit divided by it stops at float64's largest value (#34)."""
    model, tok = tiny_llama(seed=0)
    out = Engine(model, tok).generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5, temperature=1.0,
                                                                     repetition_penalty=1e-309, seed=0))
    assert out[0].finish_reason in ("stop", "length") and out[0].error is None
