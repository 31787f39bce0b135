"""The `lcx` command line.

Each subcommand lives in its own module that exposes `add_arguments(parser)` and
`run(args) -> int`; this file only wires them together, so `lcx --help` lists everything
without importing torch or transformers.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from importlib import import_module
from pathlib import Path

# (command path, module, one-line help). The module is imported only when the command runs
# or its --help is asked for.
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("report",), "lcx.report",
     "the main job: passkey, perplexity and decoding vs context length for every method -> results/report/"),
    (("demo",), "lcx.demo",
     "RoPE extrapolation table: perplexity of the bundled model at 256..4k tokens per RoPE type"),
    (("train", "lm"), "lcx.train.lm.cli",
     "train a small Llama-style LM on public-domain text (Shakespeare + KJV Bible)"),
    (("train", "build"), "lcx.train.build",
     "build a bundled model that lcx keeps as a recipe (tiny-swat-5m) into the lcx cache: its committed weights"
     " from git's history, or retrained"),
    (("train", "stream"), "lcx.train.stream",
     "train + evaluate the streaming word-transduction task: group vs interleaved positions"),
    (("train", "modadd"), "studies.modadd.cli",
     "modular-addition robustness study (position shift, template OOD): encoder recipes, decoder export"),
    (("eval", "ppl"), "lcx.eval.perplexity",
     "perplexity of a model on held-out text at several context lengths, with a RoPE spec"),
    (("models",), "lcx.models.cli",
     "list model presets and where their files come from"),
    (("rope",), "lcx.rope.cli",
     "print inv_freq / wavelengths of a RoPE spec (and check it against transformers)"),
    (("serve",), "lcx.serve.cli",
     "OpenAI-compatible server (completions, chat, streaming, logprobs) over lcx's batching engine"),
    (("vllm-args",), "lcx.serve.vllm_plugin.args",
     "print vLLM arguments that run lcx methods (lm-eval --model vllm model_args JSON, vllm serve flags)"),
    (("sweep",), "lcx.report.sweep",
     "a report sweep as a TOML file (sweeps/): run it (resumable; --ray), its status (cells done, running where,"
     " time left), render its report"),
    (("bench", "threads"), "benchmarks.threads",
     "which torch thread count is fastest here, idle and with one core busy -> results/threads_cpu.json"),
    (("bench", "prefill"), "benchmarks.prefill",
     "one long prefill per method vs the unpatched model (CPU time, memory) -> results/prefill_cpu.json"),
    (("bench", "pie"), "benchmarks.pie",
     "PIE code editing on stdlib code: recompute vs PIE vs stale cache, accuracy with CIs and cost"
     " -> results/pie_code_edit.json"),
    (("bench", "kernels"), "benchmarks.kernels",
     "time the GPU kernels (triton do_bench, roofline), write results/kernels/<gpu>.json; --check for regressions"),
    (("bench", "attention"), "benchmarks.attention",
     "Λ-mask / LM-Infinite attention per backend vs dense causal SDPA on CPU (time, peak memory)"
     " -> results/attention_cpu.{json,png}"),
    (("bench", "decode"), "benchmarks.decode",
     "decode tok/s per method through lcx's engine vs vanilla, 4k-32k, SmolLM2-135M's shape, with the"
     " memory-traffic ideal -> results/decode_cpu.{json,png}"),
    (("bench", "extrapolation"), "benchmarks.extrapolation",
     "perplexity and likelihood passkey to 8k per attention / RoPE method on tiny-5m"
     " -> results/extrapolation_tiny.{json,png}"),
    (("bench", "swat"), "benchmarks.swat",
     "held-out perplexity to 8k: the SWAT model vs the softmax model under every RoPE method"
     " -> results/swat_vs_softmax.{json,png}"),
    (("bench", "lmeval"), "benchmarks.lmeval",
     "passkey (depth x length) and perplexity per RoPE method through the lm_eval CLI -> results/lmeval/"),
    (("bench", "scale"), "benchmarks.scale",
     "every method at GPU scale on random weights (llama-3-8b, 32k-128k): prefill, decode tok/s, KV, memory vs"
     " vanilla -> results/scale/<device>.json"),
    (("bench", "prefix"), "benchmarks.prefix",
     "lcx's engine with vs without its prefix cache, beside vLLM's if installed: shared-system-prompt and"
     " passkey-sweep loads (throughput, time to first token) -> results/prefix_cpu.json"),
    (("bench", "allocator"), "benchmarks.allocator",
     "glibc's default allocator vs freed memory kept for reuse (lcx.allocator): CPU, page faults, peak RSS"
     " through lcx's engine -> results/allocator_cpu.json"),
    (("bench", "serving"), "benchmarks.serving",
     "throughput and latency of lcx serve (batched vs one at a time) and vLLM if installed"
     " -> results/serving_cpu.json"),
    (("bench", "step"), "benchmarks.step",
     "where a step of lcx's engine spends its CPU time (prefill, decode at 1 and 32 rows): linear layers,"
     " attention kernels, everything else -> results/engine_step_profile_cpu.json"),
    (("bench", "rows"), "benchmarks.rows",
     "the attention paths of a model as loaded per prefill row (torch's fused kernel, lcx's flash, masked SDPA,"
     " causal blocks): time, GFLOP/s, ratios -> results/loaded_rows_cpu.json"),
    (("bench", "sweep"), "benchmarks.sweep",
     "cells per hour of a report sweep serial, --jobs 2 and on Ray with 1 and 2 local workers; Ray's overhead"
     " per cell -> results/sweep_cpu.json"),
]

_GROUP_HELP = {
    "train": "train models (`lcx train lm --help`)",
    "eval": "evaluate models (`lcx eval ppl --help`)",
    "bench": "benchmarks: each writes JSON (config, environment, git SHA) under results/ (`lcx bench <name> --help`)",
}


# Experiments: top-level packages of a source checkout, beside lcx/ (docs/contributing.md,
# "Layout"): benchmarks/ (`lcx bench ...`) and studies/ (`lcx train modadd`, the PIE study). They
# use the library and are no part of it: the wheel ships neither, and nothing in lcx imports them
# (tests/test_layers.py). Their commands are listed here so that `lcx --help` shows them everywhere.
EXPERIMENTS = ("benchmarks", "studies")


class SourceOnlyCommand(RuntimeError):
    """An experiment's command (`lcx bench ...`) run where there is no source checkout (a wheel)."""


def checkout_root() -> Path | None:
    """The source checkout lcx was imported from (the folder holding lcx/, benchmarks/ and
    studies/), or None for an installed wheel."""
    root = Path(import_module("lcx").__file__).resolve().parent.parent
    return root if all((root / name / "__init__.py").is_file() for name in EXPERIMENTS) else None


def import_experiment(module: str):
    """Import `benchmarks.<name>` / `studies.<name>` from the checkout lcx itself comes from.

    The experiment packages are registered from that checkout by path (not looked up on
    sys.path, where an unrelated `benchmarks` distribution could shadow them), both at once, since
    a benchmark may run a study (`lcx bench pie` runs studies.code_edit).
    """
    missing = [name for name in EXPERIMENTS if name not in sys.modules]
    if missing:
        root = checkout_root()
        if root is None:
            raise SourceOnlyCommand(
                f"{module} is not installed: `lcx bench` and the studies are experiments that run from a "
                "source checkout of lcx (git clone ...; bash scripts/setup.sh, which installs it editable): "
                "they live in its top-level benchmarks/ and studies/, which the wheel leaves out; the wheel "
                "ships the library, the engine, the server, the lm-eval tasks and `lcx report`")
        for name in missing:
            init = root / name / "__init__.py"
            spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[name]
                raise
    return import_module(module)


def _lazy_command(parser: argparse.ArgumentParser, module: str) -> None:
    """Attach a module's arguments. Imported here, i.e. only when this command is chosen."""
    mod = import_experiment(module) if module.split(".")[0] in EXPERIMENTS else import_module(module)
    mod.add_arguments(parser)
    parser.set_defaults(_run=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lcx",
        description="lcx: apply long-context methods (RoPE scaling, LM-Infinite, ...) to RoPE "
        "language models, measure them, and serve them.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Examples:\n"
        "  lcx demo                         # extrapolation table on the bundled tiny model\n"
        "  lcx eval ppl --rope yarn --factor 16 --lengths 256,1024,4096\n"
        "  lcx train lm --out runs/tiny     # retrain the bundled model (~15 min on 2 CPU cores)\n",
    )
    parser.add_argument("--version", action="version", version=f"lcx {import_module('lcx').__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    # Only the module of the command actually named in argv is imported.
    wanted = [a for a in argv if not a.startswith("-")]
    for path, module, help_ in COMMANDS:
        if len(path) == 1:
            sp = subs.add_parser(path[0], help=help_, description=help_)
        else:
            if path[0] not in groups:
                gp = subs.add_parser(path[0], help=_GROUP_HELP.get(path[0], ""))
                groups[path[0]] = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
            sp = groups[path[0]].add_parser(path[1], help=help_, description=help_)
        if list(path) == wanted[: len(path)]:
            _lazy_command(sp, module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser(argv)
    except SourceOnlyCommand as e:
        print(f"lcx: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 0 if not argv else 2
    try:
        return int(run(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        # Config and input errors are the user's to fix: one clear line, no traceback.
        print(f"lcx: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
