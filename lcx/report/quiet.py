"""A quiet console for `lcx report`: the cell lines, not lm-eval's chatter about how lcx calls it.

Each cell builds an `lcx` lm-eval model from a loaded model and runs `simple_evaluate` on it, and
lm-eval and transformers answer that with the same lines on every cell: warnings that describe
lcx's own, intended use (`HARMLESS`: a preloaded model passed as `pretrained`, tasks configured
through `metadata`, lcx's `passkey` replacing lm-eval's LIBRA one) and a progress bar per task,
per request type and per weight load. Inside `quiet()` those warnings are dropped (every other
lm-eval warning still prints) and lm-eval's, lcx's lm-eval model's and transformers' progress bars
are off, so the report's own bar and its one line per cell are what a user reads.
`lcx report --verbose` (environment: `LCX_REPORT_VERBOSE=1`, which worker processes inherit)
shows everything again.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

VERBOSE_ENV = "LCX_REPORT_VERBOSE"

# lm-eval warnings that lcx's own use triggers on every cell, each harmless there:
HARMLESS = (
    "`pretrained` model kwarg is not of type `str`",  # lcx passes the model it loaded and patched
    "Passed an already-initialized model through `pretrained`",  # (the same)
    "Custom kwargs can be passed to `--metadata`",  # lcx sets lengths through metadata already
    "overrides existing task",  # lcx's passkey replaces lm-eval's LIBRA passkey (docs/lm-eval.md)
    "No aggregation function defined for metric",  # RULER's per-length metrics: lm-eval's mean is RULER's
)
# modules whose `tqdm` is looked up at call time (module globals): lm-eval's per-task and
# per-request bars; lcx's lm-eval model imports tqdm inside its methods (patched on `tqdm` itself)
BAR_MODULES = ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.models.huggingface", "lm_eval.evaluator")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip() in ("1", "true", "yes")


class _DropHarmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is not ours to drop
            return True
        return not any(h in text for h in HARMLESS)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Drop `HARMLESS` lm-eval warnings and lm-eval's/transformers' progress bars inside the
    block (nothing when `verbose()`); everything is restored on exit."""
    if verbose():
        yield
        return
    import importlib
    import sys

    import tqdm as tqdm_module

    class _Hidden(tqdm_module.tqdm):  # a bar that never draws (tqdm's own `disable`)
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    drop = _DropHarmless()
    loggers = [logging.getLogger(n) for n in ("lm_eval", "lm_eval.models.huggingface", "lm_eval.api.task",
                                              "lm_eval.api.model", "lm_eval.tasks._index", "lm_eval.evaluator",
                                              "lm_eval.evaluator_utils")]
    saved: list[tuple[object, str, object]] = []
    for name in BAR_MODULES:
        try:
            module = sys.modules.get(name) or importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an lm-eval without that module: nothing to hide
            continue
        if hasattr(module, "tqdm"):
            saved.append((module, "tqdm", module.tqdm))
            module.tqdm = _Hidden
    saved.append((tqdm_module, "tqdm", tqdm_module.tqdm))
    tqdm_module.tqdm = _Hidden  # `from tqdm import tqdm` inside lcx's lm-eval model's methods
    try:
        from transformers.utils import logging as hf_logging

        bars_were_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # "Loading weights"
    except Exception:  # noqa: BLE001
        hf_logging, bars_were_on = None, False
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)
        if hf_logging is not None and bars_were_on:
            hf_logging.enable_progress_bar()
