"""Streaming generation with group position encoding (lcx.cache.gpe)."""

from __future__ import annotations

import pytest
import torch

from lcx.cache.gpe import (StreamingConfig, group_forward_logits, group_layout, stream_generate,
                           wait_k_visible)
from lcx.models.tiny import tiny_llama

# (chunk lengths, wait_k, pe_cache_length): odd chunk sizes, k = 1 and k past the source length.
GRID = [((1, 1, 1, 1, 1), 1, 0), ((3, 1, 2), 2, 0), ((2, 5, 1, 1), 1, 7), ((1, 2), 4, 0)]


@pytest.fixture(scope="module")
def model():
    m, _ = tiny_llama(seed=0)
    return m.eval()


def _chunks(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (n,), generator=g).tolist() for n in lengths]


def test_group_layout_expected_matrix():
    # 2 source units of 1 token, wait-k 1: the diagram in the module docstring.
    pos, mask = group_layout(2, wait_k_visible([1, 1], 1, 2), 0)
    assert pos.tolist() == [0, 1, 0, 1]
    expected = [[1, 0, 0, 0],   # s0
                [1, 1, 0, 0],   # s1
                [1, 0, 1, 0],   # start (sees s0 only)
                [1, 1, 1, 1]]   # t0
    assert mask.int().tolist() == expected


@pytest.mark.parametrize("lengths,k,phi", GRID, ids=lambda v: str(v))
def test_group_streaming_matches_batch_forward(model, lengths, k, phi):
    chunks = _chunks(lengths)
    cfg = StreamingConfig(wait_k=k, mode="group", pe_cache_length=phi, start_id=1)
    res = stream_generate(model, chunks, cfg)
    assert len(res.tokens) == len(chunks)
    assert res.reencoded_tokens == 0
    assert res.src_visible == wait_k_visible(lengths, k, len(chunks))
    assert res.target_positions == [phi + j for j in range(len(chunks))]
    src = torch.tensor([sum(chunks, [])])
    tgt_in = torch.tensor([[1] + res.tokens[:-1]])
    with torch.no_grad():
        ref = group_forward_logits(model, src, tgt_in, res.src_visible, phi)[0].float()
    torch.testing.assert_close(res.logits, ref, atol=1e-5, rtol=1e-5)
    assert res.tokens == ref.argmax(-1).tolist()


def test_source_never_attends_to_target(model):
    chunks = _chunks((2, 1, 3, 1))
    cfg = StreamingConfig(wait_k=1, mode="group")
    from lcx.cache.gpe import StreamingSession

    keys, target_keys = [], []
    for forced in ([10, 11, 12, 13], [200, 150, 5, 99]):
        s = StreamingSession(model, cfg)
        s._forced = forced
        for c in chunks:
            s.read(c)
        s.finish()
        assert s.tokens == forced
        keys.append([k.clone() for k in s.source.keys])
        target_keys.append([k.clone() for k in s.target.keys])
    assert keys[0] and len(keys[0]) == len(keys[1])
    for a, b in zip(*keys):
        assert torch.equal(a, b)
    # ... while the target caches do differ (the perturbation was real)
    assert any(not torch.equal(a, b) for a, b in zip(*target_keys))


def test_reencoded_counts(model):
    chunks = _chunks((1, 2, 1, 1, 3))
    g = stream_generate(model, chunks, StreamingConfig(wait_k=2, mode="group"))
    i = stream_generate(model, chunks, StreamingConfig(wait_k=2, mode="interleaved"))
    assert g.reencoded_tokens == 0
    # interleaved: after units 3, 4, 5 the target inputs (1, 2, 3 of them) move behind the source.
    assert i.reencoded_tokens == 1 + 2 + 3
    # interleaved target input j sits right behind the source read when it was fed.
    assert i.target_positions == [v + j for j, v in enumerate(i.src_visible)]
    assert len(i.tokens) == len(g.tokens) == len(chunks)


def test_max_target_and_eos(model):
    chunks = _chunks((1, 1, 1))
    r = stream_generate(model, chunks, StreamingConfig(wait_k=1, max_target=5))
    assert len(r.tokens) == 5 and r.src_visible[-2:] == [3, 3]
    r = stream_generate(model, chunks, StreamingConfig(wait_k=1, max_target=5, eos_id=7), forced=[3, 7, 9])
    assert r.tokens == [3, 7]


@pytest.mark.parametrize("kwargs,name", [
    (dict(wait_k=-1), "wait_k"), (dict(wait_k=0), "wait_k"), (dict(wait_k=1.5), "wait_k"),
    (dict(mode="bogus"), "mode"), (dict(pe_cache_length=-1), "pe_cache_length"),
    (dict(start_id=-2), "start_id"), (dict(max_target=-1), "max_target"),
])
def test_bad_config_raises(kwargs, name):
    with pytest.raises(ValueError, match=name):
        StreamingConfig(**kwargs)


def test_bad_args_raise(model):
    with pytest.raises(ValueError, match="wait_k"):
        wait_k_visible([1, 2], -1, 2)
    with pytest.raises(ValueError, match="unit_lengths"):
        wait_k_visible([1, 0], 1, 2)
    with pytest.raises(ValueError, match="src_visible"):
        group_layout(2, [3])
    with pytest.raises(ValueError, match="source_chunks"):
        stream_generate(model, [], StreamingConfig())
    with pytest.raises(ValueError, match="chunk"):
        stream_generate(model, [[]], StreamingConfig())
