"""`lcx bench kernels`, lambda_prefill: Λ-attention prefill (G=64, L=4096) at 8k/32k/128k, triton vs
torch flash SDPA causal (goal: speedup >= 0.6 n / (2 (G + L)))."""

from __future__ import annotations

import torch

from benchmarks.harness import Prepared, n_buffers, need_cuda, need_triton, randn

from .common import G_LAMBDA, L_LAMBDA, Case, rope_inv_freq, sdpa_call


# Tq = Tk = n; triton Λ kernel vs flash SDPA causal (no Λ: the dense baseline)
def _prefill(impl: str, n: int):
    def setup(device: str, tiny: bool) -> Prepared:
        from lcx.attention import AttentionSpec, Rotary, attention

        B, H, Hkv, D = (1, 2, 1, 32) if tiny else (1, 32, 8, 128)
        T, G, L = (96, 4, 16) if tiny else (n, G_LAMBDA, L_LAMBDA)
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        if impl == "sdpa_flash_causal":
            nbytes = B * T * (2 * H + 2 * Hkv) * D * 2  # q, out + k, v
            m = n_buffers(nbytes, device)
            qs = randn((B, H, T, D), dt, device, m)
            kvs = randn((B, Hkv, T, D), dt, device, m, seed=1)
            call, native = sdpa_call(qs[0], kvs[0], kvs[0], causal=True, device=device)
            if not native:
                kvs = [x.repeat_interleave(H // Hkv, dim=1) for x in kvs]
                call, _ = sdpa_call(qs[0], kvs[0], kvs[0], causal=True, device=device)
            run = lambda i: call(qs[i % m], kvs[i % m], kvs[i % m])  # noqa: E731
            return Prepared(run, m, nbytes, 2.0 * B * H * T * T * D,
                            dict(B=B, T=T, H=H, Hkv=Hkv, D=D, gqa_native=native))
        need_triton(device)
        spec = AttentionSpec.lm_infinite(n_global=G, n_local=L)
        nbytes = B * T * (2 * H + 2 * Hkv) * D * 2
        m = n_buffers(nbytes, device)
        qs = randn((B, T, H, D), dt, device, m)
        kvs = randn((B, T, Hkv, D), dt, device, m, seed=1)
        rot = Rotary(rope_inv_freq(D).to(device))
        run = lambda i: attention(qs[i % m], kvs[i % m], kvs[i % m], spec, backend="triton", rotary=rot)  # noqa: E731
        visible = min(T, G + L)  # keys per query (most rows)
        return Prepared(run, m, nbytes, 4.0 * B * H * T * visible * D, dict(B=B, T=T, H=H, Hkv=Hkv, D=D, G=G, L=L))

    return setup


def prefill_goal(row: dict, rows: dict) -> dict | None:
    base = rows.get(row.get("baseline", ""), {})
    if "median_ms" not in row or "median_ms" not in base:
        return None
    n = row["shape"]["T"]
    target = 0.6 * n / (2 * (row["shape"]["G"] + row["shape"]["L"]))
    speedup = base["median_ms"] / row["median_ms"]
    return {"what": "speedup over flash SDPA causal >= 0.6 n / (2 (G + L))", "target": round(target, 3),
            "value": round(speedup, 3), "met": speedup >= target}


CASES = [
    case
    for n, label in ((8192, "8k"), (32768, "32k"), (131072, "128k"))
    for case in (
        Case("lambda_prefill", "sdpa_flash_causal", label, _prefill("sdpa_flash_causal", n), cpu=label == "8k"),
        Case("lambda_prefill", "triton", label, _prefill("triton", n), baseline=f"lambda_prefill/sdpa_flash_causal/{label}",
             goal=prefill_goal),
    )
]
