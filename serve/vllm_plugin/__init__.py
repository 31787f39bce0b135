"""lcx's vLLM plugin: lcx methods (the RoPE types of `lcx.rope.ROPE_TYPES` but the length-dependent
ones, every attention method of `lcx.methods.ATTENTION_METHODS`) inside vLLM's engine and server.

vLLM calls `register()` through the entry point group `vllm.general_plugins` (pyproject:
`lcx = "lcx.serve.vllm_plugin:register"`) in every process it starts. It registers one model
class per family of `.config.FAMILIES` (vLLM's own class for the family with lcx's methods) with
vLLM's documented `ModelRegistry.register_model` (lazily, as "module:Class" strings, so the
model module is imported only when vLLM builds the model). Nothing here imports vLLM at
lcx import time.

Use (what `lcx serve --engine vllm` does):

    from transformers import AutoConfig
    from lcx.serve.vllm_plugin import hf_overrides
    ov = hf_overrides(AutoConfig.from_pretrained(model_dir),
                      {"rope": {"rope_type": "truncate"}, "attention": {"type": "sliding_window", "window": 64}})
    vllm.LLM(model_dir, hf_overrides=ov, dtype="float32")     # or: vllm serve ... --hf-overrides JSON

See `.config` for what runs where (vLLM's kernels: `NATIVE_METHODS`; every other method: `.method_attention`).
"""

from __future__ import annotations

from .config import ARCHITECTURES, LCX_KEY, UNROTATED_METHODS, check_vllm_methods, hf_overrides, methods_from_hf_config

# lcx architecture -> its class, made by `.model` from vLLM's class for the family (`.config.FAMILIES`).
_MODEL_CLASSES = {a: f"lcx.serve.vllm_plugin.model:{a}" for a in ARCHITECTURES.values()}


def register() -> None:
    """Register lcx's model classes with vLLM. Re-entrant: vLLM may call it in every process,
    several times; an architecture already registered is left alone."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in _MODEL_CLASSES.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)


__all__ = ["ARCHITECTURES", "LCX_KEY", "UNROTATED_METHODS", "check_vllm_methods", "hf_overrides",
           "methods_from_hf_config", "register"]
