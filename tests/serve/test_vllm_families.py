"""lcx's vLLM plugin on every family it registers (`lcx.serve.vllm_plugin.config.FAMILIES`), Gemma 3 first.

The vLLM checks (marker `vllm`, CI's vLLM step; see tests/serve/test_vllm.py for how vLLM is
found): one tiny random checkpoint per family (`lcx.hf.models.tiny_model(family)` with vLLM's
CPU head size, saved with tiny-5m's tokenizer), every case of `CASES` run by ONE vLLM worker
process (`lcx.serve.vllm_plugin.score --cases`: vLLM's engine in-process, ~5 s a case), then per
case: vLLM's prompt logprobs equal lcx's engine's (`lcx.engine.Engine`) within TOL in float32 and
vLLM's greedy tokens (its paged-cache decode) equal the engine's; a method changes the long
prompt's logprobs against the model as loaded (the comparison can fail).

Grids, generated from the registries (a new RoPE type, attention method or family is run with
no edit here):
- Gemma 3 (hybrid: one sliding layer, window 24, RoPE base 1e3; one global layer, base 1e4;
  `query_pre_attn_scalar` 24, so vLLM's scale is not head_dim ** -0.5): the model as loaded
  (plain vLLM and the plugin without methods), every static RoPE type, every attention method's
  first example on the global layers (`layers="global"`, lcx.hf's default: windows of 3-5 keys,
  narrower than the sliding layer's own) and on every layer (`layers="all"`), and a composition;
- every other family: the model as loaded (through the plugin), the first example of a method on keys cached after
  RoPE composed with YaRN, the first example of a method on unrotated keys (SWAT) and of
  `sliding_window` (vLLM's own kernel, the window set by config or by the plugin).
Refusals, each a named error: length-dependent RoPE (the plugin refuses it for every family),
the model's own length-dependent RoPE under a method that needs its basis, families lcx leaves
out and families vLLM runs only through its Transformers backend (before vLLM starts), and a
layer whose vLLM attention has a term lcx's methods lack (attention sinks), inside vLLM.
The per-layer plan (`layer_plans`) and the refusals before vLLM run in the default tier.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from lcx.methods import examples, method_id
from lcx.rope import ROPE_TYPES
from lcx.serve.vllm_plugin import hf_overrides
from lcx.serve.vllm_plugin.config import (FAMILIES, LayerPlan, check_vllm_methods, keys_rotated, layer_plans,
                                          runs_lcx_attention)
from lcx.serve.vllm_plugin.launch import run_score_worker
from lcx.testing import example_rope_spec

MAX_MODEL_LEN = 512
CONTEXT = 256  # the tiny checkpoints' max_position_embeddings (the RoPE types' original length)
HEAD_DIM = 64  # vLLM's CPU attention takes head sizes 32, 64, 80, ... (not tiny_model's 16)
# tiny_model(family, **TINY) for every family; vocab and special tokens of tiny-5m's tokenizer
TINY = dict(head_dim=HEAD_DIM, hidden_size=4 * HEAD_DIM, vocab_size=4096, bos_token_id=0, eos_token_id=1,
            pad_token_id=2, max_position_embeddings=CONTEXT)
TINY_FAMILY = {"gemma3_text": dict(sliding_window=24),  # one sliding layer (window 24) + one global
               "phi3": dict(original_max_position_embeddings=CONTEXT),
               # Gemma 2: the same hybrid, and a logit cap low enough to matter on random weights (cap 1
               # moves lcx's engine's logprobs by 7e-3 against no cap, 70x TOL; Gemma 2's own 50 by 3e-6)
               "gemma2": dict(sliding_window=24, attn_logit_softcapping=1.0,
                              tie_word_embeddings=True)}  # vLLM's Gemma 2 has no lm_head of its own
PROMPT_LENS = (2, 63, 200, 500)  # short, a few windows, past the context (RoPE types matter)
GEN = 6
TOL = 1e-4  # |logprob_vllm - logprob_lcx|, float32
# a hang guard: the whole grid's worker took 437 s on a fresh 2-core machine (2026-12-02), CI's run 2-3x slower
WORKER_TIMEOUT_S = 3000
_TOKENIZER_PRESET = "tiny-5m"


def _first(name: str):
    return next(m for m in examples() if m.name == name)


def _runs_in_vllm(methods: dict, hf_config) -> bool:
    try:
        return not check_vllm_methods(methods, hf_config).is_identity
    except ValueError:
        return False


_REF_CONFIG = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                                    max_position_embeddings=CONTEXT)
FIRST_EXAMPLES = [_first(n) for n in dict.fromkeys(m.name for m in examples()) if n != "causal"]
STATIC_ROPE = {t: example_rope_spec(t, head_dim=HEAD_DIM, original_max_position_embeddings=CONTEXT)
               for t in sorted(ROPE_TYPES) if t != "default"}
STATIC_ROPE = {t: d for t, d in STATIC_ROPE.items() if _runs_in_vllm({"rope": d}, _REF_CONFIG)}
_ROTATED = next(m for m in FIRST_EXAMPLES
                if keys_rotated(check_vllm_methods({"attention": m.to_dict()}, _REF_CONFIG)))
_UNROTATED = next(m for m in FIRST_EXAMPLES if runs_lcx_attention(check_vllm_methods({"attention": m.to_dict()}, _REF_CONFIG))
                  and not keys_rotated(check_vllm_methods({"attention": m.to_dict()}, _REF_CONFIG)))


def _gemma3_cases() -> dict[str, dict | None]:
    cases: dict[str, dict | None] = {"plain": None, "vanilla": {}}
    cases.update({f"rope_{t}": {"rope": d} for t, d in STATIC_ROPE.items()})
    for m in FIRST_EXAMPLES:
        cases[method_id(m)] = {"attention": m.to_dict()}
        cases[f"{method_id(m)}@all"] = {"attention": m.to_dict(), "layers": "all"}
    cases["yarn_x2+lm_infinite_4_40"] = {"rope": {"rope_type": "yarn", "factor": 2},
                                         "attention": {"type": "lm_infinite", "n_global": 4, "n_local": 40}}
    return cases


def _family_cases() -> dict[str, dict | None]:
    return {"vanilla": {},
            f"yarn_x2+{method_id(_ROTATED)}": {"rope": {"rope_type": "yarn", "factor": 2},
                                               "attention": _ROTATED.to_dict()},
            method_id(_UNROTATED): {"attention": _UNROTATED.to_dict()},
            method_id(_first("sliding_window")): {"attention": _first("sliding_window").to_dict()}}


# "family:case" -> (model type, methods or None for plain vLLM): Gemma 3's grid, then each other family's.
CASES: dict[str, tuple[str, dict | None]] = {}
FULL_GRID = ("gemma3_text", "gemma2")  # the hybrids; Gemma 2's logit cap reaches every method's routes
for _f in sorted(FAMILIES.values(), key=lambda f: f.model_type not in FULL_GRID):
    for _name, _m in (_gemma3_cases() if _f.model_type in FULL_GRID else _family_cases()).items():
        CASES[f"{_f.model_type}:{_name}"] = (_f.model_type, _m)
# Refused inside vLLM: a Granite layer built with attention sinks (vLLM's per-head s_aux term).
REFUSED_IN_VLLM = {"granite_with_sinks:sinks": ("granite", dict(attention_sinks=True), {"attention": _ROTATED.to_dict()},
                                                "attention sinks")}


def _save_tiny(model_type: str, out: Path, **extra) -> Path:
    from transformers import AutoTokenizer

    from lcx.hf.models import tiny_model
    from lcx.models import resolve_source

    model = tiny_model(model_type, **TINY, **TINY_FAMILY.get(model_type, {}), **extra)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(resolve_source(_TOKENIZER_PRESET)[1]).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    out = {f.model_type: _save_tiny(f.model_type, root / f.model_type) for f in FAMILIES.values()}
    for name, (mt, extra, _, _) in REFUSED_IN_VLLM.items():
        out[name.split(":")[0]] = _save_tiny(mt, root / name.split(":")[0], **extra)
    return out


@pytest.fixture(scope="module")
def vllm_results(checkpoints, prompts, tmp_path_factory, vllm_python) -> dict[str, dict]:
    """Every case of CASES and REFUSED_IN_VLLM, run by one vLLM worker process."""
    tmp = tmp_path_factory.mktemp("vllm-families")
    cases = {name: {"model": str(checkpoints[mt]), "methods": m} for name, (mt, m) in CASES.items()}
    cases.update({name: {"model": str(checkpoints[name.split(":")[0]]), "methods": m}
                  for name, (_, _, m, _) in REFUSED_IN_VLLM.items()})
    (tmp / "cases.json").write_text(json.dumps(cases))
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    args = ["--cases", str(tmp / "cases.json"), "--prompts", str(tmp / "prompts.json"),
            "--max-model-len", str(MAX_MODEL_LEN), "--gen", str(GEN)]
    return run_score_worker(args, tmp, timeout_s=WORKER_TIMEOUT_S)["cases"]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(CASES))
def test_plugin_matches_lcx_engine(name, checkpoints, prompts, vllm_results):
    from lcx.engine import Engine, EngineConfig, SamplingParams

    model_type, methods = CASES[name]
    got = vllm_results[name]
    assert "error" not in got, f"{name}: {got.get('error')}"
    engine = Engine.from_pretrained(str(checkpoints[model_type]), EngineConfig(
        max_model_len=MAX_MODEL_LEN, max_batch=1, methods=methods or {}), dtype="float32")
    outs = engine.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    ref = [[t.logprob for t in o.prompt_logprobs[1:]] for o in outs]
    assert _max_diff(got["logprobs"], ref) < TOL, f"{name}: vLLM vs lcx Engine prompt logprobs"
    outs = engine.generate(prompts, SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True))
    assert got["generated"] == [o.token_ids for o in outs], f"{name}: vLLM greedy vs lcx Engine greedy"
    if methods:  # the method changes the long prompt's logprobs: the comparison above can fail
        plain = vllm_results[f"{model_type}:vanilla"]["logprobs"]
        assert _max_diff(got["logprobs"][-1:], plain[-1:]) > 1e-2, f"{name}: no different from plain vLLM"


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(REFUSED_IN_VLLM))
def test_refused_inside_vllm(name, vllm_results):
    """A layer whose vLLM attention has a term lcx's methods do not compute is refused by name
    when the model is built (`switch_to_method`), not run without it."""
    err = vllm_results[name].get("error", "")
    assert "ValueError" in err and REFUSED_IN_VLLM[name][3] in err, err


# ------------------------------------------------------------------ default tier: no vLLM needed

def _gemma3_config():
    from lcx.hf.models import tiny_model

    return tiny_model("gemma3_text", **TINY, **TINY_FAMILY["gemma3_text"]).config


def test_gemma3_layer_plans():
    """Hand-written per-layer plans of the tiny Gemma 3 (layer 0 sliding, base 1e3; layer 1
    global, base 1e4): lcx.hf's rule (methods on the global layers unless layers="all", the RoPE
    spec on the global layers' RoPE, each method on its layer's own basis)."""
    from lcx.rope import RopeSpec

    config = _gemma3_config()
    own_g = RopeSpec.from_dict({"rope_type": "default", "rope_theta": 1e4})
    own_s = RopeSpec.from_dict({"rope_type": "default", "rope_theta": 1e3})

    def plans(methods):
        return layer_plans(config, check_vllm_methods(methods, config))

    sl, gl = "sliding_attention", "full_attention"
    assert plans({}) == [LayerPlan(sl), LayerPlan(gl)]
    yarn = RopeSpec.from_dict({"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                               "original_max_position_embeddings": CONTEXT})
    assert plans({"rope": {"rope_type": "yarn", "factor": 2}}) == [LayerPlan(sl), LayerPlan(gl, rope=yarn)]
    sinks = {"type": "sinks", "n_sink": 4, "window": 32}
    m = check_vllm_methods({"attention": sinks}, config).attention
    assert plans({"attention": sinks}) == [
        LayerPlan(sl), LayerPlan(gl, rope=own_g, method=m, rotated=True, basis=own_g, set_window=True)]
    assert plans({"attention": sinks, "layers": "all"}) == [
        LayerPlan(sl, rope=own_s, method=m, rotated=True, basis=own_s, set_window=True),
        LayerPlan(gl, rope=own_g, method=m, rotated=True, basis=own_g, set_window=True)]
    swat = check_vllm_methods({"attention": {"type": "swat", "window": 40}}, config).attention
    assert plans({"rope": {"rope_type": "yarn", "factor": 2}, "attention": swat.to_dict()}) == [
        LayerPlan(sl), LayerPlan(gl, method=swat, basis=yarn, set_window=True)]
    assert plans({"attention": {"type": "sliding_window", "window": 40}}) == [
        LayerPlan(sl), LayerPlan(gl, set_window=True, window=40)]
    assert plans({"attention": {"type": "sliding_window", "window": 40}, "layers": "all"}) == [
        LayerPlan(sl, set_window=True, window=40), LayerPlan(gl, set_window=True, window=40)]


def test_gemma3_overrides_keep_the_hybrid():
    """On Gemma 3 the overrides never touch layer_types / sliding_window (the model's own
    local/global pattern); on Llama a sliding_window method still goes through the config."""
    config = _gemma3_config()
    config.architectures = ["Gemma3ForCausalLM"]
    ov = hf_overrides(config, {"attention": {"type": "sliding_window", "window": 40}}, max_model_len=MAX_MODEL_LEN)
    assert ov == {"architectures": ["LcxGemma3ForCausalLM"], "max_position_embeddings": MAX_MODEL_LEN,
                  "lcx_methods": {"attention": {"type": "sliding_window", "window": 40}}}
    from lcx.hf.models import tiny_model

    llama = tiny_model("llama", **TINY).config
    llama.architectures = ["LlamaForCausalLM"]
    ov = hf_overrides(llama, {"attention": {"type": "sliding_window", "window": 40}})
    assert ov["layer_types"] == ["sliding_attention"] * llama.num_hidden_layers and ov["sliding_window"] == 40


@pytest.mark.parametrize("model_type, arch, methods, match", [
    ("gemma3_text", "Gemma3ForCausalLM", {"rope": {"rope_type": "dynamic", "factor": 2}}, "length-dependent"),
    ("gemma3_text", "Gemma3ForCausalLM", {"attention": {"type": "sinks", "n_sink": 4}}, "missing key"),
    ("gemma3_text", "Gemma3ForCausalLM", {"attention": {"type": "sinks", "n_sink": 4, "window": 8},
                                          "layers": "some"}, "layers='some'"),
    ("gemma3_text", "Gemma3ForCausalLM", {"layers": "all"}, "without an attention method"),
    ("vaultgemma", "VaultGemmaForCausalLM", {}, "Transformers backend"),
    ("olmo2", "Olmo2ForCausalLM", {}, "Transformers backend"),
    ("starcoder2", "Starcoder2ForCausalLM", {}, "Transformers backend"),
    ("olmo3", "Olmo3ForCausalLM", {}, "Transformers backend"),
    ("ministral", "MinistralForCausalLM", {}, "no class registered"),
    ("hy_v3", "HYV3ForCausalLM", {}, "fused RoPE"),
    ("minimax_m2", "MiniMaxM2ForCausalLM", {}, "rotary_dim"),
    ("apertus", "ApertusForCausalLM", {}, "xIELU"),
])
def test_refused_before_vllm(model_type, arch, methods, match):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    config.architectures = [arch]
    with pytest.raises(ValueError, match=match):
        hf_overrides(config, methods)


def test_own_length_dependent_rope_refused_under_a_method():
    """A method that re-rotates keys needs the layer's basis as a static table: a model whose own
    RoPE is length-dependent is refused with a method, and runs as loaded without one."""
    from lcx.hf.models import tiny_model

    config = tiny_model("llama", **TINY).config
    config.architectures = ["LlamaForCausalLM"]
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    assert hf_overrides(config, {})["architectures"] == ["LcxLlamaForCausalLM"]
    with pytest.raises(ValueError, match="model's own RoPE has rope_type='dynamic', length-dependent"):
        hf_overrides(config, {"attention": _ROTATED.to_dict()})


def test_grids_cover_the_registries():
    """Gemma 3's grid holds every static RoPE type and every attention method (both `layers`);
    every registered family has its cases; the refused RoPE types are exactly the length-dependent."""
    from lcx.methods import ATTENTION_METHODS

    g3 = {n.split(":", 1)[1] for n in CASES if n.startswith("gemma3_text:")}
    assert {f"rope_{t}" for t, e in ROPE_TYPES.items() if not e.length_dependent and t != "default"} <= g3
    assert set(ROPE_TYPES) - set(STATIC_ROPE) == {"default"} | {t for t, e in ROPE_TYPES.items() if e.length_dependent}
    in_grid = {m["attention"]["type"] for n, (_, m) in CASES.items() if n.startswith("gemma3_text:") and m
               and "attention" in m and m.get("layers") == "all"}
    assert in_grid == set(ATTENTION_METHODS) - {"causal"}
    assert {n.split(":")[0] for n in CASES} == {f.model_type for f in FAMILIES.values()}


def test_plugin_families_are_lcx_families():
    """Every family the plugin registers is one of lcx's (`lcx.hf.models.FAMILIES`), and every
    lcx family is either registered or refused with a stated reason (`VLLM_LEFT_OUT`)."""
    from lcx.hf.models import FAMILIES as LCX_FAMILIES
    from lcx.serve.vllm_plugin.config import VLLM_LEFT_OUT

    registered = {f.model_type for f in FAMILIES.values()}
    assert registered <= set(LCX_FAMILIES)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    refused = {t: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t] for t in set(LCX_FAMILIES) - registered}
    assert {"olmo", "olmo2", "starcoder2"} <= set(refused)
    assert set(LCX_FAMILIES) == registered | set(refused) and set(VLLM_LEFT_OUT) == set(refused.values())
