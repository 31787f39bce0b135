"""lcx.methods: attention methods on HF models, StreamingLLM semantics, bounded KV cache decoding.

Smoke tier on 2 CPU cores: tiny random Llamas (`lcx.models.tiny`), sequences of tens of tokens,
windows of a few tokens so every path (window full, evictions, capped globals) is exercised.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lcx.attention import Rotary, attention_ref, lambda_attention_ref
from lcx.attention.reference import attention_ref_spec
from lcx.attention.rotary import rotate_qk
from lcx.methods import (
    ATTENTION_METHODS,
    ATTN_IMPLEMENTATION,
    BoundedKVCache,
    attention_patched,
    cache_len,
    causal,
    current_attention,
    greedy_generate,
    lm_infinite,
    method_from_dict,
    patch_attention,
    sinks,
    sliding_window,
    streaming_attention,
    streaming_attention_ref,
    swat,
    unpatch_attention,
)
from lcx.rope import RopeSpec, compute_inv_freq

# ------------------------------------------------------------------------------ grids
# Windowed methods small enough that a 40-token prompt + 45 generated tokens go far past them.
BOUNDED_METHODS = {
    "lm_infinite_4_8": lm_infinite(4, 8),
    "lm_infinite_1_5_cap3": lm_infinite(1, 5, limit_distance=3),
    "lm_infinite_0_7": lm_infinite(0, 7),
    "sliding_window_8": sliding_window(window=8),
    "sliding_window_1": sliding_window(window=1),
    "sinks_4_8": sinks(4, 8),
    "sinks_1_5": sinks(1, 5),
    "sinks_4_8_true_pos": sinks(4, 8, renumber=False),
    "swat_8": swat(8),
    "swat_5_slopes": swat(5, alibi_slopes=(0.5, -0.25, 0.0, 1.0)),
}
PROMPT_LENS = (2, 40)  # shorter than every window; far beyond them
NEW_TOKENS = 32
STREAM_SHAPES = [  # (Tq, Tk, n_sink, window)
    (1, 1, 4, 8), (7, 7, 2, 3), (13, 13, 0, 4), (16, 16, 4, 1), (5, 29, 3, 6), (29, 29, 30, 7), (63, 63, 4, 16),
]
STREAM_BACKENDS = ("ref", "blockwise", "flex")


def _inv_freq(D: int) -> torch.Tensor:
    return compute_inv_freq(RopeSpec.from_dict({"rope_type": "default", "rope_theta": 10000.0}), D)[0]


@pytest.fixture(scope="module")
def model64():
    """A private float64 tiny Llama (4 heads / 2 kv heads, head_dim 16) with a byte tokenizer."""
    from lcx.models.tiny import tiny_llama

    m, tok = tiny_llama(seed=1)
    return m.double().eval(), tok


@pytest.fixture(scope="module")
def model32():
    from lcx.models.tiny import tiny_llama

    m, tok = tiny_llama(seed=2)
    return m.eval(), tok


def _ids(T: int, seed: int = 0, B: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (B, T), generator=g)


# ------------------------------------------------------------------------------ methods as data


def test_registry_and_dicts_round_trip():
    assert set(ATTENTION_METHODS) == {"causal", "lm_infinite", "sliding_window", "sinks", "self_extend", "swat"}
    for m in (*BOUNDED_METHODS.values(), causal()):
        assert method_from_dict(m.to_dict()) == m
    assert lm_infinite(2, 9).limit_distance == 9  # default cap = n_local


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
    qwen3 = type("Q", (torch.nn.Module,), {})()
    qwen3.config = type("C", (), {"model_type": "qwen3"})()
    with pytest.raises(ValueError, match="model_type"):
        patch_attention(qwen3, causal())


# ------------------------------------------------------------------------------ StreamingLLM semantics


def _streaming_official(q, k, v, rotary_inv_freq, n_sink, window):
    """StreamingLLM's procedure, query by query: cache = sinks + the window's keys, unrotated;
    every key rotated by its SLOT index, the query by the last slot; causal softmax over the cache."""
    Tq, Tk = q.shape[1], k.shape[1]
    outs = []
    for t in range(Tq):
        i = Tk - Tq + t
        slots = sorted(set(range(min(n_sink, i + 1))) | set(range(max(0, i - window + 1), i + 1)))
        kc, vc = k[:, slots], v[:, slots]
        n = len(slots)
        rot = Rotary(rotary_inv_freq, torch.arange(n))
        qr, kr = rotate_qk(q[:, t:t + 1], kc, rot, n - 1)
        outs.append(attention_ref(qr, kr, vc, q_offset=n - 1))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("Tq, Tk, S, w", STREAM_SHAPES, ids=lambda x: str(x))
def test_streaming_ref_is_streamingllm_procedure(Tq, Tk, S, w):
    g = torch.Generator().manual_seed(Tk * 31 + Tq)
    q = torch.randn(2, Tq, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, Tk, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, Tk, 2, 16, generator=g, dtype=torch.float64)
    inv = _inv_freq(16)
    want = _streaming_official(q, k, v, inv, S, w)
    got = streaming_attention_ref(q, k, v, rotary=Rotary(inv), n_sink=S, window=w)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_streaming_positions_hand_example():
    """S=2, w=3, Tk=8, query 7: keys 5, 6, 7 at distances 2, 1, 0; sinks 0, 1 at distances 4, 3
    (true distances 7, 6). With q = k = a single rotary pair and v one-hot, the weights show it."""
    inv = torch.tensor([1.0], dtype=torch.float64)  # one frequency: score = cos(distance) * |q||k|
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64).expand(1, 1, 1, 2)
    k = q.expand(1, 8, 1, 2).clone()
    v = torch.eye(8, dtype=torch.float64)[None, :, None, :]  # value of key j = e_j
    out = streaming_attention_ref(q.clone(), k, v, rotary=Rotary(inv), n_sink=2, window=3, scale=1.0)
    dist = torch.tensor([4, 3, 99, 99, 99, 2, 1, 0], dtype=torch.float64)
    logits = torch.cos(dist).masked_fill(dist == 99, float("-inf"))
    torch.testing.assert_close(out[0, 0, 0], torch.softmax(logits, -1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", STREAM_BACKENDS)
@pytest.mark.parametrize("Tq, Tk, S, w", STREAM_SHAPES, ids=lambda x: str(x))
def test_streaming_two_pass_matches_ref(backend, Tq, Tk, S, w):
    g = torch.Generator().manual_seed(Tk)
    q, k, v = (torch.randn(1, n, h, 16, generator=g) for n, h in ((Tq, 4), (Tk, 2), (Tk, 2)))
    rot = Rotary(_inv_freq(16), torch.arange(Tk) + 5)  # positions need not start at 0
    want = streaming_attention_ref(q.double(), k.double(), v.double(), rotary=rot, n_sink=S, window=w)
    got = streaming_attention(q, k, v, rotary=rot, n_sink=S, window=w, backend=backend)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


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


def _layer_inputs(m, ids):
    """Hidden states entering every self_attn, and its outputs, from one forward of m."""
    seen = []
    hooks = [layer.self_attn.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append((kwargs["hidden_states"], out[0])), with_kwargs=True)
        for layer in m.model.layers]
    try:
        with torch.no_grad():
            m(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("G, L, cap", [(3, 8, None), (1, 5, 9), (0, 6, None), (50, 4, None)])
def test_lm_infinite_layers_equal_lambda_attention_ref(model64, G, L, cap):
    """Per layer: patched output == o_proj(lambda_attention_ref(q, k, v)) on the same inputs."""
    from lcx.cache import rope_basis

    m, _ = model64
    ids = _ids(29, seed=G)
    inv, af = rope_basis(m)  # the model's own basis (HF's float32 inv_freq, widened)
    with attention_patched(m, lm_infinite(G, L, cap), backend="blockwise"):
        seen = _layer_inputs(m, ids)
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
    from lcx.hf.rope_patch import patched

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


def test_unrotated_methods_come_from_the_registry():
    """One list: the methods whose distances are not the true ones keep unrotated keys."""
    from lcx.methods import ATTENTION_METHODS, UNROTATED_METHODS

    assert UNROTATED_METHODS == ("lm_infinite", "sinks", "self_extend")
    assert all(ATTENTION_METHODS[n].needs_unrotated_keys for n in UNROTATED_METHODS)


def test_model_types_are_one_table():
    from lcx.hf import ATTENTION_MODEL_TYPES, MODEL_TYPES, SUPPORTED_MODEL_TYPES, attention_patch

    assert SUPPORTED_MODEL_TYPES == tuple(MODEL_TYPES)
    assert attention_patch.SUPPORTED_MODEL_TYPES == ATTENTION_MODEL_TYPES
    assert "qwen3" in SUPPORTED_MODEL_TYPES and "qwen3" not in ATTENTION_MODEL_TYPES  # q/k norms before RoPE


# ------------------------------------------------------------------------------ Self-Extend
SELF_EXTEND_SHAPES = [  # (Tq, Tk, group_size, window)
    (1, 1, 2, 4), (37, 37, 4, 8), (1, 50, 3, 7), (5, 29, 2, 6), (13, 13, 4, 20), (63, 63, 1, 5), (9, 40, 5, 10),
]
SELF_EXTEND_BACKENDS = ("ref", "blockwise", "flash")


@pytest.mark.parametrize("backend", SELF_EXTEND_BACKENDS)
@pytest.mark.parametrize("Tq,Tk,G,W", SELF_EXTEND_SHAPES, ids=[f"q{a}k{b}G{c}W{d}" for a, b, c, d in SELF_EXTEND_SHAPES])
def test_self_extend_two_passes_equal_the_reference(Tq, Tk, G, W, backend):
    """SelfExtend.attend (window pass + grouped causal pass, merged by lse) == the dense definition."""
    from lcx.methods import self_extend, self_extend_ref

    g = torch.Generator().manual_seed(Tq * 100 + Tk)
    q = torch.randn(2, Tq, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, Tk, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    rot = Rotary(_inv_freq(16), torch.arange(Tk) + 3)  # positions need not start at 0
    want = self_extend_ref(q, k, v, rotary=rot, group_size=G, window=W)
    got = self_extend(G, W).attend(q, k, v, rotary=rot, backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_self_extend_reference_pins_the_positions():
    """Hand check of the definition: G = 1 is plain causal attention; a key W or more behind the
    query scores with q at floor(p_i / G) + W - W/G and k at floor(p_j / G)."""
    from lcx.methods import self_extend_ref

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    rot = Rotary(_inv_freq(8))
    causal_out = attention_ref_spec(*rotate_qk(q, k, rot, 0), v, causal().attention_spec())
    torch.testing.assert_close(self_extend_ref(q, k, v, rotary=rot, group_size=1, window=3), causal_out)
    # query 11 (last), G = 2, W = 4: keys 8..11 true positions; keys 0..7 grouped
    out = self_extend_ref(q, k, v, rotary=rot, group_size=2, window=4)
    from lcx.rope import apply_rotary_ref, rope_cos_sin

    def rot_to(x, p):
        cos, sin = rope_cos_sin(torch.tensor(p, dtype=torch.float64), rot.inv_freq, 1.0, torch.float64)
        return apply_rotary_ref(x, cos, sin)

    qi = q[:, 11:]
    near = (rot_to(qi, [11.0]) * rot_to(k[:, 8:], list(range(8, 12)))).sum(-1)  # [1, 4, H]
    far = (rot_to(qi, [11 // 2 + 4 - 4 / 2]) * rot_to(k[:, :8], [j // 2 for j in range(8)])).sum(-1)
    p = torch.softmax(torch.cat((far, near), 1) / 8 ** 0.5, dim=1)  # [1, 12, H]
    torch.testing.assert_close(out[:, 11], torch.einsum("bkh,bkhd->bhd", p, v))


def test_self_extend_on_a_model(model64):
    """Patched into a tiny Llama: G = 1 leaves the model unchanged; G = 2 changes it and the
    engine's cached decode (unrotated keys) equals full-recompute greedy decoding."""
    from lcx.engine import Engine, EngineConfig, SamplingParams
    from lcx.methods import self_extend

    m, tok = model64
    ids = _ids(40)
    with torch.no_grad():
        plain = m(ids).logits
        with attention_patched(m, self_extend(1, 6)):
            # equal up to the float32 angles of HF's own rotary module (lcx rotates in float64)
            torch.testing.assert_close(m(ids).logits, plain, rtol=1e-5, atol=1e-5)
        with attention_patched(m, self_extend(2, 6)):
            grouped = m(ids).logits
            assert (grouped - plain).abs().max() > 1e-3
            want = ids[0].tolist()
            for _ in range(8):  # greedy by full recompute
                want.append(int(m(torch.tensor([want])).logits[0, -1].argmax()))
    engine = Engine(m, tok, EngineConfig(methods={"attention": {"type": "self_extend", "group_size": 2, "window": 6}}))
    out = engine.generate([ids[0].tolist()], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == want[40:]
    assert not engine.resolved_methods["attention"].bounded  # every key stays visible
    from lcx.methods import unpatch_attention

    unpatch_attention(m)


# ------------------------------------------------------------------------------ SWAT
SWAT_SHAPES = [  # (Tq, Tk, window, alibi slopes or None for the balanced default)
    (1, 1, 1, None), (37, 37, 8, None), (1, 50, 7, None), (5, 29, 6, (0.3, -0.1, 0.05, -0.2)),
    (13, 13, 20, None), (63, 63, 1, None), (9, 40, 10, (0.0, 0.0, 0.0, 0.0)),
]
SWAT_BACKENDS = ("ref", "blockwise", "flex")


def _swat_written_out(q, k, v, rot, window, slopes):
    """o_i = sum_{i-w<j<=i} sigmoid(q~_i.k~_j / sqrt(D) - m_h (i - j)) v_j, densely, in float64;
    q~, k~ rotated at the keys' positions with lcx.rope's float64 tables. Independent of lcx.attention."""
    from lcx.rope import apply_rotary_ref, rope_cos_sin

    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    pos = rot.key_positions(Tk, q.device)
    cos, sin = rope_cos_sin(pos, rot.inv_freq, 1.0, torch.float64)
    qr = apply_rotary_ref(q.double(), cos[Tk - Tq:], sin[Tk - Tq:])
    kr = apply_rotary_ref(k.double(), cos, sin).repeat_interleave(H // Hkv, dim=2)
    i = torch.arange(Tk - Tq, Tk)[:, None]
    j = torch.arange(Tk)[None, :]
    m = torch.tensor(slopes, dtype=torch.float64)[:, None, None]  # [H, 1, 1]
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kr) / D ** 0.5 - m * (i - j)
    p = torch.sigmoid(s) * ((j <= i) & (j > i - window))
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double().repeat_interleave(H // Hkv, dim=2))


@pytest.mark.parametrize("backend", SWAT_BACKENDS)
@pytest.mark.parametrize("Tq,Tk,w,slopes", SWAT_SHAPES,
                         ids=[f"q{a}k{b}w{c}{'m' if d else ''}" for a, b, c, d in SWAT_SHAPES])
def test_swat_attend_equals_the_definition(Tq, Tk, w, slopes, backend):
    """SWAT.attend (one lcx.attention call, on any backend) == the formula written out."""
    from lcx.attention import balanced_alibi_slopes

    dtype = torch.float32 if backend == "flex" else torch.float64  # flex: no float64 on CPU
    g = torch.Generator().manual_seed(Tq * 100 + Tk)
    q = torch.randn(2, Tq, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, Tk, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    rot = Rotary(_inv_freq(16), torch.arange(Tk) + 3)  # positions need not start at 0
    want = _swat_written_out(q, k, v, rot, w, slopes or balanced_alibi_slopes(4))
    got = swat(w, alibi_slopes=slopes).attend(q.to(dtype), k.to(dtype), v.to(dtype), rotary=rot, backend=backend)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_swat_weights_hand_example():
    """q = 0 leaves only the window and the ALiBi term: key j's weight for query i is
    sigmoid(-m (i - j)) for i - w < j <= i. w = 3, slopes (ln 3, -ln 3): distances 0, 1, 2
    weigh 1/2, 1/4, 1/10 (head 0) and 1/2, 3/4, 9/10 (head 1); v one-hot shows the weights."""
    import math

    T = 5
    q = torch.zeros(1, T, 2, 2, dtype=torch.float64)
    k = torch.randn(1, T, 2, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    v = torch.eye(T, dtype=torch.float64)[None, :, None, :].expand(1, T, 2, T)  # value of key j = e_j
    out = swat(3, alibi_slopes=(math.log(3), -math.log(3))).attend(q, k, v, rotary=Rotary(_inv_freq(2)))
    a, b, c = 1 / 2, 1 / 4, 1 / 10
    want0 = torch.tensor([[a, 0, 0, 0, 0],
                          [b, a, 0, 0, 0],
                          [c, b, a, 0, 0],
                          [0, c, b, a, 0],
                          [0, 0, c, b, a]], dtype=torch.float64)
    a, b, c = 1 / 2, 3 / 4, 9 / 10
    want1 = torch.tensor([[a, 0, 0, 0, 0],
                          [b, a, 0, 0, 0],
                          [c, b, a, 0, 0],
                          [0, c, b, a, 0],
                          [0, 0, c, b, a]], dtype=torch.float64)
    torch.testing.assert_close(out[0, :, 0], want0, rtol=0, atol=1e-15)
    torch.testing.assert_close(out[0, :, 1], want1, rtol=0, atol=1e-15)


def test_swat_method_as_data():
    """Slopes are data: the balanced default is left out of the dict, explicit ones kept (a
    list, as JSON has it); `for_heads` resolves the default; flash (softmax-only) is refused."""
    from lcx.attention import balanced_alibi_slopes

    assert swat(8).to_dict() == {"type": "swat", "window": 8}
    m = swat(8, alibi_slopes=[0.5, -0.5])
    assert m.alibi_slopes == (0.5, -0.5) and m.to_dict() == {"type": "swat", "window": 8, "alibi_slopes": [0.5, -0.5]}
    assert method_from_dict(m.to_dict()) == m and hash(m) == hash(method_from_dict(m.to_dict()))
    assert swat(8).for_heads(4) == swat(8, alibi_slopes=balanced_alibi_slopes(4))
    assert swat(8).cache_window == (0, 8) and not swat(8).needs_unrotated_keys
    assert swat(8).supports("blockwise") is None and "softmax-only" in swat(8).supports("flash")


def test_swat_on_a_softmax_model(model64):
    """Applied to a softmax-trained tiny Llama (allowed; meaningful on models trained with it):
    it changes the model, and the engine's bounded, batched decode equals full-recompute greedy
    decoding under the same method."""
    from lcx.engine import Engine, EngineConfig, SamplingParams

    m, tok = model64
    ids = _ids(40)
    with torch.no_grad():
        plain = m(ids).logits
        with attention_patched(m, swat(6)):
            changed = m(ids).logits
            assert (changed - plain).abs().max() > 1e-2
            want = ids[0].tolist()
            for _ in range(8):  # greedy by full recompute
                want.append(int(m(torch.tensor([want])).logits[0, -1].argmax()))
    engine = Engine(m, tok, EngineConfig(methods={"attention": {"type": "swat", "window": 6}}))
    out = engine.generate([ids[0].tolist()], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == want[40:]
    assert engine.resolved_methods["attention"].bounded  # a cache of w - 1 keys (tests/engine/test_engine_attention.py)
    unpatch_attention(m)
