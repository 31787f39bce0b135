"""lcx serve never fails a client (issue #16): bad input gets a 4xx naming the field, never a 5xx;
oversized bodies get 413 while other clients are served; a client that leaves (streaming or not)
has its requests aborted at once; vLLM's sampling extensions are honoured (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, and OpenAI's presence/frequency penalties) and equal
a direct reference; streamed logprob offsets run over the whole text; every error is counted in
/stats and logged with its request id; lm-eval's remote tokenizer works against a keyed server.

One `lcx serve` subprocess (tiny model, float64, a 1 MiB body limit) serves the HTTP tests; the
sampling tests run the engine in this process against a reference written out here.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from lcx.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

from _servers import lcx_serve, wait_healthy  # noqa: E402


MODEL = "tiny"
KEY = "hardening-key"
MAX_MODEL_LEN = 1024
BODY_LIMIT_MB = 1  # --max-body-mb: small, so the oversized-body tests move little data
LONG = MAX_MODEL_LEN - 24  # max_tokens of a request meant to be abandoned (several seconds of decoding)
GEN = 8
TIMEOUT_S = 60
STORM = 6  # abandoned requests per kind (streaming, non-streaming) in the disconnect storm
MIXED_CLIENTS = 64  # concurrent clients of the mixed load test, one request each


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    """`lcx serve` (subprocess) on the tiny model with an API key and a 1 MiB body limit; yields
    its URL, log path and `ref`, the engine on the same weights in this process."""
    log = tmp_path_factory.mktemp("serve-hardening") / "server.log"
    with lcx_serve(tiny_model_dir, log, "--served-model-name", MODEL, "--api-key", KEY, "--max-model-len",
                   str(MAX_MODEL_LEN), "--max-batch", "32", "--dtype", "float64", "--threads", "1",
                   "--batch-window-ms", "20", "--max-body-mb", str(BODY_LIMIT_MB)) as (url, proc):
        ref = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_model_len=MAX_MODEL_LEN), dtype="float64")
        wait_healthy(url, proc, log)
        yield {"url": url, "log": log, "ref": ref}


H = {"Authorization": f"Bearer {KEY}"}


def _post(srv, path, body, headers=None, timeout=TIMEOUT_S):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {**H, "Content-Type": "application/json", **(headers or {})}
    return httpx.post(srv["url"] + path, content=content, headers=hdrs, timeout=timeout)


def _stats(srv) -> dict:
    r = httpx.get(srv["url"] + "/stats", headers=H, timeout=10)
    r.raise_for_status()
    return r.json()


def _wait_idle(srv, timeout=10.0) -> dict:
    """/stats once nothing runs or waits in the engine (fails after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        s = _stats(srv)
        if s["scheduler"]["running"] == 0 and s["scheduler"]["waiting"] == 0:
            return s
        assert time.monotonic() < deadline, f"the engine is still busy: {s['scheduler']}"
        time.sleep(0.05)


def _assert_serves(srv):
    """A normal request still gets the right answer."""
    ref = srv["ref"]
    r = _post(srv, "/v1/completions", {"prompt": "still here", "max_tokens": GEN, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref.generate([ref.encode("still here")],
                                                          SamplingParams(max_tokens=GEN))[0].text


# ================================================================================ engine sampling
@pytest.fixture(scope="module")
def m64():
    from lcx.models.tiny import tiny_llama

    m, tok = tiny_llama(seed=0)
    return m.double().eval(), tok


PROMPT = "the the the cat sat on the mat; the cat"


def _ref_decode(model, ids, n, *, rp=1.0, pp=0.0, fp=0.0, min_tokens=0, banned=()):
    """Greedy decoding from full forwards with vLLM's penalty definitions written out: the
    reference for the engine's logits adjustments."""
    ids, out = list(ids), []
    for _ in range(n):
        with torch.no_grad():
            x = model(torch.tensor([ids])).logits[0, -1].double()
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[torch.tensor(ids)] = True  # prompt + output so far
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        counts = torch.zeros_like(x)
        for t in out:
            counts[t] += 1
        x = x - fp * counts - pp * (counts > 0).double()
        if len(out) < min_tokens:
            x[list(banned)] = -math.inf
        t = int(x.argmax())
        ids.append(t)
        out.append(t)
    return out


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.8), dict(repetition_penalty=0.7),
                                dict(presence_penalty=1.5), dict(frequency_penalty=-0.8),
                                dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=1.0)],
                         ids=["rep1.8", "rep0.7", "presence", "frequency-neg", "all"])
def test_penalties_equal_reference(m64, kw):
    model, tok = m64
    eng = Engine(model, tok)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    n = 12
    got = eng.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True, **kw))[0].token_ids
    want = _ref_decode(model, ids, n, rp=kw.get("repetition_penalty", 1.0), pp=kw.get("presence_penalty", 0.0),
                       fp=kw.get("frequency_penalty", 0.0))
    assert got == want
    assert got != eng.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids  # it bites
    # batched with other requests: the same
    other = tok("zzz", add_special_tokens=False)["input_ids"]
    batched = eng.generate([other, ids], [SamplingParams(max_tokens=5), SamplingParams(max_tokens=n, ignore_eos=True,
                                                                                        **kw)])
    assert batched[1].token_ids == want


def test_min_tokens_masks_stop_tokens_and_strings(m64):
    model, tok = m64
    eng = Engine(model, tok)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    free = eng.generate([ids], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop_tok = free.token_ids[1]  # greedy would stop at step 2
    out = eng.generate([ids], SamplingParams(max_tokens=20, stop_token_ids=(stop_tok,), min_tokens=6))[0]
    banned = {stop_tok} | eng.eos_ids
    want = _ref_decode(model, ids, 20, min_tokens=6, banned=sorted(banned))
    assert len(out.token_ids) >= 6 and stop_tok not in out.token_ids[:6]
    stop_at = next((i for i, t in enumerate(want) if t in banned and i >= 6), None)
    assert out.token_ids == want[:None if stop_at is None else stop_at + 1]
    # a stop string is not checked before min_tokens either
    s = next(c for c in eng.decode(free.token_ids[:4]) if c != "\ufffd")  # a character of the first 4 tokens
    early = eng.generate([ids], SamplingParams(max_tokens=20, ignore_eos=True, stop=(s,)))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 6
    late = eng.generate([ids], SamplingParams(max_tokens=20, ignore_eos=True, stop=(s,), min_tokens=6))[0]
    assert len(late.token_ids) >= 6


def _old_sampler_tokens(model, ids, n, temperature, top_p, seed):
    """Seeded sampling as the engine did before top_k/min_p/penalties existed (softmax(logits / T),
    top-p, multinomial with the request's generator): the default path must not change."""
    g = torch.Generator().manual_seed(seed)
    ids, out = list(ids), []
    for _ in range(n):
        with torch.no_grad():
            x = model(torch.tensor([ids])).logits[0, -1]
        probs = torch.softmax(x.double() / temperature, dim=-1)
        if top_p < 1.0:
            sp, si = probs.sort(descending=True)
            keep = (sp.cumsum(0) - sp) < top_p
            probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
        t = int(torch.multinomial(probs, 1, generator=g))
        ids.append(t)
        out.append(t)
    return out


def test_seeded_sampling_unchanged_and_truncations(m64):
    model, tok = m64
    eng = Engine(model, tok)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    for T, p, seed in [(1.0, 1.0, 3), (0.8, 0.9, 11)]:
        want = _old_sampler_tokens(model, ids, 10, T, p, seed)
        got = eng.generate([ids], SamplingParams(max_tokens=10, temperature=T, top_p=p, seed=seed, ignore_eos=True))
        assert got[0].token_ids == want
        # the neutral values of the new options take the same path
        neutral = SamplingParams(max_tokens=10, temperature=T, top_p=p, seed=seed, ignore_eos=True, top_k=-1,
                                 min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        assert eng.generate([ids], neutral)[0].token_ids == want
    greedy = eng.generate([ids], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    # top_k=1 and min_p=1 leave only the top token: greedy at any temperature
    for kw in (dict(top_k=1), dict(min_p=1.0)):
        out = eng.generate([ids], SamplingParams(max_tokens=10, temperature=3.0, seed=5, ignore_eos=True, **kw))
        assert out[0].token_ids == greedy, kw
    # a temperature so small that logits / T overflows: still the top token, no NaN
    tiny_t = eng.generate([ids], SamplingParams(max_tokens=10, temperature=1e-310, seed=5, ignore_eos=True))
    assert tiny_t[0].token_ids == greedy
    # top_k / min_p: every sampled token is inside the truncation (checked on the raw logprobs, T = 1)
    for seed in range(4):
        out = eng.generate([ids], SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True, top_k=3,
                                                 logprobs=20))[0]
        for lp in out.logprobs:
            assert lp.token_id in [t for t, _ in lp.top[:3]]
        out = eng.generate([ids], SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True,
                                                 min_p=0.3, logprobs=1))[0]
        for lp in out.logprobs:
            assert lp.logprob >= math.log(0.3) + lp.top[0][1] - 1e-9


@pytest.mark.parametrize("kwargs,match", [
    (dict(seed=2**63), r"seed must be an integer in \[-2\*\*63"),
    (dict(seed=-2**63 - 1), "seed must be"),
    (dict(top_k=-2), "top_k must be"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(max_tokens=4, min_tokens=5), r"min_tokens must be an integer in \[0, max_tokens=4\]"),
    (dict(min_tokens=-1), "min_tokens"),
])
def test_sampling_extension_values_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


# ================================================================================ bad input
BIG = 10**30
CHAT = [{"role": "user", "content": "x"}]
BAD = [
    # id, path, body (dict or raw bytes), status, param, code (None: any)
    ("seed-2^64", "/v1/completions", {"prompt": "x", "seed": 2**64, "temperature": 1}, 400, "seed", None),
    ("seed-below-int64", "/v1/completions", {"prompt": "x", "seed": -2**63 - 1}, 400, "seed", None),
    ("seed-max-n2", "/v1/completions", {"prompt": "x", "seed": 2**63 - 1, "n": 2}, 400, "seed", None),
    ("seed-2^64-1-n2", "/v1/completions", {"prompt": "x", "seed": 2**64 - 1, "n": 2}, 400, "seed", None),
    ("chat-seed-huge", "/v1/chat/completions", {"messages": CHAT, "seed": BIG}, 400, "seed", None),
    ("temperature-nan", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature",
     "invalid_type"),
    ("top-p-infinity", "/v1/completions", b'{"prompt": "x", "top_p": Infinity}', 400, "top_p", "invalid_type"),
    ("temperature-1e999", "/v1/completions", b'{"prompt": "x", "temperature": 1e999}', 400, "temperature", None),
    ("n-huge", "/v1/completions", {"prompt": "x", "n": BIG}, 400, "n", None),
    ("n-negative", "/v1/chat/completions", {"messages": CHAT, "n": -3}, 400, "n", None),
    ("logprobs-negative", "/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs", None),
    ("max-tokens-huge", "/v1/completions", {"prompt": "x", "max_tokens": BIG}, 400, "max_tokens",
     "context_length_exceeded"),
    ("max-tokens-0-no-echo", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("token-id-negative", "/v1/completions", {"prompt": [3, -1]}, 400, "prompt", None),
    ("token-id-huge", "/v1/completions", {"prompt": [[3, BIG]]}, 400, "prompt", None),
    ("nested-mixed", "/v1/completions", {"prompt": [[3, "a"]]}, 400, "prompt", "invalid_type"),
    ("top-k-below", "/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", None),
    ("top-k-string", "/v1/completions", {"prompt": "x", "top_k": "5"}, 400, "top_k", "invalid_type"),
    ("min-p-over-1", "/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p", None),
    ("repetition-penalty-0", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty", None),
    ("min-tokens-negative", "/v1/completions", {"prompt": "x", "min_tokens": -1}, 400, "min_tokens", None),
    ("min-tokens-over-max", "/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens",
     None),
    ("frequency-penalty-huge", "/v1/chat/completions", {"messages": CHAT, "frequency_penalty": 1e9}, 400,
     "frequency_penalty", None),
    ("stop-token-out-of-vocab", "/v1/completions", {"prompt": "x", "stop_token_ids": [BIG]}, 400, "stop_token_ids",
     None),
    ("ignore-eos-int", "/v1/completions", {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos", "invalid_type"),
    ("vllm-beam-search", "/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search",
     "unknown_field"),
    ("vllm-guided-json", "/v1/chat/completions", {"messages": CHAT, "guided_json": {}}, 400, "guided_json",
     "unknown_field"),
    ("stream-options-without-stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options", None),
    ("chat-top-logprobs-too-many", "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50},
     400, "top_logprobs", None),
    ("chat-top-logprobs-negative", "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1},
     400, "top_logprobs", None),
    ("chat-content-number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages",
     "invalid_type"),
    ("json-null", "/v1/completions", b"null", 400, None, "invalid_type"),
    ("not-utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "invalid_json"),
    ("whitespace-body", "/v1/completions", b"   ", 400, None, "invalid_json"),
    ("detokenize-negative", "/detokenize", {"tokens": [-1]}, 400, "tokens", None),
    ("tokenize-both", "/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt", None),
    ("tokenize-extra", "/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus", "unknown_field"),
    # lone UTF-16 surrogates, low (\uDC00-\uDFFF) and high, everywhere text enters (issue #44: a low one gave 500)
    ("lone-low-surrogate", "/v1/completions", b'{"prompt": "\\udc00"}', 400, None, "invalid_json"),
    ("lone-high-surrogate-at-end", "/v1/completions", b'{"prompt": "a\\ud800"}', 400, None, "invalid_json"),
    ("surrogates-reversed", "/v1/completions", b'{"prompt": "\\udfff\\ud800"}', 400, None, "invalid_json"),
    ("chat-lone-low-surrogate", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\uDC00"}]}', 400, None, "invalid_json"),
    ("stop-lone-low-surrogate", "/v1/completions", b'{"prompt": "x", "stop": ["\\udc01"]}', 400, None,
     "invalid_json"),
    ("key-lone-low-surrogate", "/v1/completions", b'{"prompt": "x", "\\udc00": 1}', 400, None, "invalid_json"),
    ("tokenize-lone-low-surrogate", "/tokenize", b'{"prompt": "\\udc00"}', 400, None, "invalid_json"),
    ("tokenize-messages-lone-low-surrogate", "/tokenize",
     b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, None, "invalid_json"),
    # the smaller error texts of issue #44
    ("chat-message-without-role", "/v1/chat/completions", {"messages": [{}]}, 400, "messages", "missing_field"),
    ("chat-stray-prompt", "/v1/chat/completions", {"messages": CHAT, "prompt": "x"}, 400, "prompt",
     "unknown_field"),
    ("stop-1025-chars", "/v1/completions", {"prompt": "x", "stop": ["s" * 1025]}, 400, "stop", "invalid_value"),
    # the per-request work bound (--max-request-tokens: 4 x max_model_len = 4096 here; --max-n 128)
    ("work-n-256", "/v1/completions", {"prompt": "x", "n": 256, "max_tokens": 32}, 400, "n", "work_limit_exceeded"),
    ("work-n-128-x-64", "/v1/completions", {"prompt": "x", "n": 128, "max_tokens": 64}, 400, "max_tokens",
     "work_limit_exceeded"),
    ("work-100-prompts", "/v1/completions", {"prompt": ["x"] * 100, "max_tokens": 64}, 400, "max_tokens",
     "work_limit_exceeded"),
    ("work-echo-scoring", "/v1/completions", {"prompt": [[3] * 1000] * 5, "max_tokens": 0, "echo": True}, 400,
     "prompt", "work_limit_exceeded"),
    ("work-chat-n-8-whole-context", "/v1/chat/completions", {"messages": CHAT, "n": 8}, 400, "max_tokens",
     "work_limit_exceeded"),
    ("stop-1025-chars-alone", "/v1/chat/completions", {"messages": CHAT, "stop": "s" * 1025}, 400, "stop",
     "invalid_value"),
]


@pytest.mark.parametrize("path,body,status,param,code", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_naming_the_field(srv, path, body, status, param, code):
    r = _post(srv, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert param in err["message"] or err["code"] in ("invalid_type", "unknown_field", "context_length_exceeded")


def test_error_texts_name_the_nested_field(srv):
    """`messages: [{}]` names `messages.0.role` (not a missing `messages`); a stray `prompt` in chat is
    an unknown field, not a prompt-format error; a long stop string is too long, not too many."""
    err = _post(srv, "/v1/chat/completions", {"messages": [CHAT[0], {}]}).json()["error"]
    assert "'messages.1.role'" in err["message"], err
    err = _post(srv, "/v1/chat/completions", {"messages": CHAT, "prompt": "x"}).json()["error"]
    assert err["message"].startswith("unknown field 'prompt'"), err
    err = _post(srv, "/v1/completions", {"prompt": "x", "stop": "s" * 1025}).json()["error"]
    assert "1025 characters" in err["message"] and err["code"] != "too_many_items", err


def test_work_bound_names_its_flag_and_admits_what_fits(srv):
    err = _post(srv, "/v1/completions", {"prompt": "x", "n": 128, "max_tokens": 64}).json()["error"]
    assert "--max-request-tokens" in err["message"] and "4096" in err["message"], err
    err = _post(srv, "/v1/completions", {"prompt": "x", "n": 129, "max_tokens": 1}).json()["error"]
    assert "--max-n" in err["message"], err
    ok = _post(srv, "/v1/completions", {"prompt": [3] * 16, "n": 64, "max_tokens": 48})  # 64 x 64 = 4096: fits
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 64, ok.text


# Every field OpenAI (or vLLM, for its extensions) types as nullable: null means its default.
NULLABLE = {
    "/v1/completions": ("temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
                        "presence_penalty", "frequency_penalty", "logit_bias", "max_tokens", "logprobs", "echo",
                        "best_of", "suffix", "top_k", "min_p", "repetition_penalty", "stop_token_ids"),
    "/v1/chat/completions": ("temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
                             "presence_penalty", "frequency_penalty", "logit_bias", "max_tokens",
                             "max_completion_tokens", "logprobs", "top_logprobs", "top_k", "min_p",
                             "repetition_penalty", "stop_token_ids", "chat_template_kwargs"),
}


@pytest.mark.parametrize("path", list(NULLABLE))
def test_null_means_the_default(srv, path):
    """The openai client sends null for None (issue #44: temperature/top_p/n/... null gave 400)."""
    base = {"prompt": "still here"} if path == "/v1/completions" else {"messages": CHAT}
    base = {**base, "max_tokens": GEN, "seed": 7}
    want = _post(srv, path, base)
    assert want.status_code == 200, want.text
    nulls = {k: None for k in NULLABLE[path] if k not in base}
    got = _post(srv, path, {**base, **nulls})
    assert got.status_code == 200, got.text
    text = "text" if path == "/v1/completions" else "message"
    assert [c[text] for c in got.json()["choices"]] == [c[text] for c in want.json()["choices"]]
    # seed / max_tokens null: the defaults (a random seed; 16 tokens for completions)
    limit = {"max_tokens": None} if path == "/v1/completions" else {"max_completion_tokens": None}
    got = _post(srv, path, {**base, "seed": None, "temperature": None, **limit})
    assert got.status_code == 200, got.text


def test_boundary_values_are_served(srv):
    """The edges of every range are accepted (a check that the 400s above are not too eager)."""
    for body in ({"prompt": "x", "seed": 2**63 - 1, "temperature": 1, "max_tokens": 2},
                 {"prompt": "x", "seed": -2**63, "n": 2, "temperature": 1, "max_tokens": 2},
                 {"prompt": "x", "top_k": -1, "min_p": 1.0, "repetition_penalty": 1e6, "presence_penalty": -2,
                  "frequency_penalty": 2, "min_tokens": 2, "max_tokens": 2, "temperature": 1e30},
                 {"prompt": "x", "max_tokens": 0, "echo": True},
                 {"prompt": [3] * MAX_MODEL_LEN, "max_tokens": 0, "echo": True, "logprobs": 0}):
        r = _post(srv, "/v1/completions", body)
        assert r.status_code == 200, (body, r.text)
    r = _post(srv, "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 20, "max_tokens": 2,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_http_level_errors(srv):
    u = srv["url"]
    r = httpx.post(u + "/v1/completions", content=b'{"prompt": "x"}', headers={**H, "Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert "application/json" in r.json()["error"]["message"]
    r = httpx.post(u + "/v1/completions", data={"prompt": "x"}, headers=H)  # a form, as `curl -d` sends
    assert r.status_code == 415
    r = httpx.post(u + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}', headers=H)  # no type: JSON
    assert r.status_code == 200, r.text
    r = httpx.post(u + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}',
                   headers={**H, "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text
    assert httpx.get(u + "/v1/completions", headers=H).status_code == 405
    assert httpx.get(u + "/v2/nothing", headers=H).status_code == 404


def test_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(srv):
    """A string prompt longer than max_model_len tokens could cover is refused by its length in
    characters (the engine never sees it); just under the bound it is tokenized and refused by
    its token count. Chat messages and /tokenize likewise."""
    long = "a" * 900_000  # under the 1 MiB body limit, far over the character bound
    r = _post(srv, "/v1/completions", {"prompt": long, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["code"] == "context_length_exceeded" and "characters" in r.json()["error"]["message"]
    r = _post(srv, "/v1/completions", {"prompt": "a" * (MAX_MODEL_LEN + 1), "max_tokens": 1})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
    r = _post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = _post(srv, "/tokenize", {"prompt": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    _assert_serves(srv)


# ================================================================================ bodies
def test_large_bodies_get_413_and_others_keep_being_served(srv):
    """Oversized bodies (declared or chunked) get 413 while /health and completions go on; huge
    prompts under the limit do not stall the event loop either."""
    limit = BODY_LIMIT_MB << 20
    big = json.dumps({"prompt": "b" * (3 * limit)}).encode()
    r = _post(srv, "/v1/completions", big)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large" and "--max-body-mb" in r.json()["error"]["message"]

    def chunks():
        for _ in range(2 * limit // 65536 + 1):
            yield b" " * 65536  # no Content-Length: a chunked body

    r = httpx.post(srv["url"] + "/v1/completions", content=chunks(), headers={**H, "Content-Type": "application/json"},
                   timeout=TIMEOUT_S)
    assert r.status_code == 413, r.text

    stop = threading.Event()

    def flood(kind: int) -> list[int]:
        codes = []
        while not stop.is_set():
            body = big if kind == 0 else json.dumps({"prompt": "c" * (limit - 100), "max_tokens": 1}).encode()
            codes.append(_post(srv, "/v1/completions", body).status_code)
        return codes

    ref = srv["ref"]
    want = ref.generate([ref.encode("served")], SamplingParams(max_tokens=GEN))[0].text
    with ThreadPoolExecutor(4) as pool:
        floods = [pool.submit(flood, k % 2) for k in range(4)]
        try:
            time.sleep(0.3)
            worst = 0.0
            for _ in range(8):
                t0 = time.perf_counter()
                assert httpx.get(srv["url"] + "/health", timeout=10).status_code == 200
                worst = max(worst, time.perf_counter() - t0)
                r = _post(srv, "/v1/completions", {"prompt": "served", "max_tokens": GEN, "temperature": 0})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        finally:
            stop.set()
        codes = [c for f in floods for c in f.result()]
    assert codes and set(codes) <= {400, 413}, set(codes)
    assert worst < 3.0, f"/health took {worst:.2f} s while large bodies were being refused"


def test_tokenization_runs_off_the_event_loop(srv):
    """Requests that take seconds of tokenization (1023 prompts of 1000 characters, the last one
    too long, so each ends in a 400 after tokenizing everything) do not stall /health."""
    body = json.dumps({"prompt": ["t" * 1000] * 1023 + ["u" * (MAX_MODEL_LEN + 1)], "max_tokens": 1}).encode()
    assert len(body) < BODY_LIMIT_MB << 20
    with ThreadPoolExecutor(3) as pool:
        heavy = [pool.submit(_post, srv, "/v1/completions", body) for _ in range(3)]
        time.sleep(0.2)
        worst, polls = 0.0, 0
        while not all(f.done() for f in heavy):
            t0 = time.perf_counter()
            assert httpx.get(srv["url"] + "/health", timeout=30).status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            polls += 1
            time.sleep(0.02)
        for f in heavy:
            r = f.result()
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert worst < 1.0, f"/health took {worst:.2f} s while prompts were being tokenized"
    assert polls >= 3, "the heavy requests finished too fast to tell anything"


# ================================================================================ disconnects
def _abandon_non_streaming(srv, body, after_s=0.3):
    try:
        _post(srv, "/v1/completions", body, timeout=after_s)
    except httpx.TimeoutException:
        return
    raise AssertionError("the request finished before the client left; make it longer")


def test_non_streaming_disconnect_frees_the_slot(srv):
    before = _wait_idle(srv)
    body = {"prompt": "abandon me", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "n": 2}
    _abandon_non_streaming(srv, body)
    t0 = time.monotonic()
    after = _wait_idle(srv, timeout=5)
    freed_s = time.monotonic() - t0
    assert after["scheduler"]["aborted"] - before["scheduler"]["aborted"] == 2
    assert after["engine"]["finished"]["length"] == before["engine"]["finished"]["length"]  # none ran to its end
    # far fewer tokens than the 2 x LONG asked: decoding stopped when the client left
    assert after["engine"]["generated_tokens"] - before["engine"]["generated_tokens"] < LONG
    assert after["http"]["client_disconnects"] - before["http"]["client_disconnects"] == 1
    assert freed_s < 5
    _assert_serves(srv)


def test_disconnect_storm_streaming_and_not(srv):
    before = _wait_idle(srv)
    body = {"prompt": "storm", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}

    def streaming(_):
        with httpx.stream("POST", srv["url"] + "/v1/completions", json=dict(body, stream=True), headers=H,
                          timeout=TIMEOUT_S) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # one chunk, then hang up

    def plain(_):
        _abandon_non_streaming(srv, body, after_s=0.5)

    with ThreadPoolExecutor(2 * STORM) as pool:
        futs = [pool.submit(streaming, i) for i in range(STORM)] + [pool.submit(plain, i) for i in range(STORM)]
        for f in futs:
            f.result()
    assert httpx.get(srv["url"] + "/health", timeout=5).status_code == 200
    after = _wait_idle(srv, timeout=10)
    assert after["scheduler"]["aborted"] - before["scheduler"]["aborted"] == 2 * STORM
    assert after["engine"]["finished"]["length"] == before["engine"]["finished"]["length"]
    assert after["scheduler"]["errors"] == before["scheduler"]["errors"]
    assert after["http"]["client_disconnects"] - before["http"]["client_disconnects"] == 2 * STORM
    _assert_serves(srv)


# ================================================================================ conformance
def _sse(text: str) -> list[dict]:
    return [json.loads(e[6:]) for e in text.split("\n\n") if e and e != "data: [DONE]"]


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_text_offset_is_cumulative(srv, echo):
    body = {"prompt": "offsets of the whole text", "max_tokens": 12, "temperature": 0, "logprobs": 2, "n": 2,
            "echo": echo, "ignore_eos": True}
    whole = _post(srv, "/v1/completions", body).json()["choices"]
    chunks = _sse(_post(srv, "/v1/completions", dict(body, stream=True)).text)
    for c in whole:
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == c["index"]]
        offsets = [o for ch in mine if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
        assert offsets == c["logprobs"]["text_offset"]
        assert offsets == sorted(offsets) and len(set(offsets)) > 2
        gen_start = len("offsets of the whole text") if echo else 0
        assert offsets[len(offsets) - 12] == gen_start  # the first generated token starts after the echo


def test_vllm_sampling_extensions_over_http(srv):
    ref = srv["ref"]
    ids = ref.encode(PROMPT)
    cases = [dict(repetition_penalty=1.5), dict(top_k=1, temperature=2.0, seed=1), dict(min_p=0.2, temperature=1.0,
             seed=4), dict(min_tokens=5, presence_penalty=0.4, frequency_penalty=0.3, temperature=0.7, top_k=5,
                           seed=9)]
    for kw in cases:
        r = _post(srv, "/v1/completions", dict(prompt=PROMPT, max_tokens=10, **{"temperature": 0, **kw}))
        assert r.status_code == 200, r.text
        want = ref.generate([ids], SamplingParams(max_tokens=10, **{"temperature": 0, **kw}))[0]
        assert r.json()["choices"][0]["text"] == want.text, kw
    r = _post(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                            "repetition_penalty": 1.2, "min_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_concurrent_mixed_requests_equal_each_sent_alone(srv):
    """64 clients at once, completions and chat, streaming or not, greedy and seeded with vLLM's
    extensions, echo, logprobs, n > 1, stop strings: each answer equals the same request sent alone."""
    bodies = []
    for i in range(MIXED_CLIENTS):
        p = f"mixed {i}: " + "la " * (i % 4)
        kw = [dict(temperature=0), dict(temperature=0.9, seed=i, top_k=8, min_p=0.05),
              dict(temperature=0, repetition_penalty=1.4, min_tokens=3), dict(temperature=0.7, seed=i, n=2)][i % 4]
        if i % 3 == 0:
            bodies.append(("/v1/chat/completions", dict(messages=[{"role": "user", "content": p}], max_tokens=GEN,
                                                        logprobs=True, top_logprobs=2, stream=i % 2 == 0, **kw)))
        else:
            bodies.append(("/v1/completions", dict(prompt=p, max_tokens=GEN, logprobs=1, echo=i % 5 == 0,
                                                   stop=["zz"], stream=i % 2 == 0, **kw)))

    def answer(path_body):
        path, body = path_body
        r = _post(srv, path, body)
        assert r.status_code == 200, r.text
        if body.get("stream"):
            out = {}
            for ch in _sse(r.text):
                for c in ch["choices"]:
                    d = out.setdefault(c["index"], {"text": "", "lps": [], "finish": None})
                    d["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    lp = c.get("logprobs") or {}
                    d["lps"] += lp.get("token_logprobs") or [x["logprob"] for x in lp.get("content") or []]
                    d["finish"] = c["finish_reason"] or d["finish"]
            return out
        out = {}
        for c in r.json()["choices"]:
            lp = c["logprobs"] or {}
            out[c["index"]] = {"text": c.get("text", (c.get("message") or {}).get("content")),
                               "lps": lp.get("token_logprobs") or [x["logprob"] for x in lp.get("content") or []],
                               "finish": c["finish_reason"]}
        return out

    alone = [answer(b) for b in bodies]
    barrier = threading.Barrier(len(bodies))

    def together(b):
        barrier.wait(30)
        return answer(b)

    before = _stats(srv)
    with ThreadPoolExecutor(len(bodies)) as pool:
        crowd = list(pool.map(together, bodies))
    for (path, body), a, c in zip(bodies, alone, crowd):
        assert a.keys() == c.keys()
        for k in a:
            assert c[k]["text"] == a[k]["text"] and c[k]["finish"] == a[k]["finish"], (path, body)
            torch.testing.assert_close([x if x is not None else 0.0 for x in c[k]["lps"]],
                                       [x if x is not None else 0.0 for x in a[k]["lps"]], rtol=0, atol=1e-9)
    after = _stats(srv)
    assert after["scheduler"]["batches_over_1"] > before["scheduler"]["batches_over_1"]  # they were batched
    assert after["scheduler"]["errors"] == before["scheduler"]["errors"]


# ================================================================================ accounting, auth
def test_errors_are_counted_and_logged_with_request_id(srv):
    before = _stats(srv)["http"]
    rid = "hardening-rid-42"
    r = _post(srv, "/v1/completions", {"prompt": "x", "seed": 2**64}, headers={"X-Request-Id": rid})
    assert r.status_code == 400 and r.headers["x-request-id"] == rid
    assert httpx.get(srv["url"] + "/v1/models", timeout=10).status_code == 401  # no key
    r = httpx.post(srv["url"] + "/v1/completions", content=b"{}", headers={**H, "Content-Type": "text/plain"})
    assert r.status_code == 415 and len(r.headers["x-request-id"]) == 16  # a fresh id when none is given
    assert httpx.get(srv["url"] + "/nope", headers=H).status_code == 404
    after = _stats(srv)["http"]
    diff = {k: after["errors_by_status"].get(k, 0) - before["errors_by_status"].get(k, 0)
            for k in ("400", "401", "404", "415")}
    assert diff == {"400": 1, "401": 1, "404": 1, "415": 1}
    assert after["errors_by_code"]["invalid_api_key"] >= 1 and after["errors_by_code"]["unsupported_media_type"] >= 1
    assert after["errors"] - before["errors"] == 4
    deadline = time.monotonic() + 5
    while f"request {rid}: POST /v1/completions -> 400" not in srv["log"].read_text():
        assert time.monotonic() < deadline, srv["log"].read_text()[-2000:]
        time.sleep(0.1)


def test_lm_eval_remote_tokenizer_against_a_keyed_server(srv):
    """lm-eval's `tokenizer_backend=remote` (and `auto`'s probe) send the key given as
    `auth_token`: with it every tokenizer route works; without it the server says how."""
    pytest.importorskip("lm_eval")
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    ref = srv["ref"]
    base = srv["url"] + "/v1/completions"
    assert check_remote_tokenizer_support(base, auth_token=KEY)
    assert not check_remote_tokenizer_support(base, auth_token=None, max_retries=1)
    rt = RemoteTokenizer(base, auth_token=KEY)
    text = "The pass key is 12345."
    assert rt.encode(text) == ref.encode(text, add_special_tokens=False)
    assert rt.decode(rt.encode(text)) == text
    assert rt.eos_token == ref.tokenizer.eos_token and rt.eos_token_id in ref.eos_ids
    assert rt.apply_chat_template(CHAT) == ref.tokenizer.apply_chat_template(CHAT, tokenize=False,
                                                                            add_generation_prompt=True)
    r = httpx.get(srv["url"] + "/tokenizer_info", timeout=10)
    assert r.status_code == 401 and "auth_token" in r.json()["error"]["message"]
    assert httpx.get(srv["url"] + "/health", timeout=10).status_code == 200  # the one open route
