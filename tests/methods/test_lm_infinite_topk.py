"""LM-Infinite's top-k middle keys (`lm_infinite(..., top_k=k)`) against the official semantics.

The official code (Glaciohound/LM-Infinite, `models/llama.py::detailed_lambda_attention`, run
for the last query row of every forward call) is written out below as an independent per-head
loop over one row, in its own terms (HF `rotate_half` RoPE, unrotated "stationary" keys, the
`triu`/`tril` zones, `torch.finfo.min` for masked logits), with limit_distance = local_branch
as in the paper's passkey runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from lcx.attention import Rotary, lambda_attention_ref, lambda_topk_attention_ref
from lcx.methods import lm_infinite, method_from_dict
from lcx.rope import compute_inv_freq

# (Tk, Tq, n_global, n_local, top_k, insert_at): odd lengths, a middle span shorter than k,
# exactly k, no global keys, a single query (decode), a long prefill
SHAPES = [
    (13, 13, 2, 4, 2, 2),
    (13, 1, 2, 4, 2, 2),
    (29, 7, 3, 5, 4, 3),
    (10, 10, 2, 4, 4, 2),   # middle span [2, 6): exactly k = 4 keys
    (9, 9, 2, 4, 4, 2),     # middle span [2, 5): 3 < k keys: plain Λ
    (31, 31, 0, 6, 3, 0),   # no global keys, insert_at 0
    (63, 17, 4, 16, 5, 8),
]
HEADS = [(4, 2), (3, 3)]  # (H, Hkv): GQA and MHA
BACKENDS = ("ref", "blockwise", "flex")
D = 8


def _rotate_half(x):
    return torch.cat((-x[..., D // 2:], x[..., : D // 2]), dim=-1)


def _official_last_row(q, k, v, inv_freq, G, L, K, insert_at, apply_top_k):
    """One query (the last of Tk keys, at position Tk - 1) per head, as detailed_lambda_attention
    computes it for q_len = 1 with limit_distance = local_branch: q `[H, D]`, k/v `[Tk, H, D]`."""
    n = k.shape[0]
    pos = torch.arange(n, dtype=torch.float64)
    freqs = torch.cat((pos[:, None] * inv_freq, pos[:, None] * inv_freq), -1)  # [n, D]
    cos, sin = freqs.cos(), freqs.sin()
    out = []
    for h in range(q.shape[0]):
        qh, kh = q[h], k[:, h]
        rot_q = qh * cos[n - 1] + _rotate_half(qh) * sin[n - 1]
        rot_k = kh * cos + _rotate_half(kh) * sin
        d_eff = min(L, n - 1)
        stat_q = qh * cos[d_eff] + _rotate_half(qh) * sin[d_eff]
        attn = rot_k @ rot_q / math.sqrt(D)  # [n]
        attn_stat = kh @ stat_q / math.sqrt(D)
        cols = torch.arange(n)
        attn = torch.where(cols >= n - L, attn, torch.zeros_like(attn))  # triu(-L + 1 + n - 1)
        attn = attn + torch.where(cols <= n - 1 - L, attn_stat, torch.zeros_like(attn))  # tril(-L + n - 1)
        neg = torch.finfo(attn.dtype).min
        attn = attn.masked_fill((cols <= n - 1 - L) & (cols >= G), neg)  # lambda_mask
        col_high = n - L
        if apply_top_k and col_high >= G + K:
            near_q = qh * cos[insert_at] + _rotate_half(qh) * sin[insert_at]
            line = (kh @ near_q / math.sqrt(D))[G:col_high]
            keep = torch.zeros_like(line, dtype=torch.bool)
            keep[torch.topk(line, K).indices] = True
            attn[G:col_high] = line.masked_fill(~keep, neg)
        out.append(torch.softmax(attn, -1) @ v[:, h])
    return torch.stack(out)  # [H, D]


def _inputs(Tk, Tq, H, Hkv, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, Tq, H, D, generator=g, dtype=dtype)
    k = torch.randn(2, Tk, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(2, Tk, Hkv, D, generator=g, dtype=dtype)
    return q, k, v


def _inv_freq():
    return compute_inv_freq({"rope_type": "default", "rope_theta": 100.0}, D)[0]


@pytest.mark.parametrize("H,Hkv", HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("Tk,Tq,G,L,K,ins", SHAPES, ids=lambda x: str(x))
def test_reference_equals_official_last_row(Tk, Tq, G, L, K, ins, H, Hkv):
    q, k, v = _inputs(Tk, Tq, H, Hkv, seed=Tk + K)
    inv = _inv_freq()
    got = lambda_topk_attention_ref(q, k, v, rotary=Rotary(inv), n_global=G, n_local=L, top_k=K,
                                    top_k_insert_at=ins)
    plain = lambda_attention_ref(q, k, v, rotary=Rotary(inv), n_global=G, n_local=L)
    torch.testing.assert_close(got[:, :-1], plain[:, :-1], atol=0, rtol=0)  # other rows: plain Λ
    kr, vr = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))  # GQA: query head h reads kv h // (H/Hkv)
    for b in range(2):
        want = _official_last_row(q[b, -1], kr[b], vr[b], inv, G, L, K, ins, apply_top_k=True)
        torch.testing.assert_close(got[b, -1], want, atol=1e-12, rtol=1e-10)
    if Tk - L - G < K:  # too few middle keys: the official code leaves the row plain
        torch.testing.assert_close(got, plain, atol=0, rtol=0)
    else:
        assert (got[:, -1] - plain[:, -1]).abs().max() > 1e-3


def test_hand_example_weights():
    """No rotation (inv_freq 0), one-hot values: the output is the weight vector. G = 1, L = 2,
    k = 1 over Tk = 6 keys: the last query sees key 0 (global), the best middle key of [1, 4)
    and keys 4, 5 (local)."""
    q = torch.tensor([1.0, 0.0], dtype=torch.float64).view(1, 1, 1, 2)
    a = [0.0, 0.5, 3.0, 1.0, 0.0, 0.0]  # q.k_j; middle keys 1..3, key 2 the best
    k = torch.tensor([[x, 0.0] for x in a], dtype=torch.float64).view(1, 6, 1, 2)
    v = torch.eye(6, dtype=torch.float64).view(1, 6, 1, 6)
    rot = Rotary(torch.zeros(1, dtype=torch.float64))
    out = lambda_topk_attention_ref(q, k, v, rotary=rot, n_global=1, n_local=2, top_k=1, top_k_insert_at=0,
                                    scale=1.0)
    e3 = math.exp(3.0)
    want = torch.tensor([1, 0, e3, 0, 1, 1], dtype=torch.float64) / (e3 + 3)
    torch.testing.assert_close(out.view(6), want, atol=1e-15, rtol=0)
    # k = 3: every middle key, each at its score
    out3 = lambda_topk_attention_ref(q, k, v, rotary=rot, n_global=1, n_local=2, top_k=3, top_k_insert_at=0,
                                     scale=1.0)
    w = torch.tensor([math.exp(x) for x in a], dtype=torch.float64)
    torch.testing.assert_close(out3.view(6), w / w.sum(), atol=1e-15, rtol=0)


def test_insert_at_sets_the_scoring_distance():
    """Middle keys are scored with the query at top_k_insert_at and the key at 0: a key's score
    does not depend on where it sits, only on insert_at."""
    q, k, v = _inputs(21, 1, 2, 2, seed=3)
    inv = _inv_freq()
    kw = dict(rotary=Rotary(inv), n_global=1, n_local=4, top_k=2)
    a = lambda_topk_attention_ref(q, k, v, top_k_insert_at=2, **kw)
    # moving a middle key elsewhere in the middle span moves its value with it: same output
    perm = torch.arange(21)
    perm[[3, 11]] = perm[[11, 3]]
    b = lambda_topk_attention_ref(q, k[:, perm], v[:, perm], top_k_insert_at=2, **kw)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    c = lambda_topk_attention_ref(q, k, v, top_k_insert_at=7, **kw)
    assert (a - c).abs().max() > 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Tk,Tq,G,L,K,ins", SHAPES, ids=lambda x: str(x))
def test_method_attend_per_layer(Tk, Tq, G, L, K, ins, backend):
    """attend = the reference in layers [from, to), plain Λ outside; other rows always plain Λ."""
    q, k, v = _inputs(Tk, Tq, 4, 2, seed=Tk)
    inv = _inv_freq()
    m = lm_infinite(G, L, top_k=K, top_k_from_layer=1, top_k_to_layer=3, top_k_insert_at=ins)
    rot = Rotary(inv)
    want = lambda_topk_attention_ref(q, k, v, rotary=rot, n_global=G, n_local=L, top_k=K, top_k_insert_at=ins)
    plain = lambda_attention_ref(q, k, v, rotary=rot, n_global=G, n_local=L)
    for layer in range(5):
        got = m.attend(q, k, v, rotary=rot, backend=backend, layer_idx=layer)
        torch.testing.assert_close(got, want if 1 <= layer < 3 else plain, atol=1e-10, rtol=1e-10)


def test_default_layers_are_the_official_ones():
    m = lm_infinite(2, 4, top_k=5)
    assert [m.top_k_in_layer(i) for i in range(6)] == [False] * 4 + [True] * 2
    assert m.top_k_in_layer(999)
    assert m.top_k_insert_at == 2  # n_local // 2
    assert not lm_infinite(2, 4).top_k_in_layer(7)


def test_float32_within_budget():
    from lcx.testing import assert_within_budget

    q, k, v = _inputs(45, 45, 4, 2, seed=9)
    m = lm_infinite(3, 8, top_k=3, top_k_from_layer=0)
    rot = Rotary(_inv_freq(), None, 1.2)
    # the float64 reference, not the method's own backend: a blockwise bug must not sit in both
    exact = lambda_topk_attention_ref(q, k, v, rotary=rot, n_global=3, n_local=8, top_k=3, top_k_insert_at=4)
    f32 = [t.float() for t in (q, k, v)]
    ref_lowp = lambda_topk_attention_ref(*f32, rotary=rot, n_global=3, n_local=8, top_k=3, top_k_insert_at=4)
    got = m.attend(*f32, rotary=rot, backend="blockwise", layer_idx=0)
    assert got.dtype == torch.float32
    assert_within_budget(got, ref_lowp, exact, what="lm_infinite top-k float32")


def test_as_data_and_what_it_costs():
    off = lm_infinite(10, 256)
    assert off.to_dict() == {"type": "lm_infinite", "n_global": 10, "n_local": 256}  # unchanged when off
    on = lm_infinite(10, 256, top_k=5)
    assert on.to_dict() == {"type": "lm_infinite", "n_global": 10, "n_local": 256, "top_k": 5}
    full = lm_infinite(10, 256, top_k=5, top_k_from_layer=2, top_k_to_layer=20, top_k_insert_at=100)
    for m in (off, on, full):
        assert method_from_dict(m.to_dict()) == m
    assert off.cache_window == (10, 256) and on.cache_window is None  # middle keys stay: unbounded cache
    with pytest.raises(ValueError, match="no bounded cache"):
        on.check_bounded()
    pos = torch.arange(300)
    assert on.last_query_keys(pos) is None and on.query_keys(pos, 3) is None  # fast paths fall back to attend
    assert off.last_query_keys(pos) is not None


@pytest.mark.parametrize("make, bad", [
    (lambda: lm_infinite(2, 4, top_k=-1), "top_k"),
    (lambda: lm_infinite(2, 4, top_k=2.0), "top_k"),
    (lambda: lm_infinite(2, 4, top_k=2, top_k_from_layer=-1), "top_k_from_layer"),
    (lambda: lm_infinite(2, 4, top_k=2, top_k_from_layer=3, top_k_to_layer=3), "top_k_to_layer"),
    (lambda: lm_infinite(2, 4, top_k=2, top_k_insert_at=-1), "top_k_insert_at"),
    (lambda: lm_infinite(2, 4, top_k_from_layer=2), "top_k = 0"),
    (lambda: method_from_dict({"type": "lm_infinite", "n_global": 2, "n_local": 4, "top_k_insert_at": 9}),
     "top_k = 0"),
])
def test_bad_params_raise(make, bad):
    with pytest.raises(ValueError, match=bad):
        make()


def test_attend_without_layer_idx_raises():
    q, k, v = _inputs(9, 9, 2, 2)
    with pytest.raises(ValueError, match="layer_idx"):
        lm_infinite(1, 3, top_k=1).attend(q, k, v, rotary=Rotary(_inv_freq()))
    lm_infinite(1, 3).attend(q, k, v, rotary=Rotary(_inv_freq()))  # off: no layer needed


def test_patched_model_layers_equal_reference():
    """On a tiny float64 Llama (2 layers): per layer, the patched output equals o_proj of the
    reference, with top-k from layer 1 (needs the HF adapter to pass `layer_idx`)."""
    from lcx.hf.rope_patch import rope_basis
    from lcx.hf.attention_patch import attention_patched
    from lcx.models.tiny import tiny_llama

    m, _ = tiny_llama(seed=1)
    m = m.double().eval()
    ids = torch.randint(3, 259, (1, 37), generator=torch.Generator().manual_seed(0))
    method = lm_infinite(2, 8, top_k=3, top_k_from_layer=1, top_k_insert_at=4)
    seen = []
    hooks = [layer.self_attn.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append((kwargs["hidden_states"], out[0])), with_kwargs=True)
        for layer in m.model.layers]
    try:
        with attention_patched(m, method, backend="blockwise"), torch.no_grad():
            m(ids)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(m.model.layers)  # every layer's attention ran under the patch and is compared
    inv, af = rope_basis(m)
    for i, (layer, (h, out)) in enumerate(zip(m.model.layers, seen)):
        a = layer.self_attn
        B, T, _ = h.shape
        q, k, v = (p(h).view(B, T, -1, a.head_dim) for p in (a.q_proj, a.k_proj, a.v_proj))
        rot = Rotary(inv, None, af)
        ref = (lambda_topk_attention_ref(q, k, v, rotary=rot, n_global=2, n_local=8, top_k=3, top_k_insert_at=4)
               if i >= 1 else lambda_attention_ref(q, k, v, rotary=rot, n_global=2, n_local=8))
        torch.testing.assert_close(out, a.o_proj(ref.reshape(B, T, -1)), atol=1e-12, rtol=1e-10)


def test_preset_scales_the_papers_settings():
    from lcx import presets

    def att(**kw):
        return presets.config("lm_infinite_topk", L0=4096, factor=2, **kw).attention

    llama2 = att(n_layers=32)  # the official run: window 4096, 10 global, k 5, from layer 4, insert at 2048
    assert (llama2.n_global, llama2.n_local, llama2.top_k, llama2.top_k_from_layer, llama2.top_k_to_layer,
            llama2.top_k_insert_at) == (10, 4096, 5, 4, None, 2048)
    assert att(n_layers=30).top_k_from_layer == 4  # SmolLM2
    assert att(n_layers=4).top_k_from_layer == 1  # tiny: top-k in 3 of its 4 layers
    assert att().top_k_from_layer == 4  # depth unknown: the official layer
    assert presets.config("lm_infinite_topk", L0=256, factor=8, n_layers=4).to_dict() == {
        "attention": {"type": "lm_infinite", "n_global": 10, "n_local": 256, "top_k": 5, "top_k_from_layer": 1}}
    with pytest.raises(ValueError, match="n_layers"):
        att(n_layers=0)
