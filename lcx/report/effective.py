"""Effective context length: up to what length does a method keep the model working?

RULER (arXiv 2404.06654, §4) calls a model's *effective length* the longest length whose score
stays above a threshold: Llama-2-7B's 85.6 at 4k. lcx computes it per method, for the RULER
headline and separately for passkey, from the report's Wilson intervals, under two thresholds
stated side by side:

- **absolute**: RULER's 0.856 (`RULER_THRESHOLD`), the paper's bar;
- **relative**: `RELATIVE_FRACTION` (0.85) x the model's own score inside its trained context:
  the unpatched model's (`vanilla`) point score at the longest measured length <= L0. A 135M
  model never reaches 0.856, so the absolute bar alone says nothing at this scale; the relative
  one asks how much of what the model can do inside L0 a method keeps beyond it. When vanilla was
  not measured at a length <= L0 for the task (the bundled model's RULER starts at 1024 > L0 =
  256: its scaffold does not fit 256 tokens), or scores 0 there, there is no relative threshold
  and the report says so.

A length passes when its score's Wilson 95% LOWER bound is >= the threshold (so a score that
clears the bar by chance on a few prompts does not count), and the effective length is the
longest measured length such that it and every shorter measured length pass ("stays above").
None: the shortest measured length already fails. `capped`: every measured length passes, so the
effective length is at least the longest one measured.
"""

from __future__ import annotations

from typing import Any

RULER_THRESHOLD = 0.856  # RULER: Llama-2-7B-chat's score at 4k
RELATIVE_FRACTION = 0.85  # of the model's own score inside L0
REFERENCE_METHOD = "vanilla"


def _reference(by_length: dict[str, dict[str, Any]], context: int) -> dict[str, Any] | None:
    """Vanilla's score the relative threshold is a fraction of: its point score at the longest
    measured length <= L0 (None: no such length, or a score of 0, which would make every length
    pass)."""
    inside = sorted(int(L) for L, iv in by_length.items() if iv and int(L) <= context)
    if not inside or not by_length[str(inside[-1])]["acc"] > 0:
        return None
    L = inside[-1]
    return {"method": REFERENCE_METHOD, "length": L, "acc": by_length[str(L)]["acc"]}


def effective_length(by_length: dict[str, dict[str, Any]], threshold: float) -> dict[str, Any]:
    """`by_length`: length -> interval (`acc`, `lo`, `hi`, `n`) of one method -> {"length": the
    longest length L with every measured length <= L at lo >= threshold (None: none), "capped":
    every measured length passes, "measured": the lengths looked at}."""
    lengths = sorted(int(L) for L, iv in by_length.items() if iv)
    best = None
    for L in lengths:
        if by_length[str(L)]["lo"] < threshold:
            break
        best = L
    return {"length": best, "capped": bool(lengths) and best == lengths[-1], "measured": lengths}


def effective_lengths(intervals: dict[str, dict[str, dict[str, Any]]], context: int) -> dict[str, Any]:
    """method -> length -> interval (one task's, e.g. `passkey_intervals`, or the RULER headline)
    -> {"thresholds": {"absolute", "relative"} (None: no vanilla to be relative to),
    "reference": vanilla's score the relative one is a fraction of, "methods": {method:
    {"absolute": effective_length, "relative": effective_length}}}."""
    reference = _reference(intervals.get(REFERENCE_METHOD, {}), context)
    relative = None if reference is None else RELATIVE_FRACTION * reference["acc"]
    out: dict[str, Any] = {"thresholds": {"absolute": RULER_THRESHOLD, "relative": relative,
                                          "relative_fraction": RELATIVE_FRACTION},
                           "reference": reference, "methods": {}}
    for name, by_length in intervals.items():
        entry = {"absolute": effective_length(by_length, RULER_THRESHOLD)}
        if relative is not None:
            entry["relative"] = effective_length(by_length, relative)
        out["methods"][name] = entry
    return out


def report_effective_lengths(record: dict[str, Any]) -> dict[str, Any]:
    """{"passkey": ..., "ruler": ...} (`effective_lengths`) of a report record, for the tasks it
    measured, from its `passkey_intervals` and `ruler_intervals` (`lcx.report.run` stores both)."""
    from .ruler import ruler_intervals

    context = int(record["config"]["context"])
    out: dict[str, Any] = {}
    pk = record.get("passkey_intervals") or {}
    if any(pk.values()):
        out["passkey"] = effective_lengths(pk, context)
    if record["config"].get("ruler_lengths"):
        ruler = record.get("ruler_intervals") or ruler_intervals(record)
        heads = {m: {L: e["headline"] for L, e in by_len.items() if e.get("headline")} for m, by_len in ruler.items()}
        if any(heads.values()):
            out["ruler"] = effective_lengths(heads, context)
    return out


def describe(entry: dict[str, Any]) -> str:
    """`8192`, `>= 16384` (every measured length passes), `< 4096` (none does), `—`."""
    if not entry["measured"]:
        return "—"
    if entry["length"] is None:
        return f"< {entry['measured'][0]}"
    return f">= {entry['length']}" if entry["capped"] else str(entry["length"])


def markdown_section(record: dict[str, Any]) -> list[str]:
    """The report README's section: one row per method, a column per task and threshold."""
    eff = record.get("effective_length") or report_effective_lengths(record)
    if not eff:
        return []
    cols: list[tuple[str, str, str]] = []
    notes = []
    for task, label in (("passkey", "passkey"), ("ruler", "RULER")):
        e = eff.get(task)
        if e is None:
            continue
        cols.append((task, "absolute", f"{label} ≥ {RULER_THRESHOLD:g}"))
        ref = e["reference"]
        if ref is not None:
            cols.append((task, "relative", f"{label} ≥ {RELATIVE_FRACTION:g}× vanilla ({e['thresholds']['relative']:.2f})"))
            notes.append(f"{label}: vanilla scores {ref['acc']:.2f} at {ref['length']}, the longest measured "
                         "length inside L0.")
        else:
            notes.append(f"{label}: no relative threshold (vanilla was not measured inside L0, or scores 0 there).")
    names = list(dict.fromkeys(m for task in eff.values() for m in task["methods"]))
    lines = ["## Effective context length", "",
             "The longest measured length up to which a method's score stays at or above a threshold, judged "
             "on the Wilson 95% lower bound (RULER's definition, arXiv 2404.06654): RULER's absolute bar "
             f"({RULER_THRESHOLD:g}, Llama-2-7B at 4k) and a model-relative one ({RELATIVE_FRACTION:g}× the "
             "unpatched model's own score inside its trained context). `>= L`: every measured length passes; "
             "`< L`: the shortest measured length already fails. " + " ".join(notes), "",
             "| method | " + " | ".join(c[2] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name in names:
        cells = []
        for task, kind, _ in cols:
            entry = eff[task]["methods"].get(name, {}).get(kind)
            cells.append("—" if entry is None else describe(entry))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + ["", "![effective context length by method](effective_length.png)", ""]


def plot(record: dict[str, Any], out_png: Any) -> None:
    """Effective length per method: one horizontal bar per (task, threshold), on a log2 length axis;
    a hatched bar reaches the longest measured length (at least that), none: below the shortest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..data.io import atomic_savefig

    eff = record.get("effective_length") or report_effective_lengths(record)
    series = [(task, kind) for task in ("passkey", "ruler") if task in eff
              for kind in ("absolute", "relative") if eff[task]["thresholds"][kind] is not None]
    names = list(dict.fromkeys(m for task in eff.values() for m in task["methods"]))
    if not series or not names:
        return
    fig, ax = plt.subplots(figsize=(6.4, 0.42 * len(names) * max(1, len(series)) / 2 + 1.4))
    height = 0.8 / len(series)
    colors = {"passkey": ("#1f77b4", "#9ecae1"), "ruler": ("#d62728", "#fc9272")}
    all_lengths = sorted({L for task in eff.values() for e in task["methods"].values()
                          for v in e.values() for L in v["measured"]})
    floor = all_lengths[0] / 2 if all_lengths else 1
    for j, (task, kind) in enumerate(series):
        color = colors[task][0 if kind == "absolute" else 1]
        thr = eff[task]["thresholds"][kind]
        label = f"{task} ≥ {thr:.2f}" + (" (RULER's bar)" if kind == "absolute" else f" ({RELATIVE_FRACTION:g}× vanilla)")
        for i, name in enumerate(names):
            entry = eff[task]["methods"].get(name, {}).get(kind)
            y = i + (j - (len(series) - 1) / 2) * height
            if entry is None or entry["length"] is None:
                if entry is not None and entry["measured"]:  # below the shortest measured length
                    ax.plot([floor * 1.05], [y], marker="x", color=color, ms=4)
                continue
            ax.barh(y, entry["length"] - floor, left=floor, height=height, color=color,
                    hatch="//" if entry["capped"] else None, edgecolor="white", label=label)
            label = None
    ax.set_xscale("log", base=2)
    ax.set_xlim(floor, all_lengths[-1] * 1.5 if all_lengths else 2)
    ax.set_xticks(all_lengths, [str(L) for L in all_lengths])
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.axvline(record["config"]["context"], color="gray", ls=":", lw=1)
    ax.set_xlabel("effective length, tokens (hatched: >= the longest measured; x: < the shortest; dotted: L0)",
                  fontsize=8)
    if ax.get_legend_handles_labels()[0]:  # (no bar at all: every method below the shortest length)
        ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"Effective context length · {record['config']['model']}", fontsize=10)
    fig.tight_layout()
    atomic_savefig(fig, out_png, dpi=90)
    plt.close(fig)
