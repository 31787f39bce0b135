"""`lcx.methods.last_query`: one query per row as plain softmax attention equals `method.attend`."""

import pytest
import torch

from lcx.attention import Rotary
from lcx.methods import causal, examples, lm_infinite, method_id, swat
from lcx.methods.last_query import LastQueryPlan, RelativeKeys, attend_last_query
from lcx.rope import compute_inv_freq
from lcx.testing import assert_within_budget

B, H, HKV, D = 3, 4, 2, 8
# every registered method's examples (`lcx.methods.registry.examples`); methods whose last query
# is not plain softmax (SWAT's sigmoid, LM-Infinite's top-k) fall back to `attend`
METHODS = examples()
# those whose every query is plain softmax over keys rotated to given positions
QUERY_KEY_METHODS = [m for m in METHODS if m.query_keys(torch.arange(2)[None], 1) is not None]


def _positions(kind: str, n_keys: int) -> torch.Tensor | None:
    if kind == "arange":
        return None
    g = torch.Generator().manual_seed(n_keys)
    # per-row positions with gaps, as a compressed cache has (first keys, then a later run)
    steps = torch.randint(1, 4, (B, n_keys), generator=g)
    steps[:, 0] = torch.randint(0, 5, (B,), generator=g)
    return steps.cumsum(-1)


@pytest.mark.parametrize("method", METHODS, ids=method_id)
@pytest.mark.parametrize("n_keys", [1, 2, 5, 7, 13])
@pytest.mark.parametrize("pos_kind,af,cap", [("arange", 1.0, None), ("gaps", 1.0, None), ("gaps", 1.3, None),
                                            ("gaps", 1.3, 0.7)])  # cap: Gemma 2's logit soft-capping
def test_last_query_equals_attend(method, n_keys, pos_kind, af, cap):
    g = torch.Generator().manual_seed(7 * n_keys + 1)
    q = torch.randn(B, 1, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, n_keys, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, n_keys, HKV, D, generator=g, dtype=torch.float64)
    inv_freq, _ = compute_inv_freq({"rope_type": "default", "rope_theta": 100.0}, D)
    rotary = Rotary(inv_freq, _positions(pos_kind, n_keys), af)
    exact = method.attend(q, k, v, rotary=rotary, scale=0.4, layer_idx=0, softcap=cap)
    f32 = [t.float() for t in (q, k, v)]
    ref_lowp = method.attend(*f32, rotary=rotary, scale=0.4, layer_idx=0, softcap=cap)
    actual = attend_last_query(method, *f32, rotary=rotary, scale=0.4, layer_idx=0, softcap=cap)
    assert actual.dtype == torch.float32
    assert_within_budget(actual, ref_lowp, exact, what=method.describe())


def test_sdpa_soft_cap():
    """`lcx.attention.sdpa`: torch's SDPA without a cap; with one, the cap on every scaled logit
    (GQA heads and a key mask as torch's), checked against the dense definition."""
    from lcx.attention import sdpa, soft_cap

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, t, D, generator=g, dtype=torch.float64) for h, t in ((H, 5), (HKV, 9), (HKV, 9)))
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True
    kk, vv = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    for cap in (None, 0.5):
        s = soft_cap(q @ kk.transpose(-1, -2) * 0.3, cap).masked_fill(~mask, float("-inf"))
        torch.testing.assert_close(sdpa(q, k, v, attn_mask=mask, scale=0.3, softcap=cap), torch.softmax(s, -1) @ vv)
    assert not torch.allclose(sdpa(q, k, v, scale=0.3, softcap=0.5), sdpa(q, k, v, scale=0.3))


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


def _attend_relative(q, k, v, keys: RelativeKeys, scale):
    """Plain torch over `RelativeKeys`: each (query, key) pair rotated by its own table row."""
    idx = keys.index.clamp(min=0)  # [Bd, Tq, Tk]
    c, s_ = keys.cos[idx], keys.sin[idx]  # [Bd, Tq, Tk, r/2]
    cos, sin = torch.cat((c, c), dim=-1), torch.cat((-s_, s_), dim=-1)  # [Bd, Tq, Tk, r], sign-folded sin
    rep = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)  # [B, Tk, H, D]
    r, h = cos.shape[-1], cos.shape[-1] // 2
    kr = kk[:, None, :, :, :r]  # [B, 1, Tk, H, r]
    swapped = torch.cat((kr[..., h:], kr[..., :h]), dim=-1)
    rot = kr * cos[:, :, :, None].to(k.dtype) + swapped * sin[:, :, :, None].to(k.dtype)  # [B, Tq, Tk, H, r]
    rot = torch.cat((rot, kk[:, None, :, :, r:].expand(*rot.shape[:-1], -1)), dim=-1)
    s = torch.einsum("bthd,btkhd->bthk", q, rot) * scale
    s = s.masked_fill((keys.index < 0)[:, :, None, :], float("-inf"))
    return torch.einsum("bthk,bkhd->bthd", s.softmax(-1), vv)


@pytest.mark.parametrize("method", QUERY_KEY_METHODS, ids=method_id)
@pytest.mark.parametrize("n_keys,n_queries", [(1, 1), (7, 7), (13, 4), (13, 1)])
def test_query_keys_reproduce_attend_for_every_query(method, n_keys, n_queries):
    """`AttentionMethod.query_keys` (through `RelativeKeys`): every query of a prefill or chunk
    sees what `attend` gives it (float64, plain torch, no kernel)."""
    g = torch.Generator().manual_seed(n_keys * 31 + n_queries)
    q = torch.randn(B, n_queries, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, n_keys, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, n_keys, HKV, D, generator=g, dtype=torch.float64)
    inv_freq, _ = compute_inv_freq({"rope_type": "default", "rope_theta": 100.0}, D)
    rotary = Rotary(inv_freq, None, 1.3)
    keys = RelativeKeys.build(method, rotary, n_keys=n_keys, n_queries=n_queries, dtype=torch.float64)
    want = method.attend(q, k, v, rotary=rotary, scale=0.4)
    torch.testing.assert_close(_attend_relative(q, k, v, keys, 0.4), want, rtol=1e-9, atol=1e-9)
