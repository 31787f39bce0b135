"""A small native inference engine: batched prefill + decode with a KV cache over an HF Llama-family
model, with lcx methods (RoPE specs; LM-Infinite, sliding window, StreamingLLM sinks) chosen at
start-up.

    engine = Engine.from_pretrained("tiny-5m", EngineConfig(methods={"rope": {"rope_type": "yarn", "factor": 4}}))
    outs = engine.generate([engine.encode("ROMEO:"), engine.encode("JULIET:")],
                           SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=1))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

`generate` runs a list of requests to completion in one batch. The server (`lcx.serve`) drives
the same engine one `step()` at a time (continuous batching): `add_request` queues a request,
every `step` admits waiting requests (one batched prefill), runs one decode step for the requests
already running, and returns what each request produced (`StepEvent`s).

Batch layout (stated once). The running batch shares one KV cache per layer, HF layout
`[B, H_kv, T, D]`, with the rows *left-padded* to a common length T:

    column:   0    1    2    3    4    5        mask        pos
    row 0:   a0   a1   a2   a3   a4   a5       1 1 1 1 1 1  0 1 2 3 4 5
    row 1:    .    .    .   b0   b1   b2       0 0 0 1 1 1  . . . 0 1 2

- `mask [B, T]` (bool) says which cached slots a row's next query may attend to (padding and, for
  bounded-cache methods, evicted slots are False). It goes to HF as the 2D `attention_mask`, so
  every attention implementation (eager, sdpa) masks them; HF adds causality itself.
- A *position* is a token's index in its own request (prompt token 0 is at position 0), passed as
  `position_ids`; it is what RoPE rotates with. Keys are cached after RoPE (HF), so a slot's
  position never changes. `pos [B, T]` records it (-1 for padding).
- New requests are prefilled together (left-padded among themselves), then merged into the
  running batch by left-padding the shorter of the two caches; finished rows are removed, and
  columns no row can see any more are dropped. Padding is exact: masked slots get zero weight, so
  a request's tokens and logprobs do not depend on what it is batched with (up to float rounding
  of differently shaped matmuls; in float64 batched == unbatched token for token).

Sampling, in vLLM's order. The logits are first adjusted (only for a request that asks):
`repetition_penalty` (tokens of the prompt or the output: a positive logit divided by it, a
negative one multiplied), `frequency_penalty` / `presence_penalty` (minus the penalty times the
token's count in the output / once if it occurs), and while fewer than `min_tokens` tokens are out,
the stop tokens (EOS unless `ignore_eos`, `stop_token_ids`) are masked and stop strings not checked.
Then `temperature == 0` is greedy (argmax). Otherwise softmax(logits / T), restricted to the tokens
with probability >= `min_p` x the top token's, then to the `top_k` most likely, then to the
smallest set whose (renormalised) probability reaches `top_p`, sampled with the request's own
`torch.Generator` (seeded by `seed`), so a seeded request gives the same tokens in any batch. With
none of these options set, sampling is exactly softmax(logits / T) + top-p as before they existed.
Logprobs (generated and prompt) are of the model's raw distribution, log_softmax(logits), before
penalties, temperature and truncation, as in vLLM.

Length-dependent RoPE types (dynamic NTK, longrope) pick their basis per forward from the
largest position in it (`lcx.patching`, as transformers): in a batch that is the longest row's, so
for them a request's output depends on what it is batched with (as with HF batched `generate`);
run with `max_batch=1` for per-request semantics. Static types have no such effect.

Limits: `max_model_len` bounds prompt + max_tokens; a request over it is rejected with
`ValueError` (never truncated). Methods come from `EngineConfig.methods` and `ENGINE_METHODS`;
unknown names raise. Attention methods (`"attention": {"type": "lm_infinite", "n_global": 16,
"n_local": 1024}`, `sliding_window`, `sinks`; `lcx.methods`) patch the model's attention and
evict, after every step, the cached slots no later query of the row can see
(`EngineMethod.kv_policy`), so each row's cache holds at most n_first + n_recent - 1 keys — the
`BoundedKVCache` rule, per row of the padded batch. Their attention runs per row on the row's
own keys (`lcx_key_positions`, `lcx.methods.attention_patch`); tokens equal unbatched decoding
with a `BoundedKVCache` (tests/test_engine_attention.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)

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
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not _is_num(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1] (a 64-bit signed integer), "
                             f"got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
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
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, min_tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0)


@dataclass(frozen=True)
class EngineConfig:
    """Start-up configuration of an `Engine`.

    max_model_len: limit on prompt + max_tokens of every request (None: the model's
        `max_position_embeddings`, times the RoPE `factor` when a `rope` method with a factor is
        applied). May be set above the model's trained context on purpose (extrapolation).
    max_batch: most requests decoded together; more wait (FIFO).
    methods: an `lcx.MethodConfig` or its nested dict (`{"rope": {"rope_type": "yarn", "factor":
        4}, "attention": {...}, "backend": ...}`), plus any other method registered in
        `ENGINE_METHODS` as `{name: params}`; applied at start-up (rope, attention, then the others).
    """

    max_model_len: int | None = None
    max_batch: int = 16
    methods: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if not _is_int(self.max_batch) or self.max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {self.max_batch!r}")
        methods = _engine_methods(self.methods)
        for name, params in methods.items():
            check_method(name)
            if not isinstance(params, Mapping):
                raise ValueError(f"methods[{name!r}] must be a mapping of parameters, got {params!r}")
        object.__setattr__(self, "methods", MappingProxyType(
            {k: MappingProxyType(dict(v)) for k, v in methods.items()}))

    @property
    def method_config(self) -> Any:
        """The `lcx.MethodConfig` part of `methods` (RoPE + attention + backends)."""
        return _method_config(self.methods)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown EngineConfig key(s) {unknown}; accepted: {sorted(names)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {"max_model_len": self.max_model_len, "max_batch": self.max_batch,
                "methods": {k: dict(v) for k, v in self.methods.items()}}


# ============================================================================================
# Methods (the extension point)
# ============================================================================================

def _method_config(methods: Mapping[str, Any]) -> Any:
    from .method_config import NESTED_KEYS, MethodConfig

    return MethodConfig.from_dict({k: v for k, v in methods.items() if k in NESTED_KEYS})


def _engine_methods(methods: Any) -> dict[str, Any]:
    """`EngineConfig.methods` as `{name: params}`: the MethodConfig part validated by
    `lcx.MethodConfig` (its backends folded into the `attention` entry), other registered methods
    after it."""
    from .method_config import NESTED_KEYS, MethodConfig

    if isinstance(methods, MethodConfig):
        methods = methods.to_dict()
    if not isinstance(methods, Mapping):
        raise ValueError(f"methods must be an lcx.MethodConfig or a mapping {{name: params}}, "
                         f"got {type(methods).__name__}")
    d = _method_config(methods).to_dict()
    out: dict[str, Any] = {}
    if "rope" in d:
        out["rope"] = d["rope"]
    if "attention" in d:
        out["attention"] = {**d["attention"], **{k: d[k] for k in ("backend", "decode_backend") if k in d}}
    out.update({k: v for k, v in methods.items() if k not in NESTED_KEYS})
    return out


KVPolicy = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class EngineMethod:
    """A long-context method the engine runs, chosen at start-up by `EngineConfig.methods`.

    apply(model, params) -> resolved: patches the loaded model in place (e.g. `lcx.patch`) and
        returns the resolved parameters (recorded in `Engine.resolved_methods`).
    context_len(model, resolved) -> int | None: the default `max_model_len` this method implies
        (e.g. L * factor for RoPE scaling); None leaves it to the model or other methods.
    kv_policy(resolved) -> policy | None: for bounded-cache methods (LM-Infinite's Λ-shaped
        cache, sliding window, StreamingLLM). `policy(mask [B, T] bool, pos [B, T] long) ->
        mask [B, T]` is called after every prefill/decode step on the running batch and returns
        which cached slots stay visible to the rows' next queries (it may only turn slots off; pos
        is -1 on padding). Slots no row sees any more are dropped from the cache. Positions of
        new tokens stay their index in the request (what a method wants to feed RoPE instead,
        e.g. LM-Infinite's distance cap, belongs in its attention patch, applied by `apply`).
    """

    name: str
    apply: Callable[[nn.Module, Mapping[str, Any]], Any]
    context_len: Callable[[nn.Module, Any], int | None] = lambda model, resolved: None
    kv_policy: Callable[[Any], KVPolicy | None] = lambda resolved: None
    description: str = ""


def _apply_rope(model: nn.Module, params: Mapping[str, Any]):
    from .patching import current_spec, patch

    patch(model, dict(params))
    return current_spec(model)


def _rope_context_len(model: nn.Module, spec: Any) -> int | None:
    if spec is None or spec.factor is None:
        return None
    L = spec.original_max_position_embeddings or getattr(model.config, "max_position_embeddings", None)
    return int(L * spec.factor) if L else None


@dataclass(frozen=True)
class ResolvedAttention:
    """What the `attention` engine method resolved to: the `lcx.methods` method, the
    `lcx.attention` backend of every call, and whether the cache is bounded."""

    method: Any
    backend: str
    bounded: bool
    decode_backend: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.method.to_dict(), "backend": self.backend, "decode_backend": self.decode_backend,
                "bounded_cache": self.bounded}


def _apply_attention(model: nn.Module, params: Mapping[str, Any]) -> ResolvedAttention:
    from .method_config import MethodConfig
    from .methods.attention_patch import DEFAULT_BACKEND

    cfg = MethodConfig.from_dict({"attention": params})
    cfg.apply(model)
    # kv_window is None when a bounded cache cannot reproduce the method (e.g. LM-Infinite with
    # limit_distance > G + L - 1): the whole cache is kept
    return ResolvedAttention(cfg.attention, cfg.backend or DEFAULT_BACKEND, cfg.kv_window is not None,
                             cfg.decode_backend)


def _attention_kv_policy(resolved: ResolvedAttention) -> KVPolicy | None:
    return window_policy(*resolved.method.cache_window) if resolved.bounded else None


def window_policy(n_first: int, n_recent: int) -> KVPolicy:
    """Keep the slots a query can still see: positions < n_first and the last n_recent - 1."""

    def keep_window(mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # the next query of row b sits at newest[b] + 1 and sees positions < n_first or
        # > newest[b] + 1 - n_recent (BoundedLayer.update keeps the same slots)
        newest = pos.max(1, keepdim=True).values  # [B, 1]
        return mask & ((pos < n_first) | (pos > newest + 1 - n_recent))

    return keep_window


# name -> method. The only list of engine methods; tests iterate over it.
ENGINE_METHODS: dict[str, EngineMethod] = {
    "rope": EngineMethod(
        name="rope", apply=_apply_rope, context_len=_rope_context_len,
        description="a RoPE spec from lcx.rope (HF key names; unset keys come from the model)"),
    "attention": EngineMethod(
        name="attention", apply=_apply_attention, kv_policy=_attention_kv_policy,
        description="an lcx.methods attention method ({'type': 'lm_infinite'|'sliding_window'|'sinks', ...}, "
                    "optional 'backend', 'decode_backend') with a bounded per-row KV cache"),
}


def check_method(name: str) -> EngineMethod:
    """The registered method `name`; `ValueError` naming the supported ones otherwise."""
    if name in ENGINE_METHODS:
        return ENGINE_METHODS[name]
    raise ValueError(f"unknown engine method {name!r}; supported: {sorted(ENGINE_METHODS)}")


# ============================================================================================
# Outputs
# ============================================================================================

@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob and the top-k alternatives `[(token_id, logprob)]`, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepEvent:
    """What one `step` produced for one request.

    token_ids / logprobs: tokens generated this step (0 or 1; logprobs only if asked).
    text: newly stable text. Text that may still turn out to be part of a stop string, and
        trailing incomplete UTF-8, are held back until they are resolved or the request ends.
    prompt_logprobs: with the first event of a request that asked for them, one entry per prompt
        token (None for the first).
    finished / finish_reason: "stop" (EOS, stop token or stop string), "length", "abort", "error".
    error: the exception that failed this request (finish_reason "error"); others go on.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: BaseException | None = None


@dataclass
class RequestOutput:
    """A finished request (what `Engine.generate` returns)."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: BaseException | None = None


@dataclass
class EngineStats:
    """Counters the server exposes (`/stats`) and the tests and benchmark read."""

    prefill_batches: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    max_batch_size: int = 0
    prefill_s: float = 0.0  # wall time in prefill / decode steps (forward + sampling + text)
    decode_s: float = 0.0
    batch_size_hist: dict[int, int] = field(default_factory=dict)  # decode-step batch size -> steps
    finished: dict[str, int] = field(default_factory=lambda: {r: 0 for r in FINISH_REASONS})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["batch_size_hist"] = {str(k): v for k, v in sorted(self.batch_size_hist.items())}
        return d


# ============================================================================================
# Per-request state
# ============================================================================================

class _Seq:
    """One request inside the engine."""

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, eos_ids: set[int]):
        self.rid, self.prompt_ids, self.params = rid, prompt_ids, params
        self.out_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        # penalty state, made on first use on the logits' device: which tokens the prompt or
        # output hold (repetition_penalty) [V] bool, and the output's token counts [V] float64
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.gen: torch.Generator | None = None
        if params.temperature > 0:
            self.gen = torch.Generator(device="cpu")
            self.gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        self.text = ""  # full decoded text of out_ids (cut at a stop string once finished)
        self.sent = 0  # characters of `text` already handed out in events
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: BaseException | None = None

    @property
    def next_position(self) -> int:
        """Position of the last sampled token, the one the next decode step feeds."""
        return len(self.prompt_ids) + len(self.out_ids) - 1


# ============================================================================================
# Engine
# ============================================================================================

class Engine:
    """Batched prefill/decode over an HF Llama-family `*ForCausalLM` (see the module docstring).

    Not thread-safe: one thread owns an engine (the server's worker). `validate` touches no
    model state and may be called from anywhere.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, config: EngineConfig | None = None):
        from .hf import check_model_type, decoder

        config = config or EngineConfig()
        check_model_type(model, "lcx.engine")
        self.model, self.tokenizer, self.config = model.eval(), tokenizer, config
        self._decoder = decoder(model)  # the stack the batched forwards call (no lm_head)
        self.resolved_methods: dict[str, Any] = {}
        self._kv_policies: list[KVPolicy] = []
        context = None
        for name, params in config.methods.items():
            method = check_method(name)
            resolved = method.apply(model, params)
            self.resolved_methods[name] = resolved
            context = method.context_len(model, resolved) or context
            policy = method.kv_policy(resolved)
            if policy is not None:
                self._kv_policies.append(policy)
        self.max_model_len = int(config.max_model_len or context or model.config.max_position_embeddings)
        # attention methods run per row on the row's own keys (`lcx_key_positions`), not on a mask
        self._row_attention = "attention" in self.resolved_methods
        from .models.swat import swat_params

        swat = swat_params(model.config)
        if swat is not None:  # a SWAT model: per-row window attention, cache bounded to w - 1 keys
            self._row_attention = True
            self._kv_policies.append(window_policy(0, swat.window))
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.vocab_size = int(model.config.vocab_size)
        eos = getattr(model.config, "eos_token_id", None)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None) or eos
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos_ids.add(int(tokenizer.eos_token_id))
        self.eos_ids = eos_ids
        self.pad_id = int(next(iter(sorted(eos_ids)), 0) if tokenizer.pad_token_id is None
                          else tokenizer.pad_token_id)
        self.stats = EngineStats()
        self._waiting: list[_Seq] = []
        self._next_id = 0
        self._ids: set[str] = set()
        # Running batch (None when empty): per-layer keys/values [B, H_kv, T, D], mask/pos [B, T].
        self._seqs: list[_Seq] = []
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._mask: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._token_cache: dict[int, str] = {}
        self._special_ids = set(getattr(tokenizer, "all_special_ids", None) or [])
        self._byte_decoder = _byte_decoder(tokenizer)

    @classmethod
    def from_pretrained(cls, name_or_path: str, config: EngineConfig | None = None, *,
                        dtype: torch.dtype | str = torch.float32, device: str = "cpu") -> "Engine":
        """Load with `lcx.load_model` (HF dir, .gguf, preset) and build an engine."""
        from .models import load_model

        model, tok = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tok, config)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a byte-level BPE token may be part of a UTF-8 character)."""
        tok = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if self._byte_decoder is not None and tok and all(c in self._byte_decoder for c in tok) \
                and int(token_id) not in self._special_ids:
            return bytes(self._byte_decoder[c] for c in tok)
        if tok and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(tok[3:5], 16)])
            except ValueError:
                pass
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    def token_str(self, token_id: int) -> str:
        """One token as text for logprob listings (special tokens included). A token that is not
        valid UTF-8 on its own is written `bytes:\\xNN...`, as OpenAI does, so distinct tokens
        never share a string."""
        s = self._token_cache.get(token_id)
        if s is None:
            b = self.token_bytes(token_id)
            try:
                s = b.decode("utf-8")
            except UnicodeDecodeError:
                s = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            if len(self._token_cache) < 1 << 18:
                self._token_cache[token_id] = s
        return s

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise `ValueError` (naming the problem) if the request cannot run as asked."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in prompt_ids if not _is_int(t) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids in [0, {self.vocab_size}); got {bad[:5]}")
        if n > self.max_model_len:
            raise ContextLengthError(f"the prompt has {n} tokens but max_model_len is {self.max_model_len}; "
                             "shorten the prompt (lcx never truncates it)", "prompt")
        if n + params.max_tokens > self.max_model_len:
            raise ContextLengthError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{n + params.max_tokens} exceeds max_model_len {self.max_model_len}; "
                             f"lower max_tokens to at most {self.max_model_len - n}", "max_tokens")

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (validated first; `ValueError` if it cannot run). Returns its id."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids] if all(_is_int(t) for t in prompt_ids) else list(prompt_ids)
        self.validate(prompt_ids, params)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self._ids.add(request_id)
        self._waiting.append(_Seq(request_id, prompt_ids, params, self.eos_ids))
        return request_id

    def abort(self, request_id: str) -> StepEvent | None:
        """Drop a waiting or running request; returns its final event (None if unknown)."""
        for i, s in enumerate(self._waiting):
            if s.rid == request_id:
                del self._waiting[i]
                return self._finish_event(s, "abort")
        for i, s in enumerate(self._seqs):
            if s.rid == request_id:
                ev = self._finish_event(s, "abort")
                self._drop_rows([i])
                return ev
        return None

    def reset(self) -> list[str]:
        """Drop every waiting and running request (after an unexpected failure); returns their ids."""
        ids = [s.rid for s in self._waiting + self._seqs]
        self._waiting = []
        self._seqs, self._keys, self._values, self._mask, self._pos = [], [], [], None, None
        self._ids.clear()
        return ids

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._seqs)

    def has_work(self) -> bool:
        return bool(self._waiting or self._seqs)

    def generate(self, prompts: Iterable[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run `prompts` (token id lists) to completion, batched, and return them in order."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        outs: dict[str, RequestOutput] = {}
        acc: dict[str, list[StepEvent]] = {i: [] for i in ids}
        while len(outs) < len(ids):
            for ev in self.step():
                if ev.request_id not in acc:
                    continue
                acc[ev.request_id].append(ev)
                if ev.finished:
                    outs[ev.request_id] = _collect(ev.request_id, prompts[ids.index(ev.request_id)],
                                                   acc.pop(ev.request_id),
                                                   params[ids.index(ev.request_id)])
        return [outs[i] for i in ids]

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> list[StepEvent]:
        """Admit waiting requests (one batched prefill), decode one token for the running ones.

        Returns one event per request that produced something or finished. A failure confined
        to one request (its prefill, sampling or detokenisation) fails that request only.
        """
        events: list[StepEvent] = []
        if self._seqs:
            t0 = time.perf_counter()
            events += self._decode_step()
            self.stats.decode_s += time.perf_counter() - t0
        free = self.config.max_batch - len(self._seqs)
        if self._waiting and free > 0:
            admit, self._waiting = self._waiting[:free], self._waiting[free:]
            t0 = time.perf_counter()
            events += self._prefill(admit)
            self.stats.prefill_s += time.perf_counter() - t0
        for ev in events:
            if ev.finished:
                self._ids.discard(ev.request_id)
        return events

    # ------------------------------------------------------------------ prefill
    def _prefill(self, seqs: list[_Seq]) -> list[StepEvent]:
        try:
            keys, values, mask, pos, h = self._prefill_forward(seqs)
        except Exception as e:  # noqa: BLE001 - isolate: retry one by one, fail only the culprits
            if len(seqs) == 1:
                log.exception("prefill failed for request %s", seqs[0].rid)
                self._finish(seqs[0], "error", error=e)
                return [self._event(seqs[0])]
            log.warning("batched prefill of %d requests failed (%s); retrying one by one", len(seqs), e)
            return [ev for s in seqs for ev in self._prefill([s])]
        self.stats.prefill_batches += 1
        self.stats.prompt_tokens += sum(len(s.prompt_ids) for s in seqs)
        events: list[StepEvent] = []
        keep: list[int] = []
        need_sample = [i for i, s in enumerate(seqs) if s.params.max_tokens > 0]
        logits = self._lm_head(h[need_sample, -1]) if need_sample else None  # [b, V]
        for i, s in enumerate(seqs):
            try:
                ev = StepEvent(s.rid)
                if s.params.prompt_logprobs is not None:
                    n = len(s.prompt_ids)
                    plog = self._lm_head(h[i, h.shape[1] - n:-1]) if n > 1 else None  # [n-1, V]
                    ev.prompt_logprobs = [None] + (self._logprob_rows(plog, s.prompt_ids[1:], s.params.prompt_logprobs)
                                                   if plog is not None else [])
                    s.prompt_logprobs = ev.prompt_logprobs
                if s.params.max_tokens == 0:
                    self._finish(s, "length")
                else:
                    self._accept(s, logits[need_sample.index(i)], ev)
                self._fill_event(s, ev)
                events.append(ev)
                if not s.finished:
                    keep.append(i)
            except Exception as e:  # noqa: BLE001
                log.exception("post-processing failed for request %s", s.rid)
                self._finish(s, "error", error=e)
                events.append(self._event(s))
        if keep:
            self._merge([seqs[i] for i in keep], [k[keep] for k in keys], [v[keep] for v in values],
                        mask[keep], pos[keep])
        return events

    def _prefill_forward(self, seqs: list[_Seq]):
        """Left-padded batched prefill. Returns keys, values (per layer [b, H_kv, T, D]),
        mask [b, T], pos [b, T] and the final hidden states [b, T, d]."""
        from transformers.cache_utils import DynamicCache

        b, T = len(seqs), max(len(s.prompt_ids) for s in seqs)
        ids = torch.full((b, T), self.pad_id, dtype=torch.long)
        mask = torch.zeros(b, T, dtype=torch.bool)
        for i, s in enumerate(seqs):
            n = len(s.prompt_ids)
            ids[i, T - n:] = torch.tensor(s.prompt_ids)
            mask[i, T - n:] = True
        pos = mask.long().cumsum(1) - 1  # [b, T]: index within the request; -1 on padding
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        cache = DynamicCache()
        out = self._decoder(input_ids=ids, position_ids=pos.clamp(min=0), past_key_values=cache,
                               use_cache=True, **self._mask_kwargs(mask, pos))
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        return keys, values, mask, pos, out.last_hidden_state

    def _mask_kwargs(self, mask: torch.Tensor, pos: torch.Tensor | None) -> dict[str, Any]:
        """Visibility of the cached + new slots for the model's forward: a 2D attention mask, or
        for attention methods the per-row key positions (-1 where not visible)."""
        if self._row_attention:
            return {"lcx_key_positions": pos.masked_fill(~mask, -1)}
        return {"attention_mask": mask.long()}

    # ------------------------------------------------------------------ decode
    def _decode_step(self) -> list[StepEvent]:
        B = len(self._seqs)
        self.stats.decode_steps += 1
        self.stats.batch_size_hist[B] = self.stats.batch_size_hist.get(B, 0) + 1
        self.stats.max_batch_size = max(self.stats.max_batch_size, B)
        try:
            logits, keys, values = self._decode_forward(list(range(B)))
            failed: dict[int, BaseException] = {}
        except Exception as e:  # noqa: BLE001 - isolate: run rows one by one, fail only the culprits
            if B == 1:
                logits, keys, values, failed = None, None, None, {0: e}
            else:
                log.warning("batched decode of %d rows failed (%s); retrying row by row", B, e)
                logits, keys, values, failed = self._decode_rows_separately()
        if keys is not None:
            # Commit the new column of every row (failed rows are dropped just below).
            newpos = torch.tensor([s.next_position for s in self._seqs], device=self.device)
            self._keys, self._values = keys, values
            self._mask = torch.cat([self._mask, torch.ones(B, 1, dtype=torch.bool, device=self.device)], 1)
            self._pos = torch.cat([self._pos, newpos[:, None]], 1)
        events: list[StepEvent] = []
        done: list[int] = []
        greedy, lps = self._batch_greedy_and_logprobs(logits, self._seqs) if logits is not None else (None, None)
        for i, s in enumerate(self._seqs):
            if i in failed:
                log.error("decode failed for request %s: %r", s.rid, failed[i])
                self._finish(s, "error", error=failed[i])
                events.append(self._event(s))
                done.append(i)
                continue
            try:
                ev = StepEvent(s.rid)
                self._accept(s, logits[i], ev, greedy=greedy[i], logprobs=None if lps is None else lps[i])
                self._fill_event(s, ev)
            except Exception as e:  # noqa: BLE001
                log.exception("post-processing failed for request %s", s.rid)
                self._finish(s, "error", error=e)
                ev = self._event(s)
            events.append(ev)
            if s.finished:
                done.append(i)
        if done:
            self._drop_rows(done)
        self._apply_kv_policies()
        return events

    def _decode_forward(self, rows: list[int]):
        """One decode forward for batch rows `rows`: feeds each row's last sampled token.

        Returns logits [b, V] and the grown per-layer keys/values [b, H_kv, T+1, D]; the engine's
        state is untouched (the caller commits), so a failed forward leaves it intact.
        """
        full = len(rows) == len(self._seqs)
        sel = torch.tensor(rows, device=self.device)
        keys = self._keys if full else [k[sel] for k in self._keys]
        values = self._values if full else [v[sel] for v in self._values]
        mask = self._mask if full else self._mask[sel]
        cache = _hf_cache(keys, values)
        seqs = [self._seqs[i] for i in rows]
        ids = torch.tensor([[s.out_ids[-1]] for s in seqs], device=self.device)  # [b, 1]
        pos = torch.tensor([[s.next_position] for s in seqs], device=self.device)  # [b, 1]
        attn = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.bool, device=self.device)], 1)
        kpos = None
        if self._row_attention:
            kpos = torch.cat([self._pos if full else self._pos[sel], pos], 1)  # [b, T+1]
        out = self._decoder(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                               **self._mask_kwargs(attn, kpos))
        logits = self._lm_head(out.last_hidden_state[:, -1])  # [b, V]
        return logits, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]

    def _decode_rows_separately(self):
        """Fallback after a failed batched decode: one forward per row. Failed rows get zeros
        (never read: they are dropped before the next step)."""
        B = len(self._seqs)
        failed: dict[int, BaseException] = {}
        parts: dict[int, Any] = {}
        for i in range(B):
            try:
                parts[i] = self._decode_forward([i])
            except Exception as e:  # noqa: BLE001
                failed[i] = e
        if not parts:
            return None, None, None, failed
        ref = next(iter(parts.values()))

        def rows(j: int, layer: int | None):
            if layer is None:
                return [parts[i][0] if i in parts else torch.zeros_like(ref[0]) for i in range(B)]
            return [parts[i][j][layer] if i in parts else torch.zeros_like(ref[j][layer]) for i in range(B)]

        logits = torch.cat(rows(0, None))
        keys = [torch.cat(rows(1, layer)) for layer in range(len(ref[1]))]
        values = [torch.cat(rows(2, layer)) for layer in range(len(ref[2]))]
        return logits, keys, values, failed

    # ------------------------------------------------------------------ batch surgery
    def _merge(self, seqs: list[_Seq], keys, values, mask, pos) -> None:
        """Append prefilled rows to the running batch, left-padding the shorter side."""
        if not self._seqs:
            self._seqs, self._keys, self._values, self._mask, self._pos = list(seqs), keys, values, mask, pos
        else:
            T = max(self._mask.shape[1], mask.shape[1])
            a = _left_pad(self._keys, self._values, self._mask, self._pos, T)
            b = _left_pad(keys, values, mask, pos, T)
            self._keys = [torch.cat([x, y]) for x, y in zip(a[0], b[0])]
            self._values = [torch.cat([x, y]) for x, y in zip(a[1], b[1])]
            self._mask = torch.cat([a[2], b[2]])
            self._pos = torch.cat([a[3], b[3]])
            self._seqs += seqs
        self._apply_kv_policies()

    def _drop_rows(self, rows: list[int]) -> None:
        keep = [i for i in range(len(self._seqs)) if i not in set(rows)]
        if not keep:
            self._seqs, self._keys, self._values, self._mask, self._pos = [], [], [], None, None
            return
        sel = torch.tensor(keep, device=self.device)
        self._seqs = [self._seqs[i] for i in keep]
        self._keys = [k[sel] for k in self._keys]
        self._values = [v[sel] for v in self._values]
        self._mask, self._pos = self._mask[sel], self._pos[sel]
        self._compact()

    def _apply_kv_policies(self) -> None:
        if not self._seqs or not self._kv_policies:
            return
        for policy in self._kv_policies:
            new = policy(self._mask, self._pos)
            if new.shape != self._mask.shape or new.dtype != torch.bool:
                raise RuntimeError(f"kv_policy returned {tuple(new.shape)} {new.dtype}; expected "
                                   f"{tuple(self._mask.shape)} bool")
            if bool((new & ~self._mask).any()):
                raise RuntimeError("kv_policy turned on a slot that was off (padding or evicted)")
            self._mask = new
        self._compact()

    def _compact(self) -> None:
        """Drop cache columns no row can see (leading padding after rows left, evicted slots)."""
        live = self._mask.any(0)  # [T]
        if bool(live.all()):
            return
        idx = live.nonzero().squeeze(1)
        self._keys = [k[:, :, idx] for k in self._keys]
        self._values = [v[:, :, idx] for v in self._values]
        self._mask, self._pos = self._mask[:, idx], self._pos[:, idx]

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the running batch's cached keys and values (0 when idle)."""
        return sum(t.nbytes for t in (*self._keys, *self._values))

    @property
    def cache_len(self) -> int:
        """Columns of the running batch's KV cache (0 when idle)."""
        return 0 if self._mask is None else int(self._mask.shape[1])

    # ------------------------------------------------------------------ sampling and text
    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(h)
        # Logprobs and sampling in at least float32 (bf16/fp16 logits are too coarse).
        return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits

    def _logprob_rows(self, logits: torch.Tensor, chosen: Sequence[int], k: int,
                      log_probs: torch.Tensor | None = None) -> list[TokenLogprob]:
        """TokenLogprob per row of `logits [n, V]` for tokens `chosen [n]`, with top-k
        (`log_probs`: log_softmax(logits) of a single row [V], if already computed)."""
        lp = torch.log_softmax(logits, dim=-1) if log_probs is None else log_probs[None]
        idx = torch.tensor(list(chosen), device=lp.device)
        picked = lp.gather(1, idx[:, None]).squeeze(1).tolist()
        if k > 0:
            tv, ti = lp.topk(k, dim=-1)
            tv, ti = tv.tolist(), ti.tolist()
        out = []
        for r, (t, v) in enumerate(zip(chosen, picked)):
            top = tuple(zip(ti[r], tv[r])) if k > 0 else ()
            out.append(TokenLogprob(int(t), float(v), top))
        return out

    def _batch_greedy_and_logprobs(self, logits: torch.Tensor, seqs: list[_Seq]):
        """Batch-level work done once per step: argmax of every row ([B] list) and, if any row
        wants logprobs, log_softmax of all rows ([B, V])."""
        greedy = logits.argmax(-1).tolist()
        lps = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
        return greedy, lps

    def _adjust_logits(self, s: _Seq, logits: torch.Tensor) -> torch.Tensor:
        """The logits [V] after the request's penalties and min_tokens mask, as a new float64
        tensor. A penalised logit never overflows to -inf (it stops at float64's lowest), so only
        the mask gives -inf, and never to every token."""
        p = s.params
        x = logits.double()
        if x.data_ptr() == logits.data_ptr():  # already float64: copy before writing into it
            x = x.clone()
        V = x.shape[-1]
        if p.repetition_penalty != 1.0:
            if s.seen is None:
                s.seen = torch.zeros(V, dtype=torch.bool, device=x.device)
                ids = [t for t in s.prompt_ids + s.out_ids if t < V]
                s.seen[torch.tensor(ids, dtype=torch.long, device=x.device)] = True
            rp = p.repetition_penalty
            lowest = torch.finfo(torch.float64).min
            x = torch.where(s.seen, torch.where(x > 0, x / rp, (x * rp).clamp(min=lowest)), x)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            if s.counts is None:
                s.counts = torch.zeros(V, dtype=torch.float64, device=x.device)
                for t in s.out_ids:
                    s.counts[t] += 1
            x = x - p.frequency_penalty * s.counts - p.presence_penalty * (s.counts > 0).double()
        if len(s.out_ids) < p.min_tokens:
            banned = sorted(t for t in s.stop_ids if t < V)
            if 0 < len(banned) < V:  # (stop tokens covering the whole vocabulary: nothing to mask)
                x[torch.tensor(banned, dtype=torch.long, device=x.device)] = -math.inf
        return x

    def _sample(self, s: _Seq, logits: torch.Tensor, greedy: int | None = None) -> int:
        p = s.params
        if p.adjusts_logits:
            logits, greedy = self._adjust_logits(s, logits), None
        if p.temperature == 0:
            return int(logits.argmax()) if greedy is None else greedy
        x = logits.double().cpu()
        probs = torch.softmax(x / p.temperature, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            # logits / T overflowed (T tiny, e.g. 1e-310): the same distribution from logits - max,
            # which is <= 0 everywhere and 0 at the top token
            probs = torch.softmax((x - x.max()) / p.temperature, dim=-1)
        if p.min_p > 0.0:
            probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
            probs = probs / probs.sum()
        if 0 < p.top_k < probs.shape[-1]:
            tv, ti = probs.topk(p.top_k)
            probs = torch.zeros_like(probs).scatter_(0, ti, tv / tv.sum())
        if p.top_p < 1.0:
            sp, si = probs.sort(descending=True)
            # keep token j if the mass strictly before it is < top_p (the top token always stays)
            keep = (sp.cumsum(0) - sp) < p.top_p
            probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
        return int(torch.multinomial(probs, 1, generator=s.gen))

    def _accept(self, s: _Seq, logits: torch.Tensor, ev: StepEvent, *, greedy: int | None = None,
                logprobs: torch.Tensor | None = None) -> None:
        """Sample the next token of `s` from `logits [V]`, record it, check stop conditions.
        `greedy` (argmax) and `logprobs` (log_softmax of logits) may come precomputed for the batch."""
        tok = self._sample(s, logits, greedy)
        s.out_ids.append(tok)
        if s.seen is not None:
            s.seen[tok] = True
        if s.counts is not None:
            s.counts[tok] += 1
        ev.token_ids.append(tok)
        self.stats.generated_tokens += 1
        if s.params.logprobs is not None:
            lp = self._logprob_rows(logits[None], [tok], s.params.logprobs, log_probs=logprobs)[0]
            s.logprobs.append(lp)
            ev.logprobs.append(lp)
        if tok in s.stop_ids:
            s.text = self.decode(s.out_ids)
            self._finish(s, "stop", stop_reason=tok if tok not in self.eos_ids else None)
            return
        prev = len(s.text)
        s.text = self.decode(s.out_ids)
        if s.params.stop and len(s.out_ids) >= s.params.min_tokens:
            # A stop string can end in the new text and start up to len(stop)-1 chars before it.
            start = max(0, prev - max(len(x) for x in s.params.stop) + 1)
            hits = [(s.text.find(x, start), x) for x in s.params.stop]
            hits = [(i, x) for i, x in hits if i >= 0]
            if hits:
                i, x = min(hits)
                s.text = s.text[:i]
                self._finish(s, "stop", stop_reason=x)
                return
        if len(s.out_ids) >= s.params.max_tokens:
            self._finish(s, "length")

    def _finish(self, s: _Seq, reason: str, *, stop_reason: str | int | None = None,
                error: BaseException | None = None) -> None:
        s.finished, s.finish_reason, s.stop_reason, s.error = True, reason, stop_reason, error
        self.stats.finished[reason] += 1

    def _fill_event(self, s: _Seq, ev: StepEvent) -> None:
        """Move newly stable text into `ev` and copy the finish state."""
        end = len(s.text)
        if not s.finished:
            # Hold back a trailing incomplete UTF-8 sequence and a possible stop-string prefix.
            while end > s.sent and s.text[end - 1] == "\ufffd":
                end -= 1
            for x in s.params.stop:
                for k in range(min(len(x) - 1, end - s.sent), 0, -1):
                    if s.text.endswith(x[:k], 0, end):
                        end -= k
                        break
        if end > s.sent:
            ev.text = s.text[s.sent:end]
            s.sent = end
        ev.finished, ev.finish_reason, ev.stop_reason, ev.error = s.finished, s.finish_reason, s.stop_reason, s.error

    def _event(self, s: _Seq) -> StepEvent:
        ev = StepEvent(s.rid)
        if s.finish_reason != "error":
            self._fill_event(s, ev)
        else:
            ev.finished, ev.finish_reason, ev.error = True, "error", s.error
        return ev

    def _finish_event(self, s: _Seq, reason: str) -> StepEvent:
        self._finish(s, reason)
        self._ids.discard(s.rid)
        return self._event(s)


# ============================================================================================
# helpers
# ============================================================================================

def _byte_decoder(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2's printable-char -> byte table when the tokenizer is byte-level BPE, else None."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None or "ByteLevel" not in type(decoder).__name__ and "ByteLevel" not in repr(decoder):
        return None
    from .models.tiny import _gpt2_bytes_to_unicode

    return {c: b for b, c in _gpt2_bytes_to_unicode().items()}


def _hf_cache(keys: list[torch.Tensor], values: list[torch.Tensor]):
    """An HF `DynamicCache` whose layers hold these tensors (no copy; HF's update concatenates)."""
    from transformers.cache_utils import DynamicCache

    hf = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in zip(keys, values)])
    for layer, k, v in zip(hf.layers, keys, values):
        layer.keys, layer.values = k, v
    return hf


def _left_pad(keys, values, mask, pos, T: int):
    """Left-pad a batch's cache to T columns (zeros, mask False, pos -1)."""
    pad = T - mask.shape[1]
    if pad == 0:
        return keys, values, mask, pos
    b = mask.shape[0]
    keys = [torch.cat([k.new_zeros(k.shape[0], k.shape[1], pad, k.shape[3]), k], 2) for k in keys]
    values = [torch.cat([v.new_zeros(v.shape[0], v.shape[1], pad, v.shape[3]), v], 2) for v in values]
    mask = torch.cat([mask.new_zeros(b, pad), mask], 1)
    pos = torch.cat([pos.new_full((b, pad), -1), pos], 1)
    return keys, values, mask, pos


def _collect(rid: str, prompt: Sequence[int], events: list[StepEvent], params: SamplingParams) -> RequestOutput:
    last = events[-1]
    token_ids = [t for ev in events for t in ev.token_ids]
    plp = next((ev.prompt_logprobs for ev in events if ev.prompt_logprobs is not None), None)
    return RequestOutput(
        request_id=rid, prompt_ids=list(prompt), token_ids=token_ids,
        text="".join(ev.text for ev in events), finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        logprobs=[lp for ev in events for lp in ev.logprobs] if params.logprobs is not None else None,
        prompt_logprobs=plp, error=last.error)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


__all__ = [
    "ENGINE_METHODS",
    "ContextLengthError",
    "Engine",
    "EngineConfig",
    "EngineMethod",
    "EngineStats",
    "RequestOutput",
    "SamplingParams",
    "StepEvent",
    "TokenLogprob",
    "check_method",
]
