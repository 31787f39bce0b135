"""RoPE library: the registry of RoPE types, specs, rotary tables and the reference rotation.

>>> from lcx.rope import RopeSpec, compute_inv_freq
>>> inv_freq, attention_factor = compute_inv_freq(
...     RopeSpec(rope_type="yarn", factor=16, original_max_position_embeddings=256), head_dim=64)
"""

from .rotary import (
    apply_rotary_ref,
    rope_angles,
    rope_cos_sin,
    rope_cos_sin_for_spec,
    rotate_by_positions_ref,
    rotate_half,
)
from .rotary import compute_inv_freq
from .spec import PartialRopeSpec, RopeSpec
from .types import ROPE_TYPES, RopeType

__all__ = [
    "ROPE_TYPES",
    "PartialRopeSpec",
    "RopeSpec",
    "RopeType",
    "apply_rotary_ref",
    "compute_inv_freq",
    "rope_angles",
    "rope_cos_sin",
    "rope_cos_sin_for_spec",
    "rotate_by_positions_ref",
    "rotate_half",
]
