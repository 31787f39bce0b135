"""Configs of the modular-addition study: one run (`RunConfig`), the study grid (`StudyConfig`:
configurations x seeds, with `STUDY_CONFIGS` x `STUDY_SEEDS` by default), and when a run file on
disk is a finished run of a config (`load_run`: compared as resolved configs and recipes, so a
key added later with its default still matches and a redefined recipe reruns its runs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from lcx.configs import strict_from_dict as _from_dict
from lcx.data.modadd import OOD_TEMPLATES, SHIFT_OFFSETS, render

from .model import POSITION_ENCODINGS, EncoderConfig
from .recipes import INTERVENTIONS, TEMPLATE_POOLS, Recipe, check_int, recipe_by_name


EVAL_OFFSETS: tuple[int, ...] = (0, 4, 8, 16, 32, 48, 64, 80, 96, 128)


@dataclass(frozen=True)
class RunConfig:
    """One training run of the encoder classifier (everything that determines its numbers)."""

    recipe: str = "baseline"
    position: str = "learned"
    seed: int = 0
    split_seed: int = 0
    steps: int = 600
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 1.0
    # Weight decay on the learned position table too (every run committed before #17's
    # digit-order diagnosis); False exempts it like norm gains and biases (no-op without a table).
    position_decay: bool = True
    warmup_steps: int = 50
    grad_clip: float = 1.0
    eval_pairs: int = 1000
    train_pairs: int = 0  # train on the first N pairs of the train half only (0: all 4,704)
    eval_offsets: tuple[int, ...] = EVAL_OFFSETS
    model: EncoderConfig = field(default_factory=EncoderConfig)
    eval_every: int = 0  # >0: a learning curve of held-out accuracies every N steps (`curve_metrics`)
    tag: str = ""  # names a variant of the optimisation settings (part of `name`)
    # Auxiliary masked-character loss (not one of the paper's interventions; 0 = off): each
    # step, `mlm_rate` of every row's non-digit characters are replaced by MASK_ID and the
    # token head predicts them; the loss adds `mlm_weight` x that cross-entropy. Digits are never
    # masked (random operands cannot be predicted, and the row must stay answerable: the
    # classifier reads the same masked rows). Turns on `model.token_head`.
    mlm_weight: float = 0.0
    mlm_rate: float = 0.15

    def __post_init__(self) -> None:
        if isinstance(self.model, Mapping):
            object.__setattr__(self, "model", EncoderConfig.from_dict(self.model))
        if isinstance(self.eval_offsets, list):
            object.__setattr__(self, "eval_offsets", tuple(self.eval_offsets))
        recipe_by_name(self.recipe)  # validates the name
        if self.position not in POSITION_ENCODINGS:
            raise ValueError(f"position={self.position!r} is not known; known: {sorted(POSITION_ENCODINGS)}")
        if self.model.position != self.position:
            object.__setattr__(self, "model", dataclasses.replace(self.model, position=self.position))
        for name in ("mlm_weight", "mlm_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not 0 < self.mlm_rate <= 1:
            raise ValueError(f"mlm_rate must be in (0, 1], got {self.mlm_rate}")
        if self.mlm_weight > 0 and not self.model.token_head:
            object.__setattr__(self, "model", dataclasses.replace(self.model, token_head=True))
        for name, minimum in (("seed", 0), ("split_seed", 0), ("steps", 1), ("batch_size", 2),
                              ("warmup_steps", 0), ("eval_pairs", 1), ("train_pairs", 0), ("eval_every", 0)):
            check_int(name, getattr(self, name), minimum)
        if self.recipe_obj.consistency and self.batch_size % 2:
            raise ValueError(f"batch_size must be even with the consistency loss, got {self.batch_size}")
        if not isinstance(self.tag, str) or not re.fullmatch(r"[A-Za-z0-9_.=-]*", self.tag):
            raise ValueError(f"tag must be a string of letters, digits and _.=-, got {self.tag!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not isinstance(self.position_decay, bool):
            raise ValueError(f"position_decay must be true or false, got {self.position_decay!r}")
        if self.weight_decay < 0 or not self.grad_clip > 0:
            raise ValueError("weight_decay must be >= 0 and grad_clip > 0")
        if not self.eval_offsets or any(not isinstance(o, int) or o < 0 for o in self.eval_offsets):
            raise ValueError(f"eval_offsets must be non-negative integers, got {self.eval_offsets!r}")
        missing = sorted(set(SHIFT_OFFSETS) - set(self.eval_offsets))
        if missing:
            raise ValueError(f"eval_offsets must include the task's SHIFT_OFFSETS {SHIFT_OFFSETS}; missing {missing}")
        longest = 1 + max(self.eval_offsets) + self.max_body_len
        if longest > self.model.max_positions:
            raise ValueError(f"eval_offsets up to {max(self.eval_offsets)} need {longest} positions > "
                             f"model.max_positions {self.model.max_positions}")

    @property
    def recipe_obj(self) -> Recipe:
        return recipe_by_name(self.recipe)

    @property
    def max_body_len(self) -> int:
        """Longest rendered expression (markers included) over all templates and operands."""
        return max(len(render(96, 96, t, 0, markers=True)) for t in TEMPLATE_POOLS["mixed"] + OOD_TEMPLATES)

    @property
    def name(self) -> str:
        tag = f"__{self.tag}" if self.tag else ""
        return f"{self.recipe}__{self.position}{tag}__s{self.seed}"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunConfig":
        return _from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eval_offsets"] = list(self.eval_offsets)
        return d


STUDY_SEEDS = (0, 1, 2)
# (recipe, position), cheapest first (a study cut short loses the expensive tail). baseline under
# every position encoding, robust under the three that can represent order (a bidirectional
# NoPE encoder is order-blind, see studies.modadd.model), single interventions added to the
# baseline and removed from robust, both with learned positions (consistency alone is void:
# without offsets or templates the two renderings of a pair are identical), and robust_nl.
STUDY_CONFIGS: tuple[tuple[str, str], ...] = (
    ("baseline", "learned"), ("baseline", "rope"), ("baseline", "alibi"), ("baseline", "nope"),
    ("baseline+templates", "learned"), ("baseline+markers", "learned"), ("baseline+curriculum", "learned"),
    ("robust", "learned"), ("robust", "rope"), ("robust", "alibi"),
    *((f"robust-no_{i}", "learned") for i in INTERVENTIONS),
    ("robust_nl", "learned"),
)


@dataclass(frozen=True)
class StudyConfig:
    """The whole study: configurations x seeds, and the per-run budget shared by all of them.

    A configuration is `(recipe, position)`, or `(recipe, position, overrides)` where
    `overrides` holds RunConfig keys for that configuration only (say `lr`) and must then set
    a `tag` naming the variant (runs are files named by recipe, position, tag and seed)."""

    configs: tuple[tuple, ...] = STUDY_CONFIGS
    seeds: tuple[int, ...] = STUDY_SEEDS
    run: Mapping[str, Any] = field(default_factory=dict)  # RunConfig keys shared by every run
    budget_note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "configs", tuple(tuple(c) for c in self.configs))
        object.__setattr__(self, "seeds", tuple(self.seeds))
        bad = sorted(set(self.run) & {"recipe", "position", "seed"})
        if bad:
            raise ValueError(f"StudyConfig.run must not set {bad}: they come from configs and seeds")
        for c in self.configs:
            if len(c) not in (2, 3) or (len(c) == 3 and not isinstance(c[2], Mapping)):
                raise ValueError(f"configs entries are (recipe, position) or (recipe, position, overrides), got {c!r}")
            if len(c) == 3:
                bad = sorted(set(c[2]) & {"recipe", "position", "seed"})
                if bad or not c[2].get("tag"):
                    raise ValueError(f"config {c!r}: overrides need a non-empty 'tag' and must not set "
                                     "recipe, position or seed")
        names = [c.name for c in self.run_configs()]  # validates every run
        if len(set(names)) != len(names):
            raise ValueError("two configurations give runs the same name; give them different tags")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StudyConfig":
        return _from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return {"configs": [[*c[:2], dict(c[2])] if len(c) == 3 else list(c) for c in self.configs],
                "seeds": list(self.seeds), "run": dict(self.run), "budget_note": self.budget_note}

    def run_configs(self) -> list[RunConfig]:
        return [RunConfig.from_dict({**self.run, **(c[2] if len(c) == 3 else {}), "recipe": c[0], "position": c[1],
                                     "seed": s})
                for c in self.configs for s in self.seeds]


def load_run(path: Path, cfg: RunConfig | None = None) -> dict[str, Any] | None:
    """The finished run in `path`, or None if absent, unreadable, incomplete or for another config."""
    try:
        res = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(res, dict) or "metrics" not in res or "config" not in res:
        return None
    if cfg is not None and not (same_config(res["config"], cfg) and same_recipe(res.get("recipe"), cfg)):
        return None
    return res


def same_recipe(saved: Mapping[str, Any] | None, cfg: RunConfig) -> bool:
    """The run was trained with what its recipe name means now (a run file stores the resolved
    recipe; fields added since take their defaults), so redefining a recipe reruns its runs."""
    if saved is None:
        return True  # written before run files stored the recipe
    try:
        return Recipe.from_dict(saved) == cfg.recipe_obj
    except (TypeError, ValueError):
        return False


def same_config(saved: Mapping[str, Any], cfg: RunConfig) -> bool:
    """Compared as resolved configs: a key added later with its default still matches."""
    try:
        return RunConfig.from_dict(saved) == cfg
    except (TypeError, ValueError):
        return False
