"""PIE code-editing benchmark: recompute vs pie vs conflict on Python standard-library code.

    lcx bench pie --model smollm2-135m --samples 36 --ctx-tokens 512 1024
    lcx bench pie --model runs/code-smollm2-135m --split eval --samples 100 \
        --ctx-tokens 512 1024 --out results/pie_code_edit_code-smollm2-135m.json --resume
    lcx bench pie --targets context --samples 100 --ctx-tokens 512 1024 \
        --out results/pie_code_edit_context.json --resume   # lines that need the prompt
    lcx bench pie --model tiny-random --samples 6 --ctx-tokens 400 --out /tmp/pie.json
    lcx bench pie --rescore results/pie_code_edit.json   # summary from stored samples
    lcx bench pie --merge /tmp/pie512.json /tmp/pie1024.json --out results/x.json
        # one record from runs of the same settings at different --ctx-tokens (one process per core)
    lcx bench pie --compare results/base.json results/tuned.json --out results/compare.json
        # two models on the same samples: each strategy's exact match, paired (model 2 - model 1)

A record may be gzipped (`--out X.json.gz`); wherever a path `X.json` is named and only
`X.json.gz` exists, that is the one read and rewritten (the committed records are stored so).

`--split` samples from one part of lcx.data.code's by-package split of the stdlib; a model whose
train_config.json records that split (one fine-tuned with `lcx train lm --corpus stdlib-code`)
is only evaluated on `--split eval`, and only if none of its training or validation files is an
eval file. The summary gives Wilson 95% intervals for exact-match rates and, per strategy, the
paired difference of its true-line exact match to recompute's (Newcombe interval, McNemar p).

For every sample: a window of real code, a random edit (insertion / deletion / multi-place),
each strategy's cache update (cost recorded) and a greedy next-line completion; see
`studies.code_edit` for the protocol. Prints a table and writes JSON (config,
environment, git SHA, summary, per-sample records; rewritten atomically after every sample,
so an interrupted run keeps what it finished) and a PNG plot next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import Benchmark, figure
from lcx.data import io

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

STRATEGIES = ("recompute", "pie", "conflict")
DEFAULT_OUT = Path("results") / "pie_code_edit.json"
DESCRIPTION = "PIE code-editing benchmark: recompute vs pie vs conflict on Python standard-library code"
BENCH = Benchmark("pie", DESCRIPTION, __doc__, out=str(DEFAULT_OUT), threads=None, seed=0, plot=True,
                  out_help="the record, PNG beside it (default results/pie_code_edit.json, relative to the "
                           "working directory)")


@dataclass(frozen=True)
class Config:
    """The record's "config": the run's settings and what the model and the file set resolved to.
    `--resume`, `--merge` and `--compare` compare it key by key with stored records."""

    model: str
    split: str
    strategies: list[str]  # recompute first: the reference
    samples: int
    ctx_tokens: list[int]
    kinds: list[str]
    targets: str
    seed: int
    max_new_tokens: int
    backend: str
    timing_repeats: int
    device: str
    threads: int | str | None
    out: str  # as given (a gzipped record resumes under its .json name)
    no_plot: bool
    n_stdlib_files: int
    model_code_split: dict | None
    model_config: dict[str, Any]


def environment(device) -> dict:
    """lcx's run environment (without the git SHA, recorded beside it) and the device."""
    import torch

    env = {k: v for k, v in io.environment().items() if k != "git"}
    env["device"] = str(device)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def code_split_guard(model_path: str, split: str, eval_files: list[Path]) -> dict | None:
    """The model's recorded stdlib-code split (None if it has none); raises unless this run
    samples the eval split and no eval file was in the training data of the model or of any
    fine-tuning stage before it (its `init` chain, followed while the directories exist)."""
    from lcx.data.code import SPLIT_ID, stdlib_root

    records, chain, path = [], [], Path(model_path)
    while (path / "train_config.json").is_file() and str(path.resolve()) not in chain:
        chain.append(str(path.resolve()))
        cfg = json.loads((path / "train_config.json").read_text())
        if cfg.get("code_split") is not None:
            records.append(cfg["code_split"])
        init = (cfg.get("init") or {}).get("path")
        if not init:
            break
        path = Path(init)
    if not records:
        return None
    rec = records[0]
    if split != "eval":
        raise SystemExit(f"{model_path} was trained on stdlib code ({rec['split_id']}); evaluate it with "
                         f"--split eval, not --split {split}")
    eval_rel = {str(p.relative_to(stdlib_root())) for p in eval_files}
    for r in records:
        if r["split_id"] != SPLIT_ID:
            raise SystemExit(f"{model_path} (or a stage before it) was trained with split {r['split_id']}, "
                             f"this code has {SPLIT_ID}")
        overlap = sorted((set(r["train"]["files"]) | set(r["val"]["files"])) & eval_rel)
        if overlap:
            raise SystemExit(f"{len(overlap)} eval file(s) were in the model's training data, e.g. {overlap[:3]}")
    return {"split_id": rec["split_id"], "train_files_sha256": rec["train"]["files_sha256"],
            "stages_checked": len(records), "checked_no_overlap_with_eval_files": len(eval_files)}


def load(name: str, device: str):
    if name == "tiny-random":
        from lcx.models.tiny import tiny_llama

        model, tok = tiny_llama(seed=0, max_position_embeddings=4096)
        return model.to(device), tok
    from lcx.models import load_model

    return load_model(name, device=device)


def plot(record: dict, path: Path) -> None:
    """Per edit kind and strategy: update FLOPs, agreement with recompute, exact match (95% CIs)."""
    summary, cfg = record["summary"]["all_contexts"], record["config"]
    groups = [g for g in ("all", "insertion", "deletion", "multi") if g in summary]
    strategies = [s for s in STRATEGIES if s in summary["all"]]
    panels = [("flops_ratio_to_recompute", "update FLOPs / recompute", 1.0),
              ("em_vs_recompute", "same line as recompute (95% CI)", 1.0),
              ("em_vs_truth", "exact match of the true line (95% CI)", 1.0)]
    title = f"PIE code editing, {cfg['model']}, {len(record['samples'])} samples, ctx {cfg['ctx_tokens']}"
    width = 0.8 / len(strategies)
    with figure(path, 1, len(panels), figsize=(4.2 * len(panels), 3.6), title=title, title_size=9) as (fig, axes):
        for ax, (key, label, ymax) in zip(axes, panels):
            for j, s in enumerate(strategies):
                vals = [summary[g][s][key] or 0.0 for g in groups]
                ci = [summary[g][s].get(key + "_ci95") for g in groups]
                err = None
                if all(c is not None for c in ci):
                    err = [[max(0.0, v - c[0]) for v, c in zip(vals, ci)],
                           [max(0.0, c[1] - v) for v, c in zip(vals, ci)]]
                bars = ax.bar([i + (j - (len(strategies) - 1) / 2) * width for i in range(len(groups))], vals, width,
                              label=s, yerr=err, capsize=2, error_kw={"lw": 0.7})
                for b, v in zip(bars, vals):
                    ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6)
            ax.set_xticks(range(len(groups)), [f"{g}\n(n={summary[g]['n']})" for g in groups], fontsize=8)
            ax.set_ylim(0, ymax * 1.12)
            ax.set_title(label, fontsize=9)
        axes[0].legend(fontsize=7)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(ap)
    ap.add_argument("--model", default="smollm2-135m", help="preset, path, or 'tiny-random' (lcx.models.tiny)")
    ap.add_argument("--split", choices=("all", "train", "val", "eval"), default="all",
                    help="stdlib files to sample: all, or one split of lcx.data.code (a model fine-tuned on "
                         "stdlib code needs 'eval')")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES,
                    help="cache updates to run (recompute is always run: it is the reference)")
    ap.add_argument("--samples", type=int, default=36, help="samples per context length")
    ap.add_argument("--ctx-tokens", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--kinds", nargs="+", default=["insertion", "deletion", "multi"])
    ap.add_argument("--targets", choices=("any", "context"), default="any",
                    help="target lines: any non-comment line of >= 8 characters, or 'context': only lines "
                         "whose every identifier (keywords, builtins, self, cls aside) occurs in the prompt "
                         "(studies.code_edit.TARGET_POLICIES)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--backend", default="ref", help="re-rotation backend: ref | triton | cuda")
    ap.add_argument("--timing-repeats", type=int, default=1,
                    help="run each update this many times, report the median wall time")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--resume", action="store_true",
                    help="keep the samples a run with the same settings already wrote to --out (a larger "
                         "--samples extends it)")
    ap.add_argument("--rescore", type=Path, default=None, metavar="JSON",
                    help="recompute the summary (and plot) of a finished run from its stored samples, then exit")
    ap.add_argument("--compare", type=Path, nargs=2, default=None, metavar="JSON",
                    help="write to --out the paired comparison of two finished runs of different models on the "
                         "same samples (same settings but --model, --threads and --out), then exit")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                    help="write to --out one record holding the samples of these finished runs (same settings "
                         "but --ctx-tokens, --threads and --out), then exit")


def run(args: argparse.Namespace) -> int:
    if args.rescore is not None:
        return rescore(io.json_path(args.rescore), plot_it=not args.no_plot)
    if args.merge is not None:
        return merge(args.merge, io.json_path(args.out), plot_it=not args.no_plot)
    if args.compare is not None:
        if args.out == DEFAULT_OUT:
            raise SystemExit(f"--compare writes a comparison, not a run: give --out (not the default {DEFAULT_OUT})")
        return compare(*args.compare, out=args.out)
    # a record stored gzipped (X.json.gz, as the committed ones are) is resumed and rewritten as
    # such; its config keeps the name given (so a gzipped record resumes under its .json name)
    given_out, args.out = args.out, io.json_path(args.out)
    strategies = ["recompute", *[s for s in args.strategies if s != "recompute"]]

    import torch

    from benchmarks.harness import config_dict
    from studies.code_edit import SampleResult, evaluate, make_samples, stdlib_files, summarize

    BENCH.resolve_threads(args)
    device = torch.device(args.device)
    model, tok = load(args.model, args.device)
    files = stdlib_files(split=None if args.split == "all" else args.split)
    guard = code_split_guard(args.model, args.split, files)
    config = Config(
        model=args.model, split=args.split, strategies=strategies, samples=args.samples, ctx_tokens=args.ctx_tokens,
        kinds=args.kinds, targets=args.targets, seed=args.seed, max_new_tokens=args.max_new_tokens,
        backend=args.backend, timing_repeats=args.timing_repeats, device=args.device, threads=args.threads,
        out=str(given_out), no_plot=args.no_plot, n_stdlib_files=len(files), model_code_split=guard,
        model_config={k: getattr(model.config, k, None) for k in (
            "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_parameters")})
    rec = BENCH.start(args, config)
    record = {"benchmark": "pie_code_edit", "config": config_dict(config), "environment": environment(device),
              "git": io.git_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "complete": False,
              "summary": {}, "samples": []}

    results, done = [], {}
    if args.resume and args.out.is_file():
        old = io.read_json(args.out)
        # the samples of a context are drawn in order from its own seed, so only their number may change
        if {**old.get("config", {}), "samples": None} != {**json.loads(json.dumps(record["config"])), "samples": None}:
            raise SystemExit(f"--resume: {args.out} was written with other settings; drop --resume to start over")
        results = [SampleResult(**x) for x in old["samples"] if x["sample"]["index"] < args.samples]
        done = {(r.sample["ctx_tokens"], r.sample["index"]) for r in results}
        record.update(started=old["started"], resumed=[*old.get("resumed", []), len(results)])
        rec.log(f"--resume: keeping {len(results)} samples from {args.out}")
    todo = ((ctx, i, s) for ctx in args.ctx_tokens
            for i, s in enumerate(make_samples(tok, args.samples, ctx, kinds=args.kinds, seed=args.seed + ctx,
                                               files=files, targets=args.targets)))
    for ctx, i, s in rec.progress(todo, unit="sample", total=len(args.ctx_tokens) * args.samples):
        if (ctx, i) in done:
            continue
        (r,) = evaluate(model, tok, [s], strategies=strategies, backend=args.backend,
                        max_new_tokens=args.max_new_tokens, timing_repeats=args.timing_repeats,
                        log=lambda m: rec.log(f"ctx={ctx} #{i} {m}"))
        r.sample.update(ctx_tokens=ctx, index=i)
        results.append(r)
        record["samples"] = [asdict(x) for x in results]
        record["summary"] = {"all_contexts": summarize(results, strategies)}
        rec.write(record, rows=("samples",))
    record["samples"] = [asdict(x) for x in results]
    record["summary"] = summaries(results, args.ctx_tokens, strategies)
    record["complete"] = True
    record["elapsed_s"] = rec.elapsed()
    print_table(record, f"{args.model}: {len(results)} samples, contexts {args.ctx_tokens}")
    rec.write(record, rows=("samples",), quiet=False)
    if rec.plot:
        rec.draw(plot, record)
    return 0


def summaries(results: list, ctx_tokens: list[int], strategies: list[str]) -> dict:
    from studies.code_edit import summarize

    by_ctx = {f"ctx_{c}": summarize([r for r in results if r.sample["ctx_tokens"] == c], strategies)
              for c in ctx_tokens if any(r.sample["ctx_tokens"] == c for r in results)}
    return {"all_contexts": summarize(results, strategies), **by_ctx}


def _ci(x: dict, key: str) -> str:
    ci = x.get(key + "_ci95")
    return f"{x[key]:.3f} [{ci[0]:.2f},{ci[1]:.2f}]" if ci else f"{x[key]:.3f}"


def print_table(record: dict, title: str) -> None:
    print(f"\n{title}")
    print(f"{'context':13s} {'group':10s} {'strategy':10s} {'n':>4s} {'EM vs recompute':>21s} {'EM vs true line':>21s} "
          f"{'minus recompute [95% CI]':>26s} {'FLOP/rec':>9s}")
    for ctx, rows in record["summary"].items():
        for g, row in rows.items():
            for s in (s for s in STRATEGIES if s in row):
                x = row[s]
                d = x.get("em_vs_truth_minus_recompute")
                dtxt = f"{d['diff']:+.3f} [{d['ci95'][0]:+.2f},{d['ci95'][1]:+.2f}]" if d and d["ci95"] else ""
                print(f"{ctx:13s} {g:10s} {s:10s} {row['n']:4d} {_ci(x, 'em_vs_recompute'):>21s} "
                      f"{_ci(x, 'em_vs_truth'):>21s} {dtxt:>26s} {x['flops_ratio_to_recompute']:9.3f}")


MERGE_FREE = ("ctx_tokens", "threads", "out")  # settings in which merged runs may differ


def merge(paths: list[Path], out: Path, plot_it: bool = True) -> int:
    """One record from finished runs that differ only in `MERGE_FREE` settings and hold
    disjoint context lengths: their samples, the summary over all of them, per-run provenance."""
    from studies.code_edit import SampleResult

    records = [io.read_json(p) for p in paths]
    for p, r in zip(paths, records):
        if not r.get("complete"):
            raise SystemExit(f"--merge: {p} is not a finished run")
    base = {k: v for k, v in records[0]["config"].items() if k not in MERGE_FREE}
    for p, r in zip(paths[1:], records[1:]):
        other = {k: v for k, v in r["config"].items() if k not in MERGE_FREE}
        if other != base:
            diff = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k))
            raise SystemExit(f"--merge: {p} differs from {paths[0]} in {diff}")
    ctx = [c for r in records for c in r["config"]["ctx_tokens"]]
    if len(set(ctx)) != len(ctx):
        raise SystemExit(f"--merge: the runs overlap in context lengths {ctx}")
    results = [SampleResult(**x) for r in records for x in r["samples"]]
    strategies = base.get("strategies", list(STRATEGIES))
    config = {**base, "ctx_tokens": ctx, "out": str(out),
              "threads": sorted({r["config"].get("threads") for r in records}, key=str)}
    record = {"benchmark": "pie_code_edit", "config": config, "environment": records[0]["environment"],
              "git": records[0]["git"], "started": min(r["started"] for r in records), "complete": True,
              "summary": summaries(results, ctx, strategies), "samples": [asdict(x) for x in results],
              "elapsed_s": sum(r.get("elapsed_s", 0.0) for r in records),
              "merged_from": [{"path": str(p), "ctx_tokens": r["config"]["ctx_tokens"], "git": r["git"],
                               "environment": r["environment"], "elapsed_s": r.get("elapsed_s")}
                              for p, r in zip(paths, records)]}
    io.atomic_write_json(out, record, rows=("samples",))
    print_table(record, f"{base['model']}: {len(results)} samples (merged), contexts {ctx}")
    if plot_it:
        plot(record, io.with_suffix(out, ".png"))
    return 0


SAMPLE_KEYS = ("ctx_tokens", "index", "source", "kind", "target", "n_old", "n_new", "n_edits", "first_edit")
COMPARE_FREE = ("model", "model_config", "model_code_split", "threads", "out")  # may differ between models


def compare(first: Path, second: Path, out: Path) -> int:
    """Two models on the same samples: per context (and over all) and per strategy, each model's
    true-line exact match with its Wilson interval and the paired difference (second - first:
    Newcombe interval, McNemar p). The runs must be finished, differ only in `COMPARE_FREE`
    settings and hold the same samples (`SAMPLE_KEYS`: both models use one tokenizer)."""
    from studies.code_edit import exact_match, paired_difference, wilson_interval

    recs = [io.read_json(p) for p in (first, second)]
    for p, r in zip((first, second), recs):
        if not r.get("complete"):
            raise SystemExit(f"--compare: {p} is not a finished run")
    cfg = [{k: v for k, v in r["config"].items() if k not in COMPARE_FREE} for r in recs]
    if cfg[0] != cfg[1]:
        diff = sorted(k for k in cfg[0].keys() | cfg[1].keys() if cfg[0].get(k) != cfg[1].get(k))
        raise SystemExit(f"--compare: {second} differs from {first} in {diff}")
    keyed = [{(x["sample"]["ctx_tokens"], x["sample"]["index"]): x for x in r["samples"]} for r in recs]
    if keyed[0].keys() != keyed[1].keys():
        raise SystemExit("--compare: the runs hold different samples (context lengths or counts)")
    keys = sorted(keyed[0])
    for k in keys:
        a, b = ({f: keyed[i][k]["sample"].get(f) for f in SAMPLE_KEYS} for i in (0, 1))
        if a != b:
            raise SystemExit(f"--compare: sample {k} differs between the runs (another tokenizer?): {a} vs {b}")
    models = [r["config"]["model"] for r in recs]
    strategies = [s for s in recs[0]["config"]["strategies"] if s in recs[1]["config"]["strategies"]]
    groups = {"all_contexts": keys, **{f"ctx_{c}": [k for k in keys if k[0] == c] for c in recs[0]["config"]["ctx_tokens"]}}
    summary: dict = {}
    for g, ks in groups.items():
        summary[g] = {"n": len(ks)}
        for s in strategies:
            em = [[exact_match(keyed[i][k]["completions"][s], keyed[i][k]["sample"]["target"]) for k in ks] for i in (0, 1)]
            summary[g][s] = {
                **{f"em_vs_truth_{j + 1}": sum(em[j]) / len(ks) if ks else None for j in (0, 1)},
                **{f"em_vs_truth_{j + 1}_ci95": wilson_interval(sum(em[j]), len(ks)) for j in (0, 1)},
                "second_minus_first": paired_difference(em[1], em[0])}
    record = {"benchmark": "pie_code_edit_compare", "models": models, "runs": [str(first), str(second)],
              "config": cfg[0], "git": [r["git"] for r in recs], "compared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "compare_git": io.git_info(), "summary": summary}
    io.atomic_write_json(out, record)
    print(f"\nexact match of the true line: 1 = {models[0]}, 2 = {models[1]} (same samples)")
    print(f"{'group':13s} {'strategy':10s} {'n':>4s} {'model 1':>19s} {'model 2':>19s} {'2 - 1 [95% CI]':>24s} {'McNemar p':>9s}")
    for g, row in summary.items():
        for s in strategies:
            x, d = row[s], row[s]["second_minus_first"]
            c1, c2 = x["em_vs_truth_1_ci95"], x["em_vs_truth_2_ci95"]
            print(f"{g:13s} {s:10s} {row['n']:4d} {x['em_vs_truth_1']:.3f} [{c1[0]:.2f},{c1[1]:.2f}] "
                  f"{x['em_vs_truth_2']:.3f} [{c2[0]:.2f},{c2[1]:.2f}] "
                  f"{d['diff']:+.3f} [{d['ci95'][0]:+.2f},{d['ci95'][1]:+.2f}] {d['mcnemar_p']:9.2g}")
    print(f"wrote {out}")
    return 0


def rescore(path: Path, plot_it: bool = True) -> int:
    """Recompute `path`'s summary from its per-sample records (completions, targets, costs are
    stored; nothing is re-run) with the current `summarize`, and rewrite it (and its plot)."""
    from studies.code_edit import SampleResult

    record = io.read_json(path)
    cfg = record["config"]
    results = [SampleResult(**x) for x in record["samples"]]
    strategies = cfg.get("strategies", list(STRATEGIES))
    record["summary"] = summaries(results, cfg["ctx_tokens"], strategies)
    record["rescored"] = {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": io.git_info(),
                          "note": "summary recomputed from the stored samples by lcx bench pie --rescore"}
    io.atomic_write_json(path, record, rows=("samples",))
    print_table(record, f"{cfg['model']}: {len(results)} samples (rescored), contexts {cfg['ctx_tokens']}")
    if plot_it:
        plot(record, io.with_suffix(path, ".png"))
    return 0


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
