"""The one list of attention methods, and what is derived from it.

`ATTENTION_METHODS` (name -> class) is the only list of methods: configs (`method_from_dict`,
`lcx.MethodConfig`, CLI flags, lm-eval `--model_args`, serve JSON), the engine, the vLLM plugin,
the report and every test grid over methods read it. A method is one module
(`lcx.methods.<name>`: its dataclass, validation, reference and factory, see
`lcx.methods.base`); adding one is its module plus its two lines here (the import and the
entry). What the registry imports from a method's module is also exported by `lcx.methods`.

`examples()`: every method's `examples` as methods, the cases every test grid over methods is
generated from (reference vs backends, last query, decode rule, C++ kernel, engine, bounded
cache), so a new method is tested by every grid whose fast path it has.
"""

# ruff: noqa: F401 -- the method imports below are also the package's exports (`__all__`, at the end)
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .base import AttentionMethod
from .causal import Causal, causal
from .dca import DCA, chunkllama_dca, dca, dca_from_hf_config, dca_ref
from .lm_infinite import LMInfinite, lm_infinite
from .self_extend import SelfExtend, self_extend, self_extend_ref
from .sinks import Sinks, sinks
from .sliding_window import SlidingWindow, sliding_window
from .string import STRING, string, string_distances, string_ref
from .swat import SWAT, swat

# name -> class, in this order. The only list of attention methods; tests iterate over it.
ATTENTION_METHODS: dict[str, type[AttentionMethod]] = {
    cls.name: cls for cls in (Causal, LMInfinite, SlidingWindow, Sinks, SelfExtend, SWAT, DCA, STRING)
}
# the methods whose caches hold unrotated keys (read from the classes; not a second list)
UNROTATED_METHODS: tuple[str, ...] = tuple(n for n, cls in ATTENTION_METHODS.items() if cls.needs_unrotated_keys)


def method_from_dict(d: Mapping[str, Any] | AttentionMethod) -> AttentionMethod:
    """`{"type": "lm_infinite", "n_global": 16, "n_local": 256}` -> method; unknown keys raise."""
    if isinstance(d, AttentionMethod):
        return d
    d = dict(d)
    kind = d.pop("type", None)
    if kind not in ATTENTION_METHODS:
        raise ValueError(f"attention method type {kind!r} is not known; known: {sorted(ATTENTION_METHODS)}")
    cls = ATTENTION_METHODS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"attention method {kind!r}: unknown key(s) {unknown}; accepted: {sorted(names)}")
    missing = sorted(f.name for f in dataclasses.fields(cls)
                     if f.name not in d and f.default is dataclasses.MISSING)
    if missing:
        raise ValueError(f"attention method {kind!r}: missing key(s) {missing}")
    return cls(**d)


def examples() -> list[AttentionMethod]:
    """Every registered method's `examples`, in registry order (see the module docstring)."""
    return [m for cls in ATTENTION_METHODS.values() for m in cls.example_methods()]


def method_id(method: AttentionMethod) -> str:
    """A short readable name of a method and its parameters (those not at their default), for
    test ids and labels: `lm_infinite(n_global=2,n_local=4,limit_distance=9)`."""
    params = {k: v for k, v in method.to_dict().items() if k != "type"}
    return f"{method.name}({','.join(f'{k}={v}' for k, v in params.items())})".replace(" ", "")


# The package's public names (`lcx.methods` star-imports them): the registry's own and what it
# imports from the methods' modules, so a new method's import line above also exports it.
_METHOD_MODULES = {cls.__module__ for cls in ATTENTION_METHODS.values()}
__all__ = ["ATTENTION_METHODS", "UNROTATED_METHODS", "examples", "method_from_dict", "method_id"] + sorted(
    n for n, v in list(globals().items()) if not n.startswith("_") and getattr(v, "__module__", None) in _METHOD_MODULES)
