"""lcx.methods across methods: methods as data, the attention patch on HF models, bounded KV cache
decoding. Each method's own definition is pinned in its own file (test_sinks.py,
test_self_extend.py, test_swat_attention.py, test_lm_infinite_topk.py); the grids over every
method are listed in test_registry.py.

Smoke tier on 2 CPU cores: tiny random Llamas (`lcx.models.tiny`), sequences of tens of tokens,
windows of a few tokens so every path (window full, evictions, capped globals) is exercised.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lcx.testing import attention_layer_io
from lcx.attention import Rotary, lambda_attention_ref
from lcx.hf.attention_patch import attention_patched, ATTN_IMPLEMENTATION, current_attention, patch_attention, unpatch_attention
from lcx.hf.bounded_cache import BoundedKVCache, cache_len, greedy_generate
from lcx.methods import causal, examples, lm_infinite, method_from_dict, method_id, sinks, sliding_window, swat
from lcx.methods.registry import ATTENTION_METHODS, UNROTATED_METHODS

# ------------------------------------------------------------------------------ grids


def _bounded(method) -> bool:
    try:
        method.check_bounded()
    except ValueError:
        return False
    return True


# every registered method's examples that a bounded cache reproduces exactly: windows small
# enough that a 40-token prompt + 32 generated tokens go far past them
BOUNDED_METHODS = {method_id(m): m for m in examples() if _bounded(m)}
PROMPT_LENS = (2, 40)  # about as long as the windows; far beyond them
NEW_TOKENS = 32


def _ids(T: int, seed: int = 0, B: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (B, T), generator=g)


# ------------------------------------------------------------------------------ methods as data


def test_dicts_round_trip():
    for m in examples():
        assert method_from_dict(m.to_dict()) == m
    assert lm_infinite(2, 9).limit_distance == 9  # default cap = n_local
    assert lm_infinite(2, 9, limit_distance=9).to_dict() == {"type": "lm_infinite", "n_global": 2, "n_local": 9}


@pytest.mark.parametrize("make, bad", [
    (lambda: lm_infinite(-1, 8), "n_global"),
    (lambda: lm_infinite(4, 0), "n_local"),
    (lambda: lm_infinite(4, 8, limit_distance=-2), "limit_distance"),
    (lambda: lm_infinite(4.0, 8), "n_global"),
    (lambda: sliding_window(window=0), "window"),
    (lambda: sliding_window(window=True), "window"),
    (lambda: sinks(-1, 8), "n_sink"),
    (lambda: sinks(4, 0), "window"),
    (lambda: sinks(4, 8, renumber="yes"), "renumber"),
    (lambda: swat(0), "window"),
    (lambda: swat(4, alibi_slopes=[]), "alibi_slopes"),
    (lambda: swat(4, alibi_slopes=[1.0, float("inf")]), "alibi_slopes"),
    (lambda: swat(4, alibi_slopes="0.5"), "alibi_slopes"),
    (lambda: method_from_dict({"type": "swat"}), "window"),
    (lambda: swat(4, alibi_slopes=[0.5, -0.5]).for_heads(4), "2 SWAT alibi slopes for 4 heads"),
    (lambda: method_from_dict({"type": "lm_infinite", "n_global": 4, "n_locl": 8}), "n_locl"),
    (lambda: method_from_dict({"type": "lm_infinite", "n_global": 4}), "n_local"),
    (lambda: method_from_dict({"type": "landmark"}), "landmark"),
    (lambda: BoundedKVCache(causal()), "causal"),
    (lambda: BoundedKVCache(lm_infinite(4, 8, limit_distance=12)), "limit_distance"),
])
def test_bad_params_raise_value_error_naming_them(make, bad):
    with pytest.raises(ValueError, match=bad):
        make()


def test_bad_patch_arguments(model32):
    m, _ = model32
    with pytest.raises(ValueError, match="backend"):
        patch_attention(m, lm_infinite(4, 8), backend="flash9")
    assert current_attention(m) is None
    cohere2 = type("Q", (torch.nn.Module,), {})()
    cohere2.config = type("C", (), {"model_type": "cohere2"})()
    with pytest.raises(ValueError, match="model_type.*NoPE"):  # a family left out, and why
        patch_attention(cohere2, causal())
    with pytest.raises(ValueError, match="layers="):
        patch_attention(m, causal(), layers="local")


# ------------------------------------------------------------------------------ the patched model


def test_patch_causal_and_wide_windows_equal_unpatched(model64):
    m, _ = model64
    ids = _ids(37)
    with torch.no_grad():
        want = m(ids).logits
        for method in (causal(), lm_infinite(3, 37), lm_infinite(0, 100), sliding_window(window=37), sinks(4, 37)):
            with attention_patched(m, method):
                got = m(ids).logits
            # lcx rotates with float64 angles, HF with float32 ones: about 1e-7 relative.
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=method.describe())


def test_patch_narrow_windows_change_the_model(model64):
    m, _ = model64
    ids = _ids(37)
    with torch.no_grad():
        want = m(ids).logits
        for method in (lm_infinite(3, 8), sliding_window(window=8), sinks(4, 8), sinks(4, 8, renumber=False)):
            with attention_patched(m, method):
                got = m(ids).logits
            assert (got - want).abs().max() > 1e-2, method.describe()
            torch.testing.assert_close(got[:, :8], want[:, :8], atol=1e-5, rtol=1e-5)  # first window: causal


@pytest.mark.parametrize("G, L, cap", [(3, 8, None), (1, 5, 9), (0, 6, None), (50, 4, None)])
def test_lm_infinite_layers_equal_lambda_attention_ref(model64, G, L, cap):
    """Per layer: patched output == o_proj(lambda_attention_ref(q, k, v)) on the same inputs."""
    from lcx.hf.rope_patch import rope_basis

    m, _ = model64
    ids = _ids(29, seed=G)
    inv, af = rope_basis(m)  # the model's own basis (HF's float32 inv_freq, widened)
    with attention_patched(m, lm_infinite(G, L, cap), backend="blockwise"):
        seen = attention_layer_io(m, ids)
    assert len(seen) == m.config.num_hidden_layers
    for layer, (h, out) in zip(m.model.layers, seen):
        a = layer.self_attn
        B, T, _ = h.shape
        q = a.q_proj(h).view(B, T, -1, a.head_dim)
        k = a.k_proj(h).view(B, T, -1, a.head_dim)
        v = a.v_proj(h).view(B, T, -1, a.head_dim)
        ref = lambda_attention_ref(q, k, v, rotary=Rotary(inv, None, af), n_global=G, n_local=L, limit_distance=cap)
        torch.testing.assert_close(out, a.o_proj(ref.reshape(B, T, -1)), atol=1e-12, rtol=1e-10)


def test_yarn_composes_with_lm_infinite(model64):
    """LM-Infinite + YaRN: the attention reads the patched RoPE basis (inv_freq and attention
    factor), in either patching order; with a wide window it equals YaRN alone."""
    from lcx import patched

    m, _ = model64
    ids = _ids(33)
    yarn = {"rope_type": "yarn", "factor": 4.0}
    with torch.no_grad(), patched(m, yarn):
        want = m(ids).logits
        with attention_patched(m, lm_infinite(2, 64)):
            got = m(ids).logits
        with attention_patched(m, lm_infinite(2, 8)):
            narrow = m(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad(), attention_patched(m, lm_infinite(2, 8)), patched(m, yarn):
        torch.testing.assert_close(m(ids).logits, narrow, atol=1e-12, rtol=1e-12)


def test_unpatch_restores(model32):
    m, _ = model32
    ids = _ids(20)
    impl = m.config._attn_implementation
    fwd = type(m.model.layers[0].self_attn).forward
    with torch.no_grad():
        want = m(ids).logits
        patch_attention(m, lm_infinite(2, 4))
        assert m.config._attn_implementation == ATTN_IMPLEMENTATION
        assert current_attention(m) == lm_infinite(2, 4)
        with attention_patched(m, sinks(1, 3)):  # nested: restores the outer method on exit
            assert current_attention(m) == sinks(1, 3)
        assert current_attention(m) == lm_infinite(2, 4)
        patch_attention(m, sliding_window(window=4))  # re-patch replaces
        unpatch_attention(m)
        unpatch_attention(m)  # idempotent
        assert current_attention(m) is None
        assert m.config._attn_implementation == impl
        for layer in m.model.layers:
            assert "forward" not in vars(layer.self_attn)
            assert layer.self_attn.forward.__func__ is fwd
        torch.testing.assert_close(m(ids).logits, want, atol=0, rtol=0)


def test_padding_and_gapped_positions_raise(model32):
    m, _ = model32
    ids = _ids(10, B=2)
    with torch.no_grad(), attention_patched(m, lm_infinite(2, 4)):
        mask = torch.ones(2, 10, dtype=torch.long)
        mask[1, :3] = 0
        with pytest.raises(NotImplementedError, match="padded attention_mask"):
            m(ids, attention_mask=mask)
        with pytest.raises(ValueError, match="contiguous"):
            m(ids, position_ids=torch.tensor([[0, 1, 2, 3, 4, 10, 11, 12, 13, 14]]).expand(2, -1))
        # rows at different offsets are fine: each row's keys get its own positions
        m(ids, position_ids=torch.arange(10)[None] + torch.tensor([[0], [7]]))


# ------------------------------------------------------------------------------ bounded KV cache


@pytest.mark.parametrize("name", list(BOUNDED_METHODS))
@pytest.mark.parametrize("prompt_len", PROMPT_LENS)
def test_bounded_cache_generation_equals_full_cache(model32, name, prompt_len):
    """Greedy tokens with the bounded cache == with the full DynamicCache under the same method,
    far past the window; the bounded cache never holds more than n_first + n_recent - 1 slots."""
    m, _ = model32
    method = BOUNDED_METHODS[name]
    ids = _ids(prompt_len, seed=prompt_len + 1)
    with attention_patched(m, method):
        full = greedy_generate(m, ids, NEW_TOKENS)
        cache = BoundedKVCache(method)
        bounded = greedy_generate(m, ids, NEW_TOKENS, cache=cache, record_cache_bytes=True)
    assert torch.equal(bounded.tokens, full.tokens)
    n_first, n_recent = method.cache_window
    cap = n_first + n_recent - 1
    assert cache_len(cache) == min(cap, prompt_len + NEW_TOKENS - 1)
    cfg = m.config  # keys + values, fp32, plus one int64 position per slot
    per_slot = cfg.num_hidden_layers * (2 * cfg.num_key_value_heads * cfg.head_dim * 4 + 8)
    assert max(bounded.cache_bytes) <= cap * per_slot
    assert cache.get_seq_length() == prompt_len + NEW_TOKENS - 1  # tokens seen: positions continue


def test_bounded_cache_is_not_vacuous(model32):
    """The methods above do change generation vs vanilla decoding (else equality proves little)."""
    m, _ = model32
    ids = _ids(40, seed=40)
    vanilla = greedy_generate(m, ids, NEW_TOKENS).tokens
    changed = 0
    for method in (lm_infinite(4, 8), sliding_window(window=8), sinks(4, 8)):
        with attention_patched(m, method):
            changed += not torch.equal(greedy_generate(m, ids, NEW_TOKENS, cache=BoundedKVCache(method)).tokens,
                                       vanilla)
    assert changed == 3


def test_bounded_cache_memory_constant_in_length(model32):
    m, _ = model32
    method = lm_infinite(4, 8)
    sizes = {}
    with attention_patched(m, method):
        for T in (30, 120):
            cache = BoundedKVCache(method)
            res = greedy_generate(m, _ids(T), 8, cache=cache, record_cache_bytes=True)
            sizes[T] = res.cache_bytes
            kept = cache.kept_positions(0).tolist()
            assert kept == [0, 1, 2, 3] + list(range(T + 7 - 7, T + 7))  # globals + last L-1 positions
    assert sizes[30] == sizes[120] and len(set(sizes[30])) == 1
    full = greedy_generate(m, _ids(120), 2, record_cache_bytes=True).cache_bytes[-1]
    assert sizes[120][-1] * 8 < full  # 11 slots (+ positions) vs 121 slots


@pytest.mark.parametrize("method", [lm_infinite(4, 8), sinks(2, 6), sliding_window(window=5)], ids=lambda m: m.describe())
def test_bounded_chunked_prefill_equals_one_shot(model32, method):
    """Prefill in chunks (evicting between them) gives the same logits as one prefill."""
    m, _ = model32
    ids = _ids(37, seed=3)
    with torch.no_grad(), attention_patched(m, method):
        want = m(ids).logits
        cache = BoundedKVCache(method)
        got = torch.cat([m(ids[:, s:s + 5], past_key_values=cache, use_cache=True).logits
                         for s in range(0, 37, 5)], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_lm_infinite_cache_stores_unrotated_keys(model32):
    """Pinned choice: the bounded cache stores keys BEFORE RoPE (k_proj output), all of them."""
    m, _ = model32
    ids = _ids(20)
    method = lm_infinite(2, 5)
    with torch.no_grad(), attention_patched(m, method):
        cache = BoundedKVCache(method)
        m(ids, past_key_values=cache, use_cache=True)
        h = m.model.layers[0].input_layernorm(m.model.embed_tokens(ids))
        k = m.model.layers[0].self_attn.k_proj(h).view(1, 20, -1, m.config.head_dim).transpose(1, 2)
    pos = cache.kept_positions(0)
    assert pos.tolist() == [0, 1, 16, 17, 18, 19]
    torch.testing.assert_close(cache.layers[0].keys, k[:, :, pos], atol=1e-6, rtol=1e-6)


def test_method_dataclasses_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        lm_infinite(1, 2).n_local = 3


def test_bounded_cache_refuses_foreign_fillers(model32):
    """Only a model patched with the cache's own method may fill it (keys must arrive unrotated)."""
    m, _ = model32
    ids = _ids(12)
    with pytest.raises(ValueError, match="not patched"):
        m(ids, past_key_values=BoundedKVCache(lm_infinite(2, 4)), use_cache=True)
    with attention_patched(m, sinks(2, 4)), pytest.raises(ValueError, match="running sinks"):
        m(ids, past_key_values=BoundedKVCache(lm_infinite(2, 4)), use_cache=True)


def _moves_keys(method) -> bool | None:
    """Whether the last query of a 31-key call sees some key at other than its true position
    (None: not plain softmax over rotated keys)."""
    pos = torch.arange(31)[None]
    keys = method.last_query_keys(pos)
    if keys is None:
        return None
    seen = torch.ones_like(pos, dtype=torch.bool) if keys.visible is None else keys.visible
    return not torch.equal(keys.key_positions[seen].to(torch.float64), pos[seen].to(torch.float64))


@pytest.mark.parametrize("name", [n for n, cls in ATTENTION_METHODS.items()
                                  if any(_moves_keys(m) is not None for m in cls.example_methods())])
def test_unrotated_keys_where_distances_move(name):
    """`needs_unrotated_keys` (`UNROTATED_METHODS`, read from the classes) holds exactly for the
    methods some of whose queries see keys at other than their true distance (LM-Infinite's cap,
    StreamingLLM's renumbering, Self-Extend's groups), judged on their examples' last queries."""
    moved = any(_moves_keys(m) for m in ATTENTION_METHODS[name].example_methods())
    assert ATTENTION_METHODS[name].needs_unrotated_keys == moved
    assert (name in UNROTATED_METHODS) == moved


def test_model_types_are_one_table():
    from lcx.hf import ATTENTION_MODEL_TYPES, FAMILIES, LEFT_OUT, ROPE_MODEL_TYPES, attention_patch

    assert ROPE_MODEL_TYPES == ATTENTION_MODEL_TYPES == tuple(FAMILIES)  # every family takes both patches
    assert not set(LEFT_OUT) & set(FAMILIES)
    assert not hasattr(attention_patch, "SUPPORTED_MODEL_TYPES")  # one name per meaning, no alias
