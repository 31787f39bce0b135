"""Prompt logprobs from vLLM with lcx methods (run with the python that has vLLM, `vllm_python()`).

    python -m lcx.serve.vllm_plugin.score --model DIR --methods JSON \
        --prompts prompts.json --out logprobs.json [--max-model-len N]

prompts.json: a list of token-id lists. Writes `{"logprobs": [[lp(t_1|t_0), ...], ...],
"overrides": {...}}`: for each prompt, the logprob of every token after the first given the
tokens before it (vLLM's `prompt_logprobs`, float32 when --dtype float32). Used by
tests/serve/test_vllm.py to compare vLLM + plugin with lcx's engine, one vLLM start for many prompts;
`"generated"` holds each prompt's `--gen` greedy tokens (vLLM's decode path over its paged cache).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--methods", default="{}", help="an lcx.MethodConfig as JSON, as `lcx serve --methods` (see lcx.serve.vllm_plugin.config)")
    p.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    p.add_argument("--out", required=True)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--gen", type=int, default=1, help="greedy tokens to generate per prompt (decode path)")
    p.add_argument("--no-plugin", action="store_true", help="plain vLLM (no lcx model class), for baselines")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vLLM's tensor parallelism (CPU backend: one worker process per rank)")
    args = p.parse_args(argv)

    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    from .config import hf_overrides

    prompts = json.loads(Path(args.prompts).read_text())
    hf_config = AutoConfig.from_pretrained(args.model)
    if args.no_plugin:
        # vLLM's own model class; only its length limit is raised (default RoPE: the rotary
        # cache just gets longer, the basis is unchanged).
        overrides = {}
        if args.max_model_len and args.max_model_len > hf_config.max_position_embeddings:
            overrides["max_position_embeddings"] = args.max_model_len
    else:
        overrides = hf_overrides(hf_config, json.loads(args.methods), max_model_len=args.max_model_len)
    llm = LLM(model=args.model, dtype=args.dtype, hf_overrides=overrides, max_model_len=args.max_model_len,
              enforce_eager=True, seed=0, tensor_parallel_size=args.tensor_parallel_size)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        SamplingParams(max_tokens=args.gen, temperature=0.0, prompt_logprobs=0,
                                                ignore_eos=True), use_tqdm=False)
    result = []
    for ids, out in zip(prompts, outs):
        lps = out.prompt_logprobs  # [None, {tok: Logprob}, ...], one entry per prompt token
        result.append([lps[i][ids[i]].logprob for i in range(1, len(ids))])
    generated = [list(out.outputs[0].token_ids) for out in outs]
    Path(args.out).write_text(json.dumps({"logprobs": result, "generated": generated, "overrides": overrides}))
    # Shut the engine down while the interpreter is whole: left to interpreter teardown, vLLM's
    # CPU engine sometimes aborts at exit ("terminate called without an active exception").
    del llm, outs
    gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
