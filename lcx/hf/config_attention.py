"""The attention method a model's HF config asks for, applied when lcx loads the model.

One key today: Qwen's `dual_chunk_attention_config` (Qwen2.5-7B/14B-Instruct-1M, Qwen3-2507 1M
configurations: `{"chunk_size", "local_size", "original_max_position_embeddings", ...}`) asks for
Dual Chunk Attention, which Qwen's deployment recipe (vLLM V0's dual-chunk backend) runs by default.
`lcx.load_model` calls `apply_config_attention` on every HF directory it loads: such a model comes
back patched with `lcx.methods.dca.DCA` (`patch_attention`, its default backend), and one INFO log
line says so and names what lcx leaves out of the config (MInference sparse attention, vLLM's
length-dependent logit scale past `original_max_position_embeddings`; `lcx.methods.dca`).

So the model as loaded runs DCA. An `lcx.MethodConfig` with an attention method replaces it, the
stock attention included: `{"attention": {"type": "causal"}}` (flat `attention=causal`, flags
`--attention causal`: exact full causal attention, what transformers runs). One without an
attention method (`{}`; flat `attention=none` parses to "not given") keeps DCA, as it keeps a
SWAT model's own method; `lcx.engine` runs the method a model arrives patched with.
`lcx.unpatch(model)` removes it.
"""

from __future__ import annotations

import logging
from typing import Any

from lcx.methods.base import AttentionMethod
from lcx.methods.dca import HF_CONFIG_KEY, dca_from_hf_config, hf_config_left_out

log = logging.getLogger(__name__)


def config_attention(config: Any) -> AttentionMethod | None:
    """The attention method an HF config (object or config.json dict) asks for, or None."""
    return dca_from_hf_config(config)


def apply_config_attention(model: Any) -> AttentionMethod | None:
    """Patch `model` with the method its config asks for (module docstring); returns it, or None
    (the model untouched) when its config asks for none."""
    method = config_attention(model.config)
    if method is None:
        return None
    from .attention_patch import patch_attention

    patch_attention(model, method)
    left = hf_config_left_out(model.config)
    log.info("config.json has %s: running Dual Chunk Attention %s on every attention layer, as Qwen's "
             "deployment does%s; attention=causal (or another method) replaces it",
             HF_CONFIG_KEY, method.describe(), f" (not applied: {', '.join(left)})" if left else "")
    return method


__all__ = ["apply_config_attention", "config_attention"]
