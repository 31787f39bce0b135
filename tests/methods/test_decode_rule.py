"""`AttentionMethod.decode_rule` (the cache-of-rotated-keys rule `lcx.engine` decodes with) equals
`last_query_keys` on a contiguous history, for every registered method that has one."""

import pytest
import torch

from lcx.methods import ATTENTION_METHODS, causal, lm_infinite, self_extend, sinks, sliding_window, swat
from lcx.methods.spec import DecodeRule

# every registered method, small parameters; odd lengths around each window edge
METHODS = [
    causal(),
    lm_infinite(3, 5),
    lm_infinite(2, 4, limit_distance=3),
    lm_infinite(2, 4, limit_distance=9),  # cap past G + L - 1: still exact (the rule sees a full history)
    lm_infinite(0, 4),
    sliding_window(window=4),
    sliding_window(window=1),
    sinks(2, 3),
    sinks(2, 3, renumber=False),
    sinks(0, 5),
    self_extend(2, 4),
    self_extend(3, 5),
    swat(4),
]
N_KEYS = [1, 2, 3, 4, 5, 6, 7, 9, 13, 31]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.describe())
@pytest.mark.parametrize("n_keys", N_KEYS)
def test_rule_equals_last_query_keys(method, n_keys):
    rule = method.decode_rule()
    if rule is None:
        assert method.name == "swat"
        return
    want = method.last_query_keys(torch.arange(n_keys)[None])
    vis_want = torch.ones(n_keys, dtype=torch.bool) if want.visible is None else want.visible[0]
    rel_want = want.key_positions[0].to(torch.float64) - (n_keys - 1)
    vis, rel = rule.relative_positions(n_keys)
    assert torch.equal(vis, vis_want)
    assert torch.equal(rel[vis], rel_want[vis_want])


def test_every_registered_method_is_in_the_grid():
    assert {m.name for m in METHODS} == set(ATTENTION_METHODS)


def test_lm_infinite_rule_by_hand():
    # G = 2, L = 3, query at p = 6: window 4, 5, 6 at their distances; globals 0, 1 at -3 (the cap)
    vis, rel = lm_infinite(2, 3).decode_rule().relative_positions(7)
    assert vis.tolist() == [True, True, False, False, True, True, True]
    assert rel[vis].tolist() == [-3.0, -3.0, -2.0, -1.0, 0.0]


def test_sinks_rule_by_hand():
    # S = 2, w = 3, query at p = 9: renumbered cache [s0 s1 | 7 8 9] -> sinks at slots 0, 1,
    # the query at slot 4: relative -4, -3
    vis, rel = sinks(2, 3).decode_rule().relative_positions(10)
    assert rel[vis].tolist() == [-4.0, -3.0, -2.0, -1.0, 0.0]


def test_side_branch_needs_its_positions():
    with pytest.raises(ValueError, match="side branch"):
        DecodeRule(window=4, side=2)
    with pytest.raises(ValueError, match="side branch"):
        DecodeRule(window=None, side=None, side_key=lambda p: p, side_query=lambda p: p)
