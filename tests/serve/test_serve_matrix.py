"""Every method config serves, by construction (issue #44, item 1).

The matrix: method configs generated from the registries × every entry point that takes a
method. A new RoPE type, attention method or preset joins it with no edit here (a RoPE type
with a required key this module has no example value for fails `test_every_rope_type_has_an_example`).

Configs (`CASES`, generated at import):
    rope-<type>       every type of `lcx.rope.ROPE_TYPES` (its required keys from `lcx.testing.example_rope_spec`,
                      a factor where it takes one)
    attention-<name>  every method of `lcx.methods.ATTENTION_METHODS` (its first `examples` entry)
    rope+attention    the first factor-taking RoPE type with the first bounded attention method
    preset-<name>     `lcx.presets` (one in the default tier, `REPRESENTATIVE_PRESET`; all in slow)
    methods-json      rope+attention given as `--methods JSON` instead of flags

Entry points (`ENTRY_POINTS`): `lcx.serve.create_app` over an in-process engine (the cheapest:
no process start), `lcx serve` (engine process, the default), `lcx serve --no-engine-process`,
`lm_eval --model lcx`, `lcx eval ppl`, `lcx report --method`; and `lcx serve --engine vllm` in
the vLLM tier (marker `vllm`). A server must start and answer a greedy completion with the tokens
of the in-process `lcx.engine.Engine` on the same weights and config (float64 both sides); the
eval entry points must exit 0 with finite numbers for the config they were given.

Models (`FAMILY_MODELS`): the tiny Llama, and a tiny Gemma 3 (hybrid local/global: q/k norms,
its own scaling, a sliding layer with its own window and RoPE base) on which every config runs
in-process in the default tier and rope+attention through the CLI entry points in the slow tier.

Tiers (on 2 shared cores a server start costs 6-25 s, `lm_eval` ~25-40 s):
    default  every config (presets: REPRESENTATIVE_PRESET) x `create_app`, and every config's
             pickle round trip (what the engine process's spawn does with it: the defect of
             issue #44 was a config that did not pickle); `rope+attention` x `lcx serve`, and
             `lcx serve --no-engine-process` with `methods-json`.
    slow     every config (presets too) x `create_app`; every RoPE type and attention method
             (`SLOW_SERVED`: not the presets, which compose the same parts) x `lcx serve`, the
             entry point whose process boundary broke in issue #44; `rope+attention` and
             a RoPE-only (`rope-yarn`) and an attention-only (`attention-lm_infinite`) config x
             the other CLI entry points (`lm_eval`, `lcx eval ppl`, `lcx report`). (The complete cross
             product is ~150 process starts, over an hour on 2 cores: `LCX_FULL_SERVE_MATRIX=1`.)
    vllm     `lcx serve --engine vllm`: every config the plugin refuses (refused before vLLM
             starts, naming why: seconds each) and the configs of `VLLM_SERVED` (a vLLM server
             start costs 1-2 min on 2 cores, so CI's vLLM step cannot start one per
             config); `LCX_VLLM_FULL_MATRIX=1` serves every config. The plugin's per-method
             parity (prompt logprobs against lcx's engine) is tests/serve/test_vllm.py's job.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from lcx import presets  # noqa: E402
from lcx.data.io import read_json  # noqa: E402
from lcx.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from lcx.method_config import MethodConfig  # noqa: E402
from lcx.methods import ATTENTION_METHODS  # noqa: E402
from lcx.rope import ROPE_TYPES  # noqa: E402
from lcx.testing import example_rope_spec  # noqa: E402

from _servers import lcx_serve, wait_healthy  # noqa: E402


L0 = 128  # the tiny test model's context (tests/conftest.py tiny_model_dir)
HEAD_DIM = 16
FACTOR = 2.0
GEN = 8
PROMPT_TOKENS = 100  # fits every config's max_model_len (L0 for the vanilla RoPE types)
TIMEOUT_S = 120
REPRESENTATIVE_PRESET = "lm_infinite+yarn"


def _rope_spec(rope_type: str) -> dict:
    return example_rope_spec(rope_type, head_dim=HEAD_DIM, original_max_position_embeddings=L0, factor=FACTOR)


def _attention(name: str) -> dict:
    return {"type": name, **dict(ATTENTION_METHODS[name].examples[0])}


def _cases() -> dict[str, tuple[dict, str]]:
    """id -> (nested config dict, how it is passed: "flags" or "json")."""
    cases: dict[str, tuple[dict, str]] = {}
    for t in ROPE_TYPES:
        cases[f"rope-{t}"] = ({"rope": _rope_spec(t)}, "flags")
    for name in ATTENTION_METHODS:
        cases[f"attention-{name}"] = ({"attention": _attention(name)}, "flags")
    scaled = next(t for t in ROPE_TYPES if "factor" in ROPE_TYPES[t].required | ROPE_TYPES[t].optional)
    bounded = next(n for n, cls in ATTENTION_METHODS.items()
                   if any(cls(**e).cache_window is not None for e in cls.examples[:1]))
    combo = {"rope": _rope_spec(scaled), "attention": _attention(bounded)}
    cases["rope+attention"] = (combo, "flags")
    for name, p in presets.PRESETS.items():
        if p.siblings:  # runs on a sibling model trained with the method: not this tiny model's
            continue
        cases[f"preset-{name}"] = (presets.config(name, L0=L0, factor=FACTOR, n_layers=2).to_dict(), "flags")
    cases["methods-json"] = (combo, "json")
    return cases


CASES = _cases()
# the configs the vLLM tier serves by default: RoPE + attention, once by flags and once as JSON
# (each vLLM server start costs 1-2 min on 2 cores; which RoPE types and attention methods the
# plugin computes right, alone and composed, is tests/serve/test_vllm.py's parity grid, in one
# worker process); every config with LCX_VLLM_FULL_MATRIX=1
VLLM_SERVED = ("rope+attention", "methods-json")
# Dual Chunk Attention and STRING (issue #77: every entry point, `lcx serve` on both engines): the
# CLI entry points in the slow tier as LM-Infinite's, and served by vLLM in its tier (DCA on the
# unrotated layout, STRING on keys cached after RoPE)
ISSUE_77 = ("attention-dca", "attention-string")
VLLM_SERVED += ISSUE_77
DEFAULT_APP = [c for c in CASES if not c.startswith("preset-") or c == f"preset-{REPRESENTATIVE_PRESET}"]
ENTRY_POINTS = ("app", "serve", "serve-no-engine-process", "lm_eval", "eval-ppl", "report")


SLOW_SERVED = [c for c in CASES if c.startswith(("rope-", "attention-"))]


def _tier(case: str, entry: str) -> str | None:
    """Which tier runs (case, entry): "default", "slow" or None (module docstring)."""
    if entry == "app":
        return "default" if case in DEFAULT_APP else "slow"
    if entry == "serve-no-engine-process" and case == "methods-json":
        return "default"
    if entry != "serve-no-engine-process" and case == "rope+attention":
        # through `lcx serve` by default (in process: above); the other CLIs (a subprocess each, 10-30 s) slow
        return "default" if entry == "serve" else "slow"
    if (entry == "serve" and case in SLOW_SERVED) or case in ("rope-yarn", "attention-lm_infinite") + ISSUE_77:
        return "slow"
    return "slow" if os.environ.get("LCX_FULL_SERVE_MATRIX") == "1" else None


# The same matrix on a second family, a hybrid local/global one (tests/conftest.py tiny_gemma3_dir:
# Gemma 3's q/k norms, scaling, per-layer windows and RoPE bases): every config in-process (the
# combined ones, rope+attention and methods-json, in the default tier; the rest slow), the CLI entry
# points with rope+attention in the slow tier.
FAMILY_MODELS = {"llama": "tiny_model_dir", "gemma3_text": "tiny_gemma3_dir"}


def _family_tier(family: str, case: str, entry: str) -> str | None:
    if family == "llama":
        return _tier(case, entry)
    if entry == "app":  # the second family: the combined configs by default, the rest slow
        return "default" if case in ("rope+attention", "methods-json") else "slow"
    return "slow" if case == "rope+attention" and entry != "serve-no-engine-process" else None


MATRIX = [pytest.param(f, c, e, id=f"{e}-{c}" + ("" if f == "llama" else f"-{f}"),
                       marks=() if t == "default" else pytest.mark.slow)
          for f in FAMILY_MODELS for e in ENTRY_POINTS for c in CASES if (t := _family_tier(f, c, e)) is not None]


def _flags(d: dict, how: str) -> list[str]:
    """The method flags of `lcx serve` / `lcx eval ppl` for config `d` (`how`: flags or --methods JSON)."""
    if how == "json":
        return ["--methods", json.dumps(d)]
    from lcx.method_config import add_method_arguments

    import argparse
    p = argparse.ArgumentParser()
    add_method_arguments(p)
    known = {o for a in p._actions for o in a.option_strings}
    out: list[str] = []
    rope = dict(d.get("rope") or {})
    if rope:
        out += ["--rope", rope.pop("rope_type")]
        for k, v in rope.items():
            flag = "--" + k.replace("_", "-")
            out += [flag, json.dumps(v)] if flag in known else ["--rope-param", f"{k}={json.dumps(v)}"]
    att = dict(d.get("attention") or {})
    if att:
        out += ["--attention", att.pop("type")]
        for k, v in att.items():
            out += ["--" + k.replace("_", "-"), json.dumps(v)]
    for k, flag in (("backend", "--attn-backend"), ("decode_backend", "--attn-decode-backend")):
        if d.get(k) is not None:
            out += [flag, d[k]]
    return out


def _env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")


def _run(cmd: list[str], log: Path, timeout: float = 600) -> None:
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), timeout=timeout).returncode
    assert rc == 0, f"{' '.join(cmd)} exited {rc}:\n{log.read_text()[-3000:]}"


# ================================================================================ configs
def test_every_rope_type_has_an_example():
    for t in ROPE_TYPES:
        example_rope_spec(t, head_dim=HEAD_DIM, original_max_position_embeddings=L0)  # raises naming a missing key


@pytest.mark.parametrize("case", list(CASES))
def test_config_pickles_equal(case):
    """The config crosses process boundaries (the engine process, lm-eval workers) intact."""
    cfg = MethodConfig.from_dict(CASES[case][0])
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and hash(back) == hash(cfg) and back.to_dict() == cfg.to_dict()
    assert EngineConfig(methods=back) == EngineConfig(methods=cfg)


# ================================================================================ the matrix
@pytest.fixture(scope="module")
def ref_engines(request):
    """(family, config id) -> the in-process engine (float64) on the server's weights."""
    cache: dict[tuple[str, str], Engine] = {}

    def get(family: str, case: str) -> Engine:
        if (family, case) not in cache:
            model = request.getfixturevalue(FAMILY_MODELS[family])
            cache[family, case] = Engine.from_pretrained(str(model), EngineConfig(methods=CASES[case][0]),
                                                         dtype="float64")
        return cache[family, case]

    return get


def _prompt(eng: Engine) -> list[int]:
    text = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 3
    return eng.encode(text)[:PROMPT_TOKENS]


def _check_server(client, ref: Engine, case: str) -> None:
    """The server behind `client` answers a greedy completion with `ref`'s tokens and shows the
    config in its model card."""
    ids = _prompt(ref)
    want = ref.generate([ids], SamplingParams(max_tokens=GEN, ignore_eos=True))[0]
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": GEN, "temperature": 0,
                                             "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [ref.token_str(t) for t in want.token_ids], case
    card = client.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] >= PROMPT_TOKENS + GEN
    asked = MethodConfig.from_dict(CASES[case][0]).to_dict()
    if "attention" in asked:
        assert card["lcx_methods"]["attention"] == asked["attention"]
    if "rope" in asked:
        assert card["lcx_methods"]["rope"]["rope_type"] == asked["rope"]["rope_type"]


@pytest.mark.parametrize("family,case,entry", MATRIX)
def test_method_config_runs_through_entry_point(family, case, entry, request, ref_engines, tmp_path):
    d, how = CASES[case]
    log = tmp_path / f"{entry}.log"
    model = str(request.getfixturevalue(FAMILY_MODELS[family]))
    if entry == "app":
        from fastapi.testclient import TestClient

        from lcx.serve.app import create_app

        eng = Engine.from_pretrained(model, EngineConfig(methods=d), dtype="float64")
        with TestClient(create_app(eng, model_name="m", batch_window_s=0)) as client:
            _check_server(client, ref_engines(family, case), case)
        return
    if entry.startswith("serve"):
        extra = ["--no-engine-process"] if entry == "serve-no-engine-process" else []
        with lcx_serve(model, log, "--dtype", "float64", "--threads", "1", "--batch-window-ms", "0", *extra,
                       *_flags(d, how)) as (url, proc):
            wait_healthy(url, proc, log)
            with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
                _check_server(client, ref_engines(family, case), case)
        return
    if entry == "eval-ppl":
        out = tmp_path / "ppl.json"
        _run([sys.executable, "-m", "lcx.cli", "eval", "ppl", "--model", model, "--lengths", "64",
              "--max-tokens", "128", "--threads", "1", "--no-progress", "--out", str(out), *_flags(d, how)], log)
        text = out.read_text()
        nlls = [float(x) for x in _numbers(json.loads(text), "nll")]
        assert nlls and all(math.isfinite(x) for x in nlls), text[:500]
        return
    if entry == "report":
        out = tmp_path / "report"
        spec = json.dumps(d) if how == "json" else MethodConfig.from_dict(d).to_model_args()
        _run([sys.executable, "-m", "lcx.cli", "report", "--model", model, "--presets", "none",
              "--method", f"m={spec}", "--lengths", "320", "--decode-lengths", "none", "--depths", "1",
              "--samples-per-depth", "1", "--ppl-docs", "1", "--threads", "1", "--out", str(out)], log)
        rep = read_json(out / "report.json.gz")
        resolved = rep["config"]["methods_resolved"]
        assert list(resolved) == ["m"], resolved
        got = {k: v for k, v in resolved["m"].items() if v is not None}
        assert MethodConfig.from_dict(got) == MethodConfig.from_dict(d), (resolved["m"], d)  # the config given
        cell = rep["results"]["m"]["lmeval"]["320"]
        ppl = cell["ppl"]["word_perplexity"]
        assert 0 <= cell["passkey"] <= 1 and cell["passkey_docs"] == 1, cell
        assert math.isfinite(ppl) and ppl > 1, cell["ppl"]
        return
    if entry == "lm_eval":
        out = tmp_path / "lm_eval"
        args = ",".join(filter(None, [f"pretrained={model}", "dtype=float64",
                                      MethodConfig.from_dict(d).to_model_args()]))
        _run([sys.executable, "-m", "lm_eval", "--model", "lcx", "--model_args", args, "--tasks", "lcx_ppl",
              "--metadata", json.dumps({"max_seq_lengths": [64]}), "--limit", "1", "--output_path", str(out)], log)
        res = json.loads(next(out.rglob("results_*.json")).read_text())
        bpb = res["results"]["lcx_ppl"]["bits_per_byte_64,none"]
        assert math.isfinite(bpb) and bpb > 0, res["results"]
        return
    raise AssertionError(entry)


def _numbers(obj, key: str):
    """Every value under `key` anywhere in a JSON object."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key and isinstance(v, (int, float)):
                yield v
            else:
                yield from _numbers(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v, key)


# ================================================================================ vLLM tier
def test_vllm_served_configs_are_in_the_matrix():
    assert set(VLLM_SERVED) <= set(CASES), sorted(set(VLLM_SERVED) - set(CASES))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_method_config_runs_through_vllm(case, tmp_path, vllm_python):
    """`lcx serve --engine vllm` with every config: the plugin's configs start and answer with the
    in-process engine's greedy tokens (tiny-5m, head_dim 64 as vLLM's CPU attention needs, float32);
    a config the plugin refuses is refused before vLLM starts, naming why."""
    from lcx.serve.vllm_plugin import check_vllm_methods
    from lcx.models import load_model

    d, how = CASES[case]
    model, tok = load_model("tiny-5m")
    try:
        check_vllm_methods(d, model.config)
        refused = None
    except ValueError as e:
        refused = str(e)
    log = tmp_path / "vllm.log"
    if refused is None and case not in VLLM_SERVED and os.environ.get("LCX_VLLM_FULL_MATRIX") != "1":
        pytest.skip(f"served only with LCX_VLLM_FULL_MATRIX=1 (the default vLLM tier serves {VLLM_SERVED})")
    if refused is not None:
        cmd = [sys.executable, "-m", "lcx.cli", "serve", "--engine", "vllm", "--model", "tiny-5m", *_flags(d, how)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
        assert r.returncode != 0 and refused.split(";")[0][:40] in r.stderr, r.stderr[-2000:]
        return
    ref = Engine(model, tok, EngineConfig(methods=d, max_model_len=1024))
    with lcx_serve("tiny-5m", log, "--engine", "vllm", "--max-model-len", "1024", *_flags(d, how),
                   stop_timeout_s=60) as (url, proc):
        wait_healthy(url, proc, log, timeout_s=600)
        ids = _prompt(ref)
        want = ref.generate([ids], SamplingParams(max_tokens=GEN, ignore_eos=True))[0]
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-5m", "prompt": ids, "max_tokens": GEN,
                                                       "temperature": 0, "ignore_eos": True}, timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text, case
