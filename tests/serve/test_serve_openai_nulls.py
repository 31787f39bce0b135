"""OpenAI fields sent as `null` (issue #75): OpenAI clients and their wrappers send `null` for fields
they leave unset (`tools`, `tool_choice`, `response_format`, `parallel_tool_calls`, ...); lcx takes
`null`, and the values that change nothing, as absent, and answers any other value of a field it
does not implement with 400 naming the field (`lcx.serve.protocol.CHAT_NEUTRAL`).

Against a real `lcx serve` on 127.0.0.1 (the tiny model, float64): a request with every nullable
OpenAI field at `null` generates exactly what the bare request generates.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from lcx.serve.body import Limits, parse_body  # noqa: E402
from lcx.serve.protocol import CHAT_NEUTRAL, APIError, ChatCompletionRequest, CompletionRequest  # noqa: E402

from _servers import lcx_serve, wait_healthy  # noqa: E402

MAX_MODEL_LEN = 256
GEN = 5
TIMEOUT_S = 60
CHAT = [{"role": "user", "content": "ROMEO: hello"}]
# every field of OpenAI's chat completions request (openai-python's CompletionCreateParams) but
# messages and model, at null
CHAT_NULLS = {k: None for k in (
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort", "response_format",
    "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options")}
# the same for legacy completions
COMPLETION_NULLS = {k: None for k in (
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed",
    "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user")}
# (field, a value lcx does not support, the words its 400 must hold)
UNSUPPORTED = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool calling"),
    ("tools", [], "tool calling"),
    ("tool_choice", "auto", "tool calling"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}, "tool calling"),
    ("response_format", {"type": "json_object"}, "structured output"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, "structured output"),
    ("parallel_tool_calls", 1, "tool calling"),  # a number is not a boolean
    ("functions", [{"name": "f"}], "function calling"),
    ("function_call", "auto", "function calling"),
    ("modalities", ["text", "audio"], "modalities"),
    ("audio", {"voice": "alloy", "format": "wav"}, "audio"),
    ("store", True, "stored completions"),
    ("store", 0, "stored completions"),
    ("metadata", {"k": "v"}, "metadata"),
    ("service_tier", "flex", "service tiers"),
    ("reasoning_effort", "low", "reasoning"),
    ("prediction", {"type": "content", "content": "x"}, "predicted outputs"),
]
# values that change nothing: accepted as absent
NEUTRAL = [("tool_choice", "none"), ("response_format", {"type": "text"}), ("parallel_tool_calls", True),
           ("parallel_tool_calls", False), ("modalities", ["text"]), ("store", False), ("service_tier", "auto"),
           ("function_call", "none"), ("prompt_cache_key", "k1"), ("safety_identifier", "u1")]


def _parse(model, body: dict):
    req = parse_body(model, json.dumps(body).encode(), Limits.for_engine(MAX_MODEL_LEN))
    req.check_unsupported()
    return req


# ------------------------------------------------------------------------------ the request models
def test_the_neutral_table_names_fields_of_the_chat_request():
    fields = set(ChatCompletionRequest.model_fields)
    assert set(CHAT_NEUTRAL) <= fields
    assert set(CHAT_NULLS) <= fields | {"model"}, set(CHAT_NULLS) - fields
    assert set(COMPLETION_NULLS) <= set(CompletionRequest.model_fields), set(COMPLETION_NULLS) - set(
        CompletionRequest.model_fields)


def test_every_openai_field_at_null_is_the_default():
    bare = _parse(ChatCompletionRequest, {"messages": CHAT})
    nulls = _parse(ChatCompletionRequest, {"messages": CHAT, **CHAT_NULLS})
    assert nulls.sampling_kwargs() == bare.sampling_kwargs()
    assert (nulls.n, nulls.stream, nulls.logprobs, nulls.max_tokens) == (1, False, False, None)
    for name in CHAT_NEUTRAL:
        assert getattr(nulls, name) is None
    bare = _parse(CompletionRequest, {"prompt": "x"})
    nulls = _parse(CompletionRequest, {"prompt": "x", **COMPLETION_NULLS})
    assert nulls.sampling_kwargs() == bare.sampling_kwargs()
    assert (nulls.n, nulls.echo, nulls.stream, nulls.best_of) == (1, False, False, None)


@pytest.mark.parametrize("field,value", NEUTRAL, ids=[f"{f}={json.dumps(v)}" for f, v in NEUTRAL])
def test_a_neutral_value_is_accepted(field, value):
    req = _parse(ChatCompletionRequest, {"messages": CHAT, field: value})
    assert getattr(req, field) == value


@pytest.mark.parametrize("field,value,words", UNSUPPORTED,
                         ids=[f"{f}={json.dumps(v)[:20]}" for f, v, _ in UNSUPPORTED])
def test_an_unsupported_value_is_a_400_naming_the_field(field, value, words):
    with pytest.raises(APIError) as e:
        _parse(ChatCompletionRequest, {"messages": CHAT, field: value})
    err = e.value
    assert (err.status, err.param, err.code) == (400, field, "unsupported_parameter")
    assert err.message.startswith(f"{field}: ") and words in err.message and "null" in err.message, err.message


@pytest.mark.parametrize("model,base", [(ChatCompletionRequest, {"messages": CHAT}),
                                        (CompletionRequest, {"prompt": "x"})], ids=["chat", "completions"])
def test_stream_options_fields_at_null(model, base):
    req = _parse(model, {**base, "stream": True, "stream_options": {"include_usage": None,
                                                                    "include_obfuscation": None}})
    assert req.stream_options.include_usage is False
    _parse(model, {**base, "stream": True, "stream_options": {"include_obfuscation": False}})
    with pytest.raises(APIError) as e:
        _parse(model, {**base, "stream": True, "stream_options": {"include_obfuscation": True}})
    assert (e.value.param, e.value.code) == ("stream_options", "unsupported_parameter")
    assert "include_obfuscation" in e.value.message


def test_chat_only_fields_stay_unknown_to_completions():
    with pytest.raises(APIError) as e:
        _parse(CompletionRequest, {"prompt": "x", "tools": None})
    assert (e.value.status, e.value.param, e.value.code) == (400, "tools", "unknown_field")


# ------------------------------------------------------------------------------ through lcx serve
@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-nulls") / "server.log"
    with lcx_serve(tiny_model_dir, log, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float64",
                   "--threads", "1", "--no-engine-process") as (url, proc):
        wait_healthy(url, proc, log)
        yield url


def _post(url, path, body):
    return httpx.post(url + path, json=body, timeout=TIMEOUT_S)


def test_served_nulls_generate_what_the_bare_request_generates(server):
    base = {"messages": CHAT, "max_tokens": GEN, "temperature": 0}
    bare = _post(server, "/v1/chat/completions", base)
    assert bare.status_code == 200, bare.text
    body = {**CHAT_NULLS, **base}
    nulls = _post(server, "/v1/chat/completions", body)
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["message"] == bare.json()["choices"][0]["message"]
    assert nulls.json()["usage"] == bare.json()["usage"]
    base = {"prompt": "ROMEO:", "max_tokens": GEN, "temperature": 0}
    bare = _post(server, "/v1/completions", base)
    nulls = _post(server, "/v1/completions", {**COMPLETION_NULLS, **base})
    assert bare.status_code == nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["text"] == bare.json()["choices"][0]["text"]


def test_served_unsupported_tools_is_a_400_naming_the_field(server):
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "tools": UNSUPPORTED[0][1]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == ("tools", "unsupported_parameter", "invalid_request_error")


def test_the_openai_client_with_explicit_nones(server):
    """The official client, with the fields a wrapper passes as None."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)
    name = httpx.get(server + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    got = client.chat.completions.create(model=name, messages=CHAT, max_tokens=GEN, temperature=0, tools=None,
                                         tool_choice=None, response_format=None, parallel_tool_calls=None,
                                         seed=None, stop=None)
    want = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": GEN, "temperature": 0}).json()
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
