"""The hooked attention call running now: set by `lcx.hf.attention_patch`'s instance forward,
read by its two hooks and by `lcx.hf.bounded_cache` (who fills the cache, and with which layer's
method). A context variable, so threads and nested models do not see each other's calls."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class AttentionCall:
    """One call of a hooked attention module."""

    module: nn.Module
    state: Any  # lcx.hf.attention_patch._ModuleState
    cache: Any = None  # the call's past_key_values
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # the family's, seen by the rotation hook
    rotation_seen: bool = False


CURRENT_CALL: contextvars.ContextVar[AttentionCall | None] = contextvars.ContextVar("lcx_attention_call", default=None)


def current_call() -> AttentionCall | None:
    """The hooked attention call running now (None outside one)."""
    return CURRENT_CALL.get()


__all__ = ["CURRENT_CALL", "AttentionCall", "current_call"]
