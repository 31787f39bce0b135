"""The `lcx` command line.

Each subcommand lives in its own module that exposes `add_arguments(parser)` and
`run(args) -> int`; this file only wires them together, so `lcx --help` lists everything
without importing torch or transformers.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

# (command path, module, one-line help). The module is imported only when the command runs
# or its --help is asked for.
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("report",), "lcx.report",
     "the main job: passkey, perplexity and decoding vs context length for every method -> results/report/"),
    (("demo",), "lcx.demo",
     "RoPE extrapolation table: perplexity of the bundled model at 256..4k tokens per RoPE type"),
    (("train", "lm"), "lcx.train.lm.cli",
     "train a small Llama-style LM on public-domain text (Shakespeare + KJV Bible)"),
    (("train", "stream"), "lcx.train.stream",
     "train + evaluate the streaming word-transduction task: group vs interleaved positions"),
    (("train", "modadd"), "lcx.studies.modadd.cli",
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
    (("bench", "threads"), "lcx.bench.threads",
     "which torch thread count is fastest here, idle and with one core busy -> results/threads_cpu.json"),
    (("bench", "prefill"), "lcx.bench.prefill",
     "one long prefill per method vs the unpatched model (CPU time, memory) -> results/prefill_cpu.json"),
    (("bench", "pie"), "lcx.bench.pie",
     "PIE code editing on stdlib code: recompute vs PIE vs stale cache, accuracy with CIs and cost"
     " -> results/pie_code_edit.json"),
    (("bench", "kernels"), "lcx.bench.kernels",
     "time the GPU kernels (triton do_bench, roofline), write results/kernels/<gpu>.json; --check for regressions"),
    (("bench", "attention"), "lcx.bench.attention",
     "Λ-mask / LM-Infinite attention per backend vs dense causal SDPA on CPU (time, peak memory)"
     " -> results/attention_cpu.{json,png}"),
    (("bench", "decode"), "lcx.bench.decode",
     "decode tok/s per method through lcx's engine vs vanilla, 4k-32k, SmolLM2-135M's shape, with the"
     " memory-traffic ideal -> results/decode_cpu.{json,png}"),
    (("bench", "extrapolation"), "lcx.bench.extrapolation",
     "perplexity and likelihood passkey to 8k per attention / RoPE method on tiny-5m"
     " -> results/extrapolation_tiny.{json,png}"),
    (("bench", "swat"), "lcx.bench.swat",
     "held-out perplexity to 8k: the SWAT model vs the softmax model under every RoPE method"
     " -> results/swat_vs_softmax.{json,png}"),
    (("bench", "lmeval"), "lcx.bench.lmeval",
     "passkey (depth x length) and perplexity per RoPE method through the lm_eval CLI -> results/lmeval/"),
    (("bench", "scale"), "lcx.bench.scale",
     "every method at GPU scale on random weights (llama-3-8b, 32k-128k): prefill, decode tok/s, KV, memory vs"
     " vanilla -> results/scale/<device>.json"),
    (("bench", "prefix"), "lcx.bench.prefix",
     "lcx's engine with vs without its prefix cache: shared-system-prompt and passkey-sweep loads (throughput,"
     " time to first token) -> results/prefix_cpu.json"),
    (("bench", "serving"), "lcx.bench.serving",
     "throughput and latency of lcx serve (batched vs one at a time) and vLLM if installed"
     " -> results/serving_cpu.json"),
]

_GROUP_HELP = {
    "train": "train models (`lcx train lm --help`)",
    "eval": "evaluate models (`lcx eval ppl --help`)",
    "bench": "benchmarks: each writes JSON (config, environment, git SHA) under results/ (`lcx bench <name> --help`)",
}


# Packages that are not in the wheel (pyproject.toml): experiments on the library, run from a
# source checkout.
SOURCE_ONLY = ("lcx.bench", "lcx.studies")


class SourceOnlyCommand(RuntimeError):
    """A command whose code ships only in a source checkout, run from an installed wheel."""


def _lazy_command(parser: argparse.ArgumentParser, module: str) -> None:
    """Attach a module's arguments. Imported here, i.e. only when this command is chosen."""
    try:
        mod = import_module(module)
    except ModuleNotFoundError as e:
        if module.startswith(SOURCE_ONLY) and e.name is not None and e.name.startswith(SOURCE_ONLY):
            raise SourceOnlyCommand(
                f"{module} is not installed: `lcx bench` and the studies run from a source checkout of lcx "
                "(git clone ...; bash scripts/setup.sh, which installs it editable); the wheel ships the "
                "library, the engine, the server, the lm-eval tasks and `lcx report`") from None
        raise
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
