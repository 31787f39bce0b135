"""`lcx.kernels.cpu.causal_attention_cpu` (C++: causal / sliding-window float32 attention of a
row's newest queries, flash-style blocks of 64 keys, AVX-512 register tiles where built for it)
against float64 attention with the same mask: within `lcx.testing`'s budget (2x the float32
reference's error) on a grid of odd lengths, GQA, head dims that are and are not multiples of
16, windows and logit caps; both the build for this CPU and the portable one; strided inputs;
named errors for bad input."""

import shutil

import pytest
import torch

from lcx.kernels.cpu.causal_attention import causal_attention_cpu, unavailable
from lcx.testing import assert_within_budget

_TOOLCHAIN = shutil.which("c++") is not None and shutil.which("ninja") is not None
pytestmark = pytest.mark.skipif(not _TOOLCHAIN, reason="no C++ compiler or ninja: the extension cannot build")

SHAPES = [(1, 1), (1, 37), (7, 7), (33, 33), (5, 130), (65, 65), (97, 161), (130, 200)]  # (nq, n)
HEADS = [(4, 2), (9, 3), (3, 3), (6, 1)]
DIMS = [(64, 64), (32, 32), (40, 40), (128, 128), (24, 48)]  # (D, Dv): 40 and 24 take the generic tiles


def reference(q, k, v, scale, window=None, softcap=None):
    """float-any attention of the newest nq of n keys with an explicit [nq, n] mask."""
    nq, n, H, Hkv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    kk, vv = k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(nq)[:, None] + n - nq
    j = torch.arange(n)[None]
    visible = (j <= i) & ((j > i - window) if window else True)
    return torch.einsum("bhij,bjhd->bihd", s.masked_fill(~visible, float("-inf")).softmax(-1), vv)


def _check(nq, n, H, Hkv, D, Dv, *, b=2, window=None, softcap=None, target=None, seed=0):
    g = torch.Generator().manual_seed(seed + 7 * nq + n + H + D)
    q = torch.randn(b, nq, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, Hkv, Dv, generator=g, dtype=torch.float64)
    scale = D ** -0.5 * 1.7  # sharper than default: larger softmax dynamic range
    exact = reference(q, k, v, scale, window, softcap)
    lowp = reference(q.float(), k.float(), v.float(), scale, window, softcap)
    got = causal_attention_cpu(q.float(), k.float(), v.float(), scale, window, softcap, target=target)
    assert got.shape == (b, nq, H, Dv) and got.dtype == torch.float32
    assert_within_budget(got, lowp, exact, what=f"nq={nq} n={n} heads={H}/{Hkv} D={D}/{Dv} w={window} cap={softcap}")


def test_builds_where_a_toolchain_exists():
    assert unavailable() is None


@pytest.mark.parametrize("nq,n", SHAPES)
@pytest.mark.parametrize("H,Hkv", HEADS)
def test_causal_grid(nq, n, H, Hkv):
    _check(nq, n, H, Hkv, 64, 64)


@pytest.mark.parametrize("D,Dv", DIMS)
@pytest.mark.parametrize("nq,n", [(1, 19), (33, 70), (97, 161)])
def test_head_dims(D, Dv, nq, n):
    _check(nq, n, 4, 2, D, Dv)


@pytest.mark.parametrize("window", [1, 5, 64, 100])
@pytest.mark.parametrize("nq,n", [(1, 130), (40, 40), (97, 161)])
def test_sliding_window(window, nq, n):
    _check(nq, n, 4, 2, 64, 64, window=window)


@pytest.mark.parametrize("nq,n", [(1, 50), (70, 70), (33, 101)])
def test_softcap(nq, n):
    _check(nq, n, 4, 2, 64, 64, softcap=5.0)
    _check(nq, n, 4, 2, 64, 64, softcap=5.0, window=17)


@pytest.mark.slow  # a second build of the extension (~30 s)
@pytest.mark.parametrize("nq,n", [(1, 37), (33, 33), (97, 161)])
@pytest.mark.parametrize("D,Dv", [(64, 64), (40, 40)])
def test_portable_build(nq, n, D, Dv):
    """The build without ISA flags (what a CPU without AVX-512/AVX2 runs) is exact the same way."""
    _check(nq, n, 9, 3, D, Dv, target="portable", window=None)
    _check(nq, n, 9, 3, D, Dv, target="portable", window=9, softcap=4.0)


def test_strided_inputs_and_a_large_row():
    """Views with gaps (a row's newest queries sliced from a longer step, keys [b, n, Hkv, D]
    transposed from [b, Hkv, n, D]) read as the contiguous copies do, and rows past several
    query blocks and key blocks (flash rescaling across 64-key blocks) stay within budget."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 300, 9, 64, generator=g)
    k = torch.randn(2, 3, 333, 64, generator=g).transpose(1, 2)
    v = torch.randn(2, 3, 333, 64, generator=g).transpose(1, 2)
    a = causal_attention_cpu(q[:, 43:], k, v)
    b = causal_attention_cpu(q[:, 43:].contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(a, b)
    _check(300, 333, 9, 3, 64, 64, b=1)


def test_bad_input_is_named():
    x = torch.randn(1, 4, 2, 16)
    with pytest.raises(RuntimeError, match="float32"):
        causal_attention_cpu(x.double(), x.double(), x.double())
    with pytest.raises(RuntimeError, match="more queries than keys"):
        causal_attention_cpu(x, x[:, :2], x[:, :2])
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        causal_attention_cpu(torch.randn(1, 4, 3, 16), x, x)
    with pytest.raises(ValueError, match="window"):
        causal_attention_cpu(x, x, x, window=0)
    with pytest.raises(ValueError, match="softcap"):
        causal_attention_cpu(x, x, x, softcap=-1.0)


# ------------------------------------------------------------------------------------ decode step
def _decode_reference(q, k, v, visible, scale, softcap=None):
    H, Hkv = q.shape[2], k.shape[1]
    kk, vv = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)  # [B, H, C, D]
    s = torch.einsum("bhd,bhcd->bhc", q[:, 0], kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p = s.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhc,bhcd->bhd", p, vv)[:, None]


@pytest.mark.parametrize("B,C", [(1, 1), (3, 37), (5, 70), (2, 300)])
@pytest.mark.parametrize("H,Hkv,D,Dv", [(4, 2, 64, 64), (9, 3, 64, 64), (6, 1, 40, 40), (4, 4, 32, 48)])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_decode_step_grid(B, C, H, Hkv, D, Dv, softcap):
    """Slots with holes (a compressed or windowed store) and invisible tails; every row sees at
    least one slot (the engine never decodes a row without keys)."""
    from lcx.kernels.cpu.causal_attention import decode_attention_cpu

    g = torch.Generator().manual_seed(B * 100 + C + H + D)
    q = torch.randn(B, 1, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, C, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, C, Dv, generator=g, dtype=torch.float64)
    visible = torch.rand(B, C, generator=g) < 0.7
    visible[:, 0] = True
    if C > 4:
        visible[0, -4:] = False
    scale = D ** -0.5 * 1.7
    exact = _decode_reference(q, k, v, visible, scale, softcap)
    lowp = _decode_reference(q.float(), k.float(), v.float(), visible, scale, softcap)
    got = decode_attention_cpu(q.float(), k.float(), v.float(), visible, scale, softcap)
    assert got.shape == (B, 1, H, Dv)
    assert_within_budget(got, lowp, exact, what=f"decode B={B} C={C} heads={H}/{Hkv} D={D}/{Dv} cap={softcap}")


def test_decode_step_is_what_the_engine_runs(monkeypatch):
    """`decode_attention` without a side branch runs the kernel in float32 on the CPU, and equals
    its torch path (LCX_NATIVE_ROWS=0) within float32 error; a row with no visible slot is zeros."""
    from lcx.engine.decode_step import decode_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(4, 1, 9, 64, generator=g), torch.randn(4, 3, 90, 64, generator=g), torch.randn(4, 3, 90, 64, generator=g)
    visible = torch.rand(4, 90, generator=g) < 0.6
    native = decode_attention(q, k, v, visible)
    monkeypatch.setenv("LCX_NATIVE_ROWS", "0")
    torch_path = decode_attention(q, k, v, visible)
    assert (native - torch_path).abs().max() < 1e-5
    from lcx.kernels.cpu.causal_attention import decode_attention_cpu

    visible[1] = False
    assert torch.equal(decode_attention_cpu(q, k, v, visible)[1], torch.zeros(1, 9, 64))
