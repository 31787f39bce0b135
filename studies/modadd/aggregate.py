"""Aggregation of the modular-addition study: `table.json` / `table.md` (mean ± std over seeds
per configuration, place-value error shares, learning curves) and the plots, from the run files
in `<out>/runs/` alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from lcx.data.io import atomic_write_json, atomic_write_text, environment
from lcx.data.modadd import MODULUS

from .config import StudyConfig, same_config, same_recipe, load_run
from .evaluation import CURVE_SPLITS, PLACE_VALUE_SHIFTS
from .plots import row_label, plot_ablation, plot_learning, plot_shift


SPLITS = ("id", "pos", "template", "train_id")


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    t = torch.tensor(xs, dtype=torch.float64)
    return float(t.mean()), float(t.std(unbiased=True)) if len(xs) > 1 else 0.0


def aggregate(out: str | Path, study: StudyConfig | None = None) -> dict[str, Any]:
    """table.json / table.md / shift.png / ablation.png from `<out>/runs/*.json`.

    With `study`, only its configurations and seeds count (and the table says which are missing);
    without it, every run file found does.
    """
    out = Path(out)
    runs = [r for p in sorted((out / "runs").glob("*.json")) if (r := load_run(p)) is not None]
    if study is not None:
        wanted = {c.name: c for c in study.run_configs()}
        runs = [r for r in runs if r.get("name") in wanted and same_config(r["config"], wanted[r["name"]])
                and same_recipe(r.get("recipe"), wanted[r["name"]])]
        order = list(dict.fromkeys((c[0], c[1], c[2]["tag"] if len(c) == 3 else "") for c in study.configs))
    else:
        order = list(dict.fromkeys(_group_key(r) for r in runs))
    rows = []
    for recipe, position, tag in order:
        group = [r for r in runs if _group_key(r) == (recipe, position, tag)]
        if not group:
            continue
        row: dict[str, Any] = {"recipe": recipe, "position": position,
                               "seeds": sorted(r["config"]["seed"] for r in group)}
        if tag:
            row["tag"] = tag
        for s in SPLITS:
            row[s] = dict(zip(("mean", "std"), _mean_std([r["metrics"][s] for r in group])))
        offsets = group[0]["config"]["eval_offsets"]
        row["shift"] = {str(o): dict(zip(("mean", "std"), _mean_std([r["metrics"]["shift"][str(o)] for r in group])))
                        for o in offsets}
        row["train_s"] = sum(r["train_s"] for r in group) / len(group)
        # runs written before the place-value diagnostic lack it; a share is None with no errors
        shares = [pv["share"] for r in group if (pv := r["metrics"].get("place_value_errors"))
                  and pv["share"] is not None]
        if shares:
            row["place_value_share"] = sum(shares) / len(shares)
        curves = [r["curve"]["learning"] for r in group if "learning" in r.get("curve", {})]
        if curves and all(c["step"] == curves[0]["step"] for c in curves):
            row["learning"] = {"step": curves[0]["step"],
                               **{k: [_mean_std([c[k][i] for c in curves])[0] for i in range(len(curves[0]["step"]))]
                                  for k in CURVE_SPLITS}}
        rows.append(row)
    table = {"splits": list(SPLITS), "rows": rows, "n_runs": len(runs),
             "study": study.to_dict() if study else None, "environment": environment()}
    # compute actually spent: every run's training + evaluation seconds (one thread each)
    table["run_seconds"] = round(sum(r.get("train_s", 0) + r.get("eval_s", 0) for r in runs), 1)
    if study is not None:
        have = {r["name"] for r in runs}
        table["missing_runs"] = [c.name for c in study.run_configs() if c.name not in have]
    atomic_write_json(out / "table.json", table)
    atomic_write_text(out / "table.md", table_markdown(table))
    if rows:
        plot_shift(table, out / "shift.png")
        plot_ablation(table, out / "ablation.png")
    if any("learning" in r for r in rows):
        plot_learning(table, out / "learning.png")
    return table


def _group_key(run: Mapping[str, Any]) -> tuple[str, str, str]:
    c = run["config"]
    return c["recipe"], c["position"], c.get("tag", "")


def table_markdown(table: Mapping[str, Any]) -> str:
    head = ("| recipe | position | seeds | in-distribution | position shift (8/32/128) | template OOD | "
            "train pairs |\n|---|---|---|---|---|---|---|\n")
    lines = []
    for r in table["rows"]:
        cells = [f"{100 * r[s]['mean']:.1f} ± {100 * r[s]['std']:.1f}" for s in SPLITS]
        lines.append(f"| {row_label(r)} | {r['position']} | {len(r['seeds'])} | " + " | ".join(cells) + " |")
    text = head + "\n".join(lines) + "\n"
    pv = [r for r in table["rows"] if "place_value_share" in r]
    if pv:
        text += ("\nWrong answers (held-out, offset 0) off by a multiple of 9, i.e. the right digits at the "
                 f"wrong place value (a uniformly wrong answer: {100 * len(PLACE_VALUE_SHIFTS) / (MODULUS - 1):.0f}%): "
                 + "; ".join(f"{row_label(r)} {100 * r['place_value_share']:.0f}%" for r in pv) + ".\n")
    if table.get("run_seconds"):
        minutes = table["run_seconds"] / 60
        text += (f"\n{table['n_runs']} runs, {minutes:.0f} single-thread run-minutes of training and evaluation "
                 f"(~{minutes / 2:.0f} min of wall time as two shards on 2 cores).\n")
    if table.get("missing_runs"):
        text += f"\nMissing runs ({len(table['missing_runs'])}): {', '.join(table['missing_runs'])}\n"
    return text
