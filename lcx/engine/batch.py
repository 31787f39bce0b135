"""A prefill's KV cache tensors as an HF cache view (layout: `lcx.engine`)."""

from __future__ import annotations


import torch


def hf_cache(keys: list[torch.Tensor], values: list[torch.Tensor]):
    """An HF `DynamicCache` whose layers hold these tensors (no copy; HF's update concatenates)."""
    from transformers.cache_utils import DynamicCache

    hf = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in zip(keys, values)])
    for layer, k, v in zip(hf.layers, keys, values):
        layer.keys, layer.values = k, v
    return hf
