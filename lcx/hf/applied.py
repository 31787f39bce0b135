"""The record `lcx.MethodConfig.apply(model)` returns: what it did to the model (`Applied`), and
the context lengths a method config implies (`ContextLengths`, computed once, by
`context_lengths`, for `apply` and for `MethodConfig.lengths` without a model).

    applied = cfg.apply(model)
    applied.rope                 # the RoPE spec resolved against the model (once), or None
    applied.lengths              # ContextLengths(original=L0, model=max_position_embeddings, extended=...)
    applied.layer_methods        # per layer: the method it runs (None: the model's own attention)
    applied.layer_windows        # per layer: (n_first, n_recent) or None (every key)
    applied.bases                # per layer: (inv_freq, attention factor), None if length-dependent
    applied.restore()            # or `with cfg.apply(model):`

The engine (`lcx.engine`), the server's lengths (`lcx.serve.lengths`, through
`MethodConfig.lengths`, the same computation) and the lm-eval model read this record instead of
reading the model back after patching it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..rope import RopeSpec
from ..rope.spec import model_rope_parameters
from .attention_patch import current_patch, layer_methods, loaded_windows, patch_attention, unpatch_attention
from .recorded import recorded_method
from .rope_patch import current_spec, patch_rope, static_rope_bases, unpatch_rope


@dataclass(frozen=True)
class ContextLengths:
    """The context lengths a method config implies for a model (`MethodConfig.lengths`, and the
    record of `MethodConfig.apply`; one computation, `context_lengths`).

    original: L0, the length the model was pretrained at, the L of its RoPE: the resolved spec's
        `original_max_position_embeddings` where its type takes one, else the model's own
        (`lcx.rope.spec.model_rope_parameters`: Phi-3 keeps it in
        `config.original_max_position_embeddings`), else max_position_embeddings.
    model: the model's `max_position_embeddings` as loaded (Phi-3-128k: 131072, its L0 4096).
    extended: the context the config extends the model to (L x factor for a RoPE spec with a
        factor, L the spec's, else max_position_embeddings; then as far as an attention method
        that lengthens the context it is given reaches: Self-Extend); None when nothing in the
        config changes the model's length.
    """

    original: int
    model: int
    extended: int | None

    @property
    def context(self) -> int:
        """The context a front end serves by default: `extended`, else the model's own."""
        return self.extended if self.extended is not None else self.model


def context_lengths(attention: Any, spec: RopeSpec | None, model_config: Any) -> ContextLengths:
    """`ContextLengths` for a model config (`model_config`; in `apply`, the model's as loaded:
    `lcx.hf.rope_patch.loaded_config`), the resolved RoPE spec applied to it (None: none) and the
    attention method (an `lcx.methods` method or None). The one computation of lcx's lengths."""
    model_len = int(model_config.max_position_embeddings)
    own_L = model_rope_parameters(model_config).get("original_max_position_embeddings")
    original = int((spec.original_max_position_embeddings if spec is not None else None) or own_L or model_len)
    context = None
    if spec is not None and spec.factor is not None:
        context = int((spec.original_max_position_embeddings or model_len) * spec.factor)
    if attention is not None:
        reach = attention.context_len(int(context or model_len))
        if reach is not None:
            context = reach
    return ContextLengths(original, model_len, context)


@dataclass(frozen=True)
class Applied:
    """What `MethodConfig.apply` did to a model (frozen), and how to undo it (`restore()`, or leave
    it as a context manager: `with cfg.apply(model) as model:`).

    methods: the config applied, as given. rope: the RoPE spec the model runs, resolved once
        (this config's; else one an earlier `lcx.patch` left; None: the model's own RoPE).
    lengths: `ContextLengths` (L0, the model's max_position_embeddings, the extended context).
    backend / decode_backend / layers: how the attention patch runs (a soft-capping family's calls
        may go to another backend than the one asked for: `lcx.hf.attention_patch`); None unpatched.
    recorded: the attention method the model's config records (`lcx.hf.recorded`: a model trained
        with SWAT) when it runs no patch: it runs that method as loaded.
    layer_methods: per attention layer, the method it runs (None: the model's own attention).
    layer_windows: per layer, (n_first, n_recent): the keys a query sees are among the first
        n_first and the last n_recent (its method's `cache_window`; a layer with its own sliding
        window w as loaded: (0, w)); None: every key.
    bases: per layer, the RoPE basis `(inv_freq [r/2] float64, attention_factor)` it rotates with,
        or None when the basis changes with the sequence length (dynamic NTK, longrope).
    """

    model: Any = dataclasses.field(repr=False, compare=False)
    methods: Any  # lcx.MethodConfig
    rope: RopeSpec | None
    lengths: ContextLengths
    backend: str | None
    decode_backend: str | None
    layers: str | None
    recorded: Any
    layer_methods: tuple
    layer_windows: tuple
    bases: tuple | None = dataclasses.field(repr=False, compare=False)
    _undo: list = dataclasses.field(repr=False, compare=False, default_factory=list)

    @property
    def original_len(self) -> int:
        """L0 (`ContextLengths.original`)."""
        return self.lengths.original

    @property
    def context_len(self) -> int:
        """The context served by default (`ContextLengths.context`)."""
        return self.lengths.context

    @property
    def kv_window(self) -> tuple[int, int] | None:
        """(n_first, n_recent) covering every layer's bounded window (a bounded KV cache keeps
        these slots of a row exactly), or None when some layer keeps every key (no method, an
        unbounded one: `AttentionMethod.check_bounded`)."""
        windows = []
        for m, w in zip(self.layer_methods, self.layer_windows):
            if m is None:
                return None
            try:
                m.check_bounded()
            except ValueError:
                return None
            windows.append(w)
        if not windows or any(w is None for w in windows):
            return None
        return max(w[0] for w in windows), max(w[1] for w in windows)

    def restore(self) -> Any:
        if not self._undo:
            return self.model
        prev_rope, prev_attention, rope, attention = self._undo.pop()
        if attention:
            if prev_attention is None:
                unpatch_attention(self.model)
            else:
                p = prev_attention
                patch_attention(self.model, p.method, backend=p.backend, decode_backend=p.decode_backend,
                                layers=p.layers)
        if rope:
            if prev_rope is None:
                unpatch_rope(self.model)
            else:
                patch_rope(self.model, prev_rope)
        return self.model

    def __enter__(self) -> Any:
        return self.model

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def applied_record(cfg: Any, model: Any, spec: RopeSpec | None, lengths: ContextLengths, undo: tuple) -> Applied:
    """`Applied` for a model `MethodConfig.apply` (`cfg`) just patched, from what the patches hold
    now; `undo`: (RoPE spec before, attention patch before, RoPE patched, attention patched)."""
    patch = current_patch(model)
    recorded = recorded_method(model) if patch is None else None
    loaded = loaded_windows(model)
    if patch is not None:
        per_layer = tuple(layer_methods(model))
    else:
        per_layer = tuple(recorded.attention if recorded is not None else None for _ in loaded)
    windows = tuple(m.cache_window if m is not None else (None if w is None else (0, w))
                    for m, w in zip(per_layer, loaded))
    bases = static_rope_bases(model)
    return Applied(model, cfg, spec if spec is not None else current_spec(model), lengths,
                   getattr(patch, "backend", None), getattr(patch, "decode_backend", None),
                   getattr(patch, "layers", None), recorded, per_layer, windows,
                   tuple(bases) if bases is not None else None, [undo])


__all__ = ["Applied", "ContextLengths", "applied_record", "context_lengths"]
