"""`lcx bench decode`: decoding speed per method through lcx's engine, against vanilla in the same run.

    lcx bench decode                       # SmolLM2-135M's shape, fp32, one thread, 4k-32k -> results/decode_cpu.{json,png}
    lcx bench decode --lengths 2048 --layers 2 --tokens 8 --out /tmp/d.json     # a quick check
    lcx bench decode --merge a.json b.json --out results/decode_cpu.json       # lengths run in two processes
    lcx bench decode --shape gemma3-270m --lengths 2048 8192 16384 --tokens 8 \
        --out results/gemma3-270m/decode_cpu.json    # Gemma 3's hybrid shape: the method on global vs all layers

What is measured is `lcx.engine` (what `lcx serve`, `lcx report`'s decode cells and the lm-eval
`lcx` model run): for each prompt length, every case's engine prefills the same prompt, then the
engines decode in rounds, one token per case per round (interleaved, so a change in the
machine's load hits every case alike), each step timed in process CPU time (one thread: the
time this process computed, whatever the other core does) and wall time. tokens/s = 1 / the
median CPU time of a step; the ratio is against `vanilla` at the same length in the same run.

Cases (`CASES`; each an `lcx.MethodConfig` the engine applies):

  vanilla              the model as built (HF SDPA prefill; the engine's cache of rotated keys; a
                       hybrid shape: as the engine runs it, every layer on lcx's flash backend,
                       `lcx.hf.attention_patch.as_loaded_method`)
  lm_infinite/w1024    LM-Infinite, 10 global keys + a window of 1024 (the issue's short window)
  sinks/w1024          StreamingLLM, 4 sinks + a window of 1020 (1024 keys in all)
  sliding_window/w1024 a window of 1024 keys
  lm_infinite/L0       `lcx.presets` lm_infinite for the shape's L0 (window L0 = 8192: the report's)
  sinks/L0             `lcx.presets` sinks (4 + L0 - 4)
  self_extend          `lcx.presets` self_extend (W = L0 / 4, the smallest G reaching the longest length)
  dca                  `lcx.presets` dca (Dual Chunk Attention, ChunkLlama's chunk 3 L0 / 4, local L0 / 16):
                       no decode rule, so the engine keeps unrotated keys and decodes through its
                       three passes (`fast_path` false); not in the default run (`--cases`)
  string               `lcx.presets` string (S = 0.33 x the longest length, W = 128, YaRN spec with
                       STRING's attention factor): a window + side decode rule; not in the default run

The model is the shape's LlamaForCausalLM with random weights (`benchmarks.scale.SHAPES`; no
download): decode cost does not depend on the weights' values, only on their shapes and on what
each method reads, so the table holds for the trained model (the record says so).

`--shape gemma3-270m` (`HYBRID_SHAPES`): Gemma 3 270M's shape (gemma3_text: 18 layers, a
512-token sliding window in 15 of them and full attention in layers 5, 11, 17, 4 query heads /
1 KV head of 256, two RoPE bases, the full 262k vocabulary unless `--vocab`), random weights.
Its cases (`DEFAULT_CASES`): vanilla (the sliding layers already hold 512 keys each in the
engine), LM-Infinite and sinks with a window of 1024 on the global layers (lcx's default,
`MethodConfig.layers = "global"`: the whole cache constant) and on every layer (`/all`: the
sliding layers then see the method's keys instead of their own 512). Each case
runs on its own copy of the model's modules sharing one set of weights (a method patches the
attention modules it runs on).

Beside each ratio, the memory-traffic ideal: a decode step must read the weights once (the
layers' and the LM head's) and the keys/values its query can see, layer by layer; ideal ratio =
(weights + vanilla's KV) / (weights + the method's visible KV). Also per case: KV bytes the engine
holds after the last step (exact tensor sizes; per layer in `kv_bytes_per_layer`), prefill time,
and the resident-memory peak of the prefill (VmHWM over VmRSS, reset before each prefill; the
other cases' caches are resident then).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import Benchmark, figure
from benchmarks.scale import visible_keys  # the one count of the keys a query sees

DESCRIPTION = "decode tokens/s per method through lcx.engine vs vanilla, one thread, SmolLM2-135M's (or Gemma 3's) shape"
BENCH = Benchmark("decode", DESCRIPTION, __doc__, out="results/decode_cpu.json", threads=1, seed=0, plot=True)


@dataclass(frozen=True)
class Config:
    shape: str
    layers: int
    lengths: list[int]
    tokens: int
    threads: int
    seed: int
    cases: dict[str, dict]  # name -> its lcx.MethodConfig dict
    dtype: str = "float32"
    weights: str = "random (benchmarks.scale.build_model): decode cost depends on shapes, not on weight values"
    timing: str = ("per step: process CPU time (tokens_per_s, ratio) and wall time (*_wall), median over "
                   "--tokens steps, cases interleaved round by round")
    ideal: str = "bytes per decode step = weights (layers + LM head) + visible keys x KV bytes per token"
    merged_from: dict[str, dict] | None = None  # --merge: each record's lengths and git SHA
    vocab: int | None = None  # --vocab: the shape's vocabulary replaced (None: the shape's own)

    def to_dict(self) -> dict[str, Any]:
        order = ("shape", "layers", "vocab", "lengths", "tokens", "threads", "seed", "dtype", "cases", "weights",
                 "timing", "ideal", "merged_from")
        d = dataclasses.asdict(self)
        return {k: d[k] for k in order if k not in ("merged_from", "vocab") or d[k] is not None}


@dataclass(frozen=True)
class Case:
    """A row: a `lcx.presets` name (None: the model as built) or an explicit attention method."""

    name: str
    preset: str | None = None
    attention: dict[str, Any] | None = None
    layers: str | None = None  # `MethodConfig.layers` (a hybrid model: "all" = the sliding layers too)
    default: bool = True  # in a Llama shape's default run (False: only when `--cases` names it)

    def method_config(self, L0: int, max_len: int):
        from lcx import MethodConfig, presets

        if self.attention is not None:
            return MethodConfig.from_dict({"attention": self.attention, **({"layers": self.layers} if self.layers else {})})
        if self.preset is None:
            return MethodConfig()
        return presets.config(self.preset, L0=L0, factor=max(1.0, max_len / L0))


# The only list of cases; tests iterate over it.
CASES: tuple[Case, ...] = (
    Case("vanilla"),
    Case("lm_infinite/w1024", attention={"type": "lm_infinite", "n_global": 10, "n_local": 1024}),
    Case("sinks/w1024", attention={"type": "sinks", "n_sink": 4, "window": 1020}),
    Case("sliding_window/w1024", attention={"type": "sliding_window", "window": 1024}),
    Case("lm_infinite/L0", preset="lm_infinite"),
    Case("sinks/L0", preset="sinks"),
    Case("self_extend", preset="self_extend"),
    Case("dca", preset="dca", default=False),  # issue #77: beside vanilla and Self-Extend
    Case("string", preset="string", default=False),
    Case("lm_infinite/w1024/all", attention={"type": "lm_infinite", "n_global": 10, "n_local": 1024}, layers="all"),
    Case("sinks/w1024/all", attention={"type": "sinks", "n_sink": 4, "window": 1020}, layers="all"),
)
BASELINE = "vanilla"

# Shapes beside `benchmarks.scale.SHAPES` (Llama): hybrid local/global models, as `AutoConfig` kwargs.
HYBRID_SHAPES: dict[str, dict[str, Any]] = {
    "gemma3-270m": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                        sliding_window=512, max_position_embeddings=32768, query_pre_attn_scalar=256,
                        rms_norm_eps=1e-6, tie_word_embeddings=True),  # layer_types, rope_parameters: HF's defaults
}
# The cases a shape runs by default: a hybrid shape the method on its global layers vs on all
# (L0 presets would cover Gemma 3's 32k context, i.e. equal vanilla at these lengths); a
# Llama shape every case but the `/all` ones (its layers are alike: the same as without).
DEFAULT_CASES: dict[str, tuple[str, ...]] = {
    "gemma3-270m": ("vanilla", "lm_infinite/w1024", "lm_infinite/w1024/all", "sinks/w1024", "sinks/w1024/all"),
}


def default_cases(shape: str) -> list[str]:
    return list(DEFAULT_CASES.get(shape, [c.name for c in CASES if c.layers is None and c.default]))


def build_model(shape: str, *, layers: int | None, vocab: int | None, seed: int):
    """The shape's `*ForCausalLM` with random weights, float32 on the CPU, SDPA attention: a Llama
    shape as `benchmarks.scale.build_model` builds it, a hybrid one from `HYBRID_SHAPES`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.scale import SHAPES
    from benchmarks.scale import build_model as build_llama

    if shape in SHAPES and vocab is None:
        return build_llama(shape, layers=layers, dtype=torch.float32, device="cpu", seed=seed)
    kw = dict(SHAPES[shape]) if shape in SHAPES else dict(HYBRID_SHAPES[shape])
    model_type = kw.pop("model_type", "llama")
    if layers is not None:
        kw["num_hidden_layers"] = layers
    if vocab is not None:
        kw["vocab_size"] = vocab
    config = AutoConfig.for_model(model_type, **kw, bos_token_id=0, eos_token_id=None, pad_token_id=0,
                                  attn_implementation="sdpa")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _share_weights_copy(model):
    """The model's modules copied, its parameters and buffers shared (one set of weights)."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def run_length(model, facts: dict[str, int], cases: list[Case], T: int, args) -> dict[str, Any]:
    """Every case at prompt length T: prefill each, then decode interleaved (module docstring)."""
    import torch

    from benchmarks.scale import IdTokenizer
    from lcx.engine import Engine, EngineConfig, SamplingParams
    from benchmarks.measure import reset_peak, status_bytes

    g = torch.Generator().manual_seed(args.seed + T)
    prompt = torch.randint(0, facts["vocab"], (T,), generator=g).tolist()
    L0 = int(model.config.max_position_embeddings)
    elem = torch.finfo(next(model.parameters()).dtype).bits // 8
    weight_bytes = (facts["params_per_token"] + facts["lm_head_params"]) * elem
    kv_per_layer_token = facts["kv_elems_per_token"] // facts["layers"] * elem
    engines, out = {}, {}
    for case in cases:
        cfg = case.method_config(L0, max(args.lengths))
        m = _share_weights_copy(model)
        eng = Engine(m, IdTokenizer(), EngineConfig(methods=cfg, max_batch=1, max_model_len=T + args.tokens + 2))
        # one more token than timed, so the request still runs (and holds its cache) at the end
        eng.add_request(prompt, SamplingParams(max_tokens=args.tokens + 2, ignore_eos=True))
        before = status_bytes("VmRSS")
        reset_peak()
        t0 = time.perf_counter()
        with torch.inference_mode():
            eng.step()  # prefill + the first token
        prefill_s = time.perf_counter() - t0
        # the keys each layer's query sees (a hybrid model's sliding layers: their own window)
        vis = [T + 1 if w is None else min(T + 1, sum(w)) for w in eng.layer_windows]
        out[case.name] = {"config": cfg.to_dict(), "prefill_s": round(prefill_s, 3),
                          "prefill_peak_mb": round((status_bytes("VmHWM") - before) / 2**20, 1),
                          "fast_path": eng.cache_layout.rotated, "visible_keys": max(vis),
                          **({"visible_keys_per_layer": vis} if len(set(vis)) > 1 else {}),
                          "ideal_bytes_per_step": weight_bytes + sum(vis) * kv_per_layer_token,
                          "cpu_s": [], "wall_s": [], "tokens": []}
        engines[case.name] = eng
        print(f"  T={T} {case.name}: prefill {prefill_s:.1f} s", flush=True)
    # decode: round-robin, one step per case per round
    with torch.inference_mode():
        for _ in range(args.tokens):
            for name, eng in engines.items():
                c0, w0 = time.process_time(), time.perf_counter()
                evs = eng.step()
                out[name]["cpu_s"].append(time.process_time() - c0)
                out[name]["wall_s"].append(time.perf_counter() - w0)
                out[name]["tokens"] += [t for ev in evs for t in ev.token_ids]
    for name, eng in engines.items():
        r = out[name]
        r["kv_bytes"] = eng.kv_cache_bytes  # the cache after T + tokens positions
        r["kv_bytes_per_layer"] = eng.layer_kv_cache_bytes
        r["tokens_per_s"] = 1.0 / statistics.median(r["cpu_s"])
        r["tokens_per_s_wall"] = 1.0 / statistics.median(r["wall_s"])
        r["cpu_s"] = [round(x, 5) for x in r["cpu_s"]]
        r["wall_s"] = [round(x, 5) for x in r["wall_s"]]
        eng.reset()
    base = out.get(BASELINE)
    for name, r in out.items():
        if base is not None:
            r["ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["ratio_wall"] = r["tokens_per_s_wall"] / base["tokens_per_s_wall"]
            r["ideal_ratio"] = base["ideal_bytes_per_step"] / r["ideal_bytes_per_step"]
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(ap)
    ap.add_argument("--shape", default="smollm2-135m",
                    help="model shape of benchmarks.scale.SHAPES or HYBRID_SHAPES (gemma3-270m) (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count (quick checks)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="override the shape's vocabulary size (quick checks; the LM head is part of a step's cost)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--tokens", type=int, default=24, help="timed decode steps per case and length (default: %(default)s)")
    ap.add_argument("--cases", nargs="+", default=None, choices=[c.name for c in CASES],
                    help="default: the shape's (DEFAULT_CASES; a Llama shape: every case but the /all ones)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="measure nothing: join records of the same settings run for different --lengths "
                         "(e.g. the longest length in a second process) into --out")


def run(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.scale import SHAPES, shape_facts

    if args.merge:
        return merge(args)
    if args.tokens < 3:
        raise ValueError(f"--tokens must be >= 3, got {args.tokens}")
    if args.shape not in SHAPES and args.shape not in HYBRID_SHAPES:
        raise ValueError(f"unknown shape {args.shape!r}; known: {list(SHAPES) + list(HYBRID_SHAPES)}")
    threads = BENCH.resolve_threads(args)
    names = args.cases if args.cases is not None else default_cases(args.shape)
    cases = [c for c in CASES if c.name in names]
    if BASELINE not in names:
        cases = [CASES[0]] + cases
    model = build_model(args.shape, layers=args.layers, vocab=args.vocab, seed=args.seed)
    facts = shape_facts(model.config)
    L0 = int(model.config.max_position_embeddings)
    rec = BENCH.start(args, Config(
        shape=args.shape, layers=model.config.num_hidden_layers, vocab=args.vocab, lengths=sorted(args.lengths),
        tokens=args.tokens, threads=threads, seed=args.seed,
        cases={c.name: c.method_config(L0, max(args.lengths)).to_dict() for c in cases}))
    results: dict[str, Any] = {}
    for T in rec.progress(sorted(args.lengths), unit="length"):
        rec.log(f"T={T}")
        results[str(T)] = run_length(model, facts, cases, T, args)
        rec.save(results, wall_s=rec.elapsed(1), summary=summarise(results))
    print(table(results))
    rec.finish(results, plot=plot, wall_s=rec.elapsed(1), summary=summarise(results))
    return 0


def merge(args: argparse.Namespace) -> int:
    """Join records that differ only in their lengths (each length's cases ran interleaved in one
    process; lengths never compare across processes, only ratios within a length do)."""
    from lcx.configs import strict_from_dict
    from lcx.data.io import read_json

    recs = [read_json(f) for f in args.merge]
    same = ("shape", "layers", "vocab", "tokens", "threads", "seed", "dtype")
    for f, r in zip(args.merge[1:], recs[1:]):
        diff = [k for k in same if r["config"].get(k) != recs[0]["config"].get(k)]
        a, b = recs[0]["config"]["cases"], r["config"]["cases"]
        diff += [f"cases.{n}" for n in sorted(set(a) & set(b)) if a[n] != b[n]]
        if diff:
            raise ValueError(f"{f}: settings {diff} differ from {args.merge[0]}'s; only lengths (and which "
                             "cases ran) may differ")
    results = {T: row for r in recs for T, row in r["results"].items()}
    results = dict(sorted(results.items(), key=lambda kv: int(kv[0])))
    config = strict_from_dict(Config, {
        **recs[0]["config"], "lengths": [int(T) for T in results],
        "cases": {n: c for r in recs for n, c in r["config"]["cases"].items()},
        "merged_from": {str(f): {"lengths": r["config"]["lengths"], "git": r["environment"].get("git")}
                        for f, r in zip(args.merge, recs)}})
    rec = BENCH.start(args, config)
    print(table(results))
    rec.finish(results, plot=plot, wall_s=sum(r.get("wall_s", 0) for r in recs), summary=summarise(results))
    return 0


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    return {T: {name: {k: (round(r[k], 3) if isinstance(r.get(k), float) else r.get(k))
                       for k in ("tokens_per_s", "ratio", "ideal_ratio", "kv_bytes", "fast_path")}
                for name, r in row.items()} for T, row in results.items()}


def table(results: dict[str, Any]) -> str:
    lines = [f"{'case':<24}" + "".join(f"{T:>22}" for T in results)]
    names = list(dict.fromkeys(n for row in results.values() for n in row))
    for name in names:
        cells = []
        for row in results.values():
            r = row.get(name)
            cells.append("—" if r is None else
                         f"{r['tokens_per_s']:7.2f} {r.get('ratio', float('nan')):5.2f}x ({r.get('ideal_ratio', float('nan')):4.2f})")
        lines.append(f"{name:<24}" + "".join(f"{c:>22}" for c in cells))
    lines.append("(tok/s, ratio to vanilla, memory-traffic ideal ratio in parentheses)")
    return "\n".join(lines)


def plot(record: dict[str, Any], path: Path) -> None:
    """tokens/s per case vs length; the ratio to vanilla beside the memory-traffic ideal (dotted)."""
    results, cfg = record["results"], record["config"]
    names = list(dict.fromkeys(n for row in results.values() for n in row))
    vocab = f", vocab {cfg['vocab']}" if cfg.get("vocab") else ""
    title = f"lcx.engine decoding, {cfg['shape']} shape (random weights{vocab}), fp32, {cfg['threads']} thread(s)"
    with figure(path, 1, 2, figsize=(12, 4.4), title=title) as (fig, axes):
        for name in names:
            lengths = [int(T) for T, row in results.items() if name in row]
            rows = [results[str(T)][name] for T in lengths]
            line = axes[0].plot(lengths, [r["tokens_per_s"] for r in rows], marker="o", label=name)
            if name != BASELINE:
                axes[1].plot(lengths, [r.get("ratio") for r in rows], marker="o", color=line[0].get_color(),
                             label=name)
                axes[1].plot(lengths, [r.get("ideal_ratio") for r in rows], ls=":", color=line[0].get_color())
        axes[0].set_ylabel("decode tokens/s (1 / median CPU time per step)")
        axes[1].set_ylabel("speed vs vanilla (dotted: memory-traffic ideal)")
        axes[1].axhline(1.0, color="k", lw=0.8)
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt length (tokens)")
            ax.grid(alpha=0.3)
        axes[0].set_yscale("log")
        axes[0].legend(fontsize=7)


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
