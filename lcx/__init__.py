"""lcx: a long-context extrapolation and inference-serving testbed.

Core entry points (heavy modules are imported lazily so `import lcx` stays cheap and never
touches optional packages such as triton, vllm, lm-eval or flash-attn):

- `lcx.RopeSpec`, `lcx.rope` — RoPE types and rotary maths.
- `lcx.load_model(name_or_path)` — offline model + tokenizer loading (HF dir, GGUF, presets).
- `lcx.patch(model, spec)` / `lcx.unpatch(model)` / `lcx.patched(model, spec)` — apply a RoPE spec.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "RopeSpec": ("lcx.rope", "RopeSpec"),
    "load_model": ("lcx.models", "load_model"),
    "patch": ("lcx.patching", "patch"),
    "unpatch": ("lcx.patching", "unpatch"),
    "patched": ("lcx.patching", "patched"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(import_module(mod), attr)
    raise AttributeError(f"module 'lcx' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
