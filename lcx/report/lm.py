"""The `lcx` lm-eval model a report cell evaluates (passkey/perplexity and RULER cells alike), and
the call that evaluates it with a request journal (a cell resumes from its last answer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..presets import PresetRun
from .config import ReportConfig


# Generation: a cell's prompts decode together, as many rows a step as fit GENERATION_BATCH_BYTES of
# keys and values at the cell's longest sequence (at most MAX_GENERATION_BATCH): the bundled model
# decodes 16 rows at once, SmolLM2 at 16k one (as before). Answers are batch size 1's
# (`LcxLM(generation_batch=N)`, tests/eval_tasks/test_lmeval_reuse.py).
GENERATION_BATCH_BYTES = 1 << 30
MAX_GENERATION_BATCH = 16


def generation_batch(model: str, length: int, dtype: str = "float32") -> int:
    """Rows a cell at `length` tokens (+ a 256-token answer budget) decodes together."""
    from ..hf.models import model_shape
    from .config import model_hf_config

    import transformers

    config = transformers.AutoConfig.for_model(**model_hf_config(model))
    per_token = model_shape(config).kv_bytes_per_token(2 if dtype in ("bfloat16", "float16") else 4)
    return max(1, min(MAX_GENERATION_BATCH, GENERATION_BATCH_BYTES // max(1, per_token * (length + 256))))


def lmeval_model(run: PresetRun, cfg: ReportConfig, *, prefix_caching: bool = True, length: int | None = None) -> Any:
    """The `lcx` lm-eval model a cell of `run` evaluates (batch size 1: prompts in prefix-reuse
    order; `prefix_caching=False`: the engine without its prefix cache; `length`: the cell's, whose
    prompts then decode together, `generation_batch`)."""
    from ..lmeval_model import LcxLM

    batch = 1 if length is None else generation_batch(run.model, length, cfg.dtype)
    return LcxLM(pretrained=run.model, batch_size=1, dtype=cfg.dtype, device=cfg.device,
                 prefix_caching=prefix_caching, generation_batch=batch,
                 **run.config.with_default_backend(cfg.attn_backend).to_flat())


def journal_db(journal: str | Path) -> Path:
    """The file lm-eval's `CachingLM` keeps a cell's journal in (`simple_evaluate(use_cache=...)`
    appends the rank)."""
    return Path(f"{journal}_rank0.db")


def journal_count(journal: str | Path | None) -> int:
    """Requests a cell's journal already holds (0: none, or no journal)."""
    if journal is None or not journal_db(journal).exists():
        return 0
    from sqlitedict import SqliteDict

    with SqliteDict(str(journal_db(journal)), flag="r") as db:
        return len(db)


def evaluate(lm: Any, journal: str | Path | None, **kwargs: Any) -> tuple[dict[str, Any], int]:
    """lm-eval's `simple_evaluate`, with every answered request written to `journal` as it is
    answered (lm-eval's request cache, `use_cache`: a SQLite file per cell), so a cell killed
    half-way resumes from its last answer instead of its first prompt. -> (results, requests
    taken from the journal). The journal's key is the request (prompt, generation arguments),
    so a journal belongs to one cell's settings and code (`lcx.report.run.cell_journal`)."""
    from lm_eval import simple_evaluate

    resumed = journal_count(journal)
    if journal is not None:
        journal_db(journal).parent.mkdir(parents=True, exist_ok=True)
    res = simple_evaluate(model=lm, use_cache=None if journal is None else str(journal), **kwargs)
    return res, resumed
