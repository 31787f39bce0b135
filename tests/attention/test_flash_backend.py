"""The `flash` backend's decomposition (lcx/attention/flash_backend.py) on shapes that reach
every branch: head rows + chunked body with r = W / C > 1 key chunks per window, chunked
prefill off the chunk grid, decode, GQA, LM-Infinite with bounded-cache (true) positions.

test_attention.py runs `flash` through the shared backend grid (small windows, r = 1); this
module covers the long-window paths in float64 (exact to 1e-12: no rounding excuse) and once
in float32 against the derived budget.
"""

from __future__ import annotations

import pytest
import torch

from lcx.attention import BACKENDS, AttentionSpec, Rotary, attention, attention_ref_spec
from lcx.attention.flash_backend import chunk_size, mask_structure
from lcx.masks import attention_sinks, causal_mask, global_tokens, lambda_mask, sliding_window
from lcx.rope import RopeSpec, compute_inv_freq
from lcx.testing import assert_within_budget

F64, F32 = torch.float64, torch.float32
INV_FREQ = compute_inv_freq(RopeSpec(rope_type="default", rope_theta=500.0), 8, 4096)[0]

# (n_global, n_local): chunk_size(256) = 64 (r = 4), chunk_size(512) = 64 (r = 8), 300: r = 5, W % C != 0
WINDOWS = ((5, 256), (0, 256), (3, 512), (7, 300))
# (Tk, Tq): full prefill, chunked prefill off the grid, short chunk, decode, odd lengths
SHAPES = ((700, 700), (701, 301), (1100, 1100), (257, 257), (513, 130), (900, 1), (1031, 517))


def _qkv(Tq, Tk, H=4, Hkv=2, D=8, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Tq, H, D, generator=g, dtype=F64)
    k = torch.randn(1, Tk, Hkv, D, generator=g, dtype=F64)
    v = torch.randn(1, Tk, Hkv, D, generator=g, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _specs(G, L):
    yield "mask", (AttentionSpec(mask=lambda_mask(G, L)) if G else AttentionSpec(mask=sliding_window(left=L - 1))), None
    if G:
        yield "lm_infinite", AttentionSpec.lm_infinite(G, L), Rotary(INV_FREQ)


@pytest.mark.parametrize("G,L", WINDOWS, ids=lambda x: str(x))
@pytest.mark.parametrize("Tk,Tq", SHAPES, ids=lambda x: str(x))
def test_flash_long_windows_float64(G, L, Tk, Tq):
    q, k, v = _qkv(Tq, Tk)
    for name, spec, rot in _specs(G, L):
        want, want_lse = attention_ref_spec(q, k, v, spec, rotary=rot, return_lse=True)
        got, lse = attention(q, k, v, spec, backend="flash", rotary=rot, return_lse=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12, msg=lambda m: f"{name} lse: {m}")


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, torch.float16], ids=str)
def test_flash_low_precision_within_budget(dtype):
    """The chunked body's global-key matmuls and merge run in float32 for half inputs."""
    exact = _qkv(1031, 1031, H=8, Hkv=2, D=64)
    low = tuple(x.to(dtype) for x in exact)
    for _, spec, rot in _specs(9, 512):
        want = attention_ref_spec(*exact, spec, rotary=rot)
        ref32 = attention_ref_spec(*low, spec, rotary=rot)
        got = attention(*low, spec, backend="flash", rotary=rot)
        assert got.dtype == dtype
        assert_within_budget(got, ref32, want, what=f"flash {spec.name}")


def test_flash_bounded_cache_positions():
    """Decode on a compressed cache (first G keys + recent run, true positions) equals the
    last row of full-sequence LM-Infinite, as BoundedKVCache relies on."""
    G, L, T = 4, 256, 1000
    q, k, v = _qkv(T, T)
    spec = AttentionSpec.lm_infinite(G, L)
    full = attention_ref_spec(q, k, v, spec, rotary=Rotary(INV_FREQ))[:, -1:]
    keep = torch.cat((torch.arange(G), torch.arange(T - L, T)))  # the window: the last L keys
    rot = Rotary(INV_FREQ, positions=keep)
    for backend in ("ref", "flash"):
        got = attention(q[:, -1:], k[:, keep], v[:, keep], spec, backend=backend, rotary=rot)
        torch.testing.assert_close(got, full, rtol=0, atol=1e-12, msg=lambda m: f"{backend}: {m}")


def test_chunk_size_and_mask_structure():
    # 64 below W = 4096, then W / 8 rounded up to 64 and >= 768; W <= 64: W; need not divide W
    assert chunk_size(1024) == 64 and chunk_size(256) == 64 and chunk_size(300) == 64
    assert chunk_size(17) == 17 and chunk_size(64) == 64 and chunk_size(128) == 64 and chunk_size(1100) == 64
    assert chunk_size(4095) == 64 and chunk_size(4096) == 768 and chunk_size(6200) == 832
    assert chunk_size(8192) == 1024 and chunk_size(8188) == 1024
    assert mask_structure(AttentionSpec(mask=causal_mask)) == (0, None)
    assert mask_structure(AttentionSpec(mask=sliding_window(left=7))) == (0, 7)
    assert mask_structure(AttentionSpec(mask=lambda_mask(4, 16))) == (4, 15)
    assert mask_structure(AttentionSpec(mask=attention_sinks(4, 15))) == (4, 15)
    assert mask_structure(AttentionSpec(mask=global_tokens(4))) is None


def test_flash_refuses_what_it_cannot_do():
    q, k, v = _qkv(17, 17, dtype=F32)
    with pytest.raises(NotImplementedError, match="softmax-only"):
        attention(q, k, v, AttentionSpec.swat(window=8, n_heads=4), backend="flash")
    with pytest.raises(NotImplementedError, match="global_tokens"):
        attention(q, k, v, AttentionSpec(mask=global_tokens(4)), backend="flash")
    with pytest.raises(NotImplementedError, match="forward-only"):
        attention(q.requires_grad_(), k, v, AttentionSpec(mask=sliding_window(left=7)), backend="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Tk,Tq", [(4097, 4097), (4097, 1), (3001, 1000)], ids=lambda x: str(x))
def test_flash_cuda_within_budget(dtype, Tk, Tq):
    """On CUDA: torch's flash / memory-efficient kernels (or flash-attn when installed)."""
    exact = _qkv(Tq, Tk, H=8, Hkv=2, D=64)
    low = tuple(x.to(dtype).cuda() for x in exact)
    for _, spec, rot in _specs(16, 1024):
        rot_c = None if rot is None else Rotary(rot.inv_freq.cuda())
        want = attention_ref_spec(*exact, spec, rotary=rot)
        ref_lp = attention_ref_spec(*low, spec, rotary=rot_c).cpu()
        got = attention(*low, spec, backend="flash", rotary=rot_c).cpu()
        assert_within_budget(got, ref_lp, want, what=f"flash cuda {spec.name}")


def test_mask_structure_needs_the_factory_name_and_its_parameters():
    """A mask is cut only when both its factory name and its parameter keys match: LM-Infinite's
    global-branch mask `lambda_global_*` (no parameters) once crashed here with a KeyError."""
    from lcx.attention.rotary import lambda_global_mask

    assert mask_structure(AttentionSpec(mask=lambda_mask(3, 64))) == (3, 63)
    assert mask_structure(AttentionSpec(mask=attention_sinks(4, 19))) == (4, 19)
    assert mask_structure(AttentionSpec(mask=sliding_window(left=7))) == (0, 7)
    assert mask_structure(AttentionSpec(mask=causal_mask)) == (0, None)
    assert mask_structure(AttentionSpec(mask=lambda_global_mask(4, 20))) is None
    # ... it is no window, but its own structure (global keys outside a window) is data flash runs
    assert BACKENDS["flash"].supports(AttentionSpec(mask=lambda_global_mask(4, 20))) is None
    from lcx.masks import and_masks

    composed = and_masks(lambda_global_mask(4, 20), causal_mask)  # structure lost: refused, named
    reason = BACKENDS["flash"].supports(AttentionSpec(mask=composed))
    assert reason is not None and "is not causal, sliding_window, lambda or attention_sinks" in reason


@pytest.mark.parametrize("Tq,Tk,off,G,L", [(40, 4, 0, 4, 7), (40, 3, 0, 4, 7), (1, 4, 50, 4, 7), (9, 10, 20, 10, 5),
                                          (63, 2, 0, 2, 1), (217, 4, 0, 4, 63)])
def test_global_keys_outside_the_window_on_flash(Tq, Tk, off, G, L):
    """`lambda_global_mask(G, L)` (StreamingLLM's sink pass, LM-Infinite's global branch) on
    flash == the reference, output and lse, rows with no visible key included."""
    from lcx.attention.rotary import lambda_global_mask

    g = torch.Generator().manual_seed(Tq + Tk)
    q = torch.randn(1, Tq, 2, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, Tk, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
    spec = AttentionSpec(mask=lambda_global_mask(G, L))
    want, lse_w = attention(q, k, v, spec, backend="ref", q_offset=off, return_lse=True)
    got, lse_g = attention(q, k, v, spec, backend="flash", q_offset=off, return_lse=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_g, lse_w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("Tk,Tq", ((300, 300), (301, 1), (415, 115)))
def test_streaming_sinks_on_flash_equals_the_reference(Tk, Tq):
    """StreamingLLM through `flash`: pass A on flash, pass B (sink keys) on blockwise; float64."""
    from lcx.methods.streaming import streaming_attention, streaming_attention_ref

    q, k, v = _qkv(Tq, Tk)
    rot = Rotary(INV_FREQ, torch.arange(Tk))
    want = streaming_attention_ref(q, k, v, rotary=rot, n_sink=4, window=64)
    got = streaming_attention(q, k, v, rotary=rot, n_sink=4, window=64, backend="flash")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
