"""LM-Infinite's Λ-shaped mask (arXiv 2308.16137): `n_global` first keys + `n_local` recent keys.

Query i sees `j < n_global` (j <= i) and `i - n_local < j <= i` (n_local keys, itself
included, i.e. `sliding_window(left=n_local - 1)`). A global key inside the local window is one
key, seen once. The mask alone is not LM-Infinite: its distance cap lives in
`lcx.attention.lambda_attention_ref`.
"""

from __future__ import annotations

from .base import KeySpan, MaskMod, check_count, named
from .compose import or_masks
from .global_tokens import global_tokens
from .sliding_window import sliding_window


def lambda_mask(n_global: int, n_local: int) -> MaskMod:
    check_count("n_global", n_global, 0)
    check_count("n_local", n_local, 1)
    inner = or_masks(global_tokens(n_global), sliding_window(left=n_local - 1))

    def lambda_mask_mod(b, h, q_idx, kv_idx):
        return inner(b, h, q_idx, kv_idx)

    return named(
        lambda_mask_mod,
        f"lambda_{n_global}_{n_local}",
        KeySpan(n_global, n_local - 1),
        {"n_global": n_global, "n_local": n_local},
        exact=True,
    )
