"""Self-Extend (`lcx.methods.self_extend`): the two passes `attend` runs equal the dense reference
on every backend, the reference pins the grouped positions by hand, and on a model the method
changes what it should and the engine decodes it exactly. (The grids over every method,
`lcx.methods.examples`, run it too: tests/methods/test_registry.py lists them.)"""

from __future__ import annotations

import pytest
import torch

from lcx.attention import Rotary
from lcx.attention.reference import attention_ref_spec
from lcx.attention.rotary import rotate_qk
from lcx.hf.attention_patch import attention_patched
from lcx.methods import causal
from lcx.rope import RopeSpec, compute_inv_freq


def _inv_freq(D: int) -> torch.Tensor:
    return compute_inv_freq(RopeSpec.from_dict({"rope_type": "default", "rope_theta": 10000.0}), D)[0]


def _ids(T: int, seed: int = 0, B: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (B, T), generator=g)


# ------------------------------------------------------------------------------ Self-Extend
SELF_EXTEND_SHAPES = [  # (Tq, Tk, group_size, window)
    (1, 1, 2, 4), (37, 37, 4, 8), (1, 50, 3, 7), (5, 29, 2, 6), (13, 13, 4, 20), (63, 63, 1, 5), (9, 40, 5, 10),
]
SELF_EXTEND_BACKENDS = ("ref", "blockwise", "flash")


@pytest.mark.parametrize("backend", SELF_EXTEND_BACKENDS)
@pytest.mark.parametrize("Tq,Tk,G,W", SELF_EXTEND_SHAPES, ids=[f"q{a}k{b}G{c}W{d}" for a, b, c, d in SELF_EXTEND_SHAPES])
def test_self_extend_two_passes_equal_the_reference(Tq, Tk, G, W, backend):
    """SelfExtend.attend (window pass + grouped causal pass, merged by lse) == the dense definition."""
    from lcx.methods import self_extend, self_extend_ref

    g = torch.Generator().manual_seed(Tq * 100 + Tk)
    q = torch.randn(2, Tq, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, Tk, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    rot = Rotary(_inv_freq(16), torch.arange(Tk) + 3)  # positions need not start at 0
    want = self_extend_ref(q, k, v, rotary=rot, group_size=G, window=W)
    got = self_extend(G, W).attend(q, k, v, rotary=rot, backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("Tq,Tk,G,W", [(37, 37, 4, 8), (5, 29, 2, 6)], ids=["q37k37G4W8", "q5k29G2W6"])
def test_self_extend_soft_capped_equals_the_reference(Tq, Tk, G, W):
    """With a model's attention-logit soft-capping (Gemma 2) both passes cap their logits: the
    merge equals the dense definition capping the one logit each key gets (window or grouped)."""
    from lcx.methods import self_extend, self_extend_ref

    g = torch.Generator().manual_seed(Tq * 100 + Tk)
    q = torch.randn(2, Tq, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, Tk, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    rot = Rotary(_inv_freq(16), torch.arange(Tk) + 3)
    want = self_extend_ref(q, k, v, rotary=rot, group_size=G, window=W, softcap=1.5)
    got = self_extend(G, W).attend(q, k, v, rotary=rot, backend="blockwise", softcap=1.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (want - self_extend_ref(q, k, v, rotary=rot, group_size=G, window=W)).abs().max() > 1e-3


def test_self_extend_reference_pins_the_positions():
    """Hand check of the definition: G = 1 is plain causal attention; a key W or more behind the
    query scores with q at floor(p_i / G) + W - W/G and k at floor(p_j / G)."""
    from lcx.methods import self_extend_ref

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    rot = Rotary(_inv_freq(8))
    causal_out = attention_ref_spec(*rotate_qk(q, k, rot, 0), v, causal().attention_spec())
    torch.testing.assert_close(self_extend_ref(q, k, v, rotary=rot, group_size=1, window=3), causal_out)
    # query 11 (last), G = 2, W = 4: keys 8..11 true positions; keys 0..7 grouped
    out = self_extend_ref(q, k, v, rotary=rot, group_size=2, window=4)
    from lcx.rope import apply_rotary_ref, rope_cos_sin

    def rot_to(x, p):
        cos, sin = rope_cos_sin(torch.tensor(p, dtype=torch.float64), rot.inv_freq, 1.0, torch.float64)
        return apply_rotary_ref(x, cos, sin)

    qi = q[:, 11:]
    near = (rot_to(qi, [11.0]) * rot_to(k[:, 8:], list(range(8, 12)))).sum(-1)  # [1, 4, H]
    far = (rot_to(qi, [11 // 2 + 4 - 4 / 2]) * rot_to(k[:, :8], [j // 2 for j in range(8)])).sum(-1)
    p = torch.softmax(torch.cat((far, near), 1) / 8 ** 0.5, dim=1)  # [1, 12, H]
    torch.testing.assert_close(out[:, 11], torch.einsum("bkh,bkhd->bhd", p, v))


def test_self_extend_on_a_model(model64):
    """Patched into a tiny Llama: G = 1 leaves the model unchanged; G = 2 changes it and the
    engine's cached decode (unrotated keys) equals full-recompute greedy decoding."""
    from lcx.engine import Engine, EngineConfig, SamplingParams
    from lcx.methods import self_extend

    m, tok = model64
    ids = _ids(40)
    with torch.no_grad():
        plain = m(ids).logits
        with attention_patched(m, self_extend(1, 6)):
            # equal up to the float32 angles of HF's own rotary module (lcx rotates in float64)
            torch.testing.assert_close(m(ids).logits, plain, rtol=1e-5, atol=1e-5)
        with attention_patched(m, self_extend(2, 6)):
            grouped = m(ids).logits
            assert (grouped - plain).abs().max() > 1e-3
            want = ids[0].tolist()
            for _ in range(8):  # greedy by full recompute
                want.append(int(m(torch.tensor([want])).logits[0, -1].argmax()))
    engine = Engine(m, tok, EngineConfig(methods={"attention": {"type": "self_extend", "group_size": 2, "window": 6}}))
    out = engine.generate([ids[0].tolist()], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == want[40:]
    assert engine.methods.kv_window is None  # every key stays visible
    from lcx.hf.attention_patch import unpatch_attention

    unpatch_attention(m)
