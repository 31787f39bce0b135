"""lcx.patch: patched models compute what a model rebuilt with the same rope_parameters computes."""

from __future__ import annotations

import copy

import pytest
import torch

import lcx
from lcx.hf import ROPE_MODEL_TYPES
from lcx.hf.models import global_layer_type, model_shape, tiny_model
from lcx import patch, patched, unpatch
from lcx.hf.rope_patch import current_spec
from lcx.rope import ROPE_TYPES, RopeSpec, compute_inv_freq

L = 32  # tiny original context so sequences of 3-4 L stay cheap
T = 97  # odd length, ~3L: extrapolation regime
LOGIT_TOL = dict(rtol=1e-4, atol=2e-5)  # fp32; HF forms angles in fp32, lcx in fp64


def _tiny(model_type: str, theta: float = 10_000.0, seed: int = 0):
    return tiny_model(model_type, rope_theta=theta, seed=seed, max_position_embeddings=L)


def _rebuilt(model, rope_parameters: dict):
    """A fresh model of the same class whose config carries `rope_parameters` (HF computes RoPE);
    on a model with RoPE per layer type (Gemma 3), those of the global layers."""
    cfg = copy.deepcopy(model.config)
    typed = global_layer_type(model)
    cfg.rope_parameters = rope_parameters if typed is None else {**cfg.rope_parameters, typed: rope_parameters}
    other = type(model)(cfg).eval()
    other.load_state_dict(model.state_dict())
    return other


SPECS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [1.0 + 1.5 * i for i in range(8)]},
}
HF_GRID = [(mt, name) for mt in ROPE_MODEL_TYPES for name in SPECS]


def _sized(spec: dict, model) -> dict:
    """`spec` with LongRoPE's factors cut to the model's rotary pairs (a partial rotary family
    rotates fewer channels than its head has)."""
    n = model_shape(model).rotary_dim // 2
    return {k: v[:n] if k.endswith("_factor") and isinstance(v, list) else v for k, v in spec.items()}


@pytest.mark.parametrize("model_type,name", HF_GRID, ids=[f"{m}-{n}" for m, n in HF_GRID])
def test_patched_equals_rebuilt_hf_model(model_type, name):
    model = _tiny(model_type)
    ids = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids).logits
        with patched(model, _sized(SPECS[name], model)):
            out = model(ids).logits
            spec = current_spec(model)  # resolved against the model (its theta, its pretraining length)
        restored = model(ids).logits
        ref = _rebuilt(model, spec.to_dict())(ids).logits
    torch.testing.assert_close(out, ref, **LOGIT_TOL)
    # the patch really changed the computation, and unpatching really restored it
    assert (out - plain).abs().max() > 100 * LOGIT_TOL["atol"]
    assert torch.equal(restored, plain)


def test_longrope_switches_basis_with_length_like_hf():
    model = _tiny("llama")
    spec = RopeSpec.for_model(SPECS["longrope"], model.config)
    ref_model = _rebuilt(model, spec.to_dict())
    for n in (L - 3, L, L + 1, 3 * L):  # short basis up to L, long beyond
        ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad(), patched(model, spec):
            out = model(ids).logits
        with torch.no_grad():
            ref = ref_model(ids).logits
        torch.testing.assert_close(out, ref, **LOGIT_TOL)


@pytest.mark.parametrize("name", [n for n, e in ROPE_TYPES.items() if not e.in_transformers])
def test_lcx_only_types_equal_hf_machinery_with_our_inv_freq(name):
    """ntk and truncate have no transformers type: load our inv_freq into HF's own rotary module."""
    model = _tiny("llama")
    spec = RopeSpec.for_model({"rope_type": name, **({"factor": 4.0} if name == "ntk" else {})}, model.config)
    inv_freq, af = compute_inv_freq(spec, 16)
    ref_model = _rebuilt(model, {"rope_type": "default", "rope_theta": 10_000.0})
    ref_model.model.rotary_emb.inv_freq = inv_freq.float()
    ref_model.model.rotary_emb.attention_scaling = af
    ids = torch.randint(0, 128, (1, T))
    with torch.no_grad():
        with patched(model, spec):
            out = model(ids).logits
        ref = ref_model(ids).logits
        plain = model(ids).logits
    torch.testing.assert_close(out, ref, **LOGIT_TOL)
    assert (out - plain).abs().max() > 100 * LOGIT_TOL["atol"]


def test_default_spec_reproduces_the_model():
    model = _tiny("qwen2")
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        plain = model(ids).logits
        with patched(model, {"rope_type": "default"}):
            out = model(ids).logits
    torch.testing.assert_close(out, plain, **LOGIT_TOL)


def test_patch_state_roundtrip_and_config():
    model = _tiny("llama", theta=50_000.0)
    original_rot = model.model.rotary_emb
    original_params = dict(model.config.rope_parameters)
    patch(model, {"rope_type": "yarn", "factor": 8})
    spec = current_spec(model)
    assert spec.rope_theta == 50_000.0 and spec.original_max_position_embeddings == L  # inherited
    assert model.config.rope_parameters["rope_type"] == "yarn"
    patch(model, {"rope_type": "linear", "factor": 2})  # re-patch replaces, keeps the original
    assert current_spec(model).rope_type == "linear"
    with patched(model, {"rope_type": "ntk", "factor": 2}):
        assert current_spec(model).rope_type == "ntk"
    assert current_spec(model).rope_type == "linear"  # context manager restores the previous patch
    unpatch(model)
    assert model.model.rotary_emb is original_rot
    assert dict(model.config.rope_parameters) == original_params
    assert current_spec(model) is None
    unpatch(model)  # idempotent


def test_patch_follows_model_dtype_and_device():
    model = _tiny("llama").to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 50))
    with torch.no_grad(), patched(model, {"rope_type": "yarn", "factor": 4}):
        out = model(ids).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_unsupported_architecture_raises():
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(ValueError, match="model_type in .*got 'gpt2'"):
        lcx.patch(model, {"rope_type": "linear", "factor": 2})


def test_invalid_spec_raises_before_touching_the_model():
    model = _tiny("llama")
    rot = model.model.rotary_emb
    with pytest.raises(ValueError, match="factor must be >= 1"):
        patch(model, {"rope_type": "linear", "factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        patch(model, {"rope_type": "default", "partial_rotary_factor": 0.5})
    assert model.model.rotary_emb is rot and current_spec(model) is None


def test_decode_with_cache_matches_full_forward_for_static_types():
    """Static RoPE types are cache-consistent: incremental decoding == one full forward."""
    model = _tiny("llama")
    ids = torch.randint(0, 128, (1, 3 * L + 1))
    with torch.no_grad(), patched(model, {"rope_type": "yarn", "factor": 4}):
        full = model(ids).logits[:, -1]
        out = model(ids[:, :-5], use_cache=True)
        past = out.past_key_values
        for i in range(5, 0, -1):
            out = model(ids[:, -i:-i + 1] if i > 1 else ids[:, -1:], past_key_values=past, use_cache=True)
            past = out.past_key_values
    torch.testing.assert_close(out.logits[:, -1], full, **LOGIT_TOL)


def test_partial_rotary_family_spec_takes_the_models_factor():
    """A partial rotary family (Phi: half of each tiny head): a spec that names no
    partial_rotary_factor takes the model's (so its tables have the model's width); one that
    names another is refused, naming both."""
    from lcx.hf.rope_patch import resolve_rope

    model = _tiny("phi")
    assert model_shape(model).rotary_dim == 8 and model_shape(model).head_dim == 16
    spec = resolve_rope(model, {"rope_type": "yarn", "factor": 4.0})
    assert spec.partial_rotary_factor == 0.5
    ids = torch.randint(0, 128, (1, T))
    with torch.no_grad(), patched(model, spec):
        cos, _ = model.model.rotary_emb(torch.zeros(1), torch.arange(T)[None])
        assert cos.shape[-1] == 8
        model(ids)
    with pytest.raises(ValueError, match="this model rotates 8"):
        patch(model, {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.25})
    unpatch(model)
