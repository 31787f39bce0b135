"""The vLLM plugin's attention path for lcx methods, without vLLM.

`lcx.serve.vllm_plugin.method_attention._MethodAttention.forward` reads a paged cache through
block tables; here the paged cache, block tables and step metadata are built by hand (random
block placement, requests of different lengths, decode and prefill rows mixed in one step) and
every output row must equal the method's `attend` over that request's whole cache in order
(float64). Both cache layouts: unrotated keys (every method), and keys rotated at their true
positions with the query rotated too (every method with a decode rule; attention factors 1 and
1.25, since the cached keys carry it). This pins the batched decode (the rule's keys per row,
one call) and the prefill/chunk calls to the per-request semantics; tests/serve/test_vllm.py
checks the same paths inside vLLM.
"""

from __future__ import annotations

import shutil
import types

import pytest
import torch

from lcx.attention import Rotary
from lcx.methods import AttentionMethod, LMInfinite, examples, lm_infinite, method_id, self_extend, sinks, sliding_window, swat
from lcx.rope import apply_rotary_ref, rope_cos_sin
from lcx.serve.vllm_plugin.method_attention import _MethodAttention, attention_kernel, prefill_backend
from lcx.serve.vllm_plugin.step_plan import _build_plan, rotated_refusal, rotated_rule, rule_covers_prefill
from lcx.testing import assert_within_budget

H, HKV, D, BLOCK = 4, 2, 16, 8
# Hand-picked cases at the edges of the step's shapes (windows of 6-10 keys against STEP's rows of
# 1-64 keys: below, at and above G + L) ...
EDGE_CASES = {
    "lm_infinite_3_10": lm_infinite(3, 10),
    "lm_infinite_limit_over_cap": lm_infinite(2, 6, limit_distance=20),  # not bounded: per-request path
    "sinks_2_9": sinks(2, 9),
    "sinks_2_9_no_renumber": sinks(2, 9, renumber=False),
    "sliding_window_7": sliding_window(window=7),
    "self_extend_2_8": self_extend(2, 8),  # unbounded: per-request path
    "swat_9": swat(9),  # sigmoid + balanced ALiBi: bounded, (0, w)
    # the paper's top-k middle keys, this layer (0) on: unbounded, per-request path, layer_idx needed
    "lm_infinite_topk": LMInfinite(2, 6, top_k=2, top_k_from_layer=0, top_k_insert_at=3),
}
# ... and every registered method's examples (`lcx.methods.examples()`): a new method joins every
# grid of this module with no edit here.
METHODS = {**EDGE_CASES, **{method_id(m): m for m in examples()}}
ROTATED = [name for name, m in METHODS.items() if rotated_rule(m) is not None]  # all but SWAT
ATTENTION_FACTORS = (1.0, 1.25)
# (cached keys n, queries this step): decode rows of many lengths (below, at and above G + L),
# prefills and chunked prefills in the same step, two of each shape (batched together).
STEP = ((1, 1), (5, 1), (13, 1), (14, 1), (30, 1), (41, 1), (17, 17), (29, 6), (64, 1), (17, 17), (29, 6))
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def _rotated(cache, meta, query, af: float):
    """The step's cache and queries rotated at their true positions (lcx's tables, attention
    factor `af`), as the plugin's rotated layout holds them: key j of a request at position j,
    its queries at the last positions."""
    cache = cache.clone()
    table, starts = meta.block_table, meta.query_start_loc.tolist()
    rows = []
    for r, (n, n_q) in enumerate(STEP):
        cos, sin = rope_cos_sin(torch.arange(n), INV_FREQ, af, torch.float64)  # [n, r]
        blocks, offsets = table[r, torch.arange(n) // BLOCK].long(), torch.arange(n) % BLOCK
        k = cache[blocks, :, offsets, :D]  # [n, Hkv, D]
        cache[blocks, :, offsets, :D] = apply_rotary_ref(k, cos, sin)
        rows.append(apply_rotary_ref(query[starts[r]:starts[r + 1]], cos[n - n_q:], sin[n - n_q:]))
    return cache, torch.cat(rows)


def _step(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-n // BLOCK) for n, _ in STEP) + 3
    perm = torch.randperm(n_blocks, generator=g)  # requests' blocks scattered over the cache
    cache = torch.full((n_blocks, HKV, BLOCK, 2 * D), float("nan"), dtype=torch.float64)
    width = max(-(-n // BLOCK) for n, _ in STEP)
    table = torch.zeros(len(STEP), width, dtype=torch.int32)
    keys, values, used = [], [], 0
    for r, (n, _) in enumerate(STEP):
        nb = -(-n // BLOCK)
        table[r, :nb] = perm[used:used + nb].int()
        used += nb
        k = torch.randn(n, HKV, D, generator=g, dtype=torch.float64)
        v = torch.randn(n, HKV, D, generator=g, dtype=torch.float64)
        for j in range(n):
            cache[table[r, j // BLOCK], :, j % BLOCK, :D] = k[j]
            cache[table[r, j // BLOCK], :, j % BLOCK, D:] = v[j]
        keys.append(k)
        values.append(v)
    n_q = [q for _, q in STEP]
    starts = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    meta = types.SimpleNamespace(query_start_loc=starts, seq_lens=torch.tensor([n for n, _ in STEP], dtype=torch.int32),
                                 block_table=table)
    query = torch.randn(int(starts[-1]), H, D, generator=g, dtype=torch.float64)
    return cache, meta, query, keys, values


def _impl(method, attention_kernel="torch", rotated=False, af=1.0, softcap=None):
    impl = types.SimpleNamespace(lcx_method=method, lcx_inv_freq=INV_FREQ, lcx_attention_factor=af, scale=None,
                                 lcx_backend=prefill_backend(method, softcap), lcx_kernel=attention_kernel,
                                 lcx_prefill_keys={}, lcx_rotated=rotated, lcx_layer_idx=0, lcx_softcap=softcap)
    impl.forward = types.MethodType(_MethodAttention.forward, impl)
    return impl


CAPS = (None, 0.7)  # a layer's attention-logit soft-capping (Gemma 2), which every torch route takes


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("name", list(METHODS))
def test_every_row_equals_the_method_over_the_whole_cache(name, cap):
    method = METHODS[name]
    cache, meta, query, keys, values = _step()
    impl = _impl(method, softcap=cap)
    out = torch.full_like(query, float("nan"))
    impl.forward(None, query, None, None, cache, meta, out)
    starts = meta.query_start_loc.tolist()
    rotary = Rotary(impl.lcx_inv_freq, None, 1.0)
    for r, (n, n_q) in enumerate(STEP):
        s, e = starts[r], starts[r + 1]
        want = method.attend(query[s:e][None], keys[r][None], values[r][None], rotary=rotary, layer_idx=0,
                             softcap=cap)[0]
        torch.testing.assert_close(out[s:e], want, rtol=1e-10, atol=1e-10, msg=f"{name}: request {r} (n={n})")


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None, reason="no C++ toolchain")
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("name", list(METHODS))
def test_fused_attention_kernel_equals_the_method(name, cap):
    """The same step in float32 with the fused C++ decode (`attention_kernel() == "cpp"`): every row
    within `lcx.testing`'s budget of the float64 method; prefill rows take the same path as above."""
    method = METHODS[name]
    assert attention_kernel() == "cpp"
    cache, meta, query, keys, values = _step()
    impl = _impl(method, "cpp", softcap=cap)
    out = torch.full(query.shape, float("nan"))
    impl.forward(None, query.float(), None, None, cache.float(), meta, out)
    starts = meta.query_start_loc.tolist()
    rotary = Rotary(impl.lcx_inv_freq, None, 1.0)
    for r, (n, n_q) in enumerate(STEP):
        s, e = starts[r], starts[r + 1]
        args = (query[s:e][None], keys[r][None], values[r][None])
        exact = method.attend(*args, rotary=rotary, layer_idx=0, softcap=cap)[0]
        ref_lowp = method.attend(*(t.float() for t in args), rotary=rotary, layer_idx=0, softcap=cap)[0]
        assert_within_budget(out[s:e], ref_lowp, exact, what=f"{name}: request {r} (n={n})")


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("af", ATTENTION_FACTORS)
@pytest.mark.parametrize("name", ROTATED)
def test_rotated_layout_equals_the_method(name, af, cap):
    """Keys cached rotated at their true positions, queries rotated: every row (decode rows in one
    call under the method's decode rule, prefill and chunk rows) equals the method's `attend` on
    the unrotated inputs (float64, torch route)."""
    method = METHODS[name]
    cache, meta, query, keys, values = _step()
    cache_rot, query_rot = _rotated(cache, meta, query, af)
    impl = _impl(method, rotated=True, af=af, softcap=cap)
    out = torch.full_like(query, float("nan"))
    impl.forward(None, query_rot, None, None, cache_rot, meta, out)
    starts = meta.query_start_loc.tolist()
    rotary = Rotary(INV_FREQ, None, af)
    for r, (n, n_q) in enumerate(STEP):
        s, e = starts[r], starts[r + 1]
        want = method.attend(query[s:e][None], keys[r][None], values[r][None], rotary=rotary, layer_idx=0,
                             softcap=cap)[0]
        torch.testing.assert_close(out[s:e], want, rtol=1e-10, atol=1e-10, msg=f"{name}: request {r} (n={n})")


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None, reason="no C++ toolchain")
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("af", ATTENTION_FACTORS)
@pytest.mark.parametrize("name", ROTATED)
def test_rotated_layout_fused_kernel_equals_the_method(name, af, cap):
    """The rotated layout in float32 on the C++ kernel (window keys read without rotation, side
    keys re-rotated by their delta): every row within `lcx.testing`'s budget of the float64 method."""
    method = METHODS[name]
    assert attention_kernel() == "cpp"
    cache, meta, query, keys, values = _step()
    cache_rot, query_rot = _rotated(cache, meta, query, af)
    impl = _impl(method, "cpp", rotated=True, af=af, softcap=cap)
    out = torch.full(query.shape, float("nan"))
    impl.forward(None, query_rot.float(), None, None, cache_rot.float(), meta, out)
    starts = meta.query_start_loc.tolist()
    rotary = Rotary(INV_FREQ, None, af)
    for r, (n, n_q) in enumerate(STEP):
        s, e = starts[r], starts[r + 1]
        args = (query[s:e][None], keys[r][None], values[r][None])
        exact = method.attend(*args, rotary=rotary, layer_idx=0, softcap=cap)[0]
        ref_lowp = method.attend(*(t.float() for t in args), rotary=rotary, layer_idx=0, softcap=cap)[0]
        assert_within_budget(out[s:e], ref_lowp, exact, what=f"{name} af={af}: request {r} (n={n})")


def test_rotated_plan_by_hand():
    """LM-Infinite G=3, L=10 (limit 10) in the rotated layout: one call for every row, the
    prefill and chunk queries too (the rule covers them: `rule_covers_prefill`); a row whose
    query sees n keys reads [0, 3) and the last 10 when n > 13; globals outside the window are
    re-rotated by (0 - p_k) - (min(10, p_q) - p_q), window keys not at all."""
    _, meta, _, _, _ = _step()
    plan = _build_plan(meta.query_start_loc, meta.seq_lens, meta.block_table, lm_infinite(3, 10), BLOCK, True)
    assert plan.decode_groups == () and plan.multi_query == ()
    dec = plan.rule_decode
    assert dec.rows.tolist() == list(range(sum(q for _, q in STEP)))  # every row of STEP, in order
    assert dec.visible.shape == (53, 13)
    # request 6's prefill (17 queries over 17 keys), its query 14 (row 6 + 14, p_q = 14, n = 15):
    # keys 0 1 2 | 5 .. 14, globals at 0 vs the query at min(10, 14) = 10: delta 4 - p_k
    assert dec.delta[20].tolist() == [4.0, 3.0, 2.0] + [0.0] * 10 and dec.visible[20].all()
    assert dec.offsets[20].tolist() == [0, 1, 2, *[(k % BLOCK) for k in range(5, 15)]]
    # request 6's query 2 (p_q = 2): keys 0 1 2 only, in its window
    assert dec.visible[8].tolist() == [True] * 3 + [False] * 10 and dec.delta[8].tolist() == [0.0] * 13
    assert dec.visible[1].tolist() == [True] * 5 + [False] * 8  # n = 5: its 5 keys, padded
    assert dec.delta[1].tolist() == [0.0] * 13
    # n = 14 (p_q = 13): keys 0 1 2 | 4 .. 13; globals at 0 vs the query at min(10, 13) = 10
    assert dec.delta[3].tolist() == [3.0, 2.0, 1.0] + [0.0] * 10
    assert dec.visible[3].all()
    # n = 13 (p_q = 12): keys 0 .. 12; window 3 .. 12; globals 0 1 2 at 0 vs query at 10
    assert dec.delta[2].tolist() == [2.0, 1.0, 0.0] + [0.0] * 10
    # sinks(2, 9) renumbered, n = 30 (p_q = 29): sinks keep their position, the query moves to
    # min(29, 2 + 9 - 1) = 10: delta 29 - 10 = 19 for both sinks
    plan = _build_plan(meta.query_start_loc, meta.seq_lens, meta.block_table, sinks(2, 9), BLOCK, True)
    assert plan.rule_decode.delta[4].tolist() == [19.0, 19.0] + [0.0] * 9
    # Self-Extend reads every key: K = the longest request (64); its prefills take whole-cache calls
    plan = _build_plan(meta.query_start_loc, meta.seq_lens, meta.block_table, self_extend(2, 8), BLOCK, True)
    assert plan.rule_decode.visible.shape == (7, 64) and plan.multi_query == (6, 7, 9, 10)
    assert plan.rule_decode.rows.tolist() == [0, 1, 2, 3, 4, 5, 29]  # the decode rows
    # LM-Infinite capped past its window: prefill queries see the call's cap, not the rule's
    plan = _build_plan(meta.query_start_loc, meta.seq_lens, meta.block_table, lm_infinite(2, 6, limit_distance=20),
                       BLOCK, True)
    assert plan.multi_query == (6, 7, 9, 10) and plan.rule_decode.rows.tolist() == [0, 1, 2, 3, 4, 5, 29]


@pytest.mark.parametrize("name", ROTATED)
@pytest.mark.parametrize("int64", [False, True], ids=["int32-meta", "int64-meta"])
def test_cpp_rule_plan_equals_numpy_plan(name, int64):
    """The C++ planner (`rule_plan`, used where the C++ kernel runs the step) gives the numpy
    plan's every field bit for bit: rows, slots, visibility, deltas, the cache rows of the
    cache's shape and the kernel's index and rotation tables; on STEP (decode rows of every
    length, prefills and chunks) and on a step of decode rows only, int32 (vLLM's) or int64
    metadata."""
    assert attention_kernel() == "cpp"
    method = METHODS[name]
    cache, meta, _, _, _ = _step()
    shape = tuple(cache.shape)
    metas = [meta]
    decode = [r for r, (_, q) in enumerate(STEP) if q == 1]  # decode rows only: a steady-state step
    qsl = torch.arange(len(decode) + 1, dtype=torch.int32)
    metas.append(types.SimpleNamespace(query_start_loc=qsl, seq_lens=meta.seq_lens[decode],
                                       block_table=meta.block_table[decode]))
    for m in metas:
        if int64:
            m = types.SimpleNamespace(**{k: v.long() for k, v in vars(m).items()})
        ref = _build_plan(m.query_start_loc, m.seq_lens, m.block_table, method, BLOCK, True)
        got = _build_plan(m.query_start_loc, m.seq_lens, m.block_table, method, BLOCK, True, shape)
        assert ref.multi_query == got.multi_query
        a, b = ref.rule_decode, got.rule_decode
        assert b.moved is not None and a.moved is None  # the C++ planner ran, the reference did not
        for f in ("rows", "blocks", "offsets", "visible", "delta"):
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and torch.equal(x, y), f"{name}: {f}"
        assert torch.equal(a.cache_rows(shape), b.cache_rows(shape))
        ka, kb = a.relative_keys(INV_FREQ, torch.float32), b.relative_keys(INV_FREQ, torch.float32)
        assert torch.equal(ka.index, kb.index) and torch.equal(ka.cos, kb.cos) and torch.equal(ka.sin, kb.sin)


@pytest.mark.parametrize("name", list(METHODS))
def test_rotated_layout_refused_by_one_check_naming_why(name):
    """`rotated_refusal` is the rotated layout's one check: it runs exactly the methods whose
    decode plan is a fixed set of keys per row (`lcx.methods.plan`: a rule without top-k), and
    refuses the others naming why (no rule: SWAT; top-k middle keys picked by score)."""
    method = METHODS[name]
    rule, reason = method.decode_rule(), rotated_refusal(method)
    if rule is None:
        assert "no decode rule" in reason
    elif rule.top_k:
        assert "top-k" in reason and "per query head" in reason
    else:
        assert reason is None and rotated_rule(method) is not None
    assert (rotated_rule(method) is None) is (reason is not None)


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_rule_covers_prefill_only_where_query_keys_agree(name):
    """`rule_covers_prefill` (prefill queries planned under the decode rule) is True exactly for
    the window + side rules whose every prefill query equals `query_keys` of the whole call; by
    hand: LM-Infinite with its cap at the window, sinks and a plain window yes, LM-Infinite capped
    past its window (the call's Tk sets the cap), Self-Extend (every key), SWAT and top-k (no such
    rule) no."""
    want = {"lm_infinite_3_10": True, "sinks_2_9": True, "sinks_2_9_no_renumber": True, "sliding_window_7": True}
    assert rule_covers_prefill(EDGE_CASES[name]) is want.get(name, False)


@pytest.mark.parametrize("method", examples(), ids=method_id)
def test_rule_covers_prefill_where_queries_see_their_own_prefix(method):
    """For every registered example: `rule_covers_prefill` holds exactly where the method has a
    bounded window + side rule without top-k and each query of a call sees what the last query of
    its own prefix would (the base class's `query_keys`, built prefix by prefix), compared here on
    a call longer than every window."""
    rule = rotated_rule(method)
    windowed = rule is not None and rule.window is not None and rule.side is not None and not rule.top_k
    pos = torch.arange(41)[None]
    own, prefix = method.query_keys(pos, 41), AttentionMethod.query_keys(method, pos, 41)
    same = False
    if own is not None and prefix is not None:
        full = torch.ones(own.key_positions.shape, dtype=torch.bool)
        vis_a = full if own.visible is None else own.visible
        vis_b = full if prefix.visible is None else prefix.visible
        # relative positions compared where a key is seen (unseen entries hold padding)
        same = torch.equal(vis_a, vis_b) and torch.equal(own.key_positions[vis_a], prefix.key_positions[vis_b])
    assert rule_covers_prefill(method) is (windowed and same)


def test_plan_groups_decode_rows_by_compressed_length():
    _, meta, _, _, _ = _step()
    plan = _build_plan(meta.query_start_loc, meta.seq_lens, meta.block_table, lm_infinite(3, 10), BLOCK)
    sizes = {g.blocks.shape[1]: g.rows.tolist() for g in plan.decode_groups}
    # n = 1, 5 keep their whole cache; n = 13 (= G + L) and longer keep G + L = 13 keys
    assert sizes == {1: [0], 5: [1], 13: [2, 3, 4, 5, 29]}
    assert plan.multi_query == (6, 7, 9, 10)
    shapes = {(g.n_queries, g.n_keys): g.requests for g in plan.multi_query_groups}
    assert shapes == {(17, 17): (6, 9), (6, 29): (7, 10)}  # equal shapes: one batched call each
    long = next(g for g in plan.decode_groups if g.blocks.shape[1] == 13)
    assert long.positions[1].tolist() == [0, 1, 2, *range(4, 14)]  # n = 14: keys 0-2 and 4-13
    renum = _build_plan(meta.query_start_loc, meta.seq_lens, meta.block_table, sinks(3, 10), BLOCK)
    assert next(g for g in renum.decode_groups if g.blocks.shape[1] == 13).positions[1].tolist() == list(range(13))
    unbounded = _build_plan(meta.query_start_loc, meta.seq_lens, meta.block_table, self_extend(2, 8), BLOCK)
    assert unbounded.decode_groups == () and unbounded.multi_query == tuple(range(len(STEP)))


def test_plan_is_built_once_per_step_and_shared_by_layers(monkeypatch):
    import lcx.serve.vllm_plugin.step_plan as sp

    cache, meta, query, _, _ = _step()
    calls = []
    real = sp._build_plan
    monkeypatch.setattr(sp, "_build_plan", lambda *a: calls.append(1) or real(*a))
    impl = _impl(lm_infinite(3, 10))
    for _ in range(3):  # three layers, one step
        impl.forward(None, query, None, None, cache, meta, torch.empty_like(query))
    assert len(calls) == 1
    _, meta2, _, _, _ = _step(seed=1)  # the next step: new metadata object, new plan
    impl.forward(None, query, None, None, cache, meta2, torch.empty_like(query))
    assert len(calls) == 2


def test_methods_vllm_kernels_lack_take_the_lcx_path():
    """Only causal and sliding_window run on vLLM's own kernels; SWAT (sigmoid + ALiBi) and the
    position-changing methods run through `.method_attention`, never silently as softmax."""
    from lcx.methods import ATTENTION_METHODS, UNROTATED_METHODS
    from lcx.method_config import MethodConfig
    from lcx.serve.vllm_plugin.config import NATIVE_METHODS, keys_rotated, needs_unrotated, runs_lcx_attention

    assert set(UNROTATED_METHODS) <= set(ATTENTION_METHODS) - set(NATIVE_METHODS)
    assert runs_lcx_attention(MethodConfig(attention=swat(16)))
    assert runs_lcx_attention(MethodConfig(attention=self_extend(2, 8)))
    assert not runs_lcx_attention(MethodConfig(attention=sliding_window(window=16)))
    assert not runs_lcx_attention(MethodConfig())
    # keys cached after RoPE for every method with a decode rule; unrotated for the others
    assert keys_rotated(MethodConfig(attention=lm_infinite(4, 16)))
    assert keys_rotated(MethodConfig(attention=sinks(4, 16)))
    assert keys_rotated(MethodConfig(attention=self_extend(2, 8)))
    assert needs_unrotated(MethodConfig(attention=swat(16)))
    assert needs_unrotated(MethodConfig(attention=lm_infinite(4, 16, top_k=2)))
    assert not keys_rotated(MethodConfig(attention=sliding_window(window=16)))


def test_tensor_parallel_rank_keeps_each_heads_parameters():
    """Under tensor parallelism a rank computes its slice of the heads: SWAT's per-head slopes
    (given, or the balanced schedule of the whole model) are cut to the rank's heads; methods
    without per-head parameters are unchanged."""
    from lcx.attention import balanced_alibi_slopes
    from lcx.serve.vllm_plugin.method_attention import method_for_rank

    full = balanced_alibi_slopes(4)
    assert method_for_rank(swat(9), 4, 2, 0).alibi_slopes == tuple(full[:2])
    assert method_for_rank(swat(9), 4, 2, 1).alibi_slopes == tuple(full[2:])
    given = swat(9, alibi_slopes=(0.5, 0.25, -0.5, -0.25))
    assert method_for_rank(given, 4, 1, 2).alibi_slopes == (-0.5,)
    assert method_for_rank(given, 4, 4, 0) is given
    assert method_for_rank(lm_infinite(3, 10), 4, 2, 1) == lm_infinite(3, 10)
    # a rank's heads give what the whole model gives on them
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 12, 4, D, generator=g, dtype=torch.float64) for _ in range(3))
    rotary = Rotary(INV_FREQ, None, 1.0)
    whole = swat(9).attend(q, k, v, rotary=rotary)
    for rank in (0, 1):
        h = slice(2 * rank, 2 * rank + 2)
        part = method_for_rank(swat(9), 4, 2, rank).attend(q[:, :, h], k[:, :, h], v[:, :, h], rotary=rotary)
        torch.testing.assert_close(part, whole[:, :, h], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
def test_kv_cache_update_writes_each_slot_and_skips_padding(kernel):
    """`do_kv_cache_update` (torch ops, and the C++ `write_kv`): token t's key/value land at
    slot_mapping[t] (block, offset) of every kv head; -1 slots (padding) write nothing."""
    if kernel == "cpp" and attention_kernel() != "cpp":
        pytest.skip("no C++ toolchain")
    g = torch.Generator().manual_seed(3)
    n_blocks = 5
    dtype = torch.float64 if kernel == "torch" else torch.float32
    cache = torch.zeros(n_blocks, HKV, BLOCK, 2 * D, dtype=dtype)
    qkv = torch.randn(6, (H + 2 * HKV) * D, generator=g, dtype=torch.float64).to(dtype)  # as vLLM splits it
    key = qkv[:, H * D:(H + HKV) * D].view(6, HKV, D)
    value = qkv[:, (H + HKV) * D:].view(6, HKV, D)
    slots = torch.tensor([17, 3, -1, 39, 8, -1])
    _MethodAttention.do_kv_cache_update(types.SimpleNamespace(lcx_kernel=kernel), None, key, value, cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        torch.testing.assert_close(cache[s // BLOCK, :, s % BLOCK, :D], key[t], rtol=0, atol=0)
        torch.testing.assert_close(cache[s // BLOCK, :, s % BLOCK, D:], value[t], rtol=0, atol=0)
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(n_blocks * BLOCK) if s not in written]
    assert all(cache[s // BLOCK, :, s % BLOCK].abs().sum() == 0 for s in untouched)


def test_layer_index_from_vllm_layer_names():
    from lcx.serve.vllm_plugin.method_attention import layer_index

    assert layer_index("model.layers.3.self_attn.attn") == 3
    assert layer_index("layers.12.self_attn.attn") == 12
    assert layer_index("attn") is None
