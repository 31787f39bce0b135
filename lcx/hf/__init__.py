"""The Hugging Face adapter: everything lcx knows about transformers models, in one package.

- `lcx.hf.models`: the supported model types with their capabilities (`MODEL_TYPES`), and where
  a `*ForCausalLM` keeps its decoder stack, its rotary module and its attention layers
  (`decoder`, `rotary`, `attention_layers`, `head_dim_of`). Every module that touches an HF
  model's insides (the patches below, the KV-cache tools `lcx.cache.kv`, the engine) asks here.
- `lcx.hf.rope_patch`: the RoPE patch (`patch`, `unpatch`, `patched`, `current_spec`,
  `LcxRotaryEmbedding`): the model's rotary module replaced by one built from an `lcx.rope` spec.
- `lcx.hf.attention_patch`: the attention patch (`patch_attention`, `unpatch_attention`,
  `attention_patched`, `current_patch`): every `self_attn` runs an `lcx.methods` method.
- `lcx.hf.recorded`: a model's own attention method, recorded in its config
  (`config.lcx_attention`, `lcx.MethodConfig`'s attention form): `recorded_method`,
  `record_method`. A model trained with a registry method (SWAT) carries it there; the engine
  reads it like any method it applies.
- `lcx.hf.swat`: SWAT's glue, how a model trained with the registry method `swat` runs it as
  loaded: the `"lcx_swat"` attention and mask functions registered with transformers, and
  `from_pretrained_kwargs`. Building a SWAT model is `lcx.models.swat`.

Callers use the public entry points `lcx.patch` / `lcx.patched` / `lcx.unpatch` (a whole
`MethodConfig`) and `lcx.methods.patch_attention` & co. Only `lcx.hf.models` is imported with the package: the
other modules import `lcx.attention`, `lcx.methods` or transformers, so import them by name.
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
