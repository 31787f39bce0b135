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
  manager then frees blocks that left every window. On Llama the overrides set `sliding_window`
  and `layer_types` (all "sliding_attention") in the HF config, which vLLM's Llama reads; on a
  hybrid local/global model (Gemma 3) the config stays as loaded and the model class gives the
  window to the layers that take the method (`layer_plans`), vLLM's CPU backend only.
- `attention: causal`: the unpatched model (a control).
- every other method of the registry (`lcx.methods.ATTENTION_METHODS`), e.g. `lm_infinite`,
  `sinks`, `self_extend` — the methods that change distances (`lcx.methods.UNROTATED_METHODS`) —
  and those vLLM's kernels lack (`swat`: sigmoid + ALiBi): the layer computes the lcx method itself (`.method_attention`, exact, vLLM's CPU backend
  only, the KV cache keeps every block). Methods with a `decode_rule` cache keys rotated at
  their true positions by the layer's rotary (lcx's table) and re-rotate only the keys the
  method moves; the others (SWAT, LM-Infinite with top-k) skip vLLM's rotary and cache
  unrotated keys.

Families (`FAMILIES`: the HF architectures vLLM runs natively whose lcx class is registered):
every family's own vLLM model class runs unchanged (its projections, q/k norms, scaling); the lcx
class only swaps modules after vLLM built the model (`.model.install_methods`), as `layer_plans`
says per layer. On a hybrid local/global model (Gemma 3: `config.layer_types`), `layers`
(`lcx.MethodConfig.layers`, lcx.hf's rule) picks the layers that take the attention method:
"global" (default) the full-attention layers, the sliding layers keeping vLLM's own sliding-window
kernel and block freeing; "all" every layer. The RoPE spec applies to the global layers' RoPE
(`rope_parameters["full_attention"]`, as `lcx.patch` does); a layer that runs the method does so on
its own layer type's basis.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from lcx.hf.models import LEFT_OUT, model_shape, rope_layer_types
from lcx.method_config import FLAT_ROPE_KEYS, NESTED_KEYS, MethodConfig
from lcx.methods import UNROTATED_METHODS, AttentionMethod
from lcx.rope import PartialRopeSpec, RopeSpec

_log = logging.getLogger(__name__)
LCX_KEY = "lcx_methods"  # the HF-config attribute (set through hf_overrides) holding the methods
METHOD_KEYS = ("rope", "attention", "layers")  # the MethodConfig keys vLLM takes (no lcx attention backends)


@dataclass(frozen=True)
class VllmFamily:
    """One family the plugin runs: vLLM's own model class for it ("module:Class" under
    `vllm.model_executor.models`), which the lcx class (`lcx_arch`) subclasses without copying
    its forward, and whether that class reads a per-layer sliding window from the HF config
    (`layer_types` + `sliding_window`, so the overrides can carry a `sliding_window` method)."""

    model_type: str  # the lcx family (`lcx.hf.models.FAMILIES`)
    lcx_arch: str
    vllm_class: str
    window_from_config: bool = False


# HF architecture -> the family the plugin registers an lcx class for (`register()`). A family of
# `lcx.hf.models.FAMILIES` that vLLM 0.32 runs natively is one line here (its attention module
# must keep `rotary_emb(positions, q, k)` and an `attn` layer, as vLLM's decoder models do);
# tests/serve/test_vllm_families.py runs each against lcx's engine. The mixtures of experts need
# nothing more: their experts are MLPs; attention is the dense families'. Not here (`VLLM_LEFT_OUT`
# says why for each lcx family): the families vLLM 0.32 runs only through its Transformers backend
# (`TransformersForCausalLM`: transformers' own layers, no vLLM attention module with a rotary
# module to swap), the partial or interleaved RoPE families, and three whose
# vLLM class does not fit (HunYuan v3's fused CUDA rotation, MiniMax-M2's `rotary_dim`, Apertus'
# own numerics); the families lcx itself leaves out (`lcx.hf.models.LEFT_OUT`) are refused by lcx.
FAMILIES: dict[str, VllmFamily] = {
    "LlamaForCausalLM": VllmFamily("llama", "LcxLlamaForCausalLM", "llama:LlamaForCausalLM", window_from_config=True),
    "MistralForCausalLM": VllmFamily("mistral", "LcxMistralForCausalLM", "mistral:MistralForCausalLM",
                                     window_from_config=True),
    "Phi3ForCausalLM": VllmFamily("phi3", "LcxPhi3ForCausalLM", "phi3:Phi3ForCausalLM", window_from_config=True),
    "Qwen2ForCausalLM": VllmFamily("qwen2", "LcxQwen2ForCausalLM", "qwen2:Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": VllmFamily("qwen3", "LcxQwen3ForCausalLM", "qwen3:Qwen3ForCausalLM"),
    "GemmaForCausalLM": VllmFamily("gemma", "LcxGemmaForCausalLM", "gemma:GemmaForCausalLM"),
    "Gemma2ForCausalLM": VllmFamily("gemma2", "LcxGemma2ForCausalLM", "gemma2:Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": VllmFamily("gemma3_text", "LcxGemma3ForCausalLM", "gemma3:Gemma3ForCausalLM"),
    "GraniteForCausalLM": VllmFamily("granite", "LcxGraniteForCausalLM", "granite:GraniteForCausalLM"),
    "MixtralForCausalLM": VllmFamily("mixtral", "LcxMixtralForCausalLM", "mixtral:MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": VllmFamily("qwen2_moe", "LcxQwen2MoeForCausalLM", "qwen2_moe:Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": VllmFamily("qwen3_moe", "LcxQwen3MoeForCausalLM", "qwen3_moe:Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": VllmFamily("olmoe", "LcxOlmoeForCausalLM", "olmoe:OlmoeForCausalLM"),
    "GraniteMoeForCausalLM": VllmFamily("granitemoe", "LcxGraniteMoeForCausalLM", "granitemoe:GraniteMoeForCausalLM"),
    "HyperCLOVAXForCausalLM": VllmFamily("hyperclovax", "LcxHyperCLOVAXForCausalLM",
                                         "hyperclovax:HyperCLOVAXForCausalLM"),
    "GraniteMoeSharedForCausalLM": VllmFamily("granitemoeshared", "LcxGraniteMoeSharedForCausalLM",
                                              "granitemoeshared:GraniteMoeSharedForCausalLM"),
}
# HF architecture -> the lcx architecture registered with vLLM's ModelRegistry.
ARCHITECTURES: dict[str, str] = {hf: f.lcx_arch for hf, f in FAMILIES.items()}
_TRANSFORMERS_BACKEND = ("vLLM 0.32 has no native class for it and runs it through its Transformers backend "
                         "(TransformersForCausalLM: transformers' own layers, no vLLM attention module whose rotary "
                         "and attention the plugin swaps)")
# lcx families the plugin cannot run in vLLM, and why (named in `hf_overrides`' refusal).
_NOT_WIRED = ("an lcx family (the engine, `lcx serve` and lm-eval run it) that the vLLM plugin has no class "
              "for yet: its vLLM model's rotary and attention modules are not swapped")
VLLM_LEFT_OUT: dict[str, str] = {
    **{arch: _TRANSFORMERS_BACKEND for arch in (
        "OlmoForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "Starcoder2ForCausalLM", "ArceeForCausalLM",
        "FlexOlmoForCausalLM", "Jais2ForCausalLM", "SeedOssForCausalLM", "VaultGemmaForCausalLM")},
    **{arch: "vLLM 0.32 has no class registered for it (it would run it through its Transformers backend: "
       "transformers' own layers, no vLLM attention module whose rotary and attention the plugin swaps)"
       for arch in ("BitNetForCausalLM", "MinistralForCausalLM")},
    "HYV3ForCausalLM": _NOT_WIRED + "; on CUDA its vLLM attention rotates q/k in a fused RoPE + q/k-norm + "
                       "cache-write kernel that reads the rotary cache directly, past the plugin's rotary swap",
    "MiniMaxM2ForCausalLM": _NOT_WIRED + "; vLLM 0.32's class reads the config key `rotary_dim` (a partial RoPE), "
                            "which transformers' MiniMaxM2Config does not define",
    "ApertusForCausalLM": _NOT_WIRED + "; vLLM 0.32's own Apertus, before any method, differs from transformers' "
                          "by 5e-4 in prompt logprobs on a tiny checkpoint (its own xIELU activation), five times "
                          "the plugin's parity tolerance",
    **{arch: _NOT_WIRED + "; its RoPE is partial or interleaved (lcx holds its heads in "
       "its own channel order, lcx.hf.channel_order; the plugin's rotary swap rotates "
       "whole heads rotate-half)"
       for arch in ("PhiForCausalLM", "Glm4MoeForCausalLM", "StableLmForCausalLM",
                    "NemotronForCausalLM", "CohereForCausalLM",
                    "HeliumForCausalLM", "Glm4ForCausalLM", "GlmForCausalLM",
                    "Ernie4_5ForCausalLM", "GPTNeoXForCausalLM")},
}

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
        if unknown and not set(methods) <= FLAT_ROPE_KEYS:
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
    return MethodConfig(rope=rope, attention=attention, layers=cfg.layers if attention is not None else None)


def _family(hf_config: Any) -> VllmFamily | None:
    """The family of an HF config (its original or its lcx architecture)."""
    for a in getattr(hf_config, "architectures", None) or []:
        for hf, f in FAMILIES.items():
            if a in (hf, f.lcx_arch):
                return f
    return None


def windows_by_config(hf_config: Any) -> bool:
    """True when the overrides carry a `sliding_window` method in the HF config (`layer_types`
    all "sliding_attention" + `sliding_window`): a family whose vLLM class reads them, on a model
    that is not hybrid local/global (there `layer_types` is the model's own pattern)."""
    f = _family(hf_config)
    return f is not None and f.window_from_config and not is_hybrid(hf_config)


def is_hybrid(hf_config: Any) -> bool:
    """A local/global model (Gemma 3): some layers have their own sliding window, others none."""
    return any(w is not None for w in model_shape(hf_config).windows)


def with_config_attention(hf_config: Any, methods: Mapping[str, Any] | MethodConfig | None,
                          checked: MethodConfig) -> MethodConfig:
    """`checked` (= `check_vllm_methods(methods)`) with the attention method the model's own config
    asks for when `methods` name none, as `lcx.load_model` applies it (`lcx.hf.config_attention`:
    Qwen's `dual_chunk_attention_config` -> Dual Chunk Attention): a DCA model serves with DCA by
    default, `attention=causal` (folded to no method by `check_vllm_methods`) turns it off."""
    from lcx.hf.config_attention import config_attention

    if checked.attention is not None or hf_config is None:
        return checked
    own = config_attention(hf_config)
    if own is None or MethodConfig.from_dict(methods).attention is not None:  # none asked, or `causal` given
        return checked
    _log.info("the model's config asks for %s: the vLLM plugin runs it (as lcx.load_model does); "
              "attention=causal turns it off", own.describe())
    return MethodConfig(rope=checked.rope, attention=own, layers=checked.layers)


def methods_from_hf_config(hf_config: Any) -> MethodConfig:
    """The methods recorded in a (vLLM-loaded) HF config by `hf_overrides`, checked against it;
    a config without them (the lcx class run without lcx's overrides) runs the attention method
    its own config asks for (`with_config_attention`)."""
    recorded = getattr(hf_config, LCX_KEY, None)
    methods = check_vllm_methods(recorded or {})
    if recorded is None:
        methods = with_config_attention(hf_config, {}, methods)
    w = sliding_window(methods)
    got_w = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if w is not None and windows_by_config(hf_config) and (
            got_w != w or not layer_types or set(layer_types) != {"sliding_attention"}):
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

    A model whose config asks for an attention method (Qwen's `dual_chunk_attention_config`)
    runs it when `methods` name no attention method (`with_config_attention`); the model class
    then builds vLLM's family class without vLLM's own dual-chunk modules (`.model.LcxMethods`).
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    lcx_archs = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if not lcx_archs:
        mt = getattr(hf_config, "model_type", None)
        why = f" ({mt}: {LEFT_OUT[mt]}, left out of lcx's families)" if mt in LEFT_OUT else ""
        why += "".join(f" ({a}: {VLLM_LEFT_OUT[a]})" for a in archs if a in VLLM_LEFT_OUT)
        raise ValueError(f"the vLLM plugin supports architectures {sorted(ARCHITECTURES)}; the model has {archs}{why}")
    methods = with_config_attention(hf_config, methods, check_vllm_methods(methods, hf_config))
    out: dict[str, Any] = {"architectures": lcx_archs[:1], LCX_KEY: methods.to_dict()}
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_model_len is not None and (max_pos is None or max_model_len > max_pos):
        out["max_position_embeddings"] = int(max_model_len)
    if sliding_window(methods) is not None and windows_by_config(hf_config):
        out["sliding_window"] = sliding_window(methods)
        out["layer_types"] = ["sliding_attention"] * int(hf_config.num_hidden_layers)
    layer_plans(hf_config, methods)  # refusals (a length-dependent model RoPE the method needs) before vLLM starts
    return out


@dataclass(frozen=True)
class LayerPlan:
    """What the lcx class changes in one decoder layer of the vLLM model (`layer_plans`).

    rope: the RoPE basis of the layer's rotary module as an lcx table (`VllmRotaryEmbedding`):
        the methods' spec on a layer it applies to, the layer's own basis under a method that
        caches keys after RoPE (its re-rotation tables assume lcx's table); None: vLLM's rotary
        as built (or none at all, when `unrotated`).
    method: the lcx attention method the layer computes itself (`.method_attention`), None:
        vLLM's kernel.
    rotated: `method` runs on keys cached after RoPE (else unrotated: the rotary is skipped).
    basis: the layer's RoPE spec the method re-rotates with (set with `method`).
    window: the sliding window vLLM's kernel and KV manager give the layer, when `set_window`.
    """

    layer_type: str | None
    rope: RopeSpec | None = None
    method: AttentionMethod | None = None
    rotated: bool = False
    basis: RopeSpec | None = None
    set_window: bool = False
    window: int | None = None

    @property
    def unrotated(self) -> bool:
        return self.method is not None and not self.rotated


def own_rope_spec(hf_config: Any, layer_type: str | None) -> RopeSpec:
    """The model's own RoPE of a layer type (`rope_parameters[layer_type]` on a model with RoPE
    per layer type, else `rope_parameters`) as a full lcx spec; a length-dependent one raises
    (lcx's tables are static, as vLLM's cos/sin cache is)."""
    rp = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None:
        rp = dict(rp[layer_type])
    rp.setdefault("rope_type", "default")
    spec = PartialRopeSpec(rp).resolve(hf_config)
    if spec.is_length_dependent:
        raise ValueError(f"the model's own RoPE{f' ({layer_type} layers)' if layer_type else ''} has "
                         f"rope_type={spec.rope_type!r}, length-dependent; the plugin's methods need a static basis")
    return spec


def layer_plans(hf_config: Any, methods: MethodConfig) -> list[LayerPlan]:
    """Per decoder layer of an HF config, what the lcx class changes (`LayerPlan`), lcx.hf's rule:

    - a layer takes the attention method unless it is a sliding layer of a hybrid local/global
      model under `layers="global"` (the default): those keep their own window on vLLM's kernel;
    - the RoPE spec applies to every layer of a model with one RoPE, to the global layers
      (`rope_parameters["full_attention"]`) of a model with RoPE per layer type;
    - a layer that takes `sliding_window(w)` runs vLLM's kernel with window w; one that takes a
      method vLLM's kernels lack runs it in `.method_attention`, without a vLLM window (a
      sliding layer under `layers="all"` drops its own, as lcx.hf's does).
    """
    shape = model_shape(hf_config)
    typed = rope_layer_types(hf_config)
    types_ = list(hf_config.layer_types) if typed is not None else [None] * shape.layers
    spec = rope_spec(methods)
    a = methods.attention
    layers = methods.layers or "global"
    lcx_runs = runs_lcx_attention(methods)
    rotated = keys_rotated(methods)
    plans = []
    for i in range(shape.layers):
        lt = types_[i]
        takes = a is not None and (shape.windows[i] is None or layers == "all")
        scaled = spec is not None and lt in (None, "full_attention")
        basis = spec if scaled else own_rope_spec(hf_config, lt) if takes and lcx_runs else None
        if not takes:
            plans.append(LayerPlan(lt, rope=spec if scaled else None))
            continue
        if not lcx_runs:  # sliding_window: vLLM's kernel with the method's window
            plans.append(LayerPlan(lt, rope=spec if scaled else None, set_window=True, window=a.window))
            continue
        plans.append(LayerPlan(lt, rope=basis if rotated else None, method=a, rotated=rotated, basis=basis,
                               set_window=True, window=None))
    return plans


__all__ = ["ARCHITECTURES", "FAMILIES", "LCX_KEY", "LayerPlan", "NATIVE_METHODS", "UNROTATED_METHODS", "VllmFamily", "VLLM_LEFT_OUT",
           "check_vllm_methods", "hf_overrides", "is_hybrid", "keys_rotated", "layer_plans", "methods_from_hf_config",
           "needs_unrotated", "own_rope_spec", "rope_spec", "runs_lcx_attention", "sliding_window",
           "windows_by_config", "with_config_attention"]
