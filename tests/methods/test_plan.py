"""The one decode plan (`lcx.methods.plan`): for every registered method with a `DecodeRule`
(`lcx.methods.examples()`), softmax over the plan's keys, each rotated by its delta, plus the
top-k of its middle keys, equals the LAST query of `attend` (float64) on histories of every
length around the examples' windows; the C++ backend equals the reference bit for bit."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from lcx.attention import Rotary
from lcx.attention.reference import top_k_indices
from lcx.methods import examples, lm_infinite, method_id, self_extend, sinks
from lcx.methods.plan import PLAN_BACKENDS, RuleShifts, branches, step_plan
from lcx.rope import apply_rotary_ref, rope_cos_sin

H, HKV, D = 4, 2, 8
N_KEYS = (1, 2, 3, 4, 5, 6, 7, 9, 13, 31, 40)  # odd lengths around each example's window edge
LAYERS = (0, 1)
RULED = [m for m in examples() if m.decode_rule() is not None]
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
_TOOLCHAIN = shutil.which("c++") is not None and shutil.which("ninja") is not None


def _qkv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, n, H, D, generator=g, dtype=torch.float64),
            torch.randn(1, n, HKV, D, generator=g, dtype=torch.float64),
            torch.randn(1, n, HKV, D, generator=g, dtype=torch.float64))


def _rot(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x `[T, h, D]` rotated at float64 positions `[T]`."""
    cos, sin = rope_cos_sin(positions, INV_FREQ, 1.0, torch.float64)
    return apply_rotary_ref(x, cos, sin)


def _plan_last_query(rule, layer: int, q, k, v, keys, visible, delta, middle) -> torch.Tensor:
    """One row of the plan run as a softmax: q `[H, D]`, k/v `[n, Hkv, D]` unrotated -> `[H, D]`."""
    n, scale, g = k.shape[0], D ** -0.5, H // HKV
    p_q = torch.tensor([float(n - 1)], dtype=torch.float64)
    qr = _rot(q[None], p_q)[0]  # [H, D] at the query's true position
    kr = _rot(k[keys], keys.to(torch.float64) + delta)  # [K, Hkv, D] at the rule's positions
    s = torch.einsum("hd,khd->hk", qr, kr.repeat_interleave(g, 1)) * scale  # [H, K]
    s = s.masked_fill(~visible, float("-inf"))
    vals = v[keys].repeat_interleave(g, 1).transpose(0, 1)  # [H, K, D]
    if rule.top_k_in_layer(layer) and int(middle.sum()) >= rule.top_k:
        m = s.new_full(s.shape, float("-inf"))
        m = torch.where(middle, torch.einsum("hd,khd->hk", qr, kr.repeat_interleave(g, 1)) * scale, m)
        idx = top_k_indices(m, rule.top_k)  # [H, k]
        s = torch.cat([s, m.gather(1, idx)], 1)
        vals = torch.cat([vals, vals.gather(1, idx[..., None].expand(-1, -1, D))], 1)
    return torch.einsum("hk,hkd->hd", torch.softmax(s, -1), vals)


@pytest.mark.parametrize("method", RULED, ids=method_id)
def test_plan_equals_attend(method):
    rule = method.decode_rule()
    plan = step_plan(rule, torch.tensor(N_KEYS))
    B, K = plan.keys.shape
    assert K == (min(max(N_KEYS), rule.side + rule.window) if rule.window and rule.side is not None
                 and not rule.top_k else max(N_KEYS))
    assert not (plan.visible & plan.middle).any()
    for r, n in enumerate(N_KEYS):
        q, k, v = _qkv(n, seed=n)
        for layer in LAYERS:
            want = method.attend(q, k, v, rotary=Rotary(INV_FREQ, torch.arange(n)[None]), layer_idx=layer)[0, -1]
            got = _plan_last_query(rule, layer, q[0, -1], k[0], v[0], plan.keys[r], plan.visible[r],
                                   plan.delta[r], plan.middle[r])
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"n={n} layer={layer}")
        # a row's padding is invisible, at position 0, not moved
        pad = ~(plan.visible[r] | plan.middle[r])
        assert (plan.delta[r][pad] == 0).all() and (plan.keys[r][pad] < n).all()


@pytest.mark.skipif(not _TOOLCHAIN, reason="no C++ compiler or ninja: the extension cannot build")
@pytest.mark.parametrize("method", RULED, ids=method_id)
def test_cpp_plan_equals_ref(method):
    """The C++ backend gives the reference's every field bit for bit, or refuses (top-k) naming why."""
    rule = method.decode_rule()
    reason = PLAN_BACKENDS["cpp"].supports(rule)
    if rule.top_k:
        assert reason is not None and "top-k" in reason
        with pytest.raises(NotImplementedError, match="top-k"):
            step_plan(rule, torch.tensor(N_KEYS), backend="cpp")
        assert step_plan(rule, torch.tensor(N_KEYS), backend="auto").middle.any()  # ref ran
        return
    assert reason is None
    shifts = RuleShifts(rule)
    for n in (torch.tensor(N_KEYS), torch.tensor(N_KEYS[::-1]), torch.tensor([1]), torch.tensor([40] * 3)):
        ref = step_plan(rule, n, shifts=shifts)
        got = step_plan(rule, n, shifts=shifts, backend="cpp")
        for f in ("keys", "visible", "delta", "middle"):
            x, y = getattr(ref, f), getattr(got, f)
            assert x.dtype == y.dtype and torch.equal(x, y), f


def test_plan_by_hand():
    # LM-Infinite G=2, L=4, limit 4; n = 9 (p_q = 8): keys 0 1 | 5 6 7 8; globals at 0 vs the
    # query at min(4, 8) = 4: delta = (0 - p_k) - (4 - 8)
    plan = step_plan(lm_infinite(2, 4, limit_distance=4).decode_rule(), [9, 3])
    assert plan.keys.tolist() == [[0, 1, 5, 6, 7, 8], [0, 1, 2, 0, 0, 0]]
    assert plan.visible.tolist() == [[True] * 6, [True] * 3 + [False] * 3]
    assert plan.delta.tolist() == [[4.0, 3.0, 0, 0, 0, 0], [0.0] * 6]
    # sinks(2, 3) renumbered, n = 10: sinks keep their slot, the query sits at slot 4: delta 9 - 4
    plan = step_plan(sinks(2, 3).decode_rule(), [10])
    assert plan.keys.tolist() == [[0, 1, 7, 8, 9]] and plan.delta.tolist() == [[5.0, 5.0, 0, 0, 0]]
    # Self-Extend G=2, W=4 reads every key: keys 0..5 of n = 6 grouped: key floor(p/2), query
    # floor(5/2) + 4 - 4 // 2 = 4 (its `grouped_positions`); keys 2..5 in the window, keys 0, 1
    # moved by (floor(p/2) - p) - (4 - 5): 1, 0
    plan = step_plan(self_extend(2, 4).decode_rule(), [6])
    assert plan.keys.tolist() == [[0, 1, 2, 3, 4, 5]] and plan.visible.all()
    assert plan.delta.tolist() == [[1.0, 0.0, 0, 0, 0, 0]]


def test_branches_on_numpy_and_torch():
    """The rule, elementwise: one code for numpy (the plan) and torch (the engine's slots)."""
    rule = lm_infinite(2, 3, top_k=1, top_k_insert_at=2).decode_rule()
    p = np.arange(8)
    for x in (p, torch.from_numpy(p)):
        w, s, m = (np.asarray(t).tolist() for t in branches(rule, x, 7))
        assert w == [False] * 5 + [True] * 3 and s == [True] * 2 + [False] * 6
        assert m == [False] * 2 + [True] * 3 + [False] * 3


def test_bad_input_named():
    rule = sinks(2, 3).decode_rule()
    with pytest.raises(ValueError, match="n_keys"):
        step_plan(rule, [3, 0])
    with pytest.raises(ValueError, match="plan backend"):
        step_plan(rule, [3], backend="triton")
