"""A model's own attention method, recorded in its HF config.

A model trained with an `lcx.methods` attention method (SWAT: `lcx train lm --attention swat`)
records that method in its config, so it survives `save_pretrained` and every lcx component
finds it the same way. The record is `lcx.MethodConfig`'s attention form: the method's dict
(`method.to_dict()`) plus, optionally, the `lcx.attention` backends of its calls (a speed
choice; every backend computes the same thing):

    config.lcx_attention = {"type": "swat", "window": 128, "alibi_slopes": [0.0625, ...],
                            "backend": "blockwise"}

- `recorded_method(model_or_config)` reads it back as a `RecordedMethod` (the method and its
  backends, the fields of `lcx.MethodConfig` of the same names; None for a model with stock
  attention). `lcx.engine` takes a model's bounded KV cache from it, exactly as
  for a method it applies itself (`method.cache_window`); `lcx.hf.swat` runs the method
  inside transformers from it.
- `record_method(config, method, backend=...)` writes it (`lcx.models.swat.swat_config`).

Keys are checked when read (`ValueError` naming `config.lcx_attention` and the bad key), so a
hand-edited config fails loudly instead of running something else.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Mapping

from lcx.attention import BACKENDS
from lcx.methods.base import AttentionMethod
from lcx.methods.registry import ATTENTION_METHODS, method_from_dict

CONFIG_KEY = "lcx_attention"
_BACKEND_KEYS = ("backend", "decode_backend")


@dataclass(frozen=True)
class RecordedMethod:
    """The attention method a model's config records, and the `lcx.attention` backends of its
    calls (None: the default), named as `lcx.MethodConfig`'s fields."""

    attention: AttentionMethod
    backend: str | None = None
    decode_backend: str | None = None

    def __post_init__(self) -> None:
        for key in _BACKEND_KEYS:
            value = getattr(self, key)
            if value is not None and value not in BACKENDS:
                raise ValueError(f"{key}={value!r} is not an lcx.attention backend; known: {sorted(BACKENDS)}")

    def to_dict(self) -> dict[str, Any]:
        """The record: the method's dict plus the backends that are set."""
        return {**self.attention.to_dict(), **{k: getattr(self, k) for k in _BACKEND_KEYS if getattr(self, k)}}


def recorded_method(model_or_config: Any) -> RecordedMethod | None:
    """The `RecordedMethod` (attention method + backends) a model's config records in
    `config.lcx_attention`, or None. Takes a model, its config, or a config dict (config.json)."""
    config = model_or_config if isinstance(model_or_config, Mapping) else getattr(
        model_or_config, "config", model_or_config)
    d = config.get(CONFIG_KEY) if isinstance(config, Mapping) else getattr(config, CONFIG_KEY, None)
    if not d:
        return None
    if not isinstance(d, Mapping):
        raise ValueError(f"config.{CONFIG_KEY} must be an attention method dict, got {d!r}")
    try:
        key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))
        hash(key)
    except TypeError:  # an unhashable value: parse it uncached (and let the parse name it)
        return _parse(dict(d))
    return _parse_cached(key)  # read at every attention call of a SWAT layer: parse once


@functools.lru_cache(maxsize=64)
def _parse_cached(key: tuple) -> Any:
    return _parse({k: list(v) if isinstance(v, tuple) else v for k, v in key})


def _parse(d: dict[str, Any]) -> RecordedMethod:
    kind = d.get("type")
    if kind not in ATTENTION_METHODS:
        raise ValueError(f"config.{CONFIG_KEY} type {kind!r} is not an lcx attention method; "
                         f"known: {sorted(ATTENTION_METHODS)}")
    accepted = {"type", *(f.name for f in dataclasses.fields(ATTENTION_METHODS[kind])), *_BACKEND_KEYS}
    unknown = sorted(set(d) - accepted)
    if unknown:
        raise ValueError(f"unknown {CONFIG_KEY} key(s) {unknown}; accepted: {sorted(accepted)}")
    try:
        return RecordedMethod(method_from_dict({k: v for k, v in d.items() if k not in _BACKEND_KEYS}),
                              **{k: d[k] for k in _BACKEND_KEYS if k in d})
    except ValueError as e:
        raise ValueError(f"config.{CONFIG_KEY}: {e}") from None


def record_method(config: Any, method: Any, *, backend: str | None = None,
                  decode_backend: str | None = None) -> dict[str, Any]:
    """Write `method` (an `lcx.methods` method or its dict) and its backends into
    `config.lcx_attention` (validated first); returns the record."""
    record = RecordedMethod(method_from_dict(method), backend, decode_backend).to_dict()
    setattr(config, CONFIG_KEY, record)
    return record


__all__ = ["CONFIG_KEY", "RecordedMethod", "record_method", "recorded_method"]
