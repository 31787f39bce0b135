"""What lcx's Triton kernels share: the interpreter switch, row loads, the dot with its precision
choice, round-to-nearest casts and block sizes. One home, so a kernel never imports another
kernel's private names.

Run on CPU tensors with `TRITON_INTERPRET=1` set before triton is first imported (tests).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """True under the Triton interpreter (`TRITON_INTERPRET=1`): CPU tensors, numpy semantics."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pow2(n: int, lo: int = 16) -> int:
    """The block size for a dimension of n: the next power of two, at least `lo`."""
    return max(lo, triton.next_power_of_2(max(n, 1)))


@triton.jit
def load_rows(base, rows_off, cols, n_cols, stride_d, row_ok):
    """x[row, c] for c < n_cols, zero elsewhere: [R, C] from row offsets [R] and columns [C]."""
    return tl.load(base + rows_off[:, None] + cols[None, :] * stride_d,
                   mask=row_ok[:, None] & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def dot(a, b, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b: in float32 when DOT_F32 (the interpreter's bf16 tl.dot is wrong), else in the
    inputs' dtype with `input_precision=PRECISION` ("ieee" or "tf32")."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def cast_rne(x, DT: tl.constexpr, EMULATE: tl.constexpr):
    """x.to(DT) rounding to nearest even. The interpreter truncates float32 -> bfloat16 (numpy
    has no bfloat16), so under it (EMULATE) the rounding is done on the bits; GPUs round."""
    if EMULATE:
        if DT == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True).to(DT)
    return x.to(DT)


__all__ = ["cast_rne", "dot", "interpreting", "load_rows", "pow2"]
