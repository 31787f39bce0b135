"""Chunked prefill and the prefix cache (`lcx.engine.prefix`) are exact: greedy tokens identical
and logprobs equal (float64 model) with and without them, for every registered attention method
(`lcx.methods.registry.examples`) and every RoPE type (`lcx.rope.ROPE_TYPES`); refused (stated)
exactly where a prefix's keys depend on what follows. Grids generated from the registries."""

from __future__ import annotations

import pytest
import torch

from lcx.engine import Engine, EngineConfig, SamplingParams
from lcx.engine.prefix import PrefixCache
from lcx.methods import examples, method_id
from lcx.models.tiny import tiny_llama
from lcx.rope import ROPE_TYPES, RopeSpec
from lcx.testing import example_rope_spec

GEN = 8
BLOCK = 8
BUDGET = 13  # tokens per step: odd, so prompts are cut mid-way and chunks are whole blocks
L_SMALL = 32  # RoPE test model's context; the prompts run past it
HEAD_DIM = 16
TEXT = ("Sphinx of black quartz, judge my vow; the five boxing wizards jump quickly. "
        "Pack my box with five dozen liquor jugs! How vexingly quick daft zebras jump.")
SHARED = 45  # tokens shared by every prompt (byte tokenizer: bytes = tokens)
SUFFIXES = ("", " Then the fox", " and the dog ran off to see", "?")

# every registered method's examples, every RoPE type (with example values), a RoPE + method pair
METHODS = {method_id(m): {"attention": m.to_dict()} for m in examples()}


def _rope_example(rope_type: str) -> dict:
    return example_rope_spec(rope_type, head_dim=HEAD_DIM, original_max_position_embeddings=L_SMALL)


ROPES = {f"rope={t}": {"rope": _rope_example(t)} for t in sorted(ROPE_TYPES)}
CASES = {"vanilla": {}, **ROPES, **METHODS,
         "rope=yarn+lm_infinite": {"rope": _rope_example("yarn"),
                                   "attention": {"type": "lm_infinite", "n_global": 3, "n_local": 10}}}


@pytest.mark.parametrize("name", list(METHODS))
def test_call_dependence_is_what_attend_does(name):
    """`AttentionMethod.call_dependence` is None exactly where a query's output depends only on the
    keys up to it: the rows of a prefix call equal those rows of the whole call (the last row
    excepted where `last_query_extra`); where it names a reason, some prefix length differs."""
    from lcx.attention import Rotary
    from lcx.methods import method_from_dict

    method = method_from_dict(METHODS[name]["attention"])
    g = torch.Generator().manual_seed(0)
    T, D = 23, 8
    q, k, v = (torch.randn(1, T, h, D, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))

    def attend(n):
        return method.attend(q[:, :n], k[:, :n], v[:, :n], rotary=Rotary(inv_freq, torch.arange(n), 1.0),
                             backend="ref", layer_idx=1)

    full = attend(T)
    worst = max(float((full[:, :n - 1] - attend(n)[:, :n - 1]).abs().max()) for n in range(2, T))
    if method.call_dependence is None:
        assert worst < 1e-12
    else:
        assert worst > 1e-6




def _prompts(tok):
    base = tok(TEXT[:SHARED], add_special_tokens=False)["input_ids"]
    return [base + tok(sfx, add_special_tokens=False)["input_ids"] for sfx in SUFFIXES]


def _expected_refusal(methods: dict, model) -> bool:
    rope = methods.get("rope")
    if rope is not None and RopeSpec.for_model(rope, model.config).is_length_dependent:
        return True
    attn = methods.get("attention")
    if attn is None:
        return False
    from lcx.methods import method_from_dict

    return method_from_dict(attn).call_dependence is not None


def _run(methods, prompts, sp, **cfg):
    model, tok = tiny_llama(seed=2, max_position_embeddings=L_SMALL)
    model = model.double().eval()
    eng = Engine(model, tok, EngineConfig(methods=methods, max_model_len=4 * L_SMALL, **cfg))
    # one request after the other: each later prompt can reuse what the earlier ones left
    outs = [eng.generate([p], sp)[0] for p in prompts]
    return eng, outs


@pytest.mark.parametrize("case", list(CASES))
def test_prefix_cache_and_chunks_equal_whole_prefill(case):
    methods = CASES[case]
    model, tok = tiny_llama(seed=2, max_position_embeddings=L_SMALL)
    prompts = _prompts(tok)
    sp = SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=2)
    ref_eng, want = _run(methods, prompts, sp, prefix_caching=False)
    eng, got = _run(methods, prompts, sp, prefix_block_size=BLOCK, max_num_batched_tokens=BUDGET)
    assert ref_eng.stats.prefill_chunks == 0 and ref_eng.prefix_cache is None
    refused = _expected_refusal(methods, model.double())
    assert (eng.prefix_cache_refusal is not None) == refused, eng.prefix_cache_refusal
    if refused:
        assert eng.prefix_cache is None and eng.stats.prefix_cache_hits == 0
    else:
        # every later prompt reused the shared blocks; long prompts were cut into chunks
        assert eng.stats.prefix_cache_hits == len(prompts) - 1
        assert eng.stats.prefix_cache_hit_tokens == (len(prompts) - 1) * (SHARED // BLOCK * BLOCK)
        assert eng.stats.prompt_tokens_computed < ref_eng.stats.prompt_tokens_computed
        method = eng.methods.attention
        if method is None or not method.last_query_extra:
            assert eng.stats.prefill_chunks > 0
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor([e.logprob for e in b.logprobs], dtype=torch.float64),
                                   torch.tensor([e.logprob for e in a.logprobs], dtype=torch.float64),
                                   rtol=0, atol=1e-9)
        assert [[t for t, _ in e.top] for e in a.logprobs] == [[t for t, _ in e.top] for e in b.logprobs]


@pytest.mark.parametrize("case", ["vanilla", "lm_infinite(n_global=3,n_local=5)", "self_extend(group_size=2,window=4)"])
def test_chunked_prompt_logprobs_equal_whole(case):
    """prompt_logprobs computed chunk by chunk equal one call's (a request asking for them
    computes its whole prompt: it never reads the cache)."""
    methods = CASES[case]
    model, tok = tiny_llama(seed=2, max_position_embeddings=L_SMALL)
    prompts = _prompts(tok)[1:3]
    sp = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    _, want = _run(methods, prompts, sp, prefix_caching=False)
    eng, got = _run(methods, prompts, sp, prefix_block_size=BLOCK, max_num_batched_tokens=BUDGET)
    assert eng.stats.prefix_cache_hits == 0 and eng.stats.prefill_chunks > 0
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_ids)
        torch.testing.assert_close(torch.tensor([e.logprob for e in b.prompt_logprobs[1:]], dtype=torch.float64),
                                   torch.tensor([e.logprob for e in a.prompt_logprobs[1:]], dtype=torch.float64),
                                   rtol=0, atol=1e-9)


@pytest.mark.parametrize("case", ["sinks", "vanilla"])
def test_batched_continuations_equal_solo(case):
    """Several requests with different cached prefixes and chunk lengths in one prefill call
    (held KV left-padded, holes between held and new slots) == each run alone; the model as
    loaded (vanilla) too, whose continuations run per row (`loaded_rows`)."""
    methods = {"attention": {"type": "sinks", "n_sink": 2, "window": 6}} if case == "sinks" else {}
    model, tok = tiny_llama(seed=2, max_position_embeddings=L_SMALL)
    prompts = _prompts(tok)
    sp = SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=0)
    _, want = _run(methods, prompts, sp, prefix_caching=False)
    m, tok = tiny_llama(seed=2, max_position_embeddings=L_SMALL)
    eng = Engine(m.double().eval(), tok, EngineConfig(methods=methods, max_model_len=4 * L_SMALL,
                                                      prefix_block_size=BLOCK, max_num_batched_tokens=40))
    eng.generate([prompts[0][:20], prompts[0]], sp)  # fills the cache with two prefix lengths
    got = eng.generate([prompts[1], prompts[0][:20] + prompts[3][-1:], prompts[2]], sp)
    assert eng.stats.prefix_cache_hits >= 3
    assert [o.token_ids for o in got] == [want[1].token_ids, _run(methods, [prompts[0][:20] + prompts[3][-1:]], sp,
                                                                 prefix_caching=False)[1][0].token_ids,
                                          want[2].token_ids]


def test_model_as_loaded_continues_per_row_without_a_mask(monkeypatch):
    """An unpatched model continuing from held keys (prefix hit, later chunk) runs its attention
    per row on lcx's backend (`lcx.hf.attention_patch.loaded_rows`), not transformers' masked
    call: that path is taken, no mask is built; soft-capped calls (Gemma 2's) run on `blockwise`
    where the backend cannot cap (their exactness: the Gemma 2 rows of tests/hf/test_families.py,
    `test_engine_as_loaded_hybrid_fast_path` under dynamic NTK), and an unknown backend is refused."""
    import lcx.hf.attention_call as ac  # the per-call part, where the hooked calls look these up
    import lcx.hf.attention_patch as ap
    from lcx.engine.core import _loaded_rows_windows

    calls, masks = [], []
    real_attend, real_mask = ac.attend_loaded_rows, ac._no_mask
    monkeypatch.setattr(ac, "attend_loaded_rows", lambda *a, **k: calls.append(1) or real_attend(*a, **k))

    def spy_mask(**kwargs):
        out = real_mask(**kwargs)
        masks.append((ac.LOADED_ROWS.get() is not None, out is None))
        return out

    monkeypatch.setattr(ac, "_no_mask", spy_mask)  # registered by the engine's install_decode_hook
    model, tok = tiny_llama(seed=2, max_position_embeddings=L_SMALL)
    sp = SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=0)
    eng, _ = _run({}, _prompts(tok)[:2], sp, prefix_block_size=BLOCK, max_num_batched_tokens=BUDGET)
    assert eng._loaded_rows == (None,) * model.config.num_hidden_layers
    assert eng.stats.prefix_cache_hits == 1 and eng.stats.prefill_chunks > 0
    assert calls and any(active for active, _ in masks)
    assert all(none for active, none in masks if active)  # continuations built no mask
    monkeypatch.undo()
    ap.register()  # the real mask function again
    model.config.attn_logit_softcapping = 30.0
    n = model.config.num_hidden_layers
    assert _loaded_rows_windows(model, "flash") == (None,) * n and _loaded_rows_windows(model, "nope") is None


def test_bounded_method_holds_bounded_kv():
    """LM-Infinite prefilled in chunks holds G + L - 1 keys per layer between chunks, and a
    cached prefix is read back as only what the method can still see."""
    G, L = 3, 10
    model, tok = tiny_llama(seed=2, max_position_embeddings=L_SMALL)
    eng = Engine(model.double().eval(), tok, EngineConfig(
        methods={"attention": {"type": "lm_infinite", "n_global": G, "n_local": L}}, max_model_len=256,
        prefix_block_size=4, max_num_batched_tokens=8))
    prompt = _prompts(tok)[2]
    eng.add_request(prompt, SamplingParams(max_tokens=1))
    held = []
    while eng.has_work():
        eng.step()
        held += [s.kv.slots for s in eng._prefilling if s.kv is not None]
    assert held and max(held) == G + L - 1
    n, row = eng.prefix_cache.lookup(prompt, eng._window)
    assert row.slots == G + L - 1
    assert row.pos.tolist() == list(range(G)) + list(range(n - L + 1, n))


def test_prefix_cache_lru_and_chain():
    """The cache's own rules: whole blocks, never the last prompt token, chained keys (a block
    is found only after the same tokens), LRU eviction within the byte bound, tail first."""
    k = [torch.zeros(1, 40, 2)]  # one layer, 40 tokens: 1 * 40 * 2 * 4 bytes = 320 per tensor
    cache = PrefixCache({"m": 1}, block_size=4, max_bytes=10 * 2 * 4 * 4 * 2)  # room for 10 blocks
    a = list(range(40))
    cache.insert(a, 0, k, k)
    assert len(cache) == 9  # positions 0..35: 36 < 39 (never the last token's block 36..39)
    n, row = cache.lookup(a, None)
    assert n == 36 and row.slots == 36 and row.pos.tolist() == list(range(36))
    assert cache.lookup([7] + a[1:], None) == (0, None)  # a different first token: no block matches
    b = a[:8] + [99] * 32
    assert cache.lookup(b, None)[0] == 8  # shares exactly two blocks
    cache.insert(b, 0, k, k)  # 7 new blocks: 16 > 10, the least recently used (a's tail) go
    assert len(cache) == 10 and cache.nbytes <= cache.max_bytes and cache.stats.evicted_blocks == 6
    assert cache.lookup(b, None)[0] == 36
    assert cache.lookup(a, None)[0] == 12  # a's head survives (refreshed root-last), its tail went
    assert PrefixCache({"m": 2}).root != PrefixCache({"m": 1}).root  # another config: another chain
    # a prompt longer than the bound keeps its head, never evicting its own chain (a block whose
    # parent is gone is unreachable): 21 blocks into room for 10 -> blocks 0..9, the rest dropped
    c = list(range(100, 188))
    cache.insert(c, 0, [torch.zeros(1, 88, 2)], [torch.zeros(1, 88, 2)])
    assert cache.lookup(c, None)[0] == 40 and cache.stats.dropped_blocks == 11
    assert cache.lookup(a, None) == (0, None) and len(cache) == 10
    # a later call's blocks whose parent is not held are not stored (no lookup could reach them)
    d = list(range(300, 340))
    cache.insert(d, 8, k, k)
    assert cache.lookup(d, None) == (0, None) and cache.stats.dropped_blocks == 11 + 7
    assert cache.stats.hit_rate > 0
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache({}, block_size=0)


def test_engine_config_rejects_bad_values():
    for key, bad in (("max_num_batched_tokens", 0), ("prefix_block_size", 0), ("prefix_cache_bytes", -1),
                     ("prefix_caching", "yes")):
        with pytest.raises(ValueError, match=key):
            EngineConfig(**{key: bad})


def test_auto_bound_holds_one_prompt_of_max_model_len(monkeypatch):
    """`prefix_cache_bytes=None` (auto, `lcx serve`'s default): 1 GiB unless one prompt of
    max_model_len needs more, then exactly that many whole blocks, at most a quarter of the memory
    available at start-up; an explicit bound is kept, 0 included."""
    import lcx.engine.memory
    from lcx.engine.params import DEFAULT_PREFIX_CACHE_BYTES
    from lcx.hf.models import model_shape

    # (the bound depends on the memory available at start-up: 64 GiB here, so that it does not
    # depend on what else this machine runs; the cap is checked below)
    monkeypatch.setattr(lcx.engine.memory, "available_memory", lambda device: 64 << 30)
    model, tok = tiny_llama(seed=2, max_position_embeddings=L_SMALL)
    per_token = model_shape(model).kv_bytes_per_token(4)
    assert Engine(model, tok, EngineConfig(max_model_len=256, prefix_cache_bytes=None)
                  ).prefix_cache.max_bytes == DEFAULT_PREFIX_CACHE_BYTES
    n = DEFAULT_PREFIX_CACHE_BYTES // per_token + 5  # one prompt of n tokens needs more than 1 GiB
    eng = Engine(model, tok, EngineConfig(max_model_len=n, prefix_cache_bytes=None, prefix_block_size=BLOCK))
    assert eng.prefix_cache.max_bytes == -(-n // BLOCK) * BLOCK * per_token > DEFAULT_PREFIX_CACHE_BYTES
    for fixed in (0, 4096):
        assert Engine(model, tok, EngineConfig(max_model_len=n, prefix_cache_bytes=fixed)).prefix_cache.max_bytes == fixed
    # never past a quarter of the memory available at start-up (8 GiB here: a max_model_len of
    # 100M tokens gets 2 GiB), and never below 1 GiB (512 MiB available)
    for avail, want in ((8 << 30, 2 << 30), (512 << 20, DEFAULT_PREFIX_CACHE_BYTES)):
        monkeypatch.setattr(lcx.engine.memory, "available_memory", lambda device, avail=avail: avail)
        eng = Engine(model, tok, EngineConfig(max_model_len=100_000_000, prefix_cache_bytes=None))
        assert eng.prefix_cache.max_bytes == want
    assert EngineConfig.from_dict(EngineConfig(prefix_cache_bytes=None).to_dict()).prefix_cache_bytes is None


def test_generate_batch_reuses_its_shared_prefix():
    """A batch of prompts sharing a long prefix (a passkey sweep: one haystack, needles at several
    depths) computes the shared part once: the prompt sharing most goes first, the others are
    admitted a step later and reuse it; tokens and logprobs equal a run without the cache."""
    model, tok = tiny_llama(seed=2, max_position_embeddings=L_SMALL)
    hay = tok((TEXT * 2)[:150], add_special_tokens=False)["input_ids"]
    needle = tok("#42#", add_special_tokens=False)["input_ids"]
    prompts = [hay[:d] + needle + hay[d:140] for d in (20, 100, 60, 130)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
    m0, _ = tiny_llama(seed=2, max_position_embeddings=L_SMALL)
    want = Engine(m0.double().eval(), tok, EngineConfig(max_model_len=256, prefix_caching=False)).generate(prompts, sp)
    eng = Engine(model.double().eval(), tok, EngineConfig(max_model_len=256, prefix_block_size=BLOCK))
    assert eng._reuse_order(prompts)[0] in (1, 3)  # the deepest two share the most (12 blocks, a tie)
    got = eng.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(want, got):
        torch.testing.assert_close(torch.tensor([e.logprob for e in b.logprobs], dtype=torch.float64),
                                   torch.tensor([e.logprob for e in a.logprobs], dtype=torch.float64), rtol=0, atol=1e-9)
    assert eng.stats.prefix_cache_hits == 3
    # each reuses the haystack up to its own (or the leader's) needle, in whole blocks
    assert eng.stats.prefix_cache_hit_tokens == sum(d // BLOCK * BLOCK for d in (20, 100, 60))
    assert eng.stats.prompt_tokens_computed == sum(map(len, prompts)) - eng.stats.prefix_cache_hit_tokens


def test_chunks_under_a_shared_budget_stay_on_the_block_grid():
    """Chunked prefill under a token budget shared by decode rows and several prompts cuts every
    prompt's chunks in whole blocks, so each prompt's blocks are all stored and reachable: the
    same prompts sent again reuse all their whole blocks (a budget left over mid-block once gave
    a prompt a 1-token chunk, leaving its block 0 unstored and the whole prompt unreachable)."""
    import lcx

    model, tok = lcx.load_model("tiny-ret-5m")
    eng = Engine(model, tok, EngineConfig(max_model_len=1024, prefix_block_size=16, max_num_batched_tokens=50))
    g = torch.Generator().manual_seed(0)
    longs = [torch.randint(10, 500, (300 + 7 * i,), generator=g).tolist() for i in range(3)]
    eng.add_request([11, 12, 13, 14, 15], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.step()  # one decode row: 49 tokens of budget for the three prompts below
    for ids in longs:
        eng.add_request(ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert eng.stats.prefill_chunks > 3
    for ids in longs:
        h0 = eng.stats.prefix_cache_hit_tokens
        eng.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
        assert eng.stats.prefix_cache_hit_tokens - h0 == (len(ids) - 1) // 16 * 16
