"""The lcx method configuration of a vLLM model, and the `hf_overrides` that carry it into vLLM.

No vLLM import here: `lcx serve --engine vllm` (which runs in the base environment) uses this
module to validate methods and write vLLM's arguments; the model class in `.model` (loaded inside
vLLM) parses the same dict back with `methods_from_hf_config` (one `lcx.MethodConfig`, checked
for vLLM by `check_vllm_methods`).

Method configuration: an `lcx.MethodConfig` (the same JSON as `lcx serve --methods` and
`lcx.engine.EngineConfig.methods`):

    {"rope": {"rope_type": "truncate"},                            # any lcx.rope type
     "attention": {"type": "sliding_window", "window": 64}}        # an lcx.methods method

What runs inside vLLM (on the CPU backend and on CUDA; nothing here is backend-specific):
- `rope`: every static lcx RoPE type (`lcx.rope.ROPE_TYPES`, including those vLLM lacks:
  `truncate`, static `ntk`). The registered model class replaces each layer's rotary embedding
  by one whose cos/sin cache is `lcx.rope.compute_inv_freq` + `rope_cos_sin` (float64 angles),
  used by vLLM's own rotary kernel. Length-dependent types (`dynamic`, `longrope`) are refused:
  lcx recomputes their basis per forward length, vLLM keeps one cos/sin cache (vLLM's own
  "dynamic" is static at n = L*s), so the two engines would disagree.
- `attention: sliding_window(window=w)`: w keys, the query included (lcx's convention). vLLM's
  attention layers take `per_layer_sliding_window=w` with the same meaning, and the KV cache
  manager then frees blocks that left every window; the overrides set `sliding_window` and
  `layer_types` (all "sliding_attention") in the HF config, which vLLM's Llama reads.
- `attention: causal`: the unpatched model (a control).
- every other method of the registry (`lcx.methods.ATTENTION_METHODS`), e.g. `lm_infinite`,
  `sinks`, `self_extend` — the methods that change distances (`lcx.methods.UNROTATED_METHODS`) —
  and those vLLM's kernels lack (`swat`: sigmoid + ALiBi): the layer computes the lcx method itself (`.method_attention`, exact, vLLM's CPU backend
  only, the KV cache keeps every block). Methods with a `decode_rule` cache keys rotated at
  their true positions by the layer's rotary (lcx's table) and re-rotate only the keys the
  method moves; the others (SWAT, LM-Infinite with top-k) skip vLLM's rotary and cache
  unrotated keys.
"""

from __future__ import annotations

from typing import Any, Mapping

from lcx.method_config import _FLAT_ROPE_KEYS, NESTED_KEYS, MethodConfig
from lcx.methods import UNROTATED_METHODS
from lcx.rope import RopeSpec

LCX_KEY = "lcx_methods"  # the HF-config attribute (set through hf_overrides) holding the methods
METHOD_KEYS = ("rope", "attention")  # the MethodConfig keys vLLM takes (no lcx attention backends)
# HF architecture -> the lcx architecture registered with vLLM's ModelRegistry.
ARCHITECTURES: dict[str, str] = {"LlamaForCausalLM": "LcxLlamaForCausalLM"}

# vLLM's own attention kernels run `sliding_window` (and `causal`, the unpatched model). Every
# other registry method runs through `.method_attention` (exact, CPU backend only): the methods
# that change positions (LM-Infinite's capped distance, StreamingLLM's renumbering, Self-Extend's
# groups; `lcx.methods.UNROTATED_METHODS`) need it, and a method the kernels lack (SWAT's
# sigmoid + ALiBi) would otherwise silently run as softmax attention.
NATIVE_METHODS = ("causal", "sliding_window")


def check_vllm_methods(methods: Mapping[str, Any] | MethodConfig | None, hf_config: Any = None) -> MethodConfig:
    """The `lcx.MethodConfig` a vLLM model runs, checked for vLLM: its RoPE spec resolved against
    `hf_config` (a partial spec means "x this model"), `causal` folded to the unpatched model.
    vLLM's refusals on top of MethodConfig's own checks (`ValueError` naming them): keys other
    than rope/attention, lcx attention backends (vLLM runs its own kernels), length-dependent
    RoPE types (vLLM keeps one cos/sin cache)."""
    if isinstance(methods, Mapping):
        unknown = sorted(set(methods) - set(NESTED_KEYS))
        if unknown and not set(methods) <= _FLAT_ROPE_KEYS:
            raise ValueError(f"unknown vLLM method key(s) {unknown}; accepted: {list(METHOD_KEYS)}")
    cfg = MethodConfig.from_dict(methods)
    if cfg.backend is not None or cfg.decode_backend is not None:
        raise ValueError("backend / decode_backend choose lcx.attention backends for lcx's own engine; "
                         "inside vLLM the attention runs on vLLM's kernels: leave them out")
    rope = None
    if cfg.rope is not None:
        spec = cfg.rope_spec(hf_config) if hf_config is not None else RopeSpec.from_dict(cfg.rope)
        if spec.rope_theta is None:
            raise ValueError("the RoPE spec must be resolved against the model (rope_theta unset); "
                             "pass the model's HF config")
        if spec.is_length_dependent:
            raise ValueError(
                f"rope_type={spec.rope_type!r} is length-dependent (lcx recomputes its basis per "
                "forward length); vLLM keeps one cos/sin cache, so it is not supported with --engine vllm")
        rope = spec.to_dict()
    attention = cfg.attention
    if attention is not None and attention.name == "causal":
        attention = None  # the unpatched model
    return MethodConfig(rope=rope, attention=attention)


def methods_from_hf_config(hf_config: Any) -> MethodConfig:
    """The methods recorded in a (vLLM-loaded) HF config by `hf_overrides`, checked against it."""
    methods = check_vllm_methods(getattr(hf_config, LCX_KEY, None) or {})
    w = sliding_window(methods)
    got_w = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if w is not None and (got_w != w or not layer_types or set(layer_types) != {"sliding_attention"}):
        raise ValueError(f"{LCX_KEY} asks for sliding_window(window={w}) but the config has sliding_window="
                         f"{got_w}, layer_types={layer_types}; build vLLM's hf_overrides with "
                         "lcx.serve.vllm_plugin.hf_overrides")
    return methods


def rope_spec(methods: MethodConfig) -> RopeSpec | None:
    """The (resolved) RoPE spec of checked methods, or None for the model's own."""
    return None if methods.rope is None else RopeSpec.from_dict(methods.rope)


def sliding_window(methods: MethodConfig) -> int | None:
    """The window vLLM's own attention kernels run (lcx's sliding_window method only)."""
    a = methods.attention
    return a.window if a is not None and a.name == "sliding_window" else None


def runs_lcx_attention(methods: MethodConfig) -> bool:
    """True when the layers run the lcx method themselves (`.method_attention`), not vLLM's kernels."""
    return methods.attention is not None and methods.attention.name not in NATIVE_METHODS


def keys_rotated(methods: MethodConfig) -> bool:
    """True when such layers cache keys rotated at their true positions (the method has a
    `decode_rule`: LM-Infinite without top-k, sinks, Self-Extend), False when unrotated (SWAT,
    LM-Infinite with top-k) or when vLLM's kernels run the attention."""
    from .step_plan import rotated_rule  # torch only; no vLLM import

    return runs_lcx_attention(methods) and rotated_rule(methods.attention) is not None


def needs_unrotated(methods: MethodConfig) -> bool:
    """True when the layers skip vLLM's rotary and cache unrotated keys (`.method_attention`)."""
    return runs_lcx_attention(methods) and not keys_rotated(methods)


def hf_overrides(hf_config: Any, methods: Mapping[str, Any] | MethodConfig | None,
                 max_model_len: int | None = None) -> dict[str, Any]:
    """vLLM's `hf_overrides` (JSON-able) that run `methods` on the model whose HF config is given.

    - `architectures`: the lcx model class registered by `register()`;
    - `lcx_methods`: the methods, the RoPE spec fully resolved against the *original* config
      (its `original_max_position_embeddings` is the model's, before the next line changes it);
    - `max_position_embeddings` raised to `max_model_len` when that is longer (vLLM derives its
      length limit from it and sizes the rotary cache with it);
    - `sliding_window` + `layer_types` for a sliding-window method.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    lcx_archs = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if not lcx_archs:
        raise ValueError(f"the vLLM plugin supports architectures {sorted(ARCHITECTURES)}; the model has {archs}")
    methods = check_vllm_methods(methods, hf_config)
    out: dict[str, Any] = {"architectures": lcx_archs[:1], LCX_KEY: methods.to_dict()}
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_model_len is not None and (max_pos is None or max_model_len > max_pos):
        out["max_position_embeddings"] = int(max_model_len)
    if sliding_window(methods) is not None:
        out["sliding_window"] = sliding_window(methods)
        out["layer_types"] = ["sliding_attention"] * int(hf_config.num_hidden_layers)
    return out


__all__ = ["ARCHITECTURES", "LCX_KEY", "NATIVE_METHODS", "UNROTATED_METHODS", "check_vllm_methods", "hf_overrides",
           "keys_rotated", "methods_from_hf_config", "needs_unrotated", "rope_spec", "runs_lcx_attention",
           "sliding_window"]
