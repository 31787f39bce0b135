"""lm-eval glue for the `modadd_shift_*` tasks.

Metrics: `exact_match` (mean over the doc's prompts; the group `modadd_shift` averages it over
the three subtasks) and one accuracy per prompt variant (`offset_<k>`, `template_<i>`).
A generation is correct when its first number equals `(a + b) mod 97`.
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.metrics import mean

from lcx.eval_tasks.base import MetricSpec, VariantTask
from lcx.eval_tasks.common import first_int
from lcx.eval_tasks.modadd_shift.data import variant_names


class ModAddTask(VariantTask):
    def metric_specs(self, meta: dict[str, Any], config: dict[str, Any]) -> list[MetricSpec]:
        variant = (config.get("dataset_kwargs") or {}).get("variant", "id")
        names = variant_names(variant, meta)
        return [("exact_match", mean, True)] + ([(n, mean, True) for n in names] if len(names) > 1 else [])

    def score(self, doc: dict[str, Any], results: list[str]) -> dict[str, float]:
        hits = [float(first_int(r) == doc["answer"]) for r in results]
        out = {"exact_match": sum(hits) / len(hits)}
        if len(hits) > 1:
            out.update(zip(doc["variant_names"], hits, strict=True))
        return out
