"""The C++ kernel's compacted index (`lcx.kernels.cpu.compact_index`): each query walks only the
keys it sees (a bounded method's prefill: window + side keys, not every key of the call), with
the same result, bit for bit, as the full index (the same keys in the same order), which
tests/kernels/test_relative_attention_cpu.py holds to the method's `attend`."""

import shutil

import pytest
import torch

from lcx.attention import Rotary
from lcx.kernels.cpu import compact_index, paged_relative_attention_cpu
from lcx.methods import causal, examples, lm_infinite, method_id
from lcx.methods.last_query import RelativeKeys
from lcx.rope import compute_inv_freq
from lcx.testing import poison_

_TOOLCHAIN = shutil.which("c++") is not None and shutil.which("ninja") is not None

# generated from the registry: every registered method's examples whose queries are plain softmax
# over keys at given relative positions (what the C++ kernel runs), as in test_relative_attention_cpu.py
METHODS = [m for m in examples() if m.query_keys(torch.arange(2)[None], 1) is not None]
PREFILL = [(1, 1, 1), (2, 17, 17), (3, 29, 6), (1, 63, 63)]  # (B, Tk, Tq)
H, HKV, D, R, N_BLOCKS, BLOCK = 4, 2, 40, 16, 23, 16


def test_hand_written_compaction():
    # 3 queries over 5 keys; -1: not visible. Each row keeps its visible keys in key order,
    # padded with -1 to the widest row (3 keys).
    index = torch.tensor([[[0, -1, -1, -1, -1],
                           [2, -1, 1, 0, -1],
                           [-1, 4, -1, 3, 0]]])
    cols, rows = compact_index(index)
    assert cols.tolist() == [[[0, -1, -1], [0, 2, 3], [1, 3, 4]]]
    assert rows.tolist() == [[[0, -1, -1], [2, 1, 0], [4, 3, 0]]]


def test_lm_infinite_prefill_compacts_to_globals_plus_window():
    # lm_infinite(2, 4) over 64 keys: no query sees more than 2 globals + 4 window keys
    keys = RelativeKeys.build(lm_infinite(2, 4), Rotary(torch.ones(1), None, 1.0), n_keys=64, n_queries=64)
    cols, _ = compact_index(keys.index)
    assert cols.shape == (1, 64, 6)
    assert cols[0, 40].tolist() == [0, 1, 37, 38, 39, 40]
    assert cols[0, 1].tolist() == [0, 1, -1, -1, -1, -1]


@pytest.mark.skipif(not _TOOLCHAIN, reason="no C++ compiler or ninja: the extension cannot build")
@pytest.mark.parametrize("method", METHODS, ids=method_id)
@pytest.mark.parametrize("B,Tk,Tq", PREFILL, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compacted_call_equals_full_index(B, Tk, Tq, method, dtype):
    g = torch.Generator().manual_seed(B * 100 + Tk + Tq)
    kv = torch.randn(N_BLOCKS * HKV * BLOCK, 2 * D, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(N_BLOCKS * BLOCK, generator=g)[:Tk] for _ in range(B)])  # [B, Tk]
    rows = ((slots // BLOCK)[..., None] * HKV + torch.arange(HKV)) * BLOCK + (slots % BLOCK)[..., None]
    q_rows = torch.randperm(B * Tq + 2, generator=g)[: B * Tq].view(B, Tq)
    query = torch.randn(B * Tq + 2, H, D, generator=g).to(dtype)
    inv_freq, _ = compute_inv_freq({"rope_type": "default", "rope_theta": 500.0}, R)
    keys = RelativeKeys.build(method, Rotary(inv_freq, None, 1.1), n_keys=Tk, n_queries=Tq, dtype=dtype)
    cols, index = compact_index(keys.index)
    full = poison_(torch.empty(query.shape, dtype=dtype))
    paged_relative_attention_cpu(query, kv, rows, q_rows, keys, scale=0.3, out=full)
    compact = poison_(torch.empty(query.shape, dtype=dtype))
    paged_relative_attention_cpu(query, kv, rows, q_rows, RelativeKeys(index, keys.cos, keys.sin), scale=0.3,
                                 out=compact, cols=cols)
    assert not full[q_rows].isnan().any()
    assert torch.equal(compact[q_rows], full[q_rows])
    assert compact.isnan().sum() == full.isnan().sum()  # the same rows left untouched


@pytest.mark.skipif(not _TOOLCHAIN, reason="no C++ compiler or ninja: the extension cannot build")
def test_bad_cols_raise():
    keys = RelativeKeys.build(causal(), Rotary(torch.ones(2), None, 1.0), n_keys=4, n_queries=4)
    cols, index = compact_index(keys.index)
    kv, query = torch.randn(64, 8), torch.randn(4, 2, 4)
    rows = torch.arange(4)[None, :, None]  # [1, 4, 1]
    q_rows = torch.arange(4)[None]
    with pytest.raises(RuntimeError, match="cols must be"):
        paged_relative_attention_cpu(query, kv, rows, q_rows, RelativeKeys(index, keys.cos, keys.sin), scale=1.0,
                                     out=torch.empty_like(query), cols=cols[..., :2])
    with pytest.raises(RuntimeError, match="out of range"):  # a key past the request's K
        paged_relative_attention_cpu(query, kv, rows, q_rows, RelativeKeys(index, keys.cos, keys.sin), scale=1.0,
                                     out=torch.empty_like(query), cols=cols + 1)
