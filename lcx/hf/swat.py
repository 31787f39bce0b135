"""SWAT inside transformers: how a stock `LlamaForCausalLM` runs SWAT's attention (the HF glue).

SWAT (Sliding Window Attention Training, arXiv 2502.18845) is an attention method of the
registry, `lcx.methods.swat.SWAT` (`{"type": "swat", "window": w, "alibi_slopes": [...]}`):
for query i and head h,

    o_i = sum_{i-w < j <= i} sigmoid( q~_i . k~_j / sqrt(d) - m_h * (i - j) ) v_j

(see that module for the definition, the slopes and the window convention). Like every
registry method it can be applied to any model (`lcx.patch`, `--attention swat --window w`:
`lcx.hf.attention_patch` runs `SWAT.attend` on unrotated q/k). This module is for the models
trained with it: their config records the method (`lcx.hf.recorded`, `config.lcx_attention`)
and they run it as loaded, through transformers' own attention interface. Building a SWAT
model (writing the config, a fresh model) is `lcx.models.swat` (`swat_config`,
`build_swat_model`), which uses this module.

What lives here, and why here: the attention and mask functions and their registration, and
what `from_pretrained` needs to load a SWAT directory. The method's parameters and maths are
`lcx.methods.swat` / `lcx.attention` (`SWAT.attention_spec`, reference `attention_ref`); the
record is read with `lcx.hf.recorded.recorded_method` (at every call, cached, and by
`lcx.engine`, which bounds the cache of a SWAT model as for any method, from `cache_window`).

How it plugs in (transformers 5.x attention-interface registry, no copied model code):

- `register()` adds the attention function `"lcx_swat"` to `transformers.AttentionInterface`
  (and a mask function of the same name that builds no mask: the window lives in the
  attention function). It is idempotent; importing this module calls it.
- The config carries the method, so it survives `save_pretrained` (`lcx.models.swat.swat_config`
  writes it):
      config.lcx_attention = {"type": "swat", "window": w, "alibi_slopes": [m_0, ...],
                              "backend": "blockwise"}
      config.sliding_window = w            # HF's DynamicCache keeps the last w - 1 keys
      config.attn_implementation = "lcx_swat"   # written to config.json: a plain
                                                # from_pretrained fails loudly unless
                                                # `lcx.hf.swat` was imported
  `backend` (and optionally `decode_backend`, for one-token calls) is the `lcx.attention`
  backend that runs the call (a speed choice; every backend computes the same thing). The
  slopes are stored, not recomputed, so a saved model keeps its schedule.
- Loading: `from_pretrained_kwargs(path)` registers the function and returns
  `{"attn_implementation": "lcx_swat"}` for a SWAT directory (`{}` otherwise); `lcx.load_model`
  passes it to `from_pretrained`. This also covers a directory re-saved by transformers, which
  drops `attn_implementation` from config.json but keeps `lcx_attention`.

Positions in the attention function (the `lcx.masks` convention): HF hands over the rotated
queries of this call, `[B, H, Tq, D]`, and every key the cache returns, `[B, Hkv, Tk, D]`, the
new ones last. Query t is key index `Tk - Tq + t`. That holds for a full forward, for chunked
prefill and for decode, with either a full `DynamicCache` or its sliding-window layers (which
return the kept w - 1 keys plus the new ones), because the window and the ALiBi term only
depend on i - j. Cost: O(Tq * w) scores per layer with the `blockwise` backend, and with HF's
sliding-window cache O(w) memory per layer during decoding, so any length runs, far beyond the
training length.

Padded batches: pass `lcx_key_positions` `[B, Tk]` (-1 = not a key of the row) instead of a
2-D mask, as `lcx.engine` does; each row then attends over its own (consecutive) keys.
Not supported (raises): padding as a 2-D attention_mask with zeros, custom 4-D masks,
attention dropout. Packed sequences (position_ids restarting inside a row) are not detected:
SWAT windows would then cross the boundary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from .recorded import CONFIG_KEY, recorded_method

ATTN_IMPLEMENTATION = "lcx_swat"
DEFAULT_BACKEND = "blockwise"


def swat_params(config: Any) -> Any:
    """The SWAT method (`lcx.methods.SWAT`) an HF config (object or dict) records, or None for
    a model that does not run SWAT as loaded."""
    cfg = recorded_method(config)
    return cfg.attention if cfg is not None and cfg.attention.name == "swat" else None


def _module_method(config: Any) -> Any:
    """The recorded `MethodConfig` of a layer running `"lcx_swat"` (a SWAT method + backends)."""
    cfg = recorded_method(config)
    if cfg is None or cfg.attention.name != "swat":
        raise ValueError(f"attn_implementation={ATTN_IMPLEMENTATION!r} needs config.{CONFIG_KEY} "
                         f"= {{'type': 'swat', 'window': w, ...}} (use lcx.models.swat.swat_config)")
    return cfg


# ------------------------------------------------------------------------ the HF functions


def swat_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query `[B, H, Tq, D]`, key/value `[B, Hkv, Tk, D]`
    (rotated, cache included, new tokens last) -> (out `[B, Tq, H, D]`, None)."""
    from lcx.attention import attention

    if attention_mask is not None:
        raise NotImplementedError(
            "SWAT attention builds its own window mask; a custom 4-D attention_mask is not supported")
    if dropout:
        raise NotImplementedError("SWAT attention has no attention dropout (set attention_dropout=0)")
    cfg = _module_method(module.config)
    method = cfg.attention.for_heads(query.shape[1])  # raises when stored slopes do not match
    spec = method.attention_spec(None if scaling is None else float(scaling))
    backend = cfg.backend or DEFAULT_BACKEND
    if query.shape[2] == 1 and cfg.decode_backend:
        backend = cfg.decode_backend
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, T, H, D]
    row_pos = kwargs.get("lcx_key_positions")
    if row_pos is not None:  # a padded batch (lcx.engine): each row on its own keys
        return _attend_rows(q, k, v, spec, row_pos.to(q.device), backend), None
    out = attention(q, k, v, spec, backend=backend)  # [B, Tq, H, D]; q_offset = Tk - Tq
    return out, None


def _attend_rows(q, k, v, spec, row_pos: torch.Tensor, backend: str) -> torch.Tensor:
    """Per-row SWAT of a padded batch (`lcx_key_positions`, as in `lcx.hf.attention_patch`).
    The window and ALiBi see index differences, so a row's keys must be consecutive positions
    (a full history, or the last keys of one: what the engine's eviction keeps)."""
    from lcx.attention import attention

    from .attention_patch import iter_rows

    out = q.new_zeros(q.shape[:3] + (v.shape[-1],))
    for b, idx, nq in iter_rows(row_pos, q.shape[1]):
        pos = row_pos[b, idx]
        if bool((pos.diff() != 1).any()):
            raise ValueError(f"row {b}: SWAT needs consecutive key positions, got {pos.tolist()[:8]}...")
        out[b : b + 1, q.shape[1] - nq :] = attention(
            q[b : b + 1, q.shape[1] - nq :], k[b : b + 1, idx], v[b : b + 1, idx], spec, backend=backend)
    return out


def swat_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """transformers mask function: SWAT needs no materialised mask (the window and causality are
    in the attention function), so return None, after refusing padding it cannot honour."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise NotImplementedError(
            "SWAT attention does not support padding (attention_mask has zeros); run unpadded rows")
    return None


def register() -> None:
    """Register `"lcx_swat"` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, swat_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, swat_mask)


# ---------------------------------------------------------------------- loading


def _read_config(path_or_config: Any) -> Mapping[str, Any] | Any:
    if isinstance(path_or_config, (str, os.PathLike)):
        p = Path(path_or_config)
        p = p / "config.json" if p.is_dir() else p
        with open(p) as f:
            return json.load(f)
    return path_or_config


def from_pretrained_kwargs(path_or_config: Any) -> dict[str, Any]:
    """Extra `from_pretrained` kwargs for a model directory (or its config / config dict):
    `{"attn_implementation": "lcx_swat"}` for SWAT, after registering it; `{}` otherwise.

        model = AutoModelForCausalLM.from_pretrained(path, **swat.from_pretrained_kwargs(path))
    """
    cfg = recorded_method(_read_config(path_or_config))
    if cfg is None:
        return {}
    if cfg.attention.name != "swat":  # nothing else runs as loaded; apply it with lcx.patch instead
        raise ValueError(f"config.{CONFIG_KEY} records {cfg.attention.describe()}; only SWAT models run "
                         "their recorded method as loaded (apply other methods with lcx.patch)")
    register()
    return {"attn_implementation": ATTN_IMPLEMENTATION}


def is_swat(model_or_config: Any) -> bool:
    """True for a model (or config) that runs SWAT as loaded (its config records it)."""
    return swat_params(model_or_config) is not None


register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CONFIG_KEY",
    "DEFAULT_BACKEND",
    "from_pretrained_kwargs",
    "is_swat",
    "register",
    "swat_attention_forward",
    "swat_mask",
    "swat_params",
]
