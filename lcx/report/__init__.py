"""`lcx report`: one command from install to an extrapolation report.

    lcx report                                   # bundled tiny-ret-5m (retrieves at L0 = 256); RULER at 1024/2048 adds hours on CPU
    lcx report --tasks passkey,ppl               # passkey, perplexity, decoding only: ~25 min on 2 CPU cores
    lcx report --model smollm2-135m --lengths 2048,4096,8192 --presets vanilla,yarn,lm_infinite
    lcx report --quick --out /tmp/r              # plumbing check in a minute or two
    lcx report --jobs 4 --threads 1              # four cells at once, one thread each (4 x the memory)

For each context-extension method (vanilla, linear/PI, NTK, dynamic NTK, YaRN, Giraffe
truncation, LM-Infinite (also with the paper's top-k middle keys), sliding window, StreamingLLM sinks, LM-Infinite + YaRN, Self-Extend, and SWAT;
a preset with sibling models, like SWAT's, runs on the model's sibling trained with the method,
e.g. tiny-5m -> tiny-swat-5m, and is skipped for a model without one) it measures, beyond the
model's training context L0:

- passkey accuracy by context length x needle depth and perplexity by context length, through
  lm-eval's `simple_evaluate` on the lcx tasks `passkey` and `lcx_ppl` with the `lcx` lm-eval
  model (`lcx.lmeval_model.LcxLM`, the same model class as `lm_eval --model lcx`);
- RULER (`--tasks ... ,ruler`, the default; lengths >= 1024 only): lcx's `ruler_offline` tasks
  through the same `simple_evaluate` and `lcx` model, every task per length with Wilson
  intervals, the headline mean over tasks, paired tests (`lcx.report.ruler`); a cell whose
  method computes what vanilla computes on each of its prompts takes vanilla's answers after
  its first prompts per task answer the same (`--equivalent-check`, docs/report.md);
- passkey with a primed answer (`--tasks ...,passkey_primed`, asked for, never a default): the
  passkey prompts with RULER's kind of question and answer prefix, a cell of its own, paired prompt
  by prompt with the published prompt (McNemar; the share of misses that were prose:
  `lcx.report.primed`);
- decoding speed (tokens/s after a prompt of L tokens) and KV-cache memory by context length,
  through `lcx.engine.Engine` with the method as an engine method (`rope` / `attention`), i.e.
  the engine `lcx serve` runs (LM-Infinite / windows keep bounded caches there).

No method is re-implemented here: each is a `{"rope": ..., "attention": ...}` config handed to
those two components (`lcx.presets`); a sibling model runs the method its config records. Defaults scale with the model: RoPE factor s =
max(lengths) / L0, LM-Infinite n_global = 10 (the paper's default) and n_local = L0, windows L0.

Output (`--out`, default results/report/): `report.json.gz` (gzipped JSON: resolved config, environment, every
number; `passkey_intervals`: each passkey cell's correct count k, prompts n and Wilson 95%
interval, recomputed from the stored per-prompt results at every render; `passkey_paired`: every
pair of methods compared prompt by prompt at each length, the paired difference with its interval
and the exact McNemar p), `passkey_heatmap.png`
(k/n per depth cell), `passkey_by_length.png` (accuracy with Wilson 95% error bars), `headline.png`
(the README's first picture: passkey and, with RULER cells, RULER's headline by length),
`ppl_by_length.png`, `decode_by_length.png`, `README.md` (the summary tables + images), `index.html` (the report as one self-contained page: the tables, pictures and every prompt's answer, filterable; `lcx.report.page`, `lcx report --page` writes it alone), and `cells/cells.jsonl.xz` — the cell store: one xz-compressed JSON Lines file holding the run they belong to and
one line per (method, measurement, length) cell, rewritten atomically (under a lock) as each cell finishes
(`lcx.report.cells`, "The cell store"; the per-cell `cells/X.json.gz`/`X.json` and `cells/run.json` of earlier
versions are still read, and moved into the store by the next write or `lcx report --compact-cells FOLDER`).

Measure, not replay. A cell records its settings and a fingerprint of what produced its numbers:
the source of the modules that compute them (`NUMERICS_MODULES`, per measurement), the model's
files, and the environment (python, torch, transformers, lm-eval, tokenizers, device). A
`lcx report` whose last run in `--out` finished starts a new run and recomputes every cell. Only
an interrupted run with the same settings is resumed, and of its completed cells only those whose
own fingerprint is unchanged are kept: the modules of that cell's measurement, the models, the
environment (an engine change re-measures the decode cells, not the lm-eval ones). What was reused
and why is printed, and recorded in report.json.gz. `--reuse` also
keeps cells of finished runs whose settings and fingerprint match (e.g. to redraw plots);
`--fresh` recomputes everything. The cell order is length-major (every method at the shortest
length first), so an interrupted sweep already has complete tables at the shorter lengths. Inside
an lm-eval cell every answer is journaled as it is given (in lcx's cache: `cells.journal_dir`, keyed by the cell's
settings and fingerprint; `lcx.report.lm.evaluate`), so a cell killed half-way resumes from its
last answer and records `resumed_requests`.
"""


from __future__ import annotations

from .cells import (
    CELL_VERSION,
    NUMERICS_MODULES,
    cell_fingerprint,
    cell_settings,
    code_fingerprint,
    env_fingerprint,
    load_cell,
    migrate_cells,
    model_fingerprint,
    plan_run,
    read_cell,
    read_cells,
    read_run,
    run_fingerprint,
    write_cell,
)
from .cli import QUICK, add_arguments, run
from .config import (
    CELL_KINDS,
    DEFAULT_METHODS,
    PPL_METRIC,
    ReportConfig,
    model_context,
    model_hf_config,
    run_settings,
)
from .measure import (
    CELL_RUNNERS,
    DECODE_TIMING,
    prompt_ids,
    run_decode_cell,
    run_lmeval_cell,
)
from .render import (
    format_interval,
    markdown,
    passkey_counts,
    passkey_interval,
    passkey_intervals,
    passkey_paired,
    plot_report,
)
from .run import run_report

__all__ = ["CELL_KINDS", "CELL_RUNNERS", "CELL_VERSION", "DECODE_TIMING", "DEFAULT_METHODS", "NUMERICS_MODULES", "PPL_METRIC", "QUICK", "ReportConfig", "prompt_ids", "add_arguments", "cell_fingerprint", "cell_settings", "code_fingerprint", "env_fingerprint", "format_interval", "load_cell", "markdown", "migrate_cells", "model_context", "model_fingerprint", "model_hf_config", "passkey_counts", "passkey_interval", "passkey_intervals", "passkey_paired", "plan_run", "plot_report", "read_cell", "read_cells", "read_run", "run", "run_decode_cell", "run_fingerprint", "run_lmeval_cell", "run_report", "run_settings", "write_cell"]
