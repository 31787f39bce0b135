"""`lcx bench extrapolation`: attention methods and RoPE scaling on tiny-5m, perplexity + passkey.

    lcx bench extrapolation                  # -> results/extrapolation_tiny.{json,png}
    lcx bench extrapolation --quick --out /tmp/x.json
    lcx bench extrapolation --resume         # skip (method, metric) already in --out

No fine-tuning: every method is applied at inference to the bundled tiny-5m (trained at 256
tokens). Methods (`methods()`): vanilla; LM-Infinite (G global, L = 256 local keys); sliding
window of 256; StreamingLLM sinks (4 sinks + 256 window, positions renumbered); YaRN x32
(256 -> 8192); LM-Infinite (L = 1024) + YaRN x4 (the window is covered by YaRN's range).

Perplexity: `lcx.eval.perplexity.perplexity_by_length` on the validation split (works held out
of training), same windows for every length; see its docstring. Each method is one
`lcx.MethodConfig` (RoPE spec and/or attention method, attention on the blockwise backend:
O(n * (G + L)) memory), applied with `MethodConfig.apply` for both measurements.

Passkey: prompts from `lcx.eval_tasks.passkey.data.make_docs` (Landmark Attention's prompt,
sized in tiny-5m tokens), depths 0..100%. Scored without generation and controlled for how
likely the digits are a priori: the continuation " <key>" is teacher-forced after the prompt
and after a control prompt whose needle carries another key; `gain` = the difference of the two
log-likelihoods (0 for a model that ignores the needle), `choice_acc` = P(gain > 0) (chance
0.5), `exact_acc` = fraction where greedy decoding reproduces the key (argmax at every key
token). A 5M-parameter model trained on Shakespeare/KJV retrieves weakly even inside its
window, so the gain is the informative column.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import Benchmark, figure

DESCRIPTION = ("perplexity and passkey vs context length per attention / RoPE method on tiny-5m, applied at "
               "inference without fine-tuning")
BENCH = Benchmark("extrapolation", DESCRIPTION, __doc__, out="results/extrapolation_tiny.json", threads=1, seed=0,
                  plot=True)
N_GLOBAL = 16  # LM-Infinite global keys (paper: 10-100 behave alike)
TRAIN_LEN = 256
PASSKEY_SCORING = ("gain = log p(' <key>' | prompt) - log p(' <key>' | prompt with another key in the needle); "
                   "choice_acc = P(gain > 0); exact_acc = greedy reproduces the key")


@dataclass(frozen=True)
class Config:
    model: str
    lengths: list[int]
    methods: dict[str, dict]  # name -> lcx.MethodConfig dict
    max_tokens_per_length: int
    texts: dict[str, Any]  # the held-out split and its documents
    passkey: dict[str, Any]  # builder, depths, samples per depth, seed, scoring
    threads: int
    train_length: int = TRAIN_LEN
    attention_backend: str = "blockwise"

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "train_length": self.train_length, "lengths": self.lengths,
                "methods": self.methods, "max_tokens_per_length": self.max_tokens_per_length, "texts": self.texts,
                "passkey": self.passkey, "attention_backend": self.attention_backend, "threads": self.threads}


def methods(n_global: int) -> dict[str, dict]:
    """name -> `lcx.MethodConfig` dict (`{}`: the model as loaded).

    `lcx.presets` where the preset is this setting (vanilla, sliding_window, yarn at L0 = 256).
    The other rows keep their own numbers, since the committed results/extrapolation_tiny.json
    was measured with them and the presets differ: LM-Infinite with G = 16 (preset: 10) and,
    in the last row, a window of 1024 = 4 L0 with YaRN x4 (preset lm_infinite+yarn: window L0);
    StreamingLLM with 4 sinks + a window of 256 (preset: 4 + 252, L0 keys in all).
    """
    from lcx import presets

    def preset(name: str, factor: float = 1.0) -> dict:
        return presets.config(name, L0=TRAIN_LEN, factor=factor).to_dict()

    return {
        "vanilla": preset("vanilla"),
        f"lm_infinite_G{n_global}_L256": {"attention": {"type": "lm_infinite", "n_global": n_global, "n_local": 256}},
        "sliding_window_256": preset("sliding_window"),
        "sinks_4_256": {"attention": {"type": "sinks", "n_sink": 4, "window": 256}},
        "yarn_x32": preset("yarn", 32.0),
        f"lm_infinite_G{n_global}_L1024+yarn_x4": {"rope": {"rope_type": "yarn", "factor": 4.0},
                                                    "attention": {"type": "lm_infinite", "n_global": n_global,
                                                                  "n_local": 1024}},
    }


def _contexts(model, m: dict):
    """The method applied as one `lcx.MethodConfig` (a context manager restoring the model);
    attention methods on the blockwise backend (O(n (G + L)) memory)."""
    from lcx.method_config import MethodConfig

    return MethodConfig.from_dict({**m, "backend": "blockwise"} if m.get("attention") else m).apply(model)


def _continuation_ll(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """log p(cont | ctx) (teacher-forced) and whether greedy decoding would produce cont."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ctx + cont]), use_cache=False, logits_to_keep=len(cont) + 1).logits
        lp = torch.log_softmax(logits[0, :-1].float(), dim=-1)  # [len(cont), V]: predictions of cont
        t = torch.tensor(cont)
        return float(lp[torch.arange(len(cont)), t].sum()), bool((lp.argmax(-1) == t).all())


def passkey(model, tok, lengths: list[int], depths: list[float], samples: int, seed: int) -> dict:
    """Passkey retrieval scored without generation, controlled for the key's prior:
    ll_key = log p(" K" | prompt with K), ll_ctrl = log p(" K" | same prompt with the needle's key
    replaced by K' != K); retrieval gain = ll_key - ll_ctrl (0 for a model that ignores the needle)."""
    from lcx.eval_tasks.passkey.data import make_docs

    docs = make_docs(tok, lengths, depths, samples, seed)
    per_len: dict[int, list[dict]] = {L: [] for L in lengths}
    for d in docs:
        rng = random.Random(f"control:{d['key']}")
        key = d["key"]
        other = key
        while other == key:
            other = str(rng.randint(10_000, 99_999))
        cont = tok(" " + key, add_special_tokens=False)["input_ids"]
        for L, prompt in zip(d["lengths"], d["prompts"]):
            control = prompt.replace(key, other)
            ll_key, exact = _continuation_ll(model, tok(prompt, add_special_tokens=False)["input_ids"], cont)
            ll_ctrl, _ = _continuation_ll(model, tok(control, add_special_tokens=False)["input_ids"], cont)
            per_len[L].append({"depth": d["depth"], "key": key, "control_key": other,
                               "prompt_tokens": len(tok(prompt, add_special_tokens=False)["input_ids"]),
                               "ll_key": ll_key, "ll_control": ll_ctrl, "gain": ll_key - ll_ctrl, "exact": exact})
    out = {}
    for L, recs in per_len.items():
        out[str(L)] = {"n": len(recs), "choice_acc": sum(r["gain"] > 0 for r in recs) / len(recs),
                       "exact_acc": sum(r["exact"] for r in recs) / len(recs),
                       "mean_gain": sum(r["gain"] for r in recs) / len(recs),
                       "mean_ll_key": sum(r["ll_key"] for r in recs) / len(recs), "records": recs}
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from lcx.presets import add_presets_argument  # torch: imported when the command is built

    BENCH.add_arguments(ap)
    ap.add_argument("--model", default="tiny-5m", help="model preset or directory (default: %(default)s)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--n-global", type=int, default=N_GLOBAL)
    ap.add_argument("--max-tokens", type=int, default=32768, help="perplexity token budget per length")
    ap.add_argument("--depths", type=int, default=5, help="passkey depth grid size (0..100%%)")
    ap.add_argument("--samples", type=int, default=4, help="passkey prompts per depth")
    add_presets_argument(ap, default=None, nargs="+", metavar="NAME",
                         help=f"subset of the method names of `methods()` (default all)")
    ap.add_argument("--quick", action="store_true", help="lengths 256..1024, 4k tokens, 2 depths")
    ap.add_argument("--resume", action="store_true", help="keep (method, metric) entries already in --out")
    ap.add_argument("--redo", nargs="+", default=[], choices=("perplexity", "passkey"),
                    help="with --resume: recompute these metrics (e.g. passkey with more --samples)")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.lengths, args.max_tokens, args.depths = [256, 512, 1024], 4096, 2
    all_methods = methods(args.n_global)
    unknown = set(args.presets or []) - set(all_methods)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; known: {list(all_methods)}")
    todo = {k: v for k, v in all_methods.items() if args.presets is None or k in args.presets}

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # bundled models only: never the network
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    from lcx.data import io
    from lcx.eval.perplexity import load_texts, perplexity_by_length
    from lcx.models import load_model

    hf_logging.disable_progress_bar()
    threads = BENCH.resolve_threads(args)
    model, tok = load_model(args.model)
    model.eval()
    names, texts = load_texts("validation")
    depths = [0.5] if args.depths == 1 else [i / (args.depths - 1) for i in range(args.depths)]
    out = io.json_path(args.out)  # the committed record is stored gzipped (X.json.gz): found under X.json
    prev = io.read_json(out) if args.resume and out.exists() else {}
    results = prev.get("results", {}) if args.resume else {}
    seconds = prev.get("seconds", {}) if args.resume else {}
    for r in results.values():
        for metric in args.redo:
            r.pop(metric, None)
    rec = BENCH.start(args, Config(
        model=args.model, lengths=args.lengths, methods=todo, max_tokens_per_length=args.max_tokens,
        texts={"split": "validation", "documents": names},
        passkey={"builder": "lcx.eval_tasks.passkey.data.make_docs", "depths": depths,
                 "samples_per_depth": args.samples, "seed": args.seed, "scoring": PASSKEY_SCORING},
        threads=threads), out=out)
    for name, m in rec.progress(list(todo.items()), unit="method"):
        r = results.setdefault(name, {})
        if "perplexity" not in r:
            t0 = time.time()
            with _contexts(model, m):
                res = perplexity_by_length(model, tok, texts, args.lengths,
                                           max_tokens_per_length=args.max_tokens, progress=False)
            r["perplexity"] = [x.to_dict() for x in res.values()]
            seconds[f"{name}/perplexity"] = time.time() - t0
            rec.log(f"{name:<32} ppl  " + "  ".join(f"{x.length}:{x.ppl:.1f}" for x in res.values())
                    + f"   ({seconds[f'{name}/perplexity']:.0f} s)")
            rec.save(results, seconds=seconds)
        if "passkey" not in r:
            t0 = time.time()
            with _contexts(model, m):
                r["passkey"] = passkey(model, tok, args.lengths, depths, args.samples, args.seed)
            seconds[f"{name}/passkey"] = time.time() - t0
            rec.log(f"{name:<32} pass " + "  ".join(f"{L}:{v['choice_acc']:.2f}/{v['mean_gain']:+.2f}"
                                                    for L, v in r["passkey"].items())
                    + f"   ({seconds[f'{name}/passkey']:.0f} s)")
            rec.save(results, seconds=seconds)
    seconds["total_this_run"] = rec.elapsed()
    print_table(results, args.lengths)
    rec.finish(results, plot=plot, seconds=seconds)
    return 0


def print_table(results: dict, lengths: list[int]) -> None:
    w = max(len(k) for k in results) + 2
    print("perplexity (all scored tokens) | tail ppl (last 256 positions)")
    print("method".ljust(w) + "".join(f"{L:>9d}" for L in lengths))
    for key in ("ppl", "tail_ppl"):
        for name, r in results.items():
            by = {x["length"]: x[key] for x in r.get("perplexity", [])}
            print(f"{name} [{key}]".ljust(w + 10)[: w + 10] + "".join(
                f"{by[L]:>9.1f}" if L in by else f"{'':>9}" for L in lengths))
    print("passkey choice_acc / mean gain (nats) / exact_acc")
    for name, r in results.items():
        pk = r.get("passkey", {})
        print(name.ljust(w) + "".join(f"{pk[str(L)]['choice_acc']:>5.2f}/{pk[str(L)]['mean_gain']:+.1f}/"
                                      f"{pk[str(L)]['exact_acc']:.1f}"
                                      if str(L) in pk else f"{'':>9}" for L in lengths))


def plot(record: dict, path: Path) -> None:
    """Perplexity, tail perplexity and the passkey retrieval gain vs length, one line per method."""
    results = record["results"]
    title = "tiny-5m (trained at 256 tokens): attention methods and RoPE scaling without fine-tuning"
    with figure(path, 1, 3, figsize=(16, 4.5), title=title) as (fig, axes):
        for name, r in results.items():
            pp = r.get("perplexity", [])
            if pp:
                axes[0].plot([x["length"] for x in pp], [x["ppl"] for x in pp], marker="o", label=name)
                axes[1].plot([x["length"] for x in pp], [x["tail_ppl"] for x in pp], marker="o", label=name)
            pk = r.get("passkey", {})
            if pk:
                Ls = sorted(int(L) for L in pk)
                axes[2].plot(Ls, [pk[str(L)]["mean_gain"] for L in Ls], marker="o", label=name)
        for ax, sub in zip(axes, ("perplexity (all tokens)", "tail perplexity (last 256 positions)",
                                  "passkey: retrieval gain log p(key|needle) - log p(key|other needle)")):
            ax.set_xscale("log", base=2)
            ax.axvline(TRAIN_LEN, color="gray", ls=":", lw=1)
            ax.set_xlabel("context length (tokens)")
            ax.set_title(sub, fontsize=10)
            ax.grid(alpha=0.3)
        axes[0].set_yscale("log")
        axes[1].set_yscale("log")
        axes[2].axhline(0.0, color="gray", ls="--", lw=1)
        axes[2].set_ylabel("nats")
        axes[0].legend(fontsize=7)


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
