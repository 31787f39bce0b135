"""`lcx bench kernels`, lambda_decode: one query over LM-Infinite's bounded cache (G + L keys,
unrotated, true positions): the CUDA kernel, the cuda/triton/blockwise backends, vs flash SDPA
decode over the full 32k/128k cache."""

from __future__ import annotations

import torch

from benchmarks.harness import Prepared, n_buffers, need_cuda, need_triton, randn

from .common import G_LAMBDA, L_LAMBDA, Case, bandwidth_goal, rope_inv_freq, sdpa_call


def _decode(impl: str, full_len: int = 0):
    def setup(device: str, tiny: bool) -> Prepared:
        from lcx.attention import AttentionSpec, Rotary, attention

        B, H, Hkv, D = (2, 4, 2, 64) if tiny else (4, 32, 8, 128)
        G, L = (4, 32) if tiny else (G_LAMBDA, L_LAMBDA)
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        if impl == "sdpa_full_cache":  # vanilla decode over the whole (rotated) cache
            T = 300 if tiny else full_len
            nbytes = 2 * B * T * Hkv * D * 2 + 2 * B * H * D * 2
            m = n_buffers(nbytes, device)
            qs = randn((B, H, 1, D), dt, device, m)
            ks = randn((B, Hkv, T, D), dt, device, m, seed=1)
            call, native = sdpa_call(qs[0], ks[0], ks[0], causal=False, device=device)
            if not native:  # the repeated heads are read too: bytes as a dense cache
                ks = [x.repeat_interleave(H // Hkv, dim=1) for x in ks]
                call, _ = sdpa_call(qs[0], ks[0], ks[0], causal=False, device=device)
                nbytes = 2 * B * T * H * D * 2 + 2 * B * H * D * 2
            run = lambda i: call(qs[i % m], ks[i % m], ks[i % m])  # noqa: E731
            return Prepared(run, m, nbytes, 4.0 * B * H * T * D, dict(B=B, Tk=T, H=H, Hkv=Hkv, D=D, gqa_native=native))
        Tk = G + L
        spec = AttentionSpec.lm_infinite(n_global=G, n_local=L)
        pos = torch.cat((torch.arange(G), torch.arange(10**6 - L + 1, 10**6 + 1))).to(device)
        rot = Rotary(rope_inv_freq(D).to(device), pos)
        half = rot.inv_freq.numel()
        nbytes = 2 * B * Tk * Hkv * D * 2 + 2 * Tk * half * 4 + 2 * B * H * D * 2  # k, v, tables, q, out
        m = n_buffers(nbytes, device)
        qs = randn((B, 1, H, D), dt, device, m)
        ks = randn((B, Tk, Hkv, D), dt, device, m, seed=1)
        vs = randn((B, Tk, Hkv, D), dt, device, m, seed=2)
        shape = dict(B=B, Tk=Tk, H=H, Hkv=Hkv, D=D, G=G, L=L)
        flops = 4.0 * B * H * Tk * D
        if impl == "cuda":
            need_cuda(device, "the CUDA extension")
            from lcx.attention.cuda_backend import decode_keys
            from lcx.kernels.cuda.lambda_decode import decode_tables, lambda_decode_cuda

            tabs = decode_tables(rot.inv_freq, pos, Tk - 1, spec.lambda_params.effective_limit(Tk))
            keys = decode_keys(spec, Tk, Tk - 1)
            run = lambda i: lambda_decode_cuda(qs[i % m], ks[i % m], vs[i % m], keys=keys, scale=D**-0.5, tables=tabs)  # noqa: E731
            return Prepared(run, m, nbytes, flops, shape)
        backend = {"cuda_backend": "cuda", "triton_backend": "triton", "blockwise": "blockwise"}[impl]
        if backend == "cuda":
            need_cuda(device, "the CUDA extension")
        elif backend == "triton":
            need_triton(device)
        run = lambda i: attention(qs[i % m], ks[i % m], vs[i % m], spec, backend=backend, rotary=rot)  # noqa: E731
        return Prepared(run, m, nbytes, flops, shape)

    return setup


CASES = [
    Case("lambda_decode", "sdpa_full_cache", "32k", _decode("sdpa_full_cache", 32768), cpu=True),
    Case("lambda_decode", "sdpa_full_cache", "128k", _decode("sdpa_full_cache", 131072)),
    *(Case("lambda_decode", impl, "G64+L4096", _decode(impl), baseline="lambda_decode/sdpa_full_cache/32k",
           goal=bandwidth_goal if impl == "cuda" else None) for impl in ("cuda", "cuda_backend", "triton_backend")),
    Case("lambda_decode", "blockwise", "G64+L4096", _decode("blockwise"), baseline="lambda_decode/sdpa_full_cache/32k",
         cpu=True),
]
