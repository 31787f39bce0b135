"""`MethodConfig.apply(model)` returns what it did (`lcx.hf.applied.Applied`), and every front end
reads one set of context lengths (issue #75).

For every family of `lcx.hf.models.FAMILIES` and a few configs (none, YaRN, Self-Extend, both,
Phi-3 style longrope, a bounded method), on one tiny model per family with max_position_embeddings
`MODEL_LEN` (Phi-3: pretraining length `PHI3_L` in `config.original_max_position_embeddings`, its
two Ls), the same numbers come from:

- `MethodConfig.lengths(config)` (no model: `lcx serve --engine vllm`, the vLLM plugin),
- the record of `MethodConfig.apply(model)`,
- `lcx.engine.Engine` (`max_model_len` by default, and its own record),
- `lcx.serve.lengths.default_length` (the server's default for an unbounded method),

and they equal hand-computed lengths. The RoPE spec resolved without a model
(`MethodConfig.rope_spec`) equals the one `apply` resolves (`lcx.hf.rope_patch.resolve_rope`).
"""

from __future__ import annotations

import math

import pytest
import torch

from lcx import MethodConfig
from lcx.hf import FAMILIES
from lcx.hf.models import tiny_model
from lcx.hf.rope_patch import current_spec, resolve_rope

MODEL_LEN = 97  # max_position_embeddings of every tiny model (odd)
PHI3_L = 31  # Phi-3's pretraining length, config.original_max_position_embeddings (odd, != MODEL_LEN)
G, W = 3, 5  # Self-Extend: group size, neighbour window


def _self_extend(L: int) -> int:
    return G * (L - W + W // G)  # `lcx.methods.self_extend`: G * (L - W + floor(W / G))


# name -> (config, extended context as a function of (L0, max_position_embeddings), or None)
CONFIGS = {
    "as-loaded": ({}, lambda L0, M: None),
    "yarn-s3": ({"rope": {"rope_type": "yarn", "factor": 3}}, lambda L0, M: 3 * L0),
    "self-extend": ({"attention": {"type": "self_extend", "group_size": G, "window": W}},
                    lambda L0, M: _self_extend(M)),
    "yarn-s3+self-extend": ({"rope": {"rope_type": "yarn", "factor": 3},
                             "attention": {"type": "self_extend", "group_size": G, "window": W}},
                            lambda L0, M: _self_extend(3 * L0)),
    "sinks": ({"attention": {"type": "sinks", "n_sink": 2, "window": 7}}, lambda L0, M: None),
}
GRID = [(f, c) for f in FAMILIES for c in CONFIGS]


def _model(family: str) -> torch.nn.Module:
    extra = {"original_max_position_embeddings": PHI3_L} if family == "phi3" else {}
    return tiny_model(family, seed=3, max_position_embeddings=MODEL_LEN, **extra)


def _L0(family: str) -> int:
    return PHI3_L if family == "phi3" else MODEL_LEN


@pytest.mark.parametrize("family,name", GRID, ids=[f"{f}-{c}" for f, c in GRID])
def test_lengths_agree(family, name):
    from lcx.engine import Engine, EngineConfig
    from lcx.models.tiny import byte_tokenizer
    from lcx.serve.lengths import default_length

    d, extended = CONFIGS[name]
    cfg = MethodConfig.from_dict(d)
    model = _model(family)
    expected = extended(_L0(family), MODEL_LEN)
    without_model = cfg.lengths(model.config)
    assert (without_model.original, without_model.model, without_model.extended) == (_L0(family), MODEL_LEN, expected)
    assert cfg.context_len(model.config) == expected
    spec = cfg.rope_spec(model.config)
    if cfg.rope is not None:
        assert spec == resolve_rope(model, cfg.rope)
        assert spec.original_max_position_embeddings == _L0(family)
    applied = cfg.apply(model)
    assert applied.lengths == without_model
    assert applied.rope == spec == current_spec(model)
    assert applied.context_len == (expected or MODEL_LEN)
    assert len(applied.layer_methods) == len(applied.layer_windows) == model.config.num_hidden_layers
    applied.restore()
    assert current_spec(model) is None
    engine = Engine(model, byte_tokenizer(), EngineConfig(methods=cfg))
    assert engine.applied.lengths == without_model
    assert engine.max_model_len == applied.context_len
    assert engine.applied.rope == spec
    limit, how, bounded = default_length(model.config, cfg, dtype_bytes=4, memory=1 << 30)
    if bounded:  # a bounded method: what memory allows, never below the context
        assert limit >= applied.context_len and applied.kv_window is not None
    else:
        assert limit == applied.context_len


def test_phi3_longrope_reaches_max_position_embeddings():
    """Phi-3's own longrope, factor left out (transformers reads it as max_position_embeddings / L):
    L is config.original_max_position_embeddings (not max_position_embeddings) by both routes,
    and the context it extends to is the model's max_position_embeddings."""
    model = _model("phi3")
    half = model.config.head_dim // 2 if getattr(model.config, "head_dim", None) else 8
    cfg = MethodConfig.from_dict({"rope": {"rope_type": "longrope", "short_factor": [1.0] * half,
                                           "long_factor": [2.0] * half}})
    spec = cfg.rope_spec(model.config)
    assert spec == resolve_rope(model, cfg.rope)
    assert spec.original_max_position_embeddings == PHI3_L
    assert math.isclose(spec.factor, MODEL_LEN / PHI3_L)
    with cfg.apply(model) as m:
        applied = cfg.apply(m)
        assert applied.lengths == cfg.lengths(model.config)
        assert applied.lengths.original == PHI3_L and applied.context_len == MODEL_LEN


def test_record_is_frozen_and_restores_once():
    model = _model("llama")
    applied = MethodConfig.from_dict({"rope": {"rope_type": "yarn", "factor": 3},
                                      "attention": {"type": "sinks", "n_sink": 2, "window": 7}}).apply(model)
    with pytest.raises(AttributeError):
        applied.rope = None
    assert applied.kv_window == (2, 7) and applied.layer_windows == ((2, 7),) * model.config.num_hidden_layers
    assert applied.bases is not None and len(applied.bases) == model.config.num_hidden_layers
    applied.restore()
    applied.restore()  # a second restore does nothing
    assert current_spec(model) is None
