"""Re-rotation kernels (Triton, CUDA C++) against `lcx.cache.rerotate.rerotate_ref`.

Where the Triton cases run:
- on a CUDA machine: directly, on GPU tensors;
- without CUDA: `test_triton_under_interpreter` re-runs this module in a subprocess with
  `TRITON_INTERPRET=1` set before anything imports triton (setting it in this process would
  turn every later Triton kernel of the session into an interpreted one), on CPU tensors.
The CUDA C++ source is compiled with nvcc for sm_80 and sm_90 whenever nvcc exists
(tests/kernels/test_cuda_kernels.py); loading and running it needs a GPU (`gpu` marker).

Tolerance (derived, not guessed): a kernel's max error against the float64 truth must be at
most twice the error of the PyTorch reference computed in the kernel's storage dtype
(float32 tables, arithmetic in that dtype), plus one float32 ulp of the data's scale.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lcx.cache.rerotate import REROTATE_BACKENDS, rerotate, rerotate_ref
from lcx.rope import ROPE_TYPES, RopeSpec, apply_rotary_ref, compute_inv_freq, rope_cos_sin

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[2]

# (B, T, H, D, rotary_dim): odd lengths, GQA-like head counts, partial rotary, one slot
SHAPES = [(1, 1, 1, 8, 8), (2, 63, 3, 64, 64), (1, 217, 2, 16, 8), (3, 5, 4, 32, 32)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DELTAS = ["small", "zero", "huge", "per-batch"]
LAYOUTS = ["btHd", "hf-view"]  # contiguous [B,T,H,D], or the HF cache's [B,H,T,D] transposed
GRID = [(s, dt, d, lay) for s in SHAPES for dt in DTYPES for d in DELTAS for lay in LAYOUTS
        if dt == torch.float32 or (d == "small" and lay == "hf-view")]


def _id(case) -> str:
    (B, T, H, D, r), dt, d, lay = case
    return f"B{B}T{T}H{H}D{D}r{r}-{str(dt).split('.')[-1]}-{d}-{lay}"


def _case(shape, dtype, delta_kind, layout, device, seed=0):
    B, T, H, D, r = shape
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, H, T, D, generator=g) if layout == "hf-view" else torch.randn(B, T, H, D, generator=g)
    k = (base.transpose(1, 2) if layout == "hf-view" else base).to(device=device, dtype=dtype)
    delta = {"small": lambda: torch.randint(-64, 65, (T,), generator=g),
             "zero": lambda: torch.zeros(T, dtype=torch.long),
             "huge": lambda: torch.randint(-10**9, 10**9, (T,), generator=g),
             "per-batch": lambda: torch.randint(-500, 500, (B, T), generator=g)}[delta_kind]()
    inv, _ = compute_inv_freq(RopeSpec(rope_theta=1e4, partial_rotary_factor=r / D), D)
    return k, delta.to(device), inv


def _lowp_ref(k, delta, inv):
    """The reference in the storage dtype: float32 tables, arithmetic in k.dtype."""
    B, T = k.shape[:2]
    d = delta.expand(B, T) if delta.dim() == 1 else delta
    cos, sin = rope_cos_sin(d.cpu(), inv, 1.0, torch.float32)
    return apply_rotary_ref(k.cpu(), cos.to(k.dtype), sin.to(k.dtype))


def _check(kernel, k, delta, inv):
    truth = rerotate_ref(k.cpu().double(), delta.cpu(), inv)
    lowp_err = (_lowp_ref(k, delta, inv).double() - truth).abs().max().item()
    tol = 2 * lowp_err + torch.finfo(torch.float32).eps * truth.abs().max().item()
    # out-of-place into a NaN-poisoned buffer: every element must be written
    out = torch.full_like(k, float("nan"))
    k_before = k.clone()
    kernel(k, delta, inv, out=out)
    assert not out.isnan().any(), "kernel left elements unwritten"
    assert torch.equal(k, k_before), "out-of-place call modified its input"
    err = (out.cpu().double() - truth).abs().max().item()
    assert err <= tol, f"out-of-place error {err:.3g} > tol {tol:.3g} (low-precision reference {lowp_err:.3g})"
    # in place, through whatever strides k has
    res = kernel(k, delta, inv)
    assert res.data_ptr() == k.data_ptr()
    err = (k.cpu().double() - truth).abs().max().item()
    assert err <= tol, f"in-place error {err:.3g} > tol {tol:.3g}"


def _triton_device() -> str | None:
    if INTERPRET:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


def _skip_unless_triton():
    pytest.importorskip("triton")
    if _triton_device() is None:
        pytest.skip("no CUDA: run by test_triton_under_interpreter in a TRITON_INTERPRET=1 subprocess")


# ----------------------------------------------------------------------------- reference
def test_ref_rotates_in_place_and_out_of_place():
    k, delta, inv = _case((2, 9, 3, 16, 16), torch.float32, "small", "hf-view", "cpu")
    out = torch.full_like(k, float("nan"))
    rerotate_ref(k, delta, inv, out=out)
    k2 = k.clone()
    assert rerotate_ref(k2, delta, inv) is k2
    torch.testing.assert_close(k2, out, rtol=0, atol=0)
    # inverse: rotating back by -delta restores the input
    torch.testing.assert_close(rerotate_ref(k2, -delta, inv), k, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (dict(delta=torch.zeros(9)), "integer"),
    (dict(delta=torch.zeros(8, dtype=torch.long)), r"\[T\]"),
    (dict(inv=torch.ones(9, dtype=torch.float64)), "inv_freq"),
    (dict(k=torch.zeros(9, 3, 16)), r"\[B, T, H, D\]"),
])
def test_ref_rejects_bad_arguments(bad, match):
    args = dict(k=torch.zeros(1, 9, 3, 16), delta=torch.zeros(9, dtype=torch.long),
                inv=torch.ones(8, dtype=torch.float64))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        rerotate_ref(args["k"], args["delta"], args["inv"])


def test_dispatch_refuses_unsupported_backend_calls():
    k = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="unknown rerotate backend"):
        rerotate(k, torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.float64), backend="nope")
    with pytest.raises(ValueError, match="cuda"):
        rerotate(k, torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.float64), backend="cuda")
    assert set(REROTATE_BACKENDS) == {"ref", "triton", "cuda"}


# ----------------------------------------------------------------------------- triton
@pytest.mark.parametrize("case", GRID, ids=[_id(c) for c in GRID])
def test_triton_matches_ref(case):
    _skip_unless_triton()
    from lcx.kernels.triton.rerotate import rerotate_triton

    _check(rerotate_triton, *_case(*case, device=_triton_device()))


@pytest.mark.parametrize("rope_type", sorted(ROPE_TYPES))
def test_triton_every_rope_basis(rope_type):
    """Every registry type's basis (truncate has zero frequencies, longrope per-dim factors)."""
    _skip_unless_triton()
    from lcx.kernels.triton.rerotate import rerotate_triton

    entry = ROPE_TYPES[rope_type]
    params = {"factor": 4.0, "original_max_position_embeddings": 64,
              "short_factor": [1.0 + 0.1 * i for i in range(16)], "long_factor": [1.0 + 2.0 * i for i in range(16)]}
    spec = RopeSpec(rope_type=rope_type, rope_theta=5e5, **{k: params[k] for k in entry.required},
                    **({"truncate_length": 32.0} if rope_type == "truncate" else {}))
    inv, _ = compute_inv_freq(spec, 32, 4 * 64)
    k, delta, _ = _case((1, 33, 3, 32, 32), torch.float32, "small", "hf-view", _triton_device())
    _check(rerotate_triton, k, delta, inv)


def test_triton_small_block_many_programs():
    """A grid of many programs (block_t=1 and 4), tails included."""
    _skip_unless_triton()
    from lcx.kernels.triton.rerotate import rerotate_triton

    k, delta, inv = _case((2, 11, 3, 16, 16), torch.float32, "small", "hf-view", _triton_device())
    for bt in (1, 4):
        out = torch.full_like(k, float("nan"))
        rerotate_triton(k, delta, inv, out=out, block_t=bt)
        torch.testing.assert_close(out.cpu(), rerotate_ref(k.cpu().clone(), delta.cpu(), inv), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_triton_under_interpreter():
    """Run this module's Triton cases on CPU under TRITON_INTERPRET=1, in a fresh process."""
    if INTERPRET:
        pytest.skip("already inside the interpreter subprocess")
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the Triton cases run on the GPU directly")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "-k", "triton and not under_interpreter", __file__],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = [line for line in proc.stdout.splitlines() if line.strip()][-1]
    assert " passed" in summary and "skipped" not in summary, proc.stdout[-2000:]


# ----------------------------------------------------------------------------- CUDA C++
# The nvcc compile check of rerotate.cu (sm_80, sm_90) lives in tests/kernels/test_cuda_kernels.py,
# parametrized over every kernels/cuda/*.cu.


def test_cuda_sources_ship_with_the_package():
    from lcx.kernels.cuda import CUDA_SOURCES

    for src in CUDA_SOURCES:
        assert src.is_file(), src


@pytest.mark.gpu
@pytest.mark.parametrize("case", GRID, ids=[_id(c) for c in GRID])
def test_cuda_extension_matches_ref(case):
    from lcx.kernels.cuda import rerotate_cuda

    _check(rerotate_cuda, *_case(*case, device="cuda"))
