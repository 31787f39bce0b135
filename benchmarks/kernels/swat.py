"""`lcx bench kernels`, swat: sigmoid window attention (SWAT: window w, balanced ALiBi) forward +
backward: triton (and lcx's flex_compiled backend) vs torch's compiled flex_attention with the same
mask and ALiBi, its block mask built once."""

from __future__ import annotations

import torch

from benchmarks.harness import Prepared, n_buffers, need_cuda, need_triton, randn

from .common import Case, faster_than_baseline


def _swat(impl: str, T: int):
    def setup(device: str, tiny: bool) -> Prepared:
        from lcx.attention import AttentionSpec, attention

        B, H, D, W = (1, 2, 32, 16) if tiny else (1, 16, 128, 512)
        n = 64 if tiny else T
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        spec = AttentionSpec.swat(window=W, n_heads=H)
        nbytes = 2 * 4 * B * n * H * D * 2  # fwd: q, k, v, out; bwd: the same again plus grads (approx. x2)
        m = n_buffers(nbytes, device)
        layout = (B, H, n, D) if impl == "flex_attention" else (B, n, H, D)
        qkv = [[t.requires_grad_() for t in randn(layout, dt, device, 3, seed=s)] for s in range(m)]
        grad = randn(layout, dt, device, 1, seed=99)[0]
        if impl == "flex_attention":
            # torch's flex_attention itself, compiled, block mask built once (not per call as the
            # lcx "flex_compiled" backend does): sigmoid as logsigmoid score_mod + o = o_softmax * Z
            need_cuda(device, "compiled flex_attention backward")
            from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

            block_mask = create_block_mask(spec.mask, None, None, n, n, device=device)
            slopes = torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=device)

            def score_mod(score, b, h, q_idx, kv_idx):
                return torch.nn.functional.logsigmoid(score - slopes[h] * (q_idx - kv_idx).abs())

            flex = torch.compile(flex_attention, dynamic=False)

            def run(i):
                q, k, v = qkv[i % m]  # [B, H, n, D]
                o, aux = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, return_aux=AuxRequest(lse=True))
                out = o * aux.lse.exp().unsqueeze(-1).to(o.dtype)
                return torch.autograd.grad(out, (q, k, v), grad)
        else:
            backend = {"triton": "triton", "flex_compiled": "flex_compiled", "blockwise": "blockwise"}[impl]
            if backend == "triton":
                need_triton(device)
            elif backend == "flex_compiled":
                need_cuda(device, "compiled flex_attention backward")

            def run(i):
                q, k, v = qkv[i % m]  # [B, n, H, D]
                out = attention(q, k, v, spec, backend=backend)
                return torch.autograd.grad(out, (q, k, v), grad)

        visible = min(n, W)
        flops = 14.0 * B * H * n * visible * D  # fwd 4 (QK^T, PV) + bwd 10 (recompute S, dP, dV, dQ, dK)
        return Prepared(run, m, nbytes, flops, dict(B=B, T=n, H=H, D=D, window=W))

    return setup


CASES = [
    case
    for T, label in ((8192, "8k"), (32768, "32k"))
    for case in (
        Case("swat", "flex_attention", label, _swat("flex_attention", T)),
        Case("swat", "flex_compiled", label, _swat("flex_compiled", T), baseline=f"swat/flex_attention/{label}"),
        Case("swat", "triton", label, _swat("triton", T), baseline=f"swat/flex_attention/{label}",
             goal=faster_than_baseline("fwd+bwd faster than flex_attention with the same masks")),
    )
]
