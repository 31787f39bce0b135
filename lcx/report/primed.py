"""`lcx report`'s primed passkey cells (`--tasks ...,passkey_primed`; issue #76, item 4): how much of
passkey's verdict is the answer's format.

The published passkey prompt (Landmark Attention's) ends with a bare "What is the pass key? The
pass key is", and small models often continue it in words (" the pass key.") rather than with a
number: a miss of format as much as of retrieval. `passkey_primed` (`eval_tasks/passkey`,
`QUESTION_PRIMED`) asks the question the way RULER does, naming the answer's type and referring
back to the text ("What is the pass key number mentioned in the provided text? The pass key number
mentioned in the provided text is"), on the same keys, depths, needle and filler (a filler
sentence or so shorter, for the longer question: each prompt with its 12-token answer budget
still fits its length). It is scored as passkey is (the first number of the answer is the key).

A cell of kind "passkey_primed" stores what a passkey cell stores (`passkey`, `passkey_by_depth`,
`passkey_docs`, `passkey_samples`: every prompt's depth, key, verdict and output) plus each prompt's
token count and filler size, so the two cells of a (method, length) pair prompt by prompt on
(depth, key) (`primed_paired`: `lcx.stats.paired_difference`, primed - published, exact McNemar
p), and each miss is classified by `lcx.report.page.passkey_outcome` (prose: no digit in the
answer; a wrong number; the key after another number).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..presets import PresetRun
from .config import ReportConfig
from .text import format_interval, p_text, signed

KIND = "passkey_primed"  # the cell kind and the lm-eval task
MISS_KINDS = ("prose", "wrong_number", "key_late", "no_output")  # `lcx.report.page.PASSKEY_KINDS` less "right"


# The cell
# ============================================================================================

def run_primed_cell(model: str, run: PresetRun, cfg: ReportConfig, length: int, *, lm: Any = None,
                    journal: Path | None = None) -> dict[str, Any]:
    """The `passkey_primed` task at one length through lm-eval's `simple_evaluate` with the `lcx`
    model, with the passkey cell's prompt settings (depths, keys per depth, seed): the same keys
    and depths as the passkey cell of this (method, length). `journal`: as `run_lmeval_cell`'s."""
    import time

    from lm_eval.tasks import TaskManager

    from lcx.eval_tasks import TASKS_DIR

    from .lm import evaluate, lmeval_model
    from .passkey import passkey_result

    lm = lmeval_model(run, cfg, length=length) if lm is None else lm
    # (the task's YAML sets primed: true; lm-eval lays this metadata over the YAML's)
    meta = {"tokenizer": run.model, "max_seq_lengths": [length],
            "depths": list(cfg.depths) if isinstance(cfg.depths, tuple) else cfg.depths,
            "samples_per_depth": cfg.samples_per_depth, "seed": cfg.seed}
    t0 = time.perf_counter()
    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=meta)
    res, resumed = evaluate(lm, journal, tasks=[KIND], task_manager=tm, metadata=meta, log_samples=True,
                            verbosity="WARNING")
    out = passkey_result(res, KIND, length, doc_fields=("sample", "prompt_tokens", "filler_sentences"))
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    if resumed:
        out["resumed_requests"] = resumed
    return out


# Pairing with the published prompt
# ============================================================================================

def _cell(record: dict[str, Any], name: str, kind: str, L: Any) -> dict[str, Any] | None:
    return record["results"].get(name, {}).get(kind, {}).get(str(L))


def _by_prompt(cell: dict[str, Any] | None) -> dict[tuple[str, str], dict[str, Any]]:
    """(depth "%.3f", key) -> the prompt's sample, of a passkey-kind cell's per-prompt results."""
    return {(f"{x['depth']:.3f}", str(x["key"])): x for x in (cell or {}).get("passkey_samples") or []}


def _kind(smp: dict[str, Any]) -> str:
    from .passkey import passkey_outcome

    out = smp.get("output")
    return ("right" if smp["correct"] else "no_output") if out is None else passkey_outcome(out, str(smp["key"]))


def _misses(samples: list[dict[str, Any]]) -> dict[str, int]:
    kinds = [_kind(x) for x in samples]
    return {k: kinds.count(k) for k in MISS_KINDS if k in kinds}


def primed_lengths(record: dict[str, Any]) -> list[int]:
    """The lengths a record measured passkey_primed at (every length of a report that names it)."""
    c = record["config"]
    return [int(L) for L in c["lengths"]] if KIND in (c.get("tasks") or []) else []


def primed_paired(record: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """length -> a row per method with a passkey_primed or a passkey cell at that length (a report
    rendered mid-sweep shows the published side before the primed one): `primed` and `published`
    (the passkey cell's) accuracy with Wilson 95% intervals (`lcx.report.render.passkey_interval`;
    None where that cell is missing), and over the prompts both cells ran (matched by depth and key)
    `lcx.stats.paired_difference(primed, published)`: `diff` primed - published, `ci95`,
    `x_only` / `y_only` the prompts only the primed / only the published prompt retrieved,
    `mcnemar_p` (exact, two-sided); `published_misses` / `primed_misses`: kind -> count of each
    cell's misses (`lcx.report.page.passkey_outcome`: prose, wrong_number, key_late, no_output;
    absent without that cell),
    `prose_fixed`: published prose misses that the primed prompt got right, `prose_to_number`: those
    it answered with a number that is not the key (first); `unpaired`: prompts
    in only one of the two cells (0 when they ran the same prompts)."""
    from ..stats import paired_difference
    from .passkey import passkey_interval

    out: dict[str, list[dict[str, Any]]] = {}
    for L in primed_lengths(record):
        rows = []
        for name in record["results"]:
            primed, published = _cell(record, name, KIND, L), _cell(record, name, "lmeval", L)
            if primed is None and published is None:
                continue
            a, b = _by_prompt(primed), _by_prompt(published)
            keys = sorted(set(a) & set(b))
            row: dict[str, Any] = {"method": name, "primed": passkey_interval(primed),
                                   "published": passkey_interval(published),
                                   **paired_difference([bool(a[k]["correct"]) for k in keys],
                                                       [bool(b[k]["correct"]) for k in keys]),
                                   "unpaired": len(set(a) ^ set(b)) if a and b else None}
            if a:
                row["primed_misses"] = _misses([x for x in a.values() if not x["correct"]])
            if b:
                row["published_misses"] = _misses([x for x in b.values() if not x["correct"]])
            if a and b:
                row["prose_fixed"] = sum(1 for k in keys if _kind(b[k]) == "prose" and a[k]["correct"])
                row["prose_to_number"] = sum(1 for k in keys if _kind(b[k]) == "prose"
                                             and _kind(a[k]) in ("wrong_number", "key_late"))
            rows.append(row)
        if rows:
            out[str(L)] = rows
    return out


def _share(part: int, whole: int) -> str:
    return "—" if not whole else f"{part}/{whole} ({part / whole:.0%})"


def markdown_section(record: dict[str, Any]) -> list[str]:
    """The README's section: a table per length (published vs primed, paired) and what the format
    accounts for, summed over the report's cells."""
    paired = record.get("passkey_primed_paired")
    if paired is None:
        paired = primed_paired(record)
    if not primed_lengths(record):
        return []
    lines = ["## Passkey with a primed answer (`passkey_primed`)", "",
             "The published passkey prompt ends \"What is the pass key? The pass key is\"; `passkey_primed` asks "
             "as RULER does, \"What is the pass key number mentioned in the provided text? The pass key number "
             "mentioned in the provided text is\", on the same keys, depths, needle and filler (a sentence or so "
             "less filler for the longer question), scored the same way. Per method, on the same prompts: each "
             "prompt's accuracy [Wilson 95%], primed − published with the prompts only primed : only published "
             "retrieved and the exact McNemar p (paired, n prompts), and each prompt's misses that were prose "
             "(no digit in the answer: the model answered in words).", ""]
    tot = {"pub_miss": 0, "pub_prose": 0, "fixed": 0, "prose_fixed": 0, "prose_to_number": 0, "broke": 0, "pri_miss": 0, "pri_prose": 0,
           "n": 0, "cells": 0}
    for L in primed_lengths(record):
        rows = paired.get(str(L), [])
        lines += [f"### {L} tokens", "",
                  "| method | published prompt | primed answer | primed − published | only primed : only published "
                  "| McNemar p (n) | published misses in prose | primed misses in prose |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        if not rows:
            lines += ["| (not measured yet) | — | — | — | — | — | — | — |", ""]
            continue
        for r in rows:
            pm, qm = r.get("published_misses"), r.get("primed_misses")
            paired_ok = r["published"] is not None and r["primed"] is not None and r["diff"] is not None
            lines.append(
                f"| {r['method']} | {format_interval(r['published'])} | {format_interval(r['primed'])} | "
                + (f"{signed(r['diff'])} [{signed(r['ci95'][0])}, {signed(r['ci95'][1])}] | {r['x_only']} : {r['y_only']} | "
                   f"{p_text(r['mcnemar_p'])} ({r['n']}) | " if paired_ok else "— | — | — | ")
                + (_share(pm.get("prose", 0), sum(pm.values())) if pm is not None else "—") + " | "
                + (_share(qm.get("prose", 0), sum(qm.values())) if qm is not None else "—") + " |")
            if paired_ok:
                tot["cells"] += 1
                tot["n"] += r["n"]
                tot["pub_miss"] += sum(pm.values())
                tot["pub_prose"] += pm.get("prose", 0)
                tot["fixed"] += r["x_only"]
                tot["broke"] += r["y_only"]
                tot["prose_fixed"] += r["prose_fixed"]
                tot["prose_to_number"] += r["prose_to_number"]
                tot["pri_miss"] += sum(qm.values())
                tot["pri_prose"] += qm.get("prose", 0)
        unpaired = sum(r["unpaired"] or 0 for r in rows)
        lines += [""] + ([f"({unpaired} prompts ran in only one of a method's two cells and are left out of the "
                          "paired test.)", ""] if unpaired else [])
    if tot["cells"]:
        lines += [f"**How much of the verdict was format.** Over the {tot['cells']} (method, length) "
                  f"pair{'s' if tot['cells'] != 1 else ''} measured both ways "
                  f"({tot['n']} prompts), the published prompt missed {tot['pub_miss']}, "
                  f"{_share(tot['pub_prose'], tot['pub_miss'])} of them in prose. Primed, {tot['fixed']} prompts "
                  f"were retrieved that the published prompt missed ({tot['prose_fixed']} of them prose misses "
                  f"there) and {tot['broke']} were missed that it retrieved; {tot['prose_to_number']} published "
                  f"prose misses became a wrong number. The primed prompt missed {tot['pri_miss']}, "
                  f"{_share(tot['pri_prose'], tot['pri_miss'])} in prose. A prose miss that priming turns right "
                  "was a miss of format; one that priming turns into a wrong number was a miss of retrieval "
                  "that the format hid.", ""]
    return lines
