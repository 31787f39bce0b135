"""`lcx bench kernels`, rerotate: PIE re-rotation of a key cache in place, k [B, T, Hkv, D] <- R(delta) k
(triton, cuda; the reference on the CPU smoke run)."""

from __future__ import annotations

import torch

from benchmarks.harness import Prepared, n_buffers, need_cuda, need_triton, randn

from .common import Case, bandwidth_goal, rope_inv_freq


def _rerotate(impl: str):
    def setup(device: str, tiny: bool) -> Prepared:
        B, T, H, D = (1, 64, 2, 64) if tiny else (1, 32768, 8, 128)
        dt = torch.bfloat16
        if impl == "triton":
            need_triton(device)
            from lcx.kernels.triton.rerotate import rerotate_triton as fn
        elif impl == "cuda":
            need_cuda(device, "the CUDA extension")
            from lcx.kernels.cuda import rerotate_cuda as fn
        else:
            from lcx.cache.rerotate import rerotate_ref as fn
        nbytes = 2 * B * T * H * D * 2 + T * 8  # read + write the keys, read delta
        n = n_buffers(nbytes, device)
        ks = randn((B, T, H, D), dt, device, n)
        delta = torch.randint(-1000, 1000, (T,), device=device)
        inv = rope_inv_freq(D).to(device)
        return Prepared(lambda i: fn(ks[i % n], delta, inv), n, nbytes, 6.0 * B * T * H * D / 2,
                        dict(B=B, T=T, Hkv=H, D=D, dtype="bfloat16"))

    return setup


CASES = [
    Case("rerotate", "triton", "32k", _rerotate("triton"), goal=bandwidth_goal),
    Case("rerotate", "cuda", "32k", _rerotate("cuda"), goal=bandwidth_goal),
    Case("rerotate", "ref", "32k", _rerotate("ref"), cpu=True),
]
