"""Request validation against the engine: the model name, prompt lengths (in characters before
tokenizing, then in tokens), each choice's `SamplingParams`, n and seed, and the per-request work
bound (`lcx serve --max-request-tokens`, `--max-n`). Every refusal is a 400/404 naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from lcx.engine import INT64_MAX, INT64_MIN, ContextLengthError, Engine, SamplingParams

from .engine_process import EngineView
from .jobs import Job
from .protocol import LENGTH_HINT, MAX_PROMPTS, APIError, bad_request

# A prompt of more than `margin x longest token (characters) x max_model_len` characters cannot fit
# max_model_len tokens: every token covers at most the longest token's characters. That is exact
# for tokenizers whose normaliser never shortens text (byte-level BPE, Llama's SentencePiece);
# the margin leaves room for ones that do (Unicode composition). Only the bound is approximate:
# a prompt under it is tokenized and checked exactly.
PROMPT_CHARS_MARGIN = 2
# The per-request work bound (`lcx serve --max-request-tokens`, `--max-n`): a request's choices may
# together ask for at most WORK_FACTOR x max_model_len tokens of prompt + max_tokens, and n is at
# most DEFAULT_MAX_N (OpenAI's limit), so that one request cannot hold the engine for minutes
# while others wait (issue #44: n=256 x 32 tokens made a 4-token request wait 8.5 s).
WORK_FACTOR = 4
DEFAULT_MAX_N = 128
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def max_token_chars(tok: Any) -> int:
    """The most characters one token of `tok` stands for (its raw string or its decoded text,
    special tokens included): the bound behind `PROMPT_CHARS_MARGIN`."""
    ids = list(range(len(tok)))
    raw = tok.convert_ids_to_tokens(ids)
    decoded = tok.batch_decode([[i] for i in ids], skip_special_tokens=False)
    return max(1, max((len(t) for t in raw if t), default=1), max((len(t) for t in decoded), default=1))


class RequestChecks:
    """The checks the routes run on a parsed request (`ServerContext.checks`), and the count of
    prompts that passed them (/stats' `prompts`)."""

    def __init__(self, engine: Engine | EngineView, *, model_name: str, max_request_tokens: int | None = None,
                 max_n: int = DEFAULT_MAX_N):
        self.max_request_tokens = WORK_FACTOR * engine.max_model_len if max_request_tokens is None \
            else max_request_tokens
        if self.max_request_tokens < 1:
            raise ValueError(f"max_request_tokens must be >= 1, got {max_request_tokens}")
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        self.engine, self.model_name, self.max_n = engine, model_name, max_n
        self.prompt_char_limit = PROMPT_CHARS_MARGIN * max_token_chars(engine.tokenizer) * engine.max_model_len
        # prompts that passed validation (for /stats): what the server received, e.g. to check
        # that a client (lm-eval's local-completions) did not cut them
        self.prompt_stats = {"prompts": 0, "tokens": 0, "longest": 0}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_chars(self, text: str, param: str, what: str) -> None:
        """Refuse, before tokenizing, a text too long for max_model_len tokens (`PROMPT_CHARS_MARGIN`)."""
        if len(text) > self.prompt_char_limit:
            raise bad_request(f"{what} has {len(text)} characters, more than {self.engine.max_model_len} tokens "
                              f"(max_model_len) of this tokenizer can hold (at most {self.prompt_char_limit}); "
                              f"shorten it (lcx never truncates){LENGTH_HINT}", param, "context_length_exceeded")

    def sampling(self, req: Any, prompt_ids: list[int], max_tokens: int, *, logprobs: int | None,
                 prompt_logprobs: int | None, choice: int, rename: dict[str, str] | None = None,
                 allow_empty: bool = False) -> SamplingParams:
        """The request's SamplingParams for one choice, validated against the engine. `rename` maps
        engine names to the request's (chat: prompt -> messages); `allow_empty`: max_tokens 0 is
        fine (echo scoring)."""
        rename = rename or {}
        seed = None if req.seed is None else req.seed + choice
        try:
            params = SamplingParams(max_tokens=max_tokens, seed=seed, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs, **req.sampling_kwargs())
            self.engine.validate(prompt_ids, params)
        except ContextLengthError as e:
            raise bad_request(f"{e}{LENGTH_HINT}", rename.get(e.param, e.param), "context_length_exceeded") from None
        except ValueError as e:  # SamplingParams name the field first; the engine's errors are the prompt's
            first = str(e).split(" ", 1)[0]
            param = first if first in SAMPLING_FIELDS else "prompt"
            raise bad_request(str(e), rename.get(param, param)) from None
        if max_tokens == 0 and not allow_empty:
            raise bad_request(f"the prompt ({len(prompt_ids)} tokens) fills max_model_len "
                              f"{self.engine.max_model_len}: no room to generate{LENGTH_HINT}",
                              rename.get("prompt", "prompt"),
                              "context_length_exceeded")
        return params

    def count_prompt(self, ids: Sequence[int]) -> None:
        """Count a validated prompt in /stats' `prompts` (its tokens, the longest so far)."""
        st = self.prompt_stats
        st["prompts"] += 1
        st["tokens"] += len(ids)
        if len(ids) > st["longest"]:
            st["longest"] = len(ids)

    def check_work(self, jobs: Sequence[Job], n: int) -> None:
        """The per-request work bound: prompt + max_tokens summed over every choice at most
        `max_request_tokens` (`lcx serve --max-request-tokens`); 400 naming the flag."""
        work = sum(len(j.prompt_ids) + j.params.max_tokens for j in jobs)
        if work > self.max_request_tokens:
            prompts = len({j.prompt_index for j in jobs})
            gen = any(j.params.max_tokens for j in jobs)
            raise bad_request(
                f"this request asks for {work} tokens of work ({prompts} prompt(s) x n={n}: prompt + max_tokens "
                f"summed over its {len(jobs)} choice(s)); this server runs at most {self.max_request_tokens} per "
                "request (lcx serve --max-request-tokens), so that one request cannot hold the engine while others "
                "wait: lower " + ("max_tokens or n, or " if gen else "") + "send the prompts in several requests",
                "max_tokens" if gen else "prompt", "work_limit_exceeded")

    def check_n_and_seed(self, req: Any, n_prompts: int) -> None:
        n = req.n
        if n < 1:
            raise bad_request(f"n must be >= 1, got {n}", "n")
        if n > self.max_n:
            raise bad_request(f"n={n} is more than this server's limit of {self.max_n} choices per prompt "
                              "(lcx serve --max-n)", "n", "work_limit_exceeded")
        if n * n_prompts > MAX_PROMPTS:
            raise bad_request(f"{n_prompts} prompt(s) x n={n} exceeds the limit of {MAX_PROMPTS} choices "
                              "per request", "n")
        if req.seed is not None and not (INT64_MIN <= req.seed and req.seed + n - 1 <= INT64_MAX):
            extra = f"; with n={n} the choices use seed .. seed + {n - 1}, which must fit too" if n > 1 else ""
            raise bad_request(f"seed must be an integer in [-2**63, 2**63 - 1] (64-bit signed){extra}, "
                              f"got {req.seed}", "seed")
