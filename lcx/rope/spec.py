"""`RopeSpec`: the validated, frozen description of one RoPE variant.

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
import math
from dataclasses import dataclass
from typing import Any, Mapping

from .types import ROPE_TYPES  # the registry is the only list of types

# Keys accepted in a dict but carried by the model, not by the RoPE variant.
_IGNORED_HF_KEYS = {"max_position_embeddings"}


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
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type={self.rope_type!r} is not a known RoPE type; known: {sorted(ROPE_TYPES)}"
            )
        required, optional = ROPE_TYPES[self.rope_type].required, ROPE_TYPES[self.rope_type].optional
        allowed = required | optional
        for f in dataclasses.fields(self):
            if f.name in ("rope_type", "rope_theta", "partial_rotary_factor"):
                continue
            v = getattr(self, f.name)
            if f.name in required and v is None:
                raise ValueError(f"rope_type={self.rope_type!r} requires {f.name!r}")
            if v is not None and f.name not in allowed:
                raise ValueError(
                    f"key {f.name!r} does not apply to rope_type={self.rope_type!r} "
                    f"(accepted: {sorted(allowed) or 'none'})"
                )
        if self.rope_theta is not None:
            _positive("rope_theta", self.rope_theta)
        if not (0.0 < self.partial_rotary_factor <= 1.0):
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.factor is not None:
            _finite("factor", self.factor)
            if self.factor < 1.0:
                raise ValueError(f"factor must be >= 1 (it is new_length / original_length), got {self.factor}")
        if self.original_max_position_embeddings is not None:
            if int(self.original_max_position_embeddings) != self.original_max_position_embeddings or (
                self.original_max_position_embeddings < 1
            ):
                raise ValueError(
                    "original_max_position_embeddings must be a positive integer, "
                    f"got {self.original_max_position_embeddings!r}"
                )
        for name in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor", "truncate_length",
                     "attention_factor", "mscale", "mscale_all_dim"):
            v = getattr(self, name)
            if v is not None:
                _positive(name, v)
        if self.rope_type == "yarn":
            bf = self.beta_fast if self.beta_fast is not None else 32.0
            bs = self.beta_slow if self.beta_slow is not None else 1.0
            if bf <= bs:
                raise ValueError(f"beta_fast ({bf}) must be larger than beta_slow ({bs})")
            if (self.mscale is None) != (self.mscale_all_dim is None):
                raise ValueError("mscale and mscale_all_dim must be given together")
        if self.rope_type == "llama3":
            lo = self.low_freq_factor if self.low_freq_factor is not None else 1.0
            hi = self.high_freq_factor if self.high_freq_factor is not None else 4.0
            if hi <= lo:
                raise ValueError(f"high_freq_factor ({hi}) must be larger than low_freq_factor ({lo})")
        if self.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                for x in getattr(self, name):
                    if not (math.isfinite(x) and x > 0):
                        raise ValueError(f"{name} entries must be finite and > 0, got {x}")
            if len(self.short_factor) != len(self.long_factor):
                raise ValueError(
                    f"short_factor has {len(self.short_factor)} entries but long_factor has "
                    f"{len(self.long_factor)}; both need rotary_dim/2"
                )

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
        unknown = sorted(set(d) - names - _IGNORED_HF_KEYS)
        if unknown:
            raise ValueError(f"unknown RoPE key(s) {unknown}; accepted: {sorted(names)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def for_model(cls, d: Mapping[str, Any] | "RopeSpec" | None, config: Any) -> "RopeSpec":
        """Resolve a (possibly partial) spec against a model config.

        Fills `rope_theta` and, for types that use it, `original_max_position_embeddings`
        from the model (its rope_parameters / max_position_embeddings) when they are not given,
        so `{"rope_type": "yarn", "factor": 4}` means "4x this model's context". A config with
        RoPE per layer type (Gemma 3: `{"full_attention": {...}, "sliding_attention": {...}}`)
        resolves against its global layers' entry, the one `lcx.patch` scales.
        """
        d = dict(d.to_dict()) if isinstance(d, RopeSpec) else dict(d or {})
        model_rope = dict(getattr(config, "rope_parameters", None) or {})
        if isinstance(model_rope.get("full_attention"), Mapping):  # per layer type: the global layers'
            model_rope = dict(model_rope["full_attention"])
        if d.get("rope_theta") is None:
            theta = model_rope.get("rope_theta", getattr(config, "rope_theta", None))
            if theta is None:
                raise ValueError("the model config has no rope_theta; pass rope_theta explicitly")
            d["rope_theta"] = float(theta)
        rtype = d.get("rope_type", d.get("type", "default"))
        entry = ROPE_TYPES.get(rtype)
        L_key = "original_max_position_embeddings"
        if entry is not None and L_key in (entry.required | entry.optional) and d.get(L_key) is None:
            L = model_rope.get(L_key) or getattr(config, "max_position_embeddings", None)
            if L is None:
                raise ValueError(f"rope_type={rtype!r} needs {L_key!r} and the model config has none")
            d[L_key] = int(L)
        if rtype == "longrope" and d.get("factor") is None:
            # Phi-3 style configs leave `factor` out and mean max_position_embeddings / L
            # (transformers does the same); it sets the attention temperature.
            max_pos = getattr(config, "max_position_embeddings", None)
            if max_pos and d.get(L_key) and max_pos > d[L_key]:
                d["factor"] = max_pos / d[L_key]
        return cls.from_dict(d)

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


def _finite(name: str, v: float) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")


def _positive(name: str, v: float) -> None:
    _finite(name, v)
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {v!r}")


__all__ = ["RopeSpec"]
