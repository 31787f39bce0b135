"""StreamingLLM (`lcx.methods.sinks`, `lcx.methods.streaming`): the renumbered positions are
StreamingLLM's own cache procedure, pinned by a hand example, and the two-pass computation every
backend runs equals the dense reference. (The grids over every method, `lcx.methods.examples`,
run it too: tests/methods/test_registry.py lists them.)"""

from __future__ import annotations

import pytest
import torch

from lcx.attention import Rotary, attention_ref
from lcx.attention.rotary import rotate_qk
from lcx.methods import streaming_attention, streaming_attention_ref
from lcx.rope import RopeSpec, compute_inv_freq

STREAM_SHAPES = [  # (Tq, Tk, n_sink, window)
    (1, 1, 4, 8), (7, 7, 2, 3), (13, 13, 0, 4), (16, 16, 4, 1), (5, 29, 3, 6), (29, 29, 30, 7), (63, 63, 4, 16),
]
STREAM_BACKENDS = ("ref", "blockwise", "flex")


def _inv_freq(D: int) -> torch.Tensor:
    return compute_inv_freq(RopeSpec.from_dict({"rope_type": "default", "rope_theta": 10000.0}), D)[0]


# ------------------------------------------------------------------------------ StreamingLLM semantics


def _streaming_official(q, k, v, rotary_inv_freq, n_sink, window, softcap=None):
    """StreamingLLM's procedure, query by query: cache = sinks + the window's keys, unrotated;
    every key rotated by its SLOT index, the query by the last slot; causal softmax over the cache
    (its logits soft-capped at `softcap`, a Gemma 2 model's)."""
    Tq, Tk = q.shape[1], k.shape[1]
    outs = []
    for t in range(Tq):
        i = Tk - Tq + t
        slots = sorted(set(range(min(n_sink, i + 1))) | set(range(max(0, i - window + 1), i + 1)))
        kc, vc = k[:, slots], v[:, slots]
        n = len(slots)
        rot = Rotary(rotary_inv_freq, torch.arange(n))
        qr, kr = rotate_qk(q[:, t:t + 1], kc, rot, n - 1)
        outs.append(attention_ref(qr, kr, vc, q_offset=n - 1, softcap=softcap))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("Tq, Tk, S, w", STREAM_SHAPES, ids=lambda x: str(x))
def test_streaming_ref_is_streamingllm_procedure(Tq, Tk, S, w):
    g = torch.Generator().manual_seed(Tk * 31 + Tq)
    q = torch.randn(2, Tq, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, Tk, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, Tk, 2, 16, generator=g, dtype=torch.float64)
    inv = _inv_freq(16)
    want = _streaming_official(q, k, v, inv, S, w)
    got = streaming_attention_ref(q, k, v, rotary=Rotary(inv), n_sink=S, window=w)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", ["ref", "blockwise"])
def test_streaming_soft_capped_is_streamingllm_procedure(backend):
    """A model's attention-logit soft-capping (Gemma 2) in both passes of the renumbered sinks."""
    from lcx.methods import sinks

    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 9, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 30, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 30, 2, 16, generator=g, dtype=torch.float64)
    inv = _inv_freq(16)
    want = _streaming_official(q, k, v, inv, 3, 6, softcap=1.5)
    torch.testing.assert_close(streaming_attention_ref(q, k, v, rotary=Rotary(inv), n_sink=3, window=6, softcap=1.5),
                               want, atol=1e-12, rtol=1e-12)
    got = sinks(n_sink=3, window=6, renumber=True).attend(q, k, v, rotary=Rotary(inv), backend=backend, softcap=1.5)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert (want - _streaming_official(q, k, v, inv, 3, 6)).abs().max() > 1e-3


def test_streaming_positions_hand_example():
    """S=2, w=3, Tk=8, query 7: keys 5, 6, 7 at distances 2, 1, 0; sinks 0, 1 at distances 4, 3
    (true distances 7, 6). With q = k = a single rotary pair and v one-hot, the weights show it."""
    inv = torch.tensor([1.0], dtype=torch.float64)  # one frequency: score = cos(distance) * |q||k|
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64).expand(1, 1, 1, 2)
    k = q.expand(1, 8, 1, 2).clone()
    v = torch.eye(8, dtype=torch.float64)[None, :, None, :]  # value of key j = e_j
    out = streaming_attention_ref(q.clone(), k, v, rotary=Rotary(inv), n_sink=2, window=3, scale=1.0)
    dist = torch.tensor([4, 3, 99, 99, 99, 2, 1, 0], dtype=torch.float64)
    logits = torch.cos(dist).masked_fill(dist == 99, float("-inf"))
    torch.testing.assert_close(out[0, 0, 0], torch.softmax(logits, -1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", STREAM_BACKENDS)
@pytest.mark.parametrize("Tq, Tk, S, w", STREAM_SHAPES, ids=lambda x: str(x))
def test_streaming_two_pass_matches_ref(backend, Tq, Tk, S, w):
    g = torch.Generator().manual_seed(Tk)
    q, k, v = (torch.randn(1, n, h, 16, generator=g) for n, h in ((Tq, 4), (Tk, 2), (Tk, 2)))
    rot = Rotary(_inv_freq(16), torch.arange(Tk) + 5)  # positions need not start at 0
    want = streaming_attention_ref(q.double(), k.double(), v.double(), rotary=rot, n_sink=S, window=w)
    got = streaming_attention(q, k, v, rotary=rot, n_sink=S, window=w, backend=backend)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
