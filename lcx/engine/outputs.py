"""What the engine returns: per-token logprobs, per-step events, whole-request outputs, stats."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence


from .params import FINISH_REASONS, SamplingParams


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
    mixed_steps: int = 0  # steps whose decode rows and prefill chunks ran as one forward (EngineConfig.mixed_step)
    mixed_s: float = 0.0  # wall time in those steps (counted in neither prefill_s nor decode_s)
    batch_size_hist: dict[int, int] = field(default_factory=dict)  # decode-step batch size -> steps
    finished: dict[str, int] = field(default_factory=lambda: {r: 0 for r in FINISH_REASONS})
    prefill_chunks: int = 0  # prefill calls that continued a prompt from held KV (chunked prefill)
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (prompt_tokens less cache hits)
    # the prefix cache (`lcx.engine.prefix`): requests looked up / reusing >= 1 block, prompt
    # tokens looked up / reused; hit rate = prefix_cache_hit_tokens / prefix_cache_query_tokens
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["batch_size_hist"] = {str(k): v for k, v in sorted(self.batch_size_hist.items())}
        d["prefix_cache_hit_rate"] = round(self.prefix_cache_hit_rate, 6)
        return d


def collect_output(rid: str, prompt: Sequence[int], events: list[StepEvent], params: SamplingParams) -> RequestOutput:
    last = events[-1]
    token_ids = [t for ev in events for t in ev.token_ids]
    plp = next((ev.prompt_logprobs for ev in events if ev.prompt_logprobs is not None), None)
    return RequestOutput(
        request_id=rid, prompt_ids=list(prompt), token_ids=token_ids,
        text="".join(ev.text for ev in events), finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        logprobs=[lp for ev in events for lp in ev.logprobs] if params.logprobs is not None else None,
        prompt_logprobs=plp, error=last.error)
