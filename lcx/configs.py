"""Configs are data: frozen dataclasses built from dicts that name every key they take.

`strict_from_dict(cls, d)` is the one builder of a config dataclass from a mapping: an unknown
key raises `ValueError` naming it and the accepted ones (never silently ignored). Configs with
richer spellings (`lcx.MethodConfig`, `lcx.rope.RopeSpec`, `lcx.methods.method_from_dict`)
validate their own keys the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def strict_from_dict(cls: type[T], d: Mapping[str, Any]) -> T:
    """`cls(**d)` for a config dataclass, rejecting unknown keys by name."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s) {unknown}; accepted: {sorted(names)}")
    return cls(**d)


__all__ = ["strict_from_dict"]
