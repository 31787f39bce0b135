"""Every registered method on every `lcx.attention` backend a CPU call can use: `method.attend` on the
backend equals `method.attend` on the reference backend (`ref`), in float32 within twice the error
of the reference run in float32, both against the reference in float64 (`lcx.testing`). A
backend that cannot run a method's call says so (`NotImplementedError` naming why), never
computes something else. The methods are the registry's examples (`lcx.methods.examples`); each
method's own definition (its formula written out, a hand-written example) is pinned by its own
tests (tests/methods/test_attention_methods.py, test_lm_infinite_topk.py)."""

import pytest
import torch

from lcx.attention import BACKENDS, AttentionSpec, CallInfo, Rotary
from lcx.masks import causal_mask
from lcx.methods import AttentionMethod, examples, method_id
from lcx.rope import compute_inv_freq
from lcx.testing import assert_within_budget

B, H, HKV, D = 2, 4, 2, 16
SHAPES = [(1, 13), (6, 29)]  # (Tq, Tk): a decode step over 13 keys; a chunk of 6 queries after 23 keys
DEFAULT_BACKEND = "blockwise"  # AttentionMethod.attend's default: it must run every method


def _cpu_backends() -> list[str]:
    """The non-reference backends a float32 CPU call can use (Triton and the CUDA kernel need CUDA
    tensors)."""
    x = torch.zeros(1, 1, H, D)
    call = CallInfo.from_call(x, x[:, :, :HKV], x[:, :, :HKV])
    return [n for n, b in BACKENDS.items() if n != "ref" and b.supports(AttentionSpec(mask=causal_mask), call) is None]


def _cases():
    """(method, backend, Tq, Tk). flex traces every (spec, shape) anew (0.5-4 s on 2 cores): the
    default tier runs it on each method's first example and one shape, the rest is `slow`, as is
    compiled flex."""
    first = {}
    for m in examples():
        first.setdefault(m.name, m)
    for backend in _cpu_backends():
        for m in examples():
            for Tq, Tk in SHAPES:
                slow = backend == "flex_compiled" or (backend == "flex" and (m is not first[m.name] or Tq == 1))
                yield pytest.param(m, backend, Tq, Tk, id=f"{method_id(m)}-{backend}-q{Tq}k{Tk}",
                                   marks=[pytest.mark.slow] if slow else [])


def test_default_backend_is_attends_default():
    import inspect

    assert inspect.signature(AttentionMethod.attend).parameters["backend"].default == DEFAULT_BACKEND


def _grid_call(Tq, Tk):
    """The grid's float64 q, k, v and `attend` keywords for one shape."""
    g = torch.Generator().manual_seed(Tq * 100 + Tk)
    q = torch.randn(B, Tq, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Tk, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    inv_freq, _ = compute_inv_freq({"rope_type": "default", "rope_theta": 100.0}, D)
    # positions need not start at 0; an attention factor; layer 1 (every example's top-k runs there)
    return (q, k, v), dict(rotary=Rotary(inv_freq, torch.arange(Tk) + 3, 1.2), scale=0.3, layer_idx=1)


@pytest.mark.parametrize("method,backend,Tq,Tk", list(_cases()))
def test_backend_equals_reference(method, backend, Tq, Tk):
    (q, k, v), kw = _grid_call(Tq, Tk)
    f32 = [t.float() for t in (q, k, v)]
    try:
        got = method.attend(*f32, backend=backend, **kw)
    except NotImplementedError as e:
        assert f"attention backend {backend!r} cannot run" in str(e)  # refused, naming why
        assert backend != DEFAULT_BACKEND
        return
    exact = method.attend(q, k, v, backend="ref", **kw)
    ref32 = method.attend(*f32, backend="ref", **kw)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert_within_budget(got, ref32, exact, what=f"{method_id(method)} on {backend}")


def _softcap_cases():
    """(method, backend): every example on every CPU backend, one shape (6 queries after 23 keys);
    flex on each method's first example only (it traces each spec anew), compiled flex `slow`."""
    first = {}
    for m in examples():
        first.setdefault(m.name, m)
    for backend in _cpu_backends():
        for m in examples():
            slow = backend == "flex_compiled" or (backend == "flex" and m is not first[m.name])
            yield pytest.param(m, backend, id=f"{method_id(m)}-{backend}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("method,backend", list(_softcap_cases()))
def test_softcapped_backend_equals_reference(method, backend):
    """A model's attention-logit soft-capping (Gemma 2: `softcap=` of `method.attend`) on every
    logit the method forms, on every backend that can cap (the others refuse, naming why), equal
    to the reference backend's; and not vacuous: the cap changes the output."""
    Tq, Tk = 6, 29
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, Tq, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Tk, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    inv_freq, _ = compute_inv_freq({"rope_type": "default", "rope_theta": 100.0}, D)
    kw = dict(rotary=Rotary(inv_freq, torch.arange(Tk) + 3, 1.2), scale=0.3, layer_idx=1, softcap=1.5)
    f32 = [t.float() for t in (q, k, v)]
    try:
        got = method.attend(*f32, backend=backend, **kw)
    except NotImplementedError as e:
        assert backend != DEFAULT_BACKEND, e  # the default backend runs every method's calls
        assert f"attention backend {backend!r} cannot run" in str(e) and "soft" in str(e), e  # naming why
        return
    exact = method.attend(q, k, v, backend="ref", **kw)
    assert_within_budget(got, method.attend(*f32, backend="ref", **kw), exact, what=f"{method_id(method)} on {backend}")
    uncapped = method.attend(q, k, v, backend="ref", **{**kw, "softcap": None})
    one_key = method.name == "sliding_window" and method.window == 1  # a softmax over one key is 1, capped or not
    assert one_key or (exact - uncapped).abs().max() > 1e-3


# Which CPU backends refuse which registered methods (by name), on the grid's calls: pinned, so a
# backend that starts refusing what it ran (and would pass the grid above as "refused, naming
# why") fails here. The default backend refuses nothing; `flash` (the engine's default) all but SWAT.
EXPECTED_REFUSALS = {"blockwise": set(), "flash": {"swat"}, "sdpa": {"dca", "self_extend", "sinks", "string", "swat"},
                     "flex": set()}


@pytest.mark.parametrize("backend", [pytest.param(b, marks=[pytest.mark.slow] if b == "flex" else [])
                                     for b in EXPECTED_REFUSALS])
def test_which_backends_refuse_which_methods(backend):
    assert backend in _cpu_backends()
    refused = set()
    for m in examples():
        for Tq, Tk in SHAPES:
            qkv, kw = _grid_call(Tq, Tk)
            try:
                m.attend(*(t.float() for t in qkv), backend=backend, **kw)
            except NotImplementedError:
                refused.add(m.name)
    assert refused == EXPECTED_REFUSALS[backend]
