"""`RopeSpec`: the validated, frozen description of one RoPE variant; `PartialRopeSpec`: one as a
user gives it, checked where it enters and resolved once against a model (`resolve`).

Key names are Hugging Face's (`rope_type`, `rope_theta`, `factor`,
`original_max_position_embeddings`, `beta_fast`, `beta_slow`, `attention_factor`,
`mscale`, `mscale_all_dim`, `truncate`, `low_freq_factor`, `high_freq_factor`,
`short_factor`, `long_factor`, `partial_rotary_factor`) so a config moves between
transformers, vLLM and lcx unchanged. lcx adds one type of its own, `truncate`
(Giraffe's truncated basis), with one key, `truncate_length`.

Unlike transformers, every bad value raises `ValueError` naming the key; nothing warns.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from .types import ROPE_TYPES  # the registry is the only list of types

# Keys accepted in a dict but carried by the model, not by the RoPE variant.
IGNORED_HF_KEYS = frozenset({"max_position_embeddings"})
_IGNORED_HF_KEYS = IGNORED_HF_KEYS  # (the name earlier code imports)


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE variant. Build with `RopeSpec(...)` or `RopeSpec.from_dict(hf_style_dict)`.

    `factor` is the context-extension ratio s (new length / original length L).
    """

    rope_type: str = "default"
    rope_theta: float | None = None  # None: inherit the model's base (see `for_model`)
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None  # yarn: floor/ceil the correction range (HF default True)
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # longrope
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    # truncate (Giraffe): wavelengths longer than this many positions are cut (default: L)
    truncate_length: float | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, tuple):
                object.__setattr__(self, name, tuple(float(x) for x in v))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        _validate({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, partial=False)

    # ------------------------------------------------------------------ helpers
    def rotary_dim(self, head_dim: int) -> int:
        """Number of rotated channels of a head (even); the rest pass through unrotated."""
        if head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {head_dim}")
        dim = int(head_dim * self.partial_rotary_factor)
        if dim < 2 or dim % 2:
            raise ValueError(
                f"head_dim={head_dim} x partial_rotary_factor={self.partial_rotary_factor} gives "
                f"rotary dim {dim}; it must be an even number >= 2"
            )
        if self.rope_type == "longrope" and len(self.short_factor) != dim // 2:
            raise ValueError(
                f"short_factor/long_factor have {len(self.short_factor)} entries; rotary dim {dim} needs {dim // 2}"
            )
        return dim

    @property
    def is_length_dependent(self) -> bool:
        """True when inv_freq depends on the current sequence length (`RopeType.length_dependent`:
        dynamic NTK, longrope)."""
        return ROPE_TYPES[self.rope_type].length_dependent

    def to_dict(self) -> dict[str, Any]:
        """HF-style dict with only the keys that are set (lists for the longrope factors)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name == "partial_rotary_factor" and v == 1.0:
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | "RopeSpec" | None) -> "RopeSpec":
        """Build from an HF `rope_parameters` / `rope_scaling` dict; unknown keys raise ValueError.

        Accepts the legacy key `type` for `rope_type`, and ignores keys that belong to the
        model rather than the RoPE variant (`max_position_embeddings`).
        """
        if d is None:
            return cls()
        if isinstance(d, RopeSpec):
            return d
        d = dict(d)
        if "type" in d:
            if "rope_type" in d and d["rope_type"] != d["type"]:
                raise ValueError(f"both 'type'={d['type']!r} and 'rope_type'={d['rope_type']!r} given")
            d["rope_type"] = d.pop("type")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names - IGNORED_HF_KEYS)
        if unknown:
            raise ValueError(f"unknown RoPE key(s) {unknown}; accepted: {sorted(names)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def for_model(cls, d: Mapping[str, Any] | "RopeSpec" | None, config: Any) -> "RopeSpec":
        """Resolve a (possibly partial) spec against a model config: `PartialRopeSpec(d).resolve(config)`
        (None or {} is the model's own base with the default type)."""
        return PartialRopeSpec(d or {"rope_type": "default"}).resolve(config)

    def replace(self, **changes: Any) -> "RopeSpec":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """Short label such as `yarn(s=16)` used in tables and plots."""
        if self.rope_type == "default":
            return "default"
        if self.factor is not None:
            return f"{self.rope_type}(s={self.factor:g})"
        if self.rope_type == "truncate":
            return f"truncate(T={self.truncate_length or self.original_max_position_embeddings})"
        return self.rope_type



# Keys a partial spec may leave out because the model supplies them (`PartialRopeSpec.resolve`):
# rope_theta is optional everywhere, the original length is filled for the types that take it.
MODEL_KEYS = frozenset({"rope_theta", "original_max_position_embeddings"})


def _validate(s: Mapping[str, Any], *, partial: bool) -> None:
    """Check a spec's values (`s`: every RopeSpec field, None where unset). `partial`: the keys
    the model supplies (`MODEL_KEYS`) may still be missing; everything given is checked as in
    a full spec. Raises ValueError naming the key."""
    t = s["rope_type"]
    if t not in ROPE_TYPES:
        raise ValueError(f"rope_type={t!r} is not a known RoPE type; known: {sorted(ROPE_TYPES)}")
    required, optional = ROPE_TYPES[t].required, ROPE_TYPES[t].optional
    allowed = required | optional
    for name, v in s.items():
        if name in ("rope_type", "rope_theta", "partial_rotary_factor"):
            continue
        if name in required and v is None and not (partial and name in MODEL_KEYS):
            raise ValueError(f"rope_type={t!r} requires {name!r}")
        if v is not None and name not in allowed:
            raise ValueError(f"key {name!r} does not apply to rope_type={t!r} (accepted: {sorted(allowed) or 'none'})")
    if s["rope_theta"] is not None:
        _positive("rope_theta", s["rope_theta"])
    prf = s["partial_rotary_factor"]
    if not (isinstance(prf, (int, float)) and not isinstance(prf, bool) and 0.0 < prf <= 1.0):
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {prf!r}")
    if s["factor"] is not None:
        _finite("factor", s["factor"])
        if s["factor"] < 1.0:
            raise ValueError(f"factor must be >= 1 (it is new_length / original_length), got {s['factor']}")
    L = s["original_max_position_embeddings"]
    if L is not None and (isinstance(L, bool) or not isinstance(L, (int, float)) or int(L) != L or L < 1):
        raise ValueError(f"original_max_position_embeddings must be a positive integer, got {L!r}")
    for name in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor", "truncate_length",
                 "attention_factor", "mscale", "mscale_all_dim"):
        if s[name] is not None:
            _positive(name, s[name])
    if t == "yarn":
        bf = s["beta_fast"] if s["beta_fast"] is not None else 32.0
        bs = s["beta_slow"] if s["beta_slow"] is not None else 1.0
        if bf <= bs:
            raise ValueError(f"beta_fast ({bf}) must be larger than beta_slow ({bs})")
        if (s["mscale"] is None) != (s["mscale_all_dim"] is None):
            raise ValueError("mscale and mscale_all_dim must be given together")
    if t == "llama3":
        lo = s["low_freq_factor"] if s["low_freq_factor"] is not None else 1.0
        hi = s["high_freq_factor"] if s["high_freq_factor"] is not None else 4.0
        if hi <= lo:
            raise ValueError(f"high_freq_factor ({hi}) must be larger than low_freq_factor ({lo})")
    if t == "longrope":
        for name in ("short_factor", "long_factor"):
            for x in s[name]:
                if not (math.isfinite(x) and x > 0):
                    raise ValueError(f"{name} entries must be finite and > 0, got {x}")
        if len(s["short_factor"]) != len(s["long_factor"]):
            raise ValueError(f"short_factor has {len(s['short_factor'])} entries but long_factor has "
                             f"{len(s['long_factor'])}; both need rotary_dim/2")


def _factors(name: str, v: Any) -> tuple[float, ...]:
    """longrope's per-channel factors as a tuple of floats (a list or tuple of numbers)."""
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise ValueError(f"{name} must be a list of numbers, got {v!r}")
    try:
        return tuple(float(x) for x in v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of numbers, got {v!r}") from None


class PartialRopeSpec(Mapping):
    """A RoPE spec as a user gives it (`lcx.MethodConfig.rope`): HF key names, possibly partial.

    Checked once, where it enters (a config, the command line, lm-eval `--model_args`): unknown
    keys, a missing `rope_type`, bad values raise `ValueError` naming the key, exactly as a full
    `RopeSpec` would, except that the keys the model supplies (`MODEL_KEYS`: `rope_theta`,
    `original_max_position_embeddings`) may be missing. Resolved once against a model by
    `resolve(model_config) -> RopeSpec` (`{"rope_type": "yarn", "factor": 4}` is 4x that model's
    context). transformers takes the same two hops (`rope_config_validation` at config time, the
    init function at model time).

    A read-only mapping, hashable and picklable (a config crosses process boundaries: the
    server's engine process, lm-eval workers); the legacy key `type` is read as `rope_type`,
    model keys (`max_position_embeddings`) are dropped, longrope's factors are kept as tuples
    (`to_dict` gives them back as lists). Equal to a dict with the same items.
    """

    __slots__ = ("_d",)

    def __init__(self, d: "Mapping[str, Any] | RopeSpec | None" = None):
        if isinstance(d, RopeSpec):
            d = d.to_dict()
        if d is not None and not isinstance(d, Mapping):
            raise ValueError(f"a RoPE spec must be a dict of HF-style keys, got {d!r}")
        d = dict(d or {})
        if "type" in d:  # HF's legacy name
            if "rope_type" in d and d["rope_type"] != d["type"]:
                raise ValueError(f"both 'type'={d['type']!r} and 'rope_type'={d['rope_type']!r} given")
            d["rope_type"] = d.pop("type")
        d = {k: v for k, v in d.items() if v is not None and k not in IGNORED_HF_KEYS}
        unknown = sorted(set(d) - _FIELDS)
        if unknown:
            raise ValueError(f"unknown RoPE key(s) {unknown}; accepted: {sorted(_FIELDS)}")
        if d and "rope_type" not in d:
            raise ValueError(f"RoPE keys {sorted(d)} given without rope_type")
        for name in ("short_factor", "long_factor"):
            if d.get(name) is not None:
                d[name] = _factors(name, d[name])
        _validate({**_DEFAULTS, **d}, partial=True)
        object.__setattr__(self, "_d", d)

    @property
    def rope_type(self) -> str:
        return self._d.get("rope_type", "default")

    def resolve(self, config: Any) -> "RopeSpec":
        """The full spec for a model config: `rope_theta`, a partial rotary family's
        `partial_rotary_factor` and, for the types that take it,
        `original_max_position_embeddings` filled from the model (its rope_parameters /
        max_position_embeddings) when they are not given. A config with RoPE per layer type
        (Gemma 3: `{"full_attention": {...}, "sliding_attention": {...}}`) resolves against its
        global layers' entry, the one `lcx.patch` scales."""
        d = dict(self._d)
        model_rope = model_rope_parameters(config)
        if d.get("rope_theta") is None:
            theta = model_rope.get("rope_theta", getattr(config, "rope_theta", None))
            if theta is None:
                raise ValueError("the model config has no rope_theta; pass rope_theta explicitly")
            d["rope_theta"] = float(theta)
        if d.get("partial_rotary_factor") is None:  # a partial rotary family's (Phi, StableLM, ...)
            prf = model_rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
            if prf is not None and float(prf) != 1.0:
                d["partial_rotary_factor"] = float(prf)
        t = self.rope_type
        entry = ROPE_TYPES[t]
        L_key = "original_max_position_embeddings"
        if L_key in (entry.required | entry.optional) and d.get(L_key) is None:
            L = model_rope.get(L_key) or getattr(config, "max_position_embeddings", None)
            if L is None:
                raise ValueError(f"rope_type={t!r} needs {L_key!r} and the model config has none")
            d[L_key] = int(L)
        if t == "longrope" and d.get("factor") is None:
            # Phi-3 style configs leave `factor` out and mean max_position_embeddings / L
            # (transformers does the same); it sets the attention temperature.
            max_pos = getattr(config, "max_position_embeddings", None)
            if max_pos and d.get(L_key) and max_pos > d[L_key]:
                d["factor"] = max_pos / d[L_key]
        return RopeSpec.from_dict(d)

    def describe(self) -> str:
        """`yarn(s=4)`, `truncate(T=256)`, `truncate` (T: the model's length)... without a model."""
        if self._d.get("factor") is not None:
            return f"{self.rope_type}(s={self._d['factor']:g})"
        if self._d.get("truncate_length") is not None:
            return f"{self.rope_type}(T={self._d['truncate_length']:g})"
        return self.rope_type

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (tuples as lists: the JSON form)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._d.items()}

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a PartialRopeSpec is read-only")

    def __hash__(self) -> int:
        return hash(json.dumps(self._d, sort_keys=True, default=repr))

    def __reduce__(self) -> tuple[Any, ...]:
        return (PartialRopeSpec, (self._d,))

    def __repr__(self) -> str:
        return f"PartialRopeSpec({self._d!r})"


_FIELDS = frozenset(f.name for f in dataclasses.fields(RopeSpec))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RopeSpec)}


def model_rope_parameters(config: Any) -> dict[str, Any]:
    """A model config's own RoPE parameters (`rope_parameters`, {} when it has none); for a config
    with RoPE per layer type (Gemma 3: `{"full_attention": {...}, "sliding_attention": {...}}`)
    the global layers' entry, the one `lcx.patch` scales. A pretraining length kept outside
    rope_parameters (Phi-3: `config.original_max_position_embeddings`, which transformers reads
    there for the types that take one) is added as `original_max_position_embeddings`: every
    resolution of a spec against a model (`PartialRopeSpec.resolve`, `lcx.hf.resolve_rope`) takes
    its L from here, so L is one number per model (Phi-3-128k: 4096, not max_position_embeddings)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), Mapping):
        rope = dict(rope["full_attention"])
    L = getattr(config, "original_max_position_embeddings", None)
    if L is not None and rope.get("original_max_position_embeddings") is None:
        rope["original_max_position_embeddings"] = L
    return rope


def _finite(name: str, v: float) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")


def _positive(name: str, v: float) -> None:
    _finite(name, v)
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {v!r}")


__all__ = ["MODEL_KEYS", "PartialRopeSpec", "RopeSpec"]
