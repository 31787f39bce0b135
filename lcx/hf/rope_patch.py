"""Apply a RoPE spec to a loaded Hugging Face model of a supported family, in place and reversibly.

In transformers 5.x, the supported families (`lcx.hf.models.FAMILIES`) compute rotary tables once
per forward in `model.model.rotary_emb(hidden_states, position_ids) -> (cos, sin)` and hand them
to every layer. Models with RoPE per layer type (Gemma 3: `rope_parameters` nested as
{"full_attention": {...}, "sliding_attention": {...}}, `rotary_emb(x, position_ids, layer_type)`)
get the spec on the global ("full_attention") layers only, as transformers applies a scaled
`rope_parameters["full_attention"]`; the sliding layers keep their own RoPE.
`patch_rope` swaps that module for `LcxRotaryEmbedding`, which asks lcx's RoPE registry for
the inverse frequencies and builds the tables with float64 angles; attention code is untouched,
so every attention implementation of transformers (eager, sdpa, flex) sees the new positions.

    model, tok = lcx.load_model("tiny-5m")
    with lcx.patched(model, {"rope_type": "yarn", "factor": 16}):
        logits = model(ids).logits          # YaRN, 16x the model's context
    # original rotary module and config restored here

Length-dependent types (dynamic NTK, longrope) follow transformers: the basis is chosen from
the current forward's max position + 1. With a KV cache of rotated keys, dynamic NTK makes
old keys inconsistent (transformers #25104); vLLM instead fixes it at n = L*s. lcx matches HF.

Part of the HF adapter (`lcx.hf`). Callers use `lcx.patch` / `lcx.patched` / `lcx.unpatch`
(`lcx.method_config`, the one public patch trio), which apply a whole `MethodConfig` (RoPE and
attention) through this module and `lcx.hf.attention_patch`: `resolve_rope` resolves the config's
partial spec against the model once, `patch_rope` / `unpatch_rope` swap the rotary module.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from torch import nn

from ..rope import ROPE_TYPES, PartialRopeSpec, RopeSpec, compute_inv_freq, rope_angles
from .channel_order import TABLE_LAYOUTS, table_layout
from .models import check_model_type, decoder, global_layer_type, model_shape, rope_layer_types

_ORIG_ATTR = "_lcx_original"  # (rotary module, rope_parameters) stored on the patched model


class LcxRotaryEmbedding(nn.Module):
    """Drop-in for HF's `*RotaryEmbedding`: `forward(x, position_ids) -> (cos, sin)`.

    x: any tensor whose dtype/device the tables take; position_ids: [B, T] (int).
    Returns cos, sin: [B, T, r] in x.dtype, already scaled by the attention factor; r = head_dim,
    or the rotated channels of a partial rotary family (`spec.partial_rotary_factor`, as the
    family's own module: its code rotates the first r channels), laid out as the family's own
    module lays them out (`layout`, `lcx.hf.channel_order.TABLE_LAYOUTS`: [a | a], or each angle
    twice in a row for interleaved families such as Cohere), since the family's code reads them.
    """

    def __init__(self, spec: RopeSpec, head_dim: int, device: torch.device | None = None, *,
                 layer_type: str | None = None, others: nn.Module | None = None, layout: str = "halves"):
        super().__init__()
        if layout not in TABLE_LAYOUTS:
            raise ValueError(f"table layout {layout!r}; expected one of {TABLE_LAYOUTS}")
        self.spec = spec
        self.head_dim = head_dim
        self.layout = layout
        # Models with RoPE per layer type (Gemma 3): this module computes `layer_type`'s tables
        # (the global layers') and hands the other types to the model's own rotary module.
        self.layer_type = layer_type
        self.others = others
        self.rotary_dim = spec.rotary_dim(head_dim)  # tables of this width (< head_dim: partial rotary)
        inv_freq, af = compute_inv_freq(spec, head_dim, None)
        # Static basis as a float64 buffer so `.to(device)` moves it with the model.
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.attention_scaling = af
        self._by_len: dict[tuple[int, str], tuple[torch.Tensor, float]] = {}

    def _basis(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, float]:
        if not self.spec.is_length_dependent:
            return self.inv_freq, self.attention_scaling
        if self.spec.rope_type == "longrope":  # two bases only: short (n <= L) and long
            seq_len = min(seq_len, self.spec.original_max_position_embeddings + 1)
        key = (seq_len, str(device))
        if key not in self._by_len:
            if len(self._by_len) > 64:
                self._by_len.clear()
            inv, af = compute_inv_freq(self.spec, self.head_dim, seq_len)
            self._by_len[key] = (inv.to(device), af)
        return self._by_len[key]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        if self.layer_type is not None and layer_type != self.layer_type:
            if layer_type is None:
                raise ValueError("this model's RoPE is per layer type; got no layer_type "
                                 f"(lcx scales {self.layer_type!r})")
            return self.others(x, position_ids, layer_type)
        seq_len = int(position_ids.max().item()) + 1 if self.spec.is_length_dependent else 0
        inv_freq, af = self._basis(seq_len, x.device)
        ang = rope_angles(position_ids.to(x.device), inv_freq)  # [B, T, D/2] float64
        emb = torch.cat((ang, ang), -1) if self.layout == "halves" else ang.repeat_interleave(2, -1)  # [B, T, r]
        cos, sin = emb.cos(), emb.sin()
        if af != 1.0:
            cos, sin = cos * af, sin * af
        return cos.to(x.dtype), sin.to(x.dtype)

    def extra_repr(self) -> str:
        typed = f", layer_type={self.layer_type!r}" if self.layer_type is not None else ""
        return f"spec={self.spec.describe()}, head_dim={self.head_dim}{typed}"


def _inner(model: nn.Module) -> nn.Module:
    """The decoder stack that owns `rotary_emb` (`lcx.hf.decoder`), for a supported model type."""
    check_model_type(model, "lcx.patch")
    return decoder(model)


def resolve_rope(model: nn.Module, spec: PartialRopeSpec | RopeSpec | Mapping[str, Any]) -> RopeSpec:
    """`spec` (possibly partial) resolved against `model` as loaded (`PartialRopeSpec.resolve`):
    missing `rope_theta` / `original_max_position_embeddings` come from the model's original
    rope_parameters (also on a model patched already), on Gemma 3 from its global layers' entry."""
    check_model_type(model, "lcx.patch")
    partial = spec if isinstance(spec, PartialRopeSpec) else PartialRopeSpec(spec)
    return partial.resolve(loaded_config(model))


def loaded_config(model: nn.Module) -> Any:
    """`model.config` as loaded: its rope_parameters the original ones also on a model patched
    already (`patch_rope` rewrites them), the global layers' entry on Gemma 3; every other key
    the config's own. What a spec resolves against (`resolve_rope`) and what lengths are read from
    (`lcx.MethodConfig.apply`)."""
    original = getattr(model, _ORIG_ATTR, None)
    base_config = original[1] if original is not None else model.config.rope_parameters
    return _ConfigView(model.config, base_config, global_layer_type(model))


def patch_rope(model: nn.Module, spec: RopeSpec) -> nn.Module:
    """Run `spec` (resolved: `resolve_rope`) on `model` in place and return it.

    Patching an already patched model replaces the spec; `unpatch_rope` always restores the
    model as loaded. `config.rope_parameters` is updated so a saved patched model records what
    it runs. Callers apply a whole config with `lcx.patch` / `lcx.patched`, which resolve first.
    """
    if not isinstance(spec, RopeSpec) or spec.rope_theta is None:
        raise ValueError(f"patch_rope takes a RopeSpec resolved against the model (resolve_rope), got {spec!r}")
    inner = _inner(model)
    original = getattr(model, _ORIG_ATTR, None)
    base_config = original[1] if original is not None else copy.deepcopy(model.config.rope_parameters)
    layer_type = global_layer_type(model)
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else None
    own_rotary = original[0] if original is not None else inner.rotary_emb
    shape = model_shape(model)
    if spec.rotary_dim(shape.head_dim) != shape.rotary_dim:
        raise ValueError(f"{spec.describe()} rotates {spec.rotary_dim(shape.head_dim)} of {shape.head_dim} channels "
                         f"(partial_rotary_factor={spec.partial_rotary_factor}); this model rotates {shape.rotary_dim}")
    new = LcxRotaryEmbedding(spec, shape.head_dim, device=device, layer_type=layer_type,
                             others=own_rotary if layer_type is not None else None,
                             layout=_table_layout(own_rotary, model))
    if original is None:
        setattr(model, _ORIG_ATTR, (inner.rotary_emb, base_config))
    inner.rotary_emb = new
    if layer_type is None:
        model.config.rope_parameters = spec.to_dict()
    else:  # Gemma 3: only the global layers' entry changes
        model.config.rope_parameters = {**copy.deepcopy(base_config), layer_type: spec.to_dict()}
    return model


def rotary_table_layout(model: nn.Module) -> str:
    """How the model's rotary module lays out its (cos, sin) tables (`TABLE_LAYOUTS`)."""
    return _table_layout(_inner(model).rotary_emb, model)


def _table_layout(rot: nn.Module, model: nn.Module) -> str:
    if isinstance(rot, LcxRotaryEmbedding):
        return rot.layout
    typed = global_layer_type(model)
    param = next(iter(model.parameters()), None)
    pos = torch.arange(1, 5, device=param.device if param is not None else None)[None]
    with torch.no_grad():
        cos, _ = rot(torch.zeros(1, device=pos.device), pos, *((typed,) if typed is not None else ()))
    return table_layout(cos)


def unpatch_rope(model: nn.Module) -> nn.Module:
    """Restore the rotary module and rope_parameters the model had before the first `patch_rope`."""
    original = getattr(model, _ORIG_ATTR, None)
    if original is None:
        return model
    _inner(model).rotary_emb, model.config.rope_parameters = original[0], original[1]
    delattr(model, _ORIG_ATTR)
    return model


def current_spec(model: nn.Module) -> RopeSpec | None:
    """The lcx spec a patched model runs (resolved), or None for an unpatched model."""
    rot = getattr(_inner(model), "rotary_emb", None)
    return rot.spec if isinstance(rot, LcxRotaryEmbedding) else None


class _ConfigView:
    """A config whose rope_parameters are the model's original ones (for re-patching); on a model
    with RoPE per layer type, those of `layer_type` (the layers lcx.patch scales)."""

    def __init__(self, config: Any, rope_parameters: Mapping[str, Any] | None, layer_type: str | None = None):
        self._config, self._rp, self._layer_type = config, rope_parameters, layer_type

    def __getattr__(self, name: str) -> Any:
        if name == "rope_parameters":
            rp = self._rp if self._rp is not None else getattr(self._config, name)
            # (Phi-3's pretraining length, outside rope_parameters, is added where every
            # resolution reads it: `lcx.rope.spec.model_rope_parameters`)
            return dict(rp[self._layer_type] if self._layer_type is not None else rp)
        return getattr(self._config, name)


# HF rope types whose basis depends on the sequence length (HF's own rotary module mutates
# its inv_freq buffer per forward for these): their basis cannot be read off the module.
_HF_LENGTH_DEPENDENT = tuple(name for name, t in ROPE_TYPES.items() if t.length_dependent)


def rope_basis(model: nn.Module, seq_len: int | None = None, *, layer_type: str | None = None
               ) -> tuple[torch.Tensor, float]:
    """`(inv_freq [r/2] float64, attention_factor)` the model rotates with for `seq_len` positions.

    Patched models (`lcx.patch`): the lcx spec's basis at `seq_len` (matters only for the
    length-dependent types, dynamic and longrope, whose basis `LcxRotaryEmbedding` picks from
    max position + 1 of each forward). Unpatched HF models: the rotary module's `inv_freq`
    buffer and `attention_scaling`; HF keeps inv_freq in float32 and forms angles in float32,
    so a re-rotation in float64 from this basis differs from HF's own rotation by about one
    float32 ulp of the angle (`p * inv_freq`). An unpatched model with a length-dependent HF
    rope type raises `ValueError` (its buffer changes per forward; patch the model with lcx).

    layer_type: on a model with RoPE per layer type (Gemma 3), the layer type whose basis is
    wanted; None there raises `ValueError` (no one basis serves every layer).
    """
    rot = decoder(model).rotary_emb
    typed = rope_layer_types(model)
    if typed is not None:
        if layer_type is None:
            raise ValueError(f"this model's RoPE differs per layer type {list(typed)}; pass layer_type")
        if isinstance(rot, LcxRotaryEmbedding) and layer_type != rot.layer_type:
            rot = rot.others
        if not isinstance(rot, LcxRotaryEmbedding):
            return _hf_basis(rot, rot.rope_type.get(layer_type, "default"),
                             getattr(rot, f"{layer_type}_inv_freq", None),
                             getattr(rot, f"{layer_type}_attention_scaling", 1.0))
    if isinstance(rot, LcxRotaryEmbedding):
        if rot.spec.is_length_dependent:
            inv, af = compute_inv_freq(rot.spec, rot.head_dim, seq_len)
            return inv, float(af)
        return rot.inv_freq.detach().to("cpu", torch.float64), float(rot.attention_scaling)
    return _hf_basis(rot, getattr(rot, "rope_type", "default"), getattr(rot, "inv_freq", None),
                     getattr(rot, "attention_scaling", 1.0))


def layer_rope_types(model: nn.Module) -> list[str | None]:
    """Per attention layer, the `layer_type` to pass to `rope_basis` (Gemma 3: its
    `config.layer_types[i]`), or None for every layer of a model with one RoPE."""
    n = len(decoder(model).layers)
    if rope_layer_types(model) is None:
        return [None] * n
    return list(model.config.layer_types[:n])


def static_rope_bases(model: nn.Module) -> list[tuple[torch.Tensor, float]] | None:
    """Each layer's RoPE basis (`layer_rope_bases`) if none depends on the sequence length, else
    None (an lcx spec of a length-dependent type, or such an HF rope type as loaded)."""
    rot = decoder(model).rotary_emb
    if isinstance(rot, LcxRotaryEmbedding) and rot.spec.is_length_dependent:
        return None
    try:
        return layer_rope_bases(model)
    except ValueError:  # an unpatched length-dependent HF rope type
        return None


def layer_rope_bases(model: nn.Module, seq_len: int | None = None) -> list[tuple[torch.Tensor, float]]:
    """`rope_basis` of every attention layer (one basis per layer type, shared): what a decode
    loop that rotates keys itself needs on a model with RoPE per layer type."""
    by_type: dict[str | None, tuple[torch.Tensor, float]] = {}
    return [by_type.setdefault(t, rope_basis(model, seq_len, layer_type=t) if t not in by_type else by_type[t])
            for t in layer_rope_types(model)]


def _hf_basis(rot: nn.Module, rope_type: str, inv: torch.Tensor | None, af: float) -> tuple[torch.Tensor, float]:
    if rope_type in _HF_LENGTH_DEPENDENT:
        raise ValueError(
            f"the model's own rotary module uses rope_type={rope_type!r}, whose basis changes with "
            "the sequence length; patch the model with lcx (lcx.patch(model, spec)) so lcx knows it")
    if inv is None:
        raise ValueError(f"{type(rot).__name__} has no inv_freq buffer; cannot read the RoPE basis")
    return inv.detach().to("cpu", torch.float64), float(af)


