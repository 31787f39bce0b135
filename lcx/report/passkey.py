"""A passkey cell's numbers, shared by the report's measuring, rendering, page and primed-passkey
modules (one place, no import cycle between them): the cell from lm-eval's result
(`passkey_result`), its counts and Wilson interval (`passkey_counts`, `passkey_interval`) and the
kind of one answer (`passkey_outcome`: right, prose, key_late, wrong_number, no_output)."""

from __future__ import annotations

import re
from typing import Any

_DIGITS = re.compile(r"\d+")  # eval_tasks.common.first_int's pattern


def passkey_result(res: dict[str, Any], task: str, length: int, *, doc_fields: tuple[str, ...] = ()) -> dict[str, Any]:
    """A passkey-kind task's part of a cell from `simple_evaluate`'s result (`log_samples=True`):
    accuracy, accuracy by depth ("%.3f" keys), the prompt count and every prompt's depth, key,
    verdict and output; `doc_fields`: more of each doc's fields per prompt, the value at this
    length for a per-length list (e.g. "prompt_tokens")."""
    L = str(length)
    by_depth: dict[str, list[float]] = {}
    samples = []
    for smp in res["samples"][task]:
        doc = smp["doc"]
        d = f"{doc['depth']:.3f}"
        by_depth.setdefault(d, []).append(float(smp[L]))
        resps = smp.get("filtered_resps") or [None]  # one generation per request (one length)
        extra = {f: doc[f][doc["lengths"].index(length)] if isinstance(doc[f], list) else doc[f] for f in doc_fields}
        samples.append({"depth": doc["depth"], "key": doc["key"], "correct": float(smp[L]), "output": resps[0],
                        **extra})
    return {
        "passkey": res["results"][task][f"{L},none"],
        "passkey_by_depth": {d: sum(v) / len(v) for d, v in sorted(by_depth.items(), key=lambda kv: float(kv[0]))},
        "passkey_docs": len(samples),
        "passkey_samples": samples,
    }


def passkey_counts(cell: dict[str, Any] | None, depth: str | None = None) -> tuple[int, int] | None:
    """(correct, prompts) of a passkey cell (of its prompts at `depth`, a "%.3f" key of
    passkey_by_depth, if given), from its per-prompt results; a cell stored without them falls
    back to accuracy x prompts. None: not measured."""
    if not cell:
        return None
    smp = cell.get("passkey_samples")
    if smp:
        if depth is not None:
            smp = [x for x in smp if f"{x['depth']:.3f}" == depth]
        return (round(sum(float(x["correct"]) for x in smp)), len(smp)) if smp else None
    if depth is not None:
        return None
    n, acc = cell.get("passkey_docs"), cell.get("passkey")
    return (round(acc * n), n) if n and acc is not None else None


def passkey_interval(cell: dict[str, Any] | None) -> dict[str, Any] | None:
    """{"k", "n", "acc", "lo", "hi"}: a passkey cell's accuracy k/n with its Wilson 95% interval."""
    from ..stats import wilson_interval

    c = passkey_counts(cell)
    if c is None or c[1] == 0:
        return None
    (k, n), (lo, hi) = c, wilson_interval(*c)
    return {"k": k, "n": n, "acc": k / n, "lo": lo, "hi": hi}


def passkey_outcome(output: str | None, key: str) -> str:
    """The kind of a passkey answer (module docstring): "right" when the first run of decimal
    digits in `output` is `key` (the `passkey` task's scoring), else "prose" (no digit),
    "key_late" (the key is a later run of digits), "wrong_number" (runs of digits, none the key)
    or "no_output" (None)."""
    if not isinstance(key, str) or not key.isdigit():
        raise ValueError(f"passkey_outcome: key must be a string of digits, got {key!r}")
    if output is None:
        return "no_output"
    if not isinstance(output, str):
        raise ValueError(f"passkey_outcome: output must be a string or None, got {type(output).__name__}")
    runs = _DIGITS.findall(output)
    if not runs:
        return "prose"
    if runs[0] == key:
        return "right"
    return "key_late" if key in runs else "wrong_number"


__all__ = ["passkey_counts", "passkey_interval", "passkey_outcome", "passkey_result"]
