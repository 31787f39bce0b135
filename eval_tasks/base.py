"""`VariantTask`: an lm-eval task whose every document is scored under several variants.

A variant is a context length (passkey, lcx_ppl), a character offset or a template
(modadd_shift). Each doc carries one prompt per variant in `doc["prompts"]`; the task sends one
request per variant and `score(doc, results)` turns the per-variant results (in variant order)
into metrics. Every doc reports every metric, so all metrics average over the same docs and
`lm_eval --limit k` still evaluates each of the first k docs under every variant.

Metric names are computed from the task's metadata when the task is built (RULER's
convention: the metric of context length 4096 is called `"4096"`), which a static YAML
`metric_list` cannot do. A task YAML selects a subclass with `class: !function <module>.<Class>`
and keeps the rest of its configuration (dataset builder, generation settings) in YAML.

Chat templates, system instructions and descriptions: lm-eval formats the first variant's
prompt into the context it sends; the other variants are sent in the same wrapping, with their
prompt substituted for the first one.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any, Callable, Mapping

from lm_eval.api.instance import Instance
from lm_eval.api.task import ConfigurableTask

MetricSpec = tuple[str, Callable[[list], float], bool]  # (name, aggregation, higher_is_better)


class VariantTask(ConfigurableTask):
    """Subclasses define `metric_specs(meta, config)` and `score(doc, results)`."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        cfg = dict(config or {})
        cfg.pop("class", None)  # the YAML key that selected this class is not a TaskConfig field
        meta = dict(cfg.get("metadata") or {})
        specs = self.metric_specs(meta, cfg)
        cfg["metric_list"] = [
            {"metric": name, "aggregation": agg, "higher_is_better": hib} for name, agg, hib in specs
        ]
        cfg["process_results"] = self.score
        super().__init__(config=cfg)

    # ------------------------------------------------------------------ subclass API
    def metric_specs(self, meta: dict[str, Any], config: dict[str, Any]) -> list[MetricSpec]:
        raise NotImplementedError

    def score(self, doc: dict[str, Any], results: list[Any]) -> dict[str, Any]:
        raise NotImplementedError

    # ------------------------------------------------------------------ requests
    def doc_to_text(self, doc: dict[str, Any], doc_to_text: Any = None) -> str:
        return doc["prompts"][0]

    def construct_requests(self, doc: dict[str, Any], ctx: Any, **kwargs: Any) -> list[Instance]:
        kwargs.pop("apply_chat_template", None)
        kwargs.pop("chat_template", None)
        prompts = list(doc["prompts"])
        if not isinstance(ctx, str):
            raise TypeError(f"{self.config.task}: expected one context string, got {type(ctx).__name__}")
        at = ctx.rfind(prompts[0])
        if at < 0:
            raise RuntimeError(f"{self.config.task}: the formatted context does not contain the doc's prompt")
        head, tail = ctx[:at], ctx[at + len(prompts[0]):]
        out = []
        for i, prompt in enumerate(prompts):
            if self.OUTPUT_TYPE == "generate_until":
                args: tuple = (head + prompt + tail, deepcopy(self.config.generation_kwargs))
            elif self.OUTPUT_TYPE == "loglikelihood":  # per-variant continuations, else the answer
                cont = doc["continuations"][i] if doc.get("continuations") else doc["answer"]
                args = (head + prompt + tail, f"{self.config.target_delimiter}{cont}")
            elif self.OUTPUT_TYPE == "loglikelihood_rolling":
                args = (prompt,)
            else:
                raise ValueError(f"{self.config.task}: output_type {self.OUTPUT_TYPE!r} is not supported")
            out.append(Instance(request_type=self.OUTPUT_TYPE, doc=doc, arguments=args, idx=i, **kwargs))
        return out
