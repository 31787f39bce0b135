"""`lcx vllm-args`: the arguments that make vLLM itself run lcx methods, for tools that start vLLM.

lm-evaluation-harness's `--model vllm` builds `vllm.LLM(**model_args)` in-process, and accepts
`--model_args` as one JSON object; `hf_overrides` there carries the plugin's architecture and the
methods (`lcx.serve.vllm_plugin.hf_overrides`). This command prints that JSON:

    ARGS=$(lcx vllm-args --model tiny-5m --attention lm_infinite --n-global 8 --n-local 128 \\
           --max-model-len 1024)
    lm_eval --model vllm --model_args "$ARGS" --tasks lcx_ppl \\
            --metadata '{"max_seq_lengths": [512, 1024]}'        # in the vLLM environment

`--format serve` prints the `vllm serve` flags instead (what `lcx serve --engine vllm` runs).
The methods are validated here, with vLLM's refusals, before anything starts; the vLLM process
needs lcx installed (the plugin registers through the `vllm.general_plugins` entry point).
"""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

DESCRIPTION = ("print vLLM arguments that run lcx methods: lm-eval `--model vllm --model_args` JSON "
               "(hf_overrides), or `vllm serve` flags")


def vllm_arguments(model: str, methods: Any, *, max_model_len: int | None = None,
                   dtype: str = "float32", memory: int | None = None) -> tuple[str, dict[str, Any], Any]:
    """(model directory, vLLM keyword arguments, the checked `lcx.MethodConfig`) that run `methods`
    (an `lcx.MethodConfig` or its dict) on `model` (a preset name, a Hugging Face directory or a
    GGUF file: its dequantized float32 directory in lcx's cache, `lcx.models.hf_directory`).
    The keyword arguments are `hf_overrides`, `dtype` and `max_model_len`.

    `max_model_len` defaults to what lcx's own engine serves for the same model, methods and
    dtype (`lcx.serve.lengths.default_length`, one rule for both engines): the RoPE factor's or
    Self-Extend's extended context, and for a bounded attention method (LM-Infinite, sinks,
    sliding window) what `memory` bytes allow (default: the host's available memory, where
    vLLM-on-CPU keeps its KV cache; `vllm_kv_cache_gb` sizes that cache)."""
    from transformers import AutoConfig

    from lcx.models import hf_directory

    from . import check_vllm_methods, hf_overrides

    # vLLM reads a Hugging Face directory: a GGUF (e.g. the gemma3-270m preset) as lcx's float32
    # cache entry of it, the weights lcx's own engine loads (built on first use).
    model_dir = hf_directory(model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    vm = check_vllm_methods(methods, hf_config)
    max_len = max_model_len or vllm_default_length(hf_config, vm, dtype, memory=memory)[0]
    kwargs: dict[str, Any] = {"hf_overrides": hf_overrides(hf_config, vm, max_model_len=max_len), "dtype": dtype,
                              "max_model_len": int(max_len)}
    return str(model_dir), kwargs, vm


def dtype_bytes(dtype: str, hf_config: Any) -> int:
    """Bytes per parameter of vLLM's `--dtype` (auto: the config's torch_dtype, else float32)."""
    import torch

    name = {"half": "float16", "float": "float32"}.get(dtype, dtype)
    if name == "auto":
        got = getattr(hf_config, "dtype", None) or "float32"  # transformers' name (torch_dtype before)
        name = str(got).removeprefix("torch.")
    t = getattr(torch, name, None)
    if not isinstance(t, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; vLLM takes auto, half, float16, bfloat16, float, float32")
    return torch.empty((), dtype=t).element_size()


def vllm_default_length(hf_config: Any, methods: Any, dtype: str, *, memory: int | None = None) -> tuple[int, str]:
    """(max_model_len, how it was derived) of vLLM serving `methods` (checked) on the model of
    `hf_config` without --max-model-len: `lcx.serve.lengths.default_length`, lcx's engine's rule,
    with vLLM's dtype on the host's memory (vLLM-on-CPU, `lcx.serve.vllm_plugin.launch.vllm_env`)."""
    from lcx.method_config import MethodConfig

    from ..lengths import default_length

    cfg = methods if isinstance(methods, MethodConfig) else MethodConfig.from_dict(methods)
    limit, how, _ = default_length(hf_config, cfg, dtype_bytes=dtype_bytes(dtype, hf_config), device="cpu",
                                   memory=memory)
    return limit, how


def vllm_kv_cache_gb(hf_config: Any, max_model_len: int, dtype: str, *, least: int = 1) -> int:
    """GiB of vLLM-on-CPU's KV cache (VLLM_CPU_KVCACHE_SPACE) that hold one sequence of
    `max_model_len` tokens, at least `least`: vLLM refuses to start with less, and keeps every
    block of the methods its own kernels lack (`lcx.serve.vllm_plugin.config`)."""
    import math

    from lcx.hf.models import model_shape

    need = model_shape(hf_config).kv_bytes_per_token(dtype_bytes(dtype, hf_config)) * int(max_model_len)
    return max(int(least), math.ceil(need * 1.1 / (1 << 30)))  # 10%: vLLM's block rounding


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lcx.method_config import add_method_arguments

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("--model", required=True, help="preset (lcx models), Hugging Face model directory, Hub id org/name[@revision] (its "
                             "cached snapshot) or GGUF file (vLLM reads its dequantized cache entry)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="vLLM's max_model_len (default: what lcx's engine serves for the same methods: the RoPE "
                             "factor's or Self-Extend's extended context, else the model's; for a bounded attention "
                             "method what memory allows, lcx.serve.lengths; vLLM-on-CPU then needs "
                             "VLLM_CPU_KVCACHE_SPACE large enough to hold it)")
    parser.add_argument("--dtype", default="float32", help="vLLM dtype (default float32)")
    parser.add_argument("--format", choices=("lm-eval", "serve"), default="lm-eval",
                        help="lm-eval: one JSON object for --model_args (default); serve: `vllm serve` flags")
    add_method_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from lcx.method_config import method_config_from_args

    import sys

    from transformers import AutoConfig

    model_dir, kwargs, _ = vllm_arguments(args.model, method_config_from_args(args), max_model_len=args.max_model_len,
                                       dtype=args.dtype)
    n = kwargs["max_model_len"]
    gb = vllm_kv_cache_gb(AutoConfig.from_pretrained(model_dir), n, args.dtype)
    print(f"lcx vllm-args: max_model_len {n} ({'--max-model-len' if args.max_model_len else 'lcx engine default'}); "
          f"vLLM-on-CPU needs VLLM_CPU_KVCACHE_SPACE >= {gb} (GiB) to hold one sequence of it "
          "(--max-model-len lowers it)", file=sys.stderr)
    if args.format == "lm-eval":
        print(json.dumps({"pretrained": model_dir, **kwargs}))
    else:
        flags = [model_dir, "--hf-overrides", json.dumps(kwargs["hf_overrides"]), "--dtype", kwargs["dtype"],
                 "--max-model-len", str(kwargs["max_model_len"])]
        print(shlex.join(flags))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lcx vllm-args", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
