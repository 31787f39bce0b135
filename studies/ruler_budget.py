"""Would a shorter generation budget change any RULER score? (issue #42 item 3: "the generation
budget stays the tasks' own (NIAH 128 tokens) unless a cheaper stopping rule is shown to give
identical scores on a measured subset").

Decoding is greedy, so a budget of N tokens yields exactly the first N tokens of the committed
128-token answer. This re-scores every prompt of a report's RULER cells on its answer cut to N
tokens, with the task's own scorer (`task.process_results`, RULER's postprocessing and string
match) against the task's own references, the prompts rebuilt as the cell built them
(`lcx.report.ruler.load_ruler_tasks`: seeded generators, the model's tokenizer), and counts the
prompts whose score changes. The cut is made on the answer re-tokenized with the model's
tokenizer (the stored answer is text; re-encoding a generated text almost always gives back the
generated ids, and the record counts the answers whose round trip differs).

    python studies/ruler_budget.py --report results/report/smollm2-135m-ruler \\
        --budgets 16 32 48 64 96 --out results/ruler_budget_smollm2-135m.json

Cells measured before RULER's prompts were seeded (their settings lack `prompts`) are skipped:
their references cannot be rebuilt. -> JSON: per (method, length, task) the prompts, those whose
rescored full answer matches the stored score (a check of the rebuild), and per budget the
prompts whose score changes; a summary per budget over every cell, and per task the smallest
budget that changes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def _cells(report: Path) -> list[tuple[Path, dict[str, Any]]]:
    from lcx.report.cells import read_cells
    from lcx.report.config import RULER_PROMPTS

    out = []
    for stem, cell in read_cells(report).items():  # the cell store (and any per-cell files of earlier versions)
        if ".ruler." in stem and cell.get("settings", {}).get("prompts") == RULER_PROMPTS:
            out.append((report / "cells" / stem, cell))
    return out


def rescore(report: Path, budgets: list[int]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from lcx._lmeval_hook import lcx_tokenizer_dir
    from lcx.report.ruler import load_ruler_tasks

    cells = _cells(report)
    if not cells:
        raise SystemExit(f"ruler_budget: no RULER cell with seeded prompts under {report}/cells")
    rows: list[dict[str, Any]] = []
    tasks_at: dict[tuple[str, int, tuple[str, ...]], dict[str, Any]] = {}
    toks: dict[str, Any] = {}
    for path, cell in cells:
        st = cell["settings"]
        model, L, names = st["model"], int(st["length"]), tuple(st["tasks"])
        if model not in toks:
            toks[model] = AutoTokenizer.from_pretrained(lcx_tokenizer_dir(model) or model)
        tok = toks[model]
        key = (model, L, names)
        if key not in tasks_at:
            tasks_at[key] = load_ruler_tasks(model, L, names)[2]
        for name, tc in cell["result"]["tasks"].items():
            if "samples" not in tc:
                continue
            task = tasks_at[key][name]
            docs = {d["index"]: d for d in task.eval_docs}
            row = {"method": st["method"], "length": L, "task": name, "n": 0, "rescored_equal": 0,
                   "round_trip_differs": 0, "changed": {str(b): 0 for b in budgets},
                   "budget_tokens": task.config.generation_kwargs.get("max_gen_toks")}
            for smp in tc["samples"]:
                doc, answer = docs[smp["index"]], smp["output"] or ""
                ids = tok(answer, add_special_tokens=False)["input_ids"]
                row["n"] += 1
                row["round_trip_differs"] += tok.decode(ids) != answer
                full = task.process_results(doc, [answer])[str(L)]
                row["rescored_equal"] += abs(full - smp["score"]) < 1e-9
                for b in budgets:
                    cut = task.process_results(doc, [tok.decode(ids[:b])])[str(L)]
                    row["changed"][str(b)] += abs(cut - full) > 1e-9
            rows.append(row)
    summary = {str(b): {"prompts": sum(r["n"] for r in rows), "changed": sum(r["changed"][str(b)] for r in rows)}
               for b in budgets}
    per_task: dict[str, Any] = {}
    for name in sorted({r["task"] for r in rows}):
        mine = [r for r in rows if r["task"] == name]
        safe = [b for b in budgets if all(r["changed"][str(b)] == 0 for r in mine)]
        per_task[name] = {"prompts": sum(r["n"] for r in mine), "smallest_budget_changing_nothing": min(safe)
                          if safe else None, "task_budget": mine[0]["budget_tokens"]}
    return {"report": str(report), "budgets": budgets, "cells": len(cells), "summary": summary,
            "per_task": per_task, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", type=Path, required=True, help="an `lcx report --out` folder with RULER cells")
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 48, 64, 96],
                   help="generation budgets (tokens) to test (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="write the record here (JSON; default: print it)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rec = rescore(args.report, sorted(set(args.budgets)))
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(rec, indent=1)
    if args.out is None:
        print(text)
    else:
        from lcx.data.io import atomic_write_json

        atomic_write_json(args.out, rec)
        print(f"ruler_budget: {rec['cells']} cells; " + ", ".join(
            f"{b} tokens: {v['changed']}/{v['prompts']} changed" for b, v in rec["summary"].items()) + f" -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
