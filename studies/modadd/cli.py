"""`lcx train modadd`: one run, a whole study (`--study`, resumable, shardable), the table and
plots again (`--aggregate`), or the decoder-only variant (`--decoder`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Mapping

import torch

from lcx.data.io import atomic_write_json, environment

from .aggregate import aggregate, table_markdown
from .config import RunConfig, StudyConfig
from .decoder import DecoderConfig, train_decoder
from .model import POSITION_ENCODINGS
from .recipes import INTERVENTIONS, RECIPES
from .study import DEFAULT_STUDY, STUDY_PRESETS, run_study
from .training import train_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "One run (prints its accuracy per split, optionally writes the run JSON):\n"
        "  lcx train modadd --recipe robust --position alibi --seed 1 --out /tmp/run.json\n"
        "The whole study (resumable: finished runs in results/modadd/runs/ are skipped), then the\n"
        "table and plots:\n"
        "  nohup lcx train modadd --study --out results/modadd > /tmp/modadd.log 2>&1 &\n"
        "  lcx train modadd --aggregate --out results/modadd      # table/plots from the run files\n"
        "The budget check (4x the steps, one seed) into results/modadd/long:\n"
        "  lcx train modadd --study --config long --shard 0/2  (and 1/2 in a second process)\n"
        "The decoder-only variant, exported for lm-eval:\n"
        "  lcx train modadd --decoder --out results/modadd/decoder\n"
        "  lm_eval --model lcx --model_args pretrained=results/modadd/decoder --tasks modadd_shift\n"
        f"Recipes: {', '.join(RECIPES)}, or robust-no_<x> with x in {', '.join(INTERVENTIONS)}.\n"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--study", action="store_true", help="run every configuration x seed of the study")
    mode.add_argument("--aggregate", action="store_true", help="only rebuild table and plots from --out/runs")
    mode.add_argument("--decoder", action="store_true", help="train and export the decoder-only variant to --out")
    parser.add_argument("--out", default=None,
                        help="run: JSON file; --study/--aggregate: results directory (default results/modadd); "
                             "--decoder: model directory")
    parser.add_argument("--config", default="default",
                        help=f"--study/--aggregate: a committed study ({', '.join(STUDY_PRESETS)}; 'long' is "
                             f"the 4x-budget check) or a StudyConfig JSON file (default: default)")
    parser.add_argument("--recipe", default=None, help="run/--decoder: recipe name (default baseline / the decoder's)")
    parser.add_argument("--position", default="learned", choices=sorted(POSITION_ENCODINGS),
                        help="run: position encoding (default learned)")
    parser.add_argument("--seed", type=int, default=0, help="run/--decoder: seed (default 0)")
    parser.add_argument("--steps", type=int, default=None, help="run/--decoder: optimizer steps")
    parser.add_argument("--shard", default="0/1", metavar="I/N",
                        help="--study: run only runs I, I+N, ... (start N processes, one per core)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _fmt(m: Mapping[str, Any]) -> str:
    return f"id {100 * m['id']:.1f}%  pos {100 * m['pos']:.1f}%  template {100 * m['template']:.1f}%"


def _study_from_arg(config: str) -> StudyConfig:
    if config in STUDY_PRESETS:
        return STUDY_PRESETS[config]
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"--config {config!r} is neither a committed study ({', '.join(STUDY_PRESETS)}) "
                         f"nor a StudyConfig JSON file")
    return StudyConfig.from_dict(json.loads(path.read_text()))


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    progress = not args.no_progress
    if args.study or args.aggregate:
        study, out = _study_from_arg(args.config), args.out
        if out is None:
            out = "results/modadd" if args.config == "default" else f"results/modadd/{Path(args.config).stem}"
        out = Path(out)
        if args.aggregate:
            table = aggregate(out, study)
        else:
            i, n = (int(x) for x in args.shard.split("/"))
            run_study(study, out, progress=progress, shard=(i, n))
            table = json.loads((out / "table.json").read_text())
        print(table_markdown(table), end="")
        print(f"table, plots and runs in {out}")
        return 0
    if args.decoder:
        if not args.out:
            raise ValueError("--decoder needs --out DIR (the exported model directory)")
        d = {"seed": args.seed}
        if args.recipe:
            d["recipe"] = args.recipe
        if args.steps:
            d["steps"] = args.steps
        _, _, res = train_decoder(DecoderConfig.from_dict(d), args.out, progress=progress)
        print(f"decoder ({res['n_params']:,} params, {res['train_s']:.0f}s): {_fmt(res['metrics'])}; saved to {args.out}")
        return 0
    d = {"recipe": args.recipe or "baseline", "position": args.position, "seed": args.seed}
    if args.steps:
        d["steps"] = args.steps
    cfg = RunConfig.from_dict({**DEFAULT_STUDY.run, **d})
    _, res = train_run(cfg, progress=progress)
    print(f"{cfg.name} ({res['train_s']:.0f}s): {_fmt(res['metrics'])}; train pairs {100 * res['metrics']['train_id']:.1f}%")
    if args.out:
        atomic_write_json(args.out, {**res, "environment": environment()})
    return 0
