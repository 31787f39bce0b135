"""The model families lcx supports, and where their parts live (transformers 5.x).

A decoder-only `*ForCausalLM` of a supported family in transformers 5.x:

    model                         *ForCausalLM (config, lm_head)
    └── model.model               the decoder stack (`model.base_model`: GPT-NeoX's model.gpt_neox)
        ├── rotary_emb            forward(x, position_ids[, layer_type]) -> (cos, sin)
        └── layers[i].self_attn   the family's attention module (GPT-NeoX: layers[i].attention): layer_idx, scaling,
                                  its projections / q-k norms / biases, and a forward that calls
                                  its modeling module's `apply_rotary_pos_emb(q, k, cos, sin)`,
                                  then `past_key_values.update(k, v, layer_idx)`, then the
                                  attention function `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`

`FAMILIES` is the one table of supported families: every entry takes the RoPE patch
(`lcx.hf.rope_patch`) and the attention methods (`lcx.hf.attention_patch`, which hooks the two
calls above, so the family's own code runs; see `lcx.hf`), and the engine. A new family whose
attention follows that pattern (RoPE on q and k by its `apply_rotary_pos_emb`; an attention-logit
soft-cap, Gemma 2's, is handed to the method with q/k/v) is one line here; tests/hf/test_families.py then runs every method and RoPE type on it.
A family whose RoPE is not rotate-half on the whole head (partial rotary: phi, glm4_moe, stablelm, nemotron;
interleaved pairs: cohere, helium, ernie4_5; both: glm, glm4) is held in lcx's channel order
(`lcx.hf.channel_order`, found on a probe of the family's own rotation).

Families transformers 5.x builds here that are left out, and why:
- cohere2: NoPE global layers (its full-attention layers do not rotate).
- smollm3: NoPE layers (no rotation in every 4th layer).
- nanochat: q/k RMS norm after RoPE; weightless, so it commutes with the rotation, but it cancels
  the attention factor of YaRN/LongRoPE, which lcx applies after it.
- phimoe: its rotary embedding needs its own long/short mscale keys, so lcx's RoPE parity check
  (the model rebuilt by transformers under each rope type) cannot run; its attention passes.
- hunyuan_v1_dense, hunyuan_v1_moe: q/k norm applied after RoPE; lcx's methods rotate inside the
  attention call, after the family's norm, and a norm with per-channel weights does not commute
  with a rotation (`tiny_model` randomises norm weights so that the grid sees this).
Other decoder families of transformers 5.23 are not in either table (refused as unknown): the
probe of all of them (docs/methods.md, "Model families") found them hybrids with recurrent or
convolution layers, multimodal wrappers, multi-head latent attention, attention sinks,
or configs that a tiny model needs family-specific keys for (not yet written).
The attention patch refuses all of these by name; for a family not in either table it would also
refuse a rotation it cannot hold (`lcx.hf.channel_order.detect`, on a probe when the patch is
installed), and raise at call time on an attention module that does not call the two hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Family:
    """One supported model family: what its attention adds to Llama's (for people and docs), and
    the config keys a tiny random model of it needs beyond `TINY` (`tiny_model`)."""

    differs: str  # what the family's attention does beyond Llama's, all run by its own code
    tiny: tuple[tuple[str, Any], ...] = ()  # config overrides for `tiny_model`
    # what its *ForCausalLM.forward does to lm_head's output (beyond a `final_logit_softcapping`,
    # read from any config): ("divide" | "multiply", the config attribute), `lcx.hf.head.head_logits`
    logits: tuple[str, str] | None = None


# A tiny random model of any family (tests; `tiny_model`): 2 layers, 4 query / 2 KV heads of 16.
TINY: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32,
                            sliding_window=None, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, tie_word_embeddings=False)
# Gemma 3's tiny shape: one sliding layer (window 8, its own RoPE base) and one global layer.
_GEMMA3_TINY = (("layer_types", ["sliding_attention", "full_attention"]), ("sliding_window", 8),
                ("query_pre_attn_scalar", 24))

# Gemma 2's tiny shape: a sliding and a global layer sharing one basis, logits and scores capped
# near a random model's scale (Gemma 2's own caps, 50 and 30, would leave tanh nearly linear here)
_GEMMA2_TINY = (("layer_types", ["sliding_attention", "full_attention"]), ("sliding_window", 8),
                ("query_pre_attn_scalar", 24), ("attn_logit_softcapping", 0.05), ("final_logit_softcapping", 2.0),
                ("rope_parameters", {"rope_type": "default", "rope_theta": 10_000.0}), ("attn_implementation", "eager"))

# The one table of HF model types lcx supports (RoPE patch, attention methods, engine).
FAMILIES: dict[str, Family] = {
    "llama": Family("the reference: q/k/v/o projections, rotate-half RoPE on the full head"),
    "mistral": Family("config.sliding_window on every layer (the method replaces it)"),
    "qwen2": Family("q/k/v biases"),
    "qwen3": Family("RMS norm on q and k per head, before RoPE"),
    "gemma": Family("head_dim independent of hidden size; embeddings scaled by sqrt(hidden)"),
    "gemma3_text": Family("q/k RMS norm, query_pre_attn_scalar scaling, hybrid: sliding-window layers with "
                          "their own RoPE base (rope_parameters per layer type); methods on the global layers",
                          _GEMMA3_TINY),
    "phi3": Family("fused qkv_proj; pretraining length in config.original_max_position_embeddings",
                   (("original_max_position_embeddings", TINY["max_position_embeddings"]),)),
    "olmo": Family("clipped q/k/v (clip_qkv), non-parametric layer norms", (("clip_qkv", 0.5),)),
    "olmo2": Family("RMS norm on all of q and k (across heads), before RoPE"),
    "granite": Family("attention_multiplier as the scaling; residual/embedding multipliers",
                      (("logits_scaling", 4.0),), ("divide", "logits_scaling")),
    "starcoder2": Family("biases everywhere, layer norm"),
    # added from a probe of every decoder family of transformers 5.23 (docs/methods.md, "Model
    # families"): each passes the whole family grid of tests/hf/test_families.py
    "apertus": Family("q/k RMS norm before RoPE, xIELU MLP"),
    "arcee": Family("Llama attention, ReLU² MLP"),
    "bitnet": Family("ternary BitLinear projections, an RMS norm on the attention output"),
    "flex_olmo": Family("OLMo 2 attention (q/k norm across heads), mixture of experts"),
    "granitemoe": Family("Granite's attention_multiplier scaling, mixture of experts", (("logits_scaling", 4.0),),
                         ("divide", "logits_scaling")),
    "granitemoeshared": Family("Granite's attention_multiplier scaling, experts plus a shared MLP",
                               (("logits_scaling", 4.0),), ("divide", "logits_scaling")),
    "hy_v3": Family("q/k RMS norm before RoPE"),
    "hyperclovax": Family("Granite-style attention_multiplier and residual multipliers (logits multiplied, not "
                          "divided, by logits_scaling)", (("logits_scaling", 4.0),), ("multiply", "logits_scaling")),
    "jais2": Family("Llama attention with biases"),
    "minimax_m2": Family("q/k RMS norm across heads before RoPE, mixture of experts"),
    "mixtral": Family("Mistral attention, mixture of experts"),
    "olmoe": Family("q/k RMS norm across heads before RoPE, mixture of experts"),
    "qwen2_moe": Family("q/k/v biases, experts plus a shared expert"),
    "qwen3_moe": Family("q/k RMS norm per head before RoPE, mixture of experts"),
    "seed_oss": Family("q/k/v biases and an output-projection bias"),
    "olmo3": Family("OLMo 2's attention (q/k norm across heads); hybrid: sliding-window layers and full-attention "
                    "layers (methods on the full ones, as on Gemma 3)",
                    (("layer_types", ["sliding_attention", "full_attention"]), ("sliding_window", 8))),
    # partial rotary: the family rotates the first r channels of each head, lcx holds q and k in
    # its own channel order with zero frequencies for the rest (lcx.hf.channel_order)
    "phi": Family("partial rotary (40% of each head in Phi-2), q/k/v biases, optional q/k layer norm, parallel "
                  "attention and MLP"),
    "glm4_moe": Family("partial rotary (half of each head), q/k/v biases, mixture of experts"),
    # interleaved RoPE pairs (2i, 2i + 1): held in lcx's channel order like the partial rotary
    # ones (lcx.hf.channel_order)
    "cohere": Family("interleaved RoPE pairs (tables with each angle twice in a row), layer norm, logit scale",
                     (("logit_scale", 2.0),), ("multiply", "logit_scale")),
    "helium": Family("interleaved RoPE pairs"),
    "glm4": Family("interleaved RoPE pairs on half of each head, q/k/v biases, post-norms"),
    "glm": Family("interleaved RoPE pairs on half of each head, q/k/v biases"),
    "ernie4_5": Family("interleaved RoPE pairs"),
    "stablelm": Family("partial rotary (25% of each head), layer norm, optional q/k/v biases; its decoder layers "
                       "drop their keyword arguments (lcx's per-call inputs come from the decoder call)",
                       (("partial_rotary_factor", 0.5),)),  # (tiny: 8 of 16 channels, 4 frequencies)
    "nemotron": Family("partial rotary (half of each head), layer norm 1p, squared-ReLU MLP; its decoder layers "
                       "drop their keyword arguments"),
    "gpt_neox": Family("partial rotary (25% of each head in Pythia), fused query_key_value, biases, parallel "
                       "attention and MLP; its decoder is model.gpt_neox, its attention module layers[i].attention, "
                       "called with the cache as layer_past",
                       (("num_key_value_heads", None),  # (multi-head: no KV-head count in its config)
                        ("rope_parameters", {"rope_type": "default", "rope_theta": 10_000.0,
                                             "partial_rotary_factor": 0.5}))),
    # attention-logit soft-capping: the family's `softcap` reaches the method with its q/k/v
    # (`lcx.attention.AttentionSpec.softcap`); tiny caps small enough that tanh bends a random model's logits
    "gemma2": Family("attention-logit soft-capping (tanh, cap 50), query_pre_attn_scalar scaling, final-logit "
                     "soft-capping; hybrid: sliding-window and full-attention layers alternating, one RoPE basis "
                     "(methods on the full ones)", _GEMMA2_TINY),
    "vaultgemma": Family("Gemma 2's attention (soft-capped logits, hybrid sliding/full layers, one RoPE basis), "
                         "no post-norms", _GEMMA2_TINY),
    "ministral": Family("Mistral's attention; hybrid: sliding-window and full-attention layers sharing one RoPE "
                        "basis (methods on the full ones)",
                        (("layer_types", ["sliding_attention", "full_attention"]), ("sliding_window", 8),
                         ("rope_parameters", {"rope_type": "default", "rope_theta": 10_000.0}), ("attn_implementation", "eager"))),
}
ROPE_MODEL_TYPES = tuple(FAMILIES)  # the types the RoPE patch and the engine take
ATTENTION_MODEL_TYPES = tuple(FAMILIES)  # the types the attention patch takes (every family)

LEFT_OUT: dict[str, str] = {
    "cohere2": "interleaved RoPE with NoPE global layers (no rotation in its full-attention layers)",
    "smollm3": "NoPE layers",
    "nanochat": "q/k RMS norm after RoPE: weightless, so it commutes with the rotation, but it cancels the "
                "attention factor of YaRN/LongRoPE, which lcx applies after it",
    "phimoe": "its own RoPE (long/short mscale keys) that transformers' rebuild with another rope type refuses",
    "hunyuan_v1_dense": "q/k norm after RoPE (a method that rotates in attention would normalise first)",
    "hunyuan_v1_moe": "q/k norm after RoPE (a method that rotates in attention would normalise first)",
}

_ATTENTION_ATTRS = ("layer_idx", "scaling")  # (its head size: `model_shape`, from the config)
_ATTENTION_NAMES = ("self_attn", "attention")  # a decoder layer's attention module: transformers' names


def attention_softcap(model_or_config: Any) -> float | None:
    """The family's attention-logit soft-capping (`config.attn_logit_softcapping`, Gemma 2), or
    None: what every layer's attention call hands to the method (`lcx.attention.AttentionSpec.softcap`)."""
    config = getattr(model_or_config, "config", model_or_config)
    cap = getattr(config, "attn_logit_softcapping", None)
    return float(cap) if cap else None


def check_model_type(model: nn.Module, what: str, capability: str | None = None) -> str:
    """The model's type, or `ValueError` naming `what`, the supported families and, for a family
    left out on purpose, why. (`capability` is accepted for callers of the old table; every
    family has every capability.)"""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        why = f" ({model_type}: {LEFT_OUT[model_type]})" if model_type in LEFT_OUT else ""
        raise ValueError(f"{what} supports model_type in {list(FAMILIES)}; got {model_type!r} "
                         f"({type(model).__name__}){why}")
    return model_type


def decoder(model: nn.Module) -> nn.Module:
    """The decoder stack that owns `rotary_emb` and `layers` (model.model of a *ForCausalLM, or
    its `base_model` under another name, GPT-NeoX's model.gpt_neox; the model itself when given
    the stack)."""
    for cand in (getattr(model, "model", None), getattr(model, "base_model", None), model):
        if cand is not None and isinstance(getattr(cand, "rotary_emb", None), nn.Module):
            return cand
    raise ValueError(f"{type(model).__name__} has no `rotary_emb` module where transformers 5.x decoder "
                     "models keep it (model.model.rotary_emb); this model class is not supported")


def rotary(model: nn.Module) -> nn.Module:
    """The rotary module every layer takes (cos, sin) from."""
    return decoder(model).rotary_emb


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """Every layer's attention module (`self_attn`; GPT-NeoX's `attention`), checked for what the
    attention patch reads."""
    layers = getattr(decoder(model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers where transformers 5.x decoder "
                         "models keep them")
    attns = []
    for i, layer in enumerate(layers):
        attn = next((a for a in (getattr(layer, n, None) for n in _ATTENTION_NAMES) if isinstance(a, nn.Module)), None)
        missing = [a for a in _ATTENTION_ATTRS if not hasattr(attn, a)]
        if attn is None or missing:
            raise ValueError(f"layer {i}: no self_attn with {missing or 'attributes'} (unsupported attention module)")
        attns.append(attn)
    return attns


def layer_types(model_or_config: Any) -> list[str] | None:
    """`config.layer_types` (e.g. Gemma 3's "sliding_attention" / "full_attention" per layer),
    or None for a model whose layers are all alike."""
    config = getattr(model_or_config, "config", model_or_config)
    types = getattr(config, "layer_types", None)
    return list(types) if types else None


def rope_layer_types(model_or_config: Any) -> tuple[str, ...] | None:
    """The layer types that hold their own RoPE parameters (`rope_parameters` nested per layer
    type, Gemma 3), or None for one RoPE for every layer."""
    config = getattr(model_or_config, "config", model_or_config)
    rp = getattr(config, "rope_parameters", None) or {}
    types = layer_types(config) or []
    nested = tuple(t for t in dict.fromkeys(types) if isinstance(rp.get(t), dict))
    return nested or None


def global_layer_type(model_or_config: Any) -> str | None:
    """The layer type whose RoPE lcx.patch scales on a model with RoPE per layer type
    ("full_attention"), or None."""
    nested = rope_layer_types(model_or_config)
    if nested is None:
        return None
    if "full_attention" not in nested:
        raise ValueError(f"rope_parameters per layer type {list(nested)} has no 'full_attention' entry")
    return "full_attention"


def tiny_model(model_type: str, *, seed: int = 0, rope_theta: float = 10_000.0, **overrides: Any) -> nn.Module:
    """A tiny random `*ForCausalLM` of a family in `FAMILIES` (`TINY` + the family's `tiny` keys +
    `overrides`), eval mode, sdpa attention (transformers' default; its eager attention turns a
    left-padded row into NaN in 5.23) unless the family's keys name another (Gemma 2: eager only). On a model with RoPE per layer type, `rope_theta` is the
    global layers' base (the sliding layers take 1000, so the two bases differ)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not in FAMILIES ({list(FAMILIES)})")
    keys = {**TINY, **dict(FAMILIES[model_type].tiny), **overrides}
    types_ = keys.get("layer_types") or []
    if "rope_parameters" not in keys:
        default = {"rope_type": "default", "rope_theta": rope_theta}
        keys["rope_parameters"] = (default if "sliding_attention" not in types_ else {
            "full_attention": default, "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}})
    impl = keys.pop("attn_implementation", "sdpa")  # (Gemma 2 runs eager only: no soft-cap in SDPA)
    config = AutoConfig.for_model(model_type, attn_implementation=impl, **keys)
    torch.manual_seed(seed)
    # mixture-of-experts families: the eager experts loop (the grouped-matmul default has no
    # float64, which the exactness tests run in)
    extra = {"experts_implementation": "eager"} if hasattr(config, "_experts_implementation") else {}
    model = AutoModelForCausalLM.from_config(config, **extra).eval()
    # norm weights away from their init of ones: a q/k norm applied after RoPE (which does not
    # commute with a per-channel weight) must change the logits when a method rotates before it
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and p.dim() == 1:
                p.mul_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


@dataclass(frozen=True)
class ModelShape:
    """The shape facts of an HF decoder config that lcx derives, derived once (`model_shape`).

    heads / kv_heads: query and key/value heads (kv_heads = heads without GQA); head_dim: the
    config's `head_dim`, else hidden_size // heads (Gemma's is independent of hidden_size);
    intermediate_size: the MLP's (None when the config has none); layer_types: per layer (Gemma 3:
    "sliding_attention" / "full_attention"), None when all layers are alike; windows: per layer,
    the family's own sliding window on a hybrid local/global model, None on its global layers
    and on every layer of a model whose layers are all alike."""

    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int | None
    layer_types: tuple[str, ...] | None
    windows: tuple[int | None, ...]
    rotary_dim: int = 0  # channels of a head RoPE rotates: head_dim, or fewer (partial rotary families)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes one token's keys and values take in every layer's cache."""
        return dtype_bytes * 2 * self.layers * self.kv_heads * self.head_dim


def model_shape(model_or_config: Any) -> ModelShape:
    """`ModelShape` of an HF model or its config (the one place lcx derives head_dim, KV heads and
    the per-layer parameters; `rotary_dim` as transformers computes it: int(head_dim x
    partial_rotary_factor))."""
    c = getattr(model_or_config, "config", model_or_config)
    heads, layers = int(c.num_attention_heads), int(c.num_hidden_layers)
    types_ = layer_types(c)
    hybrid = types_ is not None and "sliding_attention" in types_ and "full_attention" in types_
    w = getattr(c, "sliding_window", None)
    inter = getattr(c, "intermediate_size", None)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    rp = dict(getattr(c, "rope_parameters", None) or {})
    if isinstance(rp.get("full_attention"), dict):  # RoPE per layer type: the global layers'
        rp = rp["full_attention"]
    prf = rp.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))
    return ModelShape(
        layers=layers, hidden_size=int(c.hidden_size), heads=heads,
        kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        vocab_size=int(c.vocab_size), intermediate_size=int(inter) if inter else None,
        layer_types=tuple(types_[:layers]) if types_ is not None else None,
        windows=tuple(int(w) if hybrid and types_[i] == "sliding_attention" else None for i in range(layers)),
        rotary_dim=int(head_dim * float(prf)) if prf is not None else head_dim)


def head_dim_of(config: Any) -> int:
    """`model_shape(config).head_dim`."""
    return model_shape(config).head_dim


__all__ = ["ATTENTION_MODEL_TYPES", "FAMILIES", "Family", "LEFT_OUT", "ModelShape", "ROPE_MODEL_TYPES",
           "attention_layers", "check_model_type", "decoder", "global_layer_type", "head_dim_of", "layer_types",
           "model_shape", "rope_layer_types", "rotary", "tiny_model"]
