"""CUDA C++ kernels: every `kernels/cuda/*.cu` compiles (sm_80, sm_90); the Λ-decode kernel
(attention backend "cuda") against the reference.

Where things run:
- compile checks: wherever nvcc exists (default suite); the torch bindings are syntax-checked
  against torch's headers with g++ (`slow`: ~20 s each);
- CPU (default suite): `lambda_decode.cu` itself compiled with g++ against a host emulation of
  the CUDA built-ins (tests/kernels/cuda_emu) and run on CPU threads over a small grid; the backend's
  `supports` refusals, the key ranges it derives from each
  mask (against `mask_matrix`), and the kernel's algebra (keys rotated through
  `k . R(-p) y`, the capped query, split-K merge) mirrored in PyTorch from the same
  `decode_tables` against `lambda_attention_ref`;
- GPU (`gpu` marker): the extension itself over the grid below, outputs NaN-poisoned,
  tolerance from `lcx.testing` (at most twice the float64 error of the reference run in the
  kernel's dtype), plus "bounded == full": the last row of full-sequence Λ attention equals
  the kernel on the compressed cache with true positions.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lcx.attention import BACKENDS, AttentionSpec, Rotary, attention, attention_ref_spec
from lcx.attention.cuda_backend import decode_keys
from lcx.kernels.cuda import CU_FILES, NVCC_ARCHS
from lcx.kernels.cuda.lambda_decode import decode_tables, default_splits, heads_per_block
from lcx.masks import attention_sinks, causal_mask, lambda_mask, mask_matrix, sliding_window
from lcx.rope import RopeSpec, compute_inv_freq
from lcx.testing import assert_within_budget, poison_

NVCC = shutil.which("nvcc")
ROOT = Path(__file__).resolve().parents[2]

# (B, Tk, H, Hkv, D): odd lengths, GQA groups 1/2/3/4/8, head dims 32/64/128/256
SHAPES = [(1, 1, 1, 1, 64), (2, 217, 4, 2, 64), (1, 4161, 8, 1, 128), (3, 63, 6, 2, 128),
          (2, 1000, 16, 2, 128), (1, 333, 4, 4, 32), (1, 129, 2, 1, 256)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# spec factories: (name, n_keys -> AttentionSpec)
SPECS = {
    "lm_infinite": lambda: AttentionSpec.lm_infinite(n_global=5, n_local=40),
    "lm_infinite_cap7": lambda: AttentionSpec.lm_infinite(n_global=3, n_local=17, limit_distance=7),
    "causal": lambda: AttentionSpec(mask=causal_mask),
    "window": lambda: AttentionSpec(mask=sliding_window(left=30)),
    "sinks": lambda: AttentionSpec(mask=attention_sinks(4, 25)),
    "full": lambda: AttentionSpec(mask=None),
}
POSITIONS = ["arange", "bounded", "per-batch"]  # key positions handed to Rotary
GRID = [(s, dt, sp, pos) for s in SHAPES for dt in DTYPES for sp in SPECS for pos in POSITIONS
        if (dt == torch.float32 or sp in ("lm_infinite", "window")) and (pos == "arange" or sp == "lm_infinite")]


def _id(case) -> str:
    (B, Tk, H, Hkv, D), dt, sp, pos = case
    return f"B{B}Tk{Tk}H{H}kv{Hkv}D{D}-{str(dt).split('.')[-1]}-{sp}-{pos}"


def _positions(kind: str, B: int, Tk: int) -> torch.Tensor:
    """True key positions: 0..Tk-1; a bounded cache's [first 5 | run ending at 10^6]; per row."""
    if kind == "arange":
        return torch.arange(Tk)
    if kind == "bounded":
        first = torch.arange(min(5, Tk))
        return torch.cat((first, torch.arange(10**6 - (Tk - first.numel()) + 1, 10**6 + 1)))
    base = torch.arange(Tk)
    return torch.stack([base + 1000 * b for b in range(B)])  # [B, Tk]


def _case(shape, dtype, pos_kind, device, seed=0):
    B, Tk, H, Hkv, D = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, D, generator=g)
    k = torch.randn(B, Tk, Hkv, D, generator=g)
    v = torch.randn(B, Tk, Hkv, D, generator=g)
    inv, af = compute_inv_freq(RopeSpec(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                        original_max_position_embeddings=64), D, 256)
    rot = Rotary(inv, _positions(pos_kind, B, Tk).to(device), af)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], rot


# ----------------------------------------------------------------------------- compile checks
@pytest.mark.slow  # ~20-30 s per (file, arch) on 2 cores
@pytest.mark.parametrize("arch", NVCC_ARCHS)
@pytest.mark.parametrize("cu", CU_FILES, ids=[p.stem for p in CU_FILES])
def test_cuda_source_compiles_with_nvcc(cu, arch, tmp_path):
    """Every .cu alone, as the CI step does: `nvcc -arch=sm_XX -O3 -c`. Skipped without nvcc,
    unless LCX_REQUIRE_NVCC=1 (a CI machine that must check them) turns that into a failure."""
    if NVCC is None:
        if os.environ.get("LCX_REQUIRE_NVCC") == "1":
            pytest.fail("nvcc not found and LCX_REQUIRE_NVCC=1")
        pytest.skip("nvcc not found")
    obj = tmp_path / f"{cu.stem}_{arch}.o"
    proc = subprocess.run([NVCC, f"-arch={arch}", "-O3", "-c", str(cu), "-o", str(obj)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    blob = obj.read_bytes()
    assert f"-arch {arch}".encode() in blob, "object has no SASS for the arch"
    assert f"lcx_{cu.stem}_launch".encode() in blob, "the extern \"C\" launcher is missing"


def test_every_cu_has_a_binding_and_ships():
    assert {p.stem for p in CU_FILES} >= {"rerotate", "lambda_decode"}
    for cu in CU_FILES:
        assert (cu.parent / f"{cu.stem}_binding.cpp").is_file(), cu
        assert (cu.parent / f"{cu.stem}.py").is_file(), cu


def _cuda_include() -> str | None:
    for cand in [os.environ.get("CUDA_HOME", ""), *sorted(glob.glob("/usr/local/cuda*"))]:
        if cand and (Path(cand) / "include" / "cuda_runtime.h").is_file():
            return str(Path(cand) / "include")
    return None


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or _cuda_include() is None, reason="needs g++ and CUDA headers")
@pytest.mark.parametrize("cu", CU_FILES, ids=[p.stem for p in CU_FILES])
def test_binding_compiles_against_torch_headers(cu, tmp_path):
    """`g++ -fsyntax-only` on the torch binding. A CPU wheel of torch lacks the one
    cmake-generated header c10/cuda/impl/cuda_cmake_macros.h; an empty one stands in for it."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    shim = tmp_path / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("")
    incs = [str(tmp_path), *include_paths(), _cuda_include(), sysconfig.get_paths()["include"], str(cu.parent)]
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=lcx_check",
           *[f"-I{i}" for i in incs], str(cu.parent / f"{cu.stem}_binding.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


# ----------------------------------------------------------------------------- backend contract (CPU)
def test_backend_registered_and_import_compiles_nothing():
    assert "cuda" in BACKENDS
    proc = subprocess.run(
        ["python", "-c", "import sys, lcx.attention; "
         "assert 'torch.utils.cpp_extension' not in sys.modules, 'extension machinery imported'"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("spec,kw,match", [
    (AttentionSpec(mask=causal_mask), {}, "CUDA tensors"),
    (AttentionSpec(mask=causal_mask, activation="sigmoid"), {}, "softmax-only"),
    (AttentionSpec(mask=causal_mask, alibi_slopes=(0.5, 0.25)), {}, "ALiBi"),
    (AttentionSpec.lm_infinite(2, 3), {"Tq": 3}, "CUDA tensors"),
], ids=["cpu", "sigmoid", "alibi", "cpu-lambda-prefill"])
def test_supports_names_the_reason(spec, kw, match):
    Tq = kw.get("Tq", 1)
    q, k = torch.zeros(1, Tq, 2, 64), torch.zeros(1, 9, 2, 64)
    rot = Rotary(torch.ones(32, dtype=torch.float64)) if spec.lambda_params else None
    with pytest.raises(NotImplementedError, match=match):
        attention(q, k, k, spec, backend="cuda", rotary=rot)


def test_supports_checks_call_facts():
    from lcx.attention.spec import CallInfo

    sup = BACKENDS["cuda"].supports
    spec = AttentionSpec.lm_infinite(2, 8)
    base = dict(device_type="cuda", dtype=torch.bfloat16, requires_grad=False, return_lse=True, n_heads=8,
                n_kv_heads=2, head_dim=128, n_queries=1, n_keys=100, q_offset=99, rotary=True)
    assert sup(spec, None) is None
    assert sup(spec, CallInfo(**base)) is None
    for change, match in [({"n_queries": 5}, "one query token"), ({"requires_grad": True}, "backward"),
                          ({"dtype": torch.float64}, "float64"), ({"head_dim": 48}, "head dims"),
                          ({"device_type": "cpu"}, "CUDA")]:
        reason = sup(spec, CallInfo(**{**base, **change}))
        assert reason is not None and match in reason, (change, reason)
    odd = AttentionSpec(mask=lambda_mask(2, 3))
    object.__setattr__(odd, "mask", lambda b, h, q, k: k <= q)  # an unnamed mask_mod
    assert "not causal" in sup(odd, None)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("Tk", [1, 2, 7, 41, 45, 200])
def test_decode_keys_match_the_mask(name, Tk):
    """The kernel reads [0, g_hi) + [w_lo, w_hi): exactly the mask's visible keys of the query."""
    spec = SPECS[name]()
    for i in sorted({0, Tk // 2, Tk - 1}):
        keys = decode_keys(spec, Tk, i)
        keys.check(Tk)
        got = torch.zeros(Tk, dtype=torch.bool)
        got[: keys.g_hi] = True
        got[keys.w_lo: keys.w_hi] = True
        want = mask_matrix(spec.mask, 1, Tk, q_offset=i)[0] if spec.mask is not None else torch.ones(Tk, dtype=torch.bool)
        assert torch.equal(got, want), (i, keys)
        lp = spec.lambda_params
        if lp is not None:  # capped keys are exactly Λ's global branch: j < G and i - j >= L
            j = torch.arange(Tk)
            glob = (j < lp.n_global) & (i - j >= lp.n_local)
            assert keys.capped and torch.equal(j < keys.g_hi, glob)


def test_splits_and_head_tiles():
    assert [heads_per_block(h, kv) for h, kv in [(8, 1), (8, 2), (6, 2), (12, 4), (5, 5), (32, 2)]] == [8, 4, 1, 1, 1, 8]
    assert default_splits(1, 32, 8, 4160, 132) == 65  # 4 head tiles, ~2 blocks per SM: 66 -> capped by keys/64
    assert default_splits(64, 32, 8, 4160, 132) == 2
    assert default_splits(1, 8, 8, 10, 132) == 1


def _mirror(q, k, v, spec, rot, n_splits):
    """The kernel's arithmetic in float64 PyTorch, from the same tables and key ranges (test-only)."""
    B, _, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    off = Tk - 1
    lp = spec.lambda_params
    tabs = decode_tables(rot.inv_freq, rot.key_positions(Tk, q.device), off,
                         lp.effective_limit(Tk) if lp else 0, rot.attention_factor)
    keys = decode_keys(spec, Tk, off)
    half = tabs.kcos.shape[-1]
    sc = 1.0 / D ** 0.5
    qt = tabs.qtab.double().expand(B, 4, half)
    x = q[:, 0].double()  # [B, H, D]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    c, s = qt[:, 0, None], qt[:, 1, None]  # [B, 1, half]
    y = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]), -1) * sc  # qa
    yj = torch.cat((y[..., half:2 * half], -y[..., :half], torch.zeros_like(x[..., 2 * half:])), -1)  # qb
    cc, cs = qt[:, 2, None], qt[:, 3, None]
    yg = torch.cat((x1 * cc - x2 * cs, x2 * cc + x1 * cs, x[..., 2 * half:]), -1) * sc  # qg
    idx = torch.cat((torch.arange(keys.g_hi), torch.arange(keys.w_lo, keys.w_hi)))
    kk = k[:, idx].double().repeat_interleave(H // Hkv, dim=2)  # [B, n, H, D]
    vv = v[:, idx].double().repeat_interleave(H // Hkv, dim=2)
    kc = tabs.kcos.double().expand(B, Tk, half)[:, idx]  # [B, n, half]
    ks = tabs.ksin.double().expand(B, Tk, half)[:, idx]
    pad = torch.ones(B, idx.numel(), D - 2 * half, dtype=torch.float64)
    ccoef = torch.cat((kc, kc, pad), -1)[:, :, None]  # [B, n, 1, D]
    scoef = torch.cat((ks, ks, 0 * pad), -1)[:, :, None]
    s_loc = (kk * ccoef * y[:, None]).sum(-1) + (kk * scoef * yj[:, None]).sum(-1)  # [B, n, H]
    s_glob = (kk * yg[:, None]).sum(-1)
    is_glob = (torch.arange(idx.numel()) < keys.g_hi) & keys.capped
    s_all = torch.where(is_glob[None, :, None], s_glob, s_loc)
    # split-K: normalised partials per chunk, merged by their lse
    chunk = -(-idx.numel() // n_splits)
    outs, lses = [], []
    for c0 in range(0, idx.numel(), chunk):
        sc_ = s_all[:, c0:c0 + chunk]
        lse = torch.logsumexp(sc_, dim=1)  # [B, H]
        outs.append(torch.einsum("bnh,bnhd->bhd", (sc_ - lse[:, None]).exp(), vv[:, c0:c0 + chunk]))
        lses.append(lse)
    lse = torch.logsumexp(torch.stack(lses), 0)
    out = sum(o * (l_ - lse).exp()[..., None] for o, l_ in zip(outs, lses))
    return out[:, None], lse[..., None]


@pytest.mark.parametrize("name", ["lm_infinite", "lm_infinite_cap7", "window", "sinks", "causal"])
@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("partial", [False, True], ids=["full-rotary", "partial-rotary"])
def test_kernel_algebra_matches_reference(name, pos, partial):
    """The coefficient form k . (c y + s yJ), the a^2-capped query and the split merge, in float64
    (a sign or pairing slip gives O(1) errors; the float32 tables give ~1e-7)."""
    (q, k, v), rot = _case((2, 61, 4, 2, 32), torch.float64, pos, "cpu")
    if partial:
        rot = Rotary(rot.inv_freq[:10], rot.positions, rot.attention_factor)  # rotary dim 20 of 32
    spec = SPECS[name]()
    want, want_lse = attention_ref_spec(q, k, v, spec, rotary=rot, return_lse=True)
    for n_splits in (1, 3, 61):
        out, lse = _mirror(q, k, v, spec, rot, n_splits)
        # float32 tables (float64 angles rounded once): ~1e-7 relative, not float64's 1e-16
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the .cu on CPU threads
# lambda_decode.cu itself, compiled with g++ against tests/kernels/cuda_emu/include (a host emulation of
# the CUDA built-ins it uses: one std::thread per CUDA thread, barriers for __syncthreads and warp
# shuffles) and called through its extern "C" launcher with ctypes. This runs the real indexing,
# shuffles, shared-memory merge and split-K combine without a GPU; what it cannot show is
# GPU-specific (memory model, alignment faults, speed) - the `gpu` tests below cover that.
EMU_INCLUDE = ROOT / "tests" / "kernels" / "cuda_emu" / "include"
EMU_GRID = [  # (B, Tk, H, Hkv, D), dtype, spec, positions, n_splits
    ((2, 61, 4, 2, 32), torch.float32, "lm_infinite", "bounded", 3),
    ((1, 45, 8, 1, 64), torch.bfloat16, "lm_infinite_cap7", "per-batch", 1),
    ((2, 37, 6, 2, 128), torch.float16, "window", "arange", 2),
    ((1, 50, 2, 2, 32), torch.bfloat16, "sinks", "arange", 4),
    ((3, 1, 2, 1, 64), torch.float32, "causal", "arange", 1),
    ((1, 70, 4, 1, 256), torch.float32, "lm_infinite", "bounded", 2),
    ((1, 29, 2, 1, 32), torch.float16, "full", "arange", 29),
]


def _ctypes_args():
    import ctypes as C

    p, i64 = C.c_void_p, C.c_int64
    fields = [("q", p), ("k", p), ("v", p), ("q_sb", i64), ("q_sh", i64), ("k_sb", i64), ("k_st", i64),
              ("k_sh", i64), ("v_sb", i64), ("v_st", i64), ("v_sh", i64), ("out", p), ("lse", p),
              ("o_sb", i64), ("o_sh", i64), ("lse_sb", i64), ("lse_sh", i64), ("ws_o", p), ("ws_lse", p),
              ("kcos", p), ("ksin", p), ("qtab", p), ("tab_sb", i64), ("qtab_sb", i64), ("B", i64), ("H", i64),
              ("Hkv", i64), ("Tk", i64), ("half", i64), ("g_hi", i64), ("w_lo", i64), ("w_hi", i64),
              ("capped", C.c_int), ("scale_log2", C.c_float), ("n_splits", i64), ("chunk", i64)]
    # the header is the contract: every field, in order
    header = (ROOT / "kernels" / "cuda" / "lambda_decode.h").read_text()
    body = header[header.index("struct LcxLambdaDecodeArgs {"):header.index("};")]
    import re

    declared = re.findall(r"\b(\w+)(?=[,;])", re.sub(r"//[^\n]*", "", body))
    assert declared == [f for f, _ in fields], declared
    return type("LcxLambdaDecodeArgs", (C.Structure,), {"_fields_": fields})


@pytest.fixture(scope="module")
def emulated_lib(tmp_path_factory):
    import ctypes

    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    so = tmp_path_factory.mktemp("emu") / "lambda_decode_emu.so"
    cu = ROOT / "kernels" / "cuda" / "lambda_decode.cu"
    proc = subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", f"-I{EMU_INCLUDE}",
                           "-x", "c++", str(cu), "-o", str(so)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lib = ctypes.CDLL(str(so))
    lib.lcx_lambda_decode_launch.restype = ctypes.c_int
    return lib, _ctypes_args()


def _emulated_decode(emu, q, k, v, keys, scale, tables, n_splits):
    """What lambda_decode_binding.cpp does, with CPU tensors: outputs poisoned, workspace, args."""
    import ctypes

    from lcx.kernels.cuda.lambda_decode import LOG2E, heads_per_block

    lib, Args = emu
    B, _, H, D = q.shape
    out, lse = poison_(torch.empty_like(q)), poison_(torch.empty(B, H, 1))
    ws_o, ws_lse = poison_(torch.empty(B, H, n_splits, D)), poison_(torch.empty(B, H, n_splits))
    n_vis = keys.n_visible
    a = Args(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), q_sb=q.stride(0), q_sh=q.stride(2),
             k_sb=k.stride(0), k_st=k.stride(1), k_sh=k.stride(2), v_sb=v.stride(0), v_st=v.stride(1),
             v_sh=v.stride(2), out=out.data_ptr(), lse=lse.data_ptr(), o_sb=out.stride(0), o_sh=out.stride(2),
             lse_sb=lse.stride(0), lse_sh=lse.stride(1), ws_o=ws_o.data_ptr(), ws_lse=ws_lse.data_ptr(),
             B=B, H=H, Hkv=k.shape[2], Tk=k.shape[1], g_hi=keys.g_hi, w_lo=keys.w_lo, w_hi=keys.w_hi,
             capped=int(keys.capped), scale_log2=scale * LOG2E, n_splits=n_splits,
             chunk=max(1, -(-n_vis // n_splits)))
    if tables is not None:
        bt = tables.kcos.shape[0]
        a.kcos, a.ksin, a.qtab = tables.kcos.data_ptr(), tables.ksin.data_ptr(), tables.qtab.data_ptr()
        a.half = tables.kcos.shape[-1]
        a.tab_sb = 0 if bt == 1 else k.shape[1] * a.half
        a.qtab_sb = 0 if bt == 1 else 4 * a.half
    dtype = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[q.dtype]
    err = lib.lcx_lambda_decode_launch(dtype, D, heads_per_block(H, k.shape[2]), ctypes.byref(a), None)
    assert err == 0, f"launcher refused the arguments ({err})"
    return out, lse


@pytest.mark.parametrize("case", EMU_GRID, ids=[f"{_id(c[:4])}-S{c[4]}" for c in EMU_GRID])
def test_cu_source_on_emulated_threads_matches_ref(case, emulated_lib):
    shape, dtype, name, pos, n_splits = case
    (q, k, v), rot = _case(shape, dtype, pos, "cpu")
    spec = SPECS[name]()
    Tk, D = k.shape[1], q.shape[-1]
    lp = spec.lambda_params
    tables = decode_tables(rot.inv_freq, rot.key_positions(Tk, q.device), Tk - 1,
                           lp.effective_limit(Tk) if lp else 0, rot.attention_factor)
    out, lse = _emulated_decode(emulated_lib, q, k, v, decode_keys(spec, Tk, Tk - 1), D ** -0.5, tables,
                                min(n_splits, decode_keys(spec, Tk, Tk - 1).n_visible))
    assert not out.isnan().any() and not lse.isnan().any(), "kernel left elements unwritten"
    exact, exact_lse = attention_ref_spec(*(t.double() for t in (q, k, v)), spec, rotary=rot, return_lse=True)
    lowp, lowp_lse = attention_ref_spec(q, k, v, spec, rotary=rot, return_lse=True)
    assert_within_budget(out, lowp, exact)
    assert_within_budget(lse, lowp_lse, exact_lse, what="lse", precision=q.dtype)


def test_cu_source_on_emulated_threads_hf_layout_and_no_rotary(emulated_lib):
    """Keys as the transposed view of an HF cache [B, Hkv, T, D]; no tables (pre-rotated keys)."""
    (q, k, v), _ = _case((2, 40, 4, 2, 64), torch.float32, "arange", "cpu")
    k_hf, v_hf = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    spec = SPECS["window"]()
    out, lse = _emulated_decode(emulated_lib, q, k_hf, v_hf, decode_keys(spec, 40, 39), 0.125, None, 3)
    want, want_lse = attention_ref_spec(q.double(), k.double(), v.double(), spec, return_lse=True)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cu_source_on_emulated_threads_bounded_equals_full(dtype, emulated_lib):
    """The last row of full-sequence Λ attention == the .cu on the compressed cache (true positions)."""
    T, G, L = 150, 4, 32
    spec = AttentionSpec.lm_infinite(n_global=G, n_local=L)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, T, h, 64, generator=g).to(dtype) for h in (4, 2, 2))
    inv, _ = compute_inv_freq(RopeSpec(rope_theta=1e4), 64)
    full = Rotary(inv, torch.arange(T))
    want = attention_ref_spec(q.double(), k.double(), v.double(), spec, rotary=full)[:, -1:]
    lowp = attention_ref_spec(q, k, v, spec, rotary=full)[:, -1:]
    pos = torch.arange(T)
    kept = (pos < G) | (pos > T - 1 - L)  # what BoundedKVCache returns for the step at T - 1
    kk, vk, Tk = k[:, kept].contiguous(), v[:, kept].contiguous(), int(kept.sum())
    tables = decode_tables(inv, pos[kept], Tk - 1, spec.lambda_params.effective_limit(Tk))
    got, _ = _emulated_decode(emulated_lib, q[:, -1:].contiguous(), kk, vk, decode_keys(spec, Tk, Tk - 1),
                              64 ** -0.5, tables, 2)
    assert_within_budget(got, lowp, want)


# ----------------------------------------------------------------------------- GPU
def _check_against_ref(q, k, v, spec, rot, *, n_splits=None):
    from lcx.kernels.cuda.lambda_decode import lambda_decode_cuda

    B, _, H, D = q.shape
    Tk = k.shape[1]
    lp = spec.lambda_params
    tabs = decode_tables(rot.inv_freq.to(q.device), rot.key_positions(Tk, q.device), Tk - 1,
                         lp.effective_limit(Tk) if lp else 0, rot.attention_factor)
    out, lse = poison_(torch.empty_like(q)), poison_(torch.empty(B, H, 1, device=q.device))
    lambda_decode_cuda(q, k, v, keys=decode_keys(spec, Tk, Tk - 1), scale=D ** -0.5, tables=tabs,
                       out=out, lse=lse, n_splits=n_splits)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any(), "kernel left elements unwritten"
    exact, exact_lse = attention_ref_spec(*(t.double() for t in (q, k, v)), spec, rotary=rot, return_lse=True)
    lowp, lowp_lse = attention_ref_spec(q, k, v, spec, rotary=rot, return_lse=True)
    assert_within_budget(out, lowp, exact)
    assert_within_budget(lse, lowp_lse, exact_lse, what="lse", precision=q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GRID, ids=[_id(c) for c in GRID])
def test_cuda_decode_matches_ref(case):
    shape, dtype, name, pos = case
    (q, k, v), rot = _case(shape, dtype, pos, "cuda")
    _check_against_ref(q, k, v, SPECS[name](), rot)


@pytest.mark.gpu
@pytest.mark.parametrize("n_splits", [1, 2, 7, 64, 5000])
def test_cuda_decode_any_split(n_splits):
    (q, k, v), rot = _case((2, 700, 8, 2, 128), torch.bfloat16, "bounded", "cuda")
    _check_against_ref(q, k, v, SPECS["lm_infinite"](), rot, n_splits=n_splits)


@pytest.mark.gpu
def test_cuda_decode_hf_cache_layout():
    """Keys/values as the transposed view of an HF cache `[B, Hkv, T, D]`, no copy needed."""
    (q, k, v), rot = _case((2, 301, 4, 2, 64), torch.float16, "bounded", "cuda")
    k_hf, v_hf = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    _check_against_ref(q, k_hf, v_hf, SPECS["lm_infinite"](), rot)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_backend_through_the_dispatcher(dtype):
    (q, k, v), rot = _case((1, 500, 8, 2, 128), dtype, "bounded", "cuda")
    spec = SPECS["lm_infinite"]()
    out, lse = attention(q, k, v, spec, backend="cuda", rotary=rot, return_lse=True)
    exact, exact_lse = attention_ref_spec(*(t.double() for t in (q, k, v)), spec, rotary=rot, return_lse=True)
    lowp, lowp_lse = attention_ref_spec(q, k, v, spec, rotary=rot, return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 8, 1)
    assert_within_budget(out, lowp, exact)
    assert_within_budget(lse, lowp_lse, exact_lse, what="lse", precision=q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [50, 333, 2049])
def test_bounded_equals_full(T, dtype):
    """Last row of full-sequence Λ attention == the kernel on the compressed cache (true positions)."""
    G, L = 4, 64
    spec = AttentionSpec.lm_infinite(n_global=G, n_local=L)
    g = torch.Generator().manual_seed(T)
    q = torch.randn(1, T, 8, 64, generator=g).to("cuda", dtype)
    k = torch.randn(1, T, 2, 64, generator=g).to("cuda", dtype)
    v = torch.randn(1, T, 2, 64, generator=g).to("cuda", dtype)
    inv, _ = compute_inv_freq(RopeSpec(rope_theta=1e4), 64)
    full_rot = Rotary(inv, torch.arange(T, device="cuda"))
    want = attention_ref_spec(*(t.double() for t in (q, k, v)), spec, rotary=full_rot)[:, -1:]
    lowp = attention_ref_spec(q, k, v, spec, rotary=full_rot)[:, -1:]
    pos = torch.arange(T, device="cuda")
    kept = (pos < G) | (pos > T - 1 - L)  # what BoundedKVCache returns for the step at T - 1
    got = attention(q[:, -1:], k[:, kept], v[:, kept], spec, backend="cuda", rotary=Rotary(inv, pos[kept]))
    assert_within_budget(got, lowp, want)
