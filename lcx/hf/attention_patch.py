"""Apply an attention method to a loaded Hugging Face Llama-family model, in place and reversibly.

    model, tok = lcx.load_model("tiny-5m")
    with lcx.patched(model, {"rope_type": "yarn", "factor": 4}), \\
         attention_patched(model, lm_infinite(n_global=16, n_local=1024)):
        logits = model(ids).logits          # LM-Infinite + YaRN
    # the model as loaded again

Why the attention module's forward is replaced (and not only an `AttentionInterface` function
registered): transformers hands an attention function q and k already rotated, and no
positions; LM-Infinite needs them unrotated (its global keys are scored at a capped distance)
and StreamingLLM renumbers positions. So `patch_attention` gives every `self_attn` module of
the model an instance-level `forward` (transformers 5.17 `LlamaAttention.forward` minus the
rotation) that projects q/k/v and calls `method.attend` on UNROTATED q/k with an
`lcx.attention.Rotary` holding the keys' positions. The RoPE basis is read at call time from
the model's rotary module (`lcx.hf.rope_patch.rope_basis`), so RoPE specs applied with `lcx.patch`
compose with any method, in either order. The config's `_attn_implementation` is switched to
`"lcx_attention_method"`, registered with transformers' attention and mask interfaces: the
mask function builds no mask (the method owns masking and causality; no [T, T] mask is ever
materialised) and refuses padding; the attention function itself is never called by a patched
module and raises if something calls it. `unpatch_attention` deletes the instance forwards and
restores `_attn_implementation`.

Semantics stated once:
- **The KV cache holds keys BEFORE RoPE** while a model is patched (whatever `Cache` it is
  given). Do not mix a cache filled by a patched model with an unpatched one, or vice versa.
- **Positions.** With a `DynamicCache` (or no cache), key j of the Tk returned by the cache has
  position `position_ids[:, 0] - (Tk - Tq) + j`: the cache is the contiguous history of the
  sequence. `position_ids` must be contiguous in each row (no padding, no packing; raises
  otherwise). With `lcx.hf.BoundedKVCache` the cache itself records each slot's position.
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
  `BoundedKVCache` would; padded query slots get zeros.

Supported: model types llama, mistral, qwen2 (q/k/v/o projections, rotate-half RoPE on the
full head, no q/k norm). Not supported (raises): padding in `attention_mask`, attention
dropout in training mode, models whose attention module has q/k norms (qwen3).

Part of the HF adapter (`lcx.hf`): the methods (`lcx.methods`) know nothing of
transformers; this module installs them in a model. `lcx.methods` re-exports `patch_attention`,
`unpatch_attention`, `attention_patched`, `current_attention` and `ATTN_IMPLEMENTATION`.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from lcx.attention import BACKENDS, Rotary
from lcx.methods.base import AttentionMethod
from lcx.methods.registry import method_from_dict

from .bounded_cache import BoundedKVCache
from .models import attention_layers, check_model_type, decoder
from .rope_patch import rope_basis

ATTN_IMPLEMENTATION = "lcx_attention_method"
DEFAULT_BACKEND = "blockwise"
_STATE = "_lcx_attention_method"  # on the model: _Patch; on each attention module: _ModuleState


@dataclass
class _Patch:
    method: AttentionMethod
    backend: str
    original_attn_implementation: Any
    decode_backend: str | None = None


@dataclass
class _ModuleState:
    method: AttentionMethod
    backend: str
    decoder: "weakref.ref[nn.Module]"  # owns rotary_emb: the RoPE basis is read from it per call
    decode_backend: str | None = None  # for calls with one query token (None: `backend`)

    def backend_for(self, n_queries: int) -> str:
        return self.decode_backend if n_queries == 1 and self.decode_backend else self.backend


# ------------------------------------------------------------------------ transformers hooks


def _unpatched_attention_function(module, query, key, value, attention_mask, **kwargs):
    raise RuntimeError(
        f"config._attn_implementation is {ATTN_IMPLEMENTATION!r} but this attention module is not "
        "patched by lcx.hf.attention_patch.patch_attention (its forward is the stock one); call patch_attention "
        "on the model, or set another attn_implementation")


def _no_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """Mask function: the method masks (and is causal) by itself; refuse padding it cannot honour."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise NotImplementedError(
            "lcx attention methods take no padded attention_mask (it has zeros); pass lcx_key_positions "
            "[B, Tk] instead (see lcx.hf.attention_patch), or run unpadded rows")
    return None


def register() -> None:
    """Register `"lcx_attention_method"` with transformers' attention/mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _unpatched_attention_function)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


# ------------------------------------------------------------------------ the patched forward


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


def lcx_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`LlamaAttention.forward` with the rotation moved inside `method.attend` (instance-bound).

    hidden_states `[B, Tq, hidden]` -> (attn_output `[B, Tq, hidden]`, None). `position_embeddings`
    (HF's cos/sin) are ignored: positions come from `position_ids` or the bounded cache.
    """
    step = kwargs.get("lcx_decode")
    if step is not None:  # lcx.engine's decode step over its cache of rotated keys (lcx.engine.kv)
        return step(self, hidden_states, position_embeddings), None

    st: _ModuleState = getattr(self, _STATE)
    if attention_mask is not None:
        raise NotImplementedError("lcx attention methods build their own masks; got a custom attention_mask")
    if self.training and self.attention_dropout:
        raise NotImplementedError("lcx attention methods have no attention dropout")
    B, Tq, _ = hidden_states.shape
    D = self.head_dim
    q = self.q_proj(hidden_states).view(B, Tq, -1, D)  # [B, Tq, H, D], unrotated
    k = self.k_proj(hidden_states).view(B, Tq, -1, D)  # [B, Tq, Hkv, D]
    v = self.v_proj(hidden_states).view(B, Tq, -1, D)
    bounded = isinstance(past_key_values, BoundedKVCache)
    if past_key_values is not None:
        # HF caches are [B, Hkv, T, D]; hand them unrotated keys, read back [B, Tk, Hkv, D] views.
        extra = {"lcx_method": st.method} if bounded else {}  # the bounded cache checks who fills it
        k_all, v_all = past_key_values.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx, **extra)
        k, v = k_all.transpose(1, 2), v_all.transpose(1, 2)
    Tk = k.shape[1]
    position_ids = kwargs.get("position_ids")
    decoder = st.decoder()
    if decoder is None:
        raise RuntimeError("the model this attention module was patched for no longer exists")
    row_pos = kwargs.get("lcx_key_positions")
    if row_pos is not None:
        out = _attend_rows(st, q, k, v, row_pos.to(q.device), decoder, self.scaling, self.layer_idx)
        return self.o_proj(out.reshape(B, Tq, -1)), None
    if bounded:
        true_pos = past_key_values.key_positions(self.layer_idx)  # [Tk]
        if position_ids is not None and not torch.equal(position_ids[0].to(true_pos.device), true_pos[-Tq:]):
            raise ValueError("position_ids disagree with the positions the bounded cache assigned "
                             f"({position_ids[0].tolist()[:4]}... vs {true_pos[-Tq:].tolist()[:4]}...)")
        rot_pos = past_key_values.rotary_positions(self.layer_idx)
        seq_len = int(true_pos[-1]) + 1
    else:
        rot_pos = _key_positions(position_ids, Tq, Tk, q.device)
        seq_len = int(rot_pos.max()) + 1
    inv_freq, af = rope_basis(decoder, seq_len)
    rotary = Rotary(inv_freq.to(q.device), rot_pos, af)
    out = st.method.attend(q, k, v, rotary=rotary, backend=st.backend_for(Tq), scale=self.scaling,
                           layer_idx=self.layer_idx)  # [B, Tq, H, D]
    return self.o_proj(out.reshape(B, Tq, -1)), None


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


def _attend_rows(st: "_ModuleState", q, k, v, row_pos: torch.Tensor, decoder: nn.Module, scale: float,
                 layer_idx: int | None = None):
    """Attention of a padded batch (see "Padded / ragged batches" in the module doc): rows with
    the same number of real queries and of keys are one batched call (per-row rotary positions),
    so a decode step of many requests costs a few calls, not one per row.

    q `[B, Tq, H, D]`, k/v `[B, Tk, Hkv, D]` (unrotated), row_pos `[B, Tk]` -> out `[B, Tq, H, D]`.
    """

    B, Tq = q.shape[:2]
    Tk = k.shape[1]
    if row_pos.shape != (B, Tk):
        raise ValueError(f"lcx_key_positions has shape {tuple(row_pos.shape)}; expected {(B, Tk)}")
    inv_freq, af = rope_basis(decoder, int(row_pos.max()) + 1)  # one basis per batch (as HF)
    inv_freq = inv_freq.to(q.device)
    out = q.new_zeros(q.shape[:3] + (v.shape[-1],))
    groups: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}  # (nq, keys) -> rows
    for b, idx, nq in iter_rows(row_pos, Tq):
        groups.setdefault((nq, len(idx)), []).append((b, idx))
    for (nq, n), rows in groups.items():
        bs = torch.tensor([b for b, _ in rows], device=q.device)  # [G]
        idx = torch.stack([i for _, i in rows])  # [G, n] key slots of each row
        pos = row_pos[bs[:, None], idx]  # [G, n] true positions
        rot = torch.arange(n, device=q.device).expand(len(rows), n) if st.method.renumber_in_cache else pos
        out[bs, Tq - nq:] = st.method.attend(
            q[bs, Tq - nq:], k[bs[:, None], idx], v[bs[:, None], idx],
            rotary=Rotary(inv_freq, rot, af), backend=st.backend_for(nq), scale=scale, layer_idx=layer_idx,
        ).to(out.dtype)  # fmt: skip
    return out


# ------------------------------------------------------------------------ the engine's decode hook


def _decode_hook_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings=None,
                         attention_mask=None, past_key_values=None, **kwargs: Any):
    """The stock attention forward, except that a call carrying `lcx_decode` (lcx.engine's
    decode step) runs that step instead (instance-bound on unpatched models)."""
    step = kwargs.pop("lcx_decode", None)
    if step is not None:
        return step(self, hidden_states, position_embeddings), None
    return type(self).forward(self, hidden_states=hidden_states, position_embeddings=position_embeddings,
                              attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)


def install_decode_hook(model: nn.Module) -> None:
    """Let every attention layer of `model` run `lcx.engine`'s decode step (the `lcx_decode`
    keyword of the model's forward; `lcx.engine.kv.DecodeStep`). A model patched with an
    attention method has it already (`lcx_attention_forward`); an unpatched one gets an
    instance forward that defers to the stock one for every other call. Idempotent."""
    if current_patch(model) is not None:
        return
    for attn in attention_layers(model):
        fwd = attn.__dict__.get("forward")
        if getattr(fwd, "__func__", None) is not _decode_hook_forward:
            attn.forward = types.MethodType(_decode_hook_forward, attn)


def has_decode_hook(model: nn.Module) -> bool:
    """Whether every attention layer runs `lcx_decode` steps (patched or hooked)."""
    if current_patch(model) is not None:
        return True
    return all(getattr(a.__dict__.get("forward"), "__func__", None) is _decode_hook_forward
               for a in attention_layers(model))


# ------------------------------------------------------------------------ patch / unpatch


def _decoder_and_layers(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    check_model_type(model, "lcx attention methods", "attention_methods")
    return decoder(model), attention_layers(model)


def patch_attention(model: nn.Module, method: AttentionMethod | Mapping[str, Any], *,
                    backend: str = DEFAULT_BACKEND, decode_backend: str | None = None) -> nn.Module:
    """Run every attention layer of `model` with `method` (in place; returns the model).

    method:  an `AttentionMethod` (`lm_infinite(...)`, `sliding_window(...)`, `sinks(...)`,
             `causal()`) or its dict (`{"type": "lm_infinite", "n_global": 16, ...}`).
    backend: the `lcx.attention` backend of every call ("blockwise": memory O(T * (G + L)) for
             windowed methods; a speed choice, every backend computes the same thing).
    decode_backend: the backend of calls with one query token (decode), e.g. "cuda" (a
             decode-only kernel) or "triton"; None: `backend` for those too.
    Patching a patched model replaces the method; `unpatch_attention` restores the model as loaded.
    """
    method = method_from_dict(method)
    for name, b in (("backend", backend), ("decode_backend", decode_backend)):
        if b is not None and b not in BACKENDS:
            raise ValueError(f"{name}={b!r} is not an lcx.attention backend; known: {sorted(BACKENDS)}")
    decoder, attns = _decoder_and_layers(model)
    register()
    prev: _Patch | None = getattr(model, _STATE, None)
    original = prev.original_attn_implementation if prev is not None else model.config._attn_implementation
    ref = weakref.ref(decoder)
    for attn in attns:
        setattr(attn, _STATE, _ModuleState(method, backend, ref, decode_backend))
        attn.forward = types.MethodType(lcx_attention_forward, attn)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    setattr(model, _STATE, _Patch(method, backend, original, decode_backend))
    return model


def unpatch_attention(model: nn.Module) -> nn.Module:
    """Undo `patch_attention` (a no-op on an unpatched model)."""
    prev: _Patch | None = getattr(model, _STATE, None)
    if prev is None:
        return model
    _, attns = _decoder_and_layers(model)
    for attn in attns:
        attn.__dict__.pop("forward", None)
        attn.__dict__.pop(_STATE, None)
    model.config._attn_implementation = prev.original_attn_implementation
    delattr(model, _STATE)
    return model


def current_patch(model: nn.Module) -> _Patch | None:
    """What `patch_attention` installed on the model (method, backends), or None."""
    return getattr(model, _STATE, None)


def current_attention(model: nn.Module) -> AttentionMethod | None:
    """The method a patched model runs, or None."""
    prev: _Patch | None = getattr(model, _STATE, None)
    return prev.method if prev is not None else None


@contextlib.contextmanager
def attention_patched(model: nn.Module, method: AttentionMethod | Mapping[str, Any] | None, *,
                      backend: str = DEFAULT_BACKEND, decode_backend: str | None = None) -> Iterator[nn.Module]:
    """Context manager: `patch_attention` on entry (no-op for None), previous state on exit."""
    if method is None:
        yield model
        return
    prev: _Patch | None = getattr(model, _STATE, None)
    patch_attention(model, method, backend=backend, decode_backend=decode_backend)
    try:
        yield model
    finally:
        if prev is None:
            unpatch_attention(model)
        else:
            patch_attention(model, prev.method, backend=prev.backend, decode_backend=prev.decode_backend)


__all__ = ["ATTN_IMPLEMENTATION", "attention_patched", "current_attention", "current_patch",
           "has_decode_hook", "install_decode_hook", "lcx_attention_forward", "patch_attention", "register",
           "unpatch_attention"]
