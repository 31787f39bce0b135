"""Prompt logprobs from vLLM with lcx methods (run with the python that has vLLM, `vllm_python()`).

    python -m lcx.serve.vllm_plugin.score --model DIR --methods JSON \
        --prompts prompts.json --out logprobs.json [--max-model-len N]
    python -m lcx.serve.vllm_plugin.score --cases cases.json --prompts prompts.json --out out.json

prompts.json: a list of token-id lists. Writes `{"logprobs": [[lp(t_1|t_0), ...], ...],
"overrides": {...}}`: for each prompt, the logprob of every token after the first given the
tokens before it (vLLM's `prompt_logprobs`, float32 when --dtype float32). Used by
tests/serve/test_vllm.py to compare vLLM + plugin with lcx's engine, one vLLM start for many prompts;
`"generated"` holds each prompt's `--gen` greedy tokens (vLLM's decode path over its paged cache).

`--cases`: many (model, methods) pairs in one process (tests/serve/test_vllm_families.py): a JSON
object `{name: {"model": DIR, "methods": {...} or null (plain vLLM)}}`; vLLM's engine runs
in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor: no engine-core or
worker process to start per case, ~5-10 s a case instead of ~1-3 min), one `LLM` after another.
Writes `{"cases": {name: {"logprobs", "generated", "overrides"} or {"error": "Type: message"}}}`:
a case vLLM or the plugin refuses is recorded with its error, and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path


def _overrides(model: str, methods: dict | None, max_model_len: int | None) -> dict:
    from transformers import AutoConfig

    from .config import hf_overrides

    hf_config = AutoConfig.from_pretrained(model)
    if methods is None:
        # vLLM's own model class; only its length limit is raised (default RoPE: the rotary
        # cache just gets longer, the basis is unchanged).
        if max_model_len and max_model_len > hf_config.max_position_embeddings:
            return {"max_position_embeddings": max_model_len}
        return {}
    return hf_overrides(hf_config, methods, max_model_len=max_model_len)


def _run(model: str, overrides: dict, prompts: list[list[int]], args, **llm_kwargs) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=args.dtype, hf_overrides=overrides, max_model_len=args.max_model_len,
              enforce_eager=True, seed=0, **llm_kwargs)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        SamplingParams(max_tokens=args.gen, temperature=0.0, prompt_logprobs=0,
                                       ignore_eos=True), use_tqdm=False)
    result = []
    for ids, out in zip(prompts, outs):
        lps = out.prompt_logprobs  # [None, {tok: Logprob}, ...], one entry per prompt token
        result.append([lps[i][ids[i]].logprob for i in range(1, len(ids))])
    generated = [list(out.outputs[0].token_ids) for out in outs]
    # Shut the engine down while the interpreter is whole: left to interpreter teardown, vLLM's
    # CPU engine sometimes aborts at exit ("terminate called without an active exception").
    del llm, outs
    gc.collect()
    return {"logprobs": result, "generated": generated, "overrides": overrides}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--methods", default="{}", help="an lcx.MethodConfig as JSON, as `lcx serve --methods` (see lcx.serve.vllm_plugin.config)")
    p.add_argument("--cases", default=None, help="JSON file: {name: {model, methods}}, all run in this process")
    p.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    p.add_argument("--out", required=True)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--gen", type=int, default=1, help="greedy tokens to generate per prompt (decode path)")
    p.add_argument("--no-plugin", action="store_true", help="plain vLLM (no lcx model class), for baselines")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vLLM's tensor parallelism (CPU backend: one worker process per rank)")
    args = p.parse_args(argv)
    if (args.cases is None) == (args.model is None):
        p.error("give --model (one configuration) or --cases (many)")
    prompts = json.loads(Path(args.prompts).read_text())

    if args.cases is None:
        methods = None if args.no_plugin else json.loads(args.methods)
        out = _run(args.model, _overrides(args.model, methods, args.max_model_len), prompts, args,
                   tensor_parallel_size=args.tensor_parallel_size)
        Path(args.out).write_text(json.dumps(out))
        return 0

    if args.tensor_parallel_size != 1:
        p.error("--cases runs vLLM in this process: tensor parallelism 1 only")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when each LLM starts its engine
    # The lcx classes registered as classes (vLLM's documented `register_model` takes a class
    # too), not as "module:Class" strings: vLLM inspects a lazily registered class in a fresh
    # subprocess (~20 s per architecture on 2 busy cores, to keep CUDA out of the parent), which
    # this process, running the models itself on the CPU, has no use for. `register()` then
    # finds them registered and leaves them alone.
    from vllm import ModelRegistry

    from . import model as lcx_model
    from .config import ARCHITECTURES

    for arch in ARCHITECTURES.values():
        ModelRegistry.register_model(arch, getattr(lcx_model, arch))
    results = {}
    for name, case in json.loads(Path(args.cases).read_text()).items():
        try:
            overrides = _overrides(case["model"], case.get("methods"), args.max_model_len)
            results[name] = _run(case["model"], overrides, prompts, args, distributed_executor_backend="uni")
        except Exception as e:  # recorded per case: a refusal is a result the caller checks
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            gc.collect()
        Path(args.out).write_text(json.dumps({"cases": results}))  # what ran so far, if a later case dies
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
