"""`lcx demo`: how far does each RoPE scaling method carry the bundled model past its training length?

The bundled `tiny-5m` model was trained on 256-token windows (max_position_embeddings 256,
theta 10000, head_dim 64). With no fine-tuning, each method below is applied at inference only
and the model's perplexity is measured on held-out text (works never seen in training) at
256, 512, 1024, 2048 and 4096 tokens, by `lcx.eval.perplexity.perplexity_by_length`: the same
8 chunks of 4096 tokens spread over the held-out set, tiled into windows of each length
(32768 tokens per length), every token but a window's first scored.

Methods (`lcx.presets`; L = 256, target 4096 so s = 16 wherever a factor applies):

    vanilla    the model as trained (no patch)
    linear     position interpolation, inv_freq / 16
    ntk        static NTK-aware, base 10000 * 16^(64/62)
    dynamic    dynamic NTK, s = 16: unscaled up to 256, base grows with the window length
    yarn       YaRN s = 16, beta_fast 32, beta_slow 1, attention factor 0.1 ln 16 + 1 = 1.277
    llama3     Llama-3.1 banding, s = 16, low/high freq factor 1/4
    truncate   Giraffe truncation at T = 256 (wavelengths <= 256 kept, longer ones set to
               2*pi/(16*256) or to 0 below 2*pi/(8*256))

Writes `results/rope_extrapolation_tiny.json` (config, environment, git SHA, numbers) and a PNG
(log perplexity vs length, one line per method, the training length marked), both atomically.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from .presets import add_presets_argument

TRAIN_LENGTH = 256
LENGTHS = (256, 512, 1024, 2048, 4096)
QUICK_LENGTHS = (256, 1024)
FACTOR = LENGTHS[-1] / TRAIN_LENGTH  # 16
MAX_TOKENS = 32768
QUICK_MAX_TOKENS = 2048

# `lcx.presets` names (the RoPE-only ones); theta and L are filled from the model.
METHODS = ("vanilla", "linear", "ntk", "dynamic", "yarn", "llama3", "truncate")
ALIASES = {"default": "vanilla"}  # the name this demo used before lcx.presets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "Methods: " + ", ".join(METHODS) + f" (factor {FACTOR:g} = {LENGTHS[-1]}/{TRAIN_LENGTH};\n"
        f"truncate at T = {TRAIN_LENGTH}). Scores {MAX_TOKENS} held-out tokens per length.\n"
        "Takes about 3-5 minutes on 2 CPU cores; --quick about 15 s.\n"
    )
    parser.add_argument("--model", default="tiny-5m", help="preset or HF directory (default tiny-5m)")
    parser.add_argument("--quick", action="store_true",
                        help=f"CI smoke run: lengths {','.join(map(str, QUICK_LENGTHS))}, "
                             f"{QUICK_MAX_TOKENS} tokens per length; writes files only with --out")
    add_presets_argument(parser, default=None, help=f"comma-separated subset of {','.join(METHODS)} (default all)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"token budget per length (default {MAX_TOKENS}, --quick {QUICK_MAX_TOKENS})")
    parser.add_argument("--out", default=None,
                        help="output prefix for .json and .png (default results/rope_extrapolation_tiny; "
                             "none with --quick)")
    from .threads import add_threads_argument

    add_threads_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def plot(results: Mapping[str, Mapping[int, Any]], path: str | Path, *, train_length: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lcx.data.io import atomic_savefig

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), sharey=False)
    for ax, key, sub in ((axes[0], "ppl", "all scored tokens"), (axes[1], "tail_ppl", "last 256 positions of each window")):
        for name, res in results.items():
            ns = sorted(res)
            ax.plot(ns, [math.log(getattr(res[n], key)) for n in ns], "o-", label=name, lw=1.5, ms=4)
        ax.axvline(train_length, color="k", ls="--", lw=1)
        ax.text(train_length, 0.98, " training length", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({n for r in results.values() for n in r}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("log perplexity (nats/token)")
        ax.set_title(sub, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from lcx.data.io import atomic_write_json, environment
    from lcx.data.tokenizer import encode_documents
    from lcx.eval.perplexity import format_table, load_texts, perplexity_of_stream, resolve_spec
    from lcx import presets
    from lcx.models import load_model

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would interleave with ours
    from .allocator import reuse_freed_memory
    from .threads import resolve_threads

    resolve_threads(args.threads)
    reuse_freed_memory()
    methods = list(METHODS) if not args.presets else [ALIASES.get(m.strip(), m.strip())
                                                       for m in args.presets.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    budget = args.max_tokens or (QUICK_MAX_TOKENS if args.quick else MAX_TOKENS)
    out = args.out if args.out is not None else (None if args.quick else "results/rope_extrapolation_tiny")

    model, tok = load_model(args.model)
    configs = {m: presets.config(m, L0=TRAIN_LENGTH, factor=FACTOR) for m in methods}
    specs = {m: resolve_spec(model, c.rope) for m, c in configs.items()}  # fail fast on a bad spec
    names, texts = load_texts("validation")
    ids = torch.tensor(encode_documents(tok, texts))  # once, shared by every method
    results, seconds = {}, {}
    t_all = time.perf_counter()
    for m in methods:
        t0 = time.perf_counter()
        results[m] = perplexity_of_stream(model, ids, lengths, spec=configs[m], max_tokens_per_length=budget,
                                          progress=not args.no_progress)
        seconds[m] = time.perf_counter() - t0
        if not args.no_progress:
            print(f"{m:>10}: " + "  ".join(f"{n}:{r.ppl:.1f}" for n, r in results[m].items())
                  + f"  ({seconds[m]:.0f}s)", flush=True)
    total_s = time.perf_counter() - t_all
    first = next(iter(results.values()))
    print(f"\nPerplexity of {args.model} on held-out text (trained at {TRAIN_LENGTH} tokens; "
          f"{first[lengths[0]].tokens + first[lengths[0]].windows} tokens per length):\n")
    print(format_table(results))
    print(f"\nSame, scoring only the last 256 positions of each window:\n")
    print(format_table(results, tail=True))
    print(f"\n{total_s:.0f}s on {torch.get_num_threads()} threads")
    if out:
        env = environment()
        record = {
            "description": "perplexity vs context length per RoPE method, applied at inference without fine-tuning",
            "config": {
                "model": str(args.model), "train_length": TRAIN_LENGTH, "lengths": list(lengths),
                "max_tokens_per_length": budget, "tail": 256, "quick": bool(args.quick),
                "texts": {"split": "validation", "documents": names},
                "scoring": "same chunks of max(lengths) tokens for every length, tiled into non-overlapping "
                           "windows; every token of a window but the first is scored",
                "methods": {m: (s.to_dict() if s is not None else None) for m, s in specs.items()},
            },
            "git": env.pop("git"),
            "environment": env,
            "seconds": {**seconds, "total": total_s},
            "results": {m: [r.to_dict() for r in res.values()] for m, res in results.items()},
        }
        atomic_write_json(f"{out}.json", record)
        plot(results, f"{out}.png", train_length=TRAIN_LENGTH,
             title=f"{args.model}: RoPE scaling without fine-tuning (trained at {TRAIN_LENGTH} tokens; "
                   f"s = {FACTOR:g})")
        print(f"wrote {out}.json and {out}.png")
    return 0
