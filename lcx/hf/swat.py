"""SWAT inside transformers: how a stock `LlamaForCausalLM` runs SWAT's attention (the HF glue).

SWAT (Sliding Window Attention Training, arXiv 2502.18845): for query i and head h,

    o_i = sum_{i-w < j <= i} sigmoid( q~_i . k~_j / sqrt(d) - m_h * (i - j) ) v_j

q~, k~: q and k rotated by RoPE (the Llama rotary embedding, unchanged); w: the window, in
keys, the query itself included (`lcx.masks.sliding_window(left=w - 1)`); m_h: lcx's balanced ALiBi
slopes (`lcx.attention.balanced_alibi_slopes`: the first half of the heads penalise distance,
m > 0, the second half favour it, m < 0). In the paper's notation `b_h * (i - j)` with
b_h = -m_h. Sigmoid, not softmax: no normalisation over keys, hence no attention sink. The
maths is `lcx.attention` (`AttentionSpec.swat`, reference `attention_ref`); this module only
plugs it into transformers. Building a SWAT model (writing the config, a fresh model) is
`lcx.models.swat` (`swat_config`, `build_swat_model`), which uses this module.

What lives here, and why here: the attention and mask functions and their registration, the
format of the parameters in an HF config (`SwatParams`, `config.lcx_attention`, read back at
every call and by `lcx.engine`) and what `from_pretrained` needs to load a SWAT directory. That
is how SWAT is installed into transformers modules, as `lcx.hf.attention_patch` is for the
attention methods; it depends on `lcx.attention` only, never on `lcx.models`.

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
  `backend` is the `lcx.attention` backend that runs the call (a speed choice; every backend
  computes the same thing). The slopes are stored, not recomputed, so a saved model keeps its
  schedule.
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

import functools
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import torch

ATTN_IMPLEMENTATION = "lcx_swat"
CONFIG_KEY = "lcx_attention"
DEFAULT_BACKEND = "blockwise"


@dataclass(frozen=True)
class SwatParams:
    """SWAT's parameters as stored in `config.lcx_attention` (plus `"type": "swat"`).

    window:       keys each query sees, itself included (w >= 1).
    alibi_slopes: per query head, `lcx.attention` convention (logit gets -m_h * (i - j)).
    backend:      `lcx.attention` backend name (speed only; same result).
    """

    window: int
    alibi_slopes: tuple[float, ...]
    backend: str = DEFAULT_BACKEND

    def __post_init__(self) -> None:
        from lcx.attention import BACKENDS

        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"SWAT window must be an integer >= 1, got {self.window!r}")
        slopes = tuple(float(s) for s in self.alibi_slopes)
        if not slopes or not all(math.isfinite(s) for s in slopes):
            raise ValueError(f"SWAT alibi_slopes must be finite and non-empty, got {slopes}")
        object.__setattr__(self, "alibi_slopes", slopes)
        if self.backend not in BACKENDS:
            raise ValueError(f"SWAT backend {self.backend!r} is not known; known: {sorted(BACKENDS)}")

    @classmethod
    def default(cls, window: int, n_heads: int, backend: str = DEFAULT_BACKEND) -> "SwatParams":
        from lcx.attention import balanced_alibi_slopes

        return cls(window, balanced_alibi_slopes(n_heads), backend)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SwatParams":
        d = dict(d)
        kind = d.pop("type", "swat")
        if kind != "swat":
            raise ValueError(f"{CONFIG_KEY}.type is {kind!r}, not 'swat'")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown {CONFIG_KEY} key(s) {unknown}; accepted: {sorted(names | {'type'})}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "swat", "window": self.window, "alibi_slopes": list(self.alibi_slopes),
                "backend": self.backend}


def swat_params(config: Any) -> SwatParams | None:
    """The SWAT parameters of an HF config (object or dict), or None for a non-SWAT model."""
    d = config.get(CONFIG_KEY) if isinstance(config, Mapping) else getattr(config, CONFIG_KEY, None)
    if not d or d.get("type") != "swat":
        return None
    return SwatParams.from_dict(d)


@functools.lru_cache(maxsize=64)
def _spec(window: int, slopes: tuple[float, ...], scale: float | None):
    from lcx.attention import AttentionSpec

    return AttentionSpec.swat(window, len(slopes), alibi_slopes=slopes, scale=scale)


@functools.lru_cache(maxsize=64)
def _params_cached(window: int, slopes: tuple[float, ...], backend: str) -> SwatParams:
    return SwatParams(window, slopes, backend)


def _module_params(config: Any) -> SwatParams:
    d = getattr(config, CONFIG_KEY, None)
    if not d or d.get("type") != "swat":
        raise ValueError(f"attn_implementation={ATTN_IMPLEMENTATION!r} needs config.{CONFIG_KEY} "
                         f"= {{'type': 'swat', 'window': w, ...}} (use lcx.models.swat.swat_config)")
    extra = set(d) - {"type", "window", "alibi_slopes", "backend"}
    if extra:
        raise ValueError(f"unknown {CONFIG_KEY} key(s) {sorted(extra)}")
    return _params_cached(d["window"], tuple(d["alibi_slopes"]), d.get("backend", DEFAULT_BACKEND))


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
    p = _module_params(module.config)
    if len(p.alibi_slopes) != query.shape[1]:
        raise ValueError(f"{len(p.alibi_slopes)} SWAT alibi slopes for {query.shape[1]} heads")
    spec = _spec(p.window, p.alibi_slopes, None if scaling is None else float(scaling))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, T, H, D]
    row_pos = kwargs.get("lcx_key_positions")
    if row_pos is not None:  # a padded batch (lcx.engine): each row on its own keys
        return _attend_rows(q, k, v, spec, row_pos.to(q.device), p.backend), None
    out = attention(q, k, v, spec, backend=p.backend)  # [B, Tq, H, D]; q_offset = Tk - Tq
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
    if swat_params(_read_config(path_or_config)) is None:
        return {}
    register()
    return {"attn_implementation": ATTN_IMPLEMENTATION}


def is_swat(model_or_config: Any) -> bool:
    config = getattr(model_or_config, "config", model_or_config)
    return swat_params(config) is not None


register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CONFIG_KEY",
    "DEFAULT_BACKEND",
    "SwatParams",
    "from_pretrained_kwargs",
    "is_swat",
    "register",
    "swat_attention_forward",
    "swat_mask",
    "swat_params",
]
