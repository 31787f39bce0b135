"""Recipes of the modular-addition study: what the training data looks like (`Recipe`, registry
`RECIPES`, names parsed by `recipe_by_name`).

`baseline` trains on the canonical `a+b=` at character offset 0. `robust` switches on the paper's
four interventions (arXiv 2601.04283), each a flag:

    markers      wrap the expression as `<EXPR>a+b=</EXPR>` (train and eval)
    curriculum   position curriculum: the expression starts at a random offset in [0, m(s)],
                 m(s) widening linearly from 0 to `max_offset` over the first
                 `curriculum_frac` of the steps (baseline: offset 0 only)
    templates    template mixture: each example takes a random template of the recipe's
                 `template_pool` (`symbolic`: `TRAIN_TEMPLATES`; `mixed` adds the natural-language
                 `NL_TRAIN_TEMPLATES`; recipe `robust_nl` is `robust` with the mixed pool)
    consistency  each pair is rendered twice (independent offset/template draws); the loss adds
                 `consistency_weight` x the symmetric KL between the two predicted distributions

Ablations are recipe names: `robust-no_<flag>` drops one flag, `baseline+<flag>` adds one
(parts chain: `robust-no_markers-no_consistency`); `~field=value` parts set the schedule fields
(`robust~offset_sampling=example`). The `*_at(step, steps)` methods are the schedule: which
offsets, templates and consistency weight a step trains with.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from lcx.configs import strict_from_dict as _from_dict
from lcx.data.modadd import NL_TRAIN_TEMPLATES, TRAIN_TEMPLATES


def check_int(name: str, v: Any, minimum: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")


INTERVENTIONS = ("markers", "curriculum", "templates", "consistency")
OFFSET_SAMPLING = ("batch", "example")

# What the `templates` intervention samples from: the symbolic formats only, or those plus
# natural-language phrasings (none of them an OOD template).
TEMPLATE_POOLS: dict[str, tuple[str, ...]] = {
    "symbolic": TRAIN_TEMPLATES,
    "mixed": TRAIN_TEMPLATES + NL_TRAIN_TEMPLATES,
}


@dataclass(frozen=True)
class Recipe:
    """What the training data looks like; each of the paper's interventions is one flag."""

    markers: bool = False
    curriculum: bool = False
    templates: bool = False
    consistency: bool = False
    max_offset: int = 32  # widest offset the curriculum reaches
    curriculum_frac: float = 0.5  # fraction of the steps over which the range widens
    consistency_weight: float = 1.0
    template_pool: str = "symbolic"  # templates draws from: TEMPLATE_POOLS
    # How the recipe is scheduled (defaults: the original study's choices).
    offset_sampling: str = "batch"  # one offset per batch (per rendering with consistency) or per "example"
    curriculum_delay_frac: float = 0.0  # fraction of the steps at offset 0 before the range widens
    consistency_ramp_frac: float = 0.0  # consistency weight ramps linearly from 0 over this fraction
    template_delay_frac: float = 0.0  # fraction of the steps on the canonical template before the mixture
    # fraction of the steps without the consistency loss (batches of distinct pairs) before it starts;
    # a ramp (consistency_ramp_frac) then counts from the start
    consistency_delay_frac: float = 0.0

    def __post_init__(self) -> None:
        if self.offset_sampling not in OFFSET_SAMPLING:
            raise ValueError(f"offset_sampling must be one of {OFFSET_SAMPLING}, got {self.offset_sampling!r}")
        for name in ("curriculum_delay_frac", "consistency_ramp_frac", "template_delay_frac",
                     "consistency_delay_frac"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"{name} must be a number in [0, 1), got {v!r}")
        if self.template_pool not in TEMPLATE_POOLS:
            raise ValueError(f"template_pool must be one of {sorted(TEMPLATE_POOLS)}, got {self.template_pool!r}")
        for name in INTERVENTIONS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_int("max_offset", self.max_offset, 0)
        if not 0 < self.curriculum_frac <= 1:
            raise ValueError(f"curriculum_frac must be in (0, 1], got {self.curriculum_frac}")
        if not (self.consistency_weight >= 0 and math.isfinite(self.consistency_weight)):
            raise ValueError(f"consistency_weight must be a finite number >= 0, got {self.consistency_weight}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Recipe":
        return _from_dict(cls, d)

    def max_offset_at(self, step: int, steps: int) -> int:
        """Widest offset sampled at `step` (0 without the curriculum, and during the delay)."""
        if not self.curriculum:
            return 0
        delay = round(self.curriculum_delay_frac * steps)
        ramp = max(1, round(self.curriculum_frac * steps))
        return round(self.max_offset * min(1.0, max(0, step + 1 - delay) / ramp))

    def templates_at(self, step: int, steps: int) -> bool:
        """Whether `step` samples the template mixture (False without it, and during the delay)."""
        return self.templates and step >= round(self.template_delay_frac * steps)

    def consistency_at(self, step: int, steps: int) -> bool:
        """Whether `step` renders each pair twice for the consistency loss (False without it,
        and during `consistency_delay_frac`)."""
        return self.consistency and step >= round(self.consistency_delay_frac * steps)

    def consistency_weight_at(self, step: int, steps: int) -> float:
        """The consistency loss's weight at `step` (0 without the loss, and during the delay)."""
        if not self.consistency_at(step, steps):
            return 0.0
        ramp = round(self.consistency_ramp_frac * steps)
        since = step - round(self.consistency_delay_frac * steps)
        return self.consistency_weight * (min(1.0, (since + 1) / ramp) if ramp else 1.0)


RECIPES: dict[str, Recipe] = {
    "baseline": Recipe(),
    "robust": Recipe(markers=True, curriculum=True, templates=True, consistency=True),
    # robust with natural-language phrasings in the template mixture
    "robust_nl": Recipe(markers=True, curriculum=True, templates=True, consistency=True, template_pool="mixed"),
    # robust_nl in two stages: the position curriculum alone (markers on, canonical template,
    # offset 0 for the first 10% of the steps, then offsets widening 0 -> max_offset over the next
    # 50%) and, from the middle on, the template mixture and the consistency loss too. Anything
    # that makes the operands' absolute positions useless from step 0 (templates, the consistency
    # loss) sends the encoder to the digit-order plateau; learning the task at fixed positions
    # first and then widening slowly lets it grow a relative reader out of an absolute one.
    "robust_staged": Recipe(markers=True, curriculum=True, templates=True, consistency=True, template_pool="mixed",
                            curriculum_delay_frac=0.1, template_delay_frac=0.5, consistency_delay_frac=0.5),
}


def recipe_by_name(name: str) -> Recipe:
    """`baseline`, `robust`, or a base name followed by `-no_<intervention>` (switch one off)
    or `+<intervention>` (switch one on) parts: `robust-no_markers`, `baseline+curriculum`;
    then any `~field=value` parts set other `Recipe` fields (value as JSON, else a string):
    `robust~offset_sampling=example~consistency_ramp_frac=0.3`."""
    name, *mods = name.split("~")
    base, *parts = re.split(r"(?=[-+])", name)
    if base not in RECIPES:
        raise ValueError(f"recipe={name!r}: unknown base {base!r}; known: {sorted(RECIPES)}")
    recipe = RECIPES[base]
    fields = {f.name for f in dataclasses.fields(Recipe)} - set(INTERVENTIONS)
    changes: dict[str, Any] = {}
    for mod in mods:
        key, eq, value = mod.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"recipe modifier {mod!r}: expected ~field=value with field in {sorted(fields)}")
        try:
            changes[key] = json.loads(value)
        except ValueError:
            changes[key] = value
    for part in parts:
        on = part.startswith("+")
        flag = part[1:] if on else (part[4:] if part.startswith("-no_") else None)
        if flag not in INTERVENTIONS:
            raise ValueError(f"recipe={name!r}: {part!r} is not -no_<intervention> or +<intervention> with "
                             f"intervention in {INTERVENTIONS}")
        recipe = dataclasses.replace(recipe, **{flag: on})
    return dataclasses.replace(recipe, **changes) if changes else recipe
