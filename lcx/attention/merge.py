"""Merging attention passes over disjoint key sets by their log-sum-exp.

For softmax, two passes over disjoint keys A and B, each normalised over its own keys, give
the pass over A u B as
    o = sigmoid(lse_a - lse_b) * o_a + sigmoid(lse_b - lse_a) * o_b,  lse = logaddexp(lse_a, lse_b)
(the weights are Z_a / (Z_a + Z_b) and Z_b / (Z_a + Z_b); Self-Extend's
`selfextend_flash_attn.py` merges the same way). For sigmoid, passes are not normalised:
o = o_a + o_b. A pass with no visible key for a row has lse = -inf and o = 0 there.

`lambda_two_pass` builds LM-Infinite from any kernel that returns (out, lse): a window pass
with rotated keys plus a global pass with capped distance, the global keys that fall inside
the window excluded from the second pass so each key counts once. This is the route of the
future flash backend (flash-attn has no global + window mask).
"""

from __future__ import annotations

from typing import Callable

import torch

from lcx.masks import MaskMod, sliding_window

from .rotary import lambda_global_mask, lambda_inputs
from .spec import LambdaParams, Rotary

# kernel(q, k, v, *, mask, q_offset, scale, activation) -> (out [B, Tq, H, Dv], lse [B, H, Tq])
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def merge_attention(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    activation: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge o `[B, Tq, H, Dv]` with lse `[B, H, Tq]` of two passes; returns (o, lse).

    Computed in float32 (or wider), o returned in o_a's dtype.
    """
    wide = torch.promote_types(o_a.dtype, torch.float32)
    lse_wide = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), torch.float32)
    lse = torch.logaddexp(lse_a.to(lse_wide), lse_b.to(lse_wide))
    if activation == "sigmoid":
        return (o_a.to(wide) + o_b.to(wide)).to(o_a.dtype), lse
    if activation != "softmax":
        raise ValueError(f"activation={activation!r}")
    d = (lse_a - lse_b).to(wide)
    both_empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    d = torch.where(both_empty, torch.zeros_like(d), d)  # -inf - -inf; both outputs are 0
    w_a = torch.sigmoid(d).transpose(1, 2).unsqueeze(-1)  # [B, Tq, H, 1]
    w_b = torch.sigmoid(-d).transpose(1, 2).unsqueeze(-1)
    return (w_a * o_a.to(wide) + w_b * o_b.to(wide)).to(o_a.dtype), lse


def merge_many(
    outs: list[torch.Tensor], lses: list[torch.Tensor], *, dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax merge of k >= 1 passes over disjoint key sets in one sweep (same rule as
    `merge_attention`): o = sum_p exp(lse_p - lse) o_p, lse = logsumexp_p lse_p.

    outs: `[..., Dv]` tensors whose time axis is `dim` of the lse's `[B, H, T]` layout when
    dim=2 (`[B, H, T, Dv]` outputs), or `[B, T, H, Dv]` outputs with dim=1. Rows where every
    pass is empty (lse = -inf) get o = 0, lse = -inf.
    """
    wide = torch.promote_types(outs[0].dtype, torch.float32)
    stacked = torch.stack([x.to(torch.promote_types(x.dtype, torch.float32)) for x in lses])  # [k, B, H, T]
    lse = torch.logsumexp(stacked, 0)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(stacked - safe)  # [k, B, H, T]
    if dim == 1:
        w = w.transpose(2, 3)  # [k, B, T, H]
    o = w[0].unsqueeze(-1).to(wide) * outs[0].to(wide)  # a fresh tensor: accumulate in place
    for wi, oi in zip(w[1:], outs[1:]):
        o.addcmul_(wi.unsqueeze(-1).to(wide), oi.to(wide))
    return o.to(outs[0].dtype), lse


def lambda_two_pass(
    kernel: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rotary: Rotary,
    lp: LambdaParams,
    q_offset: int,
    scale: float,
    activation: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """LM-Infinite from two kernel passes merged by lse; q, k UNROTATED `[B, T, H, D]`.

    pass A: rotated q/k, mask `sliding_window(left=n_local - 1)` over all Tk keys;
    pass B: capped q on the first G' keys at position 0, mask: j < n_global and
            i - j >= n_local (global keys inside the window stay in pass A only).
    Both passes use the caller's absolute q_offset (pass B has only G' keys).
    """
    li = lambda_inputs(q, k, rotary, lp, q_offset)
    o_a, lse_a = kernel(
        li.q_rot, li.k_rot, v, mask=sliding_window(left=lp.n_local - 1), q_offset=q_offset,
        scale=scale, activation=activation,
    )  # fmt: skip
    n_glob = li.k_glob.shape[1]
    if n_glob == 0:
        return o_a, lse_a
    mask_b: MaskMod = lambda_global_mask(lp.n_global, lp.n_local)
    o_b, lse_b = kernel(
        li.q_cap, li.k_glob, v[:, :n_glob], mask=mask_b, q_offset=q_offset, scale=scale,
        activation=activation,
    )  # fmt: skip
    return merge_attention(o_a, lse_a, o_b, lse_b, activation=activation)
