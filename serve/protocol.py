"""The wire format of the OpenAI-compatible API: request bodies, response bodies, OpenAI errors.

Bodies are validated strictly from the raw JSON (pydantic strict mode: `"5"` is not an integer,
`true` is not a number, NaN and Infinity are not numbers) and unknown fields are rejected by
name: a field lcx does not implement would otherwise be silently ignored. Fields OpenAI defines
but lcx cannot honour (logit_bias, best_of > 1, suffix; in chat tools, tool_choice,
response_format and the rest of `CHAT_NEUTRAL`) are accepted only at their neutral value, `null`
included (what OpenAI clients send for an unset field); another value is 400 naming the field.
Of vLLM's extensions, the sampling ones the engine implements are accepted (`VLLM_SAMPLING`);
value ranges are checked by `lcx.engine.SamplingParams`, which names the field.

Errors are `{"error": {"message", "type", "param", "code"}}`, OpenAI's shape, with a 4xx status
for the client's mistakes and 500 for the server's.

Responses are models too (`CompletionResponse`, `ChatCompletionResponse`, their stream chunks,
`ModelList`, the tokenizer routes' bodies): the routes build them, never raw dicts.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from lcx.engine import INT64_MAX, INT64_MIN, MAX_LOGPROBS

# Structural limits of one request (checked before pydantic by `lcx.serve.body.check_shape`, and
# stated here so /openapi.json states them; max_model_len and the stop-string count are the
# server's: `lcx.serve.body.Limits`).
MAX_PROMPTS = 1024  # prompts x n in one request
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_MESSAGES = 2048  # OpenAI's limit
# repetition_penalty divides positive logits and multiplies negative ones (in float64): inside
# this range no finite logit of a float32/bfloat16 model (|x| < 3.5e38) can overflow, so no
# accepted value yields inf/NaN probabilities. vLLM only asks > 0; values this far from 1 already
# mean "never repeat" / "always repeat".
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
# appended to every context-length error: the limit is the server's, and this flag sets it
LENGTH_HINT = "; max_model_len is the server's limit (lcx serve --max-model-len)"
# vLLM's sampling extensions that lcx implements (lcx.engine.SamplingParams); others are unknown fields
VLLM_SAMPLING = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids")


class APIError(Exception):
    """An error response: HTTP `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # extra response headers (e.g. Retry-After on a 503)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _NullIsDefault(_Strict):
    """A request whose fields OpenAI (or vLLM, for its extensions) types as nullable: `null` means
    the field's default (the openai client sends `null` for `None`, and vLLM accepts it). Such a
    field is declared `X | None` with its default, so /openapi.json states that null is accepted;
    after validation it holds the default, never None, unless None is its default."""

    @model_validator(mode="after")
    def _null_is_default(self):
        for name, f in type(self).model_fields.items():
            if getattr(self, name) is None and f.default is not None:
                object.__setattr__(self, name, f.default)
        return self


class StreamOptions(_NullIsDefault):
    include_usage: bool | None = False
    include_obfuscation: bool | None = Field(None, description="accepted only as null or false (lcx's stream "
                                                               "events carry no obfuscation padding)")


TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class _Common(_NullIsDefault):
    """Fields shared by both completion endpoints (null: the default, for every field OpenAI or
    vLLM types as nullable)."""

    model: str | None = Field(None, description="the served model's name (GET /v1/models); optional")
    temperature: float | None = Field(1.0, ge=0, description="0: greedy; OpenAI's default 1 samples")
    top_p: float | None = Field(1.0, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=MAX_PROMPTS, description=f"choices per prompt; prompts x n <= {MAX_PROMPTS}")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Union[StopString, list[StopString], None] = Field(
        None, description="at most 4 stop strings (the server's `--max-stop`), each at most "
                          f"{MAX_STOP_CHARS} characters")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="choice i uses seed + i")
    user: str | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS,
                                                description="accepted only empty (not supported)")
    # vLLM extensions (VLLM_SAMPLING)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off")
    min_p: float | None = Field(0.0, ge=0, le=1)
    repetition_penalty: float | None = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                             description="1: off")
    min_tokens: int = Field(0, ge=0)

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by the lcx server", "logit_bias", "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is allowed only with stream=true", "stream_options")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise bad_request("stream_options.include_obfuscation: stream obfuscation is not supported by the lcx "
                              "server (its events carry no padding); send null or false, or leave it out",
                              "stream_options", "unsupported_parameter")

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
    # left to right: a token-id list is recognised at once (smart mode would first report one
    # error per element against list[str])
    prompt: Union[str, Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                            Field(min_length=1, max_length=MAX_PROMPTS)]] = Field(
        union_mode="left_to_right",
        description=f"a string, strings, token ids or token-id lists (at most {MAX_PROMPTS} prompts; a token-id "
                    "list at most max_model_len ids)")
    max_tokens: int | None = Field(None, ge=0, description="default 16; 0 only with echo (scores the prompt)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, description="only n (or 1)")
    suffix: str | None = Field(None, description="accepted only empty (not supported)")

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


# OpenAI fields of /v1/chat/completions that lcx does not implement but accepts where they change
# nothing: `null` (what OpenAI clients send for an unset field: the openai client for an explicit
# `None`, LangChain and other wrappers for every field they know) and the values listed here, the
# same as leaving the field out. Any other value gets 400 naming the field and what lcx lacks
# (`unsupported_parameter`), never a silent ignore. From the OpenAI chat completions schema
# (openai-python's `CompletionCreateParams`); the fields lcx implements are the model's own.
# field -> (values besides null that change nothing, what the field asks for)
CHAT_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": ((), "tool calling"),
    "tool_choice": (("none",), "tool calling"),
    # without tools (refused above) the flag has nothing to act on, either way
    "parallel_tool_calls": ((True, False), "tool calling"),
    "functions": ((), "function calling (deprecated in OpenAI's API for tools)"),
    "function_call": (("none",), "function calling (deprecated in OpenAI's API for tools)"),
    "response_format": (({"type": "text"},), "structured output (JSON mode, JSON schema)"),
    "modalities": ((["text"],), "output modalities other than text"),
    "audio": ((), "audio output"),
    "prediction": ((), "predicted outputs"),
    "reasoning_effort": ((), "reasoning models' effort"),
    "verbosity": ((), "verbosity control"),
    "web_search_options": ((), "web search"),
    "store": ((False,), "stored completions"),
    "metadata": ((), "stored completions' metadata"),
    "service_tier": (("auto", "default"), "service tiers"),
    "prompt_cache_retention": ((), "prompt cache retention (lcx's prefix cache is automatic, "
                                   "lcx serve --prefix-caching)"),
    "moderation": ((), "moderation"),
}


def _neutral_values(allowed: tuple[Any, ...]) -> str:
    """'null', 'null or "none"', 'null, true or false'."""
    vals = ["null", *(json.dumps(a) for a in allowed)]
    return vals[0] if len(vals) == 1 else f"{', '.join(vals[:-1])} or {vals[-1]}"


def _neutral_field(name: str, table: dict[str, tuple[tuple[Any, ...], str]]) -> Any:
    allowed, what = table[name]
    return Field(None, description=f"accepted only as {_neutral_values(allowed)} ({what} is not supported by the "
                                   "lcx server)")


def check_neutral(req: BaseModel, table: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """400 `unsupported_parameter` naming the first field of `table` set to a value other than
    null and its neutral values (compared as JSON: `0` is not `false`)."""
    for name, (allowed, what) in table.items():
        v = getattr(req, name)
        if v is None:
            continue
        text = json.dumps(v, sort_keys=True, default=str)
        if any(text == json.dumps(a, sort_keys=True) for a in allowed):
            continue
        raise bad_request(f"{name}: {what} is not supported by the lcx server (got {_short_repr(v)}); send "
                          f"{_neutral_values(allowed)}, or leave the field out", name, "unsupported_parameter")


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
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension
    # OpenAI's informational fields, like `user`: accepted and not used
    safety_identifier: str | None = None
    prompt_cache_key: str | None = Field(None, description="accepted and not used (lcx's prefix cache is "
                                                           "automatic: lcx serve --prefix-caching)")
    # OpenAI's fields lcx does not implement, accepted where they change nothing (CHAT_NEUTRAL)
    tools: Any = _neutral_field("tools", CHAT_NEUTRAL)
    tool_choice: Any = _neutral_field("tool_choice", CHAT_NEUTRAL)
    parallel_tool_calls: Any = _neutral_field("parallel_tool_calls", CHAT_NEUTRAL)
    functions: Any = _neutral_field("functions", CHAT_NEUTRAL)
    function_call: Any = _neutral_field("function_call", CHAT_NEUTRAL)
    response_format: Any = _neutral_field("response_format", CHAT_NEUTRAL)
    modalities: Any = _neutral_field("modalities", CHAT_NEUTRAL)
    audio: Any = _neutral_field("audio", CHAT_NEUTRAL)
    prediction: Any = _neutral_field("prediction", CHAT_NEUTRAL)
    reasoning_effort: Any = _neutral_field("reasoning_effort", CHAT_NEUTRAL)
    verbosity: Any = _neutral_field("verbosity", CHAT_NEUTRAL)
    web_search_options: Any = _neutral_field("web_search_options", CHAT_NEUTRAL)
    store: Any = _neutral_field("store", CHAT_NEUTRAL)
    metadata: Any = _neutral_field("metadata", CHAT_NEUTRAL)
    service_tier: Any = _neutral_field("service_tier", CHAT_NEUTRAL)
    prompt_cache_retention: Any = _neutral_field("prompt_cache_retention", CHAT_NEUTRAL)
    moderation: Any = _neutral_field("moderation", CHAT_NEUTRAL)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        check_neutral(self, CHAT_NEUTRAL)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                              "top_logprobs")


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId] = Field(description="at most max_model_len token ids")


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
    if param == "prompt" and first["type"] != "extra_forbidden":
        return bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                           "token-id lists, and not empty", "prompt", "invalid_type")
    if first["type"] == "missing":
        return bad_request(f"missing required field {'.'.join(loc)!r}", param, "missing_field")
    if first["type"] == "extra_forbidden":
        return bad_request(f"unknown field {'.'.join(loc)!r} (the lcx server rejects fields it does not implement; "
                           f"of vLLM's extensions it implements {', '.join(VLLM_SAMPLING)})", param, "unknown_field")
    got = first.get("input")
    got_s = _short_repr(got)
    code = "invalid_value" if first["type"] in _RANGE_ERRORS else "invalid_type"
    return bad_request(f"invalid value for {'.'.join(loc)!r}: {first['msg']} (got {got_s})", param, code)


_RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_long",
                           "too_short", "string_too_long", "string_too_short"})


def _short_repr(x: Any) -> str:
    """repr(x) cut to 60 characters, without building the repr of a long list or string."""
    if isinstance(x, (list, dict)) and len(x) > 8:
        return f"<{type(x).__name__} of {len(x)} items>"
    if isinstance(x, str) and len(x) > 60:
        x = x[:60]
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


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


class ErrorInfo(_Out):
    message: str
    type: str = Field(description="invalid_request_error (4xx) or server_error (5xx)")
    param: str | None = Field(description="the request field at fault, if one is")
    code: str | None


class ErrorResponse(_Out):
    """OpenAI's error object: every 4xx and 5xx answer of the server."""

    error: ErrorInfo


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
    lcx_max_model_len_source: str = Field(description="how max_model_len was derived (--max-model-len, the "
                                                      "model's context x the RoPE factor, or memory for a "
                                                      "bounded attention method: lcx.serve.lengths)")
    lcx_methods: dict[str, Any]  # the methods the engine applies, resolved for this model


class Health(_Out):
    status: str


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
