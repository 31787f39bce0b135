"""`lcx bench lmeval`: passkey accuracy (by depth and length) and perplexity by length, through the `lm_eval` CLI.

For each model and method this runs, literally,

    lm_eval --model lcx --model_args pretrained=<model>[,rope_type=<m>,factor=<s>] \\
        --tasks passkey,lcx_ppl,lcx_ppl_tail --metadata '{"max_seq_lengths": [...], ...}' --log_samples ...

then writes (atomically)

    results/lmeval/lmeval_results.json     config, environment, git SHA, all numbers
    results/lmeval/passkey_heatmap.png     accuracy by insertion depth x context length
    results/lmeval/ppl_by_length.png       bits per byte by context length (lcx_ppl, lcx_ppl_tail)
    results/lmeval/raw/<model>__<method>.json   lm-eval's own results file of each run

and prints a short table. `vanilla` is the model as loaded, still through `--model lcx` so
nothing is truncated to its context. Budget (2 CPU cores): the bundled tiny-5m (context 256)
runs the full grid up to 8x its context; SmolLM2-135M (context 8192) takes ~10 s per
1k-token forward pass on 2 busy cores, so its lengths stop at 2048 (inside its context: this
measures what each method costs where no extrapolation is needed, not extrapolation).

    lcx bench lmeval                         # both models, each its PLANS methods
    lcx bench lmeval --models tiny-5m --presets vanilla,yarn --quick --out /tmp/x

The record keeps the shape of the committed results/lmeval/lmeval_results.json (`config`,
`environment` with the git SHA, `runs`), written atomically through `lcx.data.io`.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import Benchmark, figure

DESCRIPTION = "passkey (depth x length) and perplexity by length of RoPE methods, through lm_eval --model lcx"
OUT = Path("results") / "lmeval"  # relative to the working directory
BENCH = Benchmark("lmeval", DESCRIPTION, __doc__, out=str(OUT), threads=2,
                  out_help="output folder, relative to the working directory (default: %(default)s)",
                  threads_help="torch threads per lm_eval run (default: %(default)s)")

# Per model: RoPE factor of the methods, passkey grid, perplexity lengths/docs.
PLANS = {
    "tiny-5m": dict(factor=8, lengths=[128, 256, 512, 1024, 2048], depths=5, samples_per_depth=1,
                    ppl_docs=16, methods=["vanilla", "linear", "ntk", "yarn", "dynamic"]),
    "smollm2-135m": dict(factor=4, lengths=[512, 1024, 2048], depths=3, samples_per_depth=1, ppl_docs=3,
                         methods=["vanilla", "yarn", "dynamic"]),
}
TASKS = ("passkey", "lcx_ppl", "lcx_ppl_tail")
METHODS = ("vanilla", "linear", "ntk", "yarn", "dynamic")  # lcx.presets names (RoPE factor from PLANS)
# --quick: a plumbing check in about a minute per run (numbers not meant for reading).
QUICK = dict(depths=2, samples_per_depth=1, ppl_docs=2)


@dataclass(frozen=True)
class Config:
    models: dict[str, dict[str, Any]]  # name -> its plan (PLANS, --quick applied), methods, context
    methods: dict[str, dict[str, Any]]  # name -> what is recorded of it (`_recorded`)
    quick: bool
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    command: str = "lm_eval --model lcx ..."

    def to_dict(self) -> dict[str, Any]:
        return {"models": self.models, "methods": self.methods, "tasks": self.tasks, "command": self.command,
                "quick": self.quick}


def model_args(model: str, method: str, factor: float) -> str:
    from lcx import presets

    cfg = presets.config(method, L0=context_of(model), factor=factor)
    return ",".join([f"pretrained={model}", *([cfg.to_model_args()] if not cfg.is_identity else [])])


def _recorded(method: str) -> dict:
    """What the results file records per method: the RoPE type, without the per-model factor."""
    return {"rope_type": method} if method != "vanilla" else {}


def context_of(model: str) -> int:
    """The model's max_position_embeddings, from its config file (no weights loaded)."""
    from lcx.report import model_context

    return model_context(model)


def run_lm_eval(model: str, method: str, plan: dict, threads: int, workdir: Path) -> tuple[dict, dict]:
    """One `lm_eval` run; returns (lm-eval's results JSON, passkey samples by doc)."""
    meta = {"max_seq_lengths": plan["lengths"], "depths": plan["depths"],
            "samples_per_depth": plan["samples_per_depth"], "max_docs": plan["ppl_docs"]}
    exe = shutil.which("lm_eval") or str(Path(sys.executable).with_name("lm_eval"))
    cmd = [exe, "--model", "lcx", "--model_args", model_args(model, method, plan["factor"]),
           "--tasks", ",".join(TASKS), "--metadata", json.dumps(meta), "--device", "cpu",
           "--output_path", str(workdir), "--log_samples"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false")
    env.pop("LCX_NO_LMEVAL_HOOK", None)
    print("$", " ".join(cmd[:1] + [f"'{c}'" if "{" in c else c for c in cmd[1:]]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    (res_path,) = glob.glob(str(workdir / "**" / "results_*.json"), recursive=True)
    (samples_path,) = glob.glob(str(workdir / "**" / "samples_passkey_*.jsonl"), recursive=True)
    results = json.loads(Path(res_path).read_text())
    results["lcx_wall_s"] = time.perf_counter() - t0
    samples = [json.loads(line) for line in Path(samples_path).read_text().splitlines() if line.strip()]
    return results, {"samples": samples, "raw_path": res_path}


def summarize(results: dict, samples: list[dict], lengths: list[int]) -> dict:
    pk = results["results"]["passkey"]
    by_depth: dict[str, dict[str, list[float]]] = {}
    for s in samples:
        row = by_depth.setdefault(f"{s['doc']['depth']:.3f}", {})
        for L in lengths:
            row.setdefault(str(L), []).append(float(s[str(L)]))
    return {
        "passkey_by_length": {str(L): pk[f"{L},none"] for L in lengths},
        "passkey_by_depth_length": {d: {L: sum(v) / len(v) for L, v in row.items()}
                                    for d, row in sorted(by_depth.items(), key=lambda kv: float(kv[0]))},
        "passkey_docs": len(samples),
        **{f"{task}_by_length": {str(L): {m: results["results"][task][f"{m}_{L},none"] for m in
                                          ("word_perplexity", "byte_perplexity", "bits_per_byte")}
                                 for L in lengths}
           for task in ("lcx_ppl", "lcx_ppl_tail")},
        "ppl_docs": results["n-samples"]["lcx_ppl"]["effective"],
        "model_args": results["config"]["model_args"],
        "wall_s": round(results["lcx_wall_s"], 1),
    }


def plot(record: dict, out: Path) -> None:
    """passkey_heatmap.png (accuracy by depth x length, per model and method) and ppl_by_length.png
    (bits per byte by length, lcx_ppl and lcx_ppl_tail) in the folder `out`."""
    runs = record["runs"]
    models = list(runs)
    n_methods = max(len(runs[m]) for m in models)
    with figure(out / "passkey_heatmap.png", len(models), n_methods, layout="constrained", squeeze=False,
                figsize=(3.2 * n_methods, 2.9 * len(models))) as (fig, axes):
        for i, model in enumerate(models):
            for j in range(n_methods):
                ax = axes[i][j]
                if j >= len(runs[model]):
                    ax.axis("off")
                    continue
                method = list(runs[model])[j]
                grid = runs[model][method]["passkey_by_depth_length"]
                depths = list(grid)
                lengths = list(next(iter(grid.values())))
                mat = [[grid[d][L] for L in lengths] for d in depths]
                im = ax.imshow(mat, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
                ax.set_xticks(range(len(lengths)), lengths, fontsize=7, rotation=45)
                ax.set_yticks(range(len(depths)), [f"{float(d):.0%}" for d in depths], fontsize=7)
                ctx = record["config"]["models"][model]["context"]
                ax.set_title(f"{model} · {method}", fontsize=9)
                if ctx in [int(L) for L in lengths]:
                    k = [int(L) for L in lengths].index(ctx)
                    ax.axvline(k + 0.5, color="k", lw=1, ls="--")
                if j == 0:
                    ax.set_ylabel("needle depth")
                if i == len(models) - 1:
                    ax.set_xlabel("context length (tokens)")
        fig.colorbar(im, ax=axes, shrink=0.6, label="passkey accuracy")

    with figure(out / "ppl_by_length.png", 2, len(models), layout="constrained", squeeze=False,
                figsize=(4.6 * len(models), 6.4)) as (fig, axes):
        for row, (task, what) in enumerate((("lcx_ppl", "whole window of L tokens"),
                                            ("lcx_ppl_tail", "tokens L/2..L given the first half"))):
            for ax, model in zip(axes[row], models):
                for method, r in runs[model].items():
                    by_len = r[f"{task}_by_length"]
                    Ls = [int(L) for L in by_len]
                    ax.plot(Ls, [by_len[str(L)]["bits_per_byte"] for L in Ls], marker="o", label=method)
                ctx = record["config"]["models"][model]["context"]
                ax.axvline(ctx, color="k", lw=1, ls="--", label=f"model context {ctx}")
                ax.set_xscale("log", base=2)
                ax.set_xlabel("context length L (tokens)")
                ax.set_ylabel("bits per byte (lower is better)")
                ax.set_title(f"{task} · {model}\n{what}", fontsize=9)
                ax.legend(fontsize=7)


def table(record: dict) -> str:
    lines = []
    for model, runs in record["runs"].items():
        lengths = list(next(iter(runs.values()))["passkey_by_length"])
        lines.append(f"\n{model}  (context {record['config']['models'][model]['context']})")
        lines.append(f"{'method':<10} {'metric':<14} " + " ".join(f"{L:>7}" for L in lengths))
        for method, r in runs.items():
            lines.append(f"{method:<10} {'passkey acc':<14} " +
                         " ".join(f"{r['passkey_by_length'][L]:>7.2f}" for L in lengths))
            for task, label in (("lcx_ppl", "bpb window"), ("lcx_ppl_tail", "bpb 2nd half")):
                lines.append(f"{'':<10} {label:<14} " +
                             " ".join(f"{r[task + '_by_length'][L]['bits_per_byte']:>7.3f}" for L in lengths))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from lcx.presets import add_presets_argument  # torch: imported when the command is built

    BENCH.add_arguments(p)
    p.add_argument("--models", default=",".join(PLANS), help="comma-separated presets (default: %(default)s)")
    add_presets_argument(p, default=None,
                         help=f"comma-separated, from {sorted(METHODS)} (default: each model's list in PLANS)")
    p.add_argument("--quick", action="store_true",
                   help="plumbing check: 2 depths, 1 sample, 2 ppl docs, the 3 shortest lengths")


def run(args: argparse.Namespace) -> int:
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in PLANS]
    if bad:
        raise ValueError(f"unknown model(s) {bad}; known: {sorted(PLANS)}")
    methods_of = {m: ([x for x in args.presets.split(",") if x] if args.presets else PLANS[m]["methods"])
                  for m in models}
    bad = sorted({x for ms in methods_of.values() for x in ms if x not in METHODS})
    if bad:
        raise ValueError(f"unknown method(s) {bad}; known: {sorted(METHODS)}")
    methods = [m for m in METHODS if any(m in ms for ms in methods_of.values())]

    from lcx.data.io import environment

    threads = BENCH.resolve_threads(args, apply=False)  # each lm_eval process's OMP_NUM_THREADS
    plans = {m: dict(PLANS[m]) for m in models}
    if args.quick:
        for plan in plans.values():
            plan.update(QUICK, lengths=plan["lengths"][:3])
    config = Config(models={m: {**plans[m], "methods": methods_of[m], "context": context_of(m)} for m in models},
                    methods={m: _recorded(m) for m in methods}, quick=args.quick)
    rec = BENCH.start(args, config)
    record = {"config": config.to_dict(), "environment": environment(), "runs": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for model, method in rec.progress([(m, x) for m in models for x in methods_of[m]], unit="run"):
        plan = plans[model]
        with tempfile.TemporaryDirectory(prefix="lmeval-") as tmp:
            results, extra = run_lm_eval(model, method, plan, threads, Path(tmp))
            summary = summarize(results, extra["samples"], plan["lengths"])
            rec.write(results, args.out / "raw" / f"{model}__{method}.json")
        record["runs"].setdefault(model, {})[method] = summary
        rec.log(f"  {model} {method}: passkey {summary['passkey_by_length']}  ({summary['wall_s']} s)")
    rec.write(record, args.out / "lmeval_results.json")
    plot(record, args.out)
    print(table(record))
    print(f"\nwrote {args.out / 'lmeval_results.json'}, passkey_heatmap.png, ppl_by_length.png")
    return 0 if all(math.isfinite(v["bits_per_byte"]) for runs in record["runs"].values() for r in runs.values()
                    for task in ("lcx_ppl", "lcx_ppl_tail") for v in r[f"{task}_by_length"].values()) else 1


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
