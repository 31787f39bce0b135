"""RoPE library: registry coverage, validation, parity with transformers, precision, rotation algebra."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lcx.rope.spec import MODEL_KEYS

from lcx.rope import (
    ROPE_TYPES,
    PartialRopeSpec,
    RopeSpec,
    apply_rotary_ref,
    compute_inv_freq,
    rope_cos_sin,
    rotate_by_positions_ref,
)

HEAD_DIMS = (32, 64, 80, 128)
BASES = (10_000.0, 500_000.0)
FACTORS = (2.0, 4.0, 16.0, 32.0)
L = 2048
PARITY_RTOL = 1e-6  # the bar: lcx vs transformers inv_freq / attention_factor


def example_spec(rope_type: str, *, head_dim: int = 64, base: float = 10_000.0, factor: float = 4.0,
                 partial: float = 1.0) -> RopeSpec:
    """One valid spec per registry entry. A new RoPE type must add its example here."""
    half = int(head_dim * partial) // 2
    common = dict(rope_theta=base, partial_rotary_factor=partial)
    examples = {
        "default": dict(),
        "linear": dict(factor=factor),
        "ntk": dict(factor=factor),
        "dynamic": dict(factor=factor, original_max_position_embeddings=L),
        "yarn": dict(factor=factor, original_max_position_embeddings=L),
        "llama3": dict(factor=factor, original_max_position_embeddings=L, low_freq_factor=1.0,
                       high_freq_factor=4.0),
        "longrope": dict(factor=factor, original_max_position_embeddings=L,
                         short_factor=[1.0 + 0.01 * i for i in range(half)],
                         long_factor=[1.0 + 0.5 * i for i in range(half)]),
        "truncate": dict(original_max_position_embeddings=L),
    }
    return RopeSpec(rope_type=rope_type, **common, **examples[rope_type])


def test_every_registry_entry_has_an_example_and_runs():
    for name, entry in ROPE_TYPES.items():
        spec = example_spec(name)
        inv_freq, af = compute_inv_freq(spec, 64)
        assert inv_freq.shape == (32,) and inv_freq.dtype == torch.float64, name
        assert torch.isfinite(inv_freq).all() and (inv_freq >= 0).all() and af > 0, name
        assert entry.required <= set(spec.to_dict()), name


# ----------------------------------------------------------------------------- validation
BAD_SPECS = [
    ({"rope_type": "nope"}, "rope_type='nope'"),
    ({"rope_type": "linear"}, "requires 'factor'"),
    ({"rope_type": "linear", "factor": 0.5}, "factor must be >= 1"),
    ({"rope_type": "linear", "factor": float("nan")}, "factor must be a finite number"),
    ({"rope_type": "yarn", "factor": 4}, "requires 'original_max_position_embeddings'"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0}, "positive integer"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 10, "beta_fast": 1, "beta_slow": 2},
     "beta_fast"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 10, "mscale": 1.0}, "mscale"),
    ({"rope_type": "linear", "factor": 2, "beta_fast": 3}, "'beta_fast' does not apply"),
    ({"rope_type": "linear", "factr": 2}, "unknown RoPE key(s) ['factr']"),
    ({"rope_type": "longrope", "original_max_position_embeddings": 10, "short_factor": [1, 1],
      "long_factor": [1]}, "long_factor has 1"),
    ({"rope_type": "longrope", "original_max_position_embeddings": 10, "short_factor": [1, -1],
      "long_factor": [1, 1]}, "short_factor entries"),
    ({"rope_type": "default", "rope_theta": -1.0}, "rope_theta must be > 0"),
    ({"rope_type": "default", "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": 8192, "low_freq_factor": 4,
      "high_freq_factor": 1}, "high_freq_factor"),
    ({"type": "linear", "rope_type": "yarn", "factor": 2}, "both 'type'"),
]


@pytest.mark.parametrize("bad,message", BAD_SPECS, ids=[m for _, m in BAD_SPECS])
def test_invalid_specs_raise_naming_the_problem(bad, message):
    with pytest.raises(ValueError) as e:
        RopeSpec.from_dict(bad)
    assert message in str(e.value)


def test_wrong_longrope_length_for_head_dim_raises():
    spec = example_spec("longrope", head_dim=64)
    with pytest.raises(ValueError, match="needs 64"):
        compute_inv_freq(spec, 128)


def test_unset_theta_raises_and_for_model_fills_it():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="rope_theta is unset"):
        compute_inv_freq(RopeSpec(rope_type="linear", factor=2), 64)
    cfg = LlamaConfig(max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    spec = RopeSpec.for_model({"rope_type": "yarn", "factor": 16}, cfg)
    assert spec.rope_theta == 1e5 and spec.original_max_position_embeddings == 256


def test_legacy_type_key_and_roundtrip():
    spec = RopeSpec.from_dict({"type": "yarn", "factor": 4, "original_max_position_embeddings": 16,
                               "rope_theta": 1e4, "max_position_embeddings": 64})
    assert spec.rope_type == "yarn"
    assert RopeSpec.from_dict(spec.to_dict()) == spec



# ----------------------------------------------------------------------------- partial specs
# What a user leaves to the model in a partial spec: every registered type, its model keys removed
PARTIAL_GRID = sorted(ROPE_TYPES)


@pytest.mark.parametrize("rope_type", PARTIAL_GRID)
def test_partial_spec_checked_without_a_model_and_resolved_once(rope_type):
    """A partial spec (model keys left out) is accepted at the edge with no model at hand, and
    resolving it fills exactly the model keys: the same spec as the full one."""
    from types import SimpleNamespace

    full = example_spec(rope_type).to_dict()
    given = {k: v for k, v in full.items() if k not in MODEL_KEYS}
    partial = PartialRopeSpec(given)
    assert partial.to_dict() == given and partial.rope_type == rope_type
    model = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": full["rope_theta"]},
                            max_position_embeddings=L)
    assert partial.resolve(model) == example_spec(rope_type)
    assert RopeSpec.for_model(given, model) == partial.resolve(model)


@pytest.mark.parametrize("d,match", [
    ({"factor": 4}, r"RoPE keys \['factor'\] given without rope_type"),
    ({"rope_type": "yarn", "factr": 4}, r"unknown RoPE key\(s\) \['factr'\]"),
    ({"rope_type": "yarn"}, "rope_type='yarn' requires 'factor'"),
    ({"rope_type": "yarn", "factor": 0.5}, "factor must be >= 1"),
    ({"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 0},
     "original_max_position_embeddings must be a positive integer"),
    ({"rope_type": "linear", "factor": 2, "beta_fast": 3}, "key 'beta_fast' does not apply"),
    ({"rope_type": "longrope", "short_factor": "ab", "long_factor": [1.0]}, "short_factor must be a list"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 2.0]}, "short_factor has 1 entries"),
    ({"type": "yarn", "rope_type": "linear", "factor": 2}, "both 'type'"),
])
def test_partial_spec_errors_name_the_key(d, match):
    with pytest.raises(ValueError, match=match):
        PartialRopeSpec(d)


def test_partial_spec_reads_hf_forms():
    p = PartialRopeSpec({"type": "yarn", "factor": 4, "max_position_embeddings": 64, "beta_fast": None})
    assert dict(p) == {"rope_type": "yarn", "factor": 4}  # legacy key read, model key and Nones dropped
    assert PartialRopeSpec() == {} and PartialRopeSpec(RopeSpec(rope_type="linear", factor=2)).describe() == "linear(s=2)"
    with pytest.raises(ValueError, match="the model config has no rope_theta"):
        PartialRopeSpec({"rope_type": "linear", "factor": 2}).resolve(object())


# ----------------------------------------------------------------------------- transformers parity
def _hf_config(spec: RopeSpec, head_dim: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=spec.original_max_position_embeddings or L,
                      rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})
    cfg.rope_parameters = spec.to_dict()  # same dict, HF key names
    return cfg


def _hf_inv_freq(spec: RopeSpec, head_dim: int, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _hf_config(spec, head_dim)
    if spec.rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[spec.rope_type](cfg, None, seq_len=seq_len)


PARITY_TYPES = [n for n, e in ROPE_TYPES.items() if e.in_transformers]
PARITY_GRID = [
    (t, d, b, s, seq)
    for t in PARITY_TYPES
    for d in HEAD_DIMS
    for b in BASES
    for s in FACTORS
    for seq in ((None, L, 3 * L + 5, 16 * L) if ROPE_TYPES[t].length_dependent
                else (None,))
    if not (t == "default" and s != FACTORS[0])
]


@pytest.mark.parametrize("rope_type,head_dim,base,factor,seq_len", PARITY_GRID,
                         ids=[f"{t}-d{d}-b{b:g}-s{s:g}-n{q}" for t, d, b, s, q in PARITY_GRID])
def test_inv_freq_matches_transformers(rope_type, head_dim, base, factor, seq_len):
    spec = example_spec(rope_type, head_dim=head_dim, base=base, factor=factor)
    ours, af = compute_inv_freq(spec, head_dim, seq_len)
    theirs, af_hf = _hf_inv_freq(spec, head_dim, seq_len)
    theirs = theirs.to(torch.float64)
    allowed = PARITY_RTOL * theirs.abs()
    if rope_type == "llama3":
        allowed = allowed + _hf_fp32_error_bound(spec, head_dim)
    bad = (ours - theirs).abs() > allowed
    assert not bad.any(), f"{bad.sum()} of {bad.numel()} differ: {ours[bad]} vs {theirs[bad]}"
    assert af == pytest.approx(af_hf, rel=PARITY_RTOL)


def _hf_fp32_error_bound(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """transformers evaluates llama3's blend in float32; lcx in float64.

    In the blend x = (1 - a)*theta/s + a*theta with a = (L/wavelen - lo)/(hi - lo), a float32
    rounding of a (relative eps ~6e-8, amplified by L/wavelen/(hi-lo)) moves x by
    |da|*|theta - theta/s|, which near the band edges exceeds 1e-6 of x. The bound is that
    derived error (x4 for the few float32 ops involved); elsewhere the 1e-6 rtol applies.
    """
    eps = torch.finfo(torch.float32).eps
    theta, _ = compute_inv_freq(RopeSpec(rope_theta=spec.rope_theta), head_dim)
    ratio = spec.original_max_position_embeddings * theta / (2 * math.pi)  # L / wavelen
    da = 4 * eps * (ratio.abs() + spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    return da * (theta - theta / spec.factor).abs()  # per channel


@pytest.mark.parametrize("rope_type", [t for t in PARITY_TYPES if t != "default"])
def test_partial_rotary_matches_transformers(rope_type):
    spec = example_spec(rope_type, head_dim=64, partial=0.5)
    ours, af = compute_inv_freq(spec, 64, 5 * L)
    theirs, af_hf = _hf_inv_freq(spec, 64, 5 * L)
    assert ours.shape == (16,)
    torch.testing.assert_close(ours, theirs.to(torch.float64), rtol=PARITY_RTOL, atol=0)
    assert af == pytest.approx(af_hf, rel=PARITY_RTOL)


@pytest.mark.parametrize("extra", [dict(attention_factor=0.9), dict(mscale=0.707, mscale_all_dim=0.707),
                                   dict(mscale=1.0, mscale_all_dim=0.5), dict(beta_fast=16, beta_slow=2),
                                   dict(truncate=False)], ids=str)
def test_yarn_options_match_transformers(extra):
    spec = example_spec("yarn", factor=40).replace(**extra)
    ours, af = compute_inv_freq(spec, 128)
    theirs, af_hf = _hf_inv_freq(spec, 128, None)
    torch.testing.assert_close(ours, theirs.to(torch.float64), rtol=PARITY_RTOL, atol=0)
    assert af == pytest.approx(af_hf, rel=PARITY_RTOL)


# ----------------------------------------------------------------------------- lcx-only types
def test_ntk_is_default_with_scaled_base():
    d, s, b = 64, 8.0, 10_000.0
    ntk, _ = compute_inv_freq(RopeSpec(rope_type="ntk", factor=s, rope_theta=b), d)
    ref, _ = compute_inv_freq(RopeSpec(rope_theta=b * s ** (d / (d - 2))), d)
    torch.testing.assert_close(ntk, ref, rtol=1e-15, atol=0)
    # The lowest frequency is interpolated by exactly s, the highest is kept.
    base, _ = compute_inv_freq(RopeSpec(rope_theta=b), d)
    assert ntk[0] == base[0]
    assert (base[-1] / ntk[-1]).item() == pytest.approx(s ** ((d - 2) / (d - 2)), rel=1e-12)


def test_dynamic_is_unscaled_up_to_L():
    spec = example_spec("dynamic")
    base, _ = compute_inv_freq(RopeSpec(rope_theta=spec.rope_theta), 64)
    for n in (None, 1, L):
        torch.testing.assert_close(compute_inv_freq(spec, 64, n)[0], base, rtol=0, atol=0)
    assert (compute_inv_freq(spec, 64, L + 1)[0] < base).any()


def test_truncate_matches_giraffe_rule():
    T = 256
    spec = RopeSpec(rope_type="truncate", truncate_length=T, rope_theta=10_000.0)
    theta, _ = compute_inv_freq(RopeSpec(rope_theta=10_000.0), 64)
    out, af = compute_inv_freq(spec, 64)
    c = 2 * math.pi / T
    assert af == 1.0
    for th, o in zip(theta.tolist(), out.tolist()):
        if th >= c:
            assert o == th  # wavelength <= T: kept
        elif th >= c / 8:
            assert o == pytest.approx(c / 16)  # truncated to rho
        else:
            assert o == 0.0  # no rotation
    # All three regions are populated for this setting, so the test checks each rule.
    assert (out == 0).any() and (out == theta).any() and ((out - c / 16).abs() < 1e-15).any()


# ----------------------------------------------------------------------------- precision
def test_angles_at_ten_million_lose_no_precision():
    inv_freq, _ = compute_inv_freq(RopeSpec(rope_theta=10_000.0), 64)
    pos = torch.tensor([10_000_000, 10_000_001, 9_999_999])
    cos, sin = rope_cos_sin(pos, inv_freq, dtype=torch.float32)
    mpmath.mp.dps = 40
    worst = 0.0
    naive_worst = 0.0
    naive = (pos.float()[:, None] * inv_freq.float()[None, :])  # what an fp32 implementation does
    for r, p in enumerate(pos.tolist()):
        for i, f in enumerate(inv_freq.tolist()):
            exact = mpmath.mpf(p) * mpmath.mpf(f)  # f is the exact double lcx uses
            worst = max(worst, abs(float(mpmath.cos(exact)) - cos[r, i].item()),
                        abs(float(mpmath.sin(exact)) - sin[r, i].item()))
            naive_worst = max(naive_worst, abs(float(mpmath.cos(exact)) - math.cos(naive[r, i].item())))
    assert worst < 1e-6, worst  # fp32 rounding of the result only
    assert naive_worst > 1e-2, naive_worst  # proves the check can fail: fp32 products are off


def test_fractional_positions():
    inv_freq, _ = compute_inv_freq(RopeSpec(rope_theta=10_000.0), 16)
    cos, _ = rope_cos_sin(torch.tensor([2.5]), inv_freq, dtype=torch.float64)
    assert cos[0, 0].item() == pytest.approx(math.cos(2.5))


# ----------------------------------------------------------------------------- rotation algebra
@settings(max_examples=40, deadline=None)
@given(p=st.integers(-10**7, 10**7), rope_type=st.sampled_from(sorted(ROPE_TYPES)), seed=st.integers(0, 100))
def test_rotate_then_unrotate_is_identity(p, rope_type, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, 2, 64, dtype=torch.float64, generator=g)  # [B, T, H, D]
    inv_freq, _ = compute_inv_freq(example_spec(rope_type), 64)
    pos = torch.full((1, 3), p)
    y = rotate_by_positions_ref(x, pos, inv_freq)
    back = rotate_by_positions_ref(y, -pos, inv_freq)
    torch.testing.assert_close(back, x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rotate_by_positions_ref(y, pos, inv_freq, inverse=True), x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rope_type", sorted(ROPE_TYPES))
def test_inverse_undoes_attention_factor(rope_type):
    spec = example_spec(rope_type)
    inv_freq, af = compute_inv_freq(spec, 64, 4 * L)
    x = torch.randn(2, 5, 3, 64, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(5) * 1000, inv_freq, af, torch.float64)
    y = apply_rotary_ref(x, cos, sin)
    torch.testing.assert_close(apply_rotary_ref(y, cos, sin, inverse=True), x, rtol=1e-12, atol=1e-12)
    # y = af * R x: norms scale by af exactly
    torch.testing.assert_close(y.norm(dim=-1), af * x.norm(dim=-1), rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 10**6), n=st.integers(0, 10**6), t=st.integers(-10**6, 10**6),
       rope_type=st.sampled_from(sorted(ROPE_TYPES)))
def test_relative_position_invariance(m, n, t, rope_type):
    """<R(m)q, R(n)k> = <R(m+t)q, R(n+t)k>: the score depends on m-n only."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 64, dtype=torch.float64).unbind(0)  # each [B=1, T=1, H=1, D]
    inv_freq, _ = compute_inv_freq(example_spec(rope_type), 64)

    def score(a, b):
        qa = rotate_by_positions_ref(q, torch.tensor([[a]]), inv_freq)
        kb = rotate_by_positions_ref(k, torch.tensor([[b]]), inv_freq)
        return (qa * kb).sum().item()

    assert score(m, n) == pytest.approx(score(m + t, n + t), abs=1e-8)


def test_partial_rotary_leaves_tail_channels():
    spec = RopeSpec(rope_theta=10_000.0, partial_rotary_factor=0.25)
    inv_freq, _ = compute_inv_freq(spec, 64)
    assert inv_freq.shape == (8,)
    x = torch.randn(1, 4, 2, 64)
    cos, sin = rope_cos_sin(torch.arange(4), inv_freq)
    y = apply_rotary_ref(x, cos, sin)
    assert torch.equal(y[..., 16:], x[..., 16:])
    assert not torch.allclose(y[..., :16], x[..., :16])
