"""The engine's methods (the extension point): `ENGINE_METHODS`, the KV policies of bounded caches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn


# ============================================================================================
# Methods (the extension point)
# ============================================================================================

def _method_config(methods: Mapping[str, Any]) -> Any:
    from ..method_config import NESTED_KEYS, MethodConfig

    return MethodConfig.from_dict({k: v for k, v in methods.items() if k in NESTED_KEYS})


def _engine_methods(methods: Any) -> dict[str, Any]:
    """`EngineConfig.methods` as `{name: params}`: the MethodConfig part validated by
    `lcx.MethodConfig` (its backends folded into the `attention` entry), other registered methods
    after it."""
    from ..method_config import NESTED_KEYS, MethodConfig

    if isinstance(methods, MethodConfig):
        methods = methods.to_dict()
    if not isinstance(methods, Mapping):
        raise ValueError(f"methods must be an lcx.MethodConfig or a mapping {{name: params}}, "
                         f"got {type(methods).__name__}")
    d = _method_config(methods).to_dict()
    out: dict[str, Any] = {}
    if "rope" in d:
        out["rope"] = d["rope"]
    if "attention" in d:
        out["attention"] = {**d["attention"], **{k: d[k] for k in ("backend", "decode_backend") if k in d}}
    out.update({k: v for k, v in methods.items() if k not in NESTED_KEYS})
    return out


@dataclass(frozen=True)
class EngineMethod:
    """A long-context method the engine runs, chosen at start-up by `EngineConfig.methods`.

    apply(model, params) -> resolved: patches the loaded model in place (e.g. `lcx.patch`) and
        returns the resolved parameters (recorded in `Engine.resolved_methods`).
    context_len(model, resolved) -> int | None: the default `max_model_len` this method implies
        (e.g. L * factor for RoPE scaling); None leaves it to the model or other methods.
    What the engine caches for an attention method (which keys, rotated how, bounded or not)
    follows from the method itself (`lcx.engine.kv.CacheLayout`), not from the engine method.
    """

    name: str
    apply: Callable[[nn.Module, Mapping[str, Any]], Any]
    context_len: Callable[[nn.Module, Any], int | None] = lambda model, resolved: None
    description: str = ""


def _apply_rope(model: nn.Module, params: Mapping[str, Any]):
    from ..hf.rope_patch import current_spec, patch

    patch(model, dict(params))
    return current_spec(model)


def _rope_context_len(model: nn.Module, spec: Any) -> int | None:
    if spec is None or spec.factor is None:
        return None
    L = spec.original_max_position_embeddings or getattr(model.config, "max_position_embeddings", None)
    return int(L * spec.factor) if L else None


@dataclass(frozen=True)
class ResolvedAttention:
    """What the `attention` engine method resolved to: the `lcx.methods` method, the
    `lcx.attention` backend of every call, and whether the cache is bounded."""

    method: Any
    backend: str
    bounded: bool
    decode_backend: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.method.to_dict(), "backend": self.backend, "decode_backend": self.decode_backend,
                "bounded_cache": self.bounded}


def _apply_attention(model: nn.Module, params: Mapping[str, Any]) -> ResolvedAttention:
    from ..method_config import MethodConfig
    from ..hf.attention_patch import DEFAULT_BACKEND

    cfg = MethodConfig.from_dict({"attention": params})
    cfg.apply(model)
    # kv_window is None when a bounded cache cannot reproduce the method (e.g. LM-Infinite with
    # limit_distance > G + L - 1): the whole cache is kept
    return ResolvedAttention(cfg.attention, cfg.backend or DEFAULT_BACKEND, cfg.kv_window is not None,
                             cfg.decode_backend)


def model_attention(model: nn.Module) -> ResolvedAttention | None:
    """The attention method a model runs as loaded, when its config records one
    (`lcx.hf.recorded`: a model trained with a registry method, e.g. SWAT), resolved as
    `_apply_attention` resolves one asked for, but not applied: the model already runs it, per
    row on `lcx_key_positions` like a patched model. None for a model with stock attention."""
    from ..hf.attention_patch import DEFAULT_BACKEND
    from ..hf.recorded import recorded_method

    cfg = recorded_method(model.config)
    if cfg is None:
        return None
    return ResolvedAttention(cfg.attention, cfg.backend or DEFAULT_BACKEND, cfg.kv_window is not None,
                             cfg.decode_backend)


# name -> method. The only list of engine methods; tests iterate over it.
ENGINE_METHODS: dict[str, EngineMethod] = {
    "rope": EngineMethod(
        name="rope", apply=_apply_rope, context_len=_rope_context_len,
        description="a RoPE spec from lcx.rope (HF key names; unset keys come from the model)"),
    "attention": EngineMethod(
        name="attention", apply=_apply_attention,
        description="an lcx.methods attention method ({'type': 'lm_infinite'|'sliding_window'|'sinks'|'swat'|..., "
                    "...}, optional 'backend', 'decode_backend') with a bounded per-row KV cache; without it, "
                    "the method a model's config records (e.g. a SWAT model's)"),
}


def check_method(name: str) -> EngineMethod:
    """The registered method `name`; `ValueError` naming the supported ones otherwise."""
    if name in ENGINE_METHODS:
        return ENGINE_METHODS[name]
    raise ValueError(f"unknown engine method {name!r}; supported: {sorted(ENGINE_METHODS)}")
