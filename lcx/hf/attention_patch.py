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
import dataclasses
import logging
import types
import weakref
from typing import Any, Iterator, Mapping, Sequence

from torch import nn

from lcx.attention import BACKENDS
from lcx.methods.base import AttentionMethod
from lcx.methods.registry import method_from_dict
from lcx.methods.sliding_window import sliding_window

from .attention_call import (ATTN_IMPLEMENTATION, DEFAULT_BACKEND, LAYERS, STATE, ModuleState, PatchState,
                             channel_order, current_patch, decoder_and_layers, hook_decoder, hooked_forward,
                             install_rotation_hook, iter_rows, lcx_attention, register, row_groups)
from .calls import current_call
from .engine_hook import has_decode_hook, install_decode_hook, loaded_rows, remove_decode_hook
from .models import attention_layers, attention_softcap, layer_types, model_shape, rope_layer_types

logger = logging.getLogger(__name__)
_STATE = STATE  # (the name earlier code reads)


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
    dec, attns = decoder_and_layers(model)
    remove_decode_hook(model)
    register()
    prev: PatchState | None = getattr(model, STATE, None)
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
        install_rotation_hook(attn)
        setattr(attn, STATE, ModuleState(m, backend, ref, decode_backend, chosen=method, layer_type=layer_type,
                                           order=order))
        attn.forward = types.MethodType(hooked_forward, attn)
    hook_decoder(dec, True)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    setattr(model, STATE, PatchState(method, backend, original, decode_backend, layers, order))
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
    prev: PatchState | None = getattr(model, STATE, None)
    if prev is None:
        return model
    dec, attns = decoder_and_layers(model)
    for attn in attns:
        attn.__dict__.pop("forward", None)
        attn.__dict__.pop(STATE, None)
    hook_decoder(dec, False)
    model.config._attn_implementation = prev.original_attn_implementation
    delattr(model, STATE)
    return model


def current_attention(model: nn.Module) -> AttentionMethod | None:
    """The method a patched model runs, or None."""
    prev: PatchState | None = getattr(model, STATE, None)
    return prev.method if prev is not None else None


def layer_methods(model: nn.Module) -> list[AttentionMethod | None]:
    """What each attention layer of a patched model runs (its `cache_window` bounds that layer's
    cache): the model's method, or on a hybrid model's sliding layers (`layers="global"`) the
    family's own window; None for every layer of an unpatched model."""
    return [getattr(a.__dict__.get(STATE), "method", None) for a in attention_layers(model)]


@contextlib.contextmanager
def attention_patched(model: nn.Module, method: AttentionMethod | Mapping[str, Any] | None, *,
                      backend: str = DEFAULT_BACKEND, decode_backend: str | None = None,
                      layers: str = "global") -> Iterator[nn.Module]:
    """Context manager: `patch_attention` on entry (no-op for None), previous state on exit."""
    if method is None:
        yield model
        return
    prev: PatchState | None = getattr(model, STATE, None)
    patch_attention(model, method, backend=backend, decode_backend=decode_backend, layers=layers)
    try:
        yield model
    finally:
        if prev is None:
            unpatch_attention(model)
        else:
            patch_attention(model, prev.method, backend=prev.backend, decode_backend=prev.decode_backend,
                            layers=prev.layers)


__all__ = ["ATTN_IMPLEMENTATION", "DEFAULT_BACKEND", "LAYERS", "as_loaded_method", "attention_patched", "channel_order", "current_attention", "current_call",
           "current_patch", "has_decode_hook", "install_decode_hook", "iter_rows", "layer_methods",
           "lcx_attention", "loaded_rows", "loaded_windows", "model_call_info", "own_windows", "patch_attention", "register",
           "remove_decode_hook", "row_groups", "unpatch_attention"]