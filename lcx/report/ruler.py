"""`lcx report`'s RULER cells: lcx's `ruler_offline` tasks (`RULER_TASKS`) through lm-eval with the
`lcx` model at one length (`run_ruler_cell`), and what the report shows of them: per task and
length, a prompt counts as correct when RULER's score is 1 (every expected answer in the output;
multi-value tasks give partial credit, recorded as `score`), with a Wilson 95% interval; RULER's
headline is the mean over tasks (as the RULER paper averages), whose interval is Wilson's over the
pooled prompts (every task has the same number of prompts, so the pooled accuracy is that mean);
paired tests between methods per task and for the headline (prompts matched by task and index).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

from ..presets import PresetRun
from .config import RULER_TASKS, ReportConfig

# Measuring
# ============================================================================================

def _unbuildable(task: Any, length: int) -> str | None:
    """Why RULER cannot score `task` at `length`, or None: lm-eval's CWE generator, when even its
    smallest word list does not fit, emits samples with no expected answers, which its scorer then
    divides by (ZeroDivisionError after the whole generation); found here before generating."""
    docs = task.dataset["test"]
    if len(docs) == 0:
        return "no sample fits this length"
    if any(not d for d in docs["outputs"]):
        return "its samples have no expected answers at this length (the scaffold leaves no room for the words)"
    return None


def seed_as_lm_eval() -> None:
    """Seed Python's, numpy's and torch's global generators with `lm_eval.simple_evaluate`'s
    default seeds (random 0, numpy 1234, torch 1234), as `lm_eval --tasks ...` does before it
    builds the tasks. lm-eval's RULER generators draw keys, values and needle words from the
    global `random` when a task is built (`prepare_niah.generate_random`; their `random_seed`
    only shuffles the needles), so without this a cell's prompts depend on whatever drew from
    `random` earlier in the process: before this was added, the first RULER cell of every
    `lcx report` process got other prompts than the cells after it."""
    import inspect
    import random

    import numpy as np
    import torch
    from lm_eval import simple_evaluate

    p = inspect.signature(simple_evaluate).parameters
    random.seed(p["random_seed"].default)
    np.random.seed(p["numpy_random_seed"].default)
    torch.manual_seed(p["torch_random_seed"].default)


def load_ruler_tasks(model: str, length: int, tasks: Sequence[str]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """lm-eval's task objects of `tasks` at `length`, with the prompts a report cell of `model`
    answers: RULER's tokenizer is the model's (`lcx._lmeval_hook`), the generators are seeded
    (`seed_as_lm_eval`) just before the tasks are built. -> (task manager, metadata, {name: task})."""
    from lm_eval.tasks import TaskManager

    from .. import _lmeval_hook
    import lm_eval.tasks.manager

    # what the start-up hook does (also without it): lcx's tasks indexed, RULER's tokenizer and nltk data offline
    _lmeval_hook.patch_task_manager(lm_eval.tasks.manager)
    _lmeval_hook.patch_ruler()
    meta = {"tokenizer": model, "max_seq_lengths": [length]}
    # lm-eval's RULER directory only (lcx's own tasks, with the essay-haystack ones, are added by the
    # hook): indexing every lm-eval task takes seconds per cell
    tm = TaskManager(metadata=meta, include_path=str(Path(lm_eval.tasks.__file__).parent / "ruler"),
                     include_defaults=False)
    seed_as_lm_eval()  # the tasks draw their needles when built, here
    import contextlib
    import io

    from .quiet import verbose

    # lm-eval's variable-tracking generator prints its search for the haystack size ("Max length ... |
    # Noises: ..."): kept off the console unless --verbose
    with built_once(), contextlib.redirect_stdout(io.StringIO()) if not verbose() else contextlib.nullcontext():
        return tm, meta, tm.load(list(tasks))["tasks"]


# A task's prompts are a function of its generator's arguments (the tokenizer, the length) and of
# the global generators' state when it is built (`seed_as_lm_eval`; each task's draws move the state
# the next task starts from). Every method of a report answers the same prompts, so a process
# builds them once: `built_once` keys each generated dataset by the task, its generator, the
# arguments and the state of Python's, numpy's and torch's generators before the call, and a hit
# hands back the same dataset and sets the generators to the state the call left them in, so what
# follows draws as after a real build. Building is most of a short cell's time (lm-eval generates
# all 500 samples of each task, tokenizing its haystack many times: ~29 s of a 2048-token cell of
# 2 prompts per task here); the datasets are Arrow tables, not mutated by the evaluation.
_BUILT: dict[tuple[Any, ...], tuple[Any, Any]] = {}
_BUILT_LENGTHS = 2  # datasets of this many lengths are kept (cells run length-major)


def _generator_states() -> tuple[Any, Any, Any]:
    import random

    import numpy as np
    import torch

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_generator_states(states: tuple[Any, Any, Any]) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


def _digest(states: tuple[Any, Any, Any]) -> str:
    import hashlib
    import pickle

    return hashlib.sha256(pickle.dumps((states[0], [str(x) for x in states[1]], states[1][1].tobytes(),
                                        states[2].numpy().tobytes()))).hexdigest()


class built_once:
    """Within it, lm-eval's tasks with a generated dataset (`custom_dataset`) are built once per
    process for the same generator, arguments and generator states (see above)."""

    def __enter__(self) -> "built_once":
        import json

        from lm_eval.api.task import ConfigurableTask

        self.cls, self.original = ConfigurableTask, ConfigurableTask.__dict__["download"]
        original = self.original

        def download(task: Any, dataset_kwargs: dict[str, Any] | None = None) -> None:
            fn = task.config.custom_dataset
            if not callable(fn):
                return original(task, dataset_kwargs)
            args = {**(task.config.metadata or {}), **(task.config.dataset_kwargs or {})}
            length = json.dumps(args.get("max_seq_lengths"), default=repr)
            key = (length, task.config.task, getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn)),
                   json.dumps(args, sort_keys=True, default=repr), _digest(_generator_states()))
            hit = _BUILT.get(key)
            if hit is None:
                original(task, dataset_kwargs)
                lengths = {k[0] for k in _BUILT}
                if length not in lengths and len(lengths) >= _BUILT_LENGTHS:
                    _BUILT.clear()
                _BUILT[key] = hit = (task.dataset, _generator_states())
            else:
                task.dataset = hit[0]
                _set_generator_states(hit[1])

        ConfigurableTask.download = download
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cls.download = self.original


def run_ruler_cell(model: str, run: PresetRun, cfg: ReportConfig, length: int, *,
                   journal: Path | None = None) -> dict[str, Any]:
    """Every task of `cfg.ruler_tasks` (default: all of `RULER_TASKS`) at `length` through lm-eval's `simple_evaluate` with the `lcx`
    model: the first `cfg.ruler_samples` prompts of each (lm-eval's generator, seeded as lm-eval
    seeds it just before the tasks are built, `seed_as_lm_eval`, so every method gets the same
    prompts in any process), each task's own generation budget. A task
    RULER cannot build at this length is recorded with the reason instead of samples.
    `journal`: as `lcx.report.measure.run_lmeval_cell`'s (a cell resumes from its last answer)."""
    from .lm import evaluate, lmeval_model

    lm = lmeval_model(run, cfg, length=length)
    L = str(length)
    out: dict[str, Any] = {"tasks": {}}
    t0 = time.perf_counter()
    tm, meta, loaded = load_ruler_tasks(run.model, length, cfg.ruler_tasks)
    run_tasks = []
    for name in cfg.ruler_tasks:
        why = _unbuildable(loaded[name], length)
        if why is not None:
            out["tasks"][name] = {"skipped": why}
        else:
            run_tasks.append(name)
    res, resumed = evaluate(lm, journal, tasks=[loaded[n] for n in run_tasks], task_manager=tm,
                             limit=cfg.ruler_samples, metadata=meta, log_samples=True,
                             verbosity="WARNING") if run_tasks else ({"samples": {}}, 0)
    # `prompt_tokens` is RULER's own `length` of the sample: its input's tokens (RULER's tokenizer
    # call) plus the task's generation budget (128 for NIAH); the answer prefix lm-eval appends to
    # the context (`gen_prefix`, ~15-20 tokens) is not counted. Kept under this name: committed cells use it.
    for name in run_tasks:
        samples = []
        for smp in sorted(res["samples"][name], key=lambda s: s["doc_id"]):
            resps = smp.get("filtered_resps") or [None]
            samples.append({"index": smp["doc"]["index"], "score": float(smp[L]), "correct": float(smp[L]) == 1.0,
                            "prompt_tokens": smp["doc"]["length"], "output": resps[0],
                            "expected": list(smp["doc"]["outputs"])})  # (cells before 2026-12-07 lack it)
        out["tasks"][name] = {"samples": samples}
    out["tasks"] = {n: out["tasks"][n] for n in cfg.ruler_tasks}
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    if resumed:
        out["resumed_requests"] = resumed  # wall_s is this process's part only
    return out


# Tokens added to a sample's RULER `length` (its input's tokens + the generation budget) for the
# answer prefix's own tokens' neighbours: a BOS the model adds that RULER's count lacks, and the
# join of context and answer prefix (the prefix itself is counted exactly).
SEQUENCE_MARGIN = 4


def longest_sequence(model: str, length: int, tasks: Sequence[str], samples: int) -> int:
    """An upper bound on the tokens of any prompt of a RULER cell (`model`, `length`, the first
    `samples` prompts of each of `tasks`) together with its answer: RULER's own `length` of the
    sample (its input's tokens by the model's tokenizer + the task's generation budget), the answer
    prefix lm-eval appends (`gen_prefix`, tokenized) and `SEQUENCE_MARGIN`. Builds the tasks
    (seconds to a minute), runs no model."""
    from lm_eval.tasks.ruler import common_utils

    _, _, loaded = load_ruler_tasks(model, length, tasks)
    tok = common_utils.get_tokenizer(tokenizer=model)  # (lcx's patched, cached getter: the model's tokenizer)
    longest = 0
    for name in tasks:
        for doc in list(loaded[name].eval_docs)[:samples]:
            prefix = len(tok(doc.get("gen_prefix") or "", add_special_tokens=False).input_ids)
            longest = max(longest, int(doc["length"]) + prefix + SEQUENCE_MARGIN)
    return longest


def vanilla_equivalent(model: str, run: PresetRun, cfg: ReportConfig, length: int, reference: tuple[str, dict[str, Any]],
                       log: Any = print) -> dict[str, Any] | None:
    """The RULER cell of `run` at `length` taken from `reference` = (name, its RULER cell at this
    length: vanilla, the model as loaded), when `run`'s config computes exactly what the model as
    loaded computes on every prompt of the cell with its answer (`MethodConfig.identity_up_to` of
    the model >= `longest_sequence`), and its first `cfg.ruler_equivalent_check` prompts per task,
    measured under `run`, answer word for word as `reference`'s. Else None (measure the cell), with
    the reason logged. The cell returned is the reference's answers and scores with
    `equivalent_to` saying so (bound, longest sequence, prompts checked) and this check's `wall_s`."""
    import copy
    import dataclasses
    from types import SimpleNamespace

    from .config import model_hf_config

    ref_name, ref = reference
    if cfg.ruler_equivalent_check is None or run.config.is_identity:
        return None
    bound = run.config.identity_up_to(SimpleNamespace(**model_hf_config(run.model)))
    if bound <= 0:
        return None
    t0 = time.perf_counter()
    longest = longest_sequence(run.model, length, cfg.ruler_tasks, cfg.ruler_samples)
    if longest > bound:
        log(f"  {run.name} @ {length}: equals {ref_name} only up to {bound} tokens, a prompt with its answer "
            f"takes up to {longest}: measured in full")
        return None
    k = min(cfg.ruler_equivalent_check, cfg.ruler_samples)
    check = run_ruler_cell(model, run, dataclasses.replace(cfg, ruler_samples=k), length)
    checked = 0
    for name, task in check["tasks"].items():
        want = {s["index"]: s for s in (ref["tasks"].get(name) or {}).get("samples", [])}
        for s in task.get("samples", []):
            r = want.get(s["index"])
            if r is None or (r["output"], r["score"]) != (s["output"], s["score"]):
                log(f"  {run.name} @ {length}: {name} prompt {s['index']} answered {s['output']!r}, "
                    f"{ref_name} {None if r is None else r['output']!r}: measured in full")
                return None
            checked += 1
    cell = copy.deepcopy(ref)
    cell.pop("resumed_requests", None)
    cell["wall_s"] = round(time.perf_counter() - t0, 2)
    cell["equivalent_to"] = {"method": ref_name, "identity_up_to": None if math.isinf(bound) else int(bound),
                             "longest_sequence": longest,
                             "checked_prompts": checked}
    log(f"  {run.name} @ {length}: computes what {ref_name} computes on every prompt (<= {longest} of {bound} "
        f"tokens); {checked} prompts measured answered as {ref_name}'s: its answers taken")
    return cell


def _counts(task_cell: dict[str, Any] | None) -> tuple[int, int] | None:
    smp = (task_cell or {}).get("samples")
    return (sum(1 for s in smp if s["correct"]), len(smp)) if smp else None


def ruler_cell_summary(cell: dict[str, Any]) -> str:
    """One line for the progress bar: mean accuracy over the tasks RULER could build, k/n each."""
    accs = [k / n for t in cell["tasks"].values() if (c := _counts(t)) for k, n in [c]]
    return f"mean {sum(accs) / len(accs):.2f} over {len(accs)} tasks" if accs else "no task buildable"


# Statistics
# ============================================================================================

def _interval(k: int, n: int) -> dict[str, Any]:
    from ..stats import wilson_interval

    lo, hi = wilson_interval(k, n)
    return {"k": k, "n": n, "acc": k / n, "lo": lo, "hi": hi}


def _ruler_cells(record: dict[str, Any], name: str) -> dict[str, Any]:
    return record["results"].get(name, {}).get("ruler", {})


def ruler_intervals(record: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """method -> length -> {"tasks": {task: interval}, "skipped": {task: why}, "headline": interval
    of the pooled prompts with `acc` the mean over tasks} for every measured RULER cell. The
    headline covers the tasks measured at that length (the same set for every method)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name in record["results"]:
        for L, cell in _ruler_cells(record, name).items():
            tasks = {t: _interval(*c) for t, tc in cell["tasks"].items() if (c := _counts(tc))}
            skipped = {t: tc["skipped"] for t, tc in cell["tasks"].items() if "skipped" in tc}
            entry: dict[str, Any] = {"tasks": tasks, "skipped": skipped}
            if tasks:
                k, n = sum(iv["k"] for iv in tasks.values()), sum(iv["n"] for iv in tasks.values())
                entry["headline"] = {**_interval(k, n), "acc": sum(iv["acc"] for iv in tasks.values()) / len(tasks),
                                     "tasks": len(tasks)}
            out.setdefault(name, {})[L] = entry
    return out


def _outcomes(cell: dict[str, Any] | None, task: str | None) -> dict[tuple[str, int], bool]:
    """(task, prompt index) -> correct, for one task or (None) all of a RULER cell's tasks."""
    return {(t, s["index"]): bool(s["correct"]) for t, tc in (cell or {}).get("tasks", {}).items()
            if task in (None, t) for s in tc.get("samples", [])}


def ruler_paired(record: dict[str, Any]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """length -> "headline" or task -> every pair (a, b) of methods (record order) measured there:
    `lcx.stats.paired_difference` over the prompts both ran (matched by task and index)."""
    from ..stats import all_pairs

    names = list(record["results"])
    lengths = sorted({L for n in names for L in _ruler_cells(record, n)}, key=int)
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for L in lengths:
        for scope in (None, *RULER_TASKS):
            got = [(n, o) for n in names if (o := _outcomes(_ruler_cells(record, n).get(L), scope))]
            pairs = all_pairs(got)
            if pairs:
                out.setdefault(L, {})[scope or "headline"] = pairs
    return out


# Rendering
# ============================================================================================

def markdown_section(record: dict[str, Any]) -> list[str]:
    """The README's RULER section: headline by length, every task per length, paired tests against vanilla."""
    from .text import oriented, p_is, signed, format_interval

    ivs = record.get("ruler_intervals") or ruler_intervals(record)
    if not ivs:
        return []
    names = list(record["results"])
    lengths = [str(L) for L in record["config"].get("ruler_lengths", [])]
    n = record["config"].get("ruler_samples") or max(
        (iv["n"] for m in ivs.values() for c in m.values() for iv in c["tasks"].values()), default=0)
    n_tasks = len(record["config"].get("ruler_tasks") or RULER_TASKS)
    which = "`ruler_offline`" if n_tasks == len(RULER_TASKS) else "`ruler_offline`, `--ruler-tasks`"
    lines = [f"## RULER (lcx's {which}: {n_tasks} tasks, {n} prompts each per length)", "",
             "A prompt is correct when every expected answer is in the output (RULER's score 1). Headline: the "
             "mean over the tasks measured at that length, as RULER averages, with the Wilson 95% interval of the "
             "pooled prompts. Lengths below 1024 fit no RULER sample.", "",
             "| method | " + " | ".join(lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(format_interval(ivs.get(name, {}).get(L, {}).get("headline"))
                                                 for L in lengths) + " |")
    lines += ["", "![RULER: task x length per method](ruler_heatmap.png)", ""]
    lines += _equivalent_note(record, names, lengths)
    paired = record.get("ruler_paired") or ruler_paired(record)
    for L in lengths:
        tasks = [t for t in RULER_TASKS if any(t in ivs.get(m, {}).get(L, {}).get("tasks", {}) for m in names)]
        skipped = sorted({f"`{t}` ({why})" for m in names for t, why in ivs.get(m, {}).get(L, {}).get("skipped", {}).items()})
        if not tasks:
            continue
        lines += [f"At {L} tokens, correct/prompts per task" + (" (paired test against vanilla: a − b, only a : only b, p)"
                                                               if "vanilla" in names else "") + ":", "",
                  "| method | " + " | ".join(f"`{t}`" for t in tasks) + " | mean |", "|---|" + "---:|" * (len(tasks) + 1)]
        for name in names:
            cell = ivs.get(name, {}).get(L, {})
            row = []
            for t in ["headline", *tasks]:
                iv = cell.get("headline") if t == "headline" else cell.get("tasks", {}).get(t)
                text = "—" if iv is None else (f"{iv['acc']:.2f}" if t == "headline" else f"{iv['k']}/{iv['n']}")
                q = oriented(paired.get(L, {}).get(t, []), name, "vanilla") if name != "vanilla" else None
                if iv is not None and q is not None and q["diff"] is not None:
                    text += f" ({signed(q['diff'])}, {q['x_only']}:{q['y_only']}, {p_is(q['mcnemar_p'])})"
                row.append(text)
            lines.append(f"| {name} | " + " | ".join(row[1:] + row[:1]) + " |")
        if skipped:
            lines += ["", f"Not measurable at {L}: " + "; ".join(skipped) + "."]
        lines.append("")
    return lines


def _equivalent_note(record: dict[str, Any], names: list[str], lengths: list[str]) -> list[str]:
    """The README's line naming the cells taken from vanilla's answers (`vanilla_equivalent`)."""
    taken = [(n, L, e) for n in names for L in lengths
             if (e := (_ruler_cells(record, n).get(L) or {}).get("equivalent_to"))]
    if not taken:
        return []
    cells = "; ".join(f"{n} at {L} (≤ {e['longest_sequence']} of its "
                      f"{'unbounded' if e['identity_up_to'] is None else e['identity_up_to']} tokens, "
                      f"{e['checked_prompts']} prompts checked)" for n, L, e in taken)
    return [f"Answers taken from {taken[0][2]['method']}'s cell at the same length, not measured again, where the "
            "method computes exactly what the model as loaded computes on every prompt of the cell with its "
            "answer (its window covers the sequence; dynamic NTK inside the original context: "
            "`MethodConfig.identity_up_to`) and the first prompts of each task, measured under the method, "
            f"answered word for word as {taken[0][2]['method']}: {cells}. (`lcx report --equivalent-check all` "
            "measures them in full.)", ""]


def plot_heatmap(record: dict[str, Any], out: Path) -> None:
    """ruler_heatmap.png: one panel per method, task x length, colour = accuracy, k/n written in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..data.io import atomic_savefig

    ivs = record.get("ruler_intervals") or ruler_intervals(record)
    names = [n for n in record["results"] if ivs.get(n)]
    if not names:
        return
    lengths = [str(L) for L in record["config"].get("ruler_lengths", [])]
    shown = list(record["config"].get("ruler_tasks") or RULER_TASKS)  # (a report's --ruler-tasks)
    ncol = min(4, len(names))
    nrow = math.ceil(len(names) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(max(6.0, 1.2 + 1.6 * (1 + len(lengths)) * ncol), 3.4 * nrow), squeeze=False,
                             constrained_layout=True)
    im = None
    for ax, name in zip(axes.flat, names):
        grid = [[(ivs[name].get(L, {}).get("tasks", {}).get(t) or {}).get("acc", float("nan")) for L in lengths]
                for t in shown]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for r, t in enumerate(shown):
            for c, L in enumerate(lengths):
                iv = ivs[name].get(L, {}).get("tasks", {}).get(t)
                ax.text(c, r, "n/a" if iv is None else f"{iv['k']}/{iv['n']}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(lengths)), lengths, fontsize=7)
        ax.set_yticks(range(len(shown)), shown, fontsize=6)
        ax.set_title(name, fontsize=9)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.6, label="RULER accuracy (all answers found)")
    fig.suptitle(f"RULER: task x context length · {record['config']['model']}, trained context "
                 f"{record['config']['context']}\n(k/n prompts with every answer found; n/a: RULER builds no sample)",
                 fontsize=9)
    atomic_savefig(fig, out / "ruler_heatmap.png", dpi=100)
    plt.close(fig)
