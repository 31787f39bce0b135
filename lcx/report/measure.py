"""`lcx report`'s measurements, one cell each: passkey + perplexity through lm-eval's
`simple_evaluate` with the `lcx` model (`run_lmeval_cell`), decoding speed and KV memory through
`lcx.engine` (`run_decode_cell`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..presets import PresetRun
from .config import ReportConfig
from .lm import evaluate, lmeval_model
from .passkey import passkey_result  # noqa: F401  (its home until #76's primed cells shared it)

# Cells
# ============================================================================================

def _tasks_dir() -> str:
    from lcx.eval_tasks import TASKS_DIR

    return str(TASKS_DIR)


def run_lmeval_cell(model: str, run: PresetRun, cfg: ReportConfig, length: int, *,
                    lm: Any = None, ppl: bool | None = None, journal: Path | None = None) -> dict[str, Any]:
    """passkey + lcx_ppl at one context length through lm-eval's `simple_evaluate` with the
    `lcx` model (`lm`: one from `lmeval_model`, built here when None). Perplexity windows are cut
    at `cfg.ppl_window` tokens (`window_tokens`), so a length scores the same text whether it runs
    alone or in a sweep. `ppl`: whether to measure perplexity (default: at `cfg.ppl_lengths`;
    False: passkey only, as `lcx bench prefix --cell` runs it). `journal`: resume from / write to
    this request journal (`lcx.report.lm.evaluate`); the result's `resumed_requests` says how many answers
    came from it (absent: none)."""
    from lm_eval.tasks import TaskManager

    lm = lmeval_model(run, cfg, length=length) if lm is None else lm
    ppl = length in cfg.ppl_lengths if ppl is None else ppl
    meta = {"tokenizer": run.model, "max_seq_lengths": [length], "window_tokens": cfg.ppl_window,
            "depths": list(cfg.depths) if isinstance(cfg.depths, tuple) else cfg.depths,
            "samples_per_depth": cfg.samples_per_depth, "max_docs": cfg.ppl_docs, "seed": cfg.seed}
    t0 = time.perf_counter()
    tm = TaskManager(include_path=_tasks_dir(), include_defaults=False, metadata=meta)
    res, resumed = evaluate(lm, journal, tasks=["passkey", "lcx_ppl"] if ppl else ["passkey"], task_manager=tm,
                             metadata=meta, log_samples=True, verbosity="WARNING")
    wall = time.perf_counter() - t0
    L = str(length)
    out = passkey_result(res, "passkey", length)
    if ppl:
        scores = res["results"]["lcx_ppl"]
        out["ppl"] = {m: scores[f"{m}_{L},none"] for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")}
        out["ppl_docs"] = res["n-samples"]["lcx_ppl"]["effective"]
    out["wall_s"] = round(wall, 2)
    if resumed:
        out["resumed_requests"] = resumed  # wall_s is this process's part only
    return out


def prompt_ids(tokenizer: Any, n: int) -> list[int]:
    """n tokens of held-out text (the lcx corpus validation split, documents concatenated)."""
    from ..data.corpus import load_corpus

    ids: list[int] = []
    for doc in load_corpus("validation"):
        ids += tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the held-out corpus has only {len(ids)} tokens; asked for {n}")


def run_decode_cell(model: str, run: PresetRun, cfg: ReportConfig, length: int) -> dict[str, Any]:
    """Prefill `length` tokens of held-out text, then greedy-decode `decode_tokens` with lcx's
    engine (batch 1): prefill time, decode tokens/s and the peak KV-cache size."""
    import torch

    from ..engine import Engine, EngineConfig, SamplingParams
    from ..models import load_model

    m, tok = load_model(run.model, dtype=cfg.dtype, device=cfg.device)
    engine = Engine(m, tok, EngineConfig(methods=run.config.with_default_backend(cfg.attn_backend), max_batch=1,
                                         max_model_len=length + cfg.decode_tokens + 1))
    prompt = prompt_ids(tok, length)
    # one CPU thread: tokens/s from this process's CPU time, which the other processes of a shared
    # machine do not inflate (wall time is recorded too); otherwise (threads, GPU) wall time
    cpu_timed = cfg.device == "cpu" and torch.get_num_threads() == 1
    with torch.inference_mode():
        engine.add_request(prompt, SamplingParams(max_tokens=cfg.decode_tokens, ignore_eos=True))
        t0 = time.perf_counter()
        engine.step()  # prefill + first token
        prefill = time.perf_counter() - t0
        peak, steps, t1, c1 = engine.kv_cache_bytes, 0, time.perf_counter(), time.process_time()
        while engine.has_work():
            engine.step()
            steps += 1
            peak = max(peak, engine.kv_cache_bytes)
        decode, decode_cpu = time.perf_counter() - t1, time.process_time() - c1
    timed = decode_cpu if cpu_timed else decode
    return {"prefill_s": round(prefill, 4), "decode_s": round(decode, 4), "decode_cpu_s": round(decode_cpu, 4),
            "decode_steps": steps, "tokens_per_s": steps / timed if timed > 0 else float("nan"),
            "timing": "process CPU time (1 thread)" if cpu_timed else "wall", "kv_cache_mb": peak / 2**20,
            "threads": torch.get_num_threads()}


def run_ruler_cell(model: str, run: PresetRun, cfg: ReportConfig, length: int, *,
                   journal: Path | None = None) -> dict[str, Any]:
    from .ruler import run_ruler_cell as run_cell

    return run_cell(model, run, cfg, length, journal=journal)


def run_primed_cell(model: str, run: PresetRun, cfg: ReportConfig, length: int, *,
                    journal: Path | None = None) -> dict[str, Any]:
    from .primed import run_primed_cell as run_cell

    return run_cell(model, run, cfg, length, journal=journal)


CELL_RUNNERS = {"lmeval": run_lmeval_cell, "decode": run_decode_cell, "ruler": run_ruler_cell,
                "passkey_primed": run_primed_cell}
# How a decode cell times (its settings carry it: cells timed otherwise are measured again).
DECODE_TIMING = "cpu time with one CPU thread, else wall"

