"""Supported HF model types, their capabilities, and where their parts live (transformers 5.x).

A Llama-family `*ForCausalLM` in transformers 5.x:

    model                         *ForCausalLM (config, lm_head)
    └── model.model               the decoder stack
        ├── rotary_emb            forward(x, position_ids) -> (cos, sin), shared by every layer
        └── layers[i].self_attn   q_proj, k_proj, v_proj, o_proj, head_dim, layer_idx, scaling

Every type in `MODEL_TYPES` takes (cos, sin) from `rotary_emb` and rotates the full head with
HF's rotate-half convention, so the RoPE patch works on all of them (tests/hf/test_patch.py).
`attention_methods`: the attention patch recomputes q/k from the projections, so a type that
normalises q/k before RoPE (qwen3's q_norm/k_norm) is refused there.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# The one table of HF model types lcx supports, with what each supports.
MODEL_TYPES: dict[str, dict[str, bool]] = {
    "llama": {"attention_methods": True},
    "mistral": {"attention_methods": True},
    "qwen2": {"attention_methods": True},
    "qwen3": {"attention_methods": False},
}
# The types the RoPE patch and the engine take (every type), and those the attention patch takes.
ROPE_MODEL_TYPES = tuple(MODEL_TYPES)
ATTENTION_MODEL_TYPES = tuple(t for t, caps in MODEL_TYPES.items() if caps["attention_methods"])

_ATTENTION_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx", "scaling")


def check_model_type(model: nn.Module, what: str, capability: str | None = None) -> str:
    """The model's type, or `ValueError` naming `what` and the supported types (those with
    `capability`, when given)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    ok = [t for t, caps in MODEL_TYPES.items() if capability is None or caps.get(capability)]
    if model_type not in ok:
        raise ValueError(f"{what} supports model_type in {ok}; got {model_type!r} ({type(model).__name__})")
    return model_type


def decoder(model: nn.Module) -> nn.Module:
    """The decoder stack that owns `rotary_emb` and `layers` (model.model of a *ForCausalLM;
    the model itself when given the stack)."""
    for cand in (getattr(model, "model", None), model):
        if cand is not None and isinstance(getattr(cand, "rotary_emb", None), nn.Module):
            return cand
    raise ValueError(f"{type(model).__name__} has no `rotary_emb` module where transformers 5.x Llama-family "
                     "models keep it (model.model.rotary_emb); this model class is not supported")


def rotary(model: nn.Module) -> nn.Module:
    """The rotary module every layer takes (cos, sin) from."""
    return decoder(model).rotary_emb


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """Every layer's `self_attn`, checked for what the attention patch needs."""
    layers = getattr(decoder(model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers where transformers 5.x Llama-family "
                         "models keep them")
    attns = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        missing = [a for a in _ATTENTION_ATTRS if not hasattr(attn, a)]
        if attn is None or missing:
            raise ValueError(f"layer {i}: no self_attn with {missing or 'attributes'} (unsupported attention module)")
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            raise ValueError(f"layer {i}: attention with q/k norms is not supported")
        attns.append(attn)
    return attns


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
