"""Apply an attention method to a loaded Hugging Face model of any supported family, in place and
reversibly.

    model, tok = lcx.load_model("tiny-5m")
    with lcx.patched(model, {"rope_type": "yarn", "factor": 4}), \\
         attention_patched(model, lm_infinite(n_global=16, n_local=1024)):
        logits = model(ids).logits          # LM-Infinite + YaRN
    # the model as loaded again

The mechanism (stated once; `lcx.hf`'s docstring points here). Every supported family's
attention forward in transformers 5.x does, in this order (`lcx.hf.models`):

    q, k, v = the family's own code (projections, biases, q/k norms, clipping, scaling attrs)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)          # looked up in its modeling module
    k, v = past_key_values.update(k, v, layer_idx)
    out, _ = ALL_ATTENTION_FUNCTIONS[config._attn_implementation](self, q, k, v, mask,
                                     scaling=self.scaling, sliding_window=..., **kwargs)
    return o_proj(out)

`patch_attention` takes over the two calls, not the forward:

1. **rotation**: the modeling module's `apply_rotary_pos_emb` (the global the forward reads,
   `type(attn).forward.__globals__`) is wrapped once per module; inside a patched layer's call it
   returns q and k UNROTATED (and keeps the family's cos/sin for the engine), everywhere else it
   is the original function. So the cache receives keys before RoPE.
2. **attention**: `config._attn_implementation` is switched to `"lcx_attention_method"`,
   registered with transformers' attention and mask interfaces. The attention function receives
   the family's q, k, v (unrotated, cache included, new tokens last) and runs the layer's
   `method.attend` with an `lcx.attention.Rotary` holding the keys' positions and the layer's
   RoPE basis (read at call time from the model's rotary module, `lcx.hf.rope_patch.rope_basis`,
   per layer type for Gemma 3; so RoPE specs applied with `lcx.patch` compose with any method in
   either order). The mask function builds no mask (the method owns masking and causality; no
   [T, T] mask is ever materialised) and refuses padding.

Which call is "inside a patched layer" is known from a thin instance-level `forward` on each
patched attention module that marks the call (a context variable) and calls the class's own
forward unchanged. Another on the decoder stack keeps lcx's per-call keyword inputs
(`lcx_key_positions`, `lcx_decode`) for the attention calls inside it, so a family whose decoder
layers drop their keyword arguments (StableLM, Nemotron) still hands them over. No family's forward is copied. `unpatch_attention` deletes those instance
forwards and restores `_attn_implementation`; the wrapped `apply_rotary_pos_emb` stays, and is
the original function outside patched calls.

**Hybrid local/global models** (Gemma 3: `config.layer_types` with "sliding_attention" and
"full_attention" layers). `layers="global"` (the default) runs the method on the full-attention
layers; the sliding layers keep the family's own window, run as `lcx.methods.sliding_window
(window=config.sliding_window)` (the same keys as transformers' sliding mask: the query and the
w - 1 before it) on their own RoPE basis. `layers="all"` runs the method on every layer (each
still on its own layer type's RoPE basis). Models whose layers are all alike get the method on
every layer either way (Mistral's `sliding_window`, the same on every layer, is replaced by the
method). `layer_methods(model)` says what each layer runs: what `lcx.engine` needs to bound each
layer's cache to that layer's own window (`cache_window` per layer).

**A hybrid model as loaded, faster** (`as_loaded_method`): transformers runs a sliding layer as
a masked pass over the whole prompt (O(T^2) work for a window of w keys). `patch_attention(model,
causal())` runs the same model exactly (causal attention on the global layers, each sliding layer
its own window) with every layer on lcx's backend: on `flash` the sliding layers cost O(T * w)
and the global layers take the same fused causal kernel as SDPA. `lcx.engine` does this for a
hybrid model with no attention method (so `lcx serve`, `lcx report` and `lm_eval --model lcx`,
whose loglikelihood forwards run the engine's patched model, all get it).

Semantics stated once:
- **The KV cache holds keys BEFORE RoPE** in every patched layer (whatever `Cache` it is
  given). Do not mix a cache filled by a patched model with an unpatched one, or vice versa.
- **Positions.** With a `DynamicCache` (or no cache), key j of the Tk returned by the cache has
  position `position_ids[:, 0] - (Tk - Tq) + j`: the cache is the contiguous history of the
  sequence (or its last keys, as transformers' sliding-window cache layers keep them).
  `position_ids` must be contiguous in each row (no padding, no packing; raises otherwise).
  With `lcx.hf.BoundedKVCache` the cache itself records each slot's position.
- **Queries are the last Tq keys** (`lcx.masks` convention) for prefill, chunked prefill and
  decode alike.
- **Padded / ragged batches** (what `lcx.engine` runs): pass `lcx_key_positions` `[B, Tk]` (long)
  as a keyword of the model's forward and no `attention_mask`. Entry (b, j) is the position of
  the row's j-th key (the cache's keys followed by the Tq new ones), or -1 where that slot is not
  a key of row b (left padding, evicted slot). Each row's keys are then the slots >= 0, in
  order; they must be [first n_first | a contiguous run ending at the row's newest token]
  (a full history, or what a bounded cache keeps) and the row's queries its last new slots.
  Attention runs on each row's own keys (projections and MLPs stay batched; rows with equal
  numbers of queries and keys share one call), exactly as an unpadded row with a
  `BoundedKVCache` would; padded query slots get zeros. A layer running its own window raises
  if a row's keys do not cover that window (a cache bounded by another layer's method).
- **Channel order** (families whose RoPE is not rotate-half on the whole head: partial rotary,
  Phi, GLM-4-MoE; interleaved pairs, Cohere, GLM-4, ERNIE 4.5): the layout is
  found on a probe of the family's own rotation when the patch is installed
  (`channel_order(model)`; a layout lcx cannot hold raises); the attention function puts q and k
  in lcx's channel order, the layer's basis gets zero frequencies for passed channels, and the
  query is corrected for an attention factor (`lcx.hf.channel_order`, the statement). The cache
  keeps the family's order.
- **The engine's decode step** (`lcx_decode`, `lcx.engine.kv.ModelStep`): the attention
  function hands the layer's new q/k/v to `step.attend`, which attends with the layer's own
  cache and rule (per-layer windows and RoPE bases on a hybrid model; a step declares it with
  `per_layer = True`): unrotated (lcx order) on a patched model, which the step rotates; rotated
  by the family's own `apply_rotary_pos_emb` on a model with the decode hook only.
  `install_decode_hook` gives an unpatched model the same route for decode calls only (every
  other call runs the model's own rotation and attention implementation, its own masks), and
  for a prefill that continues from held keys, inside `loaded_rows` (what the engine runs after
  a prefix-cache hit or between chunks): attention per row on lcx's backend from the slots'
  positions, no mask built (transformers' SDPA takes a slow masked path whenever Tq != Tk).

Supported: the families of `lcx.hf.models.FAMILIES`; a family's attention-logit soft-capping
(Gemma 2: the attention call's `softcap`) reaches the method (`method.attend(..., softcap=)`),
and its layers run on a backend that caps (`blockwise` in place of one that cannot, logged).
Not supported (raises): padding in `attention_mask`, custom 4-D masks, attention dropout in
training mode, an attention module whose forward does not call the two hooks (e.g. NoPE layers).

Part of the HF adapter (`lcx.hf`): the methods (`lcx.methods`) know nothing of
transformers; this module installs them in a model. `lcx.methods` re-exports `patch_attention`,
`unpatch_attention`, `attention_patched`, `current_attention` and `ATTN_IMPLEMENTATION`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from lcx.attention import BACKENDS, Rotary
from lcx.methods.base import AttentionMethod
from lcx.methods.registry import method_from_dict
from lcx.methods.sliding_window import sliding_window

from .bounded_cache import BoundedKVCache
from .calls import CURRENT_CALL, AttentionCall, current_call
from .channel_order import ChannelOrder, detect
from .models import (attention_layers, attention_softcap, check_model_type, decoder, layer_types, model_shape,
                     rope_layer_types)
from .rope_patch import rope_basis, rotary_table_layout

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "lcx_attention_method"
DEFAULT_BACKEND = "blockwise"
LAYERS = ("global", "all")
_STATE = "_lcx_attention_method"  # on the model: _Patch; on each attention module: _ModuleState
_HOOK = "_lcx_decode_hook"  # on a model with the decode hook only: the attn implementation it had


@dataclass
class _Patch:
    method: AttentionMethod
    backend: str
    original_attn_implementation: Any
    decode_backend: str | None = None
    layers: str = "global"
    order: ChannelOrder | None = None  # the family's channel layout (lcx.hf.channel_order)


@dataclass
class _ModuleState:
    """What one attention module runs. `method` None: the engine's decode hook only."""

    method: AttentionMethod | None
    backend: str
    decoder: "weakref.ref[nn.Module]"  # owns rotary_emb: the RoPE basis is read from it per call
    decode_backend: str | None = None  # for calls with one query token (None: `backend`)
    chosen: AttentionMethod | None = None  # the model's method (differs on layers running their own window)
    layer_type: str | None = None  # the layer's RoPE layer type (models with RoPE per layer type)
    inner: str | None = None  # the model's own attn implementation (decode hook: every other call)
    order: ChannelOrder | None = None  # the family's channel layout (patched models; lcx.hf.channel_order)

    def backend_for(self, n_queries: int) -> str:
        return self.decode_backend if n_queries == 1 and self.decode_backend else self.backend

    @property
    def own_window(self) -> bool:
        """True on a layer that runs the family's own sliding window, not the model's method."""
        return self.method is not None and self.method != self.chosen


# ------------------------------------------------------------------------ hook 1: the rotation


def _rotation_hook(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        call = CURRENT_CALL.get()
        if call is None:
            return original(q, k, cos, sin, *args, **kwargs)
        call.cos_sin, call.rotation_seen = (cos, sin), True
        if call.state.method is None:  # the engine's decode step on a model as loaded: its own rotation
            return original(q, k, cos, sin, *args, **kwargs)
        return q, k  # unrotated: lcx rotates inside the method's call

    apply_rotary_pos_emb._lcx_original = original
    return apply_rotary_pos_emb


def _install_rotation_hook(attn: nn.Module) -> None:
    """Wrap `apply_rotary_pos_emb` where `type(attn).forward` looks it up (idempotent)."""
    namespace, fn, _ = _rotation_function(attn)
    if not hasattr(fn, "_lcx_original"):
        namespace["apply_rotary_pos_emb"] = _rotation_hook(fn)


def _rotation_function(attn: nn.Module) -> tuple[dict, Callable, str]:
    """(the namespace `type(attn).forward` reads, its `apply_rotary_pos_emb`, the module's name)."""
    namespace = type(attn).forward.__globals__
    where = namespace.get("__name__")
    fn = namespace.get("apply_rotary_pos_emb")
    if fn is None:
        raise ValueError(f"{type(attn).__name__}.forward's module ({where}) has no "
                         "apply_rotary_pos_emb to hook; this attention module is not supported")
    return namespace, fn, where


def channel_order(model: nn.Module) -> ChannelOrder:
    """How the family's rotation lays out a head's channels (`lcx.hf.channel_order`): found by
    running its own `apply_rotary_pos_emb` on a probe with tables in its rotary module's layout,
    so a family whose rotation lcx cannot hold raises `ValueError` instead of being silently
    wrong."""
    _, fn, where = _rotation_function(attention_layers(model)[0])
    shape = model_shape(model)
    return _detect(getattr(fn, "_lcx_original", fn), shape.head_dim, shape.rotary_dim, rotary_table_layout(model),
                   where)


_detect = functools.lru_cache(maxsize=None)(detect)


# ------------------------------------------------------------------------ the instance forward


# lcx's per-call inputs of the decoder call running now (`_hooked_decoder_forward`)
_LCX_INPUTS = ("lcx_decode", "lcx_key_positions")
_INPUTS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("lcx_call_inputs", default=None)


def _hooked_decoder_forward(self: nn.Module, *args: Any, **kwargs: Any):
    """The decoder stack's own forward (instance-bound), with lcx's per-call inputs
    (`lcx_key_positions`, `lcx_decode`) kept for the attention calls inside it: transformers
    hands a forward's keyword arguments down to the attention, but some families' decoder layers
    call their attention without them (StableLM, Nemotron)."""
    token = _INPUTS.set({k: kwargs[k] for k in _LCX_INPUTS if k in kwargs})
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _INPUTS.reset(token)


def _lcx_input(kwargs: Mapping[str, Any], name: str) -> Any:
    """`name` (one of `_LCX_INPUTS`) of an attention call: its own keyword, else the decoder
    call's (`_hooked_decoder_forward`), else None."""
    if name in kwargs:
        return kwargs[name]
    held = _INPUTS.get()
    return None if held is None else held.get(name)


def _hook_decoder(dec: nn.Module, on: bool) -> None:
    if on:
        dec.forward = types.MethodType(_hooked_decoder_forward, dec)
    else:
        dec.__dict__.pop("forward", None)


def _hooked_forward(self: nn.Module, *args: Any, **kwargs: Any):
    """The class's own forward, with the call marked for the two hooks (instance-bound)."""
    st: _ModuleState = self.__dict__[_STATE]
    if st.method is None and _lcx_input(kwargs, "lcx_decode") is None:
        return type(self).forward(self, *args, **kwargs)  # decode hook only: a stock call
    # (the layer's cache: `past_key_values`, GPT-NeoX's `layer_past`)
    token = CURRENT_CALL.set(AttentionCall(self, st, kwargs.get("past_key_values", kwargs.get("layer_past"))))
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        CURRENT_CALL.reset(token)


# ------------------------------------------------------------------------ hook 2: the attention


def _inner_function(module: nn.Module, name: str | None) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = type(module).forward.__globals__.get("eager_attention_forward")
    if name in (None, "eager"):
        return eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)


def lcx_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  sliding_window: int | None = None, softcap: float | None = None, **kwargs: Any):
    """transformers attention function of `"lcx_attention_method"`: query `[B, H, Tq, D]`, key/value
    `[B, Hkv, Tk, D]` (unrotated inside a patched call; cache included, new tokens last)
    -> (out `[B, Tq, H, D]`, None)."""
    softcap = softcap or None  # (families pass 0 / None for none)
    call = CURRENT_CALL.get()
    st: _ModuleState | None = module.__dict__.get(_STATE)
    if call is None or call.module is not module:
        if st is not None and st.method is None:  # decode hook, not a decode call: the model's own
            rows = _LOADED_ROWS.get()
            if rows is not None:  # lcx.engine's prefill continuing from held keys (`loaded_rows`)
                if dropout:
                    raise NotImplementedError("loaded_rows: attention dropout is not supported")
                return _attend_loaded_rows(module, query.transpose(1, 2), key.transpose(1, 2),
                                           value.transpose(1, 2), rows, scaling, softcap), None
            return _inner_function(module, st.inner)(module, query, key, value, attention_mask, scaling=scaling,
                                                     dropout=dropout, sliding_window=sliding_window,
                                                     softcap=softcap, **kwargs)
        raise RuntimeError(
            f"config._attn_implementation is {ATTN_IMPLEMENTATION!r} but this attention module is not "
            "patched by lcx.hf.attention_patch.patch_attention; call patch_attention on the model, or set "
            "another attn_implementation")
    st = call.state
    if not call.rotation_seen:
        raise NotImplementedError(f"{type(module).__name__}.forward did not call apply_rotary_pos_emb before its "
                                  "attention (e.g. a NoPE layer); lcx attention methods cannot run it")
    if dropout:
        raise NotImplementedError("lcx attention methods have no attention dropout")
    if st.own_window and sliding_window is not None and sliding_window != st.method.window:
        raise ValueError(f"layer {module.layer_idx}: the family's sliding_window is {sliding_window}, the patch "
                         f"assumed {st.method.window}")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, T, H(kv), D]
    order = st.order
    if order is not None and not order.identity:  # held in lcx's channel order (lcx.hf.channel_order)
        q, k = order.to_lcx(q), order.to_lcx(k)
    step = _lcx_input(kwargs, "lcx_decode")
    if step is not None:  # lcx.engine's decode step over its cache of rotated keys (lcx.engine.kv)
        if st.own_window and not getattr(step, "per_layer", False):
            raise NotImplementedError(
                f"layer {module.layer_idx} runs the family's own window ({st.method.describe()}), the model's "
                f"method is {st.chosen.describe()}: a decode step that runs one method on every layer cannot "
                "run it (lcx.engine's per-layer step, lcx.engine.kv.ModelStep, can; lcx.hf.layer_methods)")
        # (it corrects a partial head's query with its own basis)
        return step.attend(module, q, k, v, softcap=softcap), None
    if attention_mask is not None:
        raise NotImplementedError("lcx attention methods build their own masks; got a custom attention_mask")
    return _attend(module, st, call, q, k, v, kwargs, softcap), None


def _attend(module: nn.Module, st: _ModuleState, call: AttentionCall, q, k, v, kwargs: Mapping[str, Any],
            softcap: float | None = None) -> torch.Tensor:
    """The layer's method on q `[B, Tq, H, D]`, k/v `[B, Tk, Hkv, D]` (unrotated) -> `[B, Tq, H, D]`;
    `softcap`: the family's attention-logit soft-capping (Gemma 2), handed to the method."""
    Tq, Tk = q.shape[1], k.shape[1]
    decoder = st.decoder()
    if decoder is None:
        raise RuntimeError("the model this attention module was patched for no longer exists")
    layer_idx = module.layer_idx
    row_pos = _lcx_input(kwargs, "lcx_key_positions")
    if row_pos is not None:
        return _attend_rows(st, q, k, v, row_pos.to(q.device), decoder, module.scaling, layer_idx, softcap)
    cache = call.cache
    position_ids = kwargs.get("position_ids")
    if isinstance(cache, BoundedKVCache):
        true_pos = cache.key_positions(layer_idx)  # [Tk]
        if position_ids is not None and not torch.equal(position_ids[0].to(true_pos.device), true_pos[-Tq:]):
            raise ValueError("position_ids disagree with the positions the bounded cache assigned "
                             f"({position_ids[0].tolist()[:4]}... vs {true_pos[-Tq:].tolist()[:4]}...)")
        rot_pos = cache.rotary_positions(layer_idx)
        seq_len = int(true_pos[-1]) + 1
    else:
        rot_pos = _key_positions(position_ids, Tq, Tk, q.device)
        if int(rot_pos.min()) > 0:  # the cache returned a suffix of the history
            _check_sliding_cache_layer(st, cache, layer_idx)
        seq_len = int(rot_pos.max()) + 1
    inv_freq, af, q = _basis(decoder, seq_len, st, q)
    rotary = Rotary(inv_freq.to(q.device), rot_pos, af)
    return st.method.attend(q, k, v, rotary=rotary, backend=st.backend_for(Tq), scale=module.scaling,
                            layer_idx=layer_idx, softcap=softcap)  # [B, Tq, H, D]


def _basis(decoder: nn.Module, seq_len: int, st: _ModuleState, q: torch.Tensor):
    """(inv_freq `[D/2]`, attention_factor, q) of a call: the layer's RoPE basis at `seq_len`;
    on a partial rotary head (q in lcx's channel order) padded with zero frequencies, and q's
    passed channels corrected for the attention factor (`lcx.hf.channel_order`)."""
    inv_freq, af = rope_basis(decoder, seq_len, layer_type=st.layer_type)
    if st.order is not None:
        inv_freq, q = st.order.basis(inv_freq), st.order.fix_query(q, af)
    return inv_freq, af, q


def _check_sliding_cache_layer(st: _ModuleState, cache: Any, layer_idx: int) -> None:
    """transformers' sliding-window cache layers (what `DynamicCache(config=...)` makes for a
    hybrid model's sliding layers) keep the last `sliding_window - 1` keys between calls: enough
    for the family's own window, not for a method that sees further (`layers="all"`). Called
    when the keys a cache returned do not start at position 0."""
    layers = getattr(cache, "layers", None)
    if not layers or layer_idx >= len(layers):
        return
    w = getattr(layers[layer_idx], "sliding_window", None)
    if w is None:
        return
    window = st.method.cache_window
    if window is None or window[0] > 0 or window[1] > w:
        raise ValueError(
            f"layer {layer_idx}'s cache is a transformers sliding-window layer (keeps {w - 1} keys) but the layer "
            f"runs {st.method.describe()}, which sees other keys; pass a cache without sliding layers "
            "(transformers.DynamicCache() with no config, or lcx.hf.BoundedKVCache)")


def _key_positions(position_ids: torch.Tensor | None, n_queries: int, n_keys: int,
                   device: torch.device) -> torch.Tensor:
    """Positions `[Tk]` or `[B, Tk]` of the Tk keys of a contiguous history (see module doc)."""
    past = n_keys - n_queries
    if position_ids is None:
        return torch.arange(n_keys, device=device)
    pid = position_ids.to(device)  # [B or 1, Tq]
    start = pid[:, :1]  # [B, 1]
    if not torch.equal(pid, start + torch.arange(n_queries, device=device)):
        raise ValueError("lcx attention methods need contiguous position_ids in each row "
                         "(no padding, no packed sequences)")
    if pid.shape[0] > 1 and not torch.equal(start, start[:1].expand_as(start)):
        return start - past + torch.arange(n_keys, device=device)  # [B, Tk]
    first = int(start[0, 0]) - past
    if first < 0:
        raise ValueError(f"position_ids start at {int(start[0, 0])} but the cache holds {past} earlier keys")
    return torch.arange(first, first + n_keys, device=device)


def iter_rows(row_pos: torch.Tensor, n_queries: int):
    """Rows of a padded batch described by `lcx_key_positions` `[B, Tk]` (-1: not a key of the
    row): yields (b, idx [Tk_b] of the row's key slots, nq = its real queries, the last nq of
    the n_queries new slots); rows without a real query are skipped."""
    Tk = row_pos.shape[1]
    for b in range(row_pos.shape[0]):
        valid = row_pos[b] >= 0  # [Tk]
        nq = int(valid[Tk - n_queries:].sum())
        if nq == 0:
            continue
        if not bool(valid[Tk - nq:].all()):
            raise ValueError(f"row {b}: its new tokens must be the last slots (left padding only)")
        yield b, valid.nonzero().squeeze(1), nq


def row_groups(row_pos: torch.Tensor, n_queries: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The rows of `iter_rows` grouped by their numbers of real queries and of keys, so each group
    is one batched call: yields (nq, bs [G] row indices, idx [G, n] each row's key slots)."""
    groups: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}  # (nq, keys) -> rows
    for b, idx, nq in iter_rows(row_pos, n_queries):
        groups.setdefault((nq, len(idx)), []).append((b, idx))
    for (nq, _), rows in groups.items():
        yield nq, torch.tensor([b for b, _ in rows], device=row_pos.device), torch.stack([i for _, i in rows])


def _attend_rows(st: _ModuleState, q, k, v, row_pos: torch.Tensor, decoder: nn.Module, scale: float,
                 layer_idx: int | None = None, softcap: float | None = None):
    """Attention of a padded batch (see "Padded / ragged batches" in the module doc): rows with
    the same number of real queries and of keys are one batched call (per-row rotary positions),
    so a decode step of many requests costs a few calls, not one per row.

    q `[B, Tq, H, D]`, k/v `[B, Tk, Hkv, D]` (unrotated), row_pos `[B, Tk]` -> out `[B, Tq, H, D]`.
    """

    B, Tq = q.shape[:2]
    Tk = k.shape[1]
    if row_pos.shape != (B, Tk):
        raise ValueError(f"lcx_key_positions has shape {tuple(row_pos.shape)}; expected {(B, Tk)}")
    inv_freq, af, q = _basis(decoder, int(row_pos.max()) + 1, st, q)  # one basis per batch
    inv_freq = inv_freq.to(q.device)
    out = q.new_zeros(q.shape[:3] + (v.shape[-1],))
    for nq, bs, idx in row_groups(row_pos, Tq):
        pos = row_pos[bs[:, None], idx]  # [G, n] true positions
        if st.own_window:
            _check_window_kept(st.method.window, pos, nq, layer_idx)
        rot = torch.arange(idx.shape[1], device=q.device).expand(*idx.shape) if st.method.renumber_in_cache else pos
        out[bs, Tq - nq:] = st.method.attend(
            q[bs, Tq - nq:], k[bs[:, None], idx], v[bs[:, None], idx],
            rotary=Rotary(inv_freq, rot, af), backend=st.backend_for(nq), scale=scale, layer_idx=layer_idx,
            softcap=softcap,
        ).to(out.dtype)  # fmt: skip
    return out


def _check_window_kept(window: int, pos: torch.Tensor, nq: int, layer_idx: int | None) -> None:
    """A layer running its own window of `window` keys needs, for its first query at p0, every
    position from max(0, p0 - window + 1) on: raise if the rows' keys `pos` `[G, n]` lack one."""
    newest = pos[:, -1]  # [G]
    first_needed = (newest - nq + 1 - window + 1).clamp(min=0)  # [G]
    have = (pos >= first_needed[:, None]).sum(-1)  # [G]
    if bool((have < newest - first_needed + 1).any()):
        raise ValueError(
            f"layer {layer_idx} runs the family's own sliding window of {window} keys but the cache handed to it "
            "lacks some of them (evicted by a cache bounded for another layer's method; bound each layer by its "
            "own method: lcx.hf.layer_methods)")


# ------------------------------------------------------------------------ an unpatched model's prefill rows


@dataclass(frozen=True)
class _LoadedRows:
    key_positions: torch.Tensor  # [B, Tk] (-1: not a key of the row)
    windows: tuple[int | None, ...]  # per layer: the window the model as loaded runs, None: causal
    backend: str


_LOADED_ROWS: contextvars.ContextVar[_LoadedRows | None] = contextvars.ContextVar("lcx_loaded_rows", default=None)


@contextlib.contextmanager
def loaded_rows(key_positions: torch.Tensor, windows: Sequence[int | None], backend: str) -> Iterator[None]:
    """Inside: a model with the decode hook only (`install_decode_hook`: unpatched, its cache
    holding ROTATED keys) runs every prefill call's attention per row on `backend`, from the
    slots' positions `key_positions` `[B, Tk]` (as `lcx_key_positions`: -1 where not a key of
    the row; each row's keys a contiguous run of positions ending at its newest token), with no
    mask built: causal, or a sliding window of `windows[layer]` keys (the query and the w - 1
    before it, transformers' sliding masks). The same attention as the model's own masked call,
    without the masked pass: on the CPU, transformers' SDPA takes an explicit [Tq, Tk] mask
    whenever a prefill continues from cached keys (Tq != Tk) and runs it markedly slower than its
    causal kernel, while lcx's flash backend splits the call into an unmasked pass over the held
    keys and a causal one over the new tokens. What `lcx.engine` runs for a prefill continuing
    from a prefix-cache hit or a previous chunk on a model as loaded (`Engine._prefill_forward`);
    refuses dropout (the engine does not ask for it then)."""
    token = _LOADED_ROWS.set(_LoadedRows(key_positions, tuple(windows), backend))
    try:
        yield
    finally:
        _LOADED_ROWS.reset(token)


def _attend_loaded_rows(module: nn.Module, q, k, v, rows: _LoadedRows, scale: float | None,
                        softcap: float | None = None) -> torch.Tensor:
    """q `[B, Tq, H, D]`, k/v `[B, Tk, Hkv, D]`, rotated by the model -> out `[B, Tq, H, D]`
    (rows grouped by their numbers of queries and keys, as `_attend_rows`; `softcap`: the
    family's attention-logit soft-capping, on `blockwise` where the rows' backend has none)."""
    from lcx.attention import AttentionSpec, attention, backend_for
    from lcx.masks import causal_mask
    from lcx.masks import sliding_window as sliding_window_mask

    row_pos = rows.key_positions.to(q.device)
    B, Tq = q.shape[:2]
    if row_pos.shape != (B, k.shape[1]):
        raise ValueError(f"loaded_rows: key positions of shape {tuple(row_pos.shape)}; expected {(B, k.shape[1])}")
    w = rows.windows[module.layer_idx]
    spec = AttentionSpec(mask=causal_mask if w is None else sliding_window_mask(left=int(w) - 1), scale=scale,
                         softcap=softcap)
    backend = backend_for(rows.backend, spec)
    out = q.new_zeros(q.shape[:3] + (v.shape[-1],))
    for nq, bs, idx in row_groups(row_pos, Tq):
        n = idx.shape[1]
        pos = row_pos[bs[:, None], idx]
        if n > 1 and not bool((pos[:, 1:] - pos[:, :-1] == 1).all()):
            raise ValueError("loaded_rows: each row's keys must be a contiguous run of positions")
        if len(bs) == B and n == k.shape[1]:  # every row, every slot: no gather
            kr, vr = k, v
        else:
            kr, vr = k[bs[:, None], idx], v[bs[:, None], idx]
        out[bs, Tq - nq:] = attention(q[bs, Tq - nq:], kr, vr, spec, backend=backend).to(out.dtype)
    return out


# ------------------------------------------------------------------------ transformers registration


def _no_mask(*, attention_mask: torch.Tensor | None = None, config: Any = None, **kwargs: Any) -> Any:
    """Mask function: a patched model's layers mask by themselves (their methods are causal);
    refuse padding they cannot honour. A model with the decode hook only: its own mask function."""
    inner = _HOOKED_CONFIGS.get(id(config)) if config is not None else None
    if inner is not None and _LOADED_ROWS.get() is not None:
        return None  # `loaded_rows`: the attention masks from the rows' positions
    if inner is not None:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        return ALL_MASK_ATTENTION_FUNCTIONS[inner](attention_mask=attention_mask, config=config, **kwargs)
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise NotImplementedError(
            "lcx attention methods take no padded attention_mask (it has zeros); pass lcx_key_positions "
            "[B, Tk] instead (see lcx.hf.attention_patch), or run unpadded rows")
    return None


# id(config) -> the attn implementation a model with the decode hook only had (its masks are built
# by that implementation's mask function)
_HOOKED_CONFIGS: dict[int, str] = {}


def register() -> None:
    """Register `"lcx_attention_method"` with transformers' attention/mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, lcx_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


# ------------------------------------------------------------------------ the engine's decode hook


def install_decode_hook(model: nn.Module) -> None:
    """Let every attention layer of `model` run `lcx.engine`'s decode step (the `lcx_decode`
    keyword of the model's forward; `lcx.engine.kv.DecodeStep`). A model patched with an
    attention method has it already; an unpatched one gets the two hooks for decode calls only
    (every other call runs as loaded: the model's own rotation, attention and mask functions).
    Idempotent."""
    if current_patch(model) is not None or has_decode_hook(model):
        return
    dec, attns = _decoder_and_layers(model)
    register()
    ref = weakref.ref(dec)
    inner = model.config._attn_implementation
    channel_order(model)  # (raises for a rotation lcx cannot hold)
    for attn in attns:
        _install_rotation_hook(attn)
        setattr(attn, _STATE, _ModuleState(None, DEFAULT_BACKEND, ref, inner=inner))
        attn.forward = types.MethodType(_hooked_forward, attn)
    _hook_decoder(dec, True)
    _HOOKED_CONFIGS[id(model.config)] = inner
    weakref.finalize(model.config, _HOOKED_CONFIGS.pop, id(model.config), None)
    setattr(model, _HOOK, inner)
    model.config._attn_implementation = ATTN_IMPLEMENTATION


def remove_decode_hook(model: nn.Module) -> None:
    """Undo `install_decode_hook` (nothing on a model without the hook, or a patched one)."""
    inner = model.__dict__.get(_HOOK)
    if inner is None:
        return
    for attn in attention_layers(model):
        attn.__dict__.pop("forward", None)
        attn.__dict__.pop(_STATE, None)
    _hook_decoder(decoder(model), False)
    _HOOKED_CONFIGS.pop(id(model.config), None)
    model.config._attn_implementation = inner
    delattr(model, _HOOK)


def has_decode_hook(model: nn.Module) -> bool:
    """Whether every attention layer runs `lcx_decode` steps (patched or hooked)."""
    if current_patch(model) is not None:
        return True
    return model.__dict__.get(_HOOK) is not None and all(
        getattr(a.__dict__.get("forward"), "__func__", None) is _hooked_forward for a in attention_layers(model))


# ------------------------------------------------------------------------ patch / unpatch


def _decoder_and_layers(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    check_model_type(model, "lcx attention methods")
    return decoder(model), attention_layers(model)


def own_windows(model: nn.Module) -> list[int | None]:
    """Per layer, the family's own sliding window on a hybrid local/global model (Gemma 3:
    `config.sliding_window` on its "sliding_attention" layers), None on global layers and on
    models whose layers are all alike."""
    types_ = layer_types(model) or []
    n = len(attention_layers(model))
    hybrid = "sliding_attention" in types_ and "full_attention" in types_
    w = getattr(model.config, "sliding_window", None)
    return [w if hybrid and types_[i] == "sliding_attention" else None for i in range(n)]


def loaded_windows(model: nn.Module) -> list[int | None]:
    """Per layer, the sliding window the model as loaded runs (keys: the query and the w - 1
    before it, transformers' sliding masks), or None: a hybrid model's sliding layers
    (`own_windows`), or every layer of a model with one `sliding_window` for all (Mistral)."""
    own = own_windows(model)
    if any(w is not None for w in own):
        return own
    cfg = model.config
    w = getattr(cfg, "sliding_window", None)
    types_ = getattr(cfg, "layer_types", None)
    n = len(attention_layers(model))
    if not w or not getattr(cfg, "use_sliding_window", True) or (types_ and "sliding_attention" not in types_):
        return [None] * n
    return [int(w)] * n


def model_call_info(model: nn.Module, *, n_queries: int, n_keys: int, q_offset: int, rotary: bool = False):
    """The `lcx.attention.CallInfo` of an inference call of `model`'s attention layers (its
    device, dtype, heads and head size; no gradient, no LSE) with these query/key counts: what a
    backend's `supports()` is asked before lcx runs the model's calls on it."""
    from lcx.attention import CallInfo

    p = next(model.parameters())
    n_heads = int(model.config.num_attention_heads)
    return CallInfo(device_type=p.device.type, dtype=p.dtype, requires_grad=False, return_lse=False,
                    n_heads=n_heads, n_kv_heads=int(getattr(model.config, "num_key_value_heads", None) or n_heads),
                    head_dim=model_shape(model).head_dim, n_queries=n_queries, n_keys=n_keys,
                    q_offset=q_offset, rotary=rotary)


def as_loaded_method(model: nn.Module, backend: str) -> AttentionMethod | None:
    """The attention method under which `patch_attention(model, m, backend=backend)` runs a hybrid
    local/global model exactly as loaded, but faster: `causal()`, so that the full-attention
    layers run causal attention (on `backend` as on transformers' SDPA: the same fused kernel on
    the CPU) and every sliding layer its own window as `sliding_window(window)`, O(T * w) work
    on `backend` where transformers' masked pass over the whole prompt costs O(T^2) (Gemma 3 at
    16k: 15 of 18 layers). What `lcx.engine` runs for such a model when no method is asked for.

    None (run the model as loaded): a model whose layers are all alike, or a `backend` that
    cannot run these calls on the model's device, dtype and heads (`supports()`; e.g. flash on
    CUDA in float32), where the masked pass stays faster than a fallback. A model with
    attention-logit soft-capping (Gemma 2, which transformers runs eager only) gets it on the
    backend `patch_attention` picks for soft-capped calls (`blockwise` for the fused `flash`)."""
    from lcx.methods.causal import causal

    windows = [w for w in own_windows(model) if w is not None]
    if not windows or backend not in BACKENDS:
        return None
    methods = (causal(), *(sliding_window(window=int(w)) for w in set(windows)))
    softcap = attention_softcap(model)
    if softcap is not None:
        backend = _softcap_backend(methods, backend, softcap, "backend", quiet=True)
    call = model_call_info(model, n_queries=2 * max(windows), n_keys=2 * max(windows), q_offset=0, rotary=True)
    supports = BACKENDS[backend].supports
    for m in methods:
        specs = [dataclasses.replace(spec, softcap=softcap) for spec in m._call_specs()]
        if m.supports(backend, softcap=softcap) is not None or any(supports(spec, call) for spec in specs):
            return None
    return causal()


def _layer_plan(model: nn.Module, method: AttentionMethod, layers: str) -> list[tuple[AttentionMethod, str | None]]:
    """(method, RoPE layer type) of every layer."""
    rope_types = rope_layer_types(model)
    types_ = layer_types(model)
    plan = []
    for i, w in enumerate(own_windows(model)):
        m = sliding_window(window=int(w)) if (w is not None and layers == "global") else method
        plan.append((m, types_[i] if rope_types is not None else None))
    return plan


def patch_attention(model: nn.Module, method: AttentionMethod | Mapping[str, Any], *,
                    backend: str = DEFAULT_BACKEND, decode_backend: str | None = None,
                    layers: str = "global") -> nn.Module:
    """Run the attention layers of `model` with `method` (in place; returns the model).

    method:  an `AttentionMethod` (`lm_infinite(...)`, `sliding_window(...)`, `sinks(...)`,
             `causal()`) or its dict (`{"type": "lm_infinite", "n_global": 16, ...}`).
    backend: the `lcx.attention` backend of every call ("blockwise": memory O(T * (G + L)) for
             windowed methods; a speed choice, every backend computes the same thing).
    decode_backend: the backend of calls with one query token (decode), e.g. "cuda" (a
             decode-only kernel) or "triton"; None: `backend` for those too.
    layers:  "global" (default): on a hybrid local/global model (Gemma 3) the method runs on the
             full-attention layers and the sliding layers keep their own window; "all": every
             layer runs the method. Models whose layers are all alike: every layer either way.
    Patching a patched model replaces the method; `unpatch_attention` restores the model as loaded.
    """
    method = method_from_dict(method)
    for name, b in (("backend", backend), ("decode_backend", decode_backend)):
        if b is not None and b not in BACKENDS:
            raise ValueError(f"{name}={b!r} is not an lcx.attention backend; known: {sorted(BACKENDS)}")
    if layers not in LAYERS:
        raise ValueError(f"layers={layers!r}; expected one of {LAYERS}")
    dec, attns = _decoder_and_layers(model)
    remove_decode_hook(model)
    register()
    prev: _Patch | None = getattr(model, _STATE, None)
    original = prev.original_attn_implementation if prev is not None else model.config._attn_implementation
    ref = weakref.ref(dec)
    order = channel_order(model)
    plan = _layer_plan(model, method, layers)
    softcap = attention_softcap(model)
    if softcap is not None:  # (Gemma 2) every layer's calls are soft-capped: backends that can run them
        backend = _softcap_backend([m for m, _ in plan], backend, softcap, "backend")
        if decode_backend is not None:
            decode_backend = _softcap_backend([m for m, _ in plan], decode_backend, softcap, "decode_backend")
    for attn, (m, layer_type) in zip(attns, plan):
        _install_rotation_hook(attn)
        setattr(attn, _STATE, _ModuleState(m, backend, ref, decode_backend, chosen=method, layer_type=layer_type,
                                           order=order))
        attn.forward = types.MethodType(_hooked_forward, attn)
    _hook_decoder(dec, True)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    setattr(model, _STATE, _Patch(method, backend, original, decode_backend, layers, order))
    return model


def _softcap_backend(methods: Sequence[AttentionMethod], backend: str, softcap: float, name: str, *,
                     quiet: bool = False) -> str:
    """`backend` when it runs every layer's calls soft-capped at `softcap`, else `blockwise` (which
    runs every spec), logged with why: backends compute the same thing, so this is a speed
    choice, as `lcx.attention.attention(fallback=True)` makes it (e.g. the front ends' default
    `flash`, whose fused kernels have no soft-capping, on Gemma 2)."""
    reason = next((r for m in dict.fromkeys(methods) if (r := m.supports(backend, softcap=softcap))), None)
    if reason is None:
        return backend
    if not quiet:
        logger.info("%s=%r cannot run this model's attention-logit soft-capping (softcap=%g): %s; its layers run on "
                    "'blockwise'", name, backend, softcap, reason)
    return "blockwise"


def unpatch_attention(model: nn.Module) -> nn.Module:
    """Undo `patch_attention` (a no-op on an unpatched model)."""
    prev: _Patch | None = getattr(model, _STATE, None)
    if prev is None:
        return model
    dec, attns = _decoder_and_layers(model)
    for attn in attns:
        attn.__dict__.pop("forward", None)
        attn.__dict__.pop(_STATE, None)
    _hook_decoder(dec, False)
    model.config._attn_implementation = prev.original_attn_implementation
    delattr(model, _STATE)
    return model


def current_patch(model: nn.Module) -> _Patch | None:
    """What `patch_attention` installed on the model (method, backends, layers), or None."""
    return getattr(model, _STATE, None)


def current_attention(model: nn.Module) -> AttentionMethod | None:
    """The method a patched model runs, or None."""
    prev: _Patch | None = getattr(model, _STATE, None)
    return prev.method if prev is not None else None


def layer_methods(model: nn.Module) -> list[AttentionMethod | None]:
    """What each attention layer of a patched model runs (its `cache_window` bounds that layer's
    cache): the model's method, or on a hybrid model's sliding layers (`layers="global"`) the
    family's own window; None for every layer of an unpatched model."""
    return [getattr(a.__dict__.get(_STATE), "method", None) for a in attention_layers(model)]


@contextlib.contextmanager
def attention_patched(model: nn.Module, method: AttentionMethod | Mapping[str, Any] | None, *,
                      backend: str = DEFAULT_BACKEND, decode_backend: str | None = None,
                      layers: str = "global") -> Iterator[nn.Module]:
    """Context manager: `patch_attention` on entry (no-op for None), previous state on exit."""
    if method is None:
        yield model
        return
    prev: _Patch | None = getattr(model, _STATE, None)
    patch_attention(model, method, backend=backend, decode_backend=decode_backend, layers=layers)
    try:
        yield model
    finally:
        if prev is None:
            unpatch_attention(model)
        else:
            patch_attention(model, prev.method, backend=prev.backend, decode_backend=prev.decode_backend,
                            layers=prev.layers)


__all__ = ["ATTN_IMPLEMENTATION", "LAYERS", "as_loaded_method", "attention_patched", "channel_order", "current_attention", "current_call",
           "current_patch", "has_decode_hook", "install_decode_hook", "iter_rows", "layer_methods",
           "lcx_attention", "loaded_rows", "model_call_info", "own_windows", "patch_attention", "register",
           "row_groups", "unpatch_attention"]
