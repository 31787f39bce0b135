"""PIE cache edits: edit plans, layer-0 exactness of re-rotation, every RoPE type, costs, decoding.

The exactness claim (PIE, arXiv 2407.03157): layer-0 keys and values depend only on the token
and its position, so after `pie` they must equal a fresh prefill of the edited sequence for
every slot; deeper layers are an approximation. `recompute` is exact in every layer;
`conflict` keeps stale positions and must differ (so these tests can fail).
"""

from __future__ import annotations

import random

import pytest
import torch

from lcx.cache import (
    EDIT_STRATEGIES,
    Edit,
    PositionedKVCache,
    apply_edits,
    plan_edits,
    rerotate_ref,
    update_cache,
)
from lcx.hf.rope_patch import rope_basis
from lcx import patch, patched
from lcx.rope import ROPE_TYPES, RopeSpec, compute_inv_freq, rotate_by_positions_ref

N_OLD = 61  # odd cache length
L = 48  # original context of the RoPE specs below (the tiny model's is 128)
KEY_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32, lcx-patched model (float64 angles)
HF_KEY_TOL = dict(rtol=1e-4, atol=1e-4)  # fp32, unpatched HF model (float32 angles, ~1 ulp of p*theta)
VOCAB = (3, 259)  # byte tokens of the tiny model

# name -> edits on a cache of N_OLD tokens (token ids filled in by _ids)
EDIT_CASES = {
    "insert-start": [(0, 0, 5)],
    "insert-middle": [(30, 30, 3)],
    "insert-end": [(N_OLD, N_OLD, 4)],
    "delete-start": [(0, 4, 0)],
    "delete-middle": [(20, 27, 0)],
    "delete-end": [(N_OLD - 6, N_OLD, 0)],
    "replace-longer": [(10, 12, 7)],
    "replace-shorter": [(10, 19, 2)],
    "replace-same-length": [(40, 43, 3)],
    "multi-place": [(3, 3, 2), (15, 20, 0), (33, 35, 6), (N_OLD - 1, N_OLD, 1)],
    "adjacent": [(8, 10, 1), (10, 10, 3), (10, 13, 0)],
    "empty-edit": [(25, 25, 0)],
    "no-edits": [],
}


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(*VOCAB, (n,), generator=g).tolist()


def _edits(case: list[tuple[int, int, int]], seed: int = 1) -> list[Edit]:
    return [Edit(s, e, _ids(k, seed + i)) for i, (s, e, k) in enumerate(case)]


@pytest.fixture(scope="module")
def model():
    """A private tiny random Llama (GQA 4/2 heads, head_dim 16), patched with lcx's default RoPE
    so angles are float64 (module scope: the session fixture must not be patched)."""
    from lcx.models.tiny import tiny_llama

    m, _ = tiny_llama(seed=0)
    return patch(m, {"rope_type": "default"})


def _prefill(model, ids: list[int]) -> PositionedKVCache:
    return PositionedKVCache.prefill(model, torch.tensor([ids]))


# ----------------------------------------------------------------------------- edit plans
def test_plan_hand_written():
    """old a b c d e f g h, Edit(2, 4, XYZ), Edit(6, 7, -) -> a b X Y Z e f h."""
    old = list("abcdefgh")
    edits = [Edit(2, 4, [1, 2, 3]), Edit(6, 7, [])]
    plan = plan_edits(8, edits)
    assert plan.new_position.tolist() == [0, 1, -1, -1, 5, 6, -1, 7]
    assert (plan.n_new, plan.first_change) == (8, 2)
    assert [(s.new_start, s.old_start, s.old_end, s.new_token_ids) for s in plan.segments] == [
        (0, 0, 2, ()), (2, None, None, (1, 2, 3)), (5, 4, 6, ()), (7, 7, 8, ())]
    assert apply_edits(old, edits) == ["a", "b", 1, 2, 3, "e", "f", "h"]


def test_positions_after_each_strategy_hand_written(model):
    """What a position is after an edit: the index in the new sequence (pie, recompute); kept
    keys keep their old positions under conflict."""
    edits = [Edit(2, 4, [10, 11, 12]), Edit(6, 7, [])]
    expected = {"recompute": [0, 1, 2, 3, 4, 5, 6, 7],
                "pie": [0, 1, 2, 3, 4, 5, 6, 7],
                "conflict": [0, 1, 2, 3, 4, 4, 5, 7]}
    assert set(expected) == set(EDIT_STRATEGIES)
    base = _prefill(model, _ids(8, 0))
    for name, pos in expected.items():
        res = update_cache(model, base.clone(), edits, strategy=name)
        assert res.cache.positions.tolist() == pos, name
        assert res.cache.next_position == 8


@pytest.mark.parametrize("edits,match", [
    ([Edit(5, 9), Edit(8, 10)], "non-overlapping"),
    ([Edit(10, 12), Edit(2, 3)], "sorted"),
    ([Edit(60, 62, [1])], "runs past"),
])
def test_plan_rejects_bad_edits(edits, match):
    with pytest.raises(ValueError, match=match):
        plan_edits(61, edits)
    with pytest.raises(ValueError):
        Edit(-1, 2)
    with pytest.raises(ValueError):
        Edit(5, 4)


def test_apply_edits_matches_list_splicing():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 30)
        old = list(range(100, 100 + n))
        cuts = sorted(rng.randint(0, n) for _ in range(2 * rng.randint(0, 3)))
        edits = [Edit(cuts[i], cuts[i + 1], [rng.randint(0, 9) for _ in range(rng.randint(0, 3))])
                 for i in range(0, len(cuts), 2)]
        expect = list(old)
        for e in reversed(edits):  # right to left: original coordinates stay valid
            expect[e.start:e.end] = e.new_token_ids
        assert apply_edits(old, edits) == expect


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("case", list(EDIT_CASES), ids=list(EDIT_CASES))
def test_layer0_exact_after_pie(model, case):
    old = _ids(N_OLD, 0)
    edits = _edits(EDIT_CASES[case])
    new = apply_edits(old, edits)
    ref = _prefill(model, new)
    base = _prefill(model, old)
    res = {name: update_cache(model, base.clone(), edits, strategy=name) for name in EDIT_STRATEGIES}
    for name, r in res.items():
        assert r.cache.token_ids[0].tolist() == new, name
        assert len(r.cache) == len(new)
    # pie: layer-0 keys and values equal a fresh prefill for every slot, kept or new
    pie = res["pie"].cache
    torch.testing.assert_close(pie.keys[0], ref.keys[0], **KEY_TOL)
    torch.testing.assert_close(pie.values[0], ref.values[0], **KEY_TOL)
    assert pie.positions.tolist() == list(range(len(new)))
    # recompute is exact in every layer
    for layer in range(ref.num_layers):
        torch.testing.assert_close(res["recompute"].cache.keys[layer], ref.keys[layer], **KEY_TOL)
        torch.testing.assert_close(res["recompute"].cache.values[layer], ref.values[layer], **KEY_TOL)
    # conflict keeps stale positions: its layer-0 keys differ wherever a kept slot moved
    plan = plan_edits(N_OLD, edits)
    kept = plan.new_position[plan.new_position >= 0]
    moved = kept[kept != torch.nonzero(plan.new_position >= 0).flatten()]
    err = (res["conflict"].cache.keys[0] - ref.keys[0]).abs().amax(dim=(0, 1, 3))  # [T]
    if len(moved):
        assert err[moved].min() > 1e-2, "conflict must differ from recompute for moved keys"
    else:
        torch.testing.assert_close(res["conflict"].cache.keys[0], ref.keys[0], **KEY_TOL)
    # costs: pie and conflict encode exactly the new tokens; recompute everything after the first edit
    n_new_tokens = sum(len(e.new_token_ids) for e in edits)
    assert res["pie"].cost.tokens_encoded == res["conflict"].cost.tokens_encoded == n_new_tokens
    expected_recompute = 0 if plan.n_new == plan.n_old == plan.first_change else plan.n_new - plan.first_change
    assert res["recompute"].cost.tokens_encoded == expected_recompute
    assert res["pie"].cost.rotated_slots == len(moved)
    assert res["pie"].cost.flops <= res["recompute"].cost.flops or expected_recompute == 0


def test_unpatched_hf_model_uses_its_own_basis(tiny_model):
    """An unpatched HF model: the basis comes from its rotary module (float32 angles in HF)."""
    model, _ = tiny_model
    inv, af = rope_basis(model)
    torch.testing.assert_close(inv, model.model.rotary_emb.inv_freq.double())
    old, edits = _ids(N_OLD, 3), _edits(EDIT_CASES["multi-place"])
    ref = _prefill(model, apply_edits(old, edits))
    pie = update_cache(model, _prefill(model, old), edits, strategy="pie").cache
    torch.testing.assert_close(pie.keys[0], ref.keys[0], **HF_KEY_TOL)


def test_deleting_everything_leaves_an_empty_cache(model):
    for name in EDIT_STRATEGIES:
        res = update_cache(model, _prefill(model, _ids(9, 0)), [Edit(0, 9)], strategy=name)
        assert len(res.cache) == 0 and res.cache.keys[0].shape[2] == 0 and res.cost.tokens_encoded == 0


def test_unpatched_length_dependent_model_pie_refuses_recompute_from_zero():
    """An unpatched HF model with dynamic NTK: its basis is not knowable from outside, so the
    cache records none; pie refuses, recompute re-encodes everything."""
    from lcx.models.tiny import tiny_llama

    model, _ = tiny_llama(seed=0, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    old, edits = _ids(30, 10), _edits([(10, 10, 2)])
    cache = _prefill(model, old)
    assert not cache.has_single_basis
    with pytest.raises(ValueError, match="no one known RoPE basis"):
        update_cache(model, cache.clone(), edits, strategy="pie")
    rec = update_cache(model, cache, edits, strategy="recompute")
    assert rec.cost.tokens_encoded == 32 and "reencoded_from_zero" in rec.cost.details


def test_pie_repairs_a_conflict_cache(model):
    """pie rotates each key from the position it carries to its index: with no edits it re-syncs
    a stale (conflict) cache to the exact layer-0 keys."""
    old, edits = _ids(N_OLD, 4), _edits(EDIT_CASES["insert-middle"])
    ref = _prefill(model, apply_edits(old, edits))
    stale = update_cache(model, _prefill(model, old), edits, strategy="conflict").cache
    fixed = update_cache(model, stale, [], strategy="pie")
    assert fixed.cost.tokens_encoded == 0 and fixed.cost.rotated_slots == N_OLD - 30
    torch.testing.assert_close(fixed.cache.keys[0], ref.keys[0], **KEY_TOL)


def test_cache_without_rope_applied_is_relabelled_not_rotated(model):
    base = _prefill(model, _ids(20, 5))
    base.rope_applied = False
    keys_before = [k.clone() for k in base.keys]
    res = update_cache(model, base, [Edit(2, 5, [])], strategy="pie")
    assert res.cache.positions.tolist() == list(range(17))
    torch.testing.assert_close(res.cache.keys[0], torch.cat([keys_before[0][:, :, :2], keys_before[0][:, :, 5:]], 2))


def test_to_hf_shares_tensors_and_runs(model):
    ids = _ids(12, 6)
    cache = _prefill(model, ids)
    hf = cache.to_hf()
    assert hf.layers[0].keys.data_ptr() == cache.keys[0].data_ptr()
    with torch.no_grad():
        full = model(torch.tensor([ids + [40]])).logits[0, -1]
        step = model(torch.tensor([[40]]), past_key_values=hf, position_ids=torch.tensor([[12]])).logits[0, -1]
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)


def test_batch_edits_need_batch_one(model):
    cache = PositionedKVCache.prefill(model, torch.tensor([_ids(10, 0), _ids(10, 1)]))
    with pytest.raises(ValueError, match="batch size 1"):
        update_cache(model, cache, [Edit(0, 1)], strategy="pie")


# ----------------------------------------------------------------------------- RoPE types
def spec_for(rope_type: str, rotary_half: int) -> dict:
    """A valid spec for each registry type, built from the keys it requires (a new type with a
    new required key fails here until a default is added)."""
    defaults = {"factor": 2.0, "original_max_position_embeddings": L,
                "short_factor": [1.0 + 0.05 * i for i in range(rotary_half)],
                "long_factor": [1.0 + 0.5 * i for i in range(rotary_half)]}
    spec = {"rope_type": rope_type}
    spec.update({k: defaults[k] for k in ROPE_TYPES[rope_type].required})
    if rope_type == "truncate":
        spec["truncate_length"] = 16.0  # some frequencies truncated to rho, some to 0
    return spec


@pytest.mark.parametrize("rope_type", sorted(ROPE_TYPES))
def test_rerotation_is_exact_in_every_basis(rope_type):
    """R(delta) R(p) k == R(p + delta) k for every type's basis (lengths below and above L)."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 37, 3, 16, generator=g, dtype=torch.float64)
    p = torch.randint(0, 5000, (37,), generator=g)
    delta = torch.randint(-300, 300, (37,), generator=g)
    for seq_len in (L // 2, 4 * L):
        spec = RopeSpec(rope_theta=1e4, **{k_: v for k_, v in spec_for(rope_type, 8).items()})
        inv, _ = compute_inv_freq(spec, 16, seq_len)
        cached = rotate_by_positions_ref(k, p, inv)
        moved = rerotate_ref(cached.clone(), delta, inv)
        torch.testing.assert_close(moved, rotate_by_positions_ref(k, p + delta, inv), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rope_type", sorted(ROPE_TYPES))
def test_pie_layer0_exact_for_every_rope_type(model, rope_type):
    """Model level, lengths <= L (every type's basis is then fixed, dynamic included)."""
    old = _ids(40, 7)
    edits = _edits([(5, 5, 3), (20, 24, 0), (30, 31, 2)])
    with patched(model, spec_for(rope_type, 8)):
        ref = _prefill(model, apply_edits(old, edits))
        pie = update_cache(model, _prefill(model, old), edits, strategy="pie").cache
        conflict = update_cache(model, _prefill(model, old), edits, strategy="conflict").cache
    torch.testing.assert_close(pie.keys[0], ref.keys[0], **KEY_TOL)
    assert (conflict.keys[0] - ref.keys[0]).abs().max() > 1e-2


def test_length_dependent_types_refuse_or_recompute_from_zero(model):
    """dynamic beyond L: the basis changes with the length, so pie refuses and recompute
    re-encodes from position 0 (equal to a fresh prefill)."""
    old = _ids(70, 8)  # > L
    edits = _edits([(60, 60, 3)])
    with patched(model, spec_for("dynamic", 8)):
        base = _prefill(model, old)
        with pytest.raises(ValueError, match="RoPE basis"):
            update_cache(model, base.clone(), edits, strategy="pie")
        ref = _prefill(model, apply_edits(old, edits))
        rec = update_cache(model, base.clone(), edits, strategy="recompute")
    assert rec.cost.tokens_encoded == 73 and "reencoded_from_zero" in rec.cost.details
    torch.testing.assert_close(rec.cache.keys[1], ref.keys[1], **KEY_TOL)


def test_longrope_pie_works_above_L_and_refuses_across(model):
    """longrope: one basis per side of L; an edit whose span stays above L is exact, an edit
    whose span sits below L (short basis) in a cache longer than L (long basis) is refused."""
    old = _ids(70, 9)
    with patched(model, spec_for("longrope", 8)):
        near_end = _edits([(60, 61, 3)])
        ref = _prefill(model, apply_edits(old, near_end))
        pie = update_cache(model, _prefill(model, old), near_end, strategy="pie").cache
        torch.testing.assert_close(pie.keys[0], ref.keys[0], **KEY_TOL)
        with pytest.raises(ValueError, match="RoPE basis"):
            update_cache(model, _prefill(model, old), _edits([(10, 10, 2)]), strategy="pie")
        # a cache that crossed L in decode (short basis prefill, long basis step) has no single basis
        cache = _prefill(model, old[:L])
        cache.extend(model, torch.tensor([old[L:L + 2]]))
        assert not cache.has_single_basis
        with pytest.raises(ValueError, match="no one known RoPE basis"):
            update_cache(model, cache, _edits([(L + 1, L + 1, 1)]), strategy="pie")


# ----------------------------------------------------------------------------- model outputs
def test_pie_next_tokens_close_to_recompute(model):
    """Beyond layer 0 pie is an approximation: over random edits its next-token logits must be
    closer to recompute's than conflict's, and its greedy next token mostly agree."""
    rng = random.Random(0)
    err = {"pie": [], "conflict": []}
    agree = {"pie": 0, "conflict": 0}
    n_trials = 12
    for t in range(n_trials):
        old = _ids(N_OLD, 100 + t)
        s = rng.randint(0, N_OLD - 10)
        kind = t % 3
        edits = [Edit(s, s, _ids(rng.randint(1, 6), t))] if kind == 0 else (
            [Edit(s, s + rng.randint(1, 6))] if kind == 1 else
            [Edit(s, s + 2, _ids(4, t)), Edit(s + 5, s + 8)])
        nxt = torch.tensor([[_ids(1, 999 + t)[0]]])
        base = _prefill(model, old)
        logits = {}
        for name in EDIT_STRATEGIES:
            res = update_cache(model, base.clone(), edits, strategy=name)
            logits[name] = res.cache.extend_logits(model, nxt)[1][0]
        for name in err:
            err[name].append((logits[name] - logits["recompute"]).abs().max().item())
            agree[name] += int(logits[name].argmax() == logits["recompute"].argmax())
    assert sum(err["pie"]) < sum(err["conflict"]), err
    assert agree["pie"] >= agree["conflict"] and agree["pie"] >= n_trials // 2, agree


def test_partial_rotary_model_pie_refuses_by_name_recompute_runs():
    """A partial rotary family (Phi: RoPE on the first r channels of each head): PIE re-rotates
    whole heads, so it refuses by name; recompute works."""
    from lcx.hf.models import tiny_model

    model = tiny_model("phi", seed=0, max_position_embeddings=64, vocab_size=VOCAB[1])
    old, edits = _ids(30, 10), _edits([(10, 10, 2)])
    cache = _prefill(model, old)
    with pytest.raises(ValueError, match="partial rotary"):
        update_cache(model, cache.clone(), edits, strategy="pie")
    rec = update_cache(model, cache, edits, strategy="recompute")
    assert rec.cache.token_ids[0].tolist() == apply_edits(old, edits)
