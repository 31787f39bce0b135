"""The per-call part of lcx's attention patch (`lcx.hf.attention_patch` installs it,
`lcx.hf.engine_hook` gives an unpatched model the engine's route through it): what runs inside one
hooked attention call of an HF model.

- the state a patch leaves: `PatchState` on the model (`current_patch`), `ModuleState` on each
  attention module (attribute `STATE`);
- hook 1, the rotation: the family's `apply_rotary_pos_emb` wrapped (`install_rotation_hook`), q/k
  returned unrotated inside a patched call; `channel_order`, the family's layout;
- the instance forwards (`hooked_forward` on each attention module, `hook_decoder` on the stack)
  that mark the call (`lcx.hf.calls.CURRENT_CALL`) and keep lcx's per-call inputs (`LCX_INPUTS`);
- hook 2, the attention function `lcx_attention` (registered as `ATTN_IMPLEMENTATION` with the
  mask function `_no_mask`: `register`): the layer's method on its unrotated q/k/v, per row on
  `lcx_key_positions`, the engine's decode step (`lcx_decode`), or, on a model with the decode
  hook only inside `loaded_rows` (`LOADED_ROWS`), the model's own attention per row.

The semantics (positions, padded rows, channel order, hybrid models) are stated once, in
`lcx.hf.attention_patch`'s docstring; the engine's side of the interface in `lcx.hf.engine_hook`'s.
"""

from __future__ import annotations

import contextvars
import types
import functools
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from lcx.attention import Rotary
from lcx.methods.base import AttentionMethod

from .bounded_cache import BoundedKVCache
from .calls import CURRENT_CALL, AttentionCall
from .channel_order import ChannelOrder, detect
from .models import attention_layers, check_model_type, decoder, model_shape
from .rope_patch import rope_basis, rotary_table_layout

ATTN_IMPLEMENTATION = "lcx_attention_method"
DEFAULT_BACKEND = "blockwise"
LAYERS = ("global", "all")
STATE = "_lcx_attention_method"  # on the model: PatchState; on each attention module: ModuleState
HOOK = "_lcx_decode_hook"  # on a model with the decode hook only: the attn implementation it had


@dataclass
class PatchState:
    method: AttentionMethod
    backend: str
    original_attn_implementation: Any
    decode_backend: str | None = None
    layers: str = "global"
    order: ChannelOrder | None = None  # the family's channel layout (lcx.hf.channel_order)


@dataclass
class ModuleState:
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


def install_rotation_hook(attn: nn.Module) -> None:
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
DECODE_INPUT, KEY_POSITIONS_INPUT = "lcx_decode", "lcx_key_positions"  # (lcx.hf.engine_hook: the interface)
LCX_INPUTS = (DECODE_INPUT, KEY_POSITIONS_INPUT)
_INPUTS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("lcx_call_inputs", default=None)


def _hooked_decoder_forward(self: nn.Module, *args: Any, **kwargs: Any):
    """The decoder stack's own forward (instance-bound), with lcx's per-call inputs
    (`lcx_key_positions`, `lcx_decode`) kept for the attention calls inside it: transformers
    hands a forward's keyword arguments down to the attention, but some families' decoder layers
    call their attention without them (StableLM, Nemotron)."""
    token = _INPUTS.set({k: kwargs[k] for k in LCX_INPUTS if k in kwargs})
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _INPUTS.reset(token)


def _lcx_input(kwargs: Mapping[str, Any], name: str) -> Any:
    """`name` (one of `LCX_INPUTS`) of an attention call: its own keyword, else the decoder
    call's (`_hooked_decoder_forward`), else None."""
    if name in kwargs:
        return kwargs[name]
    held = _INPUTS.get()
    return None if held is None else held.get(name)


def hook_decoder(dec: nn.Module, on: bool) -> None:
    if on:
        dec.forward = types.MethodType(_hooked_decoder_forward, dec)
    else:
        dec.__dict__.pop("forward", None)


def hooked_forward(self: nn.Module, *args: Any, **kwargs: Any):
    """The class's own forward, with the call marked for the two hooks (instance-bound)."""
    st: ModuleState = self.__dict__[STATE]
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
    st: ModuleState | None = module.__dict__.get(STATE)
    if call is None or call.module is not module:
        if st is not None and st.method is None:  # decode hook, not a decode call: the model's own
            rows = LOADED_ROWS.get()
            if rows is not None:  # lcx.engine's prefill continuing from held keys (`loaded_rows`)
                if dropout:
                    raise NotImplementedError("loaded_rows: attention dropout is not supported")
                return attend_loaded_rows(module, query.transpose(1, 2), key.transpose(1, 2),
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


def _attend(module: nn.Module, st: ModuleState, call: AttentionCall, q, k, v, kwargs: Mapping[str, Any],
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
        return attend_rows(st, q, k, v, row_pos.to(q.device), decoder, module.scaling, layer_idx, softcap)
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


def _basis(decoder: nn.Module, seq_len: int, st: ModuleState, q: torch.Tensor):
    """(inv_freq `[D/2]`, attention_factor, q) of a call: the layer's RoPE basis at `seq_len`;
    on a partial rotary head (q in lcx's channel order) padded with zero frequencies, and q's
    passed channels corrected for the attention factor (`lcx.hf.channel_order`)."""
    inv_freq, af = rope_basis(decoder, seq_len, layer_type=st.layer_type)
    if st.order is not None:
        inv_freq, q = st.order.basis(inv_freq), st.order.fix_query(q, af)
    return inv_freq, af, q


def _check_sliding_cache_layer(st: ModuleState, cache: Any, layer_idx: int) -> None:
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


def attend_rows(st: ModuleState, q, k, v, row_pos: torch.Tensor, decoder: nn.Module, scale: float,
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
class LoadedRows:
    key_positions: torch.Tensor  # [B, Tk] (-1: not a key of the row)
    windows: tuple[int | None, ...]  # per layer: the window the model as loaded runs, None: causal
    backend: str


LOADED_ROWS: contextvars.ContextVar[LoadedRows | None] = contextvars.ContextVar("lcx_loaded_rows", default=None)


def attend_loaded_rows(module: nn.Module, q, k, v, rows: LoadedRows, scale: float | None,
                        softcap: float | None = None) -> torch.Tensor:
    """q `[B, Tq, H, D]`, k/v `[B, Tk, Hkv, D]`, rotated by the model -> out `[B, Tq, H, D]`
    (rows grouped by their numbers of queries and keys, as `attend_rows`; `softcap`: the
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
    groups = list(row_groups(row_pos, Tq))
    # every row with Tq real queries fills all its outputs; padding (and a row without a query) stays 0
    padded = any(nq < Tq for nq, _, _ in groups) or sum(len(bs) for _, bs, _ in groups) < B
    out = (q.new_zeros if padded else q.new_empty)(q.shape[:3] + (v.shape[-1],))
    native = native_rows(q)
    for nq, bs, idx in groups:
        n = idx.shape[1]
        pos = row_pos[bs[:, None], idx]
        if n > 1 and not bool((pos[:, 1:] - pos[:, :-1] == 1).all()):
            raise ValueError("loaded_rows: each row's keys must be a contiguous run of positions")
        if len(bs) == B and n == k.shape[1]:  # every row, every slot: no gather
            kr, vr = k, v
        else:
            kr, vr = k[bs[:, None], idx], v[bs[:, None], idx]
        if native and nq * (q.shape[2] // k.shape[2]) >= NATIVE_MIN_ROWS:
            from lcx.kernels.cpu.causal_attention import causal_attention_cpu

            out[bs, Tq - nq:] = causal_attention_cpu(q[bs, Tq - nq:], kr, vr, scale, w, softcap)
        elif (w is None and softcap is None and BLOCK_CAUSAL_QUERIES[0] <= nq <= BLOCK_CAUSAL_QUERIES[1]
                and n <= BLOCK_CAUSAL_MAX_KEYS and q.dtype == torch.float32 and q.device.type == "cpu"):
            out[bs, Tq - nq:] = block_causal(q[bs, Tq - nq:], kr, vr, scale)
        elif nq <= MASKED_SDPA_MAX_QUERIES and softcap is None:
            out[bs, Tq - nq:] = _masked_sdpa(q[bs, Tq - nq:], kr, vr, w, scale).to(out.dtype)
        else:
            out[bs, Tq - nq:] = attention(q[bs, Tq - nq:], kr, vr, spec, backend=backend).to(out.dtype)
    return out


# The C++ kernel's score tiles take a row's query heads x new queries as 16-float lanes: rows of
# fewer than 16 (GQA group x queries) leave most lanes empty, and torch's masked call is faster
# there (`lcx bench rows`, 2026-12-08: one query over 544 or 2048 keys 0.63-0.93x the masked
# call; 32 queries over 544 keys 2.1-2.4x it).
NATIVE_MIN_ROWS = 16


def native_rows(q: torch.Tensor) -> bool:
    """Whether rows of `q` run lcx's C++ causal kernels (`lcx.kernels.cpu.causal_attention`: these
    rows where they fill its lanes, `NATIVE_MIN_ROWS`, and the engine's decode step,
    `lcx.engine.decode_step.decode_attention`): float32 on the CPU where they build, unless
    `LCX_NATIVE_ROWS=0`. `lcx bench rows` (results/loaded_rows_cpu.json, one thread, 9/3 and 4/2
    heads of 64): 2.0-3.3x torch's fused kernel from 128 to 2048 tokens (1.05-1.37x at 32), 2.1-2.6x
    its masked call for 32-512 new queries over 544-2048 keys, 1.7-2.5x the decode step's matmul
    path."""
    if q.dtype != torch.float32 or q.device.type != "cpu" or os.environ.get("LCX_NATIVE_ROWS", "1") == "0":
        return False
    from lcx.kernels.cpu.causal_attention import unavailable

    return unavailable() is None


# Without the C++ kernel (`native_rows` false): a continuation of at most this many new tokens
# per row runs torch's SDPA with its [Tq, Tk] mask: for few queries over many held keys one
# masked call beats lcx's flash backend (an unmasked pass over the held keys, a causal one over
# the new tokens, merged by their LSE) by 1.2-6x on one CPU thread; from about 256-512 queries on the split is faster (measured
# 2026-12-07, head_dim 64, 4/2 and 9/3 heads, 128-2048 held keys; docs/benchmarks.md).
MASKED_SDPA_MAX_QUERIES = 256


def _masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                 scale: float | None) -> torch.Tensor:
    """q `[b, nq, H, D]` the newest nq of a row's n keys k/v `[b, n, Hkv, D]` (contiguous
    positions): causal, or each query and the `window` - 1 keys before it -> `[b, nq, H, D]`."""
    nq, n = q.shape[1], k.shape[1]
    mask = torch.ones(nq, n, dtype=torch.bool, device=q.device).tril(n - nq)
    if window is not None:
        mask = mask.triu(n - nq - int(window) + 1)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


# Without the C++ kernel (`native_rows` false): causal rows of this many new queries (and at most
# this many keys) run `block_causal` on the CPU in float32: torch's fused CPU kernel computes each block of queries against whole blocks of
# 512 keys, so at a few hundred queries much of its work is past the diagonal; two matmuls per
# block of 64 queries (every query head of a kv head in one) compute the causal part only.
# `lcx bench rows` (results/loaded_rows_cpu.json; 2026-12-07, one thread, idle machine, head_dim
# 64, 9/3 and 4/2 heads): 1.03-1.38x torch's fused kernel from 256 to 1024 queries (1.27-1.38x at
# 544); at 512 new queries over 2048 keys the same as lcx's flash (1.07-1.12x the masked call);
# 0.97-0.98x at 2048 and slower at 128 and below, where the fused kernel or the masked call stays.
BLOCK_CAUSAL_QUERIES = (192, 1024)
BLOCK_CAUSAL_MAX_KEYS = 4096  # the [G * 64, keys] score block stays within a few MB
BLOCK_CAUSAL_ROWS = 64


def block_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                 block: int = BLOCK_CAUSAL_ROWS) -> torch.Tensor:
    """Causal attention of the newest nq of a row's n keys: q `[b, nq, H, D]`, k/v `[b, n, Hkv, D]`
    (contiguous positions, query i at position n - nq + i) -> `[b, nq, H, Dv]`. Per block of
    `block` queries: the scores of the group's H // Hkv query heads against every key up to the
    block's last position in one matmul (the queries scaled first), the diagonal block masked, a
    softmax, a matmul with the values; nothing computed past the block's diagonal, no [nq, n] mask."""
    b, nq, H, D = q.shape
    n, Hkv = k.shape[1], k.shape[2]
    G, off = H // Hkv, n - nq
    scale = D ** -0.5 if scale is None else scale
    qg = q.transpose(1, 2).reshape(b, Hkv, G, nq, D)
    kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [b, Hkv, n, D]
    out = q.new_empty(b, Hkv, G, nq, v.shape[-1])
    tri = torch.full((block, block), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    for i0 in range(0, nq, block):
        i1 = min(i0 + block, nq)
        m, e = i1 - i0, off + i1
        qb = torch.mul(qg[:, :, :, i0:i1], scale, out=q.new_empty(b, Hkv, G, m, D)).view(b, Hkv, G * m, D)
        s = torch.matmul(qb, kt[:, :, :e].transpose(-1, -2))
        s.view(b, Hkv, G, m, e)[..., off + i0:].add_(tri[:m, :m])
        out[:, :, :, i0:i1] = torch.matmul(torch.softmax(s, -1), vt[:, :, :e]).view(b, Hkv, G, m, -1)
    return out.view(b, H, nq, -1).transpose(1, 2)


# ------------------------------------------------------------------------ transformers registration


def _no_mask(*, attention_mask: torch.Tensor | None = None, config: Any = None, **kwargs: Any) -> Any:
    """Mask function: a patched model's layers mask by themselves (their methods are causal);
    refuse padding they cannot honour. A model with the decode hook only: its own mask function."""
    inner = HOOKED_CONFIGS.get(id(config)) if config is not None else None
    if inner is not None and LOADED_ROWS.get() is not None:
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
HOOKED_CONFIGS: dict[int, str] = {}


def register() -> None:
    """Register `"lcx_attention_method"` with transformers' attention/mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, lcx_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)



def current_patch(model: nn.Module) -> PatchState | None:
    """What `patch_attention` installed on the model (method, backends, layers), or None."""
    return getattr(model, STATE, None)


def decoder_and_layers(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """The decoder stack and its attention layers of a model of a supported family (raises otherwise)."""
    check_model_type(model, "lcx attention methods")
    return decoder(model), attention_layers(model)


__all__ = ["ATTN_IMPLEMENTATION", "DECODE_INPUT", "DEFAULT_BACKEND", "HOOK", "HOOKED_CONFIGS", "KEY_POSITIONS_INPUT",
           "LAYERS", "LCX_INPUTS", "LOADED_ROWS", "LoadedRows", "ModuleState", "PatchState", "STATE",
           "attend_loaded_rows", "attend_rows", "channel_order", "current_patch", "decoder_and_layers", "hook_decoder",
           "hooked_forward", "install_rotation_hook", "iter_rows", "lcx_attention", "register", "row_groups"]
