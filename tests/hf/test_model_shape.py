"""`lcx.hf.models.model_shape`: the shape facts lcx derives from a config, checked against what
every family's modules actually hold (one tiny model per family of `FAMILIES`)."""

from __future__ import annotations

import pytest

from lcx.hf import FAMILIES, attention_layers, model_shape, own_windows
from lcx.hf.models import tiny_model

FAMILY_GRID = sorted(FAMILIES)


@pytest.mark.parametrize("model_type", FAMILY_GRID)
def test_model_shape_matches_the_modules(model_type):
    model = tiny_model(model_type)
    s = model_shape(model)
    assert s == model_shape(model.config)
    attns = attention_layers(model)
    assert s.layers == len(attns)
    for attn in attns:
        assert s.head_dim == getattr(attn, "head_dim", getattr(attn, "head_size", None))  # (GPT-NeoX: head_size)
        if hasattr(attn, "qkv_proj"):  # Phi-3: q, k, v in one projection
            assert attn.qkv_proj.out_features == (s.heads + 2 * s.kv_heads) * s.head_dim
        elif hasattr(attn, "query_key_value"):  # GPT-NeoX: the same, multi-head
            assert attn.query_key_value.out_features == 3 * s.heads * s.head_dim and s.kv_heads == s.heads
        else:
            assert attn.q_proj.out_features == s.heads * s.head_dim
            assert attn.k_proj.out_features == attn.v_proj.out_features == s.kv_heads * s.head_dim
    assert s.hidden_size == model.get_input_embeddings().embedding_dim
    assert s.vocab_size == model.get_input_embeddings().num_embeddings
    assert list(s.windows) == own_windows(model)  # the attention patch's own per-layer windows
    assert s.layer_types == (tuple(model.config.layer_types) if getattr(model.config, "layer_types", None) else None)
    assert s.kv_bytes_per_token(2) == 2 * 2 * s.layers * s.kv_heads * s.head_dim


def test_model_shape_defaults():
    """A config without head_dim / num_key_value_heads: hidden // heads, and no GQA."""
    from types import SimpleNamespace

    c = SimpleNamespace(num_attention_heads=6, num_hidden_layers=3, hidden_size=96, vocab_size=10)
    s = model_shape(c)
    assert (s.head_dim, s.kv_heads, s.intermediate_size, s.layer_types, s.windows) == (16, 6, None, None, (None,) * 3)
