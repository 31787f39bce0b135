#!/usr/bin/env python
"""PIE code-editing benchmark: recompute vs pie vs conflict on Python standard-library code.

    python scripts/bench_pie.py --model smollm2-135m --samples 36 --ctx-tokens 512 1024
    python scripts/bench_pie.py --model tiny-random --samples 6 --ctx-tokens 400 --out /tmp/pie.json

For every sample: a window of real code, a random edit (insertion / deletion / multi-place),
each strategy's cache update (cost recorded) and a greedy next-line completion; see
`lcx.cache.code_edit_eval` for the protocol. Prints a table and writes JSON (config,
environment, git SHA, summary, per-sample records; rewritten atomically after every sample,
so an interrupted run keeps what it finished) and a PNG plot next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("recompute", "pie", "conflict")


def git_sha() -> dict:
    def run(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"sha": run("rev-parse", "HEAD") or None, "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}


def environment(device) -> dict:
    import torch
    import transformers

    env = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": str(device), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def write_json_atomic(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(name: str, device: str):
    if name == "tiny-random":
        from lcx.models.tiny import tiny_llama

        model, tok = tiny_llama(seed=0, max_position_embeddings=4096)
        return model.to(device), tok
    from lcx.models import load_model

    return load_model(name, device=device)


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in ("all", "insertion", "deletion", "multi") if g in summary]
    panels = [("flops_ratio_to_recompute", "update FLOPs / recompute", 1.0),
              ("es_vs_recompute", "edit similarity vs recompute", 1.0),
              ("es_vs_truth", "edit similarity vs true line", 1.0)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    width = 0.8 / len(STRATEGIES)
    for ax, (key, label, ymax) in zip(axes, panels):
        for j, s in enumerate(STRATEGIES):
            vals = [summary[g][s][key] or 0.0 for g in groups]
            bars = ax.bar([i + (j - 1) * width for i in range(len(groups))], vals, width, label=s)
            for b, v in zip(bars, vals):
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(groups)), [f"{g}\n(n={summary[g]['n']})" for g in groups], fontsize=8)
        ax.set_ylim(0, ymax * 1.12)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--model", default="smollm2-135m", help="preset, path, or 'tiny-random' (lcx.models.tiny)")
    ap.add_argument("--samples", type=int, default=36, help="samples per context length")
    ap.add_argument("--ctx-tokens", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--kinds", nargs="+", default=["insertion", "deletion", "multi"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--backend", default="ref", help="re-rotation backend: ref | triton | cuda")
    ap.add_argument("--timing-repeats", type=int, default=1,
                    help="run each update this many times, report the median wall time")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "pie_code_edit.json")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from lcx.cache.code_edit_eval import evaluate, make_samples, stdlib_files, summarize

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    t_start = time.time()
    model, tok = load(args.model, args.device)
    files = stdlib_files()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.update(strategies=list(STRATEGIES), n_stdlib_files=len(files),
                  model_config={k: getattr(model.config, k, None) for k in (
                      "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_parameters")})
    record = {"benchmark": "pie_code_edit", "config": config, "environment": environment(device),
              "git": git_sha(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "complete": False,
              "summary": {}, "samples": []}

    results = []
    for ctx in args.ctx_tokens:
        samples = make_samples(tok, args.samples, ctx, kinds=args.kinds, seed=args.seed + ctx, files=files)
        for s in samples:
            (r,) = evaluate(model, tok, [s], backend=args.backend, max_new_tokens=args.max_new_tokens,
                            timing_repeats=args.timing_repeats, log=lambda m: print(f"ctx={ctx} {m}", flush=True))
            r.sample["ctx_tokens"] = ctx
            results.append(r)
            record["samples"] = [asdict(x) for x in results]
            record["summary"] = {"all_contexts": summarize(results)}
            write_json_atomic(args.out, record)
    by_ctx = {f"ctx_{c}": summarize([r for r in results if r.sample["ctx_tokens"] == c]) for c in args.ctx_tokens}
    record["summary"] = {"all_contexts": summarize(results), **by_ctx}
    record["complete"] = True
    record["elapsed_s"] = time.time() - t_start
    write_json_atomic(args.out, record)

    s_all = record["summary"]["all_contexts"]
    print(f"\n{args.model}: {len(results)} samples, contexts {args.ctx_tokens}")
    print(f"{'group':10s} {'strategy':10s} {'EM/rec':>7s} {'ES/rec':>7s} {'EM/true':>8s} {'ES/true':>8s} "
          f"{'tok/rec':>8s} {'FLOP/rec':>9s} {'wall/rec':>9s}")
    for g, row in s_all.items():
        for s in STRATEGIES:
            x = row[s]
            print(f"{g:10s} {s:10s} {x['em_vs_recompute']:7.2f} {x['es_vs_recompute']:7.2f} {x['em_vs_truth']:8.2f} "
                  f"{x['es_vs_truth']:8.2f} {x['tokens_ratio_to_recompute']:8.3f} {x['flops_ratio_to_recompute']:9.3f} "
                  f"{x['wall_ratio_to_recompute']:9.3f}")
    if not args.no_plot:
        png = args.out.with_suffix(".png")
        plot(s_all, png, f"PIE code editing, {args.model}, {len(results)} samples, ctx {args.ctx_tokens}")
        print(f"wrote {args.out} and {png}")
    else:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
