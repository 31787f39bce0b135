"""`lcx bench kernels`, rope: fused RoPE application y = x cos + J(x) sin, triton vs `apply_rotary_ref`."""

from __future__ import annotations

import torch

from benchmarks.harness import Prepared, n_buffers, need_cuda, need_triton, randn

from .common import Case, bandwidth_goal, rope_inv_freq


def _rope_case(impl: str):
    def setup(device: str, tiny: bool) -> Prepared:
        from lcx.rope import apply_rotary_ref, rope_cos_sin

        B, T, H, D = (1, 64, 2, 32) if tiny else (1, 32768, 32, 128)
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        if impl == "triton":
            need_triton(device)
            from lcx.kernels.triton.rope import apply_rotary_triton as fn
        else:
            fn = apply_rotary_ref
        cos, sin = rope_cos_sin(torch.arange(T, device=device), rope_inv_freq(D).to(device), 1.0, torch.float32)
        nbytes = 2 * B * T * H * D * 2 + 2 * T * D * 4
        m = n_buffers(nbytes, device)
        xs = randn((B, T, H, D), dt, device, m)
        return Prepared(lambda i: fn(xs[i % m], cos, sin), m, nbytes, 3.0 * B * T * H * D,
                        dict(B=B, T=T, H=H, D=D))

    return setup


CASES = [
    Case("rope", "ref", "32k", _rope_case("ref"), cpu=True),
    Case("rope", "triton", "32k", _rope_case("triton"), baseline="rope/ref/32k", goal=bandwidth_goal),
]
