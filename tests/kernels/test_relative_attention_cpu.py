"""`lcx.kernels.cpu.paged_relative_attention_cpu` (C++: paged gather + relative rotation + masked
softmax) with `lcx.methods.last_query.RelativeKeys` equals the method's own `attend` on the
gathered keys: decode (one query, per-request positions with gaps, as a compressed cache has)
and prefill / chunked prefill (several queries, positions 0..Tk-1), for every softmax method."""

import shutil

import pytest
import torch

from lcx.attention import Rotary
from lcx.kernels.cpu import paged_relative_attention_cpu, unavailable
from lcx.methods import causal, examples, lm_infinite, method_id
from lcx.methods.last_query import RelativeKeys
from lcx.rope import compute_inv_freq
from lcx.testing import assert_within_budget, poison_

# every registered method's examples whose queries are plain softmax over keys at given relative
# positions (`RelativeKeys`: not SWAT's sigmoid, not LM-Infinite's score-dependent top-k)
METHODS = [m for m in examples() if m.query_keys(torch.arange(2)[None], 1) is not None]
FIRST_OF_EACH = [m for i, m in enumerate(METHODS) if all(p.name != m.name for p in METHODS[:i])]
DECODE = [(1, 1), (3, 5), (7, 13), (2, 56)]  # (B, K)
PREFILL = [(1, 1, 1), (2, 17, 17), (3, 29, 6), (2, 64, 64), (1, 9, 2)]  # (B, Tk, Tq)
HEADS = [(4, 2), (6, 1), (4, 4)]  # (H, Hkv)
DIMS = [(32, 32), (40, 16)]  # (head dim, rotary dim): partial rotary passes channels through
LOWP = [torch.bfloat16, torch.float16]
N_BLOCKS, BLOCK = 37, 16

_TOOLCHAIN = shutil.which("c++") is not None and shutil.which("ninja") is not None
pytestmark = pytest.mark.skipif(not _TOOLCHAIN, reason="no C++ compiler or ninja: the extension cannot build")


def test_builds_where_a_toolchain_exists():
    assert unavailable() is None


def _case(B, Tk, Tq, H, Hkv, D, r, seed, gaps):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(N_BLOCKS * Hkv * BLOCK, 2 * D, generator=g, dtype=torch.float64)
    slots = torch.stack([torch.randperm(N_BLOCKS * BLOCK, generator=g)[:Tk] for _ in range(B)])  # [B, Tk]
    rows = ((slots // BLOCK)[..., None] * Hkv + torch.arange(Hkv)) * BLOCK + (slots % BLOCK)[..., None]
    n_rows = B * Tq + 3
    q_rows = torch.randperm(n_rows, generator=g)[: B * Tq].view(B, Tq)
    query = torch.randn(n_rows, H, D, generator=g, dtype=torch.float64)
    positions = None
    if gaps:  # a compressed cache: first keys, then a later run
        positions = torch.randint(1, 4, (B, Tk), generator=g).cumsum(-1) + torch.randint(0, 50, (B, 1), generator=g)
    inv_freq, _ = compute_inv_freq({"rope_type": "default", "rope_theta": 500.0}, r)
    return kv, rows, q_rows, query, Rotary(inv_freq, positions, 1.2)


def _check(method, B, Tk, Tq, H, Hkv, D, r, dtype, gaps, softcap=None):
    kv, rows, q_rows, query, rotary = _case(B, Tk, Tq, H, Hkv, D, r, seed=B * 1000 + Tk * 10 + Tq + H, gaps=gaps)
    scale = D ** -0.5

    def reference(dt):
        k, v = kv.to(dt)[rows][..., :D], kv.to(dt)[rows][..., D:]  # [B, Tk, Hkv, D]
        # [B, Tq, H, D]
        return method.attend(query.to(dt)[q_rows], k, v, rotary=rotary, scale=scale, softcap=softcap)

    keys = RelativeKeys.build(method, rotary, n_keys=Tk, n_queries=Tq, dtype=dtype)
    out = poison_(torch.empty(query.shape, dtype=dtype))
    paged_relative_attention_cpu(query.to(dtype), kv.to(dtype), rows, q_rows, keys, scale=scale, out=out,
                                 softcap=softcap)
    assert_within_budget(out[q_rows], reference(dtype), reference(torch.float64), what=f"{method.describe()} {dtype}")
    untouched = torch.ones(query.shape[0], dtype=torch.bool)
    untouched[q_rows.flatten()] = False
    assert out[untouched].isnan().all()  # only the queries' rows are written


@pytest.mark.parametrize("softcap", [None, 0.8], ids=str)  # 0.8: a logit cap that bites (Gemma 2's kind)
@pytest.mark.parametrize("method", METHODS, ids=method_id)
@pytest.mark.parametrize("B,Tk,Tq", [(3, 13, 1), (2, 29, 6)], ids=str)
def test_smoke_equals_attend(B, Tk, Tq, method, softcap):
    """The default tier's share of the grids below (which run with `-m slow`): every method,
    decode on gapped positions and a chunked prefill, GQA, partial rotary, with and without a cap."""
    _check(method, B, Tk, Tq, 6, 2, 40, 16, torch.float32, gaps=Tq == 1, softcap=softcap)


@pytest.mark.parametrize("method", FIRST_OF_EACH, ids=method_id)
def test_two_threads_give_the_bits_of_one(method):
    """The kernel's tasks (request, query, kv head) run on torch's intra-op pool, and the tests run
    with one thread (tests/conftest.py): here the parallel path, two threads, gives the same bits
    as one, decode and chunked prefill."""
    before = torch.get_num_threads()
    try:
        for B, Tk, Tq in ((3, 13, 1), (2, 29, 6)):
            kv, rows, q_rows, query, rotary = _case(B, Tk, Tq, 6, 2, 40, 16, seed=7, gaps=Tq == 1)
            keys = RelativeKeys.build(method, rotary, n_keys=Tk, n_queries=Tq, dtype=torch.float32)
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out = poison_(torch.empty(query.shape, dtype=torch.float32))
                paged_relative_attention_cpu(query.float(), kv.float(), rows, q_rows, keys, scale=40 ** -0.5, out=out)
                outs.append(out[q_rows])
            assert torch.equal(outs[0], outs[1]), (method.describe(), B, Tk, Tq)
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS, ids=method_id)
@pytest.mark.parametrize("D,r", DIMS, ids=str)
@pytest.mark.parametrize("H,Hkv", HEADS, ids=str)
@pytest.mark.parametrize("B,K", DECODE, ids=str)
def test_decode_equals_attend(B, K, H, Hkv, D, r, method):
    _check(method, B, K, 1, H, Hkv, D, r, torch.float32, gaps=True)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS, ids=method_id)
@pytest.mark.parametrize("D,r", DIMS, ids=str)
@pytest.mark.parametrize("H,Hkv", HEADS[:2], ids=str)
@pytest.mark.parametrize("B,Tk,Tq", PREFILL, ids=str)
def test_prefill_equals_attend(B, Tk, Tq, H, Hkv, D, r, method):
    _check(method, B, Tk, Tq, H, Hkv, D, r, torch.float32, gaps=False)


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("method", FIRST_OF_EACH, ids=method_id)
@pytest.mark.parametrize("B,Tk,Tq", [(3, 13, 1), (2, 29, 6)], ids=str)
def test_low_precision_smoke(B, Tk, Tq, method, dtype):
    _check(method, B, Tk, Tq, 4, 2, 40, 16, dtype, gaps=Tq == 1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("method", [m for m in METHODS if m not in FIRST_OF_EACH], ids=method_id)
@pytest.mark.parametrize("B,Tk,Tq", [(3, 13, 1), (2, 29, 6)], ids=str)
def test_low_precision(B, Tk, Tq, method, dtype):
    _check(method, B, Tk, Tq, 4, 2, 40, 16, dtype, gaps=Tq == 1)


def test_hand_written_lm_infinite_prefill_index():
    # lm_infinite(1, 2) over 5 keys, all 5 queries: query i sees key 0 (global) and keys i-1, i;
    # the global key outside the window is scored at the call's distance min(limit=2, Tk-1) = 2
    keys = RelativeKeys.build(lm_infinite(1, 2), Rotary(torch.ones(1), None, 1.0), n_keys=5, n_queries=5)
    rel = torch.full((5, 5), 99)
    rel[keys.index[0] >= 0] = torch.atan2(keys.sin[:, 0], keys.cos[:, 0]).round().long()[keys.index[0][keys.index[0] >= 0]]
    assert rel.tolist() == [[0, 99, 99, 99, 99],
                            [-1, 0, 99, 99, 99],
                            [-2, -1, 0, 99, 99],
                            [-2, 99, -1, 0, 99],
                            [-2, 99, 99, -1, 0]]


def test_bad_arguments_raise():
    kv, rows, q_rows, query, rotary = _case(2, 4, 1, 4, 2, 32, 32, seed=5, gaps=True)
    keys = RelativeKeys.build(causal(), rotary, n_keys=4)
    out = torch.empty(query.shape)
    with pytest.raises(RuntimeError, match="kv heads"):
        paged_relative_attention_cpu(query.float()[:, :3], kv.float(), rows, q_rows, keys, scale=0.2, out=out[:, :3])
    with pytest.raises(RuntimeError, match="one dtype"):
        paged_relative_attention_cpu(query.float(), kv.double(), rows, q_rows, keys, scale=0.2, out=out)
    with pytest.raises(RuntimeError, match="out of range"):
        paged_relative_attention_cpu(query.float(), kv.float()[:3], rows, q_rows, keys, scale=0.2, out=out)
    with pytest.raises(ValueError, match="takes"):
        paged_relative_attention_cpu(query.double(), kv.double(), rows, q_rows, keys, scale=0.2, out=out.double())
    with pytest.raises(ValueError, match="softcap"):
        paged_relative_attention_cpu(query.float(), kv.float(), rows, q_rows, keys, scale=0.2, out=out, softcap=0.0)
