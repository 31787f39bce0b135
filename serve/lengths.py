"""The server's `max_model_len` when `--max-model-len` is not given: what the method allows.

    vanilla (no method, or an unbounded one)   the model's context L0 (max_position_embeddings)
    RoPE scaling with a factor s                L x s, L the spec's (`MethodConfig.lengths`: the
                                                lengths `MethodConfig.apply` records; Phi-3: L is
                                                its original_max_position_embeddings)
    an attention method that lengthens the      what it reaches from the context above (Self-Extend:
    context (`AttentionMethod.context_len`)     G * (L - W + floor(W / G)); `MethodConfig.context_len`)
    an attention method whose queries see a     what memory allows: one prompt of that many tokens
    bounded set of keys (`cache_window`: LM-    fits in MEMORY_FRACTION of the memory available at
    Infinite without top-k, StreamingLLM sinks, start-up (`prompt_token_bytes` per token), at most
    sliding window, SWAT)                       MAX_BOUNDED_LEN tokens; never below the two above

A bounded method is read from the method itself (`MethodConfig.kv_window`, i.e. its
`cache_window` and `check_bounded`), never from a list of names: a new bounded method serves long
prompts by default. Its decode cache never grows past the window, but a prompt's prefill still
computes every position's keys, values, activations and (for echo scoring) logits, hence the
memory bound. The rule is stated in `lcx serve --help` and the limit, with how it was derived,
in `/v1/models` (`max_model_len`, `lcx_max_model_len_source`).

One rule for both engines: `default_length` reads only the model's config, so `lcx serve
--engine vllm` and `lcx vllm-args` (`lcx.serve.vllm_plugin.args.vllm_arguments`) derive the same
max_model_len as lcx's engine (`build_engine`) for the same model, methods, dtype and memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lcx.engine import Engine, EngineConfig
from lcx.engine.memory import MEMORY_FRACTION, available_memory
from lcx.method_config import MethodConfig

MAX_BOUNDED_LEN = 1 << 20  # tokens; a cap on the memory-derived limit (1,048,576)
LOGIT_BYTES = 8  # per vocabulary entry per prompt token: float32 logits + their log-softmax (echo scoring)

RULE = (f"default: the model's context, x the RoPE factor if one is given, or as far as an attention method that "
        f"lengthens it reaches (Self-Extend); for an attention method whose queries see a bounded set of keys "
        f"(LM-Infinite without top-k, sinks, sliding window, SWAT) what memory allows: one prompt's prefill in "
        f"{MEMORY_FRACTION:.0%} of the memory available at start-up, at most {MAX_BOUNDED_LEN} tokens; the same "
        f"with --engine vllm; /v1/models states the limit and how it was derived")


def prompt_token_bytes(model_config: Any, dtype_bytes: int) -> int:
    """Bytes one prompt token costs during prefill, upper estimate: its keys and values in every
    layer, the layer's activations (4 x hidden + 3 x intermediate, the MLP's three projections),
    and its logits with their log-softmax (float32)."""
    from lcx.hf.models import model_shape

    s = model_shape(model_config)
    inter = s.intermediate_size or 4 * s.hidden_size
    return s.kv_bytes_per_token(dtype_bytes) + dtype_bytes * (4 * s.hidden_size + 3 * inter) + LOGIT_BYTES * s.vocab_size


def effective_methods(model: Any, methods: MethodConfig) -> MethodConfig:
    """`methods`, or the attention method the model's config records (a model trained with one,
    as `lcx.engine.Engine` runs it) when `methods` has none. `model`: a model or its config."""
    from lcx.hf.recorded import recorded_method

    own = recorded_method(model) if methods.attention is None else None
    return methods if own is None else dataclasses.replace(methods, attention=own.attention)


def default_length(model_config: Any, methods: MethodConfig, *, dtype_bytes: int, device: Any = "cpu",
                   memory: int | None = None) -> tuple[int, str, bool]:
    """(max_model_len, how it was derived, bounded) for a server of the model of `model_config`
    (an HF config) running `methods` without `--max-model-len`, parameters of `dtype_bytes`
    bytes on `device`: the rule of the module docstring, for lcx's engine and vLLM alike.
    `bounded`: the memory rule decided (an attention method with a bounded cache). `memory`:
    bytes available (default: `available_memory(device)`, read only for a bounded method)."""
    cfg = model_config
    lengths = methods.lengths(cfg)  # the lengths `MethodConfig.apply`'s record carries (`lcx.hf.applied`)
    L0, base = lengths.model, lengths.context
    if lengths.extended is not None:
        how = f"{methods.describe()} extends the model's context (max_position_embeddings {L0}) to {base}"
    else:
        how = f"the model's context (max_position_embeddings {L0})"
    eff = effective_methods(cfg, methods)
    if eff.kv_window is None:
        return base, how + "; --max-model-len overrides it", False
    per_token = prompt_token_bytes(cfg, dtype_bytes)
    avail = available_memory(device) if memory is None else memory
    fits = int(MEMORY_FRACTION * avail) // per_token
    limit = max(base, min(MAX_BOUNDED_LEN, fits))
    return limit, (f"the attention method {eff.attention.name} sees a bounded set of keys "
                   f"(cache window {list(eff.kv_window)}): {MEMORY_FRACTION:.0%} of {avail / 2**30:.1f} GiB available "
                   f"/ {per_token} bytes per prompt token = {fits} tokens, at most {MAX_BOUNDED_LEN}, at least "
                   f"{base} ({how}); --max-model-len overrides it"), True


def default_max_model_len(model: Any, methods: MethodConfig, *, memory: int | None = None) -> tuple[int | None, str]:
    """(max_model_len, how it was derived) for a server of `model` running `methods` without
    `--max-model-len` (`default_length` for the loaded model's dtype and device); None: the
    engine's own default (the model's context, x the RoPE factor or as an attention method
    extends it: `MethodConfig.context_len`), which the description then names."""
    p = next(model.parameters())
    limit, how, bounded = default_length(model.config, methods, dtype_bytes=p.element_size(), device=p.device,
                                         memory=memory)
    return (limit if bounded else None), how


def build_engine(model_name: str, config: EngineConfig, *, dtype: str = "float32",
                 device: str = "cpu") -> tuple[Engine, str]:
    """Load the model and build the server's engine: `config.max_model_len`, or when it is None the
    default `default_max_model_len` derives. Returns (engine, how max_model_len was derived)."""
    from lcx.models import load_model

    model, tok = load_model(model_name, dtype=dtype, device=device)
    if config.max_model_len is not None:
        return Engine(model, tok, config), f"--max-model-len {config.max_model_len}"
    limit, how = default_max_model_len(model, config.methods)
    if limit is not None:
        config = dataclasses.replace(config, max_model_len=limit)
    return Engine(model, tok, config), how
