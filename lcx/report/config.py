"""`lcx report`'s settings: `ReportConfig`, the default methods (the presets marked for the report),
and what a method runs on (`run_settings`, the model's own context)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..method_config import INFERENCE_BACKEND
from ..presets import PRESETS, PresetRun

DEFAULT_METHODS = tuple(name for name, p in PRESETS.items() if p.in_report)  # a new preset runs by default
PPL_METRIC = "word_perplexity"
CELL_KINDS = ("lmeval", "decode", "ruler", "passkey_primed")
# `--tasks`: passkey and ppl are one lm-eval cell ("lmeval"); ruler is the RULER cell. TASKS is the
# default; KNOWN_TASKS adds what a report measures only when asked: passkey_primed, the passkey prompts
# with a primed answer (a cell of its own, `lcx.report.primed`), paired with passkey prompt by prompt.
TASKS = ("passkey", "ppl", "ruler")
KNOWN_TASKS = TASKS + ("passkey_primed",)
LMEVAL_TASKS = ("passkey", "ppl")
# The RULER tasks a report runs: lcx's `ruler_offline` group (lm-eval's six generated tasks and the
# five essay tasks over lcx's public-domain haystack; docs/lm-eval.md, "RULER").
RULER_TASKS = ("niah_single_1", "niah_single_2_pd", "niah_single_3_pd", "niah_multikey_1_pd", "niah_multikey_2",
               "niah_multikey_3", "niah_multiquery_pd", "niah_multivalue_pd", "ruler_vt", "ruler_cwe", "ruler_fwe")
# How a RULER cell's prompts are drawn (in its settings: cells drawn otherwise are measured again;
# `lcx.report.ruler.seed_as_lm_eval`).
RULER_PROMPTS = "global RNGs seeded as lm-eval's simple_evaluate seeds them, just before the tasks are built"
# Below this many tokens RULER's scaffold plus its 128-token answer budget leaves no room for a
# haystack (lm-eval refuses to build NIAH samples at 256 and 512): shorter report lengths get no RULER cell.
RULER_MIN_LENGTH = 1024
FULL_RULER_SAMPLES = 30  # `lcx report --full`: RULER prompts per task and length of the full run
METHOD_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a custom method's name is also part of its cell files' names


def cell_stem(name: str) -> str:
    """A method's name as it stands in its cell files' names (preset names may hold '+')."""
    return name.replace("+", "_plus_")


# ============================================================================================
# Config
# ============================================================================================

@dataclass(frozen=True)
class ReportConfig:
    """What `lcx report` measures. Lengths default to L0 x (1, 2, 4, 8) of the model's context L0."""

    model: str = "tiny-ret-5m"
    methods: tuple[str, ...] = DEFAULT_METHODS
    lengths: tuple[int, ...] | None = None
    depths: int | tuple[float, ...] = 6  # a grid size over [0, 1], or explicit fractions
    # keys per (depth, length): 30 passkey prompts per cell by default, enough for a Wilson interval
    # of about +-0.15 and for paired tests to separate methods (the committed report's setting)
    samples_per_depth: int = 5
    ppl_docs: int = 4
    decode_lengths: tuple[int, ...] | None = None  # None: the passkey lengths; (): no decode cells
    decode_tokens: int = 32
    seed: int = 0
    device: str = "cpu"  # where the model runs ("cuda" for the GPU report)
    dtype: str = "float32"  # the model's parameter dtype (float32, bfloat16, float16)
    attn_backend: str = INFERENCE_BACKEND  # lcx.attention backend of the attention methods (prefill and decode)
    # name -> an `lcx.MethodConfig` dict: methods of the user's own (`--method NAME=CONFIG`), run
    # after the presets on the report's model, with the same prompts, cells and tables
    custom_methods: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # what to measure (KNOWN_TASKS; default TASKS); ruler only at lengths >= RULER_MIN_LENGTH
    tasks: tuple[str, ...] = TASKS
    # prompts per (RULER task, length): the first n of each task's 500. 10 by default, so that the
    # main job on the bundled model finishes in minutes (a RULER cell's prefill is most of its cost:
    # 11 tasks x n prompts of the cell's length); FULL_RULER_SAMPLES (`lcx report --full`) is the
    # committed bundled report's setting
    ruler_samples: int = 10
    # which of RULER_TASKS to run (e.g. the tasks a model does above floor inside its context)
    ruler_tasks: tuple[str, ...] = RULER_TASKS
    # a RULER cell whose method computes exactly what vanilla computes on each of its prompts
    # (`MethodConfig.identity_up_to`): measure its first n prompts per task and, when they answer
    # word for word as vanilla's cell, take vanilla's answers for the rest; None: measure it in full
    # (`lcx.report.ruler.vanilla_equivalent`)
    ruler_equivalent_check: int | None = 2
    # perplexity only at lengths <= this (None: every passkey length); longer cells measure passkey
    # alone. The windows are cut at the longest perplexity length: a held-out work must be that long
    # (about 27k tokens for a 262k-vocabulary tokenizer such as Gemma 3's)
    ppl_max_length: int | None = None

    def __post_init__(self) -> None:
        tasks = tuple(self.tasks)
        if not tasks or any(t not in KNOWN_TASKS for t in tasks):
            raise ValueError(f"tasks must be a non-empty subset of {list(KNOWN_TASKS)}, got {list(tasks)}")
        if ("passkey" in tasks) != ("ppl" in tasks):
            raise ValueError("tasks: passkey and ppl are measured together (one lm-eval cell); name both or neither")
        object.__setattr__(self, "tasks", tuple(t for t in KNOWN_TASKS if t in tasks))
        rt = tuple(self.ruler_tasks)
        if not rt or any(t not in RULER_TASKS for t in rt):
            raise ValueError(f"ruler_tasks must be a non-empty subset of {list(RULER_TASKS)}, got {list(rt)}")
        object.__setattr__(self, "ruler_tasks", tuple(t for t in RULER_TASKS if t in rt))
        unknown = [m for m in self.methods if m not in PRESETS]
        if unknown:
            raise ValueError(f"unknown report method(s) {unknown}; known: {list(PRESETS)}")
        if not self.methods and not self.custom_methods:
            raise ValueError("methods must name at least one method")
        from ..method_config import MethodConfig

        custom = {}
        for name, conf in dict(self.custom_methods).items():
            if not isinstance(name, str) or not METHOD_NAME.fullmatch(name):
                raise ValueError(f"custom method name {name!r}: use letters, digits, '_', '-', '.'")
            if name in PRESETS or name in {cell_stem(p) for p in PRESETS}:  # its cells would be a preset's
                raise ValueError(f"custom method name {name!r} is a preset's; name your config differently")
            try:
                custom[name] = MethodConfig.from_dict(conf).to_dict()
            except (ValueError, TypeError) as e:
                raise ValueError(f"custom method {name!r}: {e}") from None
        object.__setattr__(self, "custom_methods", custom)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        from ..attention import BACKENDS

        if self.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend {self.attn_backend!r} is not an lcx.attention backend; "
                             f"known: {sorted(BACKENDS)}")
        for name in ("lengths", "decode_lengths"):
            v = getattr(self, name)
            if v is not None and ((not v and name == "lengths") or any(not isinstance(x, int) or x < 16 for x in v)):
                raise ValueError(f"{name} must be integers >= 16, got {v!r}")
        if isinstance(self.depths, (list, tuple)):
            d = tuple(self.depths)
            if not d or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1 for x in d):
                raise ValueError(f"depths must be a grid size or fractions in [0, 1], got {self.depths!r}")
            object.__setattr__(self, "depths", tuple(sorted({float(x) for x in d})))
        if self.ppl_max_length is not None and (not isinstance(self.ppl_max_length, int) or self.ppl_max_length < 16):
            raise ValueError(f"ppl_max_length must be an integer >= 16, got {self.ppl_max_length!r}")
        if self.ruler_equivalent_check is not None and (isinstance(self.ruler_equivalent_check, bool) or not isinstance(
                self.ruler_equivalent_check, int) or self.ruler_equivalent_check < 1):
            raise ValueError(f"ruler_equivalent_check must be an integer >= 1 or None (measure in full), "
                             f"got {self.ruler_equivalent_check!r}")
        for name, lo in (("samples_per_depth", 1), ("ppl_docs", 1), ("decode_tokens", 2), ("ruler_samples", 1)) + (
                (("depths", 1),) if not isinstance(self.depths, tuple) else ()):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")

    def resolved(self, context: int) -> "ReportConfig":
        lengths = self.lengths or tuple(context * m for m in (1, 2, 4, 8))
        return dataclasses.replace(self, lengths=tuple(sorted(lengths)),
                                   decode_lengths=tuple(sorted(lengths if self.decode_lengths is None
                                                               else self.decode_lengths)))

    @property
    def lmeval_lengths(self) -> tuple[int, ...]:
        """Lengths of the passkey + perplexity cells (none without those tasks)."""
        return tuple(self.lengths or ()) if "passkey" in self.tasks else ()

    @property
    def ppl_lengths(self) -> tuple[int, ...]:
        """The passkey lengths whose cells also measure perplexity."""
        return tuple(L for L in self.lmeval_lengths if self.ppl_max_length is None or L <= self.ppl_max_length)

    @property
    def ppl_window(self) -> int:
        """Where perplexity windows are cut: the longest perplexity length (every length when none)."""
        return max(self.ppl_lengths or self.lengths)

    @property
    def ruler_lengths(self) -> tuple[int, ...]:
        """Lengths of the RULER cells: the report's lengths that fit RULER's scaffold."""
        return tuple(L for L in self.lengths or () if L >= RULER_MIN_LENGTH) if "ruler" in self.tasks else ()

    @property
    def primed_lengths(self) -> tuple[int, ...]:
        """Lengths of the passkey_primed cells (none unless the tasks name it)."""
        return tuple(self.lengths or ()) if "passkey_primed" in self.tasks else ()

    def cell_lengths(self, kind: str) -> tuple[int, ...]:
        return {"lmeval": self.lmeval_lengths, "decode": tuple(self.decode_lengths or ()),
                "ruler": self.ruler_lengths, "passkey_primed": self.primed_lengths}[kind]

    def to_dict(self) -> dict[str, Any]:
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        if not d["custom_methods"]:  # (as before custom methods existed: an interrupted run still resumes)
            del d["custom_methods"]
        if tuple(d["tasks"]) == LMEVAL_TASKS:  # (as before RULER: earlier reports render and resume as they did)
            del d["tasks"], d["ruler_samples"]
        elif "ruler" not in d["tasks"]:
            del d["ruler_samples"]
        if d["ppl_max_length"] is None:  # (as before the option)
            del d["ppl_max_length"]
        if "ruler_samples" not in d or tuple(d["ruler_tasks"]) == RULER_TASKS:  # (all of them: as before the option)
            del d["ruler_tasks"]
        if "ruler_samples" not in d or d["ruler_equivalent_check"] == ReportConfig.ruler_equivalent_check:
            del d["ruler_equivalent_check"]  # (the default: as before the option)
        return d


# ============================================================================================
# Methods: name -> config of the components that run them
# ============================================================================================

def run_settings(run: PresetRun, model: str) -> dict[str, Any]:
    """What a cell records of its method: the config's RoPE and attention, and the model it runs
    on when that is not the report's (a preset's sibling, e.g. SWAT's trained model)."""
    d = run.config.to_dict()
    return {"rope": d.get("rope"), "attention": d.get("attention"), "model": run.model if run.model != model else None}


def model_hf_config(model: str) -> dict[str, Any]:
    """The model's config.json, no weights loaded (a GGUF's from lcx's dequantised copy, built
    once: `lcx.models.hf_directory`, as `lcx.presets.model_rope` reads it)."""
    from ..models import hf_directory

    return json.loads((hf_directory(model) / "config.json").read_text())


def model_context(model: str) -> int:
    """The model's `max_position_embeddings`, from its config."""
    return int(model_hf_config(model)["max_position_embeddings"])


# ============================================================================================
