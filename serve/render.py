"""Rendering: chat messages to the prompt's token ids (the chat template), and the engine's
logprobs to OpenAI's completion and chat logprob objects."""

from __future__ import annotations

from typing import Any, Sequence

from lcx.engine import Engine, TokenLogprob

from .engine_process import EngineView
from .protocol import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, bad_request
from .sampling import RequestChecks

LOGPROB_FLOOR = -9999.0  # what a -inf logprob is sent as (JSON has no -inf; vLLM does the same)


def finite(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN (never expected) to the floor


class Renderer:
    """Chat prompts and logprobs of one engine (`ServerContext.render`). `chat_template`: the
    resolved template (`lcx.serve.chat_template.resolve_chat_template`), None for none."""

    def __init__(self, engine: Engine | EngineView, checks: RequestChecks, *, model_name: str,
                 chat_template: str | None):
        self.engine, self.checks, self.model_name = engine, checks, model_name
        self.tok, self.chat_template = engine.tokenizer, chat_template

    def chat(self, messages: list[Any], add_generation_prompt: bool,
                    kwargs: dict[str, Any] | None) -> list[int]:
        """The chat prompt's token ids (runs on the CPU pool)."""
        tok = self.tok
        if self.chat_template is None:
            raise bad_request(f"the model {self.model_name!r} has no chat template in its tokenizer (and the server "
                              "was started with --chat-template none); use /v1/completions", "messages",
                              "no_chat_template")
        try:
            text = tok.apply_chat_template([m.as_template_dict() for m in messages], tokenize=False,
                                           chat_template=self.chat_template,
                                           add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad kwargs) are the client's
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
        if not isinstance(text, str):
            raise bad_request("the chat template did not render to text", "messages")
        self.checks.check_chars(text, "messages", "the rendered chat prompt")
        ids = self.engine.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("the rendered chat prompt is empty", "messages")
        return ids

    def _top_dict(self, lp: TokenLogprob) -> dict[str, float]:
        d = {self.engine.token_str(t): finite(v) for t, v in lp.top}
        d.setdefault(self.engine.token_str(lp.token_id), finite(lp.logprob))  # the chosen token, as vLLM
        return d

    def completion_logprobs(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                            offset: int) -> tuple[CompletionLogprobs, int]:
        """OpenAI's completion logprobs of `token_ids`, the first at character `offset` of the
        choice's whole text; also returns the offset after the last token."""
        eng = self.engine
        offsets = []
        for t in token_ids:  # character offsets into the returned text (partial UTF-8 counts 0)
            offsets.append(offset)
            offset += len(eng.token_bytes(t).decode("utf-8", errors="ignore"))
        return CompletionLogprobs(
            tokens=[eng.token_str(t) for t in token_ids],
            token_logprobs=[None if e is None else finite(e.logprob) for e in entries],
            top_logprobs=[None if e is None else self._top_dict(e) for e in entries],
            text_offset=offsets), offset

    def chat_logprobs(self, entries: Sequence[TokenLogprob], k: int) -> ChatLogprobs:
        eng = self.engine

        def one(t: int, v: float) -> dict[str, Any]:
            return {"token": eng.token_str(t), "logprob": finite(v), "bytes": list(eng.token_bytes(t))}

        return ChatLogprobs(content=[
            ChatTokenLogprob(**one(e.token_id, e.logprob), top_logprobs=[ChatTopLogprob(**one(t, v)) for t, v in e.top[:k]])
            for e in entries])
