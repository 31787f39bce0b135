"""`lcx.MethodConfig` and `lcx.presets`: one config in every format, applied and restored."""

from __future__ import annotations

import argparse
import pickle

import pytest
import torch

import lcx
import lcx.hf.attention_patch
from lcx import presets
from lcx.method_config import MethodConfig, add_method_arguments, method_config_from_args, parse_flat
from lcx.models.tiny import tiny_llama

CONFIGS = [
    {},
    {"rope": {"rope_type": "yarn", "factor": 4}},
    {"rope": {"rope_type": "truncate", "truncate_length": 96}},
    {"rope": {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
    {"attention": {"type": "sinks", "n_sink": 2, "window": 31}},
    {"attention": {"type": "sinks", "n_sink": 2, "window": 31, "renumber": False}},
    {"attention": {"type": "lm_infinite", "n_global": 3, "n_local": 17, "limit_distance": 9}},
    {"attention": {"type": "swat", "window": 9}},
    {"attention": {"type": "swat", "window": 9, "alibi_slopes": [0.5, 0.25, -0.5, -0.25]}, "backend": "blockwise"},
    {"rope": {"rope_type": "ntk", "factor": 2.5}, "attention": {"type": "sliding_window", "window": 7},
     "backend": "flash", "decode_backend": "blockwise"},
    {"attention": {"type": "sinks", "n_sink": 2, "window": 31}, "layers": "all"},
]
IDS = ["identity", "yarn", "truncate", "longrope", "sinks", "sinks-norenumber", "lm_infinite", "swat",
       "swat-slopes", "ntk+window", "sinks-all-layers"]


@pytest.mark.parametrize("d", CONFIGS, ids=IDS)
def test_every_format_round_trips(d):
    cfg = MethodConfig.from_dict(d)
    assert cfg.to_dict() == d  # parameters at their default are left out, so a config reads as written
    assert MethodConfig.from_dict(cfg.to_dict()) == cfg
    assert MethodConfig.from_flat(cfg.to_flat()) == cfg
    assert MethodConfig.from_flat(cfg.to_model_args()) == cfg
    assert hash(MethodConfig.from_dict(d)) == hash(cfg)
    back = pickle.loads(pickle.dumps(cfg))  # crosses processes (lcx serve's engine process): issue #44
    assert back == cfg and hash(back) == hash(cfg) and back.to_dict() == d


def test_flat_rope_dict_is_accepted():
    assert MethodConfig.from_dict({"rope_type": "yarn", "factor": 4}).to_dict() == {"rope": {"rope_type": "yarn",
                                                                                           "factor": 4}}
    assert MethodConfig.from_dict({"type": "linear", "factor": 2}).rope["rope_type"] == "linear"  # HF legacy key
    assert parse_flat("a=1,b=[1, 2],c=x,d=true") == {"a": 1, "b": [1, 2], "c": "x", "d": True}


@pytest.mark.parametrize("d, match", [
    ({"rope": {"rope_type": "yarn", "factr": 4}}, r"unknown RoPE key\(s\) \['factr'\]"),
    ({"rope": {"rope_type": "yarn", "factor": 0.5}}, "factor must be >= 1"),
    ({"rope": {"rope_type": "nope"}}, "not a known RoPE type"),
    ({"attention": {"type": "lm_infinite", "n_global": 4}}, "missing"),
    ({"attention": {"type": "flash"}}, "not known"),
    ({"attention": {"type": "sinks", "n_sink": 1, "window": 8}, "backend": "nope"}, "backend='nope' is not"),
    ({"backend": "flash"}, "without an attention method"),
    ({"layers": "all"}, "layers was given without an attention method"),
    ({"attention": {"type": "sinks", "n_sink": 1, "window": 8}, "layers": "local"}, r"layers='local'; expected one of"),
    ({"rope": {"rope_type": "yarn", "factor": 2}, "window": 3}, r"unknown method config key\(s\) \['window'\]"),
    ({"factor": 2, "attention": None}, "RoPE keys go under 'rope'"),
    ({"attention": {"type": "sinks", "n_sink": 1, "window": 8, "backend": "ref"}}, "backend inside 'attention'"),
    ({"attention": {"type": "sinks", "n_sink": 1, "window": 8, "decode_backend": "ref"}, "backend": "flash"},
     "decode_backend inside 'attention'"),
])
def test_bad_configs_name_the_problem(d, match):
    with pytest.raises(ValueError, match=match):
        MethodConfig.from_dict(d)


def test_flat_errors():
    with pytest.raises(ValueError, match="without rope_type"):
        MethodConfig.from_flat("factor=4")
    with pytest.raises(ValueError, match=r"unknown method key\(s\) \['window'\]"):
        MethodConfig.from_flat("attention=lm_infinite,n_global=2,n_local=8,window=3")
    with pytest.raises(ValueError, match="given twice"):
        parse_flat("a=1,a=2")


def _parse(argv):
    p = argparse.ArgumentParser()
    add_method_arguments(p, json_flag="--methods")
    return method_config_from_args(p.parse_args(argv))


def test_cli_flags_build_the_same_config():
    want = MethodConfig.from_dict(CONFIGS[9])
    got = _parse(["--rope", "ntk", "--factor", "2.5", "--attention", "sliding_window", "--window", "7",
                  "--attn-backend", "flash", "--attn-decode-backend", "blockwise"])
    assert got == want
    assert _parse(["--methods", '{"attention": {"type": "sliding_window", "window": 7}}', "--rope", "ntk",
                   "--factor", "2.5", "--attn-backend", "flash", "--attn-decode-backend", "blockwise"]) == want
    assert _parse(["--attention", "sinks", "--n-sink", "2", "--window", "31", "--renumber", "false"]) == \
        MethodConfig.from_dict(CONFIGS[5])
    assert _parse([]).is_identity
    assert _parse(["--attention", "sinks", "--n-sink", "2", "--window", "31", "--attn-layers", "all"]) == \
        MethodConfig.from_dict(CONFIGS[10])
    assert _parse(["--attention", "swat", "--window", "9"]) == MethodConfig.from_dict(CONFIGS[7])
    assert _parse(["--attention", "swat", "--window", "9", "--alibi-slopes", "[0.5,0.25,-0.5,-0.25]",
                   "--attn-backend", "blockwise"]) == MethodConfig.from_dict(CONFIGS[8])
    for argv, match in [
        (["--window", "3"], "without --attention"),
        (["--attention", "lm_infinite", "--n-global", "1", "--n-local", "4", "--window", "3"], "takes no --window"),
        (["--methods", '{"rope": {"rope_type": "ntk", "factor": 2}}', "--rope", "yarn"], "both with --rope"),
        (["--methods", "{oops"], "not valid JSON"),
        (["--methods", '{"other": {}}'], r"unknown method config key\(s\) \['other'\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            _parse(argv)


def test_derived_values():
    class Cfg:
        max_position_embeddings = 64
        rope_theta = 10_000.0

    class Scaled(Cfg):  # a model whose own rope parameters name its original length
        rope_parameters = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10_000.0,
                           "original_max_position_embeddings": 32}

    assert MethodConfig.from_dict({"rope": {"rope_type": "yarn", "factor": 4}}).context_len(Cfg) == 256
    # the spec is resolved against the model: L is the model's original length, not its window
    assert MethodConfig.from_dict({"rope": {"rope_type": "yarn", "factor": 4}}).context_len(Scaled) == 128
    assert MethodConfig.from_dict({"rope": {"rope_type": "truncate"}}).context_len(Cfg) is None
    assert MethodConfig.from_dict({"rope": {"rope_type": "yarn", "factor": 4,
                                            "original_max_position_embeddings": 32}}).context_len(Cfg) == 128
    assert MethodConfig().context_len(Cfg) is None
    assert MethodConfig.from_dict(CONFIGS[4]).kv_window == (2, 31)
    # a cap beyond G + L - 1 cannot be reproduced by a bounded cache: every key is kept
    assert MethodConfig.from_dict({"attention": {"type": "lm_infinite", "n_global": 2, "n_local": 4,
                                                 "limit_distance": 50}}).kv_window is None
    assert MethodConfig.from_dict(CONFIGS[1]).kv_window is None
    assert MethodConfig.from_dict(CONFIGS[7]).kv_window == (0, 9)
    # a default backend the method cannot run is left out (SWAT's sigmoid on softmax-only flash);
    # one asked for is kept
    assert MethodConfig.from_dict(CONFIGS[7]).with_default_backend("flash").backend is None
    assert MethodConfig.from_dict(CONFIGS[4]).with_default_backend("flash").backend == "flash"
    assert MethodConfig.from_dict(CONFIGS[8]).with_default_backend("flash").backend == "blockwise"
    from lcx.lmeval_model import split_model_args  # lm-eval: attention=swat,window=9 runs on blockwise

    assert split_model_args(parse_flat("attention=swat,window=9"))[0] == MethodConfig.from_dict(CONFIGS[7])
    spec = MethodConfig.from_dict(CONFIGS[1]).rope_spec(type("C", (), {"rope_parameters": {"rope_theta": 500.0},
                                                                       "max_position_embeddings": 64})())
    assert spec.rope_theta == 500.0 and spec.original_max_position_embeddings == 64


def test_rope_spec_checked_at_the_edge_and_resolved_once_in_apply(monkeypatch):
    """A config's RoPE spec is checked when the config is built, with no model (no placeholder
    resolution), and resolved against the model once per apply; a re-patch resolves against the
    model as loaded, not the patched one."""
    from lcx.hf.rope_patch import current_spec
    from lcx.rope import PartialRopeSpec

    calls = []
    resolve = PartialRopeSpec.resolve
    monkeypatch.setattr(PartialRopeSpec, "resolve", lambda self, c: calls.append(self) or resolve(self, c))
    cfg = MethodConfig.from_flat("rope_type=yarn,factor=4,attention=sinks,n_sink=1,window=8")
    assert isinstance(cfg.rope, PartialRopeSpec) and calls == []
    model, _ = tiny_llama(seed=0)
    L = model.config.max_position_embeddings
    with lcx.patched(model, cfg):
        assert len(calls) == 1 and current_spec(model).original_max_position_embeddings == L
        with lcx.patched(model, {"rope_type": "linear", "factor": 2}):
            assert len(calls) == 2 and current_spec(model).rope_theta == cfg.rope_spec(model.config).rope_theta
    assert current_spec(model) is None


@torch.no_grad()
def test_apply_is_one_patch_and_restores_what_was_there():
    model, _ = tiny_llama(seed=0)
    ids = torch.randint(3, 200, (1, 70), generator=torch.Generator().manual_seed(0))
    plain = model(ids).logits
    d = {"rope": {"rope_type": "yarn", "factor": 2}, "attention": {"type": "lm_infinite", "n_global": 2, "n_local": 16}}
    with lcx.patched(model, {"rope_type": "yarn", "factor": 2}):  # the RoPE-only form still works
        with lcx.hf.attention_patch.attention_patched(model, lcx.methods.lm_infinite(2, 16)):
            want = model(ids).logits
        rope_only = model(ids).logits
        with lcx.patched(model, d):
            torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
        torch.testing.assert_close(model(ids).logits, rope_only, rtol=0, atol=0)  # back to the outer patch
    torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)
    lcx.patch(model, MethodConfig.from_dict(d))
    torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
    lcx.unpatch(model)  # RoPE and attention
    torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)
    assert lcx.hf.attention_patch.current_attention(model) is None


# ------------------------------------------------------------------ presets
@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_every_preset_is_a_config_every_front_end_accepts(name):
    from lcx.engine import EngineConfig
    from lcx.lmeval_model import split_model_args

    cfg = presets.config(name, L0=64, factor=4.0)
    assert isinstance(cfg, MethodConfig)
    EngineConfig(methods=cfg)
    assert split_model_args(cfg.to_flat())[0] == cfg.with_default_backend("flash")
    assert MethodConfig.from_flat(cfg.to_model_args()) == cfg


def test_presets_resolve_per_model():
    assert presets.config("sinks", L0=256, factor=2).to_dict() == {
        "attention": {"type": "sinks", "n_sink": 4, "window": 252}}
    assert presets.config("lm_infinite+yarn", L0=256, factor=8).to_dict() == {
        "rope": {"rope_type": "yarn", "factor": 8}, "attention": {"type": "lm_infinite", "n_global": 10, "n_local": 256}}
    r = presets.resolve("swat", "tiny-5m", L0=256, factor=2)
    assert r.model == "tiny-swat-5m" and r.config.is_identity
    assert "no swat model trained for 'smollm2-135m'" in presets.resolve("swat", "smollm2-135m", L0=8192, factor=2)
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        presets.get("nope")
    with pytest.raises(ValueError, match="factor must be >= 1"):
        presets.config("yarn", L0=256, factor=0.5)


def test_bench_prefill_runs_presets_against_vanilla(tmp_path):
    """`lcx bench prefill`: every named preset through its MethodConfig, ratios against vanilla,
    one run record (config, environment with git SHA, results)."""
    import json

    from lcx.cli import main

    out = tmp_path / "p.json"
    assert main(["bench", "prefill", "--model", "tiny-ret-5m", "--length", "300", "--threads", "1",
                 "--presets", "yarn,lm_infinite,self_extend", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec) == {"description", "config", "environment", "results"} and rec["environment"]["git"]["sha"]
    res = rec["results"]
    assert list(res) == ["vanilla", "yarn", "lm_infinite", "self_extend"]
    assert res["vanilla"]["speedup_vs_vanilla"] == 1.0 and all(r["cpu_s"] > 0 for r in res.values())
    assert res["lm_infinite"]["config"] == {"attention": {"type": "lm_infinite", "n_global": 10, "n_local": 256},
                                            "backend": "flash"}


def test_bench_prefill_rows_of_a_hybrid_model_as_loaded(tmp_path, tiny_gemma3_dir):
    """A hybrid model (Gemma 3): `vanilla/lcx` (the engine's `as_loaded_method` route) and, for a
    preset the engine leaves as loaded (dynamic NTK: its basis follows the length), `dynamic/lcx`
    (per row, `windowed_rows_scope`); a static RoPE preset (YaRN) gets no such row."""
    import json

    from lcx.cli import main

    out = tmp_path / "p.json"
    assert main(["bench", "prefill", "--model", str(tiny_gemma3_dir), "--length", "300", "--threads", "1",
                 "--presets", "dynamic,yarn", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert list(res) == ["vanilla", "vanilla/lcx", "dynamic", "dynamic/lcx", "yarn"]
    assert res["dynamic/lcx"]["config"] == res["dynamic"]["config"] and "attention" not in res["dynamic"]["config"]
    assert all(r["cpu_s"] > 0 for r in res.values())


def test_rope_spec_is_read_only_plain_data():
    """`cfg.rope` cannot change after validation, and holds no proxy objects (it pickles)."""
    src = {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    cfg = MethodConfig.from_dict({"rope": src})
    src["short_factor"].append(9.0)  # the caller's dict and lists are not shared
    with pytest.raises(TypeError):
        cfg.rope["factor"] = 3.0
    with pytest.raises(AttributeError):
        cfg.rope.short_factor = 1
    assert cfg.rope["short_factor"] == (1.0,) * 8 and cfg.to_dict()["rope"]["short_factor"] == [1.0] * 8
    assert cfg.rope == {"rope_type": "longrope", "factor": 2.0, "short_factor": (1.0,) * 8, "long_factor": (2.0,) * 8}


def test_layers_choose_the_hybrid_models_layers_and_restore():
    """`layers` reaches `patch_attention`: on a tiny Gemma 3 (sliding layers with their own window)
    "global" leaves the sliding layers on their window, "all" runs the method everywhere; a config
    applied over an "all" patch restores "all" on exit."""
    from lcx.hf.attention_patch import _STATE, current_patch
    from lcx.hf.models import attention_layers, tiny_model
    from lcx.methods import sinks

    model = tiny_model("gemma3_text")
    method = sinks(2, 5)

    def methods_run() -> list:
        return [getattr(a, _STATE).method for a in attention_layers(model)]

    with lcx.patched(model, MethodConfig(attention=method)):
        run = methods_run()
        assert method in run and any(m != method for m in run)  # the sliding layers keep their window
    with lcx.patched(model, MethodConfig(attention=method, layers="all")):
        assert all(m == method for m in methods_run()) and current_patch(model).layers == "all"
        with lcx.patched(model, MethodConfig(attention=sinks(1, 3))):
            assert current_patch(model).layers == "global"
        assert all(m == method for m in methods_run()) and current_patch(model).layers == "all"
    assert current_patch(model) is None
