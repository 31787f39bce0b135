"""`lcx.methods.last_query`: one query per row as plain softmax attention equals `method.attend`."""

import pytest
import torch

from lcx.attention import Rotary
from lcx.methods import causal, lm_infinite, self_extend, sinks, sliding_window, swat
from lcx.methods.last_query import LastQueryPlan, attend_last_query
from lcx.rope import compute_inv_freq
from lcx.testing import assert_within_budget

METHODS = [
    causal(),
    lm_infinite(3, 5),
    lm_infinite(2, 4, limit_distance=3),
    lm_infinite(0, 4),
    sliding_window(window=4),
    sinks(2, 3),
    sinks(2, 3, renumber=False),
    sinks(0, 5),
    self_extend(2, 4),
    swat(4),  # sigmoid: no plan, attend_last_query falls back to attend
]
B, H, HKV, D = 3, 4, 2, 8


def _positions(kind: str, n_keys: int) -> torch.Tensor | None:
    if kind == "arange":
        return None
    g = torch.Generator().manual_seed(n_keys)
    # per-row positions with gaps, as a compressed cache has (first keys, then a later run)
    steps = torch.randint(1, 4, (B, n_keys), generator=g)
    steps[:, 0] = torch.randint(0, 5, (B,), generator=g)
    return steps.cumsum(-1)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.describe())
@pytest.mark.parametrize("n_keys", [1, 2, 5, 7, 13])
@pytest.mark.parametrize("pos_kind,af", [("arange", 1.0), ("gaps", 1.0), ("gaps", 1.3)])
def test_last_query_equals_attend(method, n_keys, pos_kind, af):
    g = torch.Generator().manual_seed(7 * n_keys + 1)
    q = torch.randn(B, 1, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, n_keys, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, n_keys, HKV, D, generator=g, dtype=torch.float64)
    inv_freq, _ = compute_inv_freq({"rope_type": "default", "rope_theta": 100.0}, D)
    rotary = Rotary(inv_freq, _positions(pos_kind, n_keys), af)
    exact = method.attend(q, k, v, rotary=rotary, scale=0.4)
    f32 = [t.float() for t in (q, k, v)]
    ref_lowp = method.attend(*f32, rotary=rotary, scale=0.4)
    actual = attend_last_query(method, *f32, rotary=rotary, scale=0.4)
    assert actual.dtype == torch.float32
    assert_within_budget(actual, ref_lowp, exact, what=method.describe())


def test_plan_only_for_softmax_methods():
    rotary = Rotary(torch.ones(2), None, 1.0)
    assert LastQueryPlan.build(swat(4), rotary, n_keys=3, batch=1) is None
    plan = LastQueryPlan.build(lm_infinite(1, 2), rotary, n_keys=6, batch=2)
    # query 5 sees key 0 (global) and keys 4, 5 (local)
    assert plan.mask[:, 0, 0].tolist() == [[True, False, False, False, True, True]] * 2
    assert LastQueryPlan.build(causal(), rotary, n_keys=6, batch=2).mask is None


def test_rejects_several_queries():
    with pytest.raises(ValueError, match="one query per row"):
        attend_last_query(causal(), torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2),
                          rotary=Rotary(torch.ones(1)))


def test_grid_covers_every_registered_method():
    from lcx.methods import ATTENTION_METHODS

    assert {m.name for m in METHODS} == set(ATTENTION_METHODS)
