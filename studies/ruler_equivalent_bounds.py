"""How long are a RULER sweep's prompts with their answers? The bound `lcx report` compares with a
method's `MethodConfig.identity_up_to` before it takes vanilla's answers for a cell
(`lcx.report.ruler.longest_sequence`: RULER's own length of each sample, i.e. its input's tokens
plus the generation budget, + the answer prefix lm-eval appends + `SEQUENCE_MARGIN`). Builds the
prompts as the cells build them (seeded, the model's tokenizer); runs no model.

    python studies/ruler_equivalent_bounds.py --model smollm2-135m --lengths 4096 8192 \\
        --tasks niah_single_1 niah_single_2_pd niah_single_3_pd niah_multikey_1_pd --samples 16 \\
        --out results/ruler_equivalent_bounds_smollm2-135m.json
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an lcx model (preset name, HF directory or .gguf)")
    p.add_argument("--lengths", type=int, nargs="+", required=True, help="RULER lengths (max_seq_length)")
    p.add_argument("--tasks", nargs="+", required=True, help="lcx ruler_offline task names")
    p.add_argument("--samples", type=int, default=16, help="prompts per task: the first N, as a cell's (default 16)")
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    if args.samples < 1 or any(L < 1 for L in args.lengths):
        p.error("--samples and --lengths must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lcx.data.io import atomic_write_json, environment
    from lcx.report.ruler import SEQUENCE_MARGIN, longest_sequence

    rec = {"model": args.model, "tasks": args.tasks, "samples_per_task": args.samples, "margin": SEQUENCE_MARGIN,
           "command": " ".join(["python", "studies/ruler_equivalent_bounds.py", *sys.argv[1:]]) if argv is None else None,
           "longest_sequence": {str(L): longest_sequence(args.model, L, args.tasks, args.samples) for L in args.lengths},
           "environment": environment()}
    atomic_write_json(args.out, rec)
    print(f"ruler_equivalent_bounds: {rec['longest_sequence']} -> {args.out}")
    return rec


if __name__ == "__main__":
    main()
