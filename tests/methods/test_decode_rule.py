"""`AttentionMethod.decode_rule` (the cache-of-rotated-keys rule `lcx.engine` decodes with) equals
`last_query_keys` on a contiguous history, for every registered method that has one."""

import pytest
import torch

from lcx.methods import examples, lm_infinite, method_id, sinks
from lcx.methods.base import DecodeRule

N_KEYS = [1, 2, 3, 4, 5, 6, 7, 9, 13, 31]  # odd lengths around each example's window edge


def _last_query_keys(method, n_keys=N_KEYS[-1]):
    return method.last_query_keys(torch.arange(n_keys)[None])


# every registered method's examples with a rule that `last_query_keys` pins (LM-Infinite's
# top-k rule is pinned against `attend` by tests/engine/test_kv_store.py), and those without one
RULED = [m for m in examples() if m.decode_rule() is not None and _last_query_keys(m) is not None]
UNRULED = [m for m in examples() if m.decode_rule() is None]


@pytest.mark.parametrize("method", RULED, ids=method_id)
@pytest.mark.parametrize("n_keys", N_KEYS)
def test_rule_equals_last_query_keys(method, n_keys):
    rule = method.decode_rule()
    want = _last_query_keys(method, n_keys)
    vis_want = torch.ones(n_keys, dtype=torch.bool) if want.visible is None else want.visible[0]
    rel_want = want.key_positions[0].to(torch.float64) - (n_keys - 1)
    vis, rel = rule.relative_positions(n_keys)
    assert torch.equal(vis, vis_want)
    assert torch.equal(rel[vis], rel_want[vis_want])


@pytest.mark.parametrize("method", UNRULED, ids=method_id)
def test_no_rule_only_where_not_plain_softmax(method):
    """A method without a rule (the engine decodes it through `attend`) is one whose last query
    is not plain softmax over rotated keys (SWAT's sigmoid)."""
    assert _last_query_keys(method) is None
    assert method.query_keys(torch.arange(5)[None], 2) is None


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
