"""`lcx report`'s command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..presets import PRESETS, add_presets_argument
from .config import DEFAULT_METHODS, FULL_RULER_SAMPLES, ReportConfig
from .render import markdown
from .run import run_report

# CLI
# ============================================================================================

# `--quick`, a plumbing check of every method in about two minutes: 2 depths x 1 key, 1 perplexity window,
# 8 decode tokens, 1 prompt per RULER task, and (unless --lengths is given) the lengths L0 and 4 L0 only
# (every kind of cell, RULER's at 4 L0 = 1024 on the bundled model)
QUICK = dict(depths=2, samples_per_depth=1, ppl_docs=1, decode_tokens=8, ruler_samples=1)
QUICK_LENGTHS = (1, 4)  # x L0


def _custom_method(s: str) -> tuple[str, dict[str, Any]]:
    """`NAME=CONFIG` -> (NAME, the config's nested dict); CONFIG is JSON (`{...}`) or the flat
    `k=v,k=v` form of lm-eval's --model_args."""
    from ..method_config import MethodConfig

    name, eq, conf = s.partition("=")
    if not eq or not name or not conf:
        raise argparse.ArgumentTypeError(f"expected NAME=CONFIG, got {s!r}")
    try:
        cfg = MethodConfig.from_json(conf) if conf.lstrip().startswith("{") else MethodConfig.from_flat(conf)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{name}: {e}") from None
    return name, cfg.to_dict()


def _quick_lengths(model: str) -> tuple[int, ...]:
    """`--quick`'s lengths: QUICK_LENGTHS x the model's context."""
    from .config import model_context

    return tuple(model_context(model) * m for m in QUICK_LENGTHS)


def _count(flag: str, text: str) -> int:
    """A count >= 1 given to `flag` (which also takes 'all'), or ValueError naming the flag."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{flag} must be an integer >= 1 or 'all', got {text!r}")
    return n


def _custom_methods(pairs: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, conf in pairs:
        if name in out:
            raise ValueError(f"--method {name!r} given twice")
        out[name] = conf
    return out


def _depths(s: str) -> int | tuple[float, ...]:
    try:
        return int(s) if "," not in s and "." not in s else tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a grid size or comma-separated fractions, got {s!r}") from None


def _int_list(s: str) -> tuple[int, ...]:
    if s.strip().lower() == "none":  # --decode-lengths none: no decode cells
        return ()
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    doc = sys.modules[__package__].__doc__  # the package docstring: what the report does
    p.description = doc.split("\n\n")[0] + "\n\n" + doc.split("\n\n", 2)[2].split("Output")[0]
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--model", default="tiny-ret-5m",
                   help="preset, HF directory, .gguf or Hub id org/name[@revision] (default: %(default)s)")
    add_presets_argument(p, default=",".join(DEFAULT_METHODS),
                         help="comma-separated presets, a subset of: " + ", ".join(PRESETS) + " (default: "
                              + ", ".join(DEFAULT_METHODS) + "); none: only the --method configs")
    p.add_argument("--method", action="append", default=[], metavar="NAME=CONFIG", type=_custom_method,
                   help="also run a method config of your own under NAME (repeatable), on the report's model "
                        "with the same prompts: CONFIG is an lcx.MethodConfig as JSON, e.g. "
                        "'lmi_cap={\"attention\": {\"type\": \"lm_infinite\", \"n_global\": 10, \"n_local\": 8192, "
                        "\"limit_distance\": 2048}}', or in lm-eval's flat form, e.g. 'yarn4=rope_type=yarn,factor=4'. "
                        "--presets none runs only these")
    p.add_argument("--lengths", type=_int_list, default=None,
                   help="context lengths for passkey/perplexity (default: L0 x 1,2,4,8)")
    p.add_argument("--decode-lengths", type=_int_list, default=None,
                   help="prompt lengths for decoding (default: --lengths; none: no decode cells, e.g. for a "
                        "passkey/perplexity sweep)")
    p.add_argument("--depths", type=_depths, default=ReportConfig.depths,
                   help="needle depths per length: a grid size over [0, 1] (default: %(default)s) or "
                        "comma-separated fractions, e.g. 0.1,0.37,0.63,0.9")
    p.add_argument("--samples-per-depth", type=int, default=ReportConfig.samples_per_depth,
                   help="passkey keys per (depth, length); prompts per cell = depths x this "
                        "(default: %(default)s, i.e. 30 prompts per cell with the default 6 depths)")
    p.add_argument("--ppl-docs", type=int, default=ReportConfig.ppl_docs,
                   help="held-out text windows per length for perplexity (default: %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=ReportConfig.decode_tokens,
                   help="greedy tokens generated after the prompt in each decode cell (default: %(default)s)")
    p.add_argument("--seed", type=int, default=ReportConfig.seed,
                   help="seed of the passkey keys (every method gets the same prompts; the held-out "
                        "perplexity windows are fixed) (default: %(default)s)")
    from ..threads import add_threads_argument

    add_threads_argument(p)
    p.add_argument("--jobs", default=None, metavar="N|auto",
                   help="measure up to N cells at once, each in a worker process of its own that loads its own model "
                        "(N x the memory of one cell): same numbers and order as one at a time; decode cells (timed) "
                        "run alone. Each job gets --threads threads, or cores // N with `auto` (default: auto, on a CPU "
                        "one job per core as far as memory holds the cells (lcx.report.jobs.auto_jobs), one on a GPU; "
                        "with --ray: as many as the cluster holds)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="measure each cell as a Ray task (pip install 'lcx[ray]'; docs/report.md, \"Ray\"): on the "
                        "cluster at ADDRESS (host:port, or `auto`; default: $RAY_ADDRESS), else on one started for the "
                        "run on this machine, bound to 127.0.0.1, with --jobs x --threads CPUs (default: every core). "
                        "A cell asks for --threads CPUs (default 1 under --ray), one GPU with --device cuda and its "
                        "memory estimate; decode cells run alone on their node. Same numbers, order and cell store as "
                        "a serial run; a cell whose node is lost is retried from its journal, one that fails is "
                        "reported and the others go on (exit status 1)")
    p.add_argument("--device", default=ReportConfig.device, help="cpu or cuda[:N] (default: %(default)s)")
    p.add_argument("--dtype", default=ReportConfig.dtype, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default: %(default)s)")
    p.add_argument("--attn-backend", default=ReportConfig.attn_backend,
                   help="lcx.attention backend of the attention methods' prefill and decode (default: "
                        "%(default)s: torch's fused flash kernels composed into the windowed mask; e.g. "
                        "triton on a GPU, blockwise, sdpa)")
    p.add_argument("--tasks", default=",".join(ReportConfig.tasks),
                   help="what to measure, comma-separated: passkey and ppl (one lm-eval cell, always together) "
                        "and ruler (lcx's ruler_offline tasks, at the lengths >= 1024; docs/report.md); also "
                        "passkey_primed (the passkey prompts with a primed answer, paired with passkey's prompt by "
                        "prompt: lcx.report.primed) (default: %(default)s)")
    p.add_argument("--ruler-samples", type=int, default=None,
                   help=f"prompts per RULER task and length (default: {ReportConfig.ruler_samples}, so that the "
                        f"main job takes minutes; {FULL_RULER_SAMPLES} with --full)")
    p.add_argument("--full", action="store_true",
                   help=f"the full run: {FULL_RULER_SAMPLES} prompts per RULER task and length instead of "
                        f"{ReportConfig.ruler_samples} (the committed bundled report's setting; about 3x the "
                        "default's time, RULER's prefills being most of it)")
    p.add_argument("--ruler-tasks", default=",".join(ReportConfig.ruler_tasks), metavar="TASKS",
                   help="comma-separated subset of lcx's ruler_offline tasks to run (default: all 11), e.g. the "
                        "tasks a model does above floor inside its context")
    p.add_argument("--equivalent-check", default=str(ReportConfig.ruler_equivalent_check), metavar="N|all",
                   help="a RULER cell whose method computes exactly what vanilla computes on every prompt of the "
                        "cell (its window covers each prompt with its answer, dynamic NTK inside the context: "
                        "MethodConfig.identity_up_to) measures its first N prompts per task and, if they answer word "
                        "for word as vanilla's cell at that length, takes vanilla's answers for the rest (marked in "
                        "the README); 'all' measures such cells in full (default: %(default)s)")
    p.add_argument("--ppl-max-length", type=int, default=None, metavar="TOKENS",
                   help="measure perplexity only at lengths <= TOKENS (longer cells: passkey alone); windows are "
                        "cut at the longest such length, and a held-out work must be that long (default: every length)")
    p.add_argument("--out", type=Path, default=Path("results/report"), help="output folder (default: %(default)s)")
    p.add_argument("--fresh", action="store_true",
                   help="recompute every cell and every answer, even of an interrupted run (default: resume an "
                        "interrupted run with the same settings and code, inside a cell from its journal; a "
                        "finished one is measured again)")
    p.add_argument("--keep-other-code", action="store_true",
                   help="keep stored cells (of the interrupted run; with --reuse/--render, any matching ones) even "
                        "if the lcx code that measured them differs from this checkout's -- for a change you know "
                        "does not touch the numbers (a refactor, a new preset) in a sweep too long to redo. Settings, "
                        "models and environment must still match; the report lists every such cell and the modules "
                        "that differ (report.json.gz: cells_kept_with_other_code)")
    p.add_argument("--reuse", action="store_true",
                   help="keep stored cells of any earlier run whose settings and code/model/environment "
                        "fingerprint match (e.g. to redraw plots)")
    p.add_argument("--render", action="store_true",
                   help="measure nothing: write the report from the stored matching cells (a sweep's progress)")
    p.add_argument("--page", action="store_true",
                   help="write only --out's index.html (the report as a page: tables, pictures, every answer "
                        "browsable) from the report.json.gz, README.md and PNGs it holds; measures and renders "
                        "nothing else (`lcx report` and --render write the page too)")
    p.add_argument("--compact-cells", nargs="+", type=Path, default=None, metavar="FOLDER",
                   help="measure nothing: move the per-cell files an earlier version wrote (cells/*.json.gz, "
                        "cells/*.json, cells/run.json) of every report folder under each FOLDER into that folder's "
                        "cell store, cells/cells.jsonl.xz (one file per report; the cells read back equal), and "
                        "delete them")
    p.add_argument("--quick", action="store_true",
                   help="plumbing check of every method in about two minutes: lengths L0 and 4 x L0 (unless --lengths), "
                        "2 depths x 1 key, 1 ppl doc, 8 decode tokens, 1 prompt per RULER task")
    p.add_argument("--verbose", action="store_true",
                   help="also print what lm-eval and transformers say on every cell (the warnings lcx's own use "
                        "triggers, per-task progress bars); by default only the report's bar and its cell lines")


def _compact_cells(folders: list[Path]) -> int:
    """`--compact-cells`: every report folder (one holding cells/) at or under each of `folders`."""
    from .cells import migrate_cells, store_path

    reports = sorted({c.parent for f in folders for c in ([f / "cells"] + sorted(f.rglob("cells")))
                      if c.is_dir()})
    if not reports:
        print(f"lcx report --compact-cells: no report folder (with cells/) under {', '.join(map(str, folders))}",
              file=sys.stderr)
        return 2
    for out in reports:
        before = sum(f.stat().st_size for f in (out / "cells").iterdir() if f.is_file())
        info = migrate_cells(out)
        after = store_path(out).stat().st_size if store_path(out).exists() else 0
        left = f"; left {len(info['unreadable'])} unreadable file(s): {', '.join(info['unreadable'])}" \
            if info["unreadable"] else ""
        print(f"{out}: {info['cells']} cells in {store_path(out).name}, {info['moved']} file(s) moved in "
              f"({before:,} -> {after:,} bytes){left}")
    return 0


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.page:
        from .page import write_page_from_folder

        try:
            path = write_page_from_folder(args.out)
        except ValueError as e:
            print(f"lcx report --page: {e}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
        return 0
    if args.compact_cells:
        return _compact_cells(args.compact_cells)
    if args.verbose:  # read by every cell, in worker processes too (lcx.report.quiet)
        from .quiet import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"
    if args.quick and args.full:
        print("lcx report: --quick and --full ask for opposite runs; give one", file=sys.stderr)
        return 2
    extra = dict(QUICK) if args.quick else {}
    if args.ruler_samples is None:
        args.ruler_samples = FULL_RULER_SAMPLES if args.full else ReportConfig.ruler_samples
    try:
        cfg = ReportConfig(
            model=args.model, methods=() if args.presets == "none" else tuple(m for m in args.presets.split(",") if m),
            custom_methods=_custom_methods(args.method),
            lengths=args.lengths if args.lengths is not None or not args.quick else _quick_lengths(args.model),
            decode_lengths=args.decode_lengths,
            depths=extra.get("depths", args.depths), samples_per_depth=extra.get("samples_per_depth",
                                                                                args.samples_per_depth),
            ppl_docs=extra.get("ppl_docs", args.ppl_docs), decode_tokens=extra.get("decode_tokens", args.decode_tokens),
            seed=args.seed, device=args.device, dtype=args.dtype, attn_backend=args.attn_backend,
            tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()),
            ruler_samples=extra.get("ruler_samples", args.ruler_samples),
            ruler_tasks=tuple(x.strip() for x in args.ruler_tasks.split(",") if x.strip()),
            ppl_max_length=args.ppl_max_length,
            ruler_equivalent_check=None if args.equivalent_check == "all" else _count("--equivalent-check",
                                                                                     args.equivalent_check))
    except ValueError as e:
        print(f"lcx report: {e}", file=sys.stderr)
        return 2
    from ..allocator import reuse_freed_memory
    from ..threads import AUTO, available_cores, resolve_threads
    from .jobs import auto_jobs

    try:
        args.jobs = None if args.jobs in (None, AUTO) else int(args.jobs)
        if args.jobs is not None and args.jobs < 1:
            raise ValueError
    except ValueError:
        print(f"lcx report: --jobs must be an integer >= 1 or 'auto', got {args.jobs!r}", file=sys.stderr)
        return 2
    if args.ray is not None and args.device not in ("cpu", "cuda"):
        print(f"lcx report: --ray gives each cell its own GPU: --device must be cpu or cuda, got {args.device!r}",
              file=sys.stderr)
        return 2
    resolve_threads(args.threads)
    reuse_freed_memory()
    ray_kw: dict[str, Any] = {}
    if args.ray is not None:  # a cell per task: --threads each (auto: 1, the cluster runs more cells instead)
        job_threads = 1 if args.threads in (None, AUTO) else int(args.threads)
        jobs = args.jobs
        ray_kw = {"ray": True, "ray_address": args.ray or os.environ.get("RAY_ADDRESS") or None,
                  "ray_cpus": jobs * job_threads if jobs else None}
    else:
        jobs = args.jobs or auto_jobs(cfg)
        job_threads = max(1, available_cores() // jobs) if args.threads in (None, AUTO) else int(args.threads)
    if args.render and (args.fresh or args.reuse):
        print("lcx report: --render measures nothing; it cannot be combined with --fresh/--reuse", file=sys.stderr)
        return 2
    record = run_report(cfg, args.out, fresh=args.fresh, reuse=args.reuse, render=args.render,
                        keep_other_code=args.keep_other_code, jobs=jobs, job_threads=job_threads, **ray_kw)
    print(markdown(record).split("## Methods")[0])
    print(f"wrote {args.out / 'README.md'}, report.json.gz, index.html and the plots")
    if record.get("cells_failed"):
        print(f"lcx report: {len(record['cells_failed'])} cell(s) failed (listed above; report.json.gz: cells_failed); "
              "the same command measures them again", file=sys.stderr)
        return 1
    return 0
