"""Bounded KV cache decoding: keep only the keys an attention method can still see.

    model, tok = lcx.load_model("tiny-5m")
    method = lm_infinite(n_global=16, n_local=256)
    with attention_patched(model, method):
        cache = BoundedKVCache(method)                      # a transformers `Cache`
        tokens = greedy_generate(model, ids, 64, cache=cache)
        cache.nbytes()                                      # <= (G + L - 1) keys+values per layer

A method whose queries only see the first `n_first` keys and the last `n_recent` keys (itself
included), `method.cache_window`, needs between steps only those n_first + n_recent - 1 keys
per layer: memory and per-token attention cost independent of the length decoded.

Semantics (stated once; pinned by tests/methods/test_attention_methods.py):

- **Keys are stored BEFORE RoPE**, with their true positions (`key_positions`). Every
  attention call rotates the G + L keys it reads (`lcx.attention` does, inside the call; one
  rotation of G + L keys per layer per step, the same order of work as the attention itself).
  Why unrotated for every key, rather than rotated window keys + unrotated global keys:
  LM-Infinite scores a global key at position 0 against a query rotated to the capped
  distance, and StreamingLLM rotates every key by its slot index, which changes each step; one
  layout serves both, and the decode step is exactly the library call that defines the method
  (`method.attend`), not a second implementation of it.
- **Eviction.** `update` appends the new keys and returns ALL keys (kept + new) for this
  call's attention, then keeps for the next call the slots with position < n_first or among
  the last n_recent - 1 positions (HF's `DynamicSlidingWindowLayer` does the same for windows).
- **Positions for RoPE** (`rotary_positions`): the true positions, except for methods with
  `renumber_in_cache` (StreamingLLM), which rotate by slot index 0..Tk-1 inside the cache.
- **Why the compressed cache is exact.** The kept keys are [first n_first | a contiguous run
  ending at the newest key], so the mask indices of the compressed cache differ from the full
  cache's only by a constant inside the run, and every kept first-key that is outside the
  query's window in the full sequence is also outside it in the compressed one (its index
  distance is >= n_recent). Masks and RoPE only see index differences inside the window, so:
  sliding window: exact; LM-Infinite: exact when its cap min(limit_distance, Tk - 1) does not
  depend on Tk, i.e. limit_distance <= n_global + n_local - 1 (the default, n_local, is;
  `check_bounded` raises otherwise); StreamingLLM: its definition *is* the compressed cache
  (`lcx.methods.streaming`). Holds for decode and for chunked prefill (any Tq per call).
- Per layer: each layer keeps what its own method sees (on a hybrid model's sliding layers,
  their own window; `lcx.hf.layer_methods`).
- Batches: rows share positions (no padding), as in `lcx.hf.attention_patch`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from lcx.methods.base import AttentionMethod
from lcx.methods.registry import method_from_dict

from .calls import current_call
from .generate import greedy_decode_ref


def kept_slots(pos: torch.Tensor, next_position: torch.Tensor | int, n_first: int, n_recent: int) -> torch.Tensor:
    """The eviction rule of a bounded cache (here and the vLLM plugin's decode plan; `lcx.engine`
    keeps the same keys by construction, `lcx.engine.kv`): the next query sits at `next_position`
    and sees positions < n_first and the last n_recent (itself included), so a cached slot at
    `pos` is kept iff pos < n_first or pos > next_position - n_recent.
    `pos` [..., T]; `next_position` broadcasts against it ([B, 1] for a batch of rows)."""
    return (pos < n_first) | (pos > next_position - n_recent)


class BoundedLayer(CacheLayerMixin):
    """One layer of a `BoundedKVCache`: keys/values `[B, Hkv, T, D]` (unrotated) + positions `[T]`."""

    is_sliding = True  # its length is bounded (what transformers' offloading/masking asks)
    is_compileable = False

    def __init__(self, n_first: int, n_recent: int, renumber: bool):
        super().__init__()
        self.n_first, self.n_recent, self.renumber = n_first, n_recent, renumber
        self.positions: torch.Tensor | None = None  # [T] int64: true positions of the kept slots
        self.cumulative_length = 0
        self._call_positions: torch.Tensor | None = None  # positions of the keys the last update returned

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        self.keys = key_states.new_zeros(B, H, 0, D)
        self.values = value_states.new_zeros(B, value_states.shape[1], 0, value_states.shape[3])
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `[B, Hkv, Tq, D]` keys/values; return all keys/values for this call; then evict."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        Tq = key_states.shape[-2]
        new_pos = torch.arange(self.cumulative_length, self.cumulative_length + Tq, device=self.device)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        pos = torch.cat([self.positions, new_pos])
        self.cumulative_length += Tq
        self._call_positions = pos
        keep = kept_slots(pos, self.cumulative_length, self.n_first, self.n_recent)
        if bool(keep.all()):
            self.keys, self.values, self.positions = keys, values, pos
        else:
            idx = keep.nonzero().squeeze(-1)
            self.keys = keys.index_select(-2, idx)
            self.values = values.index_select(-2, idx)
            self.positions = pos[idx]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kept = 0 if self.positions is None else int(self.positions.numel())
        return kept + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens seen so far (the next token's position), not the slots kept."""
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.n_first + self.n_recent - 1

    def reset(self) -> None:
        self.keys = self.values = self.positions = self._call_positions = None
        self.cumulative_length = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a bounded cache cannot be cropped: evicted keys are gone")


class BoundedKVCache(Cache):
    """transformers `Cache` of `BoundedLayer`s for a patched model (`patch_attention`).

    method: the attention method the model runs (its `cache_window` sets what is kept);
        `check_bounded` is enforced.
    num_layers: optional; layers are otherwise created on first use.
    """

    def __init__(self, method: AttentionMethod | Any, num_layers: int | None = None):
        method = method_from_dict(method)
        method.check_bounded()
        self.method = method
        n_first, n_recent = method.cache_window
        self._layer_args = (n_first, n_recent, bool(method.renumber_in_cache))
        layers = [BoundedLayer(*self._layer_args) for _ in range(num_layers)] if num_layers else None
        if layers is None:
            super().__init__(layer_class_to_replicate=_layer_factory(*self._layer_args))
        else:
            super().__init__(layers=layers)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Filled only by a model patched with the same method (keys must arrive unrotated); each
        layer is bounded by what that layer runs (`lcx.hf.layer_methods`: the method, or on a
        hybrid model's sliding layers the family's own window)."""
        call = current_call()
        chosen = None if call is None else call.state.chosen
        if chosen != self.method:
            raise ValueError(
                f"BoundedKVCache({self.method.describe()}) is filled by "
                + ("a model not patched with lcx.hf.attention_patch.patch_attention (its keys would be rotated, "
                   "and nothing would rotate them at read time)" if chosen is None
                   else f"a model running {chosen.describe()}"))
        layer_method = call.state.method
        layer_method.check_bounded()
        args_ = (*layer_method.cache_window, bool(layer_method.renumber_in_cache))
        while len(self.layers) <= layer_idx:
            self.layers.append(BoundedLayer(*self._layer_args))
        layer = self.layers[layer_idx]
        if (layer.n_first, layer.n_recent, layer.renumber) != args_:
            if layer.is_initialized:
                raise ValueError(f"BoundedKVCache layer {layer_idx} holds keys for another window")
            self.layers[layer_idx] = BoundedLayer(*args_)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        """True positions `[Tk]` of the keys the last `update` of this layer returned."""
        return self.layers[layer_idx]._call_positions

    def rotary_positions(self, layer_idx: int) -> torch.Tensor:
        """Positions `[Tk]` to rotate those keys with (slot indices for renumbering methods)."""
        layer = self.layers[layer_idx]
        pos = layer._call_positions
        return torch.arange(pos.numel(), device=pos.device) if layer.renumber else pos

    def kept_positions(self, layer_idx: int = 0) -> torch.Tensor:
        """True positions `[T]` of the slots kept for the next call."""
        return self.layers[layer_idx].positions

    def nbytes(self) -> int:
        return cache_nbytes(self)


def _layer_factory(n_first: int, n_recent: int, renumber: bool) -> Callable[[], BoundedLayer]:
    # `Cache(layer_class_to_replicate=...)` calls it with no arguments for every new layer.
    def make() -> BoundedLayer:
        return BoundedLayer(n_first, n_recent, renumber)

    return make


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a transformers cache's key/value tensors (and positions, if any)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None), getattr(layer, "positions", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def cache_len(cache: Any, layer_idx: int = 0) -> int:
    """Slots held by layer `layer_idx` (not the tokens seen)."""
    layer = cache.layers[layer_idx]
    return 0 if getattr(layer, "keys", None) is None else int(layer.keys.shape[-2])


@dataclass
class GenerationResult:
    """Greedy tokens `[B, N]` plus per-phase timings and cache sizes after every step."""

    tokens: torch.Tensor
    prefill_s: float
    decode_s: float
    cache_bytes: list[int] = field(default_factory=list)  # after prefill, then after each decode step
    step_s: list[float] = field(default_factory=list)  # wall time of each decode forward

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.tokens.shape[1] - 1  # the first token comes from the prefill
        return n * self.tokens.shape[0] / self.decode_s if self.decode_s > 0 and n > 0 else float("nan")


@torch.inference_mode()
def greedy_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    cache: Any = None,
    prefill_chunk: int | None = None,
    record_cache_bytes: bool = False,
) -> GenerationResult:
    """Greedy decoding of `max_new_tokens` after `input_ids [B, T]`, one token per forward, over a
    transformers `Cache`: the reference decode loop (`lcx.hf.generate.greedy_decode_ref`).

    Why it exists beside `lcx.engine.Engine` (lcx's decode loop, fast: keys rotated once, per-method
    decode rules): it decodes over the cache object given, running each method's own `attend` on
    unrotated keys every step, so it is the reference bounded decoding is defined and checked by
    (slow by design; `lcx bench decode` measures the engine). `BoundedKVCache` tokens equal
    full-cache tokens here (tests/methods/test_attention_methods.py), and the engine's per-row bounded
    caches equal this loop token for token (tests/engine/test_engine_attention.py). Rows share positions
    (no padding); for ragged prompts, sampling or stop rules use the engine.

    cache: a transformers `Cache` (`BoundedKVCache(method)` for bounded decoding); None = a
        full `DynamicCache` (what the model, patched or not, does by default).
    prefill_chunk: feed the prompt in chunks of this many tokens (None: one forward).
    Only the last position's logits are computed in prefill (`logits_to_keep=1`).
    """
    from transformers.cache_utils import DynamicCache

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cache = DynamicCache() if cache is None else cache
    sizes: list[int] = []
    steps: list[float] = []
    t0 = time.perf_counter()
    step = prefill_chunk or input_ids.shape[1]
    for s in range(0, input_ids.shape[1], step):
        out = model(input_ids=input_ids[:, s:s + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]  # [B, V]
    t1 = time.perf_counter()
    if record_cache_bytes:
        sizes.append(cache_nbytes(cache))

    def feed(nxt: torch.Tensor) -> torch.Tensor:  # [B] -> [B, V]
        ts = time.perf_counter()
        logits = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
        steps.append(time.perf_counter() - ts)
        if record_cache_bytes:
            sizes.append(cache_nbytes(cache))
        return logits

    tokens = greedy_decode_ref(feed, logits, max_new_tokens)  # [B, max_new_tokens]
    t2 = time.perf_counter()
    return GenerationResult(tokens, t1 - t0, t2 - t1, sizes, steps)

__all__ = ["BoundedKVCache", "BoundedLayer", "GenerationResult", "cache_len", "cache_nbytes", "greedy_generate"]
