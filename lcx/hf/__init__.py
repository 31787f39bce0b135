"""The Hugging Face adapter: everything lcx knows about transformers models, in one package.

- `lcx.hf.models`: the supported model families (`FAMILIES`, one line each; families left out
  and why: `LEFT_OUT`), and where a `*ForCausalLM` keeps its decoder stack, its rotary module
  and its attention layers (`decoder`, `rotary`, `attention_layers`, `layer_types`), and its
  shape (`model_shape`: head_dim, KV heads, per-layer types and windows, derived once here;
  `head_dim_of`). Every module that touches an HF model's insides (the patches below, the
  KV-cache tools `lcx.cache.kv`, the engine) asks here.
- `lcx.hf.rope_patch`: the RoPE patch (`resolve_rope`, `patch_rope`, `unpatch_rope`, `current_spec`,
  `LcxRotaryEmbedding`): the model's rotary module replaced by one built from an `lcx.rope` spec
  (on Gemma 3, the global layers' RoPE only); `rope_basis(model, n, layer_type=...)`,
  `layer_rope_types` / `layer_rope_bases`: the basis each layer rotates with.
- `lcx.hf.attention_patch` (installing), `lcx.hf.attention_call` (what runs inside one hooked call)
  and `lcx.hf.engine_hook` (the engine's declared interface: the decode hook, `lcx_decode` steps,
  the held-keys view `lcx_key_positions`, `loaded_rows`): the attention patch (`patch_attention`, `unpatch_attention`,
  `attention_patched`, `current_patch`, `layer_methods`, `own_windows`): every `self_attn` runs an
  `lcx.methods` method. **The mechanism, for every family**: the family's own attention forward
  runs (its projections, q/k norms, biases, scaling); lcx takes over two calls in it, the
  rotation (`apply_rotary_pos_emb` of the family's modeling module, which returns q/k unrotated
  inside a patched call) and the attention function (`"lcx_attention_method"`, registered with
  transformers' `AttentionInterface`), which runs the layer's `method.attend` on those unrotated
  q/k/v with their positions. No family's forward is copied; details and the semantics (cache
  holds keys before RoPE, ragged rows, hybrid local/global layers) in that module's docstring.
  What a decode loop needs per layer on a hybrid model (Gemma 3): `layer_methods(model)[i]`
  (its `cache_window` bounds layer i's cache; the sliding layers run their own window),
  `own_windows(model)` (the same for the model as loaded), `layer_rope_bases(model)`.
- `lcx.hf.recorded`: a model's own attention method, recorded in its config
  (`config.lcx_attention`, `lcx.MethodConfig`'s attention form): `recorded_method`,
  `record_method`. A model trained with a registry method (SWAT) carries it there; the engine
  reads it like any method it applies.
- `lcx.hf.swat`: SWAT's glue, how a model trained with the registry method `swat` runs it as
  loaded: the `"lcx_swat"` attention and mask functions registered with transformers, and
  `from_pretrained_kwargs`. Building a SWAT model is `lcx.models.swat`.

- `lcx.hf.bounded_cache`: `BoundedKVCache` (a transformers `Cache` that keeps only the keys a
  bounded method can still see, before RoPE, per layer) and `greedy_generate` over any such
  cache; `lcx.hf.generate`: `greedy_decode_ref`, the one-token-per-forward greedy loop they run
  (the reference `lcx.engine` is tested against).

Layers: `lcx.hf` imports `lcx.rope`, `lcx.attention` and `lcx.methods` (the math), never the
packages above it (`lcx.cache`, `lcx.method_config`, `lcx.models`, `lcx.engine`;
tests/test_layers.py). Callers use the public entry points `lcx.patch` / `lcx.patched` /
`lcx.unpatch` (a whole `MethodConfig`) or `patch_attention` & co. here.
"""

from .attention_patch import (
    ATTN_IMPLEMENTATION,
    attention_patched,
    current_attention,
    current_patch,
    layer_methods,
    own_windows,
    patch_attention,
    unpatch_attention,
)
from .bounded_cache import BoundedKVCache, GenerationResult, cache_len, cache_nbytes, greedy_generate
from .generate import greedy_decode_ref
from .rope_patch import layer_rope_bases, layer_rope_types
from .models import (
    ATTENTION_MODEL_TYPES,
    FAMILIES,
    LEFT_OUT,
    ROPE_MODEL_TYPES,
    ModelShape,
    attention_layers,
    attention_softcap,
    check_model_type,
    decoder,
    head_dim_of,
    layer_types,
    model_shape,
    rotary,
)

__all__ = ["ATTENTION_MODEL_TYPES", "ATTN_IMPLEMENTATION", "BoundedKVCache", "FAMILIES", "GenerationResult",
           "LEFT_OUT", "ModelShape", "ROPE_MODEL_TYPES", "model_shape", "attention_layers", "attention_softcap", "attention_patched", "cache_len", "cache_nbytes",
           "check_model_type", "current_attention", "current_patch", "decoder", "greedy_decode_ref", "greedy_generate",
           "head_dim_of", "layer_methods", "layer_rope_bases", "layer_rope_types", "layer_types", "own_windows",
           "patch_attention", "rotary",
           "unpatch_attention"]
