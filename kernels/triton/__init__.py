"""Triton kernels of lcx (installed as `lcx.kernels.triton`).

Each module imports triton at its top, so import a kernel module only when you mean to run it
(lcx's dispatchers do so lazily). Under `TRITON_INTERPRET=1`, set before triton is first
imported, the kernels run on CPU tensors through Triton's interpreter (slow; tests only).
"""
