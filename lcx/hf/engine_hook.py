"""The interface between `lcx.engine`'s model runner and the HF attention patch: what the engine
may ask of a model's attention layers, declared here, so neither side reads the other's insides.

The engine hands the model two per-call inputs, as keywords of the decoder's forward (kept for
the attention calls inside it even by families whose layers drop keyword arguments):

- `lcx_key_positions` (`KEY_POSITIONS_INPUT`) `[B, Tk]` long, the **held-keys view** of a padded
  batch: entry (b, j) is the position of row b's j-th key slot (its held keys, then the new
  tokens), -1 where the slot is not a key of the row (padding, an evicted slot). A patched layer
  attends per row on those keys with its method (`lcx.hf.attention_patch`, "Padded / ragged
  batches").
- `lcx_decode` (`DECODE_INPUT`) a `DecodeStep`: one decode step over the engine's own cache. Every
  attention layer hands its new q/k/v to `step.attend(module, q, k, v, softcap=...)` and returns
  what it returns; q/k arrive unrotated in lcx's channel order on a patched model (the step
  rotates them), rotated by the family's own rotation on a model with the decode hook only.

and three functions:

- `install_decode_hook(model)`: an unpatched model takes `lcx_decode` (a patched one does
  already); every other call keeps running as loaded. `has_decode_hook`, `remove_decode_hook`.
- `loaded_rows(key_positions, windows, backend)`: a context in which a model with the decode
  hook only runs each prefill call's attention per row on an lcx backend from `key_positions`
  (the held-keys view again), causal or each layer's own window, with no mask built: how the
  engine continues a prefill from held keys on a model as loaded.
- `lean_decoder(model)`: for a Llama-like decoder, the decode step's forward through the same
  modules without transformers' per-call machinery (`lcx.hf.lean_decode`; identical logits), or
  None where the engine runs the model's own forward. It also runs a step's prefill chunks in
  the same forward as its decode rows (`MixedPrefill`: one token matrix through the weights).
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Iterator, Protocol, Sequence

import torch
from torch import nn

from .attention_call import (ATTN_IMPLEMENTATION, DECODE_INPUT, DEFAULT_BACKEND, HOOK, HOOKED_CONFIGS,
                             KEY_POSITIONS_INPUT, LOADED_ROWS, LoadedRows, ModuleState, STATE, channel_order,
                             current_patch, decoder_and_layers, hook_decoder, hooked_forward, install_rotation_hook,
                             native_rows, register)
from .lean_decode import MixedPrefill, lean_decoder
from .models import attention_layers, decoder


class DecodeStep(Protocol):
    """What `lcx_decode` carries (`lcx.engine.kv.ModelStep`, `lcx.engine.kv.DecodeStep`)."""

    per_layer: bool  # True: it attends with each layer's own method and cache (a hybrid model's windows)

    def attend(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               softcap: float | None = None) -> torch.Tensor:
        """q `[B, 1, H, D]`, k/v `[B, 1, Hkv, D]` of attention layer `module` (its `layer_idx`)
        -> out `[B, 1, H, D]`; writes the new key/value into the step's cache."""
        ...


def install_decode_hook(model: nn.Module) -> None:
    """Let every attention layer of `model` run `lcx.engine`'s decode step (the `lcx_decode`
    keyword of the model's forward; `lcx.engine.kv.DecodeStep`). A model patched with an
    attention method has it already; an unpatched one gets the two hooks for decode calls only
    (every other call runs as loaded: the model's own rotation, attention and mask functions).
    Idempotent."""
    if current_patch(model) is not None or has_decode_hook(model):
        return
    dec, attns = decoder_and_layers(model)
    register()
    ref = weakref.ref(dec)
    inner = model.config._attn_implementation
    channel_order(model)  # (raises for a rotation lcx cannot hold)
    for attn in attns:
        install_rotation_hook(attn)
        setattr(attn, STATE, ModuleState(None, DEFAULT_BACKEND, ref, inner=inner))
        attn.forward = types.MethodType(hooked_forward, attn)
    hook_decoder(dec, True)
    HOOKED_CONFIGS[id(model.config)] = inner
    weakref.finalize(model.config, HOOKED_CONFIGS.pop, id(model.config), None)
    setattr(model, HOOK, inner)
    model.config._attn_implementation = ATTN_IMPLEMENTATION


def remove_decode_hook(model: nn.Module) -> None:
    """Undo `install_decode_hook` (nothing on a model without the hook, or a patched one)."""
    inner = model.__dict__.get(HOOK)
    if inner is None:
        return
    for attn in attention_layers(model):
        attn.__dict__.pop("forward", None)
        attn.__dict__.pop(STATE, None)
    hook_decoder(decoder(model), False)
    HOOKED_CONFIGS.pop(id(model.config), None)
    model.config._attn_implementation = inner
    delattr(model, HOOK)


def has_decode_hook(model: nn.Module) -> bool:
    """Whether every attention layer runs `lcx_decode` steps (patched or hooked)."""
    if current_patch(model) is not None:
        return True
    return model.__dict__.get(HOOK) is not None and all(
        getattr(a.__dict__.get("forward"), "__func__", None) is hooked_forward for a in attention_layers(model))


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
    from a prefix-cache hit or a previous chunk on a model as loaded (`lcx.engine.runner.ModelRunner.prefill`);
    refuses dropout (the engine does not ask for it then)."""
    token = LOADED_ROWS.set(LoadedRows(key_positions, tuple(windows), backend))
    try:
        yield
    finally:
        LOADED_ROWS.reset(token)


__all__ = ["DECODE_INPUT", "DecodeStep", "KEY_POSITIONS_INPUT", "LoadedRows", "MixedPrefill", "has_decode_hook",
           "install_decode_hook", "lean_decoder", "loaded_rows", "native_rows", "remove_decode_hook"]
