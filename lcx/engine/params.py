"""Request and engine parameters: `SamplingParams` (vLLM's sampling options, range-checked like
vLLM), `EngineConfig`, the finish reasons and limits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..method_config import MethodConfig


FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_LOGPROBS = 20  # top-k alternatives per token, as vLLM's default cap
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # the range of `seed` (torch generators take 64 bits)


class ContextLengthError(ValueError):
    """A request that does not fit `max_model_len`; `param` is "prompt" or "max_tokens"."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# ============================================================================================
# Config
# ============================================================================================

@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Validated on construction (`ValueError` names the field).

    max_tokens: tokens to generate (0: none; with `prompt_logprobs` that scores the prompt only).
    temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
    top_p: nucleus sampling mass in (0, 1]; 1 = off.
    seed: seeds the request's own generator (None: a fresh random seed).
    stop: strings that end generation; the returned text stops before the first one.
    stop_token_ids: token ids that end generation (the EOS token does too unless `ignore_eos`).
    logprobs: None = no logprobs; k >= 0 = the chosen token's logprob plus the top-k alternatives.
    prompt_logprobs: the same for every prompt token (the first has none), for `echo`.
    top_k: keep the k most likely tokens; 0 or -1 = off (vLLM's two spellings).
    min_p: keep tokens with probability >= min_p x the most likely token's, in [0, 1]; 0 = off.
    repetition_penalty: > 0; 1 = off. Applies to tokens of the prompt and of the output.
    presence_penalty / frequency_penalty: in [-2, 2]; 0 = off. Apply to tokens of the output.
    min_tokens: generate at least this many tokens (<= max_tokens) before a stop token or a stop
        string may end the request.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not _is_num(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1] (a 64-bit signed integer), "
                             f"got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)!r}")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 or -1 for all tokens, got {self.top_k!r}")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_num(self.repetition_penalty) or not math.isfinite(self.repetition_penalty) \
                or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, min_tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0)


DEFAULT_PREFIX_CACHE_BYTES = 1 << 30  # the prefix cache's bound unless raised (None: auto)


def megabytes_or_auto(name: str, value: float | str | None) -> float | None:
    """A size setting in MiB (a number >= 0, finite), or None for `auto`/unset (the prefix cache's
    bound as `lcx serve --prefix-cache-mb` and the `lcx` lm-eval model take it); ValueError naming
    `name` otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        mb = float(value)
    except (TypeError, ValueError):
        mb = -1.0
    if not 0 <= mb < float("inf") or isinstance(value, bool):
        raise ValueError(f"{name} must be a number of MiB >= 0 or auto, got {value!r}")
    return mb


@dataclass(frozen=True)
class EngineConfig:
    """Start-up configuration of an `Engine`.

    max_model_len: limit on prompt + max_tokens of every request (None: the model's
        `max_position_embeddings`, or the context the methods imply: `MethodConfig.context_len`,
        L x the RoPE factor). May be set above the model's trained context on purpose
        (extrapolation).
    max_batch: most requests decoded together; more wait (FIFO).
    methods: the `lcx.MethodConfig` the engine applies at start-up (`MethodConfig.apply`: RoPE,
        then attention). A nested dict is parsed into one here (the JSON edge, e.g. `from_dict`);
        without an attention method the engine runs the one the model's config records, if any.
    prefix_caching: keep the KV of prompt blocks and reuse the longest cached prefix of a new
        request (`lcx.engine.prefix`: exact; bypassed where a prefix's keys depend on what
        follows, `Engine.prefix_cache_refusal` says why).
    prefix_cache_bytes: the prefix cache's memory bound (LRU eviction). None (auto): 1 GiB, raised
        to hold one prompt of `max_model_len` whole (`Engine.fit_prefix_cache`; as vLLM's KV pool
        always holds one sequence of its max_model_len), so that the longest prompt the engine
        accepts is reused whole rather than only its head, but raised to at most a quarter of the
        memory available at start-up (`lcx.engine.memory`).
    prefix_block_size: tokens per cached block (a prefix is reused in whole blocks).
    max_num_batched_tokens: token budget of one `step` (decode rows + prompt tokens prefilled);
        a prompt longer than what is left is prefilled in chunks over several steps (chunked
        prefill, `lcx.engine.prefix`), so running requests keep decoding beside a long prompt.
        None: no budget (every admitted prompt is prefilled whole in the step that admits it).
    packed_linear: run the engine's own forwards on oneDNN-packed copies of the model's CPU
        float32 linear weights (`lcx.engine.packed`: what vLLM's CPU backend does; faster prefill
        and batched decode, one more copy of those weights). None (auto): when they total at most
        `lcx.engine.packed.AUTO_MAX_BYTES`; False: never.
    lean_decode: run decode steps through the same modules without transformers' per-call
        machinery where the family allows (`lcx.hf.lean_decode`: Llama, Mistral, Qwen2, Qwen3
        decoders; identical logits); False: always through the model's own forward.
    mixed_step: where the lean forward runs (and the fast path's cache), a step that has both
        decode rows and prefill chunks runs them as one forward, one token matrix through the
        weights (`lcx.hf.lean_decode.MixedPrefill`; as vLLM's step); the step's prefill work is
        then scheduled before its decode, so a slot a request frees in this step is taken in the
        next. False: two forwards, decode first (the slot freed is taken in the same step).
    """

    max_model_len: int | None = None
    max_batch: int = 16
    methods: MethodConfig = field(default_factory=MethodConfig)
    prefix_caching: bool = True
    prefix_cache_bytes: int | None = DEFAULT_PREFIX_CACHE_BYTES
    prefix_block_size: int = 16
    max_num_batched_tokens: int | None = None
    packed_linear: bool | None = None
    lean_decode: bool = True
    mixed_step: bool = True

    def __post_init__(self) -> None:
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if not is_int(self.max_batch) or self.max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {self.max_batch!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be a bool, got {self.prefix_caching!r}")
        if self.prefix_cache_bytes is not None and (not is_int(self.prefix_cache_bytes)
                                                    or self.prefix_cache_bytes < 0):
            raise ValueError(f"prefix_cache_bytes must be an integer >= 0 or None (auto), "
                             f"got {self.prefix_cache_bytes!r}")
        if not is_int(self.prefix_block_size) or self.prefix_block_size < 1:
            raise ValueError(f"prefix_block_size must be a positive integer, got {self.prefix_block_size!r}")
        if self.max_num_batched_tokens is not None and (not is_int(self.max_num_batched_tokens)
                                                        or self.max_num_batched_tokens < 1):
            raise ValueError(f"max_num_batched_tokens must be a positive integer or None, "
                             f"got {self.max_num_batched_tokens!r}")
        if self.packed_linear is not None and not isinstance(self.packed_linear, bool):
            raise ValueError(f"packed_linear must be true, false or None (auto), got {self.packed_linear!r}")
        if not isinstance(self.lean_decode, bool):
            raise ValueError(f"lean_decode must be true or false, got {self.lean_decode!r}")
        if not isinstance(self.mixed_step, bool):
            raise ValueError(f"mixed_step must be true or false, got {self.mixed_step!r}")
        object.__setattr__(self, "methods", MethodConfig.from_dict(self.methods))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EngineConfig":
        from ..configs import strict_from_dict

        return strict_from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return {"max_model_len": self.max_model_len, "max_batch": self.max_batch, "methods": self.methods.to_dict(),
                "prefix_caching": self.prefix_caching, "prefix_cache_bytes": self.prefix_cache_bytes,
                "prefix_block_size": self.prefix_block_size, "max_num_batched_tokens": self.max_num_batched_tokens,
                "packed_linear": self.packed_linear, "lean_decode": self.lean_decode,
                "mixed_step": self.mixed_step}


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
