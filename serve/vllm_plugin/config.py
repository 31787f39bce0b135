"""The lcx method configuration of a vLLM model, and the `hf_overrides` that carry it into vLLM.

No vLLM import here: `lcx serve --engine vllm` (which runs in the base environment) uses this
module to validate methods and write vLLM's arguments; the model class in `.model` (loaded inside
vLLM) parses the same dict back with `VllmMethods.from_hf_config`.

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
- every other method: `lm_infinite` (Λ-mask, capped global distance), `sinks` (StreamingLLM),
  `self_extend` (grouped positions) — the methods that change distances
  (`lcx.methods.UNROTATED_METHODS`) — and those vLLM's kernels lack (`swat`: sigmoid + ALiBi):
  the layer computes the lcx method itself (`.method_attention`, exact, vLLM's CPU backend
  only, the KV cache keeps every block). Methods with a `decode_rule` cache keys rotated at
  their true positions by the layer's rotary (lcx's table) and re-rotate only the keys the
  method moves; the others (SWAT, LM-Infinite with top-k) skip vLLM's rotary and cache
  unrotated keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lcx.method_config import _FLAT_ROPE_KEYS, NESTED_KEYS, MethodConfig
from lcx.methods import UNROTATED_METHODS, AttentionMethod
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


@dataclass(frozen=True)
class VllmMethods:
    """The lcx methods a vLLM model runs: a resolved RoPE spec and an attention method (or None)."""

    rope: RopeSpec | None = None
    attention: AttentionMethod | None = None

    def __post_init__(self) -> None:
        if self.rope is not None:
            if self.rope.rope_theta is None:
                raise ValueError("the RoPE spec must be resolved against the model (rope_theta unset); "
                                 "use VllmMethods.from_dict(methods, hf_config)")
            if self.rope.is_length_dependent:
                raise ValueError(
                    f"rope_type={self.rope.rope_type!r} is length-dependent (lcx recomputes its basis per "
                    "forward length); vLLM keeps one cos/sin cache, so it is not supported with --engine vllm")

    @classmethod
    def from_dict(cls, methods: Mapping[str, Any] | MethodConfig | None, hf_config: Any = None) -> "VllmMethods":
        """Validate an `lcx.MethodConfig` (or its dict) for vLLM; a partial RoPE spec is resolved
        against `hf_config`. vLLM's refusals on top of MethodConfig's own checks: lcx attention
        backends (vLLM runs its own kernels) and length-dependent RoPE types."""
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
            rope = cfg.rope_spec(hf_config) if hf_config is not None else RopeSpec.from_dict(cfg.rope)
        attention = cfg.attention
        if attention is not None and attention.name == "causal":
            attention = None  # the unpatched model
        return cls(rope=rope, attention=attention)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "VllmMethods":
        """The methods recorded in a (vLLM-loaded) HF config by `hf_overrides`, checked against it."""
        methods = cls.from_dict(getattr(hf_config, LCX_KEY, None) or {})
        w = methods.sliding_window
        got_w = getattr(hf_config, "sliding_window", None)
        layer_types = getattr(hf_config, "layer_types", None)
        if w is not None and (got_w != w or not layer_types or set(layer_types) != {"sliding_attention"}):
            raise ValueError(f"{LCX_KEY} asks for sliding_window(window={w}) but the config has sliding_window="
                             f"{got_w}, layer_types={layer_types}; build vLLM's hf_overrides with "
                             "lcx.serve.vllm_plugin.hf_overrides")
        return methods

    @property
    def sliding_window(self) -> int | None:
        """The window vLLM's own attention kernels run (lcx's sliding_window method only)."""
        return self.attention.window if self.attention is not None and self.attention.name == "sliding_window" \
            else None

    @property
    def runs_lcx_attention(self) -> bool:
        """True when the layers run the lcx method themselves (`.method_attention`), not vLLM's kernels."""
        return self.attention is not None and self.attention.name not in NATIVE_METHODS

    @property
    def keys_rotated(self) -> bool:
        """True when such layers cache keys rotated at their true positions (the method has a
        `decode_rule`: LM-Infinite without top-k, sinks, Self-Extend), False when unrotated (SWAT,
        LM-Infinite with top-k) or when vLLM's kernels run the attention."""
        from .method_attention import rotated_rule  # torch only; no vLLM import

        return self.runs_lcx_attention and rotated_rule(self.attention) is not None

    @property
    def needs_unrotated(self) -> bool:
        """True when the layers skip vLLM's rotary and cache unrotated keys (`.method_attention`)."""
        return self.runs_lcx_attention and not self.keys_rotated

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.rope is not None:
            out["rope"] = self.rope.to_dict()
        if self.attention is not None:
            out["attention"] = self.attention.to_dict()
        return out

    def describe(self) -> str:
        parts = [self.rope.describe() if self.rope else "rope=model",
                 self.attention.describe() if self.attention else "attention=causal"]
        return ", ".join(parts)


def hf_overrides(hf_config: Any, methods: Mapping[str, Any] | VllmMethods | None,
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
    if not isinstance(methods, VllmMethods):
        methods = VllmMethods.from_dict(methods, hf_config)
    out: dict[str, Any] = {"architectures": lcx_archs[:1], LCX_KEY: methods.to_dict()}
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_model_len is not None and (max_pos is None or max_model_len > max_pos):
        out["max_position_embeddings"] = int(max_model_len)
    if methods.sliding_window is not None:
        out["sliding_window"] = methods.sliding_window
        out["layer_types"] = ["sliding_attention"] * int(hf_config.num_hidden_layers)
    return out


def rope_context_len(hf_config: Any, methods: VllmMethods) -> int | None:
    """The context a RoPE method extends the model to (L * factor), as lcx's engine computes it."""
    spec = methods.rope
    if spec is None or spec.factor is None:
        return None
    L = spec.original_max_position_embeddings or getattr(hf_config, "max_position_embeddings", None)
    return int(L * spec.factor) if L else None


__all__ = ["ARCHITECTURES", "LCX_KEY", "NATIVE_METHODS", "UNROTATED_METHODS", "VllmMethods", "hf_overrides",
           "rope_context_len"]
