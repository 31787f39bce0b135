"""`lcx.presets`: the one table of named experiment presets.

A preset turns a model's training context L0 and a length factor s (target length / L0) into a
`MethodConfig`, so "yarn" means the same thing in `lcx report`, `lcx demo`, lm-eval scripts
and every benchmark:

    >>> from lcx import presets
    >>> presets.config("yarn", L0=256, factor=8).to_dict()
    {'rope': {'rope_type': 'yarn', 'factor': 8}}
    >>> presets.config("lm_infinite", L0=256, factor=8).to_dict()
    {'attention': {'type': 'lm_infinite', 'n_global': 10, 'n_local': 256}}

Settings (papers' defaults where they give one; see ../shared/METHODS.md):
    vanilla           the model as loaded
    linear, ntk,      RoPE scaling with factor s (position interpolation, static NTK-aware,
    dynamic, yarn,    dynamic NTK, YaRN with beta_fast 32 / beta_slow 1, Llama-3.1 banding);
    llama3            the original length is the model's
    truncate          Giraffe truncation at the model's length
    lm_infinite       LM-Infinite: 10 global keys + a window of L0 keys, global distance capped at L0
    lm_infinite_topk  LM-Infinite as its authors ran it for passkey and Qasper (README:
                      `--top_k_attention 5 --top_k_from_layer 4`): the above + the last query of
                      each call also sees its top 5 middle keys, scored at distance L0 / 2, in
                      layers from n_layers / 8 on (rounded, >= 1). Scaling: Llama-2 (L0 = 4096,
                      32 layers) gives the official insert_at 2048 and from_layer 4; SmolLM2
                      (8192, 30 layers) 4096 and 4; a 4-layer tiny model 1 (so top-k runs in 3
                      of its 4 layers, not in none). Without a layer count, from_layer is 4.
    sliding_window    a window of L0 keys
    sinks             StreamingLLM: 4 sink keys + a window of L0 - 4 keys (L0 keys in all)
    lm_infinite+yarn  the two above together (the combination LM-Infinite suggests for RoPE
                      models: the window bounds distances, YaRN the frequencies)
    self_extend       Self-Extend: true positions within W = L0 / 4 keys, floor(p / G) beyond,
                      G the smallest group size with (L0 - W) * G + W >= s * L0
    dca               Dual Chunk Attention with ChunkLlama's defaults (`lcx.methods.dca.chunkllama_dca`):
                      chunk_size 3 L0 / 4, local_size L0 / 16 (its first release; rounded down),
                      whatever the length factor (DCA bounds every distance by chunk_size, so the
                      target length does not enter); the model's RoPE as loaded. Not in
                      `lcx report`'s default set (every decode step runs its three passes, no
                      decode rule)
    string            STRING as its authors run it (`lcx.methods.string`): for the target length
                      L = s * L0, shifted offset S = int(0.33 L) and local value W = 128 (below S),
                      plus the official code's constant attention factor 0.1 ln 2 + 1 and, past
                      L0 / 0.67, its Qwen2 recipe's YaRN at factor s (1 - 0.33), both as a YaRN
                      RoPE spec (factor 1 leaves the frequencies alone); not in `lcx report`'s
                      default set. On a model whose own RoPE is scaled already (Llama 3.1's
                      `llama3` bands, Gemma 3's `linear` x8) that RoPE is kept, with its attention
                      factor times 0.1 ln 2 + 1 (the official Llama code's recipe) and no YaRN
    swat              SWAT (sigmoid, sliding window, ALiBi + RoPE; the registry method `swat`):
                      meaningful on a model trained with it, so the preset runs the sibling model
                      its `siblings` names, as loaded (that model's config records the method;
                      `--attention swat --window W` applies it to any model instead)

A preset that cannot run for a model says why (`resolve` returns the reason as a string). A
preset that scales with the model's depth (`depth_scaled`) reads `n_layers` when given.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .method_config import MethodConfig

LM_INFINITE_GLOBAL = 10  # LM-Infinite's n_global (the paper: 10-100 behave alike)
LM_INFINITE_TOP_K = 5  # the paper's passkey / Qasper runs: --top_k_attention 5
LM_INFINITE_TOP_K_FROM = 4  # --top_k_from_layer 4 of Llama-2-7B's 32 layers
SINKS = 4  # StreamingLLM's sink count


@dataclass(frozen=True)
class Preset:
    """name: build(L0, factor) -> MethodConfig (build(L0, factor, n_layers) when `depth_scaled`;
    n_layers None: the model's depth is not known). `siblings`: for methods that need a model trained
    with them, model name -> that model (the preset then runs on the sibling, as loaded: the
    sibling's config records the method, `lcx.hf.recorded`). `in_report`: one of `lcx report`'s
    default methods (`lcx.report.DEFAULT_METHODS`; False: run only when `--presets` names it)."""

    name: str
    build: Callable[..., dict[str, Any]]
    description: str
    siblings: Mapping[str, str] | None = None
    depth_scaled: bool = False
    in_report: bool = True
    model_rope: bool = False  # build(L0, factor, rope): the model's own RoPE parameters (`model_rope`)

    def config(self, L0: int, factor: float, n_layers: int | None = None,
               rope: Mapping[str, Any] | None = None) -> MethodConfig:
        if not isinstance(L0, int) or L0 < 1:
            raise ValueError(f"L0 must be a positive integer, got {L0!r}")
        if not factor >= 1:
            raise ValueError(f"factor must be >= 1, got {factor!r}")
        if n_layers is not None and (isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1):
            raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
        if self.depth_scaled:
            return MethodConfig.from_dict(self.build(L0, factor, n_layers))
        return MethodConfig.from_dict(self.build(L0, factor, rope) if self.model_rope else self.build(L0, factor))


def _rope(rope_type: str) -> Callable[[int, float], dict[str, Any]]:
    return lambda L0, s: {"rope": {"rope_type": rope_type, "factor": s}}


def _lm_infinite(L0: int) -> dict[str, Any]:
    return {"type": "lm_infinite", "n_global": LM_INFINITE_GLOBAL, "n_local": L0}


def _lm_infinite_topk(L0: int, s: float, n_layers: int | None) -> dict[str, Any]:
    """LM-Infinite + top-k middle keys, the paper's settings scaled to the model (module doc)."""
    first = LM_INFINITE_TOP_K_FROM if n_layers is None else max(1, round(n_layers * LM_INFINITE_TOP_K_FROM / 32))
    return {"attention": {**_lm_infinite(L0), "top_k": LM_INFINITE_TOP_K, "top_k_from_layer": first,
                          "top_k_insert_at": L0 // 2}}


def _self_extend(L0: int, s: float) -> dict[str, Any]:
    """Self-Extend for s x L0: a neighbour window of L0 / 4 and the smallest group size whose
    reach (L0 - W) * G + W covers s * L0 (the paper keeps W well inside L0)."""
    W = max(1, L0 // 4)
    G = max(1, math.ceil((s * L0 - W) / max(1, L0 - W)))
    return {"attention": {"type": "self_extend", "group_size": G, "window": W}}


def _dca(L0: int, s: float) -> dict[str, Any]:
    """DCA with ChunkLlama's defaults for a model trained on L0 tokens (module docstring); the
    length factor does not enter (no distance exceeds chunk_size at any length). L0 < 16 has no
    local window (L0 // 16 = 0): a ValueError naming it."""
    from .methods.dca import chunkllama_dca

    if L0 < 16:
        raise ValueError(f"dca: ChunkLlama's local_size L0 // 16 needs L0 >= 16, got L0={L0}")
    return {"attention": chunkllama_dca(L0).to_dict()}


def _string(L0: int, s: float, rope: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """STRING for s x L0 as the official scripts set it (see the module docstring); `rope`: the
    model's own RoPE parameters (`model_rope`; None or a plain RoPE: the Qwen2 recipe)."""
    from .methods.string import ATTENTION_FACTOR, SHIFTED_RATIO, STRING
    from .rope import RopeSpec, compute_inv_freq

    method = STRING.for_length(max(2, int(s * L0)))
    own = {k: v for k, v in (rope or {}).items() if v is not None}
    if "type" in own:
        own.setdefault("rope_type", own.pop("type"))
    if own.get("rope_type", "default") == "default":
        factor = max(1.0, round(s * (1 - SHIFTED_RATIO), 6))
        return {"rope": {"rope_type": "yarn", "factor": factor, "attention_factor": ATTENTION_FACTOR},
                "attention": method.to_dict()}
    # A model whose RoPE is scaled already (Llama 3.1's bands, Gemma 3's linear x8): that RoPE is
    # kept, as the official Llama code keeps the model's rotary embedding, times its factor.
    try:
        _, af = compute_inv_freq(RopeSpec.from_dict({**own, "rope_theta": own.get("rope_theta", 10_000.0)}), 64)
    except ValueError as e:
        raise ValueError(f"string: the model's own RoPE {own} does not resolve: {e}") from None
    return {"rope": {**own, "attention_factor": af * ATTENTION_FACTOR}, "attention": method.to_dict()}


def model_rope(model: str) -> dict[str, Any]:
    """A model's own RoPE parameters from its config.json, without loading it (`rope_parameters`,
    or an older config's `rope_scaling` + `rope_theta`; the global layers' entry of a model with
    RoPE per layer type: `lcx.rope.spec.model_rope_parameters`)."""
    import json
    from types import SimpleNamespace

    from .models import hf_directory
    from .rope.spec import model_rope_parameters

    d = json.loads((hf_directory(model) / "config.json").read_text())
    ns = SimpleNamespace(**d)
    if not d.get("rope_parameters") and d.get("rope_scaling"):
        ns.rope_parameters = {**d["rope_scaling"], "rope_theta": d.get("rope_theta")}
    return model_rope_parameters(ns)


_ALL = (
    Preset("vanilla", lambda L0, s: {}, "the model as loaded"),
    Preset("linear", _rope("linear"), "position interpolation, positions / s"),
    Preset("ntk", _rope("ntk"), "static NTK-aware base scaling by s"),
    Preset("dynamic", _rope("dynamic"), "dynamic NTK: unscaled up to L0, then the base grows with the length"),
    Preset("yarn", _rope("yarn"), "YaRN, factor s (beta_fast 32, beta_slow 1, attention factor 0.1 ln s + 1)"),
    Preset("llama3", _rope("llama3"), "Llama-3.1 frequency banding, factor s", in_report=False),
    Preset("truncate", lambda L0, s: {"rope": {"rope_type": "truncate"}},
           "Giraffe truncation at the model's length"),
    Preset("lm_infinite", lambda L0, s: {"attention": _lm_infinite(L0)},
           f"LM-Infinite: {LM_INFINITE_GLOBAL} global keys + a window of L0, distance capped at L0"),
    Preset("lm_infinite_topk", _lm_infinite_topk,
           f"LM-Infinite + the top {LM_INFINITE_TOP_K} middle keys for the last query (scored at distance "
           f"L0 / 2, layers from n_layers / 8 on): the paper's passkey configuration", depth_scaled=True),
    Preset("sliding_window", lambda L0, s: {"attention": {"type": "sliding_window", "window": L0}},
           "a window of L0 keys"),
    Preset("sinks", lambda L0, s: {"attention": {"type": "sinks", "n_sink": SINKS, "window": L0 - SINKS}},
           f"StreamingLLM: {SINKS} sinks + a window of L0 - {SINKS}, positions renumbered"),
    Preset("lm_infinite+yarn", lambda L0, s: {"rope": {"rope_type": "yarn", "factor": s}, "attention": _lm_infinite(L0)},
           "LM-Infinite's window with YaRN's frequencies"),
    Preset("self_extend", _self_extend, "Self-Extend: window L0/4, positions beyond it floor-divided by G "
           "(the smallest G reaching s x L0)"),
    Preset("dca", _dca, "Dual Chunk Attention, ChunkLlama's defaults: chunks of 3 L0 / 4 with a local window "
           "of L0 / 16 (no distance beyond 3 L0 / 4 at any length)", in_report=False),
    Preset("string", _string, "STRING: distances from S = 0.33 x the target length on scored S - 128 nearer, "
           "the official attention factor 0.1 ln 2 + 1 and (past L0 / 0.67, on a plain RoPE) YaRN at 0.67 s; a "
           "model's scaled RoPE (llama3, linear) is kept", in_report=False, model_rope=True),
    Preset("swat", lambda L0, s: {}, "SWAT: the sibling model trained with sigmoid sliding-window attention",
           siblings={"tiny-5m": "tiny-swat-5m"}),
)
# name -> preset. The only table of presets; tests iterate over it.
PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}


def get(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {list(PRESETS)}")
    return PRESETS[name]


def config(name: str, *, L0: int, factor: float, n_layers: int | None = None,
           rope: Mapping[str, Any] | None = None) -> MethodConfig:
    """The MethodConfig of preset `name` for training context L0, length factor s, (for a
    depth-scaled preset) the model's number of layers and (for a preset that reads it, `string`)
    the model's own RoPE parameters (`model_rope`; None: a plain RoPE)."""
    return get(name).config(L0, factor, n_layers, rope)


@dataclass(frozen=True)
class PresetRun:
    """What to run for a preset on a model: the model to load (its sibling, for a preset that
    has siblings) and the config."""

    name: str
    model: str
    config: MethodConfig


def resolve(name: str, model: str, *, L0: int, factor: float, n_layers: int | None = None) -> PresetRun | str:
    """The run of preset `name` on `model` (`n_layers`: its depth, for depth-scaled presets), or a
    string saying why it cannot run there."""
    p = get(name)
    if p.siblings is not None:
        if model not in p.siblings:
            return f"no {name} model trained for {model!r} (known: {dict(p.siblings)})"
        model = p.siblings[model]
    return PresetRun(name, model, p.config(L0, factor, n_layers, model_rope(model) if p.model_rope else None))


# ------------------------------------------------------------------ the command-line flag
# One meaning per flag (#45): `--methods` is an `lcx.MethodConfig` as JSON (`lcx serve`, `lcx eval
# ppl`, the vLLM scorer), `--presets` a list of preset names (`lcx report`, `lcx demo`, the
# benchmarks). `--methods` still takes a preset list on those commands, as a deprecated spelling:
# committed results and older notes quote commands written with it.
class _DeprecatedPresetsAlias(argparse.Action):
    """`--methods LIST` on a command whose preset list is `--presets`: stored there, with a warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} for a list of presets is deprecated, use --presets "
              f"(--methods means an lcx.MethodConfig as JSON, as in `lcx serve`)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_presets_argument(parser: argparse.ArgumentParser, *, default: Any, help: str, nargs: str | None = None,
                         metavar: str = "NAME,...") -> None:
    """`--presets` (dest `presets`): the names of the presets (or, for a benchmark, of its own named
    settings) to run; `--methods` is its deprecated alias (it warns)."""
    parser.add_argument("--presets", dest="presets", default=default, nargs=nargs, metavar=metavar, help=help)
    parser.add_argument("--methods", dest="presets", nargs=nargs, metavar=metavar, action=_DeprecatedPresetsAlias,
                        default=argparse.SUPPRESS, help="deprecated spelling of --presets")


__all__ = ["PRESETS", "Preset", "PresetRun", "add_presets_argument", "config", "get", "model_rope", "resolve"]
