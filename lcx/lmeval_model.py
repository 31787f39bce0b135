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

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from lcx.rope import RopeSpec

log = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 1 << 20


@dataclass(frozen=True)
class AttentionMethod:
    """An attention-side method the `lcx` model can apply.

    `keys`: the model_args keys of its parameters; `apply(model, params) -> None` patches the
    loaded model in place (params: the given keys, already typed by lm-eval).
    """

    name: str
    keys: frozenset[str]
    apply: Callable[[Any, dict[str, Any]], None]


DEFAULT_ATTN_BACKEND = "flash"
BACKEND_KEYS = frozenset({"attn_backend", "attn_decode_backend"})


def _from_lcx_methods() -> dict[str, AttentionMethod]:
    """One entry per `lcx.methods.ATTENTION_METHODS` method (the only list of methods):
    `attention=lm_infinite,n_global=16,n_local=256`, `attention=sliding_window,window=256`,
    `attention=sinks,n_sink=4,window=256`. Applied with `lcx.methods.patch_attention` on the
    `attn_backend` (default `flash`: prefill work O(T·(window + globals)) at fused-kernel speed)."""
    from lcx.methods.attention_patch import patch_attention
    from lcx.methods.spec import ATTENTION_METHODS as METHODS
    from lcx.methods.spec import method_from_dict

    def apply(name: str, model: Any, p: dict[str, Any]) -> None:
        p = dict(p)
        backend = p.pop("attn_backend", None) or DEFAULT_ATTN_BACKEND
        decode = p.pop("attn_decode_backend", None) or None
        patch_attention(model, method_from_dict({"type": name, **p}), backend=backend, decode_backend=decode)

    def make(name: str) -> AttentionMethod:
        keys = frozenset(f.name for f in dataclasses.fields(METHODS[name])) | BACKEND_KEYS
        return AttentionMethod(name, keys, lambda model, p: apply(name, model, p))

    return {name: make(name) for name in METHODS if name != "causal"}


# name -> method.
ATTENTION_METHODS: dict[str, AttentionMethod] = _from_lcx_methods()

# HFLM arguments that still mean something with a preloaded model.
HFLM_KEYS = frozenset({
    "batch_size", "max_batch_size", "max_length", "truncation", "logits_cache", "add_bos_token",
    "prefix_token_id", "softmax_dtype", "mixed_precision_dtype", "think_end_token",
    "enable_thinking", "chat_template_args",
})
# Accepted and ignored: lm-eval adds trust_remote_code=True to model_args with --trust_remote_code;
# lcx.load_model never runs remote code.
IGNORED_KEYS = frozenset({"trust_remote_code"})
ROPE_KEYS = frozenset(f.name for f in dataclasses.fields(RopeSpec))


def split_model_args(kwargs: dict[str, Any]) -> tuple[dict[str, Any], str | None, dict[str, Any], dict[str, Any]]:
    """Sort model_args into (rope spec dict, attention name, attention params, HFLM kwargs).

    Raises `ValueError` for keys nobody accepts, listing the accepted ones.
    """
    kwargs = dict(kwargs)
    attention = kwargs.pop("attention", None)
    rope = {k: kwargs.pop(k) for k in list(kwargs) if k in ROPE_KEYS}
    attn_keys = ATTENTION_METHODS[attention].keys if attention in ATTENTION_METHODS else frozenset()
    attn = {k: kwargs.pop(k) for k in list(kwargs) if k in attn_keys}
    hflm = {k: kwargs.pop(k) for k in list(kwargs) if k in HFLM_KEYS}
    for k in IGNORED_KEYS:
        kwargs.pop(k, None)
    if kwargs:
        raise ValueError(
            f"lcx model: unknown model_args {sorted(kwargs)}; accepted: pretrained, dtype, device, "
            f"attention, RoPE keys {sorted(ROPE_KEYS)}, lm-eval keys {sorted(HFLM_KEYS)}")
    if rope and "rope_type" not in rope:
        raise ValueError(f"lcx model: RoPE keys {sorted(rope)} given without rope_type=")
    return rope, attention, attn, hflm


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

        rope, attention, attn_params, hflm = split_model_args(kwargs)
        if attention is not None and attention not in ATTENTION_METHODS:
            raise ValueError(
                f"lcx model: attention={attention!r} is not known; supported: {sorted(ATTENTION_METHODS)}")
        if not isinstance(pretrained, str):
            raise TypeError("lcx model: pretrained must be a path or preset name (a string)")
        dtype = torch.float32 if dtype in (None, "auto") else dtype
        model, tokenizer = lcx.load_model(pretrained, dtype=dtype, device=_device(device))
        self.lcx_spec = None
        if rope:
            lcx.patch(model, rope)
            from lcx.patching import current_spec

            self.lcx_spec = current_spec(model)
            log.info("lcx model: RoPE %s", self.lcx_spec.describe())
        if attention is not None:
            ATTENTION_METHODS[attention].apply(model, attn_params)
        self.lcx_attention = attention
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
        }
