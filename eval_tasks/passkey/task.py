"""lm-eval glue for `passkey` (generation) and `passkey_ll` (log-likelihood).

One metric per context length, named by the length (RULER's convention): accuracy in [0, 1].
- `passkey`: greedy generation; correct when the first number in the output equals the key.
- `passkey_ll`: one forward pass; correct when " <key>" is the model's greedy continuation
  (lm-eval's `is_greedy`), i.e. what generation would produce, without a decode loop.
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.metrics import mean

from lcx.eval_tasks.base import MetricSpec, VariantTask
from lcx.eval_tasks.common import first_int, lengths_from
from lcx.eval_tasks.passkey.data import DEFAULT_LENGTHS


class PasskeyTask(VariantTask):
    def metric_specs(self, meta: dict[str, Any], config: dict[str, Any]) -> list[MetricSpec]:
        return [(str(L), mean, True) for L in lengths_from(meta, DEFAULT_LENGTHS)]

    def score(self, doc: dict[str, Any], results: list[Any]) -> dict[str, float]:
        out = {}
        for L, r in zip(doc["lengths"], results, strict=True):
            if self.OUTPUT_TYPE == "generate_until":
                ok = first_int(r) == doc["key"]
            else:
                _ll, is_greedy = r
                ok = bool(is_greedy)
            out[str(L)] = float(ok)
        return out
