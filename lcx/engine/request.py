"""One request's state inside the engine (`lcx.engine.core.Engine` owns it; the scheduler moves it
between its queues): prompt, sampling parameters, output so far, sampling state, prefill progress."""

from __future__ import annotations

import secrets
from typing import Any

import torch

from .outputs import TokenLogprob
from .params import SamplingParams


class Request:
    """One request inside the engine: its prompt, parameters, output so far and progress."""

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
        # prefill progress (`lcx.engine.prefix`): prompt tokens whose KV is held (`kv`, prefill
        # form), of which `cached` came from the prefix cache; prompt logprobs so far
        self.done = 0
        self.cached = 0
        self.looked_up = False
        self.group = rid  # the fair scheduler's client (`Engine.add_request`)
        self.kv: Any = None  # lcx.engine.prefix.RowKV | None
        self.plog: list[TokenLogprob] = []

    @property
    def next_position(self) -> int:
        """Position of the last sampled token, the one the next decode step feeds."""
        return len(self.prompt_ids) + len(self.out_ids) - 1


__all__ = ["Request"]
