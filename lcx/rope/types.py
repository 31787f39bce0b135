"""The RoPE registry: one pure function per type, `(spec, theta, dim, seq_len) -> (inv_freq, attention_factor)`.

Shared work is done once in `compute_inv_freq`: the rotary dim (partial rotary included) and
the unscaled frequencies `theta_i = b^(-2i/d)`, i = 0..d/2-1, in float64. Each type then maps
theta to its own inv_freq. cos and sin are later multiplied by `attention_factor` (so the
attention logits scale by its square), exactly as in transformers. Every type takes an explicit
`attention_factor`, which replaces the type's own (1 for all but yarn and longrope): transformers
reads it for yarn and longrope only; lcx's rotation applies it for every type (STRING's recipe
on a model with banded or linear RoPE keeps that RoPE and adds its constant factor, `lcx.presets`).

Notation: d rotary dim, b rope_theta, L original context
(original_max_position_embeddings), s factor, n current sequence length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # the spec validates against this registry (`RopeSpec.validate`): no runtime import back
    from .spec import RopeSpec

RopeFn = Callable[["RopeSpec", torch.Tensor, int, "int | None"], "tuple[torch.Tensor, float]"]


def rope_theta_powers(base: float, dim: int) -> torch.Tensor:
    """theta_i = base^(-2i/d) in float64, i = 0..d/2-1."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def rope_default(spec: RopeSpec, theta: torch.Tensor, dim: int, seq_len: int | None):
    return theta, 1.0


def rope_linear(spec: RopeSpec, theta: torch.Tensor, dim: int, seq_len: int | None):
    """Position interpolation (Chen et al. 2023): positions divided by s == inv_freq divided by s."""
    return theta / spec.factor, 1.0


def rope_ntk(spec: RopeSpec, theta: torch.Tensor, dim: int, seq_len: int | None):
    """Static NTK-aware scaling: b' = b * s^(d/(d-2)). (transformers has no static variant.)"""
    base = spec.rope_theta * spec.factor ** (dim / (dim - 2))
    return rope_theta_powers(base, dim), 1.0


def rope_dynamic(spec: RopeSpec, theta: torch.Tensor, dim: int, seq_len: int | None):
    """Dynamic NTK: for n > L, b' = b * ((s*n/L) - (s-1))^(d/(d-2)); unscaled for n <= L.

    `seq_len=None` means "no length known" and gives the unscaled basis, as transformers does
    at init. lcx follows transformers (the base follows the current length); vLLM's "dynamic"
    is static at n = L*s. With a KV cache of rotated keys a changing base makes old keys
    inconsistent (transformers #25104) — lcx's patch recomputes per forward like HF.
    """
    L = spec.original_max_position_embeddings
    n = L if seq_len is None else max(int(seq_len), L)
    s = spec.factor
    base = spec.rope_theta * ((s * n / L) - (s - 1)) ** (dim / (dim - 2))
    return rope_theta_powers(base, dim), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_yarn(spec: RopeSpec, theta: torch.Tensor, dim: int, seq_len: int | None):
    """YaRN (Peng et al. 2023, arXiv 2309.00071): NTK-by-parts + attention temperature.

    corr_dim(r) = d*ln(L/(2*pi*r)) / (2*ln b); dims below corr_dim(beta_fast) keep theta
    (extrapolate), dims above corr_dim(beta_slow) use theta/s (interpolate), linear ramp between.
    attention_factor = 0.1*ln(s) + 1 unless given (DeepSeek's mscale/mscale_all_dim ratio if set).
    """
    s, L, b = spec.factor, spec.original_max_position_embeddings, spec.rope_theta
    beta_fast = spec.beta_fast if spec.beta_fast is not None else 32.0
    beta_slow = spec.beta_slow if spec.beta_slow is not None else 1.0
    if spec.attention_factor is not None:
        af = float(spec.attention_factor)
    elif spec.mscale is not None:
        af = _yarn_mscale(s, spec.mscale) / _yarn_mscale(s, spec.mscale_all_dim)
    else:
        af = _yarn_mscale(s)

    def corr_dim(rotations: float) -> float:
        return dim * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(b))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if spec.truncate is None or spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp (same guard as transformers)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = (theta / s) * ramp + theta * (1 - ramp)
    return inv_freq, af


def rope_llama3(spec: RopeSpec, theta: torch.Tensor, dim: int, seq_len: int | None):
    """Llama 3.1: keep high frequencies, divide low ones by s, blend in between by wavelength."""
    s, L = spec.factor, spec.original_max_position_embeddings
    lo = spec.low_freq_factor if spec.low_freq_factor is not None else 1.0
    hi = spec.high_freq_factor if spec.high_freq_factor is not None else 4.0
    wavelen = 2 * math.pi / theta
    smooth = (L / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * theta / s + smooth * theta
    inv_freq = torch.where(wavelen > L / lo, theta / s, theta)
    medium = (wavelen >= L / hi) & (wavelen <= L / lo)
    return torch.where(medium, blended, inv_freq), 1.0


def rope_longrope(spec: RopeSpec, theta: torch.Tensor, dim: int, seq_len: int | None):
    """LongRoPE / Phi-3: per-dimension rescale factors, `long_factor` once n > L else `short_factor`.

    attention_factor = sqrt(1 + ln(s)/ln(L)) unless given; s defaults to 1 (no temperature)
    when `factor` is absent (transformers derives it from max_position_embeddings/L instead;
    pass `factor` explicitly to match a Phi-3 config). lcx switches per length like HF;
    vLLM picks short/long once at start-up from max_model_len.
    """
    L = spec.original_max_position_embeddings
    use_long = seq_len is not None and seq_len > L
    ext = torch.tensor(spec.long_factor if use_long else spec.short_factor, dtype=torch.float64)
    s = spec.factor if spec.factor is not None else 1.0
    if spec.attention_factor is not None:
        af = float(spec.attention_factor)
    else:
        af = 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(L))
    return theta / ext, af


def rope_truncate(spec: RopeSpec, theta: torch.Tensor, dim: int, seq_len: int | None):
    """Giraffe's truncated basis (Pal et al. 2023, arXiv 2308.10882).

    With cutoff c = 2*pi/T (T = truncate_length, default L): keep theta_i >= c (wavelength <= T);
    set theta_i to rho = c/16 when c/8 <= theta_i < c; set it to 0 (no rotation) below c/8.
    """
    T = spec.truncate_length or spec.original_max_position_embeddings
    if T is None:
        raise ValueError("rope_type='truncate' needs 'truncate_length' or 'original_max_position_embeddings'")
    c = 2 * math.pi / T
    rho, a = c / 16, c / 8
    inv_freq = torch.where(theta < c, torch.full_like(theta, rho), theta)
    inv_freq = torch.where(theta < a, torch.zeros_like(theta), inv_freq)
    return inv_freq, 1.0


@dataclass(frozen=True)
class RopeType:
    """A registry entry: the inv_freq function and the spec keys it requires / accepts."""

    fn: RopeFn
    required: frozenset[str] = frozenset()
    optional: frozenset[str] = frozenset()
    in_transformers: bool = True  # parity-tested against transformers' ROPE_INIT_FUNCTIONS
    # inv_freq depends on the current sequence length (`seq_len`): such a basis changes as a
    # sequence grows, so keys rotated earlier no longer match it (caches re-rotate or refuse)
    length_dependent: bool = False


def _t(fn: RopeFn, required=(), optional=(), in_transformers=True, length_dependent=False) -> RopeType:
    return RopeType(fn, frozenset(required), frozenset(optional), in_transformers, length_dependent)


_L = "original_max_position_embeddings"
ROPE_TYPES: dict[str, RopeType] = {
    "default": _t(rope_default, (), {"attention_factor"}),
    "linear": _t(rope_linear, {"factor"}, {"attention_factor"}),
    "ntk": _t(rope_ntk, {"factor"}, {"attention_factor"}, in_transformers=False),
    "dynamic": _t(rope_dynamic, {"factor", _L}, {"attention_factor"}, length_dependent=True),
    "yarn": _t(rope_yarn, {"factor", _L},
               {"beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"}),
    "llama3": _t(rope_llama3, {"factor", _L}, {"low_freq_factor", "high_freq_factor", "attention_factor"}),
    "longrope": _t(rope_longrope, {"short_factor", "long_factor", _L}, {"factor", "attention_factor"},
                    length_dependent=True),
    "truncate": _t(rope_truncate, (), {"truncate_length", _L, "attention_factor"}, in_transformers=False),
}
