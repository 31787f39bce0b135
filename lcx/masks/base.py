"""Shared pieces of every mask: the `MaskMod` type, naming, key spans and materialisation.

The window convention (which keys a query sees) is written once, in `lcx.masks`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

# mask_mod(b, h, q_idx, kv_idx) -> bool: True where query q_idx may attend to key kv_idx.
# Arguments are integer tensors (scalars under flex_attention's vmap, broadcastable grids
# elsewhere); a mask_mod must use only elementwise tensor ops (no Python `if` on values).
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class KeySpan:
    """A superset of the keys a mask can make visible to query i (absolute indices).

    Visible keys are among `j < n_global` or `i - left <= j <= i`. `left=None`: the window
    is unbounded (every `j <= i`); `left=-1`: no window. Backends that skip keys (blockwise)
    read the span to know which keys a block of queries can need; the mask_mod itself still
    decides visibility, so a span only has to be a superset, never exact.
    """

    n_global: int = 0
    left: int | None = None

    def cost(self) -> float:
        return self.n_global + (float("inf") if self.left is None else self.left + 1)

    def key_ranges(self, i0: int, i1: int, n_keys: int) -> list[tuple[int, int]]:
        """Disjoint half-open key ranges covering the span of queries `i0 <= i < i1`."""
        win_lo = 0 if self.left is None else max(0, i0 - self.left)
        win_hi = min(n_keys, i1)
        g_hi = min(self.n_global, win_lo, n_keys)  # global keys before the window only
        ranges = [(0, g_hi), (win_lo, win_hi)]
        return [(lo, hi) for lo, hi in ranges if hi > lo]


def span_union(a: KeySpan | None, b: KeySpan | None) -> KeySpan | None:
    if a is None or b is None:
        return None
    left = None if a.left is None or b.left is None else max(a.left, b.left)
    return KeySpan(max(a.n_global, b.n_global), left)


def span_intersection(a: KeySpan | None, b: KeySpan | None) -> KeySpan | None:
    # Either span bounds the intersection; keep the cheaper one.
    if a is None or b is None:
        return a if b is None else b
    return a if a.cost() <= b.cost() else b


def named(fn: MaskMod, name: str, span: KeySpan | None, params: dict[str, Any], *, exact: bool = False) -> MaskMod:
    """Label a mask_mod: `__name__` records its parameters (attention-gym style), `span` bounds
    its keys; `exact=True` (the window-shaped primitives) says the span IS the mask: a key is
    visible iff `j <= i` and (`i - j <= left` or `j < n_global`), which `window_shape` returns."""
    fn.__name__ = fn.__qualname__ = name
    fn.span = span  # type: ignore[attr-defined]
    fn.mask_params = dict(params)  # type: ignore[attr-defined]
    fn.window_shape = span if exact else None  # type: ignore[attr-defined]
    return fn


def window_shape(mask_mod: MaskMod | None) -> KeySpan | None:
    """The exact window shape `(n_global, left)` of a mask built by the window-shaped factories
    (`causal`: (0, None); `sliding_window(left=left)`: (0, left); `global_tokens(n)`: (n, -1);
    `attention_sinks(n, left)`: (n, left); `lambda_mask(G, L)`: (G, L - 1)), or None for any
    other mask (composed, hand-written). Backends that run windows natively read the mask's
    structure through this one function, never from its name."""
    return getattr(mask_mod, "window_shape", None) if mask_mod is not None else None


def mask_span(mask_mod: MaskMod | None) -> KeySpan | None:
    """The mask's key span, or None when unknown (any key may be visible)."""
    return getattr(mask_mod, "span", None) if mask_mod is not None else None


def check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def default_q_offset(n_queries: int, n_keys: int, q_offset: int | None) -> int:
    """Index of the first query: the queries are the LAST `n_queries` of the `n_keys` keys."""
    if q_offset is None:
        if n_queries > n_keys:
            raise ValueError(f"{n_queries} queries but only {n_keys} keys: pass q_offset")
        return n_keys - n_queries
    return check_count("q_offset", q_offset, 0)


def mask_matrix(
    mask_mod: MaskMod | None,
    n_queries: int,
    n_keys: int,
    *,
    q_offset: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The mask as a dense bool matrix `[n_queries, n_keys]` (True = visible).

    Query t sits at index `q_offset + t` (default `n_keys - n_queries`); see `lcx.masks`.
    `mask_mod=None` means no mask (every key visible). lcx masks do not depend on `b` or `h`;
    they are evaluated at b = h = 0.
    """
    off = default_q_offset(n_queries, n_keys, q_offset)
    q_idx = torch.arange(off, off + n_queries, device=device)
    return mask_block(mask_mod, q_idx, torch.arange(n_keys, device=device))


def mask_block(mask_mod: MaskMod | None, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """The mask on index vectors q_idx `[Tq]` and kv_idx `[n]` (absolute): bool `[Tq, n]`."""
    shape = (q_idx.shape[0], kv_idx.shape[0])
    if mask_mod is None:
        return torch.ones(shape, dtype=torch.bool, device=q_idx.device)
    zero = torch.zeros((), dtype=torch.long, device=q_idx.device)
    out = mask_mod(zero, zero, q_idx[:, None], kv_idx[None, :])
    return torch.broadcast_to(out, shape).to(torch.bool)
