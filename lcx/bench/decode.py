"""`lcx bench decode`: LM-Infinite with a bounded KV cache vs full-cache decoding, CPU, tiny-5m.

    lcx bench decode                         # 4k, 16k, 32k -> results/decode_cpu.{json,png}
    lcx bench decode --contexts 1024 --new-tokens 16 --out /tmp/d.json

For each context length n: a prompt of n held-out tokens is prefilled, then `--new-tokens`
tokens are decoded greedily, one forward per token, by the reference decode loop
(`lcx.engine.reference.greedy_decode_ref`, the loop of `lcx.methods.greedy_generate`) over HF's
own cache objects, which is what is compared; `lcx report` measures decoding in lcx's engine. Cases:

  vanilla_full     the unpatched model (HF sdpa, DynamicCache of rotated keys): the baseline;
  lminf_full       LM-Infinite (G, L) through `patch_attention`, full DynamicCache (unrotated
                   keys; every step re-rotates all n keys: what "Λ-mask on a full cache" costs);
  lminf_bounded    LM-Infinite (G, L) with `BoundedKVCache`: G + L - 1 keys kept per layer;
  sinks_bounded    StreamingLLM (4 sinks + window L) with `BoundedKVCache`.

Numbers per case: decode tokens/s = 1 / median CPU time of a per-token forward (process CPU
time, `time.process_time`, one thread: on this shared, oversubscribed machine wall time measures
the neighbours; wall-clock medians are recorded too as `tokens_per_s_wall`), prefill seconds
(wall and CPU), KV-cache bytes after
prefill and at the end (exact tensor sizes), and the process's peak resident memory during
prefill and during decoding (one subprocess per case; Linux VmHWM reset right before each
phase via /proc/self/clear_refs, glibc mmap threshold fixed at 64 KiB, as in
`lcx bench attention`; the model's weights, ~20 MB, are resident before either phase and not
counted). `tokens_equal` checks that the bounded cache generated exactly the tokens of
lminf_full. Ratios are against vanilla_full of the same context in the same run.

G, L and the sink count are flags, not `lcx.presets` (whose LM-Infinite has 10 global keys and
whose StreamingLLM window is L0 - 4): the committed results/decode_cpu.json was measured with
G = 16 and 4 sinks + a window of 256.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DESCRIPTION = "CPU greedy decoding, tiny-5m: LM-Infinite bounded KV cache vs full-cache decoding"
CASES = ("vanilla_full", "lminf_full", "lminf_bounded", "sinks_bounded")


def child(case: str, n: int, args) -> dict:
    import contextlib

    import torch
    from transformers.cache_utils import DynamicCache
    from transformers.utils import logging as hf_logging

    from lcx.data.tokenizer import encode_documents
    from lcx.engine.reference import greedy_decode_ref
    from lcx.eval.perplexity import load_texts
    from lcx.measure import reset_peak, status_bytes
    from lcx.methods import BoundedKVCache, attention_patched, cache_nbytes, lm_infinite, sinks
    from lcx.models import load_model

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    model.eval()
    _, texts = load_texts("validation")
    stream = encode_documents(tok, texts)
    if len(stream) < n:
        raise SystemExit(f"validation split has {len(stream)} tokens < {n}")
    ids = torch.tensor(stream[:n])[None]
    method = {"lminf": lm_infinite(args.n_global, args.n_local),
              "sinks": sinks(args.n_sink, args.n_local), "vanilla": None}[case.split("_")[0]]
    ctx = attention_patched(model, method) if method is not None else contextlib.nullcontext()
    with ctx, torch.inference_mode():
        cache = BoundedKVCache(method) if case.endswith("bounded") else DynamicCache()
        before = status_bytes("VmRSS")
        reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill_s, prefill_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        prefill_peak = status_bytes("VmHWM") - before
        cache_after_prefill = cache_nbytes(cache)
        logits = out.logits[:, -1]  # [1, V]
        del out
        steps, cpu = [], []

        def feed(nxt: torch.Tensor) -> torch.Tensor:  # [1] -> logits [1, V]; one timed decode step
            ts, cs = time.perf_counter(), time.process_time()
            logits = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
            steps.append(time.perf_counter() - ts)
            cpu.append(time.process_time() - cs)
            return logits

        before = status_bytes("VmRSS")
        reset_peak()
        toks = greedy_decode_ref(feed, logits, args.new_tokens)[0].tolist()
        decode_peak = status_bytes("VmHWM") - before
    med = statistics.median(cpu)
    return {"prefill_s": prefill_s, "prefill_cpu_s": prefill_cpu_s, "decode_step_median_cpu_s": med,
            "decode_step_median_wall_s": statistics.median(steps), "decode_step_mean_cpu_s": statistics.mean(cpu),
            "tokens_per_s": 1.0 / med, "tokens_per_s_wall": 1.0 / statistics.median(steps),
            "cache_bytes_after_prefill": cache_after_prefill, "cache_bytes_end": cache_nbytes(cache),
            "prefill_peak_mb": prefill_peak / 2**20, "decode_peak_mb": decode_peak / 2**20,
            "tokens": toks, "step_wall_s": steps, "step_cpu_s": cpu, "threads": torch.get_num_threads(),
            "method": None if method is None else method.to_dict()}


def run_case(case: str, n: int, args) -> dict:
    """One case in a fresh interpreter (`python -m lcx.bench.decode --child ...`, same working
    directory and PYTHONPATH, so the same lcx), its memory measured in isolation."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "lcx.bench.decode", "--child", case, "--child-context", str(n),
           "--model", args.model, "--new-tokens", str(args.new_tokens), "--n-global", str(args.n_global),
           "--n-local", str(args.n_local), "--n-sink", str(args.n_sink), "--threads", str(args.threads)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.case_timeout_s)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"status": "error", "error": " | ".join(tail), "wall_s": time.perf_counter() - t0}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res.update(status="ok", wall_s=time.perf_counter() - t0)
    return res


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.epilog = __doc__.split("\n\n", 1)[1]
    ap.add_argument("--model", default="tiny-5m", help="model preset or directory (default: %(default)s)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--n-global", type=int, default=16)
    ap.add_argument("--n-local", type=int, default=256, help="LM-Infinite window (and StreamingLLM window)")
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--case-timeout-s", type=float, default=1800.0)
    ap.add_argument("--out", default="results/decode_cpu.json",
                    help="result JSON, PNG beside it; relative to the working directory (default: %(default)s)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-context", type=int, default=None, help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lcx bench decode", description=DESCRIPTION)
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.child:
        print(json.dumps(child(args.child, args.child_context, args)))
        return 0
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (one prefill token + timed decode steps), got {args.new_tokens}")

    from lcx.bench.record import write_record
    from lcx.data.io import atomic_savefig

    config = {k: getattr(args, k) for k in ("model", "contexts", "new_tokens", "n_global", "n_local", "n_sink",
                                            "threads", "cases")}
    config["prompt"] = "the first n tokens of the validation split (lcx.data.tokenizer.encode_documents)"
    config["memory_measure"] = ("cache_bytes: exact KV tensor bytes; *_peak_mb: VmHWM increase over VmRSS during "
                                "the phase (reset via /proc/self/clear_refs; MALLOC_MMAP_THRESHOLD_=65536)")
    results: dict[str, dict] = {c: {} for c in args.cases}
    out = Path(args.out)
    t_start = time.time()

    def save(quiet: bool = True):
        write_record(out, description=DESCRIPTION, config=config, results=results, quiet=quiet,
                     wall_s=time.time() - t_start, summary=summarise(results, args))

    for n in sorted(args.contexts):
        for c in args.cases:
            r = run_case(c, n, args)
            results[c][str(n)] = r
            if r["status"] == "ok":
                print(f"n={n:>6} {c:<15} {r['tokens_per_s']:>8.1f} tok/s (cpu)  prefill {r['prefill_cpu_s']:>7.1f} s  "
                      f"cache {r['cache_bytes_end'] / 2**20:>7.2f} MB  peak prefill {r['prefill_peak_mb']:>7.1f} MB "
                      f"decode {r['decode_peak_mb']:>6.1f} MB", flush=True)
            else:
                print(f"n={n:>6} {c:<15} ERROR {r['error']}", flush=True)
            save()
    print(json.dumps(summarise(results, args), indent=1))
    save(quiet=False)
    plot(results, args, out.with_suffix(".png"), atomic_savefig)
    print(f"wrote {out.with_suffix('.png')}")
    return 0


def summarise(results: dict, args) -> dict:
    summary = {}
    for n in sorted(args.contexts):
        base = results.get("vanilla_full", {}).get(str(n), {})
        full = results.get("lminf_full", {}).get(str(n), {})
        row = {}
        for c in args.cases:
            r = results[c].get(str(n), {})
            if r.get("status") != "ok":
                continue
            row[c] = {"tokens_per_s": r["tokens_per_s"], "cache_mb": r["cache_bytes_end"] / 2**20,
                      "decode_peak_mb": r["decode_peak_mb"], "prefill_cpu_s": r["prefill_cpu_s"],
                      "tokens_per_s_wall": r["tokens_per_s_wall"]}
            if base.get("status") == "ok":
                row[c]["speedup_vs_vanilla_full"] = r["tokens_per_s"] / base["tokens_per_s"]
                row[c]["cache_memory_saving_vs_vanilla_full"] = base["cache_bytes_end"] / r["cache_bytes_end"]
            if c.startswith("lminf") and c != "lminf_full" and full.get("status") == "ok":
                row[c]["tokens_equal_lminf_full"] = r["tokens"] == full["tokens"]
        summary[str(n)] = row
    return summary


def plot(results: dict, args, path: Path, savefig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in args.cases:
        pts = [(int(n), r) for n, r in results[c].items() if r.get("status") == "ok"]
        pts.sort()
        if not pts:
            continue
        axes[0].plot([n for n, _ in pts], [r["tokens_per_s"] for _, r in pts], marker="o", label=c)
        axes[1].plot([n for n, _ in pts], [r["cache_bytes_end"] / 2**20 for _, r in pts], marker="o", label=c)
    for ax, yl in zip(axes, ("decode tokens/s (1 / median CPU time per step)", "KV cache at the end (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{args.model} CPU decoding: LM-Infinite (G={args.n_global}, L={args.n_local}) bounded cache vs full cache")
    fig.tight_layout()
    savefig(fig, path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
