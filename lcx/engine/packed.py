"""oneDNN-packed linear weights for the engine's forwards on CPU.

A CPU matmul of `[M, K] x [K, N]` runs faster on a weight already in oneDNN's blocked layout than on
a plain row-major one (MKL's sgemm repacks the weight on every call): on this project's 2-core
AVX-512 machine, 1.2-1.9x on the shapes of a prefill or of a decode step of many rows (`M >= 2`),
and no faster for one row, where reading the weight from memory is the cost. vLLM's CPU backend
runs every unquantized linear this way (`create_onednn_mm` / `onednn_mm`, packed once at load);
lcx's engine does the same for its own forwards, through torch's oneDNN ops
(`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`), with three rules:

- **Only the engine's forwards.** Each `nn.Linear` of the model gets a forward that takes the
  packed path only inside `scope()` (the engine's prefill, decode and logits calls, `ModelRunner`);
  everywhere else, e.g. lm-eval's log-likelihood forward or `lcx report`'s perplexity on the same
  model object, it is `F.linear` as before, so those numbers do not move.
- **Only where it helps, and only float32.** Inputs of at least `MIN_ROWS` rows, CPU float32
  weights, no autograd. One row (a decode step of one request) stays on `F.linear`.
- **Never stale.** A packed copy is made on first use and remade when the weight changes (its
  storage or its version counter: `load_state_dict`, an in-place edit). It costs one more copy of
  the weights it packs (and `merged`'s q/k/v and gate/up concatenations, where the lean forward
  uses them, one more of those), so `EngineConfig.packed_linear` (None: auto) packs only where the model's
  linear weights total at most `AUTO_MAX_BYTES`; True packs regardless, False never.

Exactness: oneDNN's kernel sums in another order than MKL's, so an engine output differs from the
model's own forward by float rounding (a few 1e-6 relative in float32), as batched and unbatched
rows already do; the engine's exactness tests compare within those tolerances, and
tests/engine/test_packed.py compares the packed forwards to `F.linear` over a grid of shapes.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 2  # fewer rows: F.linear (one row reads the weight once either way, without the call's overhead)
PACK_HINT = 32  # the batch size oneDNN's blocked layout is chosen for (vLLM's create_onednn_mm uses 32)
AUTO_MAX_BYTES = 2 << 30  # packed=None (auto): pack when the model's linear weights total at most this

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("lcx_packed_linear", default=False)


def available() -> bool:
    """Whether this torch has oneDNN's packed linear ops (CPU builds with MKLDNN)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """The packed path on, for the forwards inside (the engine's own)."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class _Packed:
    """One linear's packed weight and the weight it was made from."""

    __slots__ = ("key", "weight")

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.weight: torch.Tensor | None = None

    def get(self, w: torch.Tensor) -> torch.Tensor:
        key = (w.data_ptr(), w._version)
        if key != self.key:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT)
            self.key = key
        return self.weight


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward (bound to it: a deep copy of the model rebinds it to the copy)."""
    w = module.weight
    if (not _ACTIVE.get() or x.dim() < 2 or x.numel() < MIN_ROWS * x.shape[-1] or w.dtype != torch.float32
            or x.dtype != torch.float32 or w.device.type != "cpu" or torch.is_grad_enabled()):
        return F.linear(x, w, module.bias)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows if rows.is_contiguous() else rows.contiguous(),
                                             module._lcx_packed.get(w),
                                             module.bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


class _Merged:
    """The packed concatenation of several linears' weights (and biases), and what it was made from."""

    __slots__ = ("key", "weight", "bias")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def get(self, mods: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = tuple((m.weight.data_ptr(), m.weight._version) + (
            () if m.bias is None else (m.bias.data_ptr(), m.bias._version)) for m in mods)
        if key != self.key:
            w = torch.cat([m.weight.detach() for m in mods])
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT)
            self.bias = None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods])
            self.key = key
        return self.weight, self.bias


def merged(mods: list[nn.Linear], x: torch.Tensor) -> list[torch.Tensor]:
    """`[m(x) for m in mods]` for linears that read the same input (a layer's q/k/v projections, an
    MLP's gate and up): inside `scope()`, on rows the packed path takes, ONE packed GEMM over their
    concatenated weights, split, as vLLM's merged projections run (fewer, larger GEMMs: at a few
    decode rows the per-call cost dominates). The output columns are the same dot products over
    the same K; tests/engine/test_packed.py checks them bit for bit against the separate calls.
    Elsewhere, or for linears without the packed forward or with mixed biases, the separate calls."""
    first = mods[0]
    if (not _ACTIVE.get() or x.dim() < 2 or x.numel() < MIN_ROWS * x.shape[-1] or x.dtype != torch.float32
            or torch.is_grad_enabled() or any("_lcx_packed" not in m.__dict__ or m.weight.dtype != torch.float32
                                              for m in mods)
            or len({m.bias is None for m in mods}) != 1):
        return [m(x) for m in mods]
    cache = first.__dict__.get("_lcx_merged")
    if cache is None:
        cache = first._lcx_merged = _Merged()
    w, b = cache.get(mods)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows if rows.is_contiguous() else rows.contiguous(), w, b, "none", [], "")
    parts = out.split([m.weight.shape[0] for m in mods], dim=-1)
    return [p.view(*x.shape[:-1], p.shape[-1]) for p in parts]


def linears(model: nn.Module) -> list[nn.Linear]:
    """The model's CPU float32 `nn.Linear` layers (each once, tied weights included once per layer)."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dim() == 2
            and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]


def install(model: nn.Module, packed: bool | None) -> bool:
    """Give the model's linears the packed forward (`packed`: EngineConfig.packed_linear; None:
    auto by `AUTO_MAX_BYTES`). Returns whether the engine's forwards run packed. Idempotent: a
    second engine on the same model shares the first's packed copies."""
    if packed is False or not available():
        return False
    layers = linears(model)
    if not layers:
        return False
    if packed is None and sum({id(m.weight): m.weight.numel() * 4 for m in layers}.values()) > AUTO_MAX_BYTES:
        return False
    for m in layers:
        if "forward" not in m.__dict__:
            m._lcx_packed = _Packed()  # the packed copy lives with the layer
            m.forward = types.MethodType(_forward, m)  # type: ignore[method-assign]
    return True


def uninstall(model: nn.Module) -> None:
    """Remove the packed forwards and their copies (the model's own `nn.Linear.forward` again)."""
    for m in model.modules():
        if isinstance(m, nn.Linear) and "_lcx_packed" in m.__dict__:
            del m.forward
            del m._lcx_packed
            m.__dict__.pop("_lcx_merged", None)


def packed_bytes(model: nn.Module) -> int:
    """Bytes held by packed copies (0 before the first packed forward)."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        for name in ("_lcx_packed", "_lcx_merged"):
            p = m.__dict__.get(name)
            if p is not None and p.weight is not None:
                seen[id(p)] = p.weight.numel() * p.weight.element_size()
    return sum(seen.values())
