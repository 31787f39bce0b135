"""What every attention method is: the calling convention, the decode rule, the bounded cache.

A method is a frozen, validated dataclass subclassing `AttentionMethod`, one module each
(`lcx.methods.<name>`), listed once in `lcx.methods.registry.ATTENTION_METHODS`. Every method
is called the same way, on UNROTATED q/k (so methods that change positions, LM-Infinite's
distance cap and StreamingLLM's renumbering, can):

    method.attend(q, k, v, rotary=Rotary(inv_freq, key_positions, attention_factor),
                  backend="blockwise", scale=None, layer_idx=None, softcap=None) -> out [B, Tq, H, Dv]

q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]`: the queries are the last Tq of
the Tk keys (`lcx.masks` window convention), `rotary.positions` the keys' RoPE positions.

What a subclass writes
----------------------
- `name` (its registry key) and its parameters as dataclass fields, validated in
  `__post_init__` (bad values raise `ValueError` naming the parameter);
- `_spec` (a method that is one `lcx.attention` call) or `attend` (several calls, e.g.
  Self-Extend's two passes merged by log-sum-exp);
- optionally the fast paths, each tested equal to `attend`: `last_query_keys` / `query_keys`
  (the queries as plain softmax over keys rotated to method-given positions: `lcx.methods.
  last_query`, the C++ CPU kernel), `decode_rule` (`lcx.engine`'s cache of keys rotated once),
  `cache_window` (a bounded cache);
- `examples`: small parameters from which every test grid over methods is generated
  (`lcx.methods.registry.examples`): reference vs backends, last query, decode rule, C++
  kernel, engine, bounded cache. A grid takes the examples that have its fast path.

Decode rule (`AttentionMethod.decode_rule`, run by `lcx.engine`): how the last query of a step
sees a cache whose keys were rotated ONCE, when they entered it. Every softmax method is one
softmax over two branches (each method's `decode_rule` says what its branches are):

    window branch  the last `window` keys (the query's own included; None: every key), at their
                   true positions: stored rotated at p_k, the query rotated at p_q.
    side branch    the older keys p_k <= p_q - window among the first `side` positions (None:
                   all of them), at moved positions: stored rotated at `side_key(p_k)`, scored
                   with the query rotated at `side_query(p_q)`.

The relative position of a side key is side_key(p_k) - side_query(p_q), so only the query is
rotated per step (once more, for the side branch); cached keys never are. E.g. LM-Infinite:
window L; side G, side_key 0, side_query min(limit, p_q) (the distance cap). A method that is
not a softmax over rotated keys (SWAT's sigmoid with a distance bias) has no rule (None).

Positions are a token's index in its sequence (0, 1, ...); the rule equals `last_query_keys` on
a contiguous history (tests/methods/test_decode_rule.py) and so `attend`. `lcx.methods.plan`
states which branch a key is in (`branches`) and a step's plan (`step_plan`: keys, visibility,
re-rotations, top-k candidates), once, for every cache that runs the rule.

Bounded cache (`lcx.hf.bounded_cache`): a method that only ever looks at the first
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

from lcx.attention import AttentionSpec, Rotary, attention


@dataclass(frozen=True)
class AttentionMethod:
    """Base class; see the module docstring. Subclasses set `name` and implement `_spec`."""

    name: ClassVar[str] = ""
    renumber_in_cache: ClassVar[bool] = False
    # True when a query-key distance is not the true one (LM-Infinite's cap, StreamingLLM's
    # renumbering): the method rotates q/k itself, so a cache must keep keys unrotated.
    needs_unrotated_keys: ClassVar[bool] = False
    # Small parameters, one dict per case, from which every test grid over methods is generated
    # (`lcx.methods.registry.examples`): the plain case first, then one per branch of the
    # method's code (a cap, a bare variant, a per-layer switch, ...). The grids run 4 query
    # heads, 2 layers (layer_idx 0 and 1) and sequences of 1 to ~70 keys: windows of a few keys
    # run far past them.
    examples: ClassVar[tuple[Mapping[str, Any], ...]] = ()

    @classmethod
    def example_methods(cls) -> tuple["AttentionMethod", ...]:
        """`examples` as methods."""
        return tuple(cls(**params) for params in cls.examples)

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
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Unrotated q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`, v -> out `[B, Tq, H, Dv]`.
        `layer_idx`: the model layer of the call, for methods that differ per layer (LM-Infinite's
        top-k middle keys); the others ignore it. `softcap`: the model's attention-logit
        soft-capping (Gemma 2; `lcx.attention.AttentionSpec.softcap`), on every logit the method
        forms."""
        return attention(q, k, v, spec_for(self, scale, softcap), backend=backend, rotary=rotary)

    def attention_spec(self, scale: float | None = None) -> AttentionSpec:
        """The `lcx.attention` spec of this method (for methods that are one attention call)."""
        return spec_for(self, scale)

    def _spec(self, scale: float | None) -> AttentionSpec:
        raise NotImplementedError

    def supports(self, backend: str, *, softcap: float | None = None) -> str | None:
        """Why the `lcx.attention` backend `backend` cannot run this method's calls, judged on the
        method alone (a call's tensors may still rule it out; the dispatcher then raises naming
        why), or None if it can. E.g. SWAT's sigmoid on the softmax-only `flash` backend.
        `softcap`: the calls soft-capped so (a model's attention-logit soft-capping)."""
        from lcx.attention import BACKENDS

        if backend not in BACKENDS:
            return f"{backend!r} is not an lcx.attention backend; known: {sorted(BACKENDS)}"
        specs = self._call_specs()
        if softcap is not None:
            specs = tuple(dataclasses.replace(s, softcap=softcap) for s in specs)
        return next((r for spec in specs if (r := BACKENDS[backend].supports(spec, None))), None)

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

    @property
    def call_dependence(self) -> str | None:
        """Why a query's output may depend on more than the keys up to it (on the length of the
        call it is in), or None. None is what makes a prompt's prefix reusable (`lcx.engine`'s
        prefix cache) and a prompt cuttable into calls (chunked prefill): the rows of a prefix,
        hence the next layer's keys, are then the same whatever follows them. E.g. LM-Infinite
        with a cap past its window: the cap min(limit_distance, Tk - 1) follows the call's Tk."""
        return None

    @property
    def last_query_extra(self) -> bool:
        """True when the LAST query of each call sees more than the others (LM-Infinite's top-k
        middle keys): where a prompt is cut into calls then decides which rows get it, so such a
        prompt is prefilled in one call (a cached prefix still may be reused: its rows were not
        the last of their call)."""
        return False

    def decode_rule(self) -> "DecodeRule | None":
        """How a decode step's query sees a cache of keys rotated once (see the module docstring),
        or None where the method is not softmax over rotated keys (SWAT): `lcx.engine` then
        decodes through `attend` over unrotated keys."""
        return None

    def causal_up_to(self) -> float:
        """A sequence length T (keys, the query's own included) up to which this method is exactly
        full causal attention: on every sequence of at most T tokens each query sees every earlier
        key at its true distance in one softmax, so the method's output is the unpatched model's.
        Not necessarily the longest such length; `math.inf`: at every length; 0 (the default): at
        none known (e.g. SWAT's sigmoid is no softmax even when it sees every key). `lcx report`
        takes vanilla's RULER answers for a cell where every prompt with its answer is this short
        (`lcx.report.ruler.vanilla_equivalent`); tests/methods/test_causal_up_to.py checks every
        registered example against `Causal` at this length."""
        return 0

    def context_len(self, trained: int) -> int | None:
        """The sequence length this method extends a model to whose attention was trained on
        `trained` tokens (its context, after any RoPE scaling): every query-key distance it
        scores at is one the model saw. None (the default): the method does not lengthen the
        model's context this way (a bounded method, `cache_window`, serves what memory allows
        instead: `lcx.serve.lengths`). `lcx.MethodConfig.context_len` reads it: the engine's and
        both servers' default max_model_len."""
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
        from .plan import branches  # the rule's branches, stated once (`lcx.methods.plan`)

        p = torch.arange(n_keys, dtype=torch.float64)
        pq = p[-1:]
        window, side, _ = branches(self, p, pq)
        rel = p - pq
        if self.has_side:
            rel = torch.where(side, self.side_key(p) - self.side_query(pq), rel)
        return window | side, rel


@functools.lru_cache(maxsize=256)
def spec_for(method: AttentionMethod, scale: float | None, softcap: float | None = None) -> AttentionSpec:
    spec = method._spec(scale)
    return spec if softcap is None else dataclasses.replace(spec, softcap=softcap)
