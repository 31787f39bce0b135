"""The `lcx` lm-eval model's generate_until at batch size 1 runs its requests in the engine's
reuse chain (#46 item 2): a passkey sweep's prompts deepest needle first, each reusing the
haystack up to its own needle from the prefix cache. Answers equal HFLM's own order; fewer prompt
tokens are computed."""

from __future__ import annotations

import pytest


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
DEPTHS = (0.2, 0.9, 0.5, 0.7, 0.35)  # needle depths, given out of order
# Keys of different lengths, as tokenization makes a real sweep's prompts differ by a token or two:
# HFLM's order (longest first) then mixes the depths, and consecutive prompts share less.


def _prompts(keys=(5123401, 60712, 33321987, 7001, 481502)) -> list[str]:
    hay = FILLER * 12
    out = []
    for d, k in zip(DEPTHS, keys):
        cut = hay.index(". ", int(len(hay) * d)) + 2  # at a sentence end
        out.append("There is a pass key hidden in this text. Find it and remember it. " + hay[:cut]
                   + f"A pass key is {k}. Remember it. {k} is the pass key. " + hay[cut:]
                   + "What is the pass key? The pass key is")
    return out


def test_reuse_chain_runs_a_passkey_sweep_deepest_needle_first():
    import lcx
    from lcx.engine import Engine, EngineConfig

    model, tok = lcx.load_model("tiny-ret-5m")
    engine = Engine(model, tok, EngineConfig(max_model_len=2048))
    ids = [tok(p, add_special_tokens=False).input_ids for p in _prompts()]
    deepest_first = sorted(range(len(DEPTHS)), key=lambda i: -DEPTHS[i])
    assert engine.reuse_chain(ids) == deepest_first
    off = Engine(model, tok, EngineConfig(max_model_len=2048, prefix_caching=False))
    assert off.reuse_chain(ids) == list(range(len(ids)))  # no cache: as given


def test_generate_until_in_the_reuse_chain_answers_as_hflm_and_computes_less():
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from lcx.lmeval_model import LcxLM

    lm = LcxLM(pretrained="tiny-ret-5m", batch_size=1, max_length=2048)
    reqs = [Instance("generate_until", doc={}, arguments=(p, {"until": ["\n", "."], "max_gen_toks": 8}), idx=i)
            for i, p in enumerate(_prompts())]
    engine = lm.lcx_engine
    # a cache that holds about one prompt, as 1 GiB holds one or two of SmolLM2's 16k prompts
    from lcx.hf.models import model_shape

    n_tok = [len(lm.tok_encode(r.args[0])) for r in reqs]
    engine.prefix_cache.max_bytes = model_shape(engine.model.config).kv_bytes_per_token(4) * (max(n_tok) + 32)

    def run(fn):
        engine.prefix_cache.clear()
        hit0 = engine.stats.prefix_cache_hit_tokens
        out = fn(lm, reqs, disable_tqdm=True)
        return out, engine.stats.prefix_cache_hit_tokens - hit0

    chain, chain_hits = run(LcxLM.generate_until)
    hflm, hflm_hits = run(HFLM.generate_until)
    assert chain == hflm  # the same answers, each request through HFLM's own code
    # deepest first: each later prompt reuses the instruction and the haystack up to its needle
    assert chain_hits > hflm_hits and chain_hits >= 0.3 * sum(n_tok)


def test_prefix_caching_model_arg_turns_the_cache_off_and_is_checked():
    from lcx.lmeval_model import LcxLM

    assert LcxLM(pretrained="tiny-ret-5m", prefix_caching="false").lcx_engine.prefix_cache is None
    assert LcxLM(pretrained="tiny-ret-5m", prefix_caching=True).lcx_engine.prefix_cache is not None
    with pytest.raises(ValueError, match="prefix_caching must be true or false"):
        LcxLM(pretrained="tiny-ret-5m", prefix_caching="sometimes")


def test_cache_bound_holds_the_longest_prompt_unless_given():
    """A 48k-token Gemma-3-270m prompt holds 1.8 GB of keys and values, beyond the engine's 1 GiB:
    with `prefix_cache_mb=auto` (the default) generate_until raises the bound to hold the longest
    prompt whole, so every prompt reuses its predecessor as with an unbounded cache; a bound given
    in MiB is kept, and a prompt longer than it keeps its first blocks (it still hits)."""
    from lm_eval.api.instance import Instance

    from lcx.hf.models import model_shape
    from lcx.lmeval_model import LcxLM

    reqs = [Instance("generate_until", doc={}, arguments=(p, {"until": ["\n"], "max_gen_toks": 2}), idx=i)
            for i, p in enumerate(_prompts())]

    def hits(lm):
        engine = lm.lcx_engine
        lm.generate_until(reqs, disable_tqdm=True)
        return engine.stats.prefix_cache_hit_tokens, engine.prefix_cache

    auto = LcxLM(pretrained="tiny-ret-5m", batch_size=1, max_length=2048)
    auto.lcx_engine.prefix_cache.max_bytes = 4096  # smaller than any prompt
    longest = max(len(auto.tok_encode(r.args[0])) for r in reqs)
    per_token = model_shape(auto.lcx_engine.model.config).kv_bytes_per_token(4)
    auto_hits, cache = hits(auto)
    assert cache.max_bytes >= longest * per_token and cache.stats.dropped_blocks == 0
    big_hits, _ = hits(LcxLM(pretrained="tiny-ret-5m", batch_size=1, max_length=2048))
    assert auto_hits == big_hits > 0
    # a bound of about a third of a prompt: kept, each prompt's head cached, fewer tokens reused
    mb = per_token * longest / 3 / (1 << 20)
    fixed_hits, cache = hits(LcxLM(pretrained="tiny-ret-5m", batch_size=1, max_length=2048, prefix_cache_mb=str(mb)))
    assert cache.max_bytes == int(mb * (1 << 20)) and cache.stats.dropped_blocks > 0
    assert 0 < fixed_hits < big_hits
    for bad in ("-1", "lots", True):
        with pytest.raises(ValueError, match="prefix_cache_mb"):
            LcxLM(pretrained="tiny-ret-5m", prefix_cache_mb=bad)


def _passkey_requests(n_gen=12):
    from lm_eval.api.instance import Instance

    return [Instance("generate_until", doc={}, arguments=(p, {"until": ["\n"], "max_gen_toks": n_gen}), idx=i)
            for i, p in enumerate(_prompts() + _prompts(keys=(91, 2024, 777777, 5, 3141592)))]


def test_generation_batch_answers_as_batch_size_one_and_decodes_together():
    """`generation_batch=N` (issue #76 item 6): the requests' tokens decoded together, each request
    then through HFLM's own code: the answers of batch size 1, in fewer decode steps."""
    from lcx.lmeval_model import LcxLM

    reqs = _passkey_requests(n_gen=24)
    one = LcxLM(pretrained="tiny-ret-5m", batch_size=1, max_length=2048)
    many = LcxLM(pretrained="tiny-ret-5m", batch_size=1, max_length=2048, generation_batch="8")
    want = one.generate_until(reqs, disable_tqdm=True)
    got = many.generate_until(reqs, disable_tqdm=True)
    assert got == want and len(set(want)) > 1
    assert many.lcx_engine.stats.decode_steps < 0.5 * one.lcx_engine.stats.decode_steps
    assert many.lcx_engine.stats.max_batch_size == 8


class _Journal:
    """lm-eval's cache hook as the report's journal sees it: every answer handed to it, in order."""

    def __init__(self):
        self.answers = []

    def add_partial(self, kind, key, value):
        self.answers.append(value)


def test_generation_batch_never_journals_a_planning_answer():
    """The plan pass runs HFLM with lm-eval's cache hook off: the journal holds the real answers only."""
    from lcx.lmeval_model import LcxLM

    lm = LcxLM(pretrained="tiny-ret-5m", batch_size=1, max_length=2048, generation_batch=4)
    journal = _Journal()
    lm.set_cache_hook(journal)
    out = lm.generate_until(_passkey_requests()[:5], disable_tqdm=True)
    assert journal.answers == out


@pytest.mark.parametrize("bad", ["0", "-2", "x", 1.5])
def test_generation_batch_is_checked(bad):
    from lcx.lmeval_model import LcxLM

    with pytest.raises(ValueError, match="generation_batch must be a positive integer"):
        LcxLM(pretrained="tiny-ret-5m", generation_batch=bad)


def test_generation_batch_journals_chunk_by_chunk(monkeypatch):
    """A run killed mid-cell loses at most the chunk in progress: the answers of finished chunks
    reached the cache hook (the journal) before the next chunk is planned."""
    import lcx.lmeval_model as m
    from lcx.lmeval_model import LcxLM

    monkeypatch.setattr(m, "GENERATION_CHUNK", 1)
    lm = LcxLM(pretrained="tiny-ret-5m", batch_size=1, max_length=2048, generation_batch=2)
    journal = _Journal()
    lm.set_cache_hook(journal)
    real, calls = lm.lcx_engine.generate, []

    def dies_at_the_third_chunk(prompts, params=None):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(prompts, params)

    lm.lcx_engine.generate = dies_at_the_third_chunk
    with pytest.raises(KeyboardInterrupt):
        lm.generate_until(_passkey_requests()[:6], disable_tqdm=True)
    assert calls == [2, 2, 2] and len(journal.answers) == 4  # two chunks answered and journaled
