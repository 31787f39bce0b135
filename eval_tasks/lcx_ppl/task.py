"""lm-eval glue for `lcx_ppl`: per context length L, over all docs,

- `word_perplexity_L` = exp(-sum log p / sum words)   (words: lm-eval's whitespace split)
- `byte_perplexity_L` = exp(-sum log p / sum UTF-8 bytes)
- `bits_per_byte_L`   = -sum log p / sum bytes / ln 2

i.e. lm-eval's own perplexity metrics (wikitext's), computed separately for each length bucket.
`lcx_ppl` counts the whole bucket; `lcx_ppl_tail` the second half (its continuation) only.
"""

from __future__ import annotations

import re
from typing import Any

from lm_eval.api.metrics import bits_per_byte, weighted_perplexity

from lcx.eval_tasks.base import MetricSpec, VariantTask
from lcx.eval_tasks.common import lengths_from
from lcx.eval_tasks.lcx_ppl.data import DEFAULT_LENGTHS

METRICS = (("word_perplexity", weighted_perplexity), ("byte_perplexity", weighted_perplexity),
           ("bits_per_byte", bits_per_byte))


def count_words(text: str) -> int:
    return len(re.split(r"\s+", text))  # lm-eval's Task.count_words


class PerplexityTask(VariantTask):
    def metric_specs(self, meta: dict[str, Any], config: dict[str, Any]) -> list[MetricSpec]:
        return [(f"{m}_{L}", agg, False) for L in lengths_from(meta, DEFAULT_LENGTHS) for m, agg in METRICS]

    def score(self, doc: dict[str, Any], results: list[Any]) -> dict[str, tuple[float, int]]:
        out = {}
        # lcx_ppl scores the whole text (rolling); lcx_ppl_tail the continuation given the context
        texts = doc.get("continuations") or doc["prompts"]
        for L, text, r in zip(doc["lengths"], texts, results, strict=True):
            ll = r[0] if isinstance(r, (tuple, list)) else r
            words, nbytes = count_words(text), len(text.encode("utf-8"))
            out[f"word_perplexity_{L}"] = (ll, words)
            out[f"byte_perplexity_{L}"] = (ll, nbytes)
            out[f"bits_per_byte_{L}"] = (ll, nbytes)
        return out
