"""Plots of the modular-addition study's table (`aggregate.aggregate`): accuracy against the
position shift (`shift.png`), the interventions one at a time (`ablation.png`) and the learning
curves (`learning.png`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from lcx.data.io import atomic_savefig

from .model import POSITION_ENCODINGS
from .recipes import INTERVENTIONS, RECIPES, recipe_by_name


def row_label(row: Mapping[str, Any]) -> str:
    return row["recipe"] + (f" [{row['tag']}]" if row.get("tag") else "")


def plot_shift(table: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table["rows"] if r["recipe"] in (*RECIPES, "baseline+curriculum")]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = {"baseline": "--", "robust": "-", "robust_nl": ":", "baseline+curriculum": "-."}
    colors = {p: f"C{i}" for i, p in enumerate(POSITION_ENCODINGS)}
    max_offsets = set()
    for r in rows:
        xs = [int(o) for o in r["shift"]]
        ys = [100 * r["shift"][o]["mean"] for o in r["shift"]]
        es = [100 * r["shift"][o]["std"] for o in r["shift"]]
        ax.errorbar(xs, ys, yerr=es, ls=styles.get(r["recipe"].split("~")[0], "-"), marker="o", ms=3, capsize=2,
                    color=colors.get(r["position"]), label=f"{row_label(r)} / {r['position']}")
        if recipe_by_name(r["recipe"]).curriculum:
            max_offsets.add(recipe_by_name(r["recipe"]).max_offset)
    for m in max_offsets:
        ax.axvline(m, color="grey", lw=0.8, ls=":")
        ax.text(m, 90, " the curriculum\n reaches here", fontsize=7, color="grey")
    ax.set_xlabel("character offset of the expression (held-out pairs, canonical template)")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.set_title("(a+b) mod 97: accuracy vs position shift (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def plot_ablation(table: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = (["baseline"] + [f"baseline+{i}" for i in INTERVENTIONS] + ["robust"]
             + [f"robust-no_{i}" for i in INTERVENTIONS])
    rows = {r["recipe"]: r for r in table["rows"] if r["position"] == "learned" and not r.get("tag")}
    names = [n for n in names if n in rows]
    splits = ("id", "pos", "template")
    fig, ax = plt.subplots(figsize=(8, 4.2))
    w = 0.8 / len(splits)
    for j, s in enumerate(splits):
        xs = [i + (j - 1) * w for i in range(len(names))]
        ax.bar(xs, [100 * rows[n][s]["mean"] for n in names], w, yerr=[100 * rows[n][s]["std"] for n in names],
               capsize=2, label={"id": "in-distribution", "pos": "position shift", "template": "template OOD"}[s])
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title("Interventions one at a time (learned absolute positions)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def plot_learning(table: Mapping[str, Any], path: Path) -> None:
    """Learning curves (mean over seeds) of the rows that recorded them: held-out accuracy at
    offset 0, at offset 32 and on the OOD templates against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table["rows"] if "learning" in r]
    panels = (("id", "in-distribution (offset 0)"), ("pos32", "position shift (offset 32)"),
              ("template", "template OOD"))
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 4.6), sharey=True)
    for ax, (key, title) in zip(axes, panels):
        for i, r in enumerate(rows):
            ax.plot(r["learning"]["step"], [100 * v for v in r["learning"][key]], marker="o", ms=2,
                    color=f"C{i % 10}", ls="-" if i < 10 else "--", label=f"{row_label(r)} / {r['position']}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (%)")
    axes[0].set_ylim(-3, 103)
    axes[-1].legend(fontsize=6.5, loc="upper left")
    fig.suptitle("(a+b) mod 97: learning curves (mean over seeds)", fontsize=11)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)
    plt.close(fig)
