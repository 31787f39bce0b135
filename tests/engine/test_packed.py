"""The engine's oneDNN-packed linears (`lcx.engine.packed`): equal to F.linear within float32
rounding over a grid of shapes, only inside the engine's scope, repacked when the weight changes,
and the engine's greedy tokens the same with and without them."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lcx.engine import Engine, EngineConfig, SamplingParams, packed

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch has no oneDNN packed linear ops")


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 128])
@pytest.mark.parametrize("k,n,bias", [(64, 96, False), (37, 53, True), (256, 768, False)])
def test_packed_forward_matches_linear(rows, k, n, bias):
    torch.manual_seed(rows * 1000 + k)
    lin = nn.Linear(k, n, bias=bias)
    x = torch.randn(2, rows, k)
    with torch.no_grad():
        ref = F.linear(x, lin.weight, lin.bias)
        model = nn.Sequential(lin)
        assert packed.install(model, True)
        outside = lin(x)
        with packed.scope():
            inside = lin(x)
    assert torch.equal(outside, ref)  # outside the engine's scope: F.linear itself
    assert inside.shape == ref.shape
    torch.testing.assert_close(inside, ref, rtol=1e-5, atol=1e-5)
    assert (lin._lcx_packed.weight is not None) == (2 * rows >= packed.MIN_ROWS)
    packed.uninstall(model)
    assert "forward" not in lin.__dict__ and torch.equal(lin(x), ref)


def test_repacked_when_the_weight_changes():
    lin = nn.Linear(32, 48, bias=False)
    model = nn.Sequential(lin)
    packed.install(model, True)
    x = torch.randn(5, 32)
    with torch.no_grad(), packed.scope():
        a = lin(x)
        lin.weight.mul_(2.0)  # in place: the version counter moves
        b = lin(x)
        lin.load_state_dict({"weight": torch.randn(48, 32)})
        c = lin(x)
        torch.testing.assert_close(b, 2 * a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


def test_auto_and_off():
    model = nn.Sequential(nn.Linear(8, 8))
    assert not packed.install(model, False) and "forward" not in model[0].__dict__
    assert packed.install(model, None)  # tiny: auto packs
    with pytest.raises(ValueError, match="packed_linear"):
        EngineConfig(packed_linear="yes")


def test_grad_and_low_precision_stay_on_linear():
    lin = nn.Linear(16, 16)
    packed.install(nn.Sequential(lin), True)
    x = torch.randn(4, 16, requires_grad=True)
    with packed.scope():
        lin(x).sum().backward()  # autograd: F.linear (oneDNN's op has no backward here)
    assert x.grad is not None and lin._lcx_packed.weight is None
    half = nn.Linear(16, 16).to(torch.bfloat16)
    packed.install(nn.Sequential(half), True)  # not float32: not packed at all
    assert "forward" not in half.__dict__


@pytest.mark.parametrize("conc", [1, 5])
def test_engine_tokens_same_with_and_without(tiny_model, conc):
    model, tok = tiny_model
    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(11 + 13 * i)] for i in range(5)]
    sp = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=1)
    outs = {}
    for flag in (False, True):
        eng = Engine(model, tok, EngineConfig(max_batch=conc, packed_linear=flag, prefix_caching=False))
        assert eng.runner.packed is flag
        outs[flag] = eng.generate(prompts, sp)
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-4)
    assert packed.packed_bytes(model) > 0  # prefills (rows >= 2) ran packed


def test_deepcopy_rebinds_to_the_copy():
    import copy

    lin = nn.Linear(8, 8, bias=False)
    model = nn.Sequential(lin)
    packed.install(model, True)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.zero_()
        x = torch.randn(3, 8)
        assert torch.equal(twin(x), torch.zeros(3, 8))
        with packed.scope():
            assert torch.equal(twin(x), torch.zeros(3, 8))
            torch.testing.assert_close(model(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 4, 33, 97, 544])
@pytest.mark.parametrize("k,ns", [(576, (576, 192, 192)), (576, (1536, 1536)), (64, (128, 32, 32)), (40, (24, 8))])
@pytest.mark.parametrize("bias", [False, True])
def test_merged_projections_equal_the_separate_calls_bit_for_bit(rows, k, ns, bias):
    """`packed.merged` (the lean forward's q/k/v and gate/up: one GEMM over the concatenated
    weights) gives each linear's own packed output bit for bit; outside the scope, the calls
    themselves; after a weight changes, the merged copy is remade."""
    torch.manual_seed(rows + k)
    mods = [nn.Linear(k, n, bias=bias) for n in ns]
    m = nn.Module()
    for i, lin in enumerate(mods):
        m.add_module(f"l{i}", lin)
    assert packed.install(m, True)
    x = torch.randn(rows, k)
    with torch.no_grad():
        plain = packed.merged(mods, x)  # outside the scope: F.linear each
        assert all(torch.equal(a, F.linear(x, lin.weight, lin.bias)) for a, lin in zip(plain, mods))
        with packed.scope():
            got, want = packed.merged(mods, x), [lin(x) for lin in mods]
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            mods[1].weight.mul_(2)  # stale merged copy must be remade
            got = packed.merged(mods, x)
            assert all(torch.equal(a, lin(x)) for a, lin in zip(got, mods))
