"""The `lcx` model for lm-eval: any model `lcx.load_model` loads, with lcx methods applied.

    lm_eval --model lcx --tasks passkey,lcx_ppl \\
        --model_args pretrained=tiny-5m,rope_type=yarn,factor=4 \\
        --metadata '{"max_seq_lengths": [256, 512, 1024]}'

`pretrained` is anything `lcx.load_model` accepts: a local Hugging Face directory, a `.gguf`
file, or a preset (`tiny-ret-5m`, `tiny-5m`, `smollm2-135m`; `lcx models` lists them). Nothing is
downloaded.

Methods come from `--model_args` keys:
- RoPE: `rope_type` and any other `RopeSpec` key (`factor`, `rope_theta`,
  `original_max_position_embeddings`, `beta_fast`, ..., lists as `short_factor=[...]`), Hugging
  Face names; unset keys come from the model (`lcx.patch`). Without `rope_type` the model runs
  as loaded.
- Attention (`attention=<name>` plus that method's keys): LM-Infinite (`lm_infinite`: n_global,
  n_local, limit_distance), sliding windows (`sliding_window`: window) and StreamingLLM
  (`sinks`: n_sink, window), from `lcx.methods`; composable with any RoPE spec.
  `attn_backend` picks the `lcx.attention` backend of its calls (default `flash`: torch's fused
  flash kernels composed into the windowed mask, the fastest exact CPU route; `blockwise`,
  `sdpa`, `ref`, ...) and `attn_decode_backend` the one of single-token calls (default: the same).

Everything else is lm-eval's HFLM (this class subclasses it with the model preloaded), which
does loglikelihood, loglikelihood_rolling and generate_until with the method in effect. One
difference: HFLM truncates inputs to the model's `max_position_embeddings`; here `max_length`
defaults to `DEFAULT_MAX_LENGTH` (2**20 tokens), so prompts beyond the original context reach
the model whole, which is the point of extrapolation. Pass `max_length=N` for HFLM's
left-truncation at N. `batch_size=auto` probes memory at `max_length` and so needs an explicit,
realistic `max_length`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from lcx.method_config import INFERENCE_BACKEND, ROPE_KEYS, MethodConfig
from lcx.methods.spec import ATTENTION_METHODS

log = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 1 << 20


DEFAULT_ATTN_BACKEND = INFERENCE_BACKEND

# HFLM arguments that still mean something with a preloaded model.
HFLM_KEYS = frozenset({
    "batch_size", "max_batch_size", "max_length", "truncation", "logits_cache", "add_bos_token",
    "prefix_token_id", "softmax_dtype", "mixed_precision_dtype", "think_end_token",
    "enable_thinking", "chat_template_args",
})
# Accepted and ignored: lm-eval adds trust_remote_code=True to model_args with --trust_remote_code;
# lcx.load_model never runs remote code.
IGNORED_KEYS = frozenset({"trust_remote_code"})


def split_model_args(kwargs: dict[str, Any]) -> tuple[MethodConfig, dict[str, Any]]:
    """Sort model_args into (the `lcx.MethodConfig` their method keys describe, HFLM kwargs).

    Method keys are `MethodConfig`'s flat form (RoPE keys, `attention=<name>` and its keys,
    `attn_backend`, `attn_decode_backend`); the attention backend defaults to `flash`. Raises
    `ValueError` for keys nobody accepts, listing the accepted ones.
    """
    methods, rest = MethodConfig.nest_flat(kwargs)
    hflm = {k: rest.pop(k) for k in list(rest) if k in HFLM_KEYS}
    for k in IGNORED_KEYS:
        rest.pop(k, None)
    if rest:
        raise ValueError(
            f"lcx model: unknown model_args {sorted(rest)}; accepted: pretrained, dtype, device, "
            f"RoPE keys {sorted(ROPE_KEYS)}, attention=<{'|'.join(sorted(ATTENTION_METHODS))}> and its keys, "
            f"attn_backend, attn_decode_backend, lm-eval keys {sorted(HFLM_KEYS)}")
    if "rope" in methods and "rope_type" not in methods["rope"]:
        raise ValueError(f"lcx model: RoPE keys {sorted(methods['rope'])} given without rope_type=")
    return MethodConfig.from_dict(methods).with_default_backend(DEFAULT_ATTN_BACKEND), hflm


def _device(device: str | None) -> str:
    # lm-eval's CLI defaults to cuda:0; like HFLM, fall back to the CPU when there is no GPU.
    if device and device.startswith("cuda") and not torch.cuda.is_available():
        log.info("device %r requested but CUDA is unavailable: using cpu", device)
        return "cpu"
    return device or "cpu"


@register_model("lcx")
class LcxLM(HFLM):
    """lm-eval model `lcx`: `HFLM` over `lcx.load_model(pretrained)` with lcx methods applied."""

    def __init__(self, pretrained: str, dtype: str | torch.dtype = "float32", device: str | None = "cpu",
                 **kwargs: Any) -> None:
        import lcx
        from lcx.hf.rope_patch import current_spec

        cfg, hflm = split_model_args(kwargs)
        if not isinstance(pretrained, str):
            raise TypeError("lcx model: pretrained must be a path or preset name (a string)")
        dtype = torch.float32 if dtype in (None, "auto") else dtype
        model, tokenizer = lcx.load_model(pretrained, dtype=dtype, device=_device(device))
        cfg.apply(model)
        self.lcx_config = cfg
        self.lcx_spec = current_spec(model)  # the RoPE spec resolved against the model, or None
        if cfg.rope is not None:
            log.info("lcx model: %s", cfg.describe())
        self.lcx_attention = cfg.attention.name if cfg.attention is not None else None
        hflm.setdefault("max_length", DEFAULT_MAX_LENGTH)
        super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", **hflm)
        self.pretrained = pretrained  # a name for lm-eval's results, not the model object

    def get_model_info(self) -> dict:
        """What lm-eval records about the model: no hub lookups (HFLM asks the hub for a SHA)."""
        from lcx.models import resolve_source

        kind, path = resolve_source(self.pretrained)
        return {
            "model_num_parameters": sum(p.numel() for p in self._model.parameters()),
            "model_dtype": str(self._model.dtype),
            "lcx_source": f"{kind}:{path}",
            "lcx_rope": self.lcx_spec.to_dict() if self.lcx_spec is not None else None,
            "lcx_attention": self.lcx_attention,
            "lcx_methods": self.lcx_config.to_dict(),
        }
