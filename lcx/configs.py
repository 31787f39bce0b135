"""Configs are data: frozen dataclasses built from dicts that name every key they take.

`strict_from_dict(cls, d)` is the one builder of a config dataclass from a mapping: an unknown
key raises `ValueError` naming it and the accepted ones (never silently ignored), a missing
required key one naming it (not a `TypeError` from the constructor). Its users: `EngineConfig`,
the training and study configs (`lcx.train.lm`, `studies.modadd`), the benchmarks' stored
configs (`lcx bench decode --merge`). Configs with richer spellings (`lcx.MethodConfig`, `lcx.rope.RopeSpec`, `lcx.methods.method_from_dict`)
validate their own keys the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def strict_from_dict(cls: type[T], d: Mapping[str, Any]) -> T:
    """`cls(**d)` for a config dataclass, rejecting unknown keys, and missing required ones, by name
    (`ValueError`, which the `lcx` command line prints as one line)."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = {f.name for f in fields}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s) {unknown}; accepted: {sorted(names)}")
    missing = [f.name for f in fields if f.name not in d and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{cls.__name__}: missing key(s) {missing}")
    return cls(**d)


__all__ = ["strict_from_dict"]
