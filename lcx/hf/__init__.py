"""The Hugging Face adapter: what lcx knows about transformers models, in one place.

- `lcx.hf.models`: the supported model types with their capabilities (`MODEL_TYPES`), and where
  a `*ForCausalLM` keeps its decoder stack, its rotary module and its attention layers
  (`decoder`, `rotary`, `attention_layers`, `head_dim_of`). Every module that touches an HF
  model's insides (the RoPE patch `lcx.patching`, the attention patch
  `lcx.methods.attention_patch`, the KV-cache tools `lcx.cache.kv`, the engine) asks here.
"""

from .models import (
    ATTENTION_MODEL_TYPES,
    MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    attention_layers,
    check_model_type,
    decoder,
    head_dim_of,
    rotary,
)

__all__ = ["ATTENTION_MODEL_TYPES", "MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "attention_layers",
           "check_model_type", "decoder", "head_dim_of", "rotary"]
