"""Attention: the reference against brute force, every backend against the reference.

Backends are checked with `lcx.testing`'s derived tolerance: error vs the float64 reference
at most twice the error of the reference run in the same precision (plus a small floor).
"""

from __future__ import annotations

import functools
import logging
import math

import pytest
import torch

from lcx.attention import (
    BACKENDS,
    BLOCK_Q,
    AttentionSpec,
    CallInfo,
    LambdaParams,
    Rotary,
    alibi_slopes,
    attention,
    attention_ref,
    attention_ref_spec,
    attention_sdpa,
    backend_for,
    balanced_alibi_slopes,
    flex_bucket,
    lambda_attention_ref,
    lambda_inputs,
    lambda_two_pass,
    merge_attention,
)
from lcx.masks import attention_sinks, causal_mask, global_tokens, mask_matrix, sliding_window
from lcx.rope import RopeSpec, apply_rotary_ref, compute_inv_freq, rope_cos_sin
from lcx.testing import assert_within_budget

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16

# ----------------------------------------------------------------------------- grids
# name: (B, Tq, Tk, H, Hkv, D). Lengths 1, 17, 63, 217; GQA; head dims 16 and 64.
SHAPES = {
    "prefill1": (1, 1, 1, 2, 2, 16),
    "prefill17_gqa": (2, 17, 17, 4, 2, 16),
    "prefill63_d64": (1, 63, 63, 2, 2, 64),
    "prefill217_mqa": (1, 217, 217, 4, 1, 16),
    "chunk17of63_gqa": (1, 17, 63, 4, 2, 16),
    "decode1of217_d64": (2, 1, 217, 4, 2, 64),
}
LOWP_SHAPES = ("chunk17of63_gqa", "prefill217_mqa")  # fp16/bf16 run on these only
LONG_SHAPE = (1, 1000, 1000, 4, 2, 16)  # blockwise: several query blocks, Λ/window memory


# name: (spec factory(H), rotary?). Rotary = q/k arrive unrotated and the backend applies RoPE.
def _spec(name: str, H: int) -> AttentionSpec:
    return {
        "causal": lambda: AttentionSpec(),
        "window8": lambda: AttentionSpec(mask=sliding_window(left=7)),
        "sinks4_window8": lambda: AttentionSpec(mask=attention_sinks(4, 7)),
        "alibi": lambda: AttentionSpec(alibi_slopes=alibi_slopes(H)),
        "swat16_rope": lambda: AttentionSpec.swat(16, H),
        "lambda4_16": lambda: AttentionSpec.lm_infinite(4, 16),
        "lambda3_8_cap24_sigmoid": lambda: AttentionSpec.lm_infinite(3, 8, 24, activation="sigmoid"),
        # attention-logit soft-capping (Gemma 2) at 2: randn q/k give logits of about +-1, so tanh bends them
        "window8_softcap2": lambda: AttentionSpec(mask=sliding_window(left=7), softcap=2.0),
        "lambda4_16_softcap2": lambda: AttentionSpec.lm_infinite(4, 16, softcap=2.0),
    }[name]()


SPECS = ("causal", "window8", "sinks4_window8", "alibi", "swat16_rope", "lambda4_16", "lambda3_8_cap24_sigmoid",
         "window8_softcap2", "lambda4_16_softcap2")
ROTARY_SPECS = ("swat16_rope", "lambda4_16", "lambda3_8_cap24_sigmoid", "lambda4_16_softcap2")
GRAD_SHAPES = ("prefill17_gqa", "chunk17of63_gqa", "prefill217_mqa")
GRAD_DTYPES = (F32, BF16)

INV_FREQ_16, _ = compute_inv_freq(RopeSpec(rope_theta=10000.0), 16)
INV_FREQ_64, _ = compute_inv_freq(RopeSpec(rope_theta=10000.0), 64)


def _backend_param(name):
    # one compile per (spec, bucket, dtype) costs seconds on 2 cores: compiled flex is `slow`
    return pytest.param(name, marks=pytest.mark.slow) if name == "flex_compiled" else name


BACKEND_PARAMS = [_backend_param(b) for b in BACKENDS]


# ----------------------------------------------------------------------------- helpers
def make_qkv(shape, dtype=F64, seed=0, requires_grad=False):
    B, Tq, Tk, H, Hkv, D = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, H, D, generator=g, dtype=F64)
    k = torch.randn(B, Tk, Hkv, D, generator=g, dtype=F64)
    v = torch.randn(B, Tk, Hkv, D, generator=g, dtype=F64)
    return [t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v)]


def rotary_for(spec_name, D, positions=None, attention_factor=1.0):
    if spec_name not in ROTARY_SPECS:
        return None
    inv = INV_FREQ_16 if D == 16 else INV_FREQ_64
    return Rotary(inv, positions=positions, attention_factor=attention_factor)


def low(ts, dtype, requires_grad=False):
    return [t.detach().to(dtype).requires_grad_(requires_grad) for t in ts]


def run_or_check_refusal(backend, qkv, spec, **kw):
    """Run the backend, or (if it refuses) check the dispatcher raises with the reason."""
    call = CallInfo.from_call(*qkv, **kw)
    reason = BACKENDS[backend].supports(spec, call)
    if reason is not None:
        with pytest.raises(NotImplementedError, match="cannot run"):
            attention(*qkv, spec, backend=backend, **kw)
        return None
    return attention(*qkv, spec, backend=backend, **kw)


# ----------------------------------------------------------------------------- brute force
def brute_attention(q, k, v, visible, bias, activation, scale, softcap=None):
    """Per-(b, h, i) loops, float64: the formula in `lcx.attention.reference` literally."""
    cap = (lambda x: x) if softcap is None else (lambda x: softcap * math.tanh(x / softcap))
    B, Tq, H, D = q.shape
    Hkv = k.shape[2]
    out = torch.zeros(B, Tq, H, v.shape[-1], dtype=F64)
    lse = torch.full((B, H, Tq), float("-inf"), dtype=F64)
    for b in range(B):
        for h in range(H):
            kh = h // (H // Hkv)
            for t in range(Tq):
                js = [j for j in range(k.shape[1]) if visible(t, j)]
                if not js:
                    continue
                s = torch.tensor([cap(float(scale * q[b, t, h] @ k[b, j, kh])) + bias(h, t, j) for j in js], dtype=F64)
                w = torch.softmax(s, 0) if activation == "softmax" else torch.sigmoid(s)
                z = torch.exp(s) if activation == "softmax" else torch.sigmoid(s)
                lse[b, h, t] = torch.log(z.sum())
                out[b, t, h] = sum(w[n] * v[b, j, kh] for n, j in enumerate(js))
    return out, lse


@pytest.mark.parametrize("activation", ["softmax", "sigmoid"])
@pytest.mark.parametrize("tq", [9, 4, 1], ids=["prefill9", "chunk4of9", "decode1of9"])
@pytest.mark.parametrize("softcap", [None, 0.7], ids=["", "softcap"])
def test_reference_matches_brute_force(activation, tq, softcap):
    """Pins ALiBi's sign (-m|i-j|), the GQA head map (h // group), sigmoid, q_offset, and where
    soft-capping sits (on the scaled logit, before the bias and the mask)."""
    q, k, v = make_qkv((2, tq, 9, 4, 2, 8))
    slopes = balanced_alibi_slopes(4)  # both signs
    mask = attention_sinks(1, 2)
    off = 9 - tq
    vis = mask_matrix(mask, tq, 9)
    out, lse = attention_ref(q, k, v, mask=mask, alibi_slopes=slopes, activation=activation, return_lse=True,
                             softcap=softcap)
    want, want_lse = brute_attention(
        q, k, v, lambda t, j: bool(vis[t, j]), lambda h, t, j: -slopes[h] * abs(off + t - j),
        activation, 1 / math.sqrt(8), softcap,
    )  # fmt: skip
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def test_reference_empty_rows_are_zero():
    q, k, v = make_qkv((1, 3, 3, 2, 2, 8))
    out, lse = attention_ref(q, k, v, mask=global_tokens(0), return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


# ----------------------------------------------------------------------------- Λ reference
def rope(x, positions, inv_freq):
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, F64)
    return apply_rotary_ref(x, cos, sin)


@pytest.mark.parametrize("n_global", [0, 3])
def test_lambda_with_large_window_is_causal_rope_attention(n_global):
    """n_local >= T: every global key is inside the window, counted once, as local."""
    q, k, v = make_qkv((2, 40, 40, 4, 2, 16))
    pos = torch.arange(40)
    got = lambda_attention_ref(q, k, v, rotary=Rotary(INV_FREQ_16), n_global=n_global, n_local=64)
    want = attention_ref(rope(q, pos, INV_FREQ_16), rope(k, pos, INV_FREQ_16), v, mask=causal_mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tq", [40, 7, 1], ids=["prefill40", "chunk7of40", "decode1of40"])
def test_lambda_output_invariant_to_position_shift(tq):
    q, k, v = make_qkv((1, tq, 40, 2, 2, 16))
    kw = dict(n_global=4, n_local=8, return_lse=True)
    a = lambda_attention_ref(q, k, v, rotary=Rotary(INV_FREQ_16), **kw)
    b = lambda_attention_ref(q, k, v, rotary=Rotary(INV_FREQ_16, positions=torch.arange(40) + 123_457), **kw)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-9)
    # per-row positions [B, Tk]: each row shifted by its own amount
    q2, k2, v2 = (torch.cat((t, t)) for t in (q, k, v))
    rows = torch.stack((torch.arange(40), torch.arange(40) + 999))
    c = lambda_attention_ref(q2, k2, v2, rotary=Rotary(INV_FREQ_16, positions=rows), **kw)
    torch.testing.assert_close(c[0], torch.cat((a[0], a[0])), rtol=0, atol=1e-9)


@pytest.mark.parametrize("tq", [12, 5, 1], ids=["prefill12", "chunk5of12", "decode1of12"])
@pytest.mark.parametrize("limit_distance", [None, 6, 50], ids=["cap_default", "cap6", "cap_beyond_Tk"])
def test_lambda_matches_brute_force(tq, limit_distance):
    """Local keys at real distance; global keys outside the window at distance
    min(limit_distance, Tk - 1); globals inside the window once. lse pins the counting."""
    G, L, Tk = 3, 4, 12
    q, k, v = make_qkv((1, tq, Tk, 2, 1, 16))
    off = Tk - tq
    pos = torch.arange(Tk) * 3 + 7  # non-trivial positions
    cap = min(L if limit_distance is None else limit_distance, Tk - 1)
    qr, kr = rope(q, pos[off:], INV_FREQ_16), rope(k, pos, INV_FREQ_16)
    q_cap = rope(q, torch.full((tq,), cap), INV_FREQ_16)  # query at position cap, key at 0
    scale = 1 / 4

    def visible(t, j):
        i = off + t
        return j <= i and (i - j < L or j < G)

    def logit(b, h, t, j):
        i = off + t
        if i - j < L:
            return scale * qr[b, t, h] @ kr[b, j, 0]
        return scale * q_cap[b, t, h] @ k[b, j, 0]

    want_o = torch.zeros(1, tq, 2, 16, dtype=F64)
    want_lse = torch.zeros(1, 2, tq, dtype=F64)
    for h in range(2):
        for t in range(tq):
            js = [j for j in range(Tk) if visible(t, j)]
            s = torch.stack([logit(0, h, t, j) for j in js])
            want_lse[0, h, t] = torch.logsumexp(s, 0)
            want_o[0, t, h] = torch.softmax(s, 0) @ v[0, js, 0]
    got_o, got_lse = lambda_attention_ref(
        q, k, v, rotary=Rotary(INV_FREQ_16, positions=pos), n_global=G, n_local=L,
        limit_distance=limit_distance, return_lse=True,
    )  # fmt: skip
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-12)


def test_lambda_distance_cap_is_a_relative_distance():
    """q_cap . k_glob equals R(p) q . R(p - d) k for any p: every global key sits at d."""
    q, k, _ = make_qkv((1, 5, 30, 1, 1, 16))
    lp = LambdaParams(n_global=2, n_local=8, limit_distance=11)
    li = lambda_inputs(q, k, Rotary(INV_FREQ_16), lp, q_offset=25)
    got = torch.einsum("bqhd,bkhd->bqk", li.q_cap, li.k_glob)
    for p in (11, 500, 98_765):
        qr = rope(q, torch.full((5,), p), INV_FREQ_16)
        kr = rope(k[:, :2], torch.full((2,), p - 11), INV_FREQ_16)
        torch.testing.assert_close(got, torch.einsum("bqhd,bkhd->bqk", qr, kr), rtol=0, atol=1e-10)
    assert LambdaParams(2, 8).effective_limit(100) == 8
    assert LambdaParams(2, 8, 50).effective_limit(20) == 19  # official: min(limit, Tk - 1)


# ----------------------------------------------------------------------------- merge
@pytest.mark.parametrize("activation", ["softmax", "sigmoid"])
def test_merge_of_disjoint_key_sets_is_full_attention(activation):
    q, k, v = make_qkv((2, 17, 63, 4, 2, 16))
    a = global_tokens(5)  # keys j < 5 ...
    b = AttentionSpec(mask=sliding_window(left=20)).mask  # ... and a window: overlap for early queries
    b_only = lambda bb, h, i, j: b(bb, h, i, j) & (j >= 5)  # noqa: E731  disjoint from a
    kw = dict(activation=activation, return_lse=True)
    o_a, l_a = attention_ref(q, k, v, mask=a, **kw)
    o_b, l_b = attention_ref(q, k, v, mask=b_only, **kw)
    full = lambda bb, h, i, j: a(bb, h, i, j) | b(bb, h, i, j)  # noqa: E731
    want_o, want_l = attention_ref(q, k, v, mask=full, **kw)
    got_o, got_l = merge_attention(o_a, l_a, o_b, l_b, activation=activation)
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_l, want_l, rtol=0, atol=1e-12)


def test_merge_with_empty_passes():
    o = torch.randn(1, 3, 2, 4, dtype=F64)
    lse = torch.tensor([[[0.5, float("-inf"), float("-inf")], [1.0, float("-inf"), 2.0]]], dtype=F64)
    empty = torch.full_like(lse, float("-inf"))
    zero = torch.zeros_like(o)
    got, got_lse = merge_attention(o.masked_fill(torch.isneginf(lse).transpose(1, 2)[..., None], 0), lse, zero, empty)
    assert torch.isfinite(got).all()
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(lse))
    assert (got[0, 1, 0] == 0).all()  # both passes empty -> 0


def _ref_kernel(q, k, v, *, mask, q_offset, scale, activation):
    return attention_ref(q, k, v, mask=mask, q_offset=q_offset, scale=scale, activation=activation, return_lse=True)


def _flex_kernel(q, k, v, *, mask, q_offset, scale, activation):
    spec = AttentionSpec(mask=mask, activation=activation, scale=scale)
    return attention(q, k, v, spec, backend="flex", q_offset=q_offset, return_lse=True)


@pytest.mark.parametrize("activation", ["softmax", "sigmoid"])
@pytest.mark.parametrize("tq", [217, 17, 1], ids=["prefill217", "chunk17of217", "decode1of217"])
def test_lambda_two_pass_merge_equals_reference(tq, activation):
    """The flash route, with the reference standing in for the two kernel calls."""
    q, k, v = make_qkv((1, tq, 217, 4, 2, 16))
    lp, rot = LambdaParams(4, 16), Rotary(INV_FREQ_16)
    want = lambda_attention_ref(q, k, v, rotary=rot, n_global=4, n_local=16, activation=activation, return_lse=True)
    got = lambda_two_pass(_ref_kernel, q, k, v, rotary=rot, lp=lp, q_offset=217 - tq, scale=0.25, activation=activation)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_lambda_two_pass_with_flex_kernel():
    shape = (1, 63, 217, 4, 2, 16)
    exact = make_qkv(shape)
    lp, rot = LambdaParams(4, 16), Rotary(INV_FREQ_16)
    want = lambda_attention_ref(*exact, rotary=rot, n_global=4, n_local=16)
    ref32 = lambda_attention_ref(*low(exact, F32), rotary=rot, n_global=4, n_local=16)
    got, _ = lambda_two_pass(_flex_kernel, *low(exact, F32), rotary=rot, lp=lp, q_offset=154, scale=0.25)
    assert_within_budget(got, ref32, want)


# ----------------------------------------------------------------------------- backends: forward
@functools.lru_cache(maxsize=None)
def _references(shape, spec_name, dtype):
    """(out, lse) of the reference in float64 and in `dtype`; shared by every backend."""
    spec, rot = _spec(spec_name, SHAPES[shape][3]), rotary_for(spec_name, SHAPES[shape][5])
    exact = make_qkv(SHAPES[shape])
    want = attention_ref_spec(*exact, spec, rotary=rot, return_lse=True)
    return (*want, *attention_ref_spec(*low(exact, dtype), spec, rotary=rot, return_lse=True))


def _forward_cases():
    for backend in BACKENDS:
        for shape in SHAPES:
            for dt in (F32, F16, BF16):
                if dt != F32 and shape not in LOWP_SHAPES:
                    continue
                # flex traces each (spec, bucket, dtype) anew (~0.5 s, compiled: seconds)
                slow = backend == "flex_compiled" or (
                    backend == "flex" and (shape == "prefill63_d64" or dt != F32 and shape != LOWP_SHAPES[0])
                )
                for spec in SPECS:
                    # soft-capped specs: the default tier on two shapes (a chunk, a decode step)
                    capped_slow = "softcap" in spec and shape not in ("chunk17of63_gqa", "decode1of217_d64")
                    yield pytest.param(
                        backend, shape, spec, dt, id=f"{backend}-{shape}-{spec}-{str(dt)[6:]}",
                        marks=[pytest.mark.slow] if slow or capped_slow else [],
                    )  # fmt: skip


@pytest.mark.parametrize("backend,shape,spec_name,dtype", list(_forward_cases()))
def test_backend_forward(backend, shape, spec_name, dtype):
    B, Tq, Tk, H, Hkv, D = SHAPES[shape]
    spec = _spec(spec_name, H)
    rot = rotary_for(spec_name, D)
    exact = make_qkv(SHAPES[shape])
    want, want_lse, ref_lp, ref_lp_lse = _references(shape, spec_name, dtype)
    got = run_or_check_refusal(backend, low(exact, dtype), spec, rotary=rot, return_lse=True)
    if got is None:  # no lse from this backend: check the output alone
        got = run_or_check_refusal(backend, low(exact, dtype), spec, rotary=rot)
        if got is None:
            return
        got = (got, None)
    out, lse = got
    assert out.dtype == dtype and out.shape == (B, Tq, H, D)
    assert_within_budget(out, ref_lp, want, what=f"{backend} output")
    if lse is not None:
        assert_within_budget(lse, ref_lp_lse, want_lse, what=f"{backend} lse", precision=dtype)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("spec_name", SPECS)
def test_backend_forward_float64(backend, spec_name):
    """In float64 a backend has no rounding excuse: it must agree to ~1e-12."""
    shape = SHAPES["chunk17of63_gqa"]
    spec, rot = _spec(spec_name, shape[3]), rotary_for(spec_name, shape[5])
    qkv = make_qkv(shape)
    got = run_or_check_refusal(backend, qkv, spec, rotary=rot)
    if got is not None:
        torch.testing.assert_close(got, attention_ref_spec(*qkv, spec, rotary=rot), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["blockwise", "sdpa", "flash"])
@pytest.mark.parametrize("spec_name", ["window8", "lambda4_16", "swat16_rope", "alibi"])
def test_backend_forward_long(backend, spec_name):
    """~1000 tokens: several blockwise query blocks (BLOCK_Q = 128), window and Λ reads."""
    assert LONG_SHAPE[1] > 4 * BLOCK_Q
    spec, rot = _spec(spec_name, LONG_SHAPE[3]), rotary_for(spec_name, LONG_SHAPE[5])
    exact = make_qkv(LONG_SHAPE)
    want = attention_ref_spec(*exact, spec, rotary=rot)
    ref32 = attention_ref_spec(*low(exact, F32), spec, rotary=rot)
    got = run_or_check_refusal(backend, low(exact, F32), spec, rotary=rot)
    if got is not None:
        assert_within_budget(got, ref32, want)


# ----------------------------------------------------------------------------- backends: gradients
def _grads(fn, qkv, seed=1):
    out = fn(*qkv)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), qkv)


def _grad_cases():
    for shape in GRAD_SHAPES:
        for dt in GRAD_DTYPES:
            for spec in SPECS:
                yield pytest.param(shape, spec, dt, id=f"{shape}-{spec}-{str(dt)[6:]}")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "ref"])
@pytest.mark.parametrize("shape,spec_name,dtype", list(_grad_cases()))
def test_backend_gradients(backend, shape, spec_name, dtype):
    H, D = SHAPES[shape][3], SHAPES[shape][5]
    spec, rot = _spec(spec_name, H), rotary_for(spec_name, D)
    exact = make_qkv(SHAPES[shape], requires_grad=True)
    call = CallInfo.from_call(*low(exact, dtype, True), rotary=rot)
    if BACKENDS[backend].supports(spec, call) is not None:
        with pytest.raises(NotImplementedError):
            attention(*low(exact, dtype, True), spec, backend=backend, rotary=rot)
        return
    want = _grads(lambda *t: attention_ref_spec(*t, spec, rotary=rot), exact)
    ref_lp = _grads(lambda *t: attention_ref_spec(*t, spec, rotary=rot), low(exact, dtype, True))
    got = _grads(lambda *t: attention(*t, spec, backend=backend, rotary=rot), low(exact, dtype, True))
    for name, g, r, w in zip("qkv", got, ref_lp, want):
        assert g.dtype == dtype
        assert_within_budget(g, r, w, what=f"{backend} d{name}")


@pytest.mark.parametrize("spec_name", ["window8", "lambda4_16", "swat16_rope"])
def test_blockwise_gradients_long(spec_name):
    spec, rot = _spec(spec_name, LONG_SHAPE[3]), rotary_for(spec_name, LONG_SHAPE[5])
    exact = make_qkv(LONG_SHAPE, requires_grad=True)
    want = _grads(lambda *t: attention_ref_spec(*t, spec, rotary=rot), exact)
    ref32 = _grads(lambda *t: attention_ref_spec(*t, spec, rotary=rot), low(exact, F32, True))
    got = _grads(lambda *t: attention(*t, spec, backend="blockwise", rotary=rot), low(exact, F32, True))
    for name, g, r, w in zip("qkv", got, ref32, want):
        assert_within_budget(g, r, w, what=f"blockwise d{name}")


# ----------------------------------------------------------------------------- compiled flex
@pytest.mark.slow  # an inductor compile, ~21 s from a cold cache: the slow tier's compiled-flex step
def test_flex_compiled_buckets_lengths():
    """One compile serves every length in a bucket (offset and Tk are captured tensors)."""
    from torch._dynamo.utils import counters

    spec = AttentionSpec(mask=sliding_window(left=7))
    assert flex_bucket(1) == flex_bucket(17) == flex_bucket(100) == 128
    assert flex_bucket(129) == 256 and flex_bucket(1025) == 2048
    graphs = None
    for Tq, Tk in [(17, 17), (63, 100), (1, 90), (100, 100)]:
        exact = make_qkv((1, Tq, Tk, 4, 2, 16))
        out = attention(*low(exact, F32), spec, backend="flex_compiled")
        assert_within_budget(out, attention_ref_spec(*low(exact, F32), spec), attention_ref_spec(*exact, spec))
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled for a length inside a bucket"


# ----------------------------------------------------------------------------- dispatcher, specs
def test_every_backend_runs_plain_causal_forward():
    """Every backend can do plain causal attention; on CPU tensors a GPU-only backend (cuda, or
    triton outside the interpreter) may refuse, but only for the device."""
    exact = make_qkv(SHAPES["prefill17_gqa"])
    for name, b in BACKENDS.items():
        assert b.supports(AttentionSpec()) is None, name  # method-only check, no call facts
        call = CallInfo.from_call(*low(exact, F32))
        reason = b.supports(AttentionSpec(), call)
        assert reason is None or "CUDA" in reason or "TRITON_INTERPRET" in reason, (name, reason)


def test_dispatcher_raises_with_reason_and_falls_back(caplog):
    qkv = low(make_qkv(SHAPES["prefill17_gqa"]), F32)
    spec = AttentionSpec.swat(8, 4)
    with pytest.raises(NotImplementedError, match="softmax-only"):
        attention(*qkv, spec, backend="sdpa")
    with pytest.raises(NotImplementedError, match="softmax-only"):
        attention_sdpa(*qkv, spec)  # direct calls refuse too
    with caplog.at_level(logging.WARNING, logger="lcx.attention.backends"):
        out = attention(*qkv, spec, backend="sdpa", fallback=True)
    assert "falling back to 'blockwise'" in caplog.text
    torch.testing.assert_close(out, attention(*qkv, spec, backend="blockwise"))
    with pytest.raises(ValueError, match="not known"):
        attention(*qkv, spec, backend="nope")
    qkv_grad = low(qkv, F32, requires_grad=True)
    with pytest.raises(NotImplementedError, match="no backward on CPU"):
        attention(*qkv_grad, AttentionSpec(), backend="flex")


def test_backend_for_keeps_a_backend_that_runs_the_spec_else_blockwise():
    capped = AttentionSpec(softcap=2.0)
    assert backend_for("sdpa", AttentionSpec()) == "sdpa"
    assert backend_for("flex", capped) == "flex"  # score_mod caps
    assert backend_for("sdpa", capped) == "blockwise"  # fused kernels have no soft-capping
    assert backend_for("flash", AttentionSpec.swat(8, 4)) == "blockwise"
    with pytest.raises(ValueError, match="not known"):
        backend_for("nope", capped)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_backends_give_zero_for_rows_without_keys(backend):
    qkv = low(make_qkv((1, 5, 9, 2, 2, 16)), F32)
    spec = AttentionSpec(mask=global_tokens(2))  # queries at 4.. see keys 0, 1
    out = run_or_check_refusal(backend, qkv, spec, q_offset=0)
    if out is not None:
        torch.testing.assert_close(out, attention_ref_spec(*qkv, spec, q_offset=0), rtol=0, atol=1e-5)
    empty = AttentionSpec(mask=global_tokens(0))
    out = run_or_check_refusal(backend, qkv, empty)
    if out is not None:
        assert torch.equal(out, torch.zeros_like(out))


def test_alibi_schedules():
    assert alibi_slopes(8) == tuple(2.0**-i for i in range(1, 9))
    assert alibi_slopes(6) == (2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3)  # Press et al.
    assert balanced_alibi_slopes(4) == (2**-4, 2**-8, -(2**-4), -(2**-8))
    with pytest.raises(ValueError):
        balanced_alibi_slopes(3)


@pytest.mark.parametrize(
    "bad",
    [lambda: AttentionSpec(activation="relu"),
     lambda: AttentionSpec(mask=sliding_window(left=3), lambda_params=LambdaParams(2, 4)),
     lambda: AttentionSpec.lm_infinite(2, 4, alibi_slopes=(1.0,)),
     lambda: AttentionSpec(alibi_slopes=(float("nan"),)),
     lambda: LambdaParams(2, 0),
     lambda: AttentionSpec(softcap=0.0), lambda: AttentionSpec(softcap=-1.0),
     lambda: AttentionSpec(softcap=float("inf")), lambda: AttentionSpec(softcap=True)],
    ids=["activation", "lambda_mask_mismatch", "lambda_alibi", "nan_slope", "no_window", "softcap_zero",
         "softcap_negative", "softcap_inf", "softcap_bool"],
)  # fmt: skip
def test_bad_specs_raise(bad):
    with pytest.raises(ValueError):
        bad()


def test_lambda_needs_rotary_and_shapes_are_checked():
    qkv = low(make_qkv(SHAPES["prefill17_gqa"]), F32)
    with pytest.raises(ValueError, match="rotary"):
        attention(*qkv, AttentionSpec.lm_infinite(2, 4), backend="ref")
    with pytest.raises(ValueError, match="alibi slopes"):
        attention(*qkv, AttentionSpec(alibi_slopes=(1.0, 2.0)), backend="ref")
    q, k, v = qkv
    with pytest.raises(ValueError, match="multiple"):
        attention(q[:, :, :3], k, v, AttentionSpec(), backend="ref")
