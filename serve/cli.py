"""`lcx serve`: an OpenAI-compatible server over lcx's engine, with lcx methods applied.

    lcx serve --model tiny-5m --port 8000
    lcx serve --model smollm2-135m --rope yarn --factor 4 --max-model-len 32768 --api-key s3cret
    lcx serve --model runs/tiny/final --methods '{"rope": {"rope_type": "ntk", "factor": 8}}'

Then any OpenAI client (base_url http://HOST:PORT/v1), or lm-eval:

    lm_eval --model local-completions --tasks passkey_ll \\
        --model_args model=tiny-5m,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=<model dir>,tokenizer_backend=huggingface
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from lcx.rope.cli import add_spec_arguments, spec_dict_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model: a Hugging Face directory, a .gguf file or a preset (tiny-5m, smollm2-135m)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as `model` (default: --model as given)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("LCX_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                             "(default: $LCX_API_KEY, else no key)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="limit on prompt + max_tokens; longer requests are rejected, never truncated "
                             "(default: the model's context, times the RoPE factor if one is given)")
    parser.add_argument("--max-batch", type=int, default=16,
                        help="most requests decoded together; more wait in FIFO order (default: %(default)s)")
    parser.add_argument("--batch-window-ms", type=float, default=10.0,
                        help="when idle, wait this long after a request arrives to batch others with it "
                             "(default: %(default)s)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="device (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--methods", default=None, metavar="JSON",
                        help="engine methods as JSON {name: params}, e.g. '{\"rope\": {\"rope_type\": \"yarn\", "
                             "\"factor\": 4}}'; --rope flags add a `rope` entry")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_spec_arguments(parser, default_type=None)


def methods_from_args(args: argparse.Namespace) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    if args.methods:
        try:
            methods = json.loads(args.methods)
        except json.JSONDecodeError as e:
            raise ValueError(f"--methods is not valid JSON: {e}") from None
        if not isinstance(methods, dict):
            raise ValueError(f"--methods must be a JSON object {{name: params}}, got {args.methods!r}")
    rope = spec_dict_from_args(args)
    if rope is not None:
        if "rope" in methods:
            raise ValueError("a RoPE spec was given both with --rope flags and in --methods; give one")
        methods["rope"] = rope
    return methods


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from lcx.engine import Engine, EngineConfig

    from .app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    # Validate everything that is cheap before loading the model.
    config = EngineConfig(max_model_len=args.max_model_len, max_batch=args.max_batch,
                          methods=methods_from_args(args))
    if args.batch_window_ms < 0:
        raise ValueError(f"--batch-window-ms must be >= 0, got {args.batch_window_ms}")
    engine = Engine.from_pretrained(args.model, config, dtype=args.dtype, device=args.device)
    name = args.served_model_name or args.model
    app = create_app(engine, model_name=name, api_key=args.api_key, batch_window_s=args.batch_window_ms / 1000)
    print(f"lcx serve: {name} on http://{args.host}:{args.port}/v1 (max_model_len {engine.max_model_len}, "
          f"max_batch {config.max_batch}, methods {dict(config.to_dict()['methods'])})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log)
    return 0
