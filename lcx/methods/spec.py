"""Attention methods for whole models: what a layer computes, and what a bounded cache keeps.

A method is a frozen, validated dataclass; `ATTENTION_METHODS` is the only list of them.
Every method is called the same way, on UNROTATED q/k (so methods that change positions,
LM-Infinite's distance cap and StreamingLLM's renumbering, can):

    method.attend(q, k, v, rotary=Rotary(inv_freq, key_positions, attention_factor),
                  backend="blockwise", scale=None) -> out [B, Tq, H, Dv]

q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]`: the queries are the last Tq of
the Tk keys (`lcx.masks` window convention), `rotary.positions` the keys' RoPE positions.

Methods
-------
- `causal()`                  full causal attention (the unpatched model; a control).
- `lm_infinite(G, L, limit)`  LM-Infinite (arXiv 2308.16137): Λ-mask, G global + L local keys,
                              global keys scored at distance min(limit, Tk - 1) (default L);
                              `lcx.attention.lambda_attention_ref` defines it;
                              `top_k=5` adds the paper's top-k middle keys for the last query.
- `sliding_window(window=w)`  a window of w keys, itself included (the `sliding_window(left=w - 1)` mask).
- `self_extend(G, W)`         Self-Extend (arXiv 2401.01325): true positions within a window of
                              W keys, positions floor-divided by G beyond (`lcx.methods.self_extend`).
- `sinks(S, w)`               StreamingLLM (arXiv 2309.17453): S sink keys + a window of w keys,
                              positions renumbered as StreamingLLM's cache does
                              (`lcx.methods.streaming`). `sinks(S, w, renumber=False)` is the bare
                              `attention_sinks` mask at true positions (no renumbering).
- `swat(w)`                   SWAT (arXiv 2502.18845): sigmoid attention over a window of w keys
                              with per-head ALiBi (balanced by default) + RoPE (`lcx.methods.swat`);
                              meaningful on a model trained with it, which records it in its config.

Decode rule (`AttentionMethod.decode_rule`, run by `lcx.engine`): how the last query of a step
sees a cache whose keys were rotated ONCE, when they entered it. Every method but SWAT is one
softmax over two branches:

    window branch  the last `window` keys (the query's own included; None: every key), at their
                   true positions: stored rotated at p_k, the query rotated at p_q.
    side branch    the older keys p_k <= p_q - window among the first `side` positions (None:
                   all of them), at moved positions: stored rotated at `side_key(p_k)`, scored
                   with the query rotated at `side_query(p_q)`.

The relative position of a side key is side_key(p_k) - side_query(p_q), so only the query is
rotated per step (once more, for the side branch); cached keys never are. Per method:

    causal            window None
    sliding_window    window w
    lm_infinite       window L; side G, side_key 0, side_query min(limit, p_q) (the distance cap);
                      with top_k: the k best middle keys, query at top_k_insert_at, key at 0
    sinks (renumber)  window w; side S, side_key p_k, side_query min(p_q, S + w - 1)
    sinks (bare)      window w; side S, side_key p_k, side_query p_q
    self_extend       window W; side every key, side_key floor(p_k / G),
                      side_query floor(p_q / G) + W - W / G
    swat              None (sigmoid with a distance bias: not a softmax over rotated keys)

Positions are a token's index in its sequence (0, 1, ...); the rule equals `last_query_keys` on
a contiguous history (tests/methods/test_decode_rule.py) and so `attend`.

Bounded cache (`lcx.methods.bounded_cache`): a method that only ever looks at the first
`n_first` keys and the last `n_recent` keys (the query included) can decode with a cache of
`n_first + n_recent - 1` keys per layer. What each method computes on that compressed cache
equals what it computes on the full cache (see `bounded_cache` for the argument, and the
tests); `renumber_in_cache` says whether the compressed cache rotates keys by their slot index
(StreamingLLM) or by their true position (the others).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import torch

from lcx.attention import AttentionSpec, LambdaParams, Rotary, attention
from lcx.masks import attention_sinks, causal_mask
from lcx.masks import sliding_window as sliding_window_mask
from lcx.masks.base import check_count


@dataclass(frozen=True)
class AttentionMethod:
    """Base class; see the module docstring. Subclasses set `name` and implement `_spec`."""

    name: ClassVar[str] = ""
    renumber_in_cache: ClassVar[bool] = False
    # True when a query-key distance is not the true one (LM-Infinite's cap, StreamingLLM's
    # renumbering): the method rotates q/k itself, so a cache must keep keys unrotated.
    needs_unrotated_keys: ClassVar[bool] = False

    # --------------------------------------------------------------- what the layer computes
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        rotary: Rotary,
        backend: str = "blockwise",
        scale: float | None = None,
        layer_idx: int | None = None,
    ) -> torch.Tensor:
        """Unrotated q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`, v -> out `[B, Tq, H, Dv]`.
        `layer_idx`: the model layer of the call, for methods that differ per layer (LM-Infinite's
        top-k middle keys); the others ignore it."""
        return attention(q, k, v, _spec_for(self, scale), backend=backend, rotary=rotary)

    def attention_spec(self, scale: float | None = None) -> AttentionSpec:
        """The `lcx.attention` spec of this method (for methods that are one attention call)."""
        return _spec_for(self, scale)

    def _spec(self, scale: float | None) -> AttentionSpec:
        raise NotImplementedError

    def supports(self, backend: str) -> str | None:
        """Why the `lcx.attention` backend `backend` cannot run this method's calls, judged on the
        method alone (a call's tensors may still rule it out; the dispatcher then raises naming
        why), or None if it can. E.g. SWAT's sigmoid on the softmax-only `flash` backend."""
        from lcx.attention import BACKENDS

        if backend not in BACKENDS:
            return f"{backend!r} is not an lcx.attention backend; known: {sorted(BACKENDS)}"
        return next((r for spec in self._call_specs() if (r := BACKENDS[backend].supports(spec, None))), None)

    def _call_specs(self) -> tuple[AttentionSpec, ...]:
        """The specs of the `lcx.attention` calls `attend` makes (what `supports` checks)."""
        return (self.attention_spec(),)

    def last_query_keys(self, positions: torch.Tensor) -> "LastQueryKeys | None":
        """The attention of the LAST query of a call as plain softmax attention over rotated keys:
        which keys it sees and the position each key must be rotated to (the query at its own
        position `positions[..., -1]`), or None where the method is not of that form (SWAT's
        sigmoid). `positions` `[B, Tk]`: the keys' RoPE positions in the call.
        `lcx.methods.last_query` runs it; tested equal to `attend` for every method."""
        return None

    def query_keys(self, positions: torch.Tensor, n_queries: int) -> "LastQueryKeys | None":
        """`last_query_keys` for each of the call's last `n_queries` queries (query t is key
        Tk - n_queries + t, the convention of every lcx call): `visible` and `key_positions`
        `[B, Tq, Tk]`, key positions to be read relative to query t's own position. Default:
        query t sees what the last query of the call cut after it would see (right for methods
        whose query depends only on the keys up to it; a method whose queries also depend on
        the call's length, like LM-Infinite's cap, overrides this). None: not plain softmax."""
        Tk = positions.shape[-1]
        vis, pos = [], []
        for t in range(n_queries):
            n = Tk - n_queries + t + 1
            lq = self.last_query_keys(positions[..., :n])
            if lq is None:
                return None
            pad = Tk - n
            seen = torch.ones_like(positions[..., :n], dtype=torch.bool) if lq.visible is None else lq.visible
            vis.append(torch.nn.functional.pad(seen, (0, pad), value=False))
            pos.append(torch.nn.functional.pad(lq.key_positions, (0, pad), value=0))
        return LastQueryKeys(torch.stack(vis, dim=-2), torch.stack(pos, dim=-2))

    def decode_rule(self) -> "DecodeRule | None":
        """How a decode step's query sees a cache of keys rotated once (see the module docstring),
        or None where the method is not softmax over rotated keys (SWAT): `lcx.engine` then
        decodes through `attend` over unrotated keys."""
        return None

    # --------------------------------------------------------------- what a bounded cache keeps
    @property
    def cache_window(self) -> tuple[int, int] | None:
        """(n_first, n_recent): the keys any query can see are among the first n_first and the
        last n_recent (itself included); None for an unbounded method."""
        return None

    def check_bounded(self) -> None:
        """Raise `ValueError` if a bounded cache cannot reproduce this method exactly."""
        if self.cache_window is None:
            raise ValueError(f"attention method {self.name!r} sees every key; it has no bounded cache")

    # --------------------------------------------------------------- config as data
    def to_dict(self) -> dict[str, Any]:
        """`{"type": name, **parameters}`, parameters at their default left out (`method_from_dict`
        puts them back), so a config reads as it was written."""
        out: dict[str, Any] = {"type": self.name}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.default is dataclasses.MISSING or v != self._default(f):
                out[f.name] = v
        return out

    def _default(self, f: dataclasses.Field) -> Any:
        return f.default

    def describe(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())
        return f"{self.name}({params})"


@dataclass(frozen=True)
class LastQueryKeys:
    """What the last query of a call sees (`AttentionMethod.last_query_keys`).

    visible:       `[B, Tk]` bool, or None when it sees every key;
    key_positions: `[B, Tk]` the position to rotate each key to: a score q.R(p_k - p_q)k needs
                   only the relative rotation, so a branch that rotates the query to a
                   different position (LM-Infinite's cap, StreamingLLM's renumbered sinks,
                   Self-Extend's groups) moves the key instead, by the same amount.
    """

    visible: torch.Tensor | None
    key_positions: torch.Tensor


@dataclass(frozen=True)
class DecodeRule:
    """How the last query of a step sees a cache of keys rotated once (module docstring).

    window:     keys at true positions: p_q - window < p_k <= p_q (None: every key).
    side:       the side branch's keys, among those p_k <= p_q - window: the first `side`
                positions (0: no side branch; None: every key).
    side_key:   p_k -> the position a side key is stored rotated at (float64 tensor op).
    side_query: p_q -> the position the query is rotated at for the side branch.
    top_k:      k > 0: a third branch, LM-Infinite's top-k middle keys. The middle keys
                side <= p_k <= p_q - window, stored like side keys (rotated at side_key(p_k),
                so the side store keeps every key), are scored with the query rotated at
                `top_k_query`; per query head the k best join the softmax with those scores
                as logits, in layers top_k_layers[0] <= layer < top_k_layers[1] (None: all
                after), and only where the middle holds at least k keys.
    """

    window: int | None
    side: int | None = 0
    side_key: Callable[[torch.Tensor], torch.Tensor] | None = None
    side_query: Callable[[torch.Tensor], torch.Tensor] | None = None
    top_k: int = 0
    top_k_query: float | None = None
    top_k_layers: tuple[int, int | None] = (0, None)

    def __post_init__(self) -> None:
        if self.side != 0 and (self.window is None or self.side_key is None or self.side_query is None):
            raise ValueError("a side branch needs a window and both side_key and side_query")
        if self.top_k and (self.side is None or not self.side_key or self.top_k_query is None):
            raise ValueError("a top-k branch needs a bounded side branch (its keys' rotation) and top_k_query")

    def top_k_in_layer(self, layer: int) -> bool:
        lo, hi = self.top_k_layers
        return bool(self.top_k) and lo <= layer and (hi is None or layer < hi)

    @property
    def has_side(self) -> bool:
        return self.side != 0

    def relative_positions(self, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a query at p_q = n_keys - 1 over keys 0..n_keys-1: (visible `[n_keys]` bool,
        relative position key - query `[n_keys]` float64), what `last_query_keys` gives on a
        contiguous history (the test of this rule)."""
        p = torch.arange(n_keys, dtype=torch.float64)
        pq = p[-1:]
        in_window = torch.ones(n_keys, dtype=torch.bool) if self.window is None else p > pq - self.window
        rel = p - pq
        visible = in_window.clone()
        if self.has_side:
            side = ~in_window & (p < self.side if self.side is not None else torch.ones_like(in_window))
            rel = torch.where(side, self.side_key(p) - self.side_query(pq), rel)
            visible |= side
        return visible, rel


@functools.lru_cache(maxsize=256)
def _spec_for(method: AttentionMethod, scale: float | None) -> AttentionSpec:
    return method._spec(scale)


@dataclass(frozen=True)
class Causal(AttentionMethod):
    """Full causal attention, computed by lcx (a control: equals the unpatched model)."""

    name: ClassVar[str] = "causal"

    def _spec(self, scale):
        return AttentionSpec(mask=causal_mask, scale=scale)

    def last_query_keys(self, positions):
        return LastQueryKeys(None, positions)

    def decode_rule(self):
        return DecodeRule(window=None)


@dataclass(frozen=True)
class LMInfinite(AttentionMethod):
    """LM-Infinite (arXiv 2308.16137): G global + L local keys, global distance capped.

    n_global: first keys every query sees (paper: 10-100 behave alike).
    n_local:  window of keys, the query itself included (paper: the pretraining length).
    limit_distance: distance at which global keys outside the window are scored (default
        n_local); the query is rotated to min(limit_distance, Tk - 1), global keys to 0.

    Top-k middle keys (the paper's passkey/Qasper runs, `--top_k_attention 5 --top_k_from_layer 4`
    of Glaciohound/LM-Infinite `models/llama.py`); off when top_k = 0 (the default):
    top_k:            k. In layers top_k_from_layer <= layer < top_k_to_layer, the LAST query of
                      each call (the last prompt token of a prefill, every decode step; no other
                      row) also sees, per query head, the k middle keys j in [n_global, i - n_local
                      + 1) (those the Λ-mask hides from query i) scoring highest with the query
                      rotated to top_k_insert_at and the key to 0; their logits are those scores,
                      in one softmax with the Λ keys (`lcx.attention.lambda_topk_attention_ref`).
                      Fewer than k middle keys: the plain Λ row.
    top_k_from_layer: first layer (0-based) that does it (official default 4).
    top_k_to_layer:   first layer that no longer does (default None: every layer after; the
                      official default is 1000).
    top_k_insert_at:  the distance every middle key is scored at (default n_local // 2: the
                      official default is 2048 with a 4096-key window).
    With top_k > 0 the cache keeps every key (`cache_window` None: any middle key can be
    chosen, so memory grows with the sequence as full attention's), `attend` needs `layer_idx`,
    and the last query is not a fixed-subset softmax (`last_query_keys`/`query_keys` None).
    Calls cut differently (chunked prefill) give the top-k to different rows, as in the
    official code.
    """

    name: ClassVar[str] = "lm_infinite"
    needs_unrotated_keys: ClassVar[bool] = True
    n_global: int
    n_local: int
    limit_distance: int | None = None
    top_k: int = 0
    top_k_from_layer: int = 4
    top_k_to_layer: int | None = None
    top_k_insert_at: int | None = None

    def __post_init__(self) -> None:
        # One validation for LM-Infinite's parameters: lcx.attention.LambdaParams.
        lp = LambdaParams(self.n_global, self.n_local, self.limit_distance)
        object.__setattr__(self, "limit_distance", lp.limit_distance)
        check_count("top_k", self.top_k, 0)
        check_count("top_k_from_layer", self.top_k_from_layer, 0)
        if self.top_k_to_layer is not None:
            check_count("top_k_to_layer", self.top_k_to_layer, self.top_k_from_layer + 1)
        if self.top_k_insert_at is None:
            object.__setattr__(self, "top_k_insert_at", self.n_local // 2)
        check_count("top_k_insert_at", self.top_k_insert_at, 0)
        if not self.top_k:
            unused = [f.name for f in dataclasses.fields(self)
                      if f.name.startswith("top_k_") and getattr(self, f.name) != self._default(f)]
            if unused:
                raise ValueError(f"lm_infinite: {unused} set but top_k = 0 (top-k middle keys off)")

    def _default(self, f):
        # None means n_local (the cap) and n_local // 2 (the top-k insert position)
        if f.name == "limit_distance":
            return self.n_local
        return self.n_local // 2 if f.name == "top_k_insert_at" else f.default

    def top_k_in_layer(self, layer_idx: int | None) -> bool:
        """Whether the last query of a call in layer `layer_idx` gets the top-k middle keys."""
        if not self.top_k:
            return False
        if layer_idx is None:
            raise ValueError("lm_infinite with top_k > 0 differs per layer: attend() needs layer_idx "
                             f"(top-k in layers [{self.top_k_from_layer}, {self.top_k_to_layer}))")
        return self.top_k_from_layer <= layer_idx and (self.top_k_to_layer is None or layer_idx < self.top_k_to_layer)

    def attend(self, q, k, v, *, rotary, backend="blockwise", scale=None, layer_idx=None):
        out = super().attend(q, k, v, rotary=rotary, backend=backend, scale=scale)  # Λ, every row
        if not self.top_k_in_layer(layer_idx):
            return out
        # the last row again, with its top-k middle keys: one row, dense (O(Tk) work)
        from lcx.attention import lambda_topk_attention_ref

        last = lambda_topk_attention_ref(
            q[:, -1:], k, v, rotary=rotary, n_global=self.n_global, n_local=self.n_local,
            limit_distance=self.limit_distance, top_k=self.top_k, top_k_insert_at=self.top_k_insert_at,
            scale=scale)  # [B, 1, H, Dv]
        return torch.cat((out[:, :-1], last.to(out.dtype)), dim=1)

    def _spec(self, scale):
        return AttentionSpec.lm_infinite(self.n_global, self.n_local, self.limit_distance, scale=scale)

    @property
    def cache_window(self):
        return None if self.top_k else (self.n_global, self.n_local)

    def decode_rule(self):
        # global keys stored unrotated (position 0), scored with the query at the cap
        # d = min(limit, p_q) (on a contiguous history Tk - 1 = p_q); with top_k, the middle
        # keys are stored the same way and scored with the query at top_k_insert_at
        limit = self.limit_distance
        top = dict(top_k=self.top_k, top_k_query=float(self.top_k_insert_at),
                   top_k_layers=(self.top_k_from_layer, self.top_k_to_layer)) if self.top_k else {}
        return DecodeRule(window=self.n_local, side=self.n_global, side_key=torch.zeros_like,
                          side_query=lambda p: torch.clamp(p, max=limit), **top)

    def last_query_keys(self, positions):
        keys = self.query_keys(positions, 1)
        return None if keys is None else LastQueryKeys(keys.visible[..., 0, :], keys.key_positions[..., 0, :])

    def query_keys(self, positions, n_queries):
        if self.top_k:
            return None  # which middle keys the last query sees depends on the scores
        # local keys (the last n_local up to the query) at their positions; global keys outside
        # the window are scored with the query at d = min(limit, Tk - 1) of the whole call (not
        # of its own prefix) and the key at 0: relative rotation -d
        Tk = positions.shape[-1]
        i = torch.arange(Tk - n_queries, Tk, device=positions.device)[:, None]  # [Tq, 1]
        j = torch.arange(Tk, device=positions.device)  # [Tk]
        local = (j <= i) & (j > i - self.n_local)
        glob = (j < self.n_global) & (j <= i) & ~local
        d = LambdaParams(self.n_global, self.n_local, self.limit_distance).effective_limit(Tk)
        p = positions[..., None, :]  # [B, 1, Tk]
        p_query = positions[..., Tk - n_queries:, None]  # [B, Tq, 1]
        eff = torch.where(glob, p_query - d, p)
        return LastQueryKeys((local | glob).expand_as(eff), eff)

    def check_bounded(self) -> None:
        if self.top_k:
            raise ValueError("lm_infinite with top_k > 0 may pick any middle key: it has no bounded cache")
        # The global branch rotates the query to min(limit_distance, Tk - 1). A compressed
        # cache has Tk <= n_global + n_local, so it reproduces the full cache only if the cap
        # never exceeds n_global + n_local - 1 (no global keys: nothing is capped).
        cap = self.n_global + self.n_local - 1
        if self.n_global > 0 and self.limit_distance > cap:
            raise ValueError(
                f"limit_distance={self.limit_distance} > n_global + n_local - 1 = {cap}: with a bounded "
                f"cache the capped distance min(limit_distance, Tk - 1) would depend on evicted keys; "
                f"use limit_distance <= {cap} (default n_local) or a full cache")


@dataclass(frozen=True)
class SlidingWindow(AttentionMethod):
    """Causal sliding window of `window` keys, the query itself included."""

    name: ClassVar[str] = "sliding_window"
    window: int

    def __post_init__(self) -> None:
        check_count("window", self.window, 1)

    def _spec(self, scale):
        return AttentionSpec(mask=sliding_window_mask(left=self.window - 1), scale=scale)

    def last_query_keys(self, positions):
        Tk = positions.shape[-1]
        visible = torch.arange(Tk, device=positions.device) >= Tk - self.window
        return LastQueryKeys(visible.expand_as(positions), positions)

    def decode_rule(self):
        return DecodeRule(window=self.window)

    @property
    def cache_window(self):
        return (0, self.window)


@dataclass(frozen=True)
class Sinks(AttentionMethod):
    """StreamingLLM (arXiv 2309.17453): `n_sink` first keys + a window of `window` keys.

    renumber=True (StreamingLLM): positions are renumbered inside the cache, so a query sees
        the sinks as if they sat just before its window (`lcx.methods.streaming`).
    renumber=False: the bare `attention_sinks(n_sink, window - 1)` mask at true positions
        (distances to the sinks grow without bound).
    """

    name: ClassVar[str] = "sinks"
    needs_unrotated_keys: ClassVar[bool] = True
    n_sink: int
    window: int
    renumber: bool = True

    def __post_init__(self) -> None:
        check_count("n_sink", self.n_sink, 0)
        check_count("window", self.window, 1)
        if not isinstance(self.renumber, bool):
            raise ValueError(f"renumber must be a bool, got {self.renumber!r}")

    @property
    def renumber_in_cache(self) -> bool:  # type: ignore[override]
        return self.renumber

    def _spec(self, scale):
        return AttentionSpec(mask=attention_sinks(self.n_sink, self.window - 1), scale=scale)

    def attend(self, q, k, v, *, rotary, backend="blockwise", scale=None, layer_idx=None):
        if not self.renumber:
            return super().attend(q, k, v, rotary=rotary, backend=backend, scale=scale)
        from .streaming import streaming_attention

        return streaming_attention(q, k, v, rotary=rotary, n_sink=self.n_sink, window=self.window,
                                   backend=backend, scale=scale)

    def last_query_keys(self, positions):
        # query i = Tk - 1; window keys j > i - w at their positions; sinks j < S outside the
        # window: renumbered, the query at p[c], c = min(i, S + w - 1) (`lcx.methods.streaming`)
        Tk = positions.shape[-1]
        i = Tk - 1
        j = torch.arange(Tk, device=positions.device)
        window = j > i - self.window
        sink = (j < self.n_sink) & ~window
        eff = positions
        if self.renumber:
            shift = positions[..., i:] - positions[..., min(i, self.n_sink + self.window - 1)][..., None]
            eff = torch.where(sink, positions + shift, positions)
        return LastQueryKeys((window | sink).expand_as(positions), eff)

    def decode_rule(self):
        # renumbered: a sink keeps its slot index (= its position, p < S) and the query sits at
        # slot min(p_q, S + w - 1), the last slot of the full compressed cache
        last = self.n_sink + self.window - 1
        query = (lambda p: torch.clamp(p, max=last)) if self.renumber else (lambda p: p)
        return DecodeRule(window=self.window, side=self.n_sink, side_key=lambda p: p, side_query=query)

    @property
    def cache_window(self):
        return (self.n_sink, self.window)


# (their modules import AttentionMethod from here)
from .self_extend import SelfExtend  # noqa: E402
from .swat import SWAT  # noqa: E402

# name -> class. The only list of attention methods; tests iterate over it.
ATTENTION_METHODS: dict[str, type[AttentionMethod]] = {
    cls.name: cls for cls in (Causal, LMInfinite, SlidingWindow, Sinks, SelfExtend, SWAT)
}
# the methods whose caches hold unrotated keys (read from the classes; not a second list)
UNROTATED_METHODS: tuple[str, ...] = tuple(n for n, cls in ATTENTION_METHODS.items() if cls.needs_unrotated_keys)


def causal() -> Causal:
    return Causal()


def lm_infinite(n_global: int, n_local: int, limit_distance: int | None = None, *, top_k: int = 0,
                top_k_from_layer: int = 4, top_k_to_layer: int | None = None,
                top_k_insert_at: int | None = None) -> LMInfinite:
    """LM-Infinite; `top_k > 0` adds the paper's top-k middle keys (see `LMInfinite`)."""
    return LMInfinite(n_global, n_local, limit_distance, top_k, top_k_from_layer, top_k_to_layer, top_k_insert_at)


def sliding_window(*, window: int) -> SlidingWindow:
    """`window` keys, the query included (keyword-only: the mask `lcx.masks.sliding_window(left=...)`
    counts the keys before the query)."""
    return SlidingWindow(window)


def sinks(n_sink: int, window: int, renumber: bool = True) -> Sinks:
    return Sinks(n_sink, window, renumber)


def self_extend(group_size: int, window: int) -> SelfExtend:
    return SelfExtend(group_size, window)


def swat(window: int, alibi_slopes=None) -> SWAT:
    """SWAT over `window` keys, the query included; slopes default to the balanced schedule."""
    return SWAT(window, alibi_slopes)


def method_from_dict(d: Mapping[str, Any] | AttentionMethod) -> AttentionMethod:
    """`{"type": "lm_infinite", "n_global": 16, "n_local": 256}` -> method; unknown keys raise."""
    if isinstance(d, AttentionMethod):
        return d
    d = dict(d)
    kind = d.pop("type", None)
    if kind not in ATTENTION_METHODS:
        raise ValueError(f"attention method type {kind!r} is not known; known: {sorted(ATTENTION_METHODS)}")
    cls = ATTENTION_METHODS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"attention method {kind!r}: unknown key(s) {unknown}; accepted: {sorted(names)}")
    missing = sorted(f.name for f in dataclasses.fields(cls)
                     if f.name not in d and f.default is dataclasses.MISSING)
    if missing:
        raise ValueError(f"attention method {kind!r}: missing key(s) {missing}")
    return cls(**d)
