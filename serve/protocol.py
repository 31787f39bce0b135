"""The wire format of the OpenAI-compatible API: request bodies, response bodies, OpenAI errors.

Bodies are validated strictly from the raw JSON (pydantic strict mode: `"5"` is not an integer,
`true` is not a number, NaN and Infinity are not numbers) and unknown fields are rejected by
name: a field lcx does not implement would otherwise be silently ignored. Fields OpenAI defines
but lcx cannot honour (logit_bias, best_of > 1, suffix) are accepted only at their neutral value.
Of vLLM's extensions, the sampling ones the engine implements are accepted (`VLLM_SAMPLING`);
value ranges are checked by `lcx.engine.SamplingParams`, which names the field.

Errors are `{"error": {"message", "type", "param", "code"}}`, OpenAI's shape, with a 4xx status
for the client's mistakes and 500 for the server's.

Responses are models too (`CompletionResponse`, `ChatCompletionResponse`, their stream chunks,
`ModelList`, the tokenizer routes' bodies): the routes build them, never raw dicts.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from lcx.engine import MAX_LOGPROBS

MAX_PROMPTS = 1024  # prompts x n in one request
# vLLM's sampling extensions that lcx implements (lcx.engine.SamplingParams); others are unknown fields
VLLM_SAMPLING = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids")


class APIError(Exception):
    """An error response: HTTP `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    """Fields shared by both completion endpoints."""

    model: str | None = None
    temperature: float = 1.0  # OpenAI's default: sample unless told otherwise
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM extensions (VLLM_SAMPLING)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by the lcx server", "logit_bias", "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is allowed only with stream=true", "stream_options")

    def sampling_kwargs(self) -> dict[str, Any]:
        """The `lcx.engine.SamplingParams` keywords these fields give (but max_tokens, seed, logprobs)."""
        return dict(temperature=self.temperature, top_p=self.top_p, stop=tuple(self.stop_list()),
                    stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                    top_k=0 if self.top_k is None else self.top_k, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens)

    def stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise bad_request("stop strings must be non-empty", "stop")
        return stop


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            out: list[Any] = [p]
        elif not p:
            raise bad_request("prompt is empty", "prompt")
        elif isinstance(p[0], int):
            out = [list(p)]
        else:
            out = list(p)
        if any(len(x) == 0 for x in out):
            raise bad_request("prompt is empty: every prompt needs at least one character or token", "prompt")
        return out

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of not in (None, 1, self.n):
            raise bad_request("best_of other than n is not supported by the lcx server", "best_of",
                              "unsupported_parameter")
        if self.suffix:
            raise bad_request("suffix is not supported by the lcx server", "suffix", "unsupported_parameter")


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Messages may carry fields lcx does not use (name, tool_call_id, ...): they go to the
    # chat template, which decides. Only role and content are checked.
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None

    def as_template_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(part.text for part in self.content)
        d.setdefault("content", "")
        return d


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                              "top_logprobs")


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def validation_error(e: ValidationError) -> APIError:
    """A 400 `APIError` naming the first offending field."""
    errs = e.errors()
    first = errs[0] if errs else {"type": "", "loc": (), "msg": str(e)}
    if first["type"] == "json_invalid":
        return bad_request(f"malformed JSON body: {first['msg']}", None, "invalid_json")
    loc = [str(x) for x in first["loc"]]
    if not loc and first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return bad_request("the request body must be a JSON object", None, "invalid_type")
    param = loc[0] if loc else None
    if param == "prompt":
        return bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                           "token-id lists, and not empty", "prompt", "invalid_type")
    if first["type"] == "missing":
        return bad_request(f"missing required field {param!r}", param, "missing_field")
    if first["type"] == "extra_forbidden":
        return bad_request(f"unknown field {'.'.join(loc)!r} (the lcx server rejects fields it does not implement; "
                           f"of vLLM's extensions it implements {', '.join(VLLM_SAMPLING)})", param, "unknown_field")
    got = first.get("input")
    got_s = repr(got)
    got_s = got_s if len(got_s) <= 60 else got_s[:57] + "..."
    return bad_request(f"invalid value for {'.'.join(loc)!r}: {first['msg']} (got {got_s})", param, "invalid_type")


# ------------------------------------------------------------------------------ responses
# What the server sends, as models: the shapes of OpenAI's API (and vLLM's extras) in one place.
# `None` fields are sent as `null` (OpenAI clients expect e.g. "logprobs": null), except in a
# chat `delta`, which carries only the keys that changed.


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _drop_null_usage(d: dict[str, Any]) -> dict[str, Any]:
    if d.get("usage", 0) is None:
        del d["usage"]
    return d


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Out):
    """Legacy completions logprobs: per token its text, logprob, top alternatives and the
    character offset into the choice's whole text (echoed prompt first). Prompt tokens without
    a logprob (the first) carry null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def __add__(self, other: "CompletionLogprobs") -> "CompletionLogprobs":
        return CompletionLogprobs(**{k: getattr(self, k) + getattr(other, k) for k in type(self).model_fields})


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Out):
    """A `/v1/completions` response, and (with one choice each) its stream chunks."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # stream chunks: only the usage chunk has one

    @model_serializer(mode="wrap")
    def _usage_if_set(self, handler):
        return _drop_null_usage(handler(self))


class ChatTopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler):  # a delta carries only the keys it changes
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only the usage chunk has one

    @model_serializer(mode="wrap")
    def _usage_if_set(self, handler):
        return _drop_null_usage(handler(self))


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lcx"
    max_model_len: int
    lcx_methods: dict[str, Any]  # the methods the engine applies, resolved for this model


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizerInfo(_Out):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class TokenizeResponse(_Out):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Out):
    prompt: str
