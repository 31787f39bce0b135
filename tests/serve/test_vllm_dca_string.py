"""Dual Chunk Attention and STRING inside vLLM's V1 engine through lcx's plugin (issue #77).

The plugin runs every registry method generically (`lcx.serve.vllm_plugin.method_attention`):
- DCA has no decode rule (three query rotations per key part), so its layers skip vLLM's rotary
  and cache UNROTATED keys; prefill, chunked prefill and every decode step (one query) call
  `DCA.attend` over the request's whole cache (the unbounded method's whole-cache path);
- STRING (overlap=False) has a window + side decode rule, so its layers keep vLLM's rotary (lcx's
  table) and cache keys rotated at their true positions; a decode step reads the last S keys as
  cached and re-rotates the older ones by -(S - W) (the query moved to p_q - S + W); STRING with
  `overlap=True` (the official prefill's form) has no rule and runs on the unrotated layout.

This module checks what tests/serve/test_vllm.py's registry grid (each method's first example,
a few keys per window) does not: the presets at the scale they run on a model (tiny-5m,
L0 = 256: `dca` = chunks of 192 with a local window of 16; `string` at 4 x L0 = S 337, W 128 and
the YaRN RoPE spec with STRING's attention factor), DCA's second example (w >= c) and STRING's
overlap form. In one vLLM worker process (`lcx.serve.vllm_plugin.score --cases`): vLLM's prompt
logprobs equal lcx's `Engine`'s within 1e-4 (float32) on prompts of 2-1000 tokens, vLLM's greedy
decode (paged cache, one query a step) gives the engine's tokens, and the method changes the
longest prompt's logprobs against plain vLLM (so the check can fail). The layout each method
takes is checked without vLLM (default tier).

A model whose config.json carries Qwen's `dual_chunk_attention_config` (a random-weight Qwen2
directory, no hub): vLLM 0.32's own Qwen2 class builds V0's dual-chunk rotary from it and fails
on the CPU ("Cannot access accelerator device"); through the plugin it serves with DCA by
default, as `lcx.load_model` loads it (`with_config_attention`; the key is kept from vLLM's
class), with a RoPE spec and no attention method still DCA, and `attention=causal` plain causal
attention: each equal to lcx's engine on the model as `lcx.load_model` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lcx import presets
from lcx.methods import method_from_dict
from lcx.methods.string import string
from lcx.serve.vllm_plugin import check_vllm_methods
from lcx.serve.vllm_plugin.config import keys_rotated, layer_plans, runs_lcx_attention
from lcx.serve.vllm_plugin.launch import run_score_worker

MODEL = "tiny-5m"
L0, HEAD_DIM = 256, 64  # tiny-5m's max_position_embeddings and head_dim
MAX_MODEL_LEN = 1024
TOL = 1e-4
PROMPT_LENS = (2, 63, 257, 517, 1000)  # through DCA's chunk boundaries (c = 176) and past STRING's S = 337
GEN = 6
GEN_PROMPTS = (3, 5)  # 257 and 1000 tokens: decode across chunks, past the shift
WORKER_TIMEOUT_S = 1800  # a hang guard (one vLLM start + ~10-40 s a case on 2 busy cores)

CASES = {
    "dca_preset": presets.config("dca", L0=L0, factor=4).to_dict(),
    "dca_w_ge_c": {"attention": {"type": "dca", "chunk_size": 7, "local_size": 4}},
    "string_preset": presets.config("string", L0=L0, factor=4).to_dict(),
    "string_overlap": {"attention": {"type": "string", "shifted_offset": 5, "local_value": 2, "overlap": True}},
}
# the cache layout the plugin picks for each (True: keys cached after RoPE, re-rotated by the rule)
ROTATED = {"dca_preset": False, "dca_w_ge_c": False, "string_preset": True, "string_overlap": False}


# A Qwen2 directory whose config asks for DCA (chunk_size 40, local window 8: chunks of 32): what each methods
# config serves in vLLM, and the lcx engine config it must equal (on the model as lcx loads it)
QWEN_DCA = {"chunk_size": 40, "local_size": 8, "original_max_position_embeddings": 256}
QWEN_CASES = {"qwen2_dca:as_loaded": {}, "qwen2_dca:causal": {"attention": {"type": "causal"}},
              "qwen2_dca:yarn": {"rope": {"rope_type": "yarn", "factor": 2}}}


def _qwen2_dca_dir(out: Path) -> Path:
    from transformers import AutoTokenizer

    from lcx.hf.models import tiny_model
    from lcx.models import resolve_source

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_model("qwen2", head_dim=HEAD_DIM, hidden_size=4 * HEAD_DIM, vocab_size=4096, bos_token_id=0,
                           eos_token_id=1, pad_token_id=2, max_position_embeddings=L0)
    model.config.dual_chunk_attention_config = dict(QWEN_DCA)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(resolve_source(MODEL)[1]).save_pretrained(out)
    return out


def test_config_dca_resolved_for_vllm(tmp_path):
    """The overrides carry DCA from a model's `dual_chunk_attention_config` when no attention
    method is given (with a RoPE spec too), nothing with `attention=causal`, and a method given."""
    from transformers import AutoConfig

    from lcx.serve.vllm_plugin import hf_overrides
    from lcx.serve.vllm_plugin.config import methods_from_hf_config

    config = AutoConfig.from_pretrained(_qwen2_dca_dir(tmp_path / "q"))
    dca_dict = {"type": "dca", "chunk_size": 40, "local_size": 8}
    assert hf_overrides(config, None)["lcx_methods"] == {"attention": dca_dict}
    assert hf_overrides(config, {})["lcx_methods"] == {"attention": dca_dict}
    assert hf_overrides(config, {"attention": {"type": "causal"}})["lcx_methods"] == {}
    yarn = hf_overrides(config, {"rope": {"rope_type": "yarn", "factor": 2}})["lcx_methods"]
    assert yarn["attention"] == dca_dict and yarn["rope"]["rope_type"] == "yarn"
    sinks = {"type": "sinks", "n_sink": 2, "window": 8}
    assert hf_overrides(config, {"attention": sinks})["lcx_methods"] == {"attention": sinks}
    # the lcx class run without lcx's overrides (no lcx_methods in the config): the config's DCA
    assert methods_from_hf_config(config).attention.to_dict() == dca_dict


def test_presets_are_the_scale_this_module_claims():
    assert CASES["dca_preset"] == {"attention": {"type": "dca", "chunk_size": 192, "local_size": 16}}
    s = CASES["string_preset"]
    assert method_from_dict(s["attention"]) == string(337, 128)  # S = int(0.33 * 1024), W = 128
    assert s["rope"]["rope_type"] == "yarn" and s["rope"]["factor"] == 2.68


@pytest.mark.parametrize("name", list(CASES))
def test_layout_the_plugin_takes(name):
    """DCA (no decode rule) and STRING with overlap: unrotated keys, the rotary skipped; STRING:
    keys after RoPE (lcx's table with the spec's attention factor) and its window + side rule."""
    from transformers import AutoConfig

    from lcx.models import resolve_source

    hf_config = AutoConfig.from_pretrained(resolve_source(MODEL)[1])
    assert (hf_config.max_position_embeddings, hf_config.head_dim) == (L0, HEAD_DIM)
    methods = check_vllm_methods(CASES[name], hf_config)
    assert runs_lcx_attention(methods)
    assert keys_rotated(methods) is ROTATED[name]
    plans = layer_plans(hf_config, methods)
    assert all(p.method == methods.attention and p.rotated is ROTATED[name] for p in plans)
    assert all((p.rope is not None) is ROTATED[name] for p in plans)  # the rotary swapped in, or skipped


# ------------------------------------------------------------------ inside vLLM


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from lcx.models import resolve_source

    return resolve_source(MODEL)[1]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from lcx.models import load_model

    _, tok = load_model(MODEL)
    text = tok("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet "
               "is the sun.")["input_ids"]
    g = torch.Generator().manual_seed(77)
    out = [text]
    for n in PROMPT_LENS:
        ids = (text * (n // len(text) + 1))[:n]
        noise = torch.randint(3, 4096, (n,), generator=g).tolist()
        out.append([t if i % 7 else r for i, (t, r) in enumerate(zip(ids, noise))])
    return out


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return _qwen2_dca_dir(tmp_path_factory.mktemp("qwen2-dca") / "model")


@pytest.fixture(scope="module")
def vllm_runs(model_dir, qwen_dir, prompts, tmp_path_factory, vllm_python) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("vllm-dca-string")
    qwen = qwen_dir
    cases = {"plain": {"model": str(model_dir), "methods": None},
             **{n: {"model": str(model_dir), "methods": d} for n, d in CASES.items()},
             **{n: {"model": str(qwen), "methods": d} for n, d in QWEN_CASES.items()},
             "qwen2_dca:plain_vllm": {"model": str(qwen), "methods": None}}
    (tmp / "cases.json").write_text(json.dumps(cases))
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    args = ["--cases", str(tmp / "cases.json"), "--prompts", str(tmp / "prompts.json"),
            "--max-model-len", str(MAX_MODEL_LEN), "--gen", str(GEN)]
    return run_score_worker(args, tmp, timeout_s=WORKER_TIMEOUT_S)["cases"]


def _max_diff(a, b) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(CASES))
def test_vllm_equals_lcx_engine(name, model_dir, prompts, vllm_runs):
    from lcx.engine import Engine, EngineConfig, SamplingParams

    case, plain = vllm_runs[name], vllm_runs["plain"]
    assert "error" not in case, f"{name}: the vLLM worker refused or failed: {case.get('error')}"
    assert "error" not in plain, plain.get("error")
    engine = Engine.from_pretrained(str(model_dir), EngineConfig(max_model_len=MAX_MODEL_LEN, max_batch=1,
                                                                 methods=CASES[name]), dtype="float32")
    outs = engine.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    want = [[t.logprob for t in o.prompt_logprobs[1:]] for o in outs]
    diff = _max_diff(case["logprobs"], want)
    print(f"{name}: max |vLLM - Engine| prompt logprob {diff:.1e}")
    assert diff < TOL, f"{name}: vLLM + plugin vs lcx's Engine ({diff:.2e})"
    outs = engine.generate([prompts[i] for i in GEN_PROMPTS],
                           SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True))
    assert [case["generated"][i] for i in GEN_PROMPTS] == [o.token_ids for o in outs], f"{name}: greedy"
    # the method changes the longest prompt's logprobs: the comparison above can fail
    assert _max_diff(case["logprobs"][-1:], plain["logprobs"][-1:]) > 1e-2


def _engine_logprobs_and_greedy(engine, prompts):
    from lcx.engine import SamplingParams

    outs = engine.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    lps = [[t.logprob for t in o.prompt_logprobs[1:]] for o in outs]
    outs = engine.generate([prompts[i] for i in GEN_PROMPTS],
                           SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True))
    return lps, [o.token_ids for o in outs]


@pytest.mark.vllm
def test_dca_config_model_serves_with_dca(prompts, qwen_dir, vllm_runs):
    """The Qwen2 directory with `dual_chunk_attention_config`: plain vLLM cannot load it on the
    CPU; through the plugin each methods config equals lcx's engine on the model as
    `lcx.load_model` loads it (DCA applied) with the same methods config, and DCA changes the
    long prompts' logprobs against `attention=causal` (so the comparison can fail)."""
    from lcx.engine import Engine, EngineConfig
    from lcx.models import load_model

    assert "Cannot access accelerator" in vllm_runs["qwen2_dca:plain_vllm"].get("error", ""), \
        "plain vLLM now loads a dual_chunk_attention_config model: say so in docs/vllm.md"
    for name, methods in QWEN_CASES.items():
        case = vllm_runs[name]
        assert "error" not in case, f"{name}: {case.get('error')}"
        assert case["overrides"]["lcx_methods"].get("attention", {}).get("type") == \
            (None if "causal" in name else "dca"), case["overrides"]
        model, tok = load_model(str(qwen_dir))
        engine = Engine(model, tok, EngineConfig(max_model_len=MAX_MODEL_LEN, max_batch=1, methods=methods))
        lps, greedy = _engine_logprobs_and_greedy(engine, prompts)
        diff = _max_diff(case["logprobs"], lps)
        print(f"{name}: max |vLLM - Engine| prompt logprob {diff:.1e}")
        assert diff < TOL, f"{name}: vLLM + plugin vs lcx's Engine ({diff:.2e})"
        assert [case["generated"][i] for i in GEN_PROMPTS] == greedy, f"{name}: greedy"
    as_loaded, causal = vllm_runs["qwen2_dca:as_loaded"], vllm_runs["qwen2_dca:causal"]
    assert _max_diff(as_loaded["logprobs"][-2:], causal["logprobs"][-2:]) > 1e-2
