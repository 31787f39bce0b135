"""The padded batch's KV cache as tensors: HF cache views and left padding (layout: `lcx.engine`)."""

from __future__ import annotations


import torch


def _hf_cache(keys: list[torch.Tensor], values: list[torch.Tensor]):
    """An HF `DynamicCache` whose layers hold these tensors (no copy; HF's update concatenates)."""
    from transformers.cache_utils import DynamicCache

    hf = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in zip(keys, values)])
    for layer, k, v in zip(hf.layers, keys, values):
        layer.keys, layer.values = k, v
    return hf


def _left_pad(keys, values, mask, pos, T: int):
    """Left-pad a batch's cache to T columns (zeros, mask False, pos -1)."""
    pad = T - mask.shape[1]
    if pad == 0:
        return keys, values, mask, pos
    b = mask.shape[0]
    keys = [torch.cat([k.new_zeros(k.shape[0], k.shape[1], pad, k.shape[3]), k], 2) for k in keys]
    values = [torch.cat([v.new_zeros(v.shape[0], v.shape[1], pad, v.shape[3]), v], 2) for v in values]
    mask = torch.cat([mask.new_zeros(b, pad), mask], 1)
    pos = torch.cat([pos.new_full((b, pad), -1), pos], 1)
    return keys, values, mask, pos
