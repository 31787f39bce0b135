"""Triton kernels of lcx (installed as `lcx.kernels.triton`).

- `rerotate`: PIE re-rotation of cached keys.
- `lambda_attention`: attention forward for causal / window / sinks / LM-Infinite Λ masks
  (RoPE and the distance cap inside, block skipping, split-K decode).
- `swat`: differentiable window attention (SWAT sigmoid + ALiBi, softmax windows).
- `rope`: fused RoPE application (`apply_rotary_triton`).

Each module imports triton at its top, so import a kernel module only when you mean to run it
(lcx's dispatchers do so lazily). Under `TRITON_INTERPRET=1`, set before triton is first
imported, the kernels run on CPU tensors through Triton's interpreter (slow; tests only).
"""
