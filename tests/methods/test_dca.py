"""Dual Chunk Attention (`lcx.methods.dca`): the per-chunk passes `attend` runs equal the dense
reference on every backend; the position maps by hand; the lengths up to which it is causal
attention (from any start, from position 0) and no further; chunked calls equal one call (prefix
cache and chunked prefill exact); parameters, ChunkLlama's defaults and Qwen's
`dual_chunk_attention_config`. (The grids over every method, `lcx.methods.examples`, run it too;
its parity with ChunkLlama's published algorithm is tests/methods/test_dca_parity.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from lcx.attention import Rotary
from lcx.attention.reference import attention_ref_spec
from lcx.attention.spec import AttentionSpec
from lcx.masks import causal_mask
from lcx.methods import DCA, Causal, chunkllama_dca, dca, dca_from_hf_config, dca_ref, method_from_dict
from lcx.methods.dca import _rotate, hf_config_left_out
from lcx.rope import compute_inv_freq

B, H, HKV, D = 2, 4, 2, 16
# (Tq, Tk, chunk_size, local_size): a decode step, chunks of queries after held keys, whole
# prefills; w < c (the successive query clamped at s) and w >= c (never clamped)
SHAPES = [
    (1, 1, 8, 3), (1, 13, 8, 3), (6, 29, 8, 3), (29, 29, 8, 3), (61, 61, 8, 3), (33, 33, 7, 4),
    (7, 40, 7, 4), (61, 61, 16, 3), (17, 50, 24, 2), (63, 63, 3, 1),
]
BACKENDS = ("ref", "blockwise", "flash", "flex")


def _inv_freq(D: int = D) -> torch.Tensor:
    return compute_inv_freq({"rope_type": "default", "rope_theta": 100.0}, D)[0]


def _qkv(Tq: int, Tk: int, seed: int = 0, batch: int = B):
    g = torch.Generator().manual_seed(seed * 1000 + Tq * 100 + Tk)
    q = torch.randn(batch, Tq, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, Tk, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


# ------------------------------------------------------------------------------ passes == reference
# flex traces every shape anew (seconds each on 2 cores): two shapes are enough for it
CASES = [pytest.param(*shape, backend, id=f"q{shape[0]}k{shape[1]}s{shape[2]}w{shape[3]}-{backend}")
         for shape in SHAPES for backend in BACKENDS if backend != "flex" or shape in (SHAPES[2], SHAPES[7])]


@pytest.mark.parametrize("Tq,Tk,s,w,backend", CASES)
def test_passes_equal_the_reference(Tq, Tk, s, w, backend):
    q, k, v = _qkv(Tq, Tk)
    rot = Rotary(_inv_freq(), torch.arange(Tk) + 3, 1.2)  # positions need not start at 0
    want = dca_ref(q, k, v, rotary=rot, chunk_size=s, local_size=w, scale=0.3)
    got = dca(s, w).attend(q, k, v, rotary=rot, backend=backend, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("Tq,Tk", [(1, 23), (9, 37)])
def test_soft_capped_passes_equal_the_reference(Tq, Tk):
    """Soft-capping (Gemma 2) caps the one logit each key gets, in whichever part it falls."""
    q, k, v = _qkv(Tq, Tk)
    rot = Rotary(_inv_freq(), torch.arange(Tk))
    want = dca_ref(q, k, v, rotary=rot, chunk_size=8, local_size=3, softcap=1.5)
    got = dca(8, 3).attend(q, k, v, rotary=rot, backend="blockwise", softcap=1.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, dca(8, 3).attend(q, k, v, rotary=rot))


def test_rows_with_their_own_positions():
    """[B, Tk] positions: rows whose chunks fall differently (other starts, a compressed cache's
    gaps) each run at their own positions, as the reference defines."""
    q, k, v = _qkv(5, 21, batch=3)
    pos = torch.stack([torch.arange(21), torch.arange(21) + 4, torch.cat((torch.arange(3), torch.arange(12, 30)))])
    rot = Rotary(_inv_freq(), pos)
    want = dca_ref(q, k, v, rotary=rot, chunk_size=8, local_size=3)
    for backend in ("blockwise", "flash"):
        torch.testing.assert_close(dca(8, 3).attend(q, k, v, rotary=rot, backend=backend), want,
                                   rtol=1e-12, atol=1e-12)
    for b in range(3):  # each row as its own call
        one = dca(8, 3).attend(q[b:b + 1], k[b:b + 1], v[b:b + 1], rotary=Rotary(_inv_freq(), pos[b]))
        torch.testing.assert_close(one, want[b:b + 1], rtol=1e-12, atol=1e-12)


def test_float32_flash_within_float32_error():
    from lcx.testing import assert_within_budget

    q, k, v = _qkv(61, 61)
    rot = Rotary(_inv_freq(), None)
    exact = dca_ref(q, k, v, rotary=rot, chunk_size=16, local_size=3)
    f32 = [t.float() for t in (q, k, v)]
    ref32 = dca_ref(*f32, rotary=rot, chunk_size=16, local_size=3)
    got = dca(16, 3).attend(*f32, rotary=rot, backend="flash")
    assert got.dtype == torch.float32
    assert_within_budget(got, ref32, exact, what="dca on flash")


def test_bad_positions_raise():
    q, k, v = _qkv(3, 5)
    with pytest.raises(ValueError, match="do not decrease"):
        dca(8, 3).attend(q, k, v, rotary=Rotary(_inv_freq(), torch.tensor([0, 1, 2, 4, 3])))
    with pytest.raises(ValueError, match="integer key positions"):
        dca(8, 3).attend(q, k, v, rotary=Rotary(_inv_freq(), torch.arange(5) + 0.5))


# ------------------------------------------------------------------------------ the position maps by hand
# chunk_size s = 8, local_size w = 3: chunks of c = 5 positions; inter query at min(2c - 1, s) = 8.
# Query distance to each key 0..p_q (q position - k position), written out:
#   p_q = 12 (chunk 2, r = 2 <= w): keys 0-4 inter 8 - r_k; keys 5-9 successive 7 - r_k (= true,
#       unclamped); keys 10-12 intra, true distances
#   p_q = 14 (chunk 2, r = 4 > w): successive query clamped at 8: 8 - r_k (true would be 9 - r_k)
#   p_q = 7 (chunk 1, r = 2): no inter keys; successive 7 - r_k, the true distances
HAND = {
    12: [8, 7, 6, 5, 4, 7, 6, 5, 4, 3, 2, 1, 0],
    14: [8, 7, 6, 5, 4, 8, 7, 6, 5, 4, 4, 3, 2, 1, 0],
    7: [7, 6, 5, 4, 3, 2, 1, 0],
}


@pytest.mark.parametrize("p_q", sorted(HAND))
def test_distances_by_hand(p_q):
    m = dca(8, 3)
    moved = m.moved_key_positions(torch.arange(p_q + 1))  # keys moved against the query at p_q
    assert (p_q - moved).tolist() == HAND[p_q]


@pytest.mark.parametrize("pos_kind", ["arange", "offset", "gaps"])
@pytest.mark.parametrize("Tk", [1, 6, 13, 31])
def test_last_query_is_softmax_over_moved_keys(Tk, pos_kind):
    """The decode query = plain causal softmax over keys rotated to `moved_key_positions`."""
    m = dca(8, 3)
    q, k, v = _qkv(1, Tk)
    pos = {"arange": torch.arange(Tk), "offset": torch.arange(Tk) + 7,
           "gaps": torch.cumsum(torch.randint(1, 4, (Tk,), generator=torch.Generator().manual_seed(Tk)), 0)}[pos_kind]
    rot = Rotary(_inv_freq(), pos, 1.1)
    moved = m.moved_key_positions(pos)
    qr = _rotate(q, pos[-1:].to(torch.float64), rot)
    kr = _rotate(k, moved, rot)
    want = attention_ref_spec(qr, kr, v, AttentionSpec(mask=causal_mask, scale=0.3))
    torch.testing.assert_close(m.attend(q, k, v, rotary=rot, scale=0.3), want, rtol=1e-12, atol=1e-12)


def test_largest_distance_is_chunk_size():
    """Whatever the length, no query-key distance exceeds chunk_size (DCA's point)."""
    for s, w in ((8, 3), (7, 4), (24, 2), (3, 1)):
        for Tk in (1, 17, 100):
            pos = torch.arange(Tk)
            d = pos[-1] - dca(s, w).moved_key_positions(pos)
            assert int(d.max()) <= s and int(d.min()) == 0


# ------------------------------------------------------------------------------ causal up to
def _causal_gap(m: DCA, T: int, start: int) -> float:
    q, k, v = _qkv(T, T, seed=start)
    rot = Rotary(_inv_freq(), torch.arange(T) + start)
    return float((m.attend(q, k, v, rotary=rot) - Causal().attend(q, k, v, rotary=rot)).abs().max())


@pytest.mark.parametrize("s,w", [(8, 3), (7, 4), (12, 2), (5, 4), (9, 1)])
def test_causal_up_to_from_any_start_and_no_further(s, w):
    m = dca(s, w)
    c, bound = s - w, m.causal_up_to()
    assert bound == min(w + 2, c + 1)
    starts = range(0, 2 * c + 1)
    assert all(_causal_gap(m, bound, a) < 1e-12 for a in starts)
    assert max(_causal_gap(m, bound + 1, a) for a in starts) > 1e-6  # some start breaks one more token


@pytest.mark.parametrize("s,w", [(8, 3), (7, 4), (12, 2), (5, 4), (9, 1)])
def test_causal_from_position_zero_and_no_further(s, w):
    m = dca(s, w)
    bound = m.causal_from_start()
    assert bound == min(s + 1, 2 * (s - w))
    assert _causal_gap(m, bound, 0) < 1e-12
    assert _causal_gap(m, bound + 1, 0) > 1e-6


# ------------------------------------------------------------------------------ calls: prefix cache, chunked prefill
@pytest.mark.parametrize("cuts", [(1,), (5, 13), (7, 20, 33), (30,)])
def test_chunked_calls_equal_one_call(cuts):
    """call_dependence is None: the rows of any cut of a prompt into calls (each call's queries
    over every key up to them) are the rows of the one call."""
    m = dca(8, 3)
    assert m.call_dependence is None and not m.last_query_extra
    T = 41
    q, k, v = _qkv(T, T)
    rot = Rotary(_inv_freq(), torch.arange(T))
    whole = m.attend(q, k, v, rotary=rot, backend="flash")
    bounds = (0, *cuts, T)
    for a, b in zip(bounds, bounds[1:]):
        part = m.attend(q[:, a:b], k[:, :b], v[:, :b], rotary=Rotary(_inv_freq(), torch.arange(b)), backend="flash")
        torch.testing.assert_close(part, whole[:, a:b], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ parameters
@pytest.mark.parametrize("kw,match", [
    ({"chunk_size": 8, "local_size": 8}, "local_size must be < chunk_size"),
    ({"chunk_size": 8, "local_size": 9}, "local_size must be < chunk_size"),
    ({"chunk_size": 8, "local_size": 0}, "local_size must be >= 1"),
    ({"chunk_size": 1, "local_size": 1}, "chunk_size must be >= 2"),
    ({"chunk_size": 8.0, "local_size": 3}, "chunk_size must be an int"),
    ({"chunk_size": 8, "local_size": True}, "local_size must be an int"),
])
def test_bad_parameters_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        DCA(**kw)


def test_config_round_trip_and_derived_values():
    m = method_from_dict({"type": "dca", "chunk_size": 1536, "local_size": 128})
    assert m == dca(1536, 128) and m.to_dict() == {"type": "dca", "chunk_size": 1536, "local_size": 128}
    assert m.chunk_len == 1408 and m.inter_query_position == 1536
    assert dca(7, 4).inter_query_position == 5  # w >= c: 2c - 1 < s
    assert m.decode_rule() is None and m.needs_unrotated_keys  # three query rotations: attend decodes
    from lcx.method_config import MethodConfig

    cfg = MethodConfig.from_flat("attention=dca,chunk_size=1536,local_size=128")
    assert cfg.attention == m and MethodConfig.from_flat(cfg.to_flat()) == cfg


def test_chunkllama_defaults():
    """replace_with_chunkllama(pretraining_length=L0): chunk 3 L0 // 4, local window L0 // 16
    (its first release; its current code L0 // 8, passed explicitly)."""
    assert chunkllama_dca(4096) == dca(3072, 256)
    assert chunkllama_dca(2048) == dca(1536, 128)  # a 2k-context model (SmolLM2-135M's L0 is 8192: 6144, 512)
    assert chunkllama_dca(4096, local_size=4096 // 8) == dca(3072, 512)
    with pytest.raises(ValueError, match="pretraining_length"):
        chunkllama_dca(2)


# ------------------------------------------------------------------------------ Qwen's config
QWEN_1M = {"chunk_size": 262144, "local_size": 8192, "original_max_position_embeddings": 262144}


def test_dca_from_hf_config():
    from types import SimpleNamespace

    assert dca_from_hf_config({"model_type": "qwen2"}) is None
    assert dca_from_hf_config(SimpleNamespace(model_type="qwen2")) is None
    assert dca_from_hf_config({"dual_chunk_attention_config": QWEN_1M}) == dca(262144, 8192)
    assert dca_from_hf_config(SimpleNamespace(dual_chunk_attention_config=QWEN_1M)) == dca(262144, 8192)
    assert hf_config_left_out({"dual_chunk_attention_config": QWEN_1M}) == ["original_max_position_embeddings"]
    sparse = {**QWEN_1M, "sparse_attention_config": [{"0": ["vertical_and_slash", 1000, 6096, 0]}],
              "original_max_position_embeddings": 0}
    assert hf_config_left_out({"dual_chunk_attention_config": sparse}) == ["sparse_attention_config"]


@pytest.mark.parametrize("d,match", [
    ({"chunk_size": 16}, r"lacks \['local_size'\]"),
    ({"local_size": 4}, r"lacks \['chunk_size'\]"),
    ({"chunk_size": 16, "local_size": 16}, "dual_chunk_attention_config: local_size must be < chunk_size"),
    ({"chunk_size": "16", "local_size": 4}, "chunk_size must be an int"),
    ({"chunk_size": 16, "local_size": 4, "original_max_position_embeddings": -1}, "original_max_position_embeddings"),
    ([16, 4], "must be a dict"),
])
def test_bad_hf_config_raises(d, match):
    with pytest.raises(ValueError, match=match):
        dca_from_hf_config({"dual_chunk_attention_config": d})


def test_causal_up_to_is_finite_and_small():
    assert math.isfinite(dca(262144, 8192).causal_up_to()) and dca(262144, 8192).causal_up_to() == 8194
