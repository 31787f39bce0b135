"""SWAT (`lcx.methods.swat`): `attend` on every backend that takes sigmoid + ALiBi equals the
formula written out, a hand-written weight matrix, the method as data, and on a softmax model
the engine's bounded decode is exact. (The grids over every method, `lcx.methods.examples`,
run it too: tests/methods/test_registry.py lists them.)"""

from __future__ import annotations

import pytest
import torch

from lcx.attention import Rotary
from lcx.hf.attention_patch import attention_patched, unpatch_attention
from lcx.methods import method_from_dict, swat
from lcx.rope import RopeSpec, compute_inv_freq


def _inv_freq(D: int) -> torch.Tensor:
    return compute_inv_freq(RopeSpec.from_dict({"rope_type": "default", "rope_theta": 10000.0}), D)[0]


def _ids(T: int, seed: int = 0, B: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (B, T), generator=g)


# ------------------------------------------------------------------------------ SWAT
SWAT_SHAPES = [  # (Tq, Tk, window, alibi slopes or None for the balanced default)
    (1, 1, 1, None), (37, 37, 8, None), (1, 50, 7, None), (5, 29, 6, (0.3, -0.1, 0.05, -0.2)),
    (13, 13, 20, None), (63, 63, 1, None), (9, 40, 10, (0.0, 0.0, 0.0, 0.0)),
]
SWAT_BACKENDS = ("ref", "blockwise", "flex")


def _swat_written_out(q, k, v, rot, window, slopes):
    """o_i = sum_{i-w<j<=i} sigmoid(q~_i.k~_j / sqrt(D) - m_h (i - j)) v_j, densely, in float64;
    q~, k~ rotated at the keys' positions with lcx.rope's float64 tables. Independent of lcx.attention."""
    from lcx.rope import apply_rotary_ref, rope_cos_sin

    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    pos = rot.key_positions(Tk, q.device)
    cos, sin = rope_cos_sin(pos, rot.inv_freq, 1.0, torch.float64)
    qr = apply_rotary_ref(q.double(), cos[Tk - Tq:], sin[Tk - Tq:])
    kr = apply_rotary_ref(k.double(), cos, sin).repeat_interleave(H // Hkv, dim=2)
    i = torch.arange(Tk - Tq, Tk)[:, None]
    j = torch.arange(Tk)[None, :]
    m = torch.tensor(slopes, dtype=torch.float64)[:, None, None]  # [H, 1, 1]
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kr) / D ** 0.5 - m * (i - j)
    p = torch.sigmoid(s) * ((j <= i) & (j > i - window))
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double().repeat_interleave(H // Hkv, dim=2))


@pytest.mark.parametrize("backend", SWAT_BACKENDS)
@pytest.mark.parametrize("Tq,Tk,w,slopes", SWAT_SHAPES,
                         ids=[f"q{a}k{b}w{c}{'m' if d else ''}" for a, b, c, d in SWAT_SHAPES])
def test_swat_attend_equals_the_definition(Tq, Tk, w, slopes, backend):
    """SWAT.attend (one lcx.attention call, on any backend) == the formula written out."""
    from lcx.attention import balanced_alibi_slopes

    dtype = torch.float32 if backend == "flex" else torch.float64  # flex: no float64 on CPU
    g = torch.Generator().manual_seed(Tq * 100 + Tk)
    q = torch.randn(2, Tq, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, Tk, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    rot = Rotary(_inv_freq(16), torch.arange(Tk) + 3)  # positions need not start at 0
    want = _swat_written_out(q, k, v, rot, w, slopes or balanced_alibi_slopes(4))
    got = swat(w, alibi_slopes=slopes).attend(q.to(dtype), k.to(dtype), v.to(dtype), rotary=rot, backend=backend)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_swat_weights_hand_example():
    """q = 0 leaves only the window and the ALiBi term: key j's weight for query i is
    sigmoid(-m (i - j)) for i - w < j <= i. w = 3, slopes (ln 3, -ln 3): distances 0, 1, 2
    weigh 1/2, 1/4, 1/10 (head 0) and 1/2, 3/4, 9/10 (head 1); v one-hot shows the weights."""
    import math

    T = 5
    q = torch.zeros(1, T, 2, 2, dtype=torch.float64)
    k = torch.randn(1, T, 2, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    v = torch.eye(T, dtype=torch.float64)[None, :, None, :].expand(1, T, 2, T)  # value of key j = e_j
    out = swat(3, alibi_slopes=(math.log(3), -math.log(3))).attend(q, k, v, rotary=Rotary(_inv_freq(2)))
    a, b, c = 1 / 2, 1 / 4, 1 / 10
    want0 = torch.tensor([[a, 0, 0, 0, 0],
                          [b, a, 0, 0, 0],
                          [c, b, a, 0, 0],
                          [0, c, b, a, 0],
                          [0, 0, c, b, a]], dtype=torch.float64)
    a, b, c = 1 / 2, 3 / 4, 9 / 10
    want1 = torch.tensor([[a, 0, 0, 0, 0],
                          [b, a, 0, 0, 0],
                          [c, b, a, 0, 0],
                          [0, c, b, a, 0],
                          [0, 0, c, b, a]], dtype=torch.float64)
    torch.testing.assert_close(out[0, :, 0], want0, rtol=0, atol=1e-15)
    torch.testing.assert_close(out[0, :, 1], want1, rtol=0, atol=1e-15)


def test_swat_method_as_data():
    """Slopes are data: the balanced default is left out of the dict, explicit ones kept (a
    list, as JSON has it); `for_heads` resolves the default; flash (softmax-only) is refused."""
    from lcx.attention import balanced_alibi_slopes

    assert swat(8).to_dict() == {"type": "swat", "window": 8}
    m = swat(8, alibi_slopes=[0.5, -0.5])
    assert m.alibi_slopes == (0.5, -0.5) and m.to_dict() == {"type": "swat", "window": 8, "alibi_slopes": [0.5, -0.5]}
    assert method_from_dict(m.to_dict()) == m and hash(m) == hash(method_from_dict(m.to_dict()))
    assert swat(8).for_heads(4) == swat(8, alibi_slopes=balanced_alibi_slopes(4))
    assert swat(8).cache_window == (0, 8) and not swat(8).needs_unrotated_keys
    assert swat(8).supports("blockwise") is None and "softmax-only" in swat(8).supports("flash")


def test_swat_on_a_softmax_model(model64):
    """Applied to a softmax-trained tiny Llama (allowed; meaningful on models trained with it):
    it changes the model, and the engine's bounded, batched decode equals full-recompute greedy
    decoding under the same method."""
    from lcx.engine import Engine, EngineConfig, SamplingParams

    m, tok = model64
    ids = _ids(40)
    with torch.no_grad():
        plain = m(ids).logits
        with attention_patched(m, swat(6)):
            changed = m(ids).logits
            assert (changed - plain).abs().max() > 1e-2
            want = ids[0].tolist()
            for _ in range(8):  # greedy by full recompute
                want.append(int(m(torch.tensor([want])).logits[0, -1].argmax()))
    engine = Engine(m, tok, EngineConfig(methods={"attention": {"type": "swat", "window": 6}}))
    out = engine.generate([ids[0].tolist()], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == want[40:]
    assert engine.methods.kv_window is not None  # a cache of w - 1 keys (tests/engine/test_engine_attention.py)
    unpatch_attention(m)
