"""`lcx.MethodConfig`: what lcx applies to a model, as one frozen, validated value.

A method config is a RoPE spec (`lcx.rope.PartialRopeSpec`: HF keys, possibly partial: unset keys come from
the model) plus an attention method (any of the registry `lcx.methods.ATTENTION_METHODS`)
plus the `lcx.attention` backends of the attention method's calls. Every entry point takes it
in the same formats:

    nested dict / JSON (the canonical form; `lcx serve --methods`, EngineConfig, vLLM hf_overrides)
        {"rope": {"rope_type": "yarn", "factor": 4},
         "attention": {"type": "lm_infinite", "n_global": 10, "n_local": 256},
         "backend": "flash"}
    flat HF-style rope dict (RoPE only)          {"rope_type": "yarn", "factor": 4}
    flat key=value (lm-eval `--model_args`)      rope_type=yarn,factor=4,attention=lm_infinite,
                                                 n_global=10,n_local=256,attn_backend=flash
    CLI flags (`add_method_arguments`)           --rope yarn --factor 4 --attention lm_infinite
                                                 --n-global 10 --n-local 256 --attn-backend flash

    cfg = lcx.MethodConfig.from_dict({"rope": {"rope_type": "yarn", "factor": 4}})
    with lcx.patched(model, cfg):           # or cfg.apply(model) as a context manager
        logits = model(ids).logits
    cfg.to_dict() == MethodConfig.from_flat(cfg.to_flat()).to_dict()   # formats round-trip

`backend=None` means the default of `lcx.hf.attention_patch.patch_attention` (`blockwise`, which also
trains); inference front ends ask for `INFERENCE_BACKEND` (`flash`, the fastest exact CPU route)
through `with_default_backend` (lm-eval's `lcx` model, `lcx eval ppl`, `lcx report`), which
leaves it out for a method flash cannot run (SWAT's sigmoid).

A model trained with an attention method (SWAT) records it in its HF config in this format's
attention form, `{"type": "swat", "window": 128, ..., "backend": "blockwise"}`
(`lcx.hf.recorded`), and runs it as loaded; an empty MethodConfig leaves it as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from .rope import PartialRopeSpec, RopeSpec
from .rope.spec import IGNORED_HF_KEYS

NESTED_KEYS = ("rope", "attention", "backend", "decode_backend", "layers")
# The attention backend inference front ends default to (lm-eval's `lcx` model, `lcx eval ppl`,
# `lcx report`): torch's fused flash kernels composed into the method's mask, the fastest exact
# route on CPU; forward only, so training keeps `lcx.methods`' default (`blockwise`).
INFERENCE_BACKEND = "flash"
# flat (lm-eval) names of the backend fields and of `layers`
FLAT_BACKEND_KEYS = {"attn_backend": "backend", "attn_decode_backend": "decode_backend", "attn_layers": "layers"}
ROPE_KEYS = frozenset(f.name for f in dataclasses.fields(RopeSpec))
# what a flat HF-style rope dict may hold besides RopeSpec's keys (legacy `type`, model keys)
FLAT_ROPE_KEYS = ROPE_KEYS | {"type"} | IGNORED_HF_KEYS


def _attention_classes() -> dict[str, type]:
    from .methods.registry import ATTENTION_METHODS

    return ATTENTION_METHODS


def attention_keys(name: str) -> frozenset[str]:
    """The parameter names of attention method `name` (its dataclass fields)."""
    return frozenset(f.name for f in dataclasses.fields(_attention_classes()[name]))


def _check_backend(field: str, value: Any) -> None:
    if value is None:
        return
    from .attention import BACKENDS

    if value not in BACKENDS:
        raise ValueError(f"{field}={value!r} is not an lcx.attention backend; known: {sorted(BACKENDS)}")


@dataclass(frozen=True)
class MethodConfig:
    """RoPE spec + attention method + attention backends; see the module docstring.

    rope: a RoPE spec dict (HF key names) or a RopeSpec, kept as an `lcx.rope.PartialRopeSpec`:
        checked here, possibly partial (`{"rope_type": "yarn", "factor": 4}` means 4x the context
        of whatever model it is applied to), resolved against the model once, in `apply`
        (`rope_spec(model_config)` for the same resolution without a model). None: the model's own RoPE.
    attention: an `lcx.methods` method or its dict (`{"type": "sinks", "n_sink": 4, ...}`).
        None: the model's own attention.
    backend / decode_backend: `lcx.attention` backends of the attention method's calls (all
        backends compute the same thing; a speed choice). None: `lcx.methods`' default.
    layers: on a hybrid local/global model (Gemma 3), "global" runs the attention method on the
        full-attention layers (the sliding layers keep their own window), "all" on every layer
        (`lcx.hf.attention_patch.patch_attention`). None: "global". No effect on models whose
        layers are all alike.
    """

    rope: PartialRopeSpec | None = None  # the (partial) spec as given; `rope_spec(model)` resolves it
    attention: Any = None  # lcx.methods.AttentionMethod | None
    backend: str | None = None
    decode_backend: str | None = None
    layers: str | None = None

    def __post_init__(self) -> None:
        if self.rope is not None:
            if not isinstance(self.rope, PartialRopeSpec):
                object.__setattr__(self, "rope", PartialRopeSpec(self.rope))
        if self.attention is not None:
            from .methods import AttentionMethod, method_from_dict

            if not isinstance(self.attention, (Mapping, AttentionMethod)):
                raise ValueError(f"attention must be an attention method dict, got {self.attention!r}")
            object.__setattr__(self, "attention", method_from_dict(self.attention))
        _check_backend("backend", self.backend)
        _check_backend("decode_backend", self.decode_backend)
        if self.attention is None and (self.backend or self.decode_backend):
            raise ValueError("an attention backend was given without an attention method")
        if self.layers is not None:
            from .hf.attention_patch import LAYERS

            if self.layers not in LAYERS:
                raise ValueError(f"layers={self.layers!r}; expected one of {list(LAYERS)}")
            if self.attention is None:
                raise ValueError("layers was given without an attention method")

    # ------------------------------------------------------------------ formats
    @classmethod
    def from_dict(cls, d: "Mapping[str, Any] | MethodConfig | RopeSpec | None") -> "MethodConfig":
        """Nested `{"rope": ..., "attention": ..., "backend": ..., "decode_backend": ...}` or a
        flat HF-style rope dict (`{"rope_type": "yarn", "factor": 4}`); unknown keys raise
        (the backends are top-level keys, never inside the attention dict)."""
        if d is None:
            return cls()
        if isinstance(d, MethodConfig):
            return d
        if isinstance(d, RopeSpec):
            return cls(rope=d)
        if not isinstance(d, Mapping):
            raise ValueError(f"a method config must be a mapping, got {type(d).__name__}")
        d = dict(d)
        if d and not set(d) & set(NESTED_KEYS) and set(d) <= FLAT_ROPE_KEYS:
            return cls(rope=d)  # a flat HF-style rope dict
        unknown = sorted(set(d) - set(NESTED_KEYS))
        if unknown:
            hint = " (RoPE keys go under 'rope')" if set(unknown) & ROPE_KEYS else ""
            raise ValueError(f"unknown method config key(s) {unknown}{hint}; accepted: {list(NESTED_KEYS)}")
        attention = d.get("attention")
        inner = sorted(set(attention) & {"backend", "decode_backend"}) if isinstance(attention, Mapping) else []
        if inner:
            raise ValueError(f"{', '.join(inner)} inside 'attention': the backends are keys of the method config, "
                             f"beside 'attention' ({{\"attention\": {{...}}, \"{inner[0]}\": ...}})")
        return cls(rope=d.get("rope"), attention=attention, backend=d.get("backend"),
                   decode_backend=d.get("decode_backend"), layers=d.get("layers"))

    @classmethod
    def from_json(cls, text: str) -> "MethodConfig":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"method config is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """The nested form, None fields left out (`{}` for the model as loaded)."""
        out: dict[str, Any] = {}
        if self.rope is not None:
            out["rope"] = self.rope.to_dict()
        if self.attention is not None:
            out["attention"] = self.attention.to_dict()
        for key in ("backend", "decode_backend", "layers"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @staticmethod
    def nest_flat(kwargs: "Mapping[str, Any] | str") -> tuple[dict[str, Any], dict[str, Any]]:
        """lm-eval style flat keys -> (the nested dict of the method keys, the other keys), nothing
        validated yet (so a caller can first refuse keys it does not know).

        RoPE keys (`rope_type`, `factor`, ...), `attention=<name>` plus that method's keys,
        `attn_backend`, `attn_decode_backend`, `attn_layers`. A string is parsed as `k=v,k=v` (values as JSON
        where they parse: numbers, booleans, lists `[1,2]`)."""
        kw = parse_flat(kwargs) if isinstance(kwargs, str) else dict(kwargs)
        out: dict[str, Any] = {}
        rope = {k: kw.pop(k) for k in list(kw) if k in ROPE_KEYS}
        if rope:
            out["rope"] = rope
        name = kw.pop("attention", None)
        if name is not None:
            classes = _attention_classes()
            if name not in classes:
                raise ValueError(f"attention={name!r} is not known; known: {sorted(classes)}")
            out["attention"] = {"type": name, **{k: kw.pop(k) for k in list(kw) if k in attention_keys(name)}}
        out.update({field: kw.pop(flat) for flat, field in FLAT_BACKEND_KEYS.items() if flat in kw})
        return out, kw

    @classmethod
    def split_flat(cls, kwargs: "Mapping[str, Any] | str") -> tuple["MethodConfig", dict[str, Any]]:
        """lm-eval style flat keys -> (config, the keys that are not method keys); see `nest_flat`."""
        d, rest = cls.nest_flat(kwargs)
        return cls.from_dict(d), rest

    @classmethod
    def from_flat(cls, kwargs: "Mapping[str, Any] | str") -> "MethodConfig":
        """Like `split_flat`, but every key must be a method key."""
        cfg, rest = cls.split_flat(kwargs)
        if rest:
            raise ValueError(f"unknown method key(s) {sorted(rest)}; accepted: RoPE keys, attention=<name> "
                             f"and its keys, {sorted(FLAT_BACKEND_KEYS)}")
        return cfg

    def to_flat(self) -> dict[str, Any]:
        """The flat form (`from_flat(cfg.to_flat()) == cfg`)."""
        out: dict[str, Any] = self.rope.to_dict() if self.rope is not None else {}
        if self.attention is not None:
            a = self.attention.to_dict()
            out["attention"] = a.pop("type")
            out.update({k: v for k, v in a.items() if v is not None})
        for flat, field in FLAT_BACKEND_KEYS.items():
            if getattr(self, field) is not None:
                out[flat] = getattr(self, field)
        return out

    def to_model_args(self) -> str:
        """`--model_args` text for lm-eval (`pretrained=...` not included)."""
        return ",".join(f"{k}={json.dumps(list(v)) if isinstance(v, (list, tuple)) else v}"
                        for k, v in self.to_flat().items())

    # ------------------------------------------------------------------ derived values
    def with_default_backend(self, backend: str | None) -> "MethodConfig":
        """This config with `backend` filled in when it has an attention method, none is set, and
        the method can run on it (`AttentionMethod.supports`): a default the method cannot take
        (SWAT's sigmoid on the softmax-only `flash`) is left out, so `lcx.methods`' default
        (`blockwise`) runs it. A backend asked for explicitly is never replaced."""
        if self.attention is None or self.backend is not None or backend is None:
            return self
        if self.attention.supports(backend) is not None:
            return self
        return dataclasses.replace(self, backend=backend)

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def rope_spec(self, model_config: Any) -> RopeSpec | None:
        """The RoPE spec resolved against a model's config (`PartialRopeSpec.resolve`), or None."""
        return None if self.rope is None else self.rope.resolve(model_config)

    def context_len(self, model_config: Any) -> int | None:
        """The context this config extends a model to (`lengths(model_config).extended`): L x
        factor for a RoPE spec with a factor, then as far as an attention method that lengthens
        the context reaches (Self-Extend); None when nothing here changes the model's length."""
        return self.lengths(model_config).extended

    def lengths(self, model_config: Any) -> Any:
        """The context lengths this config implies for the model of `model_config` (an HF config),
        without a model: the same computation as `apply`'s record (`Applied.lengths`), for a
        front end that has only the config (`lcx serve --engine vllm`, the vLLM plugin)."""
        from .hf.applied import context_lengths

        return context_lengths(self.attention, self.rope_spec(model_config), model_config)

    @property
    def kv_window(self) -> tuple[int, int] | None:
        """(n_first, n_recent) of a bounded KV cache that reproduces the attention method
        exactly, or None when every key must be kept (no method, or an unbounded one)."""
        if self.attention is None:
            return None
        try:
            self.attention.check_bounded()
        except ValueError:
            return None
        return self.attention.cache_window

    def identity_up_to(self, model_config: Any) -> float:
        """A sequence length T (prompt and answer together) up to which this config computes
        exactly what the model as loaded computes, on the model of `model_config`; not necessarily
        the longest such T. `math.inf` for the identity; with an attention method at most its
        `causal_up_to()`; dynamic NTK on a model whose own RoPE is unscaled (the same theta) is
        unscaled up to its original context, so at most that; any other RoPE spec changes the
        basis at every length (0). `lcx report` takes vanilla's RULER answers for a cell whose
        prompts all fit this (`lcx.report.ruler.vanilla_equivalent`)."""
        import math

        bound = math.inf
        if self.rope is not None:
            from .rope.spec import model_rope_parameters

            spec = self.rope_spec(model_config)
            own = model_rope_parameters(model_config)  # (the global layers' on a hybrid model)
            if (spec.rope_type != "dynamic" or own.get("rope_type", "default") != "default"
                    or float(own.get("rope_theta", getattr(model_config, "rope_theta", -1.0))) != spec.rope_theta):
                return 0
            bound = spec.original_max_position_embeddings
        if self.attention is not None:
            bound = min(bound, self.attention.causal_up_to())
        return bound

    @property
    def is_identity(self) -> bool:
        """True when applying this config leaves the model as loaded."""
        return self.rope is None and self.attention is None

    def describe(self) -> str:
        parts = [f"rope={self.rope.describe()}" if self.rope is not None else "",
                 f"attention={self.attention.describe()}" if self.attention is not None else "",
                 f"backend={self.backend}" if self.backend else "",
                 f"decode_backend={self.decode_backend}" if self.decode_backend else "",
                 f"layers={self.layers}" if self.layers else ""]
        return ", ".join(p for p in parts if p) or "the model as loaded"

    # ------------------------------------------------------------------ applying
    def apply(self, model: Any) -> Any:
        """Patch `model` in place (RoPE, then attention) and return what was done: an `Applied`
        record (the resolved RoPE spec, the context lengths, what each layer runs, its window and
        RoPE basis, the backends) that front ends read instead of reading the model back. Its
        `restore()` (or leaving it as a context manager) puts back what the model ran before.

        The RoPE spec is resolved here, once, against the model as loaded
        (`lcx.hf.rope_patch.resolve_rope`: on Gemma 3 its global layers' RoPE; L from
        `lcx.rope.spec.model_rope_parameters`, the one place a model's L is read)."""
        from .hf.applied import applied_record, context_lengths
        from .hf.attention_patch import DEFAULT_BACKEND, current_patch, patch_attention
        from .hf.rope_patch import current_spec, loaded_config, patch_rope, resolve_rope

        spec = resolve_rope(model, self.rope) if self.rope is not None else None
        undo = (current_spec(model) if spec is not None else None, current_patch(model),
                spec is not None, self.attention is not None)
        lengths = context_lengths(self.attention, spec, loaded_config(model))  # (before patch_rope rewrites it)
        if spec is not None:
            patch_rope(model, spec)
        if self.attention is not None:
            patch_attention(model, self.attention, backend=self.backend or DEFAULT_BACKEND,
                            decode_backend=self.decode_backend, layers=self.layers or "global")
        return applied_record(self, model, spec, lengths, undo)


# ---------------------------------------------------------------------- lcx.patch & co
# The one public patch trio (`lcx.patch`, `lcx.unpatch`, `lcx.patched`): a whole MethodConfig.
# `lcx.hf` has the per-part primitives under their own names (`patch_rope` / `unpatch_rope`,
# `patch_attention` / `unpatch_attention`).
def patch(model: Any, cfg: "MethodConfig | Mapping[str, Any] | RopeSpec") -> Any:
    """Apply any method config (nested dict, flat rope dict, RopeSpec or MethodConfig) in place."""
    MethodConfig.from_dict(cfg).apply(model)
    return model


def unpatch(model: Any) -> Any:
    """Restore the model as loaded: RoPE and attention."""
    from .hf.attention_patch import unpatch_attention
    from .hf.rope_patch import unpatch_rope

    unpatch_attention(model)
    return unpatch_rope(model)


def patched(model: Any, cfg: "MethodConfig | Mapping[str, Any] | RopeSpec | None") -> Any:
    """Context manager: apply on entry (nothing for None), the previous state on exit."""
    return MethodConfig.from_dict(cfg).apply(model)


# ---------------------------------------------------------------------- flat text
def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        low = text.lower()
        return {"true": True, "false": False, "none": None}.get(low, text)


def parse_flat(text: str) -> dict[str, Any]:
    """`"a=1,b=[1,2],c=x"` -> {"a": 1, "b": [1, 2], "c": "x"} (commas inside brackets kept)."""
    out: dict[str, Any] = {}
    depth, item = 0, ""
    items = []
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += ch
    items.append(item)
    for it in (i.strip() for i in items):
        if not it:
            continue
        if "=" not in it:
            raise ValueError(f"expected key=value, got {it!r}")
        k, v = it.split("=", 1)
        k = k.strip()
        if k in out:
            raise ValueError(f"key {k!r} given twice")
        out[k] = _value(v.strip())
    return out


# ---------------------------------------------------------------------- CLI flags
def add_method_arguments(parser: argparse.ArgumentParser, *, json_flag: str | None = "--methods") -> None:
    """The method flags every lcx command shares: the RoPE flags (`--rope TYPE`, `--factor`, ...),
    `--attention TYPE` with one flag per attention-method parameter (`--n-global`, `--window`,
    ...), `--attn-backend`, `--attn-decode-backend`, and (json_flag) a whole config as JSON."""
    from .attention import BACKENDS
    from .rope.cli import add_spec_arguments

    add_spec_arguments(parser, default_type=None)
    classes = _attention_classes()
    g = parser.add_argument_group(
        "attention method", "an lcx.methods method and its parameters; composes with any RoPE spec")
    g.add_argument("--attention", default=None, choices=sorted(classes), metavar="TYPE",
                   help=f"attention method: {', '.join(sorted(classes))} (default: the model's own)")
    seen: set[str] = set()
    for name, cls in classes.items():
        for f in dataclasses.fields(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            users = [n for n, c in classes.items() if f.name in {x.name for x in dataclasses.fields(c)}]
            g.add_argument(f"--{f.name.replace('_', '-')}", dest=f"attn__{f.name}", type=_value, default=None,
                           metavar="V", help=f"`{f.name}` of {', '.join(users)}")
    g.add_argument("--attn-backend", default=None, choices=sorted(BACKENDS), metavar="NAME",
                   help=f"lcx.attention backend of the method's calls: {', '.join(sorted(BACKENDS))}")
    g.add_argument("--attn-decode-backend", default=None, choices=sorted(BACKENDS), metavar="NAME",
                   help="backend of single-token (decode) calls (default: --attn-backend)")
    g.add_argument("--attn-layers", default=None, choices=("global", "all"),
                   help="on a hybrid local/global model (Gemma 3): the method on the full-attention layers "
                        "only (global, the default; the sliding layers keep their own window) or on all")
    if json_flag:
        parser.add_argument(json_flag, dest="method_json", default=None, metavar="JSON",
                            help='a whole method config as JSON, e.g. \'{"rope": {"rope_type": "yarn", "factor": 4}, '
                                 '"attention": {"type": "lm_infinite", "n_global": 10, "n_local": 256}}\'; '
                                 "the flags add to it (a part given both ways is refused)")


def method_config_from_args(args: argparse.Namespace) -> MethodConfig:
    """The config the flags of `add_method_arguments` describe: the JSON of `--methods` (unknown
    keys raise), with the flags' parts added to it. A part given both as flags and in the JSON
    is refused."""
    from .rope.cli import spec_dict_from_args

    cfg = MethodConfig()
    text = getattr(args, "method_json", None)
    if text:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--methods is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"--methods must be a JSON object, got {text!r}")
        cfg = MethodConfig.from_dict(d)
    parts: dict[str, Any] = {}
    rope = spec_dict_from_args(args)
    if rope is not None:
        if cfg.rope is not None:
            raise ValueError("a RoPE spec was given both with --rope flags and in --methods; give one")
        parts["rope"] = rope
    params = {k[len("attn__"):]: v for k, v in vars(args).items() if k.startswith("attn__") and v is not None}
    if args.attention is not None:
        if cfg.attention is not None:
            raise ValueError("an attention method was given both with --attention and in --methods; give one")
        unknown = sorted(set(params) - attention_keys(args.attention))
        if unknown:
            raise ValueError(f"--attention {args.attention} takes no "
                             f"{', '.join('--' + u.replace('_', '-') for u in unknown)}")
        parts["attention"] = {"type": args.attention, **params}
    elif params:
        raise ValueError(f"attention parameters {sorted(params)} given without --attention TYPE")
    for flag, field in FLAT_BACKEND_KEYS.items():  # --attn-backend, --attn-decode-backend, --attn-layers
        if getattr(args, flag, None) is not None:
            parts[field] = getattr(args, flag)
    return dataclasses.replace(cfg, **parts) if parts else cfg


def __getattr__(name: str) -> Any:
    # `apply`'s record and its lengths live in the HF adapter (`lcx.hf.applied`), imported lazily:
    # the flags and formats here need no torch
    if name in ("Applied", "ContextLengths"):
        from .hf import applied

        return getattr(applied, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Applied", "ContextLengths", "MethodConfig", "add_method_arguments", "attention_keys",
           "method_config_from_args", "parse_flat", "patch", "patched", "unpatch"]
