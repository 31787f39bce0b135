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
def vllm_runs(model_dir, prompts, tmp_path_factory, vllm_python) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("vllm-dca-string")
    cases = {"plain": {"model": str(model_dir), "methods": None},
             **{n: {"model": str(model_dir), "methods": d} for n, d in CASES.items()}}
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
