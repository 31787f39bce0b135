"""lcx.eval_tasks: lm-evaluation-harness tasks shipped with lcx (installed as `lcx.eval_tasks`).

One folder per task (YAML + small Python module + README):

- `passkey`, `passkey_ll`, `passkey_primed` — Landmark-Attention passkey retrieval at RULER-style
  context lengths (`--metadata '{"max_seq_lengths": [...]}'`), generation and log-likelihood
  variants, and generation with RULER's kind of answer prefix.
- `modadd_shift` (group) — `(a + b) mod 97` on held-out pairs: in distribution, moved to other
  character offsets, and in natural-language templates never used in training.
- `lcx_ppl`, `lcx_ppl_tail` — perplexity / bits per byte of held-out works of the lcx corpus, by
  context length (whole bucket, or its second half given the first).
- `niah_single_2_pd`, `niah_single_3_pd`, `niah_multikey_1_pd`, `niah_multivalue_pd`,
  `niah_multiquery_pd` — RULER's essay-haystack NIAH tasks (lm-eval's generators) over lcx's
  public-domain held-out corpus instead of downloaded essays; `ruler_offline` (group) — these and
  the six RULER tasks that generate their data (docs/lm-eval.md, "RULER").

lm-eval finds these tasks by itself once lcx is installed (a start-up hook, `lcx._lmeval_hook`,
adds `TASKS_DIR` to every `TaskManager`; opt out with `LCX_NO_LMEVAL_HOOK=1`). Explicitly:
`lm_eval --include_path <TASKS_DIR> ...` or `python -m lcx.eval_tasks ...`.

This module stays import-light: it never imports lm_eval (tests/test_packaging.py checks).
"""

from __future__ import annotations

from pathlib import Path

TASKS_DIR: Path = Path(__file__).resolve().parent

# Task and group names this package defines (tests check every YAML is listed here).
TASK_NAMES: tuple[str, ...] = (
    "passkey",
    "passkey_ll",
    "passkey_primed",
    "modadd_shift",
    "modadd_shift_id",
    "modadd_shift_pos",
    "modadd_shift_template",
    "lcx_ppl",
    "lcx_ppl_tail",
    "niah_single_2_pd",
    "niah_single_3_pd",
    "niah_multikey_1_pd",
    "niah_multivalue_pd",
    "niah_multiquery_pd",
    "ruler_offline",
)

__all__ = ["TASKS_DIR", "TASK_NAMES"]
