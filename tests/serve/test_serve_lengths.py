"""Long prompts by default where the method allows them, and no silent truncation through lm-eval
(issue #44, items 2 and 3).

- `lcx.serve.lengths.default_max_model_len` for every attention method of the registry: a method
  whose queries see a bounded set of keys (read from the method: `MethodConfig.kv_window`) gets the
  memory-derived limit, beyond the model's context; the others keep the engine's default (the
  model's context, x the RoPE factor);
- a server with a bounded method and no `--max-model-len` serves a prompt 3x the model's context
  with the tokens of an engine given the length explicitly; `/v1/models` states the limit and how
  it was derived, `lcx serve --help` the rule; a vanilla server's context-length 400s name
  `--max-model-len`;
- lm-eval's `local-completions` (which left-truncates to 2,047 tokens unless `max_length=` is
  given) sends a prompt above 2,048 tokens whole, as the docs' recipe runs it: the server's /stats
  shows the longest prompt it received.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from lcx.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from lcx.method_config import MethodConfig  # noqa: E402
from lcx.methods import ATTENTION_METHODS  # noqa: E402
from lcx.serve import lengths  # noqa: E402

from _servers import lcx_serve, wait_healthy  # noqa: E402


L0 = 128  # the tiny test model's context
GiB = 1 << 30
METHODS = {f"{name}-{i}": {"type": name, **dict(e)}
           for name, cls in ATTENTION_METHODS.items() for i, e in enumerate(cls.examples)}


@pytest.mark.parametrize("method", list(METHODS))
def test_default_length_follows_the_method(method, tiny_model):
    model, _ = tiny_model
    cfg = MethodConfig.from_dict({"attention": METHODS[method]})
    limit, how = lengths.default_max_model_len(model, cfg, memory=GiB)
    if cfg.kv_window is None:
        assert limit is None and "max_position_embeddings 128" in how
        return
    per_token = lengths.prompt_token_bytes(model.config, 4)
    assert limit == min(lengths.MAX_BOUNDED_LEN, int(lengths.MEMORY_FRACTION * GiB) // per_token) > L0
    assert "bounded" in how and "--max-model-len" in how
    # little memory: never below the model's context
    assert lengths.default_max_model_len(model, cfg, memory=1)[0] == L0


def test_rope_scaling_keeps_its_length(tiny_model):
    model, _ = tiny_model
    limit, how = lengths.default_max_model_len(model, MethodConfig.from_dict({"rope": {"rope_type": "yarn",
                                                                                       "factor": 4}}))
    assert limit is None and "512" in how  # the engine's L0 x factor
    both = MethodConfig.from_dict({"rope": {"rope_type": "yarn", "factor": 4},
                                   "attention": {"type": "sliding_window", "window": 64}})
    assert lengths.default_max_model_len(model, both, memory=1)[0] == 4 * L0  # at least L0 x factor


def test_help_states_the_rule():
    from lcx.serve.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    text = " ".join(p.format_help().split())
    assert " ".join(lengths.RULE.split()) in text


def _app(model_dir, methods, max_model_len=None):
    from fastapi.testclient import TestClient

    from lcx.serve.app import create_app

    eng, how = lengths.build_engine(str(model_dir), EngineConfig(methods=methods, max_model_len=max_model_len),
                                    dtype="float64")
    return TestClient(create_app(eng, model_name="m", batch_window_s=0, max_model_len_source=how)), eng


def test_bounded_method_serves_past_the_context_by_default(tiny_model_dir):
    methods = {"attention": {"type": "lm_infinite", "n_global": 4, "n_local": L0}}
    ref = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(methods=methods, max_model_len=8 * L0),
                                 dtype="float64")
    ids = (ref.encode("It is the east, and Juliet is the sun. ") * 20)[:3 * L0]
    want = ref.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0].text
    client, eng = _app(tiny_model_dir, methods)
    with client:
        card = client.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == eng.max_model_len > 3 * L0
        assert "bounded" in card["lcx_max_model_len_source"]
        r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want


def test_context_length_errors_name_the_flag(tiny_model_dir):
    client, eng = _app(tiny_model_dir, None)
    assert eng.max_model_len == L0
    with client:
        assert "max_position_embeddings" in client.get("/v1/models").json()["data"][0]["lcx_max_model_len_source"]
        for path, body in [("/v1/completions", {"prompt": [5] * (L0 + 1)}),  # token ids: the body check
                           ("/v1/completions", {"prompt": "ab" * L0}),  # text: the engine's check
                           ("/v1/completions", {"prompt": "ab", "max_tokens": L0}),
                           ("/v1/completions", {"prompt": "x" * (10 * L0 * 64)}),  # the character bound
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab" * L0}]}),
                           ("/tokenize", {"prompt": "x" * (10 * L0 * 64)}),
                           ("/detokenize", {"tokens": [5] * (L0 + 1)})]:
            r = client.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert "--max-model-len" in r.json()["error"]["message"], (path, r.json())


# ================================================================================ lm-eval (item 3)
LONG = 2304  # a passkey length above lm-eval's default max_length (2048: prompts cut to 2,047 tokens)


@pytest.mark.slow  # a server + lm_eval: ~40-90 s on 2 cores
def test_lm_eval_recipe_sends_long_prompts_whole(tiny_model_dir, tmp_path):
    """docs/serving.md's lm-eval recipe at a length above 2,048: the server receives the whole
    prompt (its /stats), whether or not `max_length=` is given (lcx's lm-eval hook asks the server
    for its max_model_len when it is not)."""
    pytest.importorskip("lm_eval")
    log = tmp_path / "server.log"
    with lcx_serve(tiny_model_dir, log, "--served-model-name", "tiny", "--max-model-len", "4096", "--threads", "1",
                   "--max-batch", "4") as (url, proc):
        wait_healthy(url, proc, log)
        out = tmp_path / "lmeval"
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"model=tiny,base_url={url}/v1/completions,tokenizer={tiny_model_dir},tokenizer_backend=huggingface,"
               "num_concurrent=2,max_retries=1", "--tasks", "passkey_ll", "--limit", "1",
               "--metadata", json.dumps({"max_seq_lengths": [LONG]}), "--output_path", str(out)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        assert "max_length=4096, the server's max_model_len" in p.stderr
        longest = httpx.get(f"{url}/stats", timeout=10).json()["prompts"]["longest"]
        assert 2048 < longest <= LONG, longest


def test_hook_reads_the_servers_length(tiny_model_dir):
    """`server_max_model_len` reads /v1/models (with the key); None for a server that does not answer."""
    from fastapi.testclient import TestClient  # noqa: F401 (fastapi present)

    from lcx._lmeval_hook import server_max_model_len

    log_dir = tiny_model_dir.parent
    with lcx_serve(tiny_model_dir, log_dir / "hook-server.log", "--api-key", "k", "--no-engine-process",
                   "--threads", "1", "--max-model-len", "300") as (url, proc):
        wait_healthy(url, proc, log_dir / "hook-server.log")
        assert server_max_model_len(f"{url}/v1/completions", "k") == 300
        assert server_max_model_len(f"{url}/v1/completions", "wrong") is None
    assert server_max_model_len("http://127.0.0.1:9/v1/completions", timeout=1) is None
