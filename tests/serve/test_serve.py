"""lcx serve: real servers on 127.0.0.1 (a `lcx serve` subprocess, and uvicorn in a thread for
fault injection) driven by the official `openai` client, raw HTTP and lm-eval `local-completions`.

Every output is checked against the engine run in this process on the same weights (float64, so
batched and unbatched greedy decoding agree token for token).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from lcx.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

from _servers import free_port, lcx_serve, wait_healthy  # noqa: E402


MODEL = "tiny"  # --served-model-name
KEY = "test-key-123"
MAX_MODEL_LEN = 512
CLIENTS, PER_CLIENT = 32, 3  # load test
LOAD_PROMPTS = [f"client {i}: " + "lorem ipsum " * (i % 5) for i in range(12)]
GEN = 8
REQUEST_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """`lcx serve` on the tiny model, as a subprocess; yields its base URL, its log and `ref`,
    the engine on the same weights in this process (loaded while the server starts)."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with lcx_serve(tiny_model_dir, log, "--served-model-name", MODEL, "--api-key", KEY, "--max-model-len",
                   str(MAX_MODEL_LEN), "--max-batch", "32", "--dtype", "float64", "--threads", "1",
                   "--batch-window-ms", "20") as (url, proc):
        ref = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_model_len=MAX_MODEL_LEN), dtype="float64")
        wait_healthy(url, proc, log)
        yield {"url": url, "log": log, "ref": ref}


@pytest.fixture(scope="module")
def ref(server):
    """The engine on the server's weights, in this process: the expected outputs."""
    return server["ref"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, timeout=REQUEST_TIMEOUT_S, max_retries=0)


def _post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    return httpx.post(server["url"] + path, content=body, headers=headers, timeout=REQUEST_TIMEOUT_S, **kw)


def _stats(server) -> dict:
    r = httpx.get(server["url"] + "/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    r.raise_for_status()
    return r.json()


def _greedy(ref, prompt_ids, n=GEN, **kw):
    return ref.generate([prompt_ids], SamplingParams(max_tokens=n, **kw))[0]


def _chat_ids(ref, messages):
    text = ref.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return ref.encode(text, add_special_tokens=False)


def _assert_alive(server, client):
    r = client.completions.create(model=MODEL, prompt="ok", max_tokens=1, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


# -------------------------------------------------------------------------------- openai client
def test_completion(client, ref):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=GEN, temperature=0)
    want = _greedy(ref, ref.encode("Hello there"))
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == 11 and r.usage.completion_tokens == len(want.token_ids)
    assert r.model == MODEL and r.object == "text_completion"


def test_completion_batch_of_prompts_and_n(client, ref):
    prompts = ["abc", "defgh", "x"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=GEN, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:
        assert c.text == _greedy(ref, ref.encode(prompts[c.index // 2])).text


def test_stop_strings_and_seeded_sampling(client, ref):
    ids = ref.encode("stop here")
    full = _greedy(ref, ids, n=24, ignore_eos=True).text
    stop = next(full[i:i + 2] for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    r = client.completions.create(model=MODEL, prompt="stop here", max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"
    kw = dict(model=MODEL, prompt="sample", max_tokens=GEN, temperature=0.8, top_p=0.9, seed=11)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    want = ref.generate([ref.encode("sample")], SamplingParams(max_tokens=GEN, temperature=0.8, top_p=0.9,
                                                               seed=11))[0]
    assert a.choices[0].text == want.text


def test_chat(client, ref):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi!"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=GEN, temperature=0)
    want = _greedy(ref, _chat_ids(ref, messages))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(_chat_ids(ref, messages))


def test_streaming_completion(client, ref):
    stream = client.completions.create(model=MODEL, prompt="stream me", max_tokens=GEN, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = _greedy(ref, ref.encode("stream me"))
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [want.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_streaming_chat(client, ref):
    messages = [{"role": "user", "content": "stream please"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=GEN, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == _greedy(ref, _chat_ids(ref, messages)).text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_raw_sse_format(server):
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "sse", "max_tokens": 3, "temperature": 0,
                                          "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_logprobs(client, ref):
    r = client.completions.create(model=MODEL, prompt="logprobs", max_tokens=GEN, temperature=0, logprobs=3)
    want = _greedy(ref, ref.encode("logprobs"), logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(want.token_ids)
    torch.testing.assert_close(lp.token_logprobs, [e.logprob for e in want.logprobs], rtol=0, atol=1e-9)
    for top, e in zip(lp.top_logprobs, want.logprobs):
        assert 3 <= len(top) <= 4  # top-3 plus the chosen token
        assert max(top.values()) == pytest.approx(e.top[0][1], abs=1e-9)
    messages = [{"role": "user", "content": "chat logprobs"}]
    c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=GEN, temperature=0,
                                       logprobs=True, top_logprobs=2)
    want = _greedy(ref, _chat_ids(ref, messages), logprobs=2)
    content = c.choices[0].logprobs.content
    torch.testing.assert_close([t.logprob for t in content], [e.logprob for e in want.logprobs], rtol=0, atol=1e-9)
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_echo_prompt_logprobs_match_forward(server, ref):
    """What lm-eval's loglikelihood sends: token ids, echo, logprobs=1, max_tokens 1 (or 0)."""
    ids = ref.encode("The pass key is 12345.")
    with torch.no_grad():
        lp = torch.log_softmax(ref.model(torch.tensor([ids])).logits[0], -1)
    want = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    for max_tokens in (0, 1):
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": [ids], "max_tokens": max_tokens,
                                              "temperature": 0, "echo": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        tl = ch["logprobs"]["token_logprobs"]
        assert len(tl) == len(ids) + max_tokens and tl[0] is None
        torch.testing.assert_close(tl[1:len(ids)], want, rtol=0, atol=1e-9)
        assert ch["text"].startswith("The pass key is 12345.")


def test_streaming_echo_with_logprobs(server, ref):
    body = {"model": MODEL, "prompt": "echo me", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    r = _post(server, "/v1/completions", dict(body, stream=True))
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    assert chunks[0]["choices"][0]["text"] == "echo me"  # the prompt comes first
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    tl = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    torch.testing.assert_close(tl[1:], whole["logprobs"]["token_logprobs"][1:], rtol=0, atol=1e-12)


def test_client_disconnect_aborts_the_request(server):
    before = _stats(server)["scheduler"]["aborted"]
    body = {"model": MODEL, "prompt": "long", "max_tokens": MAX_MODEL_LEN - 10, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # one chunk, then hang up
    deadline = time.monotonic() + 30
    while _stats(server)["scheduler"]["aborted"] == before:
        assert time.monotonic() < deadline, "the server kept decoding for a client that left"
        time.sleep(0.1)


def test_requests_arriving_together_are_prefilled_together(server, client):
    before = _stats(server)["engine"]
    client.completions.create(model=MODEL, prompt=[f"p{i}" * (i + 1) for i in range(8)], max_tokens=2, temperature=0)
    after = _stats(server)["engine"]
    assert after["prefill_batches"] - before["prefill_batches"] == 1
    assert after["max_batch_size"] >= 8


def test_load_concurrent_clients(server, client, ref):
    """32 clients x 3 requests at once: every response complete and equal to the solo output;
    the scheduler decoded batches of more than one request."""
    want = {p: _greedy(ref, ref.encode(p), ignore_eos=True).text for p in LOAD_PROMPTS}
    before = _stats(server)
    barrier = threading.Barrier(CLIENTS)

    def worker(c: int) -> list[tuple[str, str, str]]:
        barrier.wait(30)
        out = []
        for k in range(PER_CLIENT):
            p = LOAD_PROMPTS[(c * PER_CLIENT + k) % len(LOAD_PROMPTS)]
            r = client.completions.create(model=MODEL, prompt=p, max_tokens=GEN, temperature=0,
                                          extra_body={"ignore_eos": True})
            out.append((p, r.choices[0].text, r.choices[0].finish_reason))
            assert r.usage.completion_tokens == GEN
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = [x for f in [pool.submit(worker, c) for c in range(CLIENTS)] for x in f.result()]
    wall = time.perf_counter() - t0
    assert len(results) == CLIENTS * PER_CLIENT
    for p, text, finish in results:
        assert finish == "length"
        assert text == want[p]
    after = _stats(server)
    done = after["scheduler"]["finished"] - before["scheduler"]["finished"]
    assert done == CLIENTS * PER_CLIENT
    assert after["scheduler"]["errors"] == before["scheduler"]["errors"]
    assert after["engine"]["max_batch_size"] > 1
    assert after["scheduler"]["batches_over_1"] > before["scheduler"]["batches_over_1"]
    assert "batch size" in server["log"].read_text()  # the scheduler logs batch changes
    print(f"load: {len(results)} requests in {wall:.1f} s; batch hist {after['engine']['batch_size_hist']}")


# -------------------------------------------------------------------------------- bad input
BAD = [
    # id, path, body, status, param, code
    ("malformed-json", "/v1/completions", b'{"prompt": "x", ', 400, None, "invalid_json"),
    ("empty-body", "/v1/completions", b"", 400, None, "invalid_json"),
    ("not-an-object", "/v1/completions", b"[1, 2]", 400, None, "invalid_type"),
    ("missing-prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt", None),
    ("max-tokens-string", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "invalid_type"),
    ("temperature-string", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("prompt-number", "/v1/completions", {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("prompt-mixed-list", "/v1/completions", {"prompt": [1, "a"]}, 400, "prompt", "invalid_type"),
    ("stream-int", "/v1/completions", {"prompt": "x", "stream": 1}, 400, "stream", "invalid_type"),
    ("negative-max-tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
    ("huge-max-tokens", "/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt-too-long", "/v1/completions", {"prompt": "a" * (MAX_MODEL_LEN + 1), "max_tokens": 0, "echo": True},
     400, "prompt",
     "context_length_exceeded"),
    ("unknown-model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("empty-prompt-list", "/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("token-out-of-vocab", "/v1/completions", {"prompt": [5, 100000]}, 400, "prompt", None),
    ("unknown-field", "/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unknown_field"),
    ("logprobs-too-many", "/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", None),
    ("top-p-zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("negative-temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("logit-bias-unsupported", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias",
     "unsupported_parameter"),
    ("penalty-out-of-range", "/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty",
     None),
    ("n-zero", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("chat-no-messages", "/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("chat-bad-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages",
     None),
    ("chat-zero-max-tokens", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                      "max_tokens": 0}, 400, "max_tokens", None),
    ("chat-top-logprobs-alone", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "top_logprobs": 2}, 400, "top_logprobs", None),
    ("stream-too-long", "/v1/completions", {"prompt": "b" * 600, "stream": True}, 400, "prompt",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("path,body,status,param,code", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, client, path, body, status, param, code):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    _assert_alive(server, client)


def test_api_key(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server["url"] + "/v1/completions", json={"prompt": "x"}, headers=headers, timeout=10)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server["url"] + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server["url"] + "/health", timeout=10).status_code == 200
    bad = openai.OpenAI(base_url=server["url"] + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    _assert_alive(server, client)


def test_tokenizer_endpoints(server, ref):
    h = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(server["url"] + "/tokenizer_info", headers=h, timeout=10).json()
    assert info["eos_token"] == ref.tokenizer.eos_token and info["chat_template"]
    assert info["model_max_length"] == MAX_MODEL_LEN
    toks = _post(server, "/tokenize", {"prompt": "héllo", "add_special_tokens": False}).json()["tokens"]
    assert toks == ref.encode("héllo", add_special_tokens=False)
    assert _post(server, "/detokenize", {"tokens": toks}).json()["prompt"] == "héllo"


# -------------------------------------------------------------------------------- worker failure
class _ThreadServer:
    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_healthy(self.url)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(15)


def test_engine_failure_on_one_request_gives_500_and_others_continue(tiny_model):
    from lcx.serve.app import create_app

    model, tok = tiny_model
    eng = Engine(model, tok, EngineConfig(max_batch=8))
    poison = tok("POISON", add_special_tokens=False)["input_ids"]
    orig = eng._sample

    def sample(s, logits, greedy=None):
        if s.prompt_ids == poison and len(s.out_ids) == 2:
            raise RuntimeError("injected failure")
        return orig(s, logits, greedy)

    eng._sample = sample
    good = {p: Engine(model, tok).generate([tok(p, add_special_tokens=False)["input_ids"]],
                                           SamplingParams(max_tokens=GEN, ignore_eos=True))[0].text
            for p in ("alpha", "beta", "gamma")}
    app = create_app(eng, model_name=MODEL, batch_window_s=0.05)
    with _ThreadServer(app) as srv:
        def call(p, stream=False):
            return httpx.post(srv.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
                "prompt": p, "max_tokens": GEN, "temperature": 0, "ignore_eos": True, "stream": stream})

        with ThreadPoolExecutor(4) as pool:
            futs = {p: pool.submit(call, p) for p in ("POISON", "alpha", "beta", "gamma")}
            res = {p: f.result() for p, f in futs.items()}
        assert res["POISON"].status_code == 500
        err = res["POISON"].json()["error"]
        assert err["type"] == "server_error" and "injected failure" in err["message"]
        for p in good:
            assert res[p].status_code == 200 and res[p].json()["choices"][0]["text"] == good[p]
        s = call("POISON", stream=True)  # mid-stream: an error event, then [DONE]
        events = [e for e in s.text.split("\n\n") if e]
        assert "injected failure" in json.loads(events[-2][6:])["error"]["message"]
        assert events[-1] == "data: [DONE]"
        assert call("alpha").json()["choices"][0]["text"] == good["alpha"]
        snap = app.state.scheduler.snapshot()
        assert snap["scheduler"]["errors"] == 2 and snap["engine"]["finished"]["error"] == 2
        http = httpx.get(srv.url + "/stats", timeout=10).json()["http"]  # both failures counted, by code
        assert http["errors_by_status"] == {"500": 2} and http["errors_by_code"] == {"engine_error": 2}


# -------------------------------------------------------------------------------- lm-eval
@pytest.mark.slow
def test_lm_eval_local_completions(server, tiny_model_dir, tmp_path):
    """lm-eval 0.4.13 `local-completions` against the server: passkey (generate_until, stop
    strings) and passkey_ll (loglikelihood: echo + logprobs)."""
    pytest.importorskip("lm_eval")
    out = tmp_path / "lmeval"
    before = _stats(server)["scheduler"]["finished"]
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
           f"model={MODEL},base_url={server['url']}/v1/completions,tokenizer={tiny_model_dir},"
           "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1",
           "--tasks", "passkey,passkey_ll", "--limit", "2", "--metadata", '{"max_seq_lengths": [320]}',
           "--output_path", str(out)]
    env = dict(os.environ, OPENAI_API_KEY=KEY, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    files = list(out.rglob("results_*.json"))
    assert files, p.stdout[-2000:]
    res = json.loads(files[0].read_text())["results"]
    for task in ("passkey", "passkey_ll"):
        acc = res[task]["320,none"]
        assert 0.0 <= acc <= 1.0
    assert _stats(server)["scheduler"]["finished"] - before >= 4  # 2 docs x 2 tasks reached the server


# -------------------------------------------------------------------------------- CLI
def test_cli_methods_and_errors(tiny_model_dir, capsys):
    """`lcx serve` flags: --rope flags become the `rope` method; unknown or doubly given methods
    fail before the model is loaded (exit 2, one line naming the problem)."""
    import argparse

    from lcx.cli import main
    from lcx.method_config import method_config_from_args
    from lcx.serve.cli import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--model", "m", "--rope", "yarn", "--factor", "4"])
    assert method_config_from_args(args).to_dict() == {"rope": {"rope_type": "yarn", "factor": 4.0}}
    assert method_config_from_args(ap.parse_args(["--model", "m"])).is_identity
    cases = [
        (["--methods", '{"lm_infinite": {}}'], "unknown method config key(s) ['lm_infinite']"),
        (["--methods", '{"attention": {"type": "lm_infinite", "n_global": 4, "n_local": 0}}'], "n_local must be >= 1"),
        (["--methods", '{"bogus": {}}'], "unknown method config key(s) ['bogus']"),
        (["--methods", "{oops"], "--methods is not valid JSON"),
        (["--methods", '{"rope": {"rope_type": "ntk", "factor": 2}}', "--rope", "yarn"], "both with --rope flags"),
        (["--max-batch", "0"], "max_batch must be a positive integer"),
    ]
    for extra, msg in cases:
        assert main(["serve", "--model", str(tiny_model_dir), *extra]) == 2
        assert msg in capsys.readouterr().err
