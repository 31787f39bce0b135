"""STRING (`lcx.methods.string`): the position map pinned by a hand-written matrix, the dense
reference pinned by hand at the boundary key, the two passes `attend` runs equal the reference on
every backend, the exact causal bound, the decode rule by hand, parameters and the official
defaults. (The grids over every method, `lcx.methods.examples`, run it too:
tests/methods/test_registry.py lists them; the parity with the authors' code on Llama and Qwen2
models is tests/methods/test_string_parity.py.)"""

from __future__ import annotations

import pytest
import torch

from lcx.attention import Rotary
from lcx.methods import STRING, causal, method_from_dict, string, string_distances, string_ref
from lcx.rope import RopeSpec, apply_rotary_ref, compute_inv_freq, rope_cos_sin

SHAPES = [  # (Tq, Tk, S, W)
    (1, 1, 4, 1), (37, 37, 4, 1), (1, 50, 7, 3), (5, 29, 5, 2), (13, 13, 20, 3), (63, 63, 1, 0), (9, 40, 6, 5),
    (1, 9, 9, 0), (1, 10, 9, 0),  # the last query just before and at the shift
]
BACKENDS = ("blockwise", "flash", "flex")


def _inv_freq(D: int) -> torch.Tensor:
    return compute_inv_freq(RopeSpec.from_dict({"rope_type": "default", "rope_theta": 10000.0}), D)[0]


def _qkv(Tq: int, Tk: int, seed: int, B: int = 2, D: int = 16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, 4, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Tk, 2, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def test_distances_by_hand():
    # the paper's Figure 5 shape: L = 9, S = 3 (W = 2): diagonals i - j < 3 keep i - j, the others
    # are i - j - 3 + 2; the largest distance is 8 - 3 + 2 = 7 (entries above the diagonal are masked)
    d = string_distances(torch.arange(9), torch.arange(9), 3, 2)
    want = torch.tensor([
        [0, -1, -2, -3, -4, -5, -6, -7, -8],
        [1, 0, -1, -2, -3, -4, -5, -6, -7],
        [2, 1, 0, -1, -2, -3, -4, -5, -6],
        [2, 2, 1, 0, -1, -2, -3, -4, -5],
        [3, 2, 2, 1, 0, -1, -2, -3, -4],
        [4, 3, 2, 2, 1, 0, -1, -2, -3],
        [5, 4, 3, 2, 2, 1, 0, -1, -2],
        [6, 5, 4, 3, 2, 2, 1, 0, -1],
        [7, 6, 5, 4, 3, 2, 2, 1, 0],
    ], dtype=torch.float64)
    assert torch.equal(d, want)
    # the last 2 queries of the 9 keys, positions starting at 5: the same rows, values from positions
    d = string_distances(torch.arange(12, 14), torch.arange(5, 14), 3, 2)
    assert torch.equal(d, want[7:])


@pytest.mark.parametrize("overlap", [False, True], ids=["matrix", "overlap"])
def test_reference_by_hand_at_the_boundary(overlap):
    """One query S keys after the first: keys 1..S at their true distances, key 0 (distance S) at
    W; with overlap, key 0 ALSO at its true distance S, a second softmax entry."""
    S, W, D = 5, 2, 16
    inv = _inv_freq(D)
    q, k, v = _qkv(1, S + 1, seed=3, B=1, D=D)
    rot = Rotary(inv, torch.arange(S + 1) + 4, 1.3)

    def at(x, p):  # x [1, 1, H, D] rotated to position p (the attention factor on cos and sin)
        cos, sin = rope_cos_sin(torch.tensor([p]), inv, 1.3, torch.float64)
        return apply_rotary_ref(x, cos, sin)

    p_q = S + 4
    qh = q[0, 0].reshape(2, 2, D)  # query heads grouped by their kv head
    logits, vals = [], []
    for j in range(S + 1):
        kj = at(k[:, j : j + 1], j + 4)[0, 0]  # [Hkv, D]
        pq = p_q if j > 0 else p_q - S + W
        qj = at(q, pq)[0, 0].reshape(2, 2, D)
        logits.append(torch.einsum("ghd,gd->gh", qj, kj))
        vals.append(v[0, j])
    if overlap:
        logits.append(torch.einsum("ghd,gd->gh", at(q, p_q)[0, 0].reshape(2, 2, D), at(k[:, :1], 4)[0, 0]))
        vals.append(v[0, 0])
    p = torch.softmax(torch.stack(logits) * D ** -0.5, dim=0)  # [keys, Hkv, g]
    want = torch.einsum("jgh,jgd->ghd", p, torch.stack(vals)).reshape(1, 1, 4, D)
    got = string_ref(q, k, v, rotary=rot, shifted_offset=S, local_value=W, overlap=overlap)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(string_ref(q, k, v, rotary=rot, shifted_offset=S, local_value=W, overlap=not overlap),
                              want)


@pytest.mark.parametrize("overlap", [False, True], ids=["matrix", "overlap"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Tq,Tk,S,W", SHAPES, ids=[f"q{a}k{b}S{c}W{d}" for a, b, c, d in SHAPES])
def test_two_passes_equal_the_reference(Tq, Tk, S, W, backend, overlap):
    """STRING.attend (window pass + shifted-query causal pass, merged by lse) == the dense definition,
    positions not starting at 0, GQA, an attention factor."""
    q, k, v = _qkv(Tq, Tk, seed=Tq * 100 + Tk)
    rot = Rotary(_inv_freq(16), torch.arange(Tk) + 3, 1.07)
    want = string_ref(q, k, v, rotary=rot, shifted_offset=S, local_value=W, overlap=overlap)
    got = string(S, W, overlap).attend(q, k, v, rotary=rot, backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ("blockwise", "flex"))  # flash has no soft-capping (it says so)
def test_scale_softcap_and_batched_positions(backend):
    q, k, v = _qkv(11, 30, seed=7)
    pos = torch.stack((torch.arange(30), torch.arange(30) + 17))  # [B, Tk]: per-row positions
    rot = Rotary(_inv_freq(16), pos)
    for overlap in (False, True):
        want = string_ref(q, k, v, rotary=rot, shifted_offset=6, local_value=2, overlap=overlap, scale=0.3, softcap=2.5)
        got = string(6, 2, overlap).attend(q, k, v, rotary=rot, backend=backend, scale=0.3, softcap=2.5)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_float32_flash_within_derived_tolerance():
    """float32 on the flash backend: error vs float64 at most twice the float32 reference's."""
    q, k, v = _qkv(33, 61, seed=11)
    rot = Rotary(_inv_freq(16), None)
    exact = string_ref(q, k, v, rotary=rot, shifted_offset=9, local_value=3)
    q32, k32, v32 = q.float(), k.float(), v.float()
    ref_err = (string_ref(q32, k32, v32, rotary=rot, shifted_offset=9, local_value=3).double() - exact).abs().max()
    err = (string(9, 3).attend(q32, k32, v32, rotary=rot, backend="flash").double() - exact).abs().max()
    assert err <= 2 * ref_err + 1e-6


@pytest.mark.parametrize("overlap", [False, True], ids=["matrix", "overlap"])
@pytest.mark.parametrize("S", [1, 4, 9])
def test_exactly_causal_up_to_the_shift(S, overlap):
    """causal_up_to() = S, and it is the exact bound: one key more and some query sees a shifted key."""
    m = string(S, S - 1 if S > 1 else 0, overlap)
    assert m.causal_up_to() == S
    q, k, v = _qkv(S + 1, S + 1, seed=S)
    rot = Rotary(_inv_freq(16), None)
    torch.testing.assert_close(m.attend(q[:, :S], k[:, :S], v[:, :S], rotary=rot),
                               causal().attend(q[:, :S], k[:, :S], v[:, :S], rotary=rot), rtol=1e-12, atol=1e-12)
    m_far = string(S, 0, overlap)  # W = 0: the shifted key at distance S scored at 0, surely different
    assert not torch.allclose(m_far.attend(q, k, v, rotary=rot), causal().attend(q, k, v, rotary=rot))


def test_decode_rule_by_hand():
    # S = 3, W = 1, query at p = 6: keys 4, 5, 6 at -2, -1, 0; keys 0..3 against the query at
    # 6 - 3 + 1 = 4: -4, -3, -2, -1
    vis, rel = string(3, 1).decode_rule().relative_positions(7)
    assert vis.all()
    assert rel.tolist() == [-4.0, -3.0, -2.0, -1.0, -2.0, -1.0, 0.0]
    assert string(3, 1, overlap=True).decode_rule() is None  # a key in both branches: no rule
    assert string(3, 1, overlap=True).last_query_keys(torch.arange(7)[None]) is None
    # fewer keys than S: the window alone
    vis, rel = string(3, 1).decode_rule().relative_positions(3)
    assert rel.tolist() == [-2.0, -1.0, 0.0]


def test_prefix_reuse_and_chunks_are_exact():
    m = string(4, 1)
    assert m.call_dependence is None and not m.last_query_extra and m.cache_window is None
    # a prefix's rows do not depend on what follows: rows of a call over 20 keys == the same rows
    # computed in a call over their first 12 keys (queries = last 5 of those)
    q, k, v = _qkv(20, 20, seed=5)
    rot = Rotary(_inv_freq(16), None)
    whole = m.attend(q, k, v, rotary=rot, backend="flash")
    part = m.attend(q[:, 7:12], k[:, :12], v[:, :12], rotary=rot, backend="flash")
    torch.testing.assert_close(part, whole[:, 7:12], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make, bad", [
    (lambda: string(0), "shifted_offset"),
    (lambda: string(4.0), "shifted_offset"),
    (lambda: string(4, -1), "local_value"),
    (lambda: string(4, 4), "local_value"),
    (lambda: string(4, True), "local_value"),
    (lambda: string(4, 1, overlap="yes"), "overlap"),
    (lambda: method_from_dict({"type": "string", "local_value": 3}), "shifted_offset"),
    (lambda: method_from_dict({"type": "string", "shifted_offset": 8, "window": 3}), "window"),
    (lambda: STRING.for_length(1), "length"),
    (lambda: STRING.for_length(1000, shifted_ratio=1.2), "shifted_ratio"),
])
def test_bad_params_raise_value_error_naming_them(make, bad):
    with pytest.raises(ValueError, match=bad):
        make()


def test_official_defaults():
    # README: replace_with_string(L, shifted_offset=int(0.33 * L), small_local_value=128); for
    # Llama 3.1's L = 131072 it writes shifted_offset 43253 (the vLLM config example)
    m = STRING.for_length(131072)
    assert (m.shifted_offset, m.local_value, m.overlap) == (43253, 128, False)
    assert m.to_dict() == {"type": "string", "shifted_offset": 43253}
    assert method_from_dict(m.to_dict()) == m
    assert STRING.for_length(16384, shifted_ratio=0.25, local_value=512) == string(4096, 512)
    assert STRING.for_length(64).local_value == 20  # W lowered below a small S (int(0.33 * 64) = 21)


def test_preset_is_the_official_recipe():
    """`lcx.presets`' `string`: S = int(0.33 L), W = 128 for L = s x L0; the constant attention factor
    as a YaRN spec whose factor is 1 up to L0 / 0.67 and the Qwen2 recipe's s (1 - 0.33) beyond."""
    from lcx import presets
    from lcx.methods.string import ATTENTION_FACTOR

    cfg = presets.config("string", L0=8192, factor=2)  # SmolLM2 at 16k
    assert cfg.attention == string(5406, 128)
    assert cfg.rope.to_dict() == {"rope_type": "yarn", "factor": 1.34, "attention_factor": ATTENTION_FACTOR}
    cfg = presets.config("string", L0=131072, factor=1)  # Llama 3.1 at its length, as the README runs it
    assert cfg.attention == string(43253, 128)
    assert cfg.rope.to_dict()["factor"] == 1.0
    assert presets.config("string", L0=32768, factor=4).rope.to_dict()["factor"] == 2.68  # Qwen2 at 128k
    assert not presets.get("string").in_report


@pytest.mark.parametrize("old_format", [False, True], ids=["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("own", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "linear", "factor": 4.0}], ids=["llama3", "linear"])
def test_preset_keeps_a_scaled_model_rope(tmp_path, own, old_format):
    """On a model whose config scales its RoPE already (Llama 3.1's bands, Gemma 3's linear x8),
    `lcx report`'s `string` keeps that RoPE, as the official Llama code keeps the model's rotary
    embedding, with the constant attention factor: the applied basis is the model's own
    frequencies times 0.1 ln 2 + 1 (the plain-RoPE recipe, YaRN, would have replaced them)."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from lcx import MethodConfig, presets
    from lcx.methods.string import ATTENTION_FACTOR

    torch.manual_seed(0)
    hf = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256,
                     rope_parameters={**own, "rope_theta": 10000.0})
    model = LlamaForCausalLM(hf).eval()
    model.save_pretrained(tmp_path)
    if old_format:  # a config.json from before transformers 5: rope_scaling and rope_theta
        d = json.loads((tmp_path / "config.json").read_text())
        rope = d.pop("rope_parameters")
        d["rope_theta"] = rope.pop("rope_theta")
        d["rope_scaling"] = rope
        (tmp_path / "config.json").write_text(json.dumps(d))
    own_inv_freq = model.model.rotary_emb.inv_freq.clone().double()
    run = presets.resolve("string", str(tmp_path), L0=256, factor=2)
    assert run.config.rope.rope_type == own["rope_type"]
    assert run.config.rope.to_dict()["attention_factor"] == ATTENTION_FACTOR
    assert run.config.attention == string(int(0.33 * 512), 128)
    applied = run.config.apply(model)
    inv_freq, af = applied.bases[0]
    torch.testing.assert_close(inv_freq, own_inv_freq, rtol=1e-6, atol=0)
    assert af == ATTENTION_FACTOR
    applied.restore()
    plain = MethodConfig.from_dict(presets.config("string", L0=256, factor=2).to_dict()).apply(model)
    assert (plain.bases[0][0] - own_inv_freq).abs().max() > 1e-3  # the plain recipe loses the model's RoPE
    plain.restore()


@pytest.mark.parametrize("overlap", [False, True], ids=["rule", "overlap-general-path"])
def test_engine_on_a_model_equals_full_recompute(model64, overlap):
    """The official recipe (STRING + the constant attention factor as a YaRN spec) in a tiny Llama:
    the engine's greedy tokens, with chunked prefill and a reused prefix, equal greedy decoding by
    full recompute; STRING changes the model's output. overlap=False decodes on the decode rule
    (keys rotated once), overlap=True on the general path (unrotated keys through `attend`)."""
    import lcx
    from lcx.engine import Engine, EngineConfig, SamplingParams
    from lcx.methods.string import ATTENTION_FACTOR

    m, tok = model64
    cfg = {"rope": {"rope_type": "yarn", "factor": 1.5, "attention_factor": ATTENTION_FACTOR},
           "attention": {"type": "string", "shifted_offset": 9, "local_value": 3, "overlap": overlap}}
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 259, (37,), generator=g).tolist()]
    prompts.append(prompts[0][:33] + torch.randint(3, 259, (8,), generator=g).tolist())  # shares 2 blocks of 16
    want = []
    with torch.no_grad(), lcx.patched(m, cfg):
        for p in prompts:
            seq = list(p)
            for _ in range(7):
                seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
            want.append(seq[len(p):])
        with_string = m(torch.tensor([prompts[0]])).logits
    with torch.no_grad(), lcx.patched(m, {"rope": cfg["rope"]}):
        assert (m(torch.tensor([prompts[0]])).logits - with_string).abs().max() > 1e-3
    engine = Engine(m, tok, EngineConfig(methods=cfg, max_num_batched_tokens=16, max_batch=1))
    sp = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    got = [engine.generate([p], sp)[0].token_ids for p in prompts]
    assert got == want
    # the second prompt reused 2 blocks of 16; the first prefilled 37 tokens in 16-token steps
    assert engine.stats.prefix_cache_hit_tokens == 32 and engine.stats.prefill_batches >= 4
    assert engine.methods.kv_window is None
    from lcx.hf.attention_patch import unpatch_attention
    from lcx.hf.rope_patch import unpatch_rope

    unpatch_attention(m)
    unpatch_rope(m)
