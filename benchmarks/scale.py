"""`lcx bench scale`: every method at GPU scale, on random weights.

    lcx bench scale                                        # CUDA: the three shapes at 32k, 64k, 128k
                                                           #   -> results/scale/<gpu>.json
    lcx bench scale --shape smollm2-135m --lengths 2048    # CPU: the same code, small -> results/scale/cpu.json
    lcx bench scale --time-limit 240 --resume              # what scripts/gpu_session.sh runs

The question (a GPU user's): which method costs what at 32k-128k tokens on a 7B-class model?
Cost does not depend on trained weights, so none are needed: a Llama model is built from a
named shape (`SHAPES`: LlamaConfig kwargs written here, no download) with random weights, in
bfloat16 on the device (float32 on the CPU), and each case below prefills T tokens and greedily
decodes `--decode-tokens` more through lcx's engine (`lcx.engine.Engine`, batch 1: the path
`lcx serve` and `lcx report` run, so engine speed-ups land in these numbers):

    case                  method (lcx.presets, L0 = --context)             lcx.attention backend
    vanilla               the model as built: transformers' SDPA (on CUDA torch's flash kernel)
    lm_infinite/triton    LM-Infinite, G = 10, L = L0                       triton (the Λ kernel)
    lm_infinite/flex      the same                                          flex_compiled (CUDA) / flex (CPU)
    lm_infinite/flash     the same                                          flash (lcx's inference default)
    sinks                 StreamingLLM, 4 sinks + L0 - 4                    flash
    sliding_window        a window of L0                                    flash
    swat                  SWAT (sigmoid, window L0, ALiBi): its cost only   triton (CUDA) / blockwise (CPU)
    self_extend           Self-Extend, W = L0 / 4, G to reach T             flash

Per cell (shape, length, case): time of the prefill (the engine's first step: prefill + first
token), decode tokens/s (the following steps), the engine's KV-cache bytes, peak device memory,
ratios to `vanilla` of the same run, and the hardware ideal beside them: HBM bytes one decode
step must read (weights + the keys/values the method lets the query see: all T for vanilla and
Self-Extend, G + L for LM-Infinite, the window for the others) and the FLOPs of the prefill
(2 x parameters x T + the attention's 4 x H x D per visible query-key pair), with the ratios
they predict and the copy bandwidth / bf16 matmul rate measured in the same run
(`benchmarks.harness.measure_ceilings`). A cell whose memory estimate does not fit the device
is recorded as not fitting, before anything is allocated; a backend that cannot run on this
device is recorded with its reason.

Order: most valuable cells first (the largest shape; its shortest and longest length for
vanilla, LM-Infinite/triton and sinks; then the other cases at those lengths; then the lengths
in between; then the smaller shapes). The JSON is rewritten after every cell; `--time-limit`
stops before a cell that would start later than the limit allows and `--resume` skips the cells
a previous run wrote, so a second call continues the first.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import Benchmark

DESCRIPTION = "every method at GPU scale on random weights: prefill time, decode tok/s, KV bytes, memory vs vanilla"
BENCH = Benchmark("scale", DESCRIPTION, __doc__, threads="1",
                  out_help="result JSON (default results/scale/<gpu>.json, or results/scale/cpu.json)")

# Model shapes as LlamaConfig kwargs (the published configs' architecture numbers; no weights).
# max_position_embeddings is the context the presets scale from (L0): 8192 for all three
# (Llama 3.2's long-context RoPE scaling is left out: with random weights it changes no cost).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}
GPU_SHAPES = ("llama-3-8b", "llama-3.2-1b", "smollm2-135m")  # value order: the largest first
GPU_LENGTHS = (32768, 131072, 65536)  # shortest and longest first


@dataclass(frozen=True)
class Case:
    """One row of the table: a preset (None: the model as built) or an explicit attention
    method, and the `lcx.attention` backend per device type (None: the method's default)."""

    name: str
    preset: str | None
    backend: dict[str, str | None]
    attention: dict[str, Any] | None = None  # an explicit method (SWAT: its cost on any model)

    def method_config(self, L0: int, T: int, device: str):
        from lcx import MethodConfig, presets

        if self.attention is not None:
            cfg = MethodConfig.from_dict({"attention": {**self.attention, "window": L0}})
        elif self.preset is None:
            return MethodConfig()
        else:
            cfg = presets.config(self.preset, L0=L0, factor=max(1.0, T / L0))
        backend = self.backend.get(device, self.backend.get("*"))
        return cfg if backend is None else MethodConfig.from_dict({**cfg.to_dict(), "backend": backend})


# The only list of cases; tests iterate over it. KEY_CASES: the first ones a GPU call runs.
CASES: tuple[Case, ...] = (
    Case("vanilla", None, {"*": None}),
    Case("lm_infinite/triton", "lm_infinite", {"*": "triton"}),
    Case("sinks", "sinks", {"*": "flash"}),
    Case("lm_infinite/flex", "lm_infinite", {"cuda": "flex_compiled", "*": "flex"}),
    Case("lm_infinite/flash", "lm_infinite", {"*": "flash"}),
    Case("sliding_window", "sliding_window", {"*": "flash"}),
    Case("swat", None, {"cuda": "triton", "*": "blockwise"}, attention={"type": "swat"}),
    Case("self_extend", "self_extend", {"*": "flash"}),
)
KEY_CASES = ("vanilla", "lm_infinite/triton", "sinks")
# Backends that materialise a [T, T] score matrix per head (the memory estimate counts it).
QUADRATIC_BACKENDS = ("ref", "sdpa", "flex")


@dataclass(frozen=True)
class Config:
    shapes: dict[str, dict[str, Any]]  # name -> LlamaConfig kwargs (with --layers)
    lengths: list[int]
    cases: list[dict[str, Any]]
    context: int | str  # L0, or "the shape's max_position_embeddings"
    device: str
    dtype: str
    decode_tokens: int
    repeats: int
    threads: int
    memory_fraction: float
    batch: int = 1
    weights: str = "random (normal, std 0.02; norms 1), seed 0"
    timing: str = ("wall clock, synchronised: prefill = the engine's first step (prefill + first token); "
                   "decode = the following steps; after a warm-up at min(T, 1024) tokens")

    def to_dict(self) -> dict[str, Any]:
        order = ("shapes", "lengths", "cases", "context", "device", "dtype", "decode_tokens", "repeats", "threads",
                 "batch", "memory_fraction", "weights", "timing")
        return {k: getattr(self, k) for k in order}


# ============================================================================================
# Model, tokenizer stand-in, formulas
# ============================================================================================

def build_model(shape: str, *, layers: int | None, dtype: Any, device: str, seed: int = 0):
    """A LlamaForCausalLM of `SHAPES[shape]` (with `layers` layers if given), random weights
    (normal, std 0.02; norms 1), in `dtype` on `device`, eval mode, SDPA attention."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    kw = dict(SHAPES[shape])
    if layers is not None:
        kw["num_hidden_layers"] = layers
    config = LlamaConfig(**kw, bos_token_id=0, eos_token_id=None, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class IdTokenizer:
    """What `lcx.engine.Engine` needs of a tokenizer when prompts are token ids (a random-weight
    model has no vocabulary): ids as text `<id>`, no special tokens but pad 0."""

    eos_token_id = None
    pad_token_id = 0
    all_special_ids: list[int] = []

    def convert_ids_to_tokens(self, i: int) -> str:
        return f"<{int(i)}>"

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{int(i)}>" for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        raise ValueError("IdTokenizer takes token ids only")


def shape_facts(config: Any) -> dict[str, int]:
    """Parameter counts and per-token KV size of a Llama config (no model needed)."""
    h, f, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or h // H
    per_layer = h * H * D + 2 * h * Hkv * D + H * D * h + 3 * h * f + 2 * h
    emb = config.vocab_size * h
    head = 0 if config.tie_word_embeddings else emb
    return {"layers": n, "hidden": h, "intermediate": f, "heads": H, "kv_heads": Hkv, "head_dim": D,
            "vocab": config.vocab_size, "params": n * per_layer + emb + head + h,
            "params_per_token": n * per_layer + h,  # what a token's forward multiplies (no lm_head)
            "lm_head_params": emb,  # read once per decode step (tied or not)
            "kv_elems_per_token": n * 2 * Hkv * D}


def visible_keys(method: Any, T: int) -> int:
    """Keys the query at position T-1 sees (`lcx.methods` method; None: all T)."""
    if method is None:
        return T
    window = method.cache_window  # (n_first, n_recent) of a bounded method, else None
    return T if window is None else min(T, sum(window))


def attention_pairs(method: Any, T: int) -> int:
    """Query-key pairs a causal prefill of T tokens computes: T(T+1)/2 for full attention;
    for a method that sees n_first + the last n_recent keys, sum_i min(i + 1, n_first + n_recent)."""
    W = visible_keys(method, T)
    if W >= T:
        return T * (T + 1) // 2
    return W * (W + 1) // 2 + (T - W) * W


def ideal(facts: dict[str, int], method: Any, T: int, elem_bytes: int) -> dict[str, float]:
    """The hardware ideal of a cell: bytes one decode step must read at context T (weights once
    + the visible keys and values) and the FLOPs of the prefill (matmuls 2 x params x T, the
    lm_head for the last token, attention 4 x H x D per query-key pair, QK^T and PV)."""
    w_bytes = (facts["params_per_token"] + facts["lm_head_params"]) * elem_bytes
    kv_bytes = facts["kv_elems_per_token"] * visible_keys(method, T) * elem_bytes
    att = 4 * facts["layers"] * facts["heads"] * facts["head_dim"] * attention_pairs(method, T)
    return {"decode_bytes_per_step": w_bytes + kv_bytes, "decode_kv_bytes_per_step": kv_bytes,
            "prefill_flops": 2 * facts["params_per_token"] * T + 2 * facts["lm_head_params"] + att}


def estimate_bytes(facts: dict[str, int], cfg: Any, T: int, decode: int, elem_bytes: int) -> int:
    """Peak bytes a cell adds on top of the weights (an upper estimate, checked before running):
    the prefill's cache of all T keys and values, the engine's copy of what it keeps (all of
    them for an unbounded method), the MLP's activations over T tokens, and a [T, T] score
    matrix per head for a backend that materialises one."""
    kv_full = facts["kv_elems_per_token"] * (T + decode) * elem_bytes
    kept = kv_full if cfg.kv_window is None else facts["kv_elems_per_token"] * sum(cfg.kv_window) * elem_bytes
    act = T * (4 * facts["hidden"] + 3 * facts["intermediate"]) * elem_bytes
    backend = cfg.backend if cfg.attention is not None else "sdpa_causal"
    scores = T * T * facts["heads"] * 4 if backend in QUADRATIC_BACKENDS else 0
    return kv_full + kept + act + scores


def free_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def backend_reason(cfg: Any, device: str) -> str | None:
    """Why this cell's backend cannot run here (None: it can): the method's own refusal
    (`AttentionMethod.supports`), or a device the backend does not take."""
    import importlib.util

    if cfg.attention is None or cfg.backend is None:
        return None
    reason = cfg.attention.supports(cfg.backend)
    if reason is not None:
        return reason
    if cfg.backend in ("triton", "cuda") and device != "cuda":
        return f"the {cfg.backend} backend needs CUDA tensors (device {device})"
    if cfg.backend == "triton" and importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


# ============================================================================================
# One cell
# ============================================================================================

def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device: str) -> int:
    import torch

    from benchmarks.measure import reset_peak, status_bytes

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    reset_peak()
    return status_bytes("VmRSS")


def _peak(device: str) -> int:
    import torch

    from benchmarks.measure import status_bytes

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else status_bytes("VmHWM")


def run_engine(model: Any, cfg: Any, prompt: list[int], decode_tokens: int, device: str,
               profile_to: Path | None = None) -> dict[str, Any]:
    """Prefill `prompt` and decode `decode_tokens` greedily with lcx's engine under `cfg`
    (applied by the engine, removed after). Times are wall clock, synchronised. With
    `profile_to`, the decode steps after the first run under torch.profiler and its operator
    tables are written there (`write_profile`); such a run's times are not a measurement."""
    import contextlib

    import torch

    import lcx
    from lcx.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(model, IdTokenizer(), EngineConfig(methods=cfg, max_batch=1,
                                                       max_model_len=len(prompt) + decode_tokens + 1))
    def step() -> None:
        for ev in engine.step():
            if ev.finish_reason == "error":  # the engine isolates a failing request; here it is the cell's failure
                raise ev.error if isinstance(ev.error, BaseException) else RuntimeError(str(ev.error))

    try:
        with torch.inference_mode():
            engine.add_request(prompt, SamplingParams(max_tokens=decode_tokens, ignore_eos=True))
            _sync(device)
            t0 = time.perf_counter()
            step()  # prefill + the first token
            _sync(device)
            prefill = time.perf_counter() - t0
            if profile_to is not None and engine.has_work():
                step()  # one decode step outside the profile (first-call allocations)
            prof = _profiler(device) if profile_to is not None else contextlib.nullcontext()
            kv, steps, t1 = engine.kv_cache_bytes, 0, time.perf_counter()
            with prof:
                while engine.has_work():
                    step()
                    steps += 1
                    kv = max(kv, engine.kv_cache_bytes)
                _sync(device)
            decode = time.perf_counter() - t1
            if profile_to is not None:
                write_profile(prof, profile_to, steps=steps, wall_s=decode, device=device)
    finally:
        del engine
        lcx.unpatch(model)
    return {"prefill_s": prefill, "decode_s": decode, "decode_steps": steps, "kv_cache_bytes": kv}


def _profiler(device: str):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    return profile(activities=acts, record_shapes=False)


def write_profile(prof: Any, path: Path, *, steps: int, wall_s: float, device: str = "cuda",
                  rows: int = 30) -> None:
    """Where the decode steps' time went: the operators by self device time (CUDA) and by self
    CPU time, and the share of the wall time the device was busy (launch-bound when small)."""
    ka = prof.key_averages()
    cuda_attr = next((a for a in ("self_device_time_total", "self_cuda_time_total")
                      if ka and hasattr(ka[0], a)), None) if device == "cuda" else None
    busy_us = sum(getattr(e, cuda_attr) for e in ka) if cuda_attr else 0.0
    cpu_us = sum(e.self_cpu_time_total for e in ka)
    lines = [f"decode steps profiled: {steps}, wall {wall_s:.4f} s ({1e3 * wall_s / max(1, steps):.3f} ms/step)",
             f"self CPU time of all operators: {cpu_us / 1e6:.4f} s"]
    if cuda_attr:
        lines.append(f"device busy (sum of kernel self time): {busy_us / 1e6:.4f} s = "
                     f"{100 * busy_us / 1e6 / max(wall_s, 1e-12):.1f}% of the wall time")
        lines += ["", "== by self device time", prof.key_averages().table(sort_by=cuda_attr, row_limit=rows)]
    lines += ["", "== by self CPU time", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def run_cell(model: Any, facts: dict[str, int], case: Case, T: int, args: argparse.Namespace,
             device: str, elem_bytes: int, key: str = "cell") -> dict[str, Any]:
    """One (shape, length, case) cell: a result row, or `{"skipped": reason}` / `{"not_fit": ...}`."""
    import torch

    L0 = args.context or int(model.config.max_position_embeddings)
    cfg = case.method_config(L0, T, device)
    row: dict[str, Any] = {"config": cfg.to_dict(), **ideal(facts, cfg.attention, T, elem_bytes)}
    reason = backend_reason(cfg, device)
    if cfg.attention is not None and cfg.attention.name == "swat" and facts["heads"] % 2:
        # Balanced ALiBi needs an even head count (SmolLM2 has 9). Explicit slopes would do for a
        # cost measurement, but AttentionSpec.swat builds its balanced default even when slopes
        # are given (lcx/attention/spec.py), so an odd head count cannot run SWAT yet.
        reason = f"SWAT's balanced ALiBi needs an even number of heads ({facts['heads']} here)"
    if reason is not None:
        return {**row, "skipped": reason}
    need, free = estimate_bytes(facts, cfg, T, args.decode_tokens, elem_bytes), free_bytes(device)
    row["estimated_bytes"] = need
    if need > args.memory_fraction * free:
        return {**row, "not_fit": f"needs ~{need / 2**30:.1f} GiB beyond the weights, "
                                  f"{free / 2**30:.1f} GiB free on {device}"}
    g = torch.Generator().manual_seed(T)
    prompt = torch.randint(1, facts["vocab"], (T,), generator=g).tolist()
    try:
        # warm-up: kernel compilation and autotuning (Triton, the flex block mask) at a short
        # length; flex_compiled buckets lengths, so it warms up at this length (prefill only)
        warm = T if cfg.backend == "flex_compiled" else min(T, 1024)
        run_engine(model, cfg, prompt[:warm], 1, device)
        gc.collect()
        base = _reset_peak(device)
        runs = [run_engine(model, cfg, prompt, args.decode_tokens, device) for _ in range(args.repeats)]
        peak = max(0, _peak(device) - (base if device != "cuda" else 0))  # CPU: RSS can shrink
        if getattr(args, "profile_decode", None):  # an extra run, after the timed ones
            prof_path = Path(args.profile_decode) / f"decode_{key.replace('|', '_').replace('/', '-')}.txt"
            run_engine(model, cfg, prompt, args.decode_tokens, device, profile_to=prof_path)
            row["decode_profile"] = str(prof_path)
    except (NotImplementedError, ValueError, torch.OutOfMemoryError) as e:
        return {**row, "skipped": f"{type(e).__name__}: {e}"[:500]}
    finally:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    prefill = statistics.median(r["prefill_s"] for r in runs)
    decode_s = statistics.median(r["decode_s"] / max(1, r["decode_steps"]) for r in runs)
    row.update({
        "prefill_s": round(prefill, 5), "decode_tok_s": round(1.0 / decode_s, 3) if decode_s > 0 else None,
        "decode_step_ms": round(1e3 * decode_s, 4), "decode_steps": runs[0]["decode_steps"],
        "kv_cache_bytes": runs[0]["kv_cache_bytes"],
        ("peak_memory_bytes" if device == "cuda" else "peak_rss_increase_bytes"): int(peak),
        "prefill_TFLOPs": round(row["prefill_flops"] / prefill / 1e12, 4),
        "decode_GBps": round(row["decode_bytes_per_step"] / decode_s / 1e9, 3) if decode_s > 0 else None,
    })
    return row


# ============================================================================================
# The sweep
# ============================================================================================

def cell_order(shapes: list[str], lengths: list[int], cases: list[Case]) -> list[tuple[str, int, Case]]:
    """Most valuable cells first: per shape (in the order given), the KEY_CASES at the shortest
    and longest length, then the other cases at those lengths, then the lengths in between."""
    ends = {min(lengths), max(lengths)}

    def rank(cell: tuple[str, int, Case]) -> tuple:
        shape, T, case = cell
        tier = 0 if T in ends and case.name in KEY_CASES else 1 if T in ends else 2
        return (shapes.index(shape), tier, sorted(lengths).index(T), [c.name for c in cases].index(case.name))

    return sorted(((s, T, c) for s in shapes for T in lengths for c in cases), key=rank)


def add_ratios(cells: dict[str, Any]) -> None:
    """Ratios against vanilla of the same shape and length, measured and ideal, in place."""
    for key, row in cells.items():
        shape_len = key.rsplit("|", 1)[0]
        base = cells.get(f"{shape_len}|vanilla")
        if not base or "prefill_s" not in base or "prefill_s" not in row:
            continue
        row["vs_vanilla"] = {
            "prefill_speedup": round(base["prefill_s"] / row["prefill_s"], 4),
            "decode_speedup": (round(row["decode_tok_s"] / base["decode_tok_s"], 4)
                               if row.get("decode_tok_s") and base.get("decode_tok_s") else None),
            "kv_bytes": round(row["kv_cache_bytes"] / base["kv_cache_bytes"], 6) if base["kv_cache_bytes"] else None,
            "ideal_prefill_speedup": round(base["prefill_flops"] / row["prefill_flops"], 4),
            "ideal_decode_speedup": round(base["decode_bytes_per_step"] / row["decode_bytes_per_step"], 4),
        }


def table(record: dict[str, Any]) -> str:
    lines = [f"{'shape':<13} {'T':>7} {'case':<19} {'prefill s':>9} {'x van':>6} {'ideal':>6} "
             f"{'tok/s':>8} {'x van':>6} {'ideal':>6} {'KV MiB':>9} {'peak GiB':>8}"]
    for key, row in record["results"].items():
        shape, T, case = key.split("|")
        if "prefill_s" not in row:
            why = row.get("skipped") or row.get("not_fit") or row.get("not_run")
            lines.append(f"{shape:<13} {T:>7} {case:<19} -- {why}"[:160])
            continue
        r = row.get("vs_vanilla", {})
        peak = row.get("peak_memory_bytes", row.get("peak_rss_increase_bytes", 0)) / 2**30
        f = (lambda x: f"{x:6.2f}" if isinstance(x, (int, float)) else f"{'':>6}")
        lines.append(f"{shape:<13} {T:>7} {case:<19} {row['prefill_s']:9.3f} {f(r.get('prefill_speedup'))} "
                     f"{f(r.get('ideal_prefill_speedup'))} {row['decode_tok_s'] or 0:8.1f} "
                     f"{f(r.get('decode_speedup'))} {f(r.get('ideal_decode_speedup'))} "
                     f"{row['kv_cache_bytes'] / 2**20:9.2f} {peak:8.2f}")
    return "\n".join(lines)


def default_out(device: str) -> Path:
    import torch

    if device == "cuda":
        from benchmarks.harness import gpu_slug

        return Path("results") / "scale" / f"{gpu_slug(torch.cuda.get_device_name())}.json"
    return Path("results") / "scale" / "cpu.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(parser)
    parser.add_argument("--shape", default=None,
                        help=f"comma-separated shapes of {', '.join(SHAPES)} (default: all on CUDA, "
                             "smollm2-135m on the CPU)")
    parser.add_argument("--lengths", default=None,
                        help="comma-separated prompt lengths (default: 32768,131072,65536 on CUDA, 2048 on the CPU)")
    parser.add_argument("--cases", default=None, help=f"comma-separated subset of {', '.join(c.name for c in CASES)}")
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count (a fast smoke run)")
    parser.add_argument("--context", type=int, default=None,
                        help="L0 the presets scale from (windows, Self-Extend's groups); default: the shape's "
                             "8192 on CUDA, 512 on the CPU (so that 2048 tokens are beyond it, as 32k-128k are on a GPU)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--decode-tokens", type=int, default=None, help="decode steps (default 32 on CUDA, 8 on the CPU)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per cell; medians kept (default 1)")
    parser.add_argument("--memory-fraction", type=float, default=0.9,
                        help="a cell runs when its estimate is below this fraction of free memory (default 0.9)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds: start no cell after this much time minus --cell-budget (default: none)")
    parser.add_argument("--cell-budget", type=float, default=45.0,
                        help="seconds a cell is assumed to need when checking --time-limit (default 45)")
    parser.add_argument("--resume", action="store_true", help="keep the cells already in --out and run the others")
    parser.add_argument("--no-ceilings", action="store_true", help="skip measuring copy bandwidth and matmul rate")
    parser.add_argument("--profile-decode", default=None, metavar="DIR",
                        help="after each cell's timed runs, one more run whose decode steps run under "
                             "torch.profiler; writes DIR/decode_<shape>_<T>_<case>.txt (operators by self "
                             "device and CPU time, device-busy share of the wall time). Costs a run per cell")


def _csv(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    import json

    import torch

    from lcx.models.loading import as_dtype

    threads = BENCH.resolve_threads(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    gpu = device == "cuda"
    shapes = _csv(args.shape) or (list(GPU_SHAPES) if gpu else ["smollm2-135m"])
    lengths = [int(x) for x in _csv(args.lengths)] or (list(GPU_LENGTHS) if gpu else [2048])
    by_name = {c.name: c for c in CASES}
    cases = [by_name[n] if n in by_name else None for n in _csv(args.cases)] or list(CASES)
    if None in cases:
        raise ValueError(f"unknown case in --cases {args.cases!r}; known: {list(by_name)}")
    if by_name["vanilla"] not in cases:
        cases.insert(0, by_name["vanilla"])  # every ratio is against it
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"unknown shape {s!r}; known: {list(SHAPES)}")
    if any(T < 16 for T in lengths) or args.repeats < 1:
        raise ValueError("--lengths must be >= 16 and --repeats >= 1")
    dtype = as_dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    args.context = args.context if args.context is not None else (None if gpu else 512)
    if args.context is not None and args.context < 16:
        raise ValueError(f"--context must be >= 16, got {args.context}")
    args.decode_tokens = args.decode_tokens if args.decode_tokens is not None else (32 if gpu else 8)
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    config = Config(
        shapes={s: {**SHAPES[s], **({"num_hidden_layers": args.layers} if args.layers else {})} for s in shapes},
        lengths=lengths, cases=[{"name": c.name, "preset": c.preset, "backend": c.backend, "attention": c.attention}
                                for c in cases],
        context=args.context or "the shape's max_position_embeddings", device=device,
        dtype=str(dtype).removeprefix("torch."), decode_tokens=args.decode_tokens, repeats=args.repeats,
        threads=threads, memory_fraction=args.memory_fraction)
    rec = BENCH.start(args, config, out=args.out or default_out(device),
                      environment={"device": device, "device_name": torch.cuda.get_device_name() if gpu else "cpu"})
    out = rec.out
    cells: dict[str, Any] = {}
    if args.resume and out.is_file():
        prev = json.loads(out.read_text())
        free = ("lengths", "shapes", "cases")  # a resumed run may sweep more of these
        if {k: v for k, v in prev.get("config", {}).items() if k not in free} == \
                {k: v for k, v in json.loads(json.dumps(config.to_dict())).items() if k not in free}:
            cells = {k: v for k, v in prev.get("results", {}).items() if "not_run" not in v}
            print(f"resuming {out}: {len(cells)} cells kept")
        else:
            print(f"--resume: {out} has other settings; starting afresh")
    if not args.no_ceilings:
        from benchmarks.harness import measure_ceilings

        rec.environment["ceilings"] = measure_ceilings(device, tiny=not gpu)

    def save(complete: bool) -> None:
        add_ratios(cells)
        rec.save(cells, complete=complete)

    order = [c for c in cell_order(shapes, lengths, cases) if f"{c[0]}|{c[1]}|{c[2].name}" not in cells]
    model = shape_now = facts = None
    stopped = False
    for shape, T, case in rec.progress(order, unit="cell"):
        key = f"{shape}|{T}|{case.name}"
        if args.time_limit is not None and rec.elapsed() > args.time_limit - args.cell_budget:
            cells[key] = {"not_run": f"time limit ({args.time_limit:.0f} s)"}
            stopped = True
            continue
        if shape != shape_now:
            model = None
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
            from transformers import LlamaConfig

            cfg_kw = dict(config.shapes[shape])
            facts = shape_facts(LlamaConfig(**cfg_kw))
            w = facts["params"] * elem_bytes
            if w > args.memory_fraction * free_bytes(device):
                shape_now = shape
                rec.log(f"{shape}: weights {w / 2**30:.1f} GiB do not fit")
                model = None
            else:
                model, shape_now = build_model(shape, layers=args.layers, dtype=dtype, device=device), shape
        if model is None:
            cells[key] = {"not_fit": f"the weights ({facts['params'] * elem_bytes / 2**30:.1f} GiB) do not fit "
                                     f"{free_bytes(device) / 2**30:.1f} GiB free on {device}"}
        else:
            cells[key] = run_cell(model, facts, case, T, args, device, elem_bytes, key)
        row = cells[key]
        rec.log(f"{key}: " + (f"prefill {row['prefill_s']:.3f} s, {row['decode_tok_s']} tok/s, "
                              f"KV {row['kv_cache_bytes'] / 2**20:.1f} MiB" if "prefill_s" in row
                              else str(row.get("skipped") or row.get("not_fit"))))
        save(False)
    add_ratios(cells)
    print(table(rec.save(cells, complete=not stopped)))
    print(f"wrote {out}" + ("" if not stopped else " (time limit: a second call with --resume continues)"))
    return 0


main = BENCH.command(add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
