"""vLLM model classes that run lcx methods (imported by vLLM through the ModelRegistry only).

One mechanism for every family of `.config.FAMILIES`: the lcx class is vLLM's own class for the
family (same weights, same kernels, same forward: projections, q/k norms, scaling) with the mixin
`LcxMethods`, whose `__init__` lets vLLM build the model and then changes, layer by layer as
`.config.layer_plans` says (`install_methods`):
- the attention module's `rotary_emb`: an lcx table (`VllmRotaryEmbedding`, vLLM's rotary kernel)
  for a layer the RoPE spec applies to or that caches keys after RoPE for an lcx method; an
  identity (`NoRotary`) for a layer that runs a method on unrotated keys (SWAT, LM-Infinite with
  top-k), which rotates inside attention;
- the `Attention` layer's impl: switched to the lcx method (`.method_attention.switch_to_method`)
  with the layer's own RoPE basis and vLLM's scale (`impl.scale`: Gemma 3's
  `query_pre_attn_scalar ** -0.5` as built by vLLM);
- its sliding window, where the overrides cannot carry it (a hybrid model's layers, a family whose
  class does not read `layer_types`): set on the layer and its CPU impl before vLLM asks the
  layers for their KV-cache specs, so the KV manager frees blocks as for a model built with it.
The methods come from the config attribute `lcx_methods`, written by
`lcx.serve.vllm_plugin.hf_overrides`. The classes are made from the table on first access
(`LcxLlamaForCausalLM`, `LcxGemma3ForCausalLM`, ...: module `__getattr__`), as vLLM's registry
imports "lcx.serve.vllm_plugin.model:<lcx_arch>".
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

from lcx.methods.dca import HF_CONFIG_KEY as DCA_CONFIG_KEY
from lcx.rope import RopeSpec, compute_inv_freq, rope_cos_sin

from .config import FAMILIES, LayerPlan, layer_plans, methods_from_hf_config
from .method_attention import layer_index, method_for_rank, switch_to_method


class VllmRotaryEmbedding(RotaryEmbedding):
    """vLLM's rotary embedding (its kernels, GPT-NeoX layout) with an lcx RoPE basis.

    The cos/sin cache is `[max_position, rotary_dim]` = `cat(cos, sin)` of half width each,
    vLLM's layout; angles come from `lcx.rope.compute_inv_freq` and are formed in float64 by
    `lcx.rope.rope_cos_sin`, multiplied by the spec's attention factor (as lcx and HF do).
    """

    def __init__(self, spec: RopeSpec, head_size: int, max_position: int, dtype: torch.dtype):
        object.__setattr__(self, "spec", spec)  # read by _compute_cos_sin_cache during super().__init__
        super().__init__(head_size=head_size, rotary_dim=spec.rotary_dim(head_size),
                         max_position_embeddings=max_position, base=float(spec.rope_theta),
                         is_neox_style=True, dtype=dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq, attention_factor = compute_inv_freq(self.spec, self.head_size, None)  # [r/2] f64
        positions = torch.arange(self.max_position_embeddings)
        cos, sin = rope_cos_sin(positions, inv_freq, attention_factor, dtype=torch.float32)  # [P, r]
        half = self.rotary_dim // 2
        return torch.cat((cos[:, :half], sin[:, :half]), dim=-1)  # [P, r]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lcx={self.spec.describe()}"


class NoRotary(nn.Module):
    """The rotary module of a layer whose lcx method runs on unrotated q/k (it rotates inside
    attention): the family's forward calls `rotary_emb(positions, q, k)` and gets q, k back."""

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        return query, key


def _attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Decoder layer index -> its attention module (the module holding the vLLM `Attention`
    layer `attn` and the `rotary_emb` its forward calls), for every family's vLLM class."""
    found = {}
    for module in model.modules():
        attn = getattr(module, "attn", None)
        if isinstance(attn, Attention) and hasattr(module, "rotary_emb"):
            i = layer_index(attn.layer_name)
            if i is None:
                raise ValueError(f"cannot tell the decoder layer of vLLM attention layer {attn.layer_name!r}")
            found[i] = module
    return found


def set_window(attn: Attention, window: int | None) -> None:
    """Give vLLM attention layer `attn` the sliding window `window` (None: none) after it was
    built: the layer's `sliding_window` (its KV-cache spec: `SlidingWindowSpec` frees blocks that
    left the window) and its CPU impl's (the kernel's mask; -1 there is "none"). Only the CPU
    backend's impl is known to read nothing else from the window chosen at construction."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    if attn.sliding_window == window:
        return
    if not isinstance(attn.impl, CPUAttentionBackendImpl):
        raise ValueError(f"a sliding window on {attn.layer_name} set by lcx (a hybrid local/global model's layers, "
                         f"or a family whose vLLM class does not read layer_types) runs on vLLM's CPU backend only; "
                         f"this layer uses {type(attn.impl).__name__}")
    attn.sliding_window = window
    attn.impl.sliding_window = -1 if window is None else int(window)


def install_methods(model: nn.Module, vllm_config: VllmConfig, methods) -> list[LayerPlan]:
    """Apply `methods` (checked, `methods_from_hf_config`) to a vLLM model just built by its
    family's class: each attention module as its `LayerPlan` says (module doc). Returns the plans."""
    hf_config = vllm_config.model_config.hf_config
    plans = layer_plans(hf_config, methods)
    modules = _attention_modules(model)
    # Cover every position vLLM may schedule (max_model_len can exceed the config's length).
    max_pos = max(int(getattr(hf_config, "max_position_embeddings", 0) or 0),
                  int(vllm_config.model_config.max_model_len))
    tables: dict[tuple[str, int], VllmRotaryEmbedding] = {}  # one cos/sin cache per basis
    for i, module in sorted(modules.items()):
        plan = plans[i]
        head_dim = int(module.head_dim)
        if plan.rope is not None:
            key = (repr(plan.rope), head_dim)
            if key not in tables:
                tables[key] = VllmRotaryEmbedding(plan.rope, head_dim, max_pos, torch.get_default_dtype())
            module.rotary_emb = tables[key]
        elif plan.unrotated:
            module.rotary_emb = NoRotary()
        if plan.set_window:
            set_window(module.attn, plan.window)
        if plan.method is not None:
            inv_freq, attention_factor = compute_inv_freq(plan.basis, head_dim, None)
            method = method_for_rank(plan.method, module.total_num_heads, module.num_heads,
                                     get_tensor_model_parallel_rank())
            switch_to_method(module.attn, method, inv_freq, attention_factor, rotated=plan.rotated)
    missing = sorted(set(range(len(plans))) - set(modules))
    if missing and any(p != LayerPlan(p.layer_type) for p in plans):
        raise ValueError(f"{type(model).__name__}: no attention module with a rotary_emb found for layers {missing}; "
                         "the lcx methods cannot be applied to this vLLM model class")
    return plans


class LcxMethods:
    """Mixin before a vLLM `*ForCausalLM` class: the family's model, then `install_methods`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs) -> None:
        # Validate once, before any layer is built: a bad config fails with lcx's message.
        hf_config = vllm_config.model_config.hf_config
        methods = methods_from_hf_config(hf_config)
        # Qwen's `dual_chunk_attention_config` (read above: DCA is lcx's method here, in `methods`
        # unless `attention=causal` turned it off) must not reach vLLM's own family class, which
        # would build its dual-chunk rotary and pass the config to `Attention` (V0's DCA backend,
        # gone from the V1 engine; on the CPU its rotary asks for an accelerator and fails).
        if getattr(hf_config, DCA_CONFIG_KEY, None) is not None:
            setattr(hf_config, DCA_CONFIG_KEY, None)
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.lcx_plans = install_methods(self, vllm_config, methods)
        self.lcx_methods = methods


def _lcx_class(lcx_arch: str) -> type:
    family = next(f for f in FAMILIES.values() if f.lcx_arch == lcx_arch)
    module, name = family.vllm_class.split(":")
    base = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
    cls = type(lcx_arch, (LcxMethods, base), {
        "__module__": __name__, "__qualname__": lcx_arch,
        "__doc__": f"vLLM's {name} with lcx methods; registered as architecture {lcx_arch!r}."})
    return cls


def __getattr__(name: str) -> type:
    if name in {f.lcx_arch for f in FAMILIES.values()}:
        cls = globals()[name] = _lcx_class(name)
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
