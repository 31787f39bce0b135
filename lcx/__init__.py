"""lcx: a long-context extrapolation and inference-serving testbed.

Core entry points (heavy modules are imported lazily so `import lcx` stays cheap and never
touches optional packages such as triton, vllm, lm-eval or flash-attn):

- `lcx.RopeSpec`, `lcx.rope` — RoPE types and rotary maths.
- `lcx.load_model(name_or_path)` — model + tokenizer loading (HF dir, GGUF, presets, Hub ids).
- `lcx.MethodConfig` — a RoPE spec + an attention method + backends, one value in one format
  for every entry point; `lcx.presets` — the named experiment presets (`yarn`, `lm_infinite`, ...).
- `lcx.patch(model, cfg)` / `lcx.unpatch(model)` / `lcx.patched(model, cfg)` — apply any method
  config (RoPE, attention or both; a flat HF rope dict works too), in place and reversibly.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "RopeSpec": ("lcx.rope", "RopeSpec"),
    "load_model": ("lcx.models", "load_model"),
    "MethodConfig": ("lcx.method_config", "MethodConfig"),
    "patch": ("lcx.method_config", "patch"),
    "unpatch": ("lcx.method_config", "unpatch"),
    "patched": ("lcx.method_config", "patched"),
    "presets": ("lcx.presets", None),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        module = import_module(mod)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'lcx' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
