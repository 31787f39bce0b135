"""`lcx report`'s tables and plots from report.json.gz: Wilson intervals for every passkey cell,
paired tests between methods on the same prompts, `plot_report`, `markdown`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .config import CELL_KINDS, PPL_METRIC
from .passkey import passkey_counts, passkey_interval  # noqa: F401  (re-exported: lcx.report's names)
from .text import format_interval, oriented, p_is, p_text, signed

# Plots and Markdown
# ============================================================================================

def _cell(record: dict[str, Any], name: str, kind: str, L: Any) -> dict[str, Any] | None:
    return record["results"].get(name, {}).get(kind, {}).get(str(L))


def _get(record: dict[str, Any], name: str, kind: str, L: Any, *keys: str) -> float:
    """A number of a cell, NaN where the cell was not measured (a report rendered mid-run)."""
    v: Any = _cell(record, name, kind, L)
    for k in keys:
        if v is None:
            break
        v = v.get(k)
    return float("nan") if v is None else float(v)


def passkey_intervals(record: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """method -> length -> `passkey_interval` of every measured passkey cell."""
    return {name: {str(L): iv for L in record["config"]["lengths"]
                   if (iv := passkey_interval(_cell(record, name, "lmeval", L))) is not None}
            for name in record["results"]}


def _outcomes(cell: dict[str, Any] | None) -> dict[tuple[str, str], bool] | None:
    """(depth "%.3f", key) -> correct, per prompt of a passkey cell; None without per-prompt results."""
    smp = (cell or {}).get("passkey_samples")
    return {(f"{x['depth']:.3f}", str(x["key"])): bool(x["correct"]) for x in smp} if smp else None


def passkey_paired(record: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """length -> every pair (a, b) of methods (record order, a first) whose passkey cells at that
    length hold per-prompt results: `lcx.stats.paired_difference` over the prompts both ran,
    matched by (depth, key) — a - b with Newcombe's paired 95% interval, `x_only` / `y_only` the
    prompts only a / only b retrieved, and the exact McNemar p. Every method runs the same
    prompts, so this is the test that uses the pairing (two Wilson intervals ignore it)."""
    from ..stats import all_pairs

    out: dict[str, list[dict[str, Any]]] = {}
    for L in record["config"]["lengths"]:
        got = [(n, o) for n in record["results"] if (o := _outcomes(_cell(record, n, "lmeval", L)))]
        pairs = all_pairs(got)
        if pairs:
            out[str(L)] = pairs
    return out


def _paired_section(record: dict[str, Any]) -> list[str]:
    """The README's paired tests: every method against vanilla at every length, and every pair at
    the longest length (rows win : columns win, p)."""
    paired = record.get("passkey_paired") or passkey_paired(record)
    if not paired:
        return []
    names = list(record["results"])
    lengths = [str(L) for L in record["config"]["lengths"]]
    lines = ["## Paired tests on the same prompts", "",
             "Every method answers the same passkey prompts, so two methods are compared prompt by prompt: "
             "a − b [Newcombe's paired 95% interval], prompts only a : only b retrieved, exact two-sided "
             "McNemar p (`lcx.stats.paired_difference`; every pair at every length is in report.json.gz, "
             "`passkey_paired`). Many pairs are tested: one p just under 0.05 is weak evidence on its own.", ""]
    if "vanilla" in names and len(names) > 1:
        lines += ["| method − vanilla | " + " | ".join(lengths) + " |", "|---|" + "---:|" * len(lengths)]
        for n in names:
            if n == "vanilla":
                continue
            row = []
            for L in lengths:
                q = oriented(paired.get(L, []), n, "vanilla")
                row.append("—" if q is None or q["diff"] is None else
                           f"{signed(q['diff'])} [{signed(q['ci95'][0])}, {signed(q['ci95'][1])}] "
                           f"{q['x_only']}:{q['y_only']} {p_is(q['mcnemar_p'])}")
            lines.append(f"| {n} | " + " | ".join(row) + " |")
        lines.append("")
    L = next((L for L in reversed(lengths) if paired.get(L)), None)
    if L is not None:
        cols = [n for n in names if any(n in (p["a"], p["b"]) for p in paired[L])]
        lines += [f"At {L} tokens, every pair (row only : column only, p):", "",
                  "| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        for r in cols:
            cells = []
            for c in cols:
                q = None if r == c else oriented(paired[L], r, c)
                cells.append("" if q is None else f"{q['x_only']}:{q['y_only']} ({p_text(q['mcnemar_p'])})")
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def plot_report(record: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..data.io import atomic_savefig

    from .effective import plot as plot_effective

    plot_effective(record, out / "effective_length.png")
    if record["config"].get("ruler_lengths"):
        from .ruler import plot_heatmap

        plot_heatmap(record, out)
        if "passkey" not in record["config"]["tasks"] and not record["config"]["decode_lengths"]:
            plot_headline(record, out)
            return  # a RULER-only report: no passkey, perplexity or decode plots
    res, ctx = record["results"], record["config"]["context"]
    names = list(res)
    lengths = [int(L) for L in record["config"]["lengths"]]
    ncol = min(4, len(names))
    nrow = math.ceil(len(names) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.1 * ncol, 2.6 * nrow), squeeze=False, constrained_layout=True)
    im = None
    for ax, name in zip(axes.flat, names):
        depths = sorted({d for L in lengths for d in (_cell(record, name, "lmeval", L) or {}).get("passkey_by_depth", {})},
                        key=float)
        grid = [[_get(record, name, "lmeval", L, "passkey_by_depth", d) for L in lengths] for d in depths]
        if depths:
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for (r, d), (c, L) in ((rd, cl) for rd in enumerate(depths) for cl in enumerate(lengths)):
                kn = passkey_counts(_cell(record, name, "lmeval", L), d)
                if kn is not None:  # k/n: the prompts behind each colour
                    ax.text(c, r, f"{kn[0]}/{kn[1]}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(lengths)), lengths, fontsize=7, rotation=45)
        ax.set_yticks(range(len(depths)), [f"{float(d):.0%}" for d in depths], fontsize=7)
        if ctx in lengths:
            ax.axvline(lengths.index(ctx) + 0.5, color="k", lw=1, ls="--")
        ax.set_title(name, fontsize=9)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.6, label="passkey accuracy")
    fig.suptitle(f"passkey accuracy: needle depth x context length ({record['config']['model']}, "
                 f"trained context {ctx}, dashed; k/n correct per cell)", fontsize=10)
    atomic_savefig(fig, out / "passkey_heatmap.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.5), constrained_layout=True)
    ivs = passkey_intervals(record)
    _accuracy_by_length(ax, names, lengths, ctx, ivs, "passkey accuracy (Wilson 95% interval)")
    ax.set_title(f"passkey accuracy by context length · {record['config']['model']} · n = "
                 f"{_ns(ivs)} prompts per point", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    atomic_savefig(fig, out / "passkey_by_length.png", dpi=110)
    plt.close(fig)
    plot_headline(record, out)

    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    ppl = {name: [_get(record, name, "lmeval", L, "ppl", PPL_METRIC) for L in lengths] for name in names}
    for i, name in enumerate(names):
        ax.plot(lengths, ppl[name], marker="o", label=name, ls="-" if i < 10 else "--", color=f"C{i % 10}")
    ax.axvline(ctx, color="k", lw=1, ls=":", label=f"trained context {ctx}")
    ax.set_xscale("log", base=2)
    if any(math.isfinite(x) and x > 0 for ys in ppl.values() for x in ys):
        ax.set_yscale("log")  # (nothing to log-scale before the first lm-eval cell)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"{PPL_METRIC.replace('_', ' ')} (lcx_ppl, lower is better)")
    ax.set_title(f"perplexity by context length · {record['config']['model']}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    atomic_savefig(fig, out / "ppl_by_length.png", dpi=110)
    plt.close(fig)

    dl = [int(L) for L in record["config"]["decode_lengths"]]
    if not dl:  # --decode-lengths none
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for i, name in enumerate(names):
        style = dict(marker="o", label=name, ls="-" if i < 10 else "--", color=f"C{i % 10}")
        a1.plot(dl, [_get(record, name, "decode", L, "tokens_per_s") for L in dl], **style)
        a2.plot(dl, [_get(record, name, "decode", L, "kv_cache_mb") for L in dl], **style)
    for a, label in ((a1, "decode tokens / s"), (a2, "KV cache (MB, peak)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("prompt length (tokens)")
        a.set_ylabel(label)
        a.axvline(ctx, color="k", lw=1, ls=":")
    if any(math.isfinite(x) and x > 0 for n in names for L in dl for x in [_get(record, n, "decode", L, "kv_cache_mb")]):
        a2.set_yscale("log")  # (a report rendered before any decode cell has nothing to log-scale)
    a1.legend(fontsize=7, ncol=2)
    fig.suptitle(f"decoding with lcx.engine after a prompt of L tokens · {record['config']['model']}", fontsize=10)
    atomic_savefig(fig, out / "decode_by_length.png", dpi=110)
    plt.close(fig)


def _ns(ivs: dict[str, dict[str, dict[str, Any]]]) -> str:
    return ", ".join(map(str, sorted({iv["n"] for m in ivs.values() for iv in m.values()}))) or "—"


def _accuracy_by_length(ax: Any, names: list[str], lengths: list[int], ctx: int,
                        ivs: dict[str, dict[str, dict[str, Any]]], ylabel: str) -> None:
    """One line per method: accuracy by length (log2 axis) with Wilson 95% error bars, the points of
    the methods dodged sideways so equal intervals stay visible; the trained context dotted."""
    for i, name in enumerate(names):
        pts = [(L, ivs[name][str(L)]) for L in lengths if str(L) in ivs.get(name, {})]
        if not pts:
            continue
        xs = [L * 2 ** (0.2 * (i - (len(names) - 1) / 2) / max(1, len(names) - 1)) for L, _ in pts]  # dodge
        acc = [iv["acc"] for _, iv in pts]
        err = [[max(0.0, a - iv["lo"]) for a, (_, iv) in zip(acc, pts)],
               [max(0.0, iv["hi"] - a) for a, (_, iv) in zip(acc, pts)]]
        ax.errorbar(xs, acc, yerr=err, marker="o", ms=4, capsize=2, lw=1, label=name,
                    ls="-" if i < 10 else "--", color=f"C{i % 10}")
    ax.axvline(ctx, color="k", lw=1, ls=":", label=f"trained context {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(L) for L in lengths])
    ax.set_xlim(min(lengths) / 2 ** 0.3, max(lengths) * 2 ** 0.3)  # the lengths measured (the context may lie outside)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)


def plot_headline(record: dict[str, Any], out: Path) -> list[str]:
    """headline.png, the report's first picture (the README shows it): passkey accuracy by length
    per method and, where the report has RULER cells, RULER's headline (the mean over its tasks,
    Wilson interval of the pooled prompts) by length beside it, each panel over the lengths it
    measured (RULER's scaffold needs >= 1024 tokens). Returns the panels drawn ("passkey", "RULER")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..data.io import atomic_savefig

    c = record["config"]
    names, ctx = list(record["results"]), c["context"]
    panels = []
    if "passkey" in c.get("tasks", ["passkey"]):
        panels.append(("passkey", passkey_intervals(record), [int(L) for L in c["lengths"]]))
    if c.get("ruler_lengths"):
        from .ruler import ruler_intervals

        ruler = {m: {L: e["headline"] for L, e in by_len.items() if "headline" in e}
                 for m, by_len in ruler_intervals(record).items()}
        lengths = sorted(int(L) for L in c["ruler_lengths"])
        panels.append(("RULER", ruler, lengths))
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False,
                             constrained_layout=True, sharey=True)
    for ax, (what, ivs, lengths) in zip(axes.flat, panels):
        label = ("passkey accuracy" if what == "passkey" else "RULER: mean accuracy over its tasks")
        _accuracy_by_length(ax, names, lengths, ctx, ivs, label + " (Wilson 95%)")
        ax.set_title(f"{what} by context length · n = {_ns(ivs)} prompts per point", fontsize=10)
    axes.flat[-1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{c['model']} · trained context {ctx} · lcx report", fontsize=11)
    atomic_savefig(fig, out / "headline.png", dpi=100)
    plt.close(fig)
    return [what for what, _, _ in panels]


def _fmt(x: float, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def other_code_note(record: dict[str, Any]) -> str:
    oc = record.get("cells_kept_with_other_code") or {}
    if not oc:
        return ""
    mods = sorted({m for c in oc.values() for m in c["modules"]})
    return (f" Kept with `--keep-other-code`: {len(oc)} cell(s) measured by lcx code that differs from this "
            f"checkout's in {', '.join(f'`{m}`' for m in mods)} (listed in report.json.gz).")


def _decode_section(record: dict[str, Any], dl: list) -> list[str]:
    """The README's decoding table (cells of kind "decode" at prompt lengths `dl`)."""
    c, res = record["config"], record["results"]
    lines = [f"## Decoding ({c['decode_tokens']} greedy tokens after a prompt of L tokens, lcx.engine, batch 1)", "",
             "| method | " + " | ".join(f"{L} tok/s" for L in dl) + " | " + " | ".join(f"{L} KV MB" for L in dl) + " |",
             "|---|" + "---:|" * (2 * len(dl))]

    def tps(name: str, L: Any) -> str:
        x, base = _get(record, name, "decode", L, "tokens_per_s"), _get(record, "vanilla", "decode", L, "tokens_per_s")
        ratio = f" ({x / base:.2f}×)" if "vanilla" in res and math.isfinite(x) and math.isfinite(base) and base else ""
        return _fmt(x, ".1f") + ratio

    for name in res:
        lines.append(f"| {name} | " + " | ".join(tps(name, L) for L in dl) + " | "
                     + " | ".join(_fmt(_get(record, name, "decode", L, "kv_cache_mb"), ".2f") for L in dl) + " |")
    timing = {(_cell(record, n, "decode", L) or {}).get("timing") for n in res for L in dl} - {None}
    return lines + ["", "tok/s (× vanilla at the same length); each cell measured on its own, one after another, "
                    f"timed by {' / '.join(sorted(timing)) or 'wall clock'}: compare ratios with the noise of one "
                    "run in mind (`lcx bench decode` interleaves the methods for a controlled comparison).", "",
                    "![decoding by length](decode_by_length.png)", ""]


def markdown(record: dict[str, Any]) -> str:
    c, res = record["config"], record["results"]
    lengths, dl = c["lengths"], c["decode_lengths"]
    n_pk = max([(_cell(record, n, "lmeval", L) or {}).get("passkey_docs", 0) for n in res for L in lengths] or [0])
    done = sum(1 for n in res for k in CELL_KINDS for _ in res[n].get(k, {}))
    status = ("" if done == record.get("cells_total", done) else
              f" **Partial: {done} of {record['cells_total']} cells measured so far** (— = not yet).")
    lines = [f"# lcx report · {c['model']}", "",
             f"Trained context L0 = {c['context']}; lengths {lengths}; RoPE factor s = {c['rope_factor']:g} "
             + (f"(max length / L0). Rendered by `lcx report --render` from {record['cells_reused']} of "
                f"{record.get('cells_total', '?')} stored cells (each cell's run id and wall time are in cells/)."
                if record.get("run_id") == "render" else
                f"(max length / L0). Produced by `lcx report` in {record['wall_s']:.0f} s wall "
                f"({record.get('measured_s', record['wall_s']):.0f} s measuring; {record['cells_reused']} of "
                f"{record.get('cells_total', '?')} cells kept from run {record.get('run_id', '?')}).") + status
             + other_code_note(record), ""]
    if record.get("sweep"):
        lines += [f"Sweep file: [`{record['sweep']}`]({record['sweep_link']}) — `lcx sweep run {record['sweep']}` "
                  f"measures what is missing (resumable; `--ray` on a cluster), `lcx sweep render {record['sweep']}` "
                  "writes this report from the stored cells.", ""]
    if record.get("cells_read_from"):
        srcs = sorted(set(record["cells_read_from"].values()))
        lines += [f"{len(record['cells_read_from'])} cells are read from "
                  + ", ".join(f"`{s}`" for s in srcs)
                  + " (measured there with these settings, not measured again here): "
                  + ", ".join(f"`{k}`" for k in record["cells_read_from"]) + ".", ""]
    if "passkey" in c.get("tasks", ["passkey"]):  # (a RULER-only report has no passkey/perplexity cells)
        lines += _passkey_ppl_sections(record, n_pk)
    if "passkey_primed" in c.get("tasks", []):
        from .primed import markdown_section as primed_section

        lines += primed_section(record)
    if c.get("ruler_lengths"):
        from .ruler import markdown_section

        lines += markdown_section(record)
    from .effective import markdown_section as effective_section

    lines += effective_section(record)
    if dl:
        lines += _decode_section(record, dl)
    lines += ["## Methods (resolved)", ""]
    return _tail(record, lines)


def _passkey_ppl_sections(record: dict[str, Any], n_pk: int) -> list[str]:
    c, res = record["config"], record["results"]
    lengths = c["lengths"]
    lines = [f"## Passkey accuracy by context length ({n_pk} prompts per cell: depths {c['depths']} x "
             f"{c['samples_per_depth']} keys)", "",
             "Each cell: accuracy [Wilson 95% interval] n=prompts. Non-overlapping intervals are a "
             "conservative test of a difference; the same prompts run for every method, and the paired "
             "tests below use that.", "",
             "| method | " + " | ".join(str(L) for L in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for name in res:
        lines.append(f"| {name} | " + " | ".join(format_interval(passkey_interval(_cell(record, name, "lmeval", L)))
                                                 for L in lengths) + " |")
    lines += ["", "![passkey accuracy by length](passkey_by_length.png)", "",
              "![passkey heatmap](passkey_heatmap.png)", "",
              f"## Perplexity ({PPL_METRIC}, `lcx_ppl`: {c['ppl_docs']} windows of held-out text per length"
              + (f"; measured at lengths <= {c['ppl_max_length']} only" if c.get("ppl_max_length") else "") + ")", "",
              "| method | " + " | ".join(str(L) for L in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for name in res:
        lines.append(f"| {name} | " + " | ".join(_fmt(_get(record, name, "lmeval", L, "ppl", PPL_METRIC), ".1f")
                                                 for L in lengths) + " |")
    lines += ["", "![perplexity by length](ppl_by_length.png)", ""]
    return lines + _paired_section(record)


def _tail(record: dict[str, Any], lines: list[str]) -> str:
    c, res = record["config"], record["results"]
    lengths, env = c["lengths"], record["environment"]
    for name, m in c["methods_resolved"].items():
        lines.append(f"- **{name}**: `{json.dumps({k: v for k, v in m.items() if v})}`")
    for name, why in c["methods_skipped"].items():
        lines.append(f"- **{name}**: skipped — {why}")
    wall = {n: sum((_cell(record, n, k, L) or {}).get("wall_s", 0) for k in ("lmeval", "ruler") for L in lengths) for n in res}
    lines += ["", "## Settings and environment", "", "```json",
              json.dumps({k: v for k, v in c.items() if k not in ("methods_resolved", "methods_skipped")}, indent=1),
              "```", "",
              f"torch {env.get('torch')}, transformers {env.get('transformers')}, python {env.get('python')}, "
              f"{env.get('cpu_count', '?')} CPUs; git {(record['git'].get('sha') or '?')[:12]}"
              f"{' (dirty)' if record['git'].get('dirty') else ''}. lm-eval seconds per method (all lengths): "
              + ", ".join(f"{n} {w:.0f}" for n, w in wall.items()) + ".",
              "Timings come from whatever machine ran the report; compare methods within one report.", ""]
    return "\n".join(lines)


# ============================================================================================
