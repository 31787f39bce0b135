"""`AttentionMethod.causal_up_to()`: on every sequence of at most that many keys a method is exactly
full causal attention (the unpatched model's), so `lcx report` may take vanilla's answers for a
cell whose prompts all fit (`lcx.report.ruler.vanilla_equivalent`). Generated from the registry's
examples: at the bound, every query row of `method.attend` equals `Causal`'s (float64, the
reference backend, positions not starting at 0, an attention factor, layer 1 where every top-k
example runs); past it the method differs from `Causal` (a bound below the sequence the method
changes is not claimed). `MethodConfig.identity_up_to` combines it with the RoPE spec."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lcx.attention import Rotary
from lcx.method_config import MethodConfig
from lcx.methods import Causal, examples, method_id
from lcx.rope import compute_inv_freq

B, H, HKV, D = 1, 4, 2, 16
BEYOND = 40  # keys past every example's bound, where each changes something


def _attend(method, Tk: int, Tq: int | None = None):
    g = torch.Generator().manual_seed(Tk)
    Tq = Tk if Tq is None else Tq
    q = torch.randn(B, Tq, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Tk, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    inv_freq, _ = compute_inv_freq({"rope_type": "default", "rope_theta": 100.0}, D)
    kw = dict(rotary=Rotary(inv_freq, torch.arange(Tk) + 3, 1.2), scale=0.3, layer_idx=1, backend="ref")
    return method.attend(q, k, v, **kw), Causal().attend(q, k, v, **kw)


@pytest.mark.parametrize("method", examples(), ids=method_id)
def test_method_is_causal_up_to_its_bound(method):
    bound = method.causal_up_to()
    assert bound == math.inf or (isinstance(bound, int) and 0 <= bound < BEYOND), bound
    if bound == 0:
        return  # no length claimed
    T = BEYOND if bound == math.inf else bound
    got, causal = _attend(method, T)  # every query of a prefill of T keys
    torch.testing.assert_close(got, causal, rtol=1e-12, atol=1e-12)
    got, causal = _attend(method, T, Tq=1)  # the decode step at T
    torch.testing.assert_close(got, causal, rtol=1e-12, atol=1e-12)
    if bound != math.inf:
        got, causal = _attend(method, BEYOND)
        assert not torch.allclose(got, causal), f"{method_id(method)} equals causal attention at {BEYOND} keys too"


def test_swat_claims_no_length():
    from lcx.methods import SWAT

    assert SWAT(window=8).causal_up_to() == 0  # sigmoid: not softmax even over every key


MODEL = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, max_position_embeddings=256)
GEMMA = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                        max_position_embeddings=32768)


@pytest.mark.parametrize("config,model,want", [
    ({}, MODEL, math.inf),
    ({"attention": {"type": "causal"}}, MODEL, math.inf),
    ({"rope": {"rope_type": "dynamic", "factor": 4}}, MODEL, 256),  # unscaled up to its original context
    ({"rope": {"rope_type": "dynamic", "factor": 4}}, GEMMA, 32768),
    ({"rope": {"rope_type": "dynamic", "factor": 4, "original_max_position_embeddings": 128}}, MODEL, 128),
    ({"rope": {"rope_type": "dynamic", "factor": 4, "rope_theta": 5e5}}, MODEL, 0),  # another base
    ({"rope": {"rope_type": "dynamic", "factor": 2}},
     SimpleNamespace(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, max_position_embeddings=256), 0),
    ({"rope": {"rope_type": "yarn", "factor": 4}}, MODEL, 0),
    ({"rope": {"rope_type": "linear", "factor": 4}}, MODEL, 0),
    ({"attention": {"type": "lm_infinite", "n_global": 10, "n_local": 200}}, MODEL, 200),
    ({"attention": {"type": "sinks", "n_sink": 4, "window": 196}}, MODEL, 200),
    ({"rope": {"rope_type": "dynamic", "factor": 4}, "attention": {"type": "sliding_window", "window": 300}}, MODEL, 256),
    ({"rope": {"rope_type": "yarn", "factor": 4}, "attention": {"type": "self_extend", "group_size": 2, "window": 64}}, MODEL, 0),
    ({"attention": {"type": "swat", "window": 8}}, MODEL, 0),
])
def test_config_identity_up_to(config, model, want):
    assert MethodConfig.from_dict(config).identity_up_to(model) == want
