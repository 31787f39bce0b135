"""What `lcx.engine.Engine` applies to its model and what it then runs: the method config it is
given, or the one the model arrives patched with or records, on the fastest exact backend."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..hf.recorded import recorded_method
from ..hf.rope_patch import static_rope_bases
from ..method_config import INFERENCE_BACKEND, MethodConfig
from ..rope import ROPE_TYPES


def to_apply(model: nn.Module, methods: MethodConfig) -> MethodConfig:
    """The config the engine applies to `model` for `methods` (`EngineConfig.methods`): fast by
    default, an attention method without a backend named runs on the fastest exact one that
    supports its calls (`INFERENCE_BACKEND`, flash, else lcx.methods' blockwise)."""
    from ..hf.attention_patch import DEFAULT_BACKEND, current_patch

    if methods.attention is None:
        # none asked for, and the model arrives patched (`lcx.load_model` applies what its
        # config asks for, e.g. DCA: `lcx.hf.config_attention`): the engine runs that method
        ran = current_patch(model)
        if ran is not None:  # (its backends kept unless the patch's default: then the fast one)
            methods = dataclasses.replace(methods, attention=ran.method, layers=ran.layers,
                                          backend=None if ran.backend == DEFAULT_BACKEND else ran.backend,
                                          decode_backend=ran.decode_backend)
    methods = methods.with_default_backend(INFERENCE_BACKEND)
    if methods.attention is None and recorded_method(model) is None and (
            static_rope_bases(model) is not None if methods.rope is None
            else not ROPE_TYPES[methods.rope.rope_type].length_dependent):
        # a hybrid local/global model as loaded (Gemma 3), exactly, on lcx's fastest exact
        # backend: the sliding layers their own window in O(T * w) instead of transformers'
        # masked O(T^2) pass, the global layers causal (`lcx.hf.attention_patch.as_loaded_method`;
        # only for a static RoPE basis: HF's length-dependent rope rotates each key once, at
        # the basis of the call that computed it, which an attention method does not)
        from ..hf.attention_patch import as_loaded_method

        fast = as_loaded_method(model, INFERENCE_BACKEND)
        if fast is not None:
            methods = dataclasses.replace(methods, attention=fast, backend=INFERENCE_BACKEND, layers="global")
    return methods


def running_methods(applied: Any) -> MethodConfig:
    """What the engine runs after `applied` (`MethodConfig.apply`'s record): the config applied,
    with the backends the patch runs, or the attention method the model's config records."""
    from ..hf.attention_patch import DEFAULT_BACKEND

    methods = applied.methods
    if applied.recorded is not None:
        # none asked for: the model's own attention method, when its config records one (a
        # model trained with it, e.g. SWAT), bounded like one asked for (not applied: the
        # model already runs it, per row on `lcx_key_positions` like a patched model)
        own = applied.recorded
        methods = dataclasses.replace(methods, attention=own.attention, backend=own.backend,
                                      decode_backend=own.decode_backend)
    elif methods.attention is not None and (applied.backend, applied.decode_backend) != (
            methods.backend or DEFAULT_BACKEND, methods.decode_backend):
        # the backends the patch runs where they are not those asked for (a soft-capping
        # model's calls go to one that can cap them: `lcx.hf.attention_patch.patch_attention`),
        # so the engine states what it runs
        methods = dataclasses.replace(methods, backend=applied.backend, decode_backend=applied.decode_backend)
    # what the engine runs: the config applied, plus the attention method the model records
    return methods


__all__ = ["running_methods", "to_apply"]
