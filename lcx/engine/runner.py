"""The engine's model runner (as vLLM's v1 `gpu_model_runner.py`): turns the scheduler's decision
into forwards of the model with the method's hooks, and holds the running batch's bounded KV store
(`lcx.engine.kv`). It knows nothing of requests' history: a prefill is given each row's next
tokens, their first position and the KV the row holds; a decode step each row's last token and
its position; rows are added to and dropped from the store by index.

It reaches the model's attention only through `lcx.hf.engine_hook`, the declared interface: the
decode hook (`install_decode_hook`), the `lcx_decode` step (`lcx.engine.decode_step`), the held-keys
view (`lcx_key_positions`) and `loaded_rows`. What each layer runs comes from the record
`MethodConfig.apply` returned (`lcx.hf.applied.Applied`), never from reading the model back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..hf.attention_patch import current_patch, layer_methods, loaded_windows
from ..hf.engine_hook import (DECODE_INPUT, KEY_POSITIONS_INPUT, LoadedRows, MixedPrefill, has_decode_hook,
                              install_decode_hook, lean_decoder, loaded_rows, native_rows)
from ..hf.head import head_logits
from ..hf.rope_patch import current_spec
from ..method_config import INFERENCE_BACKEND, MethodConfig
from . import packed
from .batch import hf_cache
from .kv import CacheLayout, KVLayout, ModelKV
from .prefix import RowKV, stack_rows


@dataclass
class PrefillOutput:
    """One batched prefill call's result: keys, values (per layer `[b, H_kv, N + C, D]`: held slots,
    then the C new ones), `pos` `[b, N + C]` (-1 on padding), the new tokens' final hidden states
    `hidden` `[b, C, d]`."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    pos: torch.Tensor
    hidden: torch.Tensor

    @property
    def n_new(self) -> int:
        return self.hidden.shape[1]

    def new_kv(self, i: int, c: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Row i's keys and values of its c tokens computed in this call (per layer `[H_kv, c, D]`)."""
        start = self.pos.shape[1] - c
        return [k[i, :, start:] for k in self.keys], [v[i, :, start:] for v in self.values]

    def held(self, i: int, next_position: int, window: tuple[int, int] | None) -> RowKV:
        """Row i's KV after this call, only the slots a query at `next_position` can still see
        (`RowKV.kept`): what a prompt prefilled in several calls holds between them."""
        valid = self.pos[i] >= 0
        if self.pos.shape[0] == 1 and bool(valid.all()):  # views of this call's cache, no copy
            row = RowKV([k[0] for k in self.keys], [v[0] for v in self.values], self.pos[0])
        else:
            idx = valid.nonzero().squeeze(1)
            row = RowKV([k[i].index_select(1, idx) for k in self.keys],
                        [v[i].index_select(1, idx) for v in self.values], self.pos[i, idx])
        return row.kept(next_position, window)


class ModelRunner:
    """The forwards of one engine's model (module docstring). `applied`: what
    `MethodConfig.apply` did to it; `methods`: what the engine runs (the config applied, or the
    method the model's config records)."""

    def __init__(self, model: nn.Module, applied: Any, methods: MethodConfig, *, pad_id: int,
                 packed_linear: bool | None = None, lean_decode: bool = True):
        from ..hf import decoder

        self.model, self.applied, self.methods, self.pad_id = model, applied, methods, pad_id
        self.decoder = decoder(model)  # the stack the batched forwards call (no lm_head)
        self.recorded = applied.recorded is not None
        self.layer_methods = list(applied.layer_methods)
        self.cache_layout: KVLayout = kv_layout(model, applied, methods.decode_backend)
        self.hook = self.cache_layout.rotated and methods.attention is None
        # a model as loaded with sliding-window layers that `as_loaded_method` leaves as loaded
        # (Mistral's one window; a hybrid such as Gemma 3 under a length-dependent RoPE): for every
        # prefill transformers builds a [T, T] mask and runs the masked SDPA over all T keys
        windowed = windowed_rows(model, INFERENCE_BACKEND) if methods.attention is None else None
        # per layer, the window the model runs as loaded, where its prefill calls run per row on
        # lcx's backend (`lcx.hf.engine_hook.loaded_rows`; None: the model's own masked call):
        # those continuing from held keys, and for a windowed model whole prompts too (O(T * w))
        self.loaded_rows = windowed if windowed is not None else (
            loaded_rows_windows(model, INFERENCE_BACKEND) if self.hook else None)
        self.whole_prompt_rows = windowed is not None
        if self.hook or self.loaded_rows is not None:
            install_decode_hook(model)  # decode steps (rotated layout) and `loaded_rows` calls
        # attention methods run per row on the row's own keys (`lcx_key_positions`), not on a mask
        self.row_attention = methods.attention is not None
        # an unpatched model with its own sliding windows: a prefill continuing from held KV
        # gets masks built from positions per layer type (HF's mask slots by index)
        self.own_windows = loaded_windows(model) if methods.attention is None else None
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # a model as loaded whose rows run lcx's C++ causal kernel (float32 on the CPU,
        # `lcx.hf.engine_hook.native_rows`): every prefill per row through it too, whole
        # prompts included (the model's own call is torch's fused kernel, about half as fast:
        # `lcx bench rows`)
        self.native_prefill = self.loaded_rows is not None and native_rows(torch.empty(0, dtype=self.dtype,
                                                                                     device=self.device))
        self.store: ModelKV | None = None  # the running batch's KV (None when idle)
        # an emptied store whose buffers the next batch's rows are copied into (`drop_rows`)
        self.parked: ModelKV | None = None
        # the engine's forwards on oneDNN-packed linear weights (`lcx.engine.packed`; CPU float32)
        self.packed = packed.install(model, packed_linear)
        self._packed_scope = packed.scope if self.packed else contextlib.nullcontext
        # the fast path's decode forward without transformers' per-call machinery (`lean_decoder`)
        self.lean = (lean_decoder(model, packed.merged if self.packed else lambda mods, x: [m(x) for m in mods])
                     if lean_decode else None)

    # ------------------------------------------------------------------ the model's state
    def check_hook(self) -> None:
        """The fast path needs every attention layer to take `lcx_decode`: the patch's forward, or
        the hook installed at start-up (re-installed if an unpatch removed it). Raises if the
        model's attention or RoPE patch is no longer the one the engine applied (every step)."""
        patched = current_patch(self.model) is not None
        if patched != (self.methods.attention is not None and not self.recorded) or (
                patched and layer_methods(self.model) != self.layer_methods):
            raise RuntimeError("the model's attention patch changed after the engine was built; build a new Engine")
        if current_spec(self.model) != self.applied.rope:
            raise RuntimeError("the model's RoPE patch changed after the engine was built (e.g. lcx.unpatch); "
                               "build a new Engine")
        if not patched and not has_decode_hook(self.model):
            install_decode_hook(self.model)

    def forward_scope(self, input_ids: torch.Tensor) -> contextlib.AbstractContextManager:
        """The context for a plain forward over whole rows `input_ids` `[B, T]` (`Engine.forward_scope`)."""
        if not self.whole_prompt_rows:
            return contextlib.nullcontext()
        self.check_hook()
        return whole_rows(self.model, input_ids, self.loaded_rows, INFERENCE_BACKEND)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states `h` `[..., d]` (the model's lm_head and its soft-cap /
        scaling, as its forward), in at least float32 (bf16/fp16 logits are too coarse)."""
        with self._packed_scope():
            logits = head_logits(self.model, h)
        return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits

    # ------------------------------------------------------------------ prefill
    def prefill(self, rows: Sequence[tuple[Sequence[int], int, RowKV | None]]) -> PrefillOutput:
        """One batched prefill call: per row (its next tokens, the position of the first, the KV it
        holds or None), the tokens left-padded to the longest, continuing from the held KV
        (left-padded before them, `lcx.engine.prefix`)."""
        from transformers.cache_utils import DynamicCache

        ids, qpos, held_k, held_v, pos = self._prefill_inputs(rows)
        C = ids.shape[1]
        cache = DynamicCache() if held_k is None else hf_cache(held_k, held_v)
        if self.loaded_rows is not None and (held_k is not None or self.whole_prompt_rows or self.native_prefill):
            # a model as loaded continuing from held keys (or a windowed one, or one on lcx's C++
            # kernel, any prefill): per row on lcx's backend, no mask (`loaded_rows`; the model's own
            # call would be a masked pass)
            with loaded_rows(pos, self.loaded_rows, INFERENCE_BACKEND), self._packed_scope():
                out = self.decoder(input_ids=ids, position_ids=qpos.clamp(min=0), past_key_values=cache,
                                   use_cache=True)
        else:
            with self._packed_scope():
                out = self.decoder(input_ids=ids, position_ids=qpos.clamp(min=0), past_key_values=cache,
                                   use_cache=True, **self.mask_kwargs(pos >= 0, pos, n_new=C if held_k is not None else 0))
        return PrefillOutput([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers],
                             pos, out.last_hidden_state)

    def _prefill_inputs(self, rows: Sequence[tuple[Sequence[int], int, RowKV | None]], room: bool = False):
        """A prefill call's inputs: token ids and their positions `[b, C]` (left-padded: pad id,
        position -1), the held keys / values per layer `[b, Hkv, N, D]` (None: none held; `room`:
        `[b, Hkv, N + C, D]`, the last C slots for the new keys, `stack_rows`) and every slot's
        position `[b, N + C]`."""
        b, C = len(rows), max(len(t) for t, _, _ in rows)
        ids = torch.full((b, C), self.pad_id, dtype=torch.long)
        qpos = torch.full((b, C), -1, dtype=torch.long)
        for i, (toks, start, _) in enumerate(rows):
            c = len(toks)
            ids[i, C - c:] = torch.tensor(list(toks))
            qpos[i, C - c:] = torch.arange(start, start + c)
        ids, qpos = ids.to(self.device), qpos.to(self.device)
        held_k, held_v, kpos = stack_rows([kv for _, _, kv in rows], len(self.decoder.layers), None, C if room else 0)
        return ids, qpos, held_k, held_v, torch.cat([kpos.to(self.device), qpos], 1)

    # ------------------------------------------------------------------ decode and prefill in one forward
    def can_mix(self, store: ModelKV | None) -> bool:
        """Whether a step's decode rows and prefill chunks can run as one forward (`mixed`): the
        lean forward (`lcx.hf.lean_decode`), the fast path's rotated cache, and a prefill the lean
        forward attends as the model's own call does (a patched layer per row on the held-keys
        view; a model as loaded per row on lcx's backend, causal)."""
        return (self.lean is not None and store is not None and store.layout.rotated
                and (self.row_attention or (self.loaded_rows is not None and not self.whole_prompt_rows
                                            and all(w is None for w in self.loaded_rows))))

    def mixed(self, store: ModelKV, tokens: Sequence[int], positions: Sequence[int],
              rows: Sequence[tuple[Sequence[int], int, RowKV | None]]) -> tuple[torch.Tensor, PrefillOutput]:
        """`decode` of the rows of `store` and `prefill` of `rows` in one forward (`can_mix`; the
        weights read once for both, as vLLM's step): (the decode rows' logits `[b, V]`, the
        prefill's `PrefillOutput`)."""
        ids, qpos, held_k, held_v, pos = self._prefill_inputs(rows, room=True)
        real = (qpos >= 0).flatten()
        slots = real.nonzero().squeeze(1)
        pre = MixedPrefill(ids.flatten()[slots], qpos.flatten()[slots], slots, tuple(ids.shape), pos, held_k, held_v,
                           None if self.row_attention else LoadedRows(pos, self.loaded_rows, INFERENCE_BACKEND))
        d_ids = torch.tensor([[t] for t in tokens], device=self.device)  # [b, 1]
        p_q = torch.tensor(list(positions), device=self.device)  # [b]
        step = store.decode_step(p_q, self.dtype)
        with self._packed_scope():
            h = self.lean(d_ids, p_q, step, pre)
        return self.logits(h[:, -1]), PrefillOutput(pre.keys, pre.values, pos, pre.hidden)

    def mask_kwargs(self, mask: torch.Tensor, pos: torch.Tensor | None, *, n_new: int = 0) -> dict[str, Any]:
        """Visibility of the cached + new slots for the model's forward: a 2D attention mask, or
        for attention methods the held-keys view (`lcx_key_positions`: -1 where not visible). An
        unpatched model with its own sliding windows continuing from held KV (`n_new` new slots
        after the held ones; padding between them, where HF's masks, by slot index, would shift a
        window): 4D masks from the positions (`position_masks`)."""
        if self.row_attention:
            return {KEY_POSITIONS_INPUT: pos.masked_fill(~mask, -1)}
        if n_new and self.own_windows is not None and any(w is not None for w in self.own_windows):
            return {"attention_mask": position_masks(self.model, self.own_windows, pos.masked_fill(~mask, -1),
                                                     n_new, self.dtype)}
        return {"attention_mask": mask.long()}

    # ------------------------------------------------------------------ decode
    def decode(self, store: ModelKV, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """One decode forward of the rows of `store` (in order): feeds each row's token at its
        position, writes its key/value into `store` and returns logits `[b, V]`. Fast path
        (`store.layout.rotated`): one `ModelStep` handed to every layer (each attends with its layer
        group's `DecodeStep`). General path: each row's visible keys gathered in position order
        into an HF cache for the method's own attention (`lcx_key_positions`), the new column
        written back after."""
        ids = torch.tensor([[t] for t in tokens], device=self.device)  # [b, 1]
        p_q = torch.tensor(list(positions), device=self.device)  # [b]
        if store.layout.rotated:  # (the engine's step checked the hook: check_hook)
            step = store.decode_step(p_q, self.dtype)
            with self._packed_scope():
                if self.lean is not None:
                    return self.logits(self.lean(ids, p_q, step)[:, -1])  # [b, V]
                out = self.decoder(input_ids=ids, position_ids=p_q[:, None], use_cache=False, **{DECODE_INPUT: step})
            return self.logits(out.last_hidden_state[:, -1])  # [b, V]
        store = store.only  # the general path: one layout on every layer
        keys, values, kpos = store.gathered(p_q)  # [b, Hkv, T, D], [b, T]
        cache = hf_cache(keys, values)
        kpos = torch.cat([kpos, p_q[:, None]], 1)  # [b, T+1]
        with self._packed_scope():
            out = self.decoder(input_ids=ids, position_ids=p_q[:, None], past_key_values=cache, use_cache=True,
                               **self.mask_kwargs(kpos >= 0, kpos))
        logits = self.logits(out.last_hidden_state[:, -1])
        store.write_unrotated(store.step(p_q), [layer.keys[:, :, -1] for layer in cache.layers],
                              [layer.values[:, :, -1] for layer in cache.layers])
        return logits

    # ------------------------------------------------------------------ the running batch's rows
    def add_rows(self, out: PrefillOutput, rows: list[int], budgets: Sequence[int]) -> None:
        """Append rows `rows` of a prefill call to the running batch's store, each allocated for at
        most `budgets[j]` positions (prompt + max_tokens)."""
        if list(rows) == list(range(out.pos.shape[0])):  # every row (the common case): no gathered copy
            keys, values, pos = out.keys, out.values, out.pos
        else:
            keys, values, pos = [k[rows] for k in out.keys], [v[rows] for v in out.values], out.pos[rows]
        if self.store is None and self.parked is not None:  # the last batch's buffers, memory already paged in
            self.store, self.parked = self.parked, None
        # into the store's spare rows where they fit (no new buffers), else a new store appended
        new = ModelKV.from_prefill(self.cache_layout, keys, values, pos, torch.tensor(list(budgets)), into=self.store)
        if self.store is None or self.store.batch == 0:
            self.store = new
        elif new is not self.store:
            self.store.append(new)  # (in place: only the new rows are copied)

    def drop_rows(self, rows: list[int]) -> list[int]:
        """Drop these rows of the store in place; returns the remaining rows' new order as old
        indices (`lcx.engine.kv.ModelKV.drop`: holes filled from the end, so a step that finishes
        a few requests moves at most as many rows, never the whole batch's cache)."""
        if len(set(rows)) == self.store.batch:
            # the buffers are kept, with no rows, for the next batch (`parked`): a fresh store's
            # memory is paged in as it is first written, which on the system-prompt load cost
            # more than its copies (`lcx bench step --vs-vllm`: `fill_` 0.30 s of SmolLM2's 4.8)
            self.store.drop(rows)
            self.store, self.parked = None, self.store
            return []
        return self.store.drop(rows)


def kv_layout(model: nn.Module, applied: Any, decode_backend: str | None) -> KVLayout:
    """The engine's `KVLayout` for a model and what `MethodConfig.apply` ran on it (`applied`,
    `lcx.hf.applied.Applied`: each layer's method, window and RoPE basis; `lcx.engine.kv`).

    The fast path (keys rotated once, per group of layers running the same method on the same
    RoPE basis): unpatched models (every layer as loaded; layers with their own sliding window a
    ring of that window) and every layer's method with a `DecodeRule`. The general path, one
    layout for every layer keeping the union of the layers' windows, when some layer's method has
    no rule (SWAT), the RoPE basis changes with the length (dynamic NTK, longrope: a key rotated
    once would keep an old basis, which an attention method's reference does not do), an explicit
    `decode_backend` asks for the method's own attention, or the method is one a model records
    (it runs its own attention forward)."""
    from ..hf.attention_patch import channel_order
    from ..hf.rope_patch import layer_rope_types

    per_layer = applied.layer_methods
    n = len(per_layer)
    if all(m is None for m in per_layer):
        groups: dict[Any, list[int]] = {}
        for i, w in enumerate(applied.layer_windows):
            groups.setdefault(None if w is None else w[1], []).append(i)
        return KVLayout(tuple((CacheLayout.unpatched() if w is None else CacheLayout.own_window(w), tuple(g))
                              for w, g in groups.items()))
    bases = applied.bases
    if (applied.recorded is not None or decode_backend is not None or bases is None
            or any(m.decode_rule() is None for m in per_layer)):
        return KVLayout.single(CacheLayout.general(union_window([m.cache_window for m in per_layer])), n)
    types_ = layer_rope_types(model)
    by_key: dict[Any, list[int]] = {}
    for i, m in enumerate(per_layer):
        by_key.setdefault((m, types_[i]), []).append(i)
    order = channel_order(model)  # the family's channel layout (lcx.hf.channel_order)
    return KVLayout(tuple((CacheLayout.for_method(m, basis=bases[g[0]], order=order), tuple(g))
                          for (m, _), g in by_key.items()))


def windowed_rows(model: nn.Module, backend: str = INFERENCE_BACKEND) -> tuple[int | None, ...] | None:
    """Per layer, the window of a model as loaded (no attention method applied) with
    sliding-window layers, when `lcx.hf.attention_patch.loaded_rows` can run its calls on
    `backend` (`loaded_rows_windows`); else None. Such a model prefills per row on `backend`
    in the engine (every prompt) and in `windowed_rows_scope`: a hybrid under a length-dependent
    RoPE, which `as_loaded_method` leaves as loaded, or Mistral's one window."""
    from ..hf.attention_patch import current_patch

    if current_patch(model) is not None or all(w is None for w in loaded_windows(model)):
        return None
    return loaded_rows_windows(model, backend)


def windowed_rows_scope(model: nn.Module, input_ids: torch.Tensor,
                        backend: str = INFERENCE_BACKEND) -> contextlib.AbstractContextManager:
    """For a model `windowed_rows` names: a context in which its forward over whole rows
    `input_ids` `[B, T]` (no cache, positions 0..T-1) attends per row on `backend`, each layer
    causal or its own window, with no [T, T] mask built (the decode hook installed for the scope
    if the model has none); the same attention as its own masked call, as the engine prefills
    it. A no-op context for any other model."""
    windows = windowed_rows(model, backend)
    return contextlib.nullcontext() if windows is None else whole_rows(model, input_ids, windows, backend)


@contextlib.contextmanager
def whole_rows(model: nn.Module, input_ids: torch.Tensor, windows: tuple[int | None, ...], backend: str):
    from ..hf.engine_hook import has_decode_hook, install_decode_hook, loaded_rows, remove_decode_hook

    installed = not has_decode_hook(model)
    if installed:
        install_decode_hook(model)
    B, T = input_ids.shape
    try:
        with loaded_rows(torch.arange(T, device=input_ids.device).expand(B, T), windows, backend):
            yield
    finally:
        if installed:
            remove_decode_hook(model)


def loaded_rows_windows(model: nn.Module, backend: str) -> tuple[int | None, ...] | None:
    """Per layer, the window an unpatched model runs as loaded (`lcx.hf.attention_patch.loaded_windows`), when
    `lcx.hf.attention_patch.loaded_rows` can run its prefill calls on `backend` (the backend
    `supports()` them on the model's device, dtype and heads; soft-capped calls, Gemma 2's, on
    `blockwise` where `backend` cannot cap), else None."""
    from ..attention import BACKENDS, AttentionSpec, backend_for
    from ..hf import attention_softcap
    from ..hf.attention_patch import model_call_info
    from ..masks import causal_mask
    from ..masks import sliding_window as sliding_window_mask

    if backend not in BACKENDS:
        return None
    windows = tuple(loaded_windows(model))
    call = model_call_info(model, n_queries=2, n_keys=4, q_offset=2)
    softcap = attention_softcap(model)
    for w in set(windows):
        spec = AttentionSpec(mask=causal_mask if w is None else sliding_window_mask(left=w - 1), softcap=softcap)
        if BACKENDS[backend_for(backend, spec)].supports(spec, call) is not None:
            return None
    return windows


def position_masks(model: nn.Module, windows: list[int | None], pos: torch.Tensor, n_new: int,
                    dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive 4D masks `[b, 1, C, N + C]` of a prefill call from its slots' positions `pos`
    `[b, N + C]` (-1: padding; the C = n_new new tokens last): a query sees the keys at positions
    <= its own, within its layer's window (the query and the w - 1 before it, as transformers'
    sliding masks); a padding query sees itself only (never read, but finite). One mask when
    every layer has the same window, else {layer type: mask} (hybrid models take a mask per
    layer type)."""
    from ..hf import layer_types

    T = pos.shape[1]
    q = pos[:, -n_new:, None]  # [b, C, 1]
    k = pos[:, None, :]  # [b, 1, T]
    seen = (k >= 0) & (k <= q)  # [b, C, T]
    own = torch.zeros(n_new, T, dtype=torch.bool, device=pos.device)
    own[torch.arange(n_new), T - n_new + torch.arange(n_new)] = True
    own = own[None] & (q < 0)
    neg = torch.finfo(dtype).min

    def mask(w: int | None) -> torch.Tensor:
        vis = (seen if w is None else seen & (k > q - w)) | own
        return torch.zeros(vis.shape, dtype=dtype, device=pos.device).masked_fill_(~vis, neg)[:, None]

    if len(set(windows)) == 1:
        return mask(windows[0])
    by_type: dict[str, int | None] = {}
    for t, w in zip(layer_types(model), windows):
        if by_type.setdefault(t, w) != w:
            raise ValueError(f"layers of type {t!r} run different windows; cannot mask them per layer type")
    return {t: mask(w) for t, w in by_type.items()}


def union_window(windows: list[tuple[int, int] | None]) -> tuple[int, int] | None:
    """(n_first, n_recent) covering every layer's window (None if a layer keeps every key)."""
    if not windows or any(w is None for w in windows):
        return None
    return max(w[0] for w in windows), max(w[1] for w in windows)


__all__ = ["ModelRunner", "PrefillOutput", "kv_layout", "loaded_rows_windows", "position_masks", "union_window",
           "whole_rows", "windowed_rows", "windowed_rows_scope"]
