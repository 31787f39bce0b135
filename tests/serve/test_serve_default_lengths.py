"""One default max_model_len for every engine (issue #75, item 5).

- Self-Extend's reach: `SelfExtend.context_len(L)` is the longest sequence whose scored distances
  (its own `last_query_keys`) all stay within a trained context L; one token more leaves it.
  `MethodConfig.context_len` reads it (on top of a RoPE factor), so lcx's engine and `lcx serve`
  serve the extended context by default instead of the training context.
- `lcx serve --engine vllm` (`lcx.serve.cli.vllm_launch`, the vLLM argv and environment, built
  without starting vLLM) and `lcx vllm-args` derive the max_model_len lcx's engine derives for the
  same model, methods, dtype and memory (`lcx.serve.lengths.default_length`, shared), name
  `--max-model-len` in how it was derived, and size vLLM's CPU KV cache to hold it.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from lcx.engine import Engine, EngineConfig  # noqa: E402
from lcx.method_config import MethodConfig, method_config_from_args  # noqa: E402
from lcx.methods import ATTENTION_METHODS  # noqa: E402
from lcx.methods.self_extend import SelfExtend  # noqa: E402
from lcx.serve import lengths  # noqa: E402

L0 = 128  # the tiny test model's context
GiB = 1 << 30
# (trained context L, group size G, window W): G dividing W and not, W = 1, W = L, odd sizes
REACH_GRID = [(256, 4, 64), (256, 3, 64), (128, 2, 4), (97, 5, 13), (61, 7, 1), (33, 3, 33), (17, 1, 5),
              (64, 16, 60)]
# method configs served on the tiny model: (id, methods dict, the length lcx's engine serves by default)
SELF_EXTEND = {"attention": {"type": "self_extend", "group_size": 4, "window": 32}}  # (128 - 32) * 4 + 32 = 416
CASES = [
    ("vanilla", {}, L0),
    ("yarn-x4", {"rope": {"rope_type": "yarn", "factor": 4}}, 4 * L0),
    ("self-extend", SELF_EXTEND, 416),
    ("self-extend-odd", {"attention": {"type": "self_extend", "group_size": 3, "window": 37}}, 3 * (L0 - 37 + 12)),
    ("yarn-x2+self-extend", {"rope": {"rope_type": "yarn", "factor": 2}, **SELF_EXTEND}, (2 * L0 - 32) * 4 + 32),
    ("lm-infinite", {"attention": {"type": "lm_infinite", "n_global": 4, "n_local": 64}}, None),  # memory
    ("sliding-window", {"attention": {"type": "sliding_window", "window": 63}}, None),
]


def _max_distance(method: SelfExtend, T: int) -> float:
    """The largest query-key distance the method scores on a sequence of T tokens (its last
    query sees the farthest keys): from `last_query_keys`, the method's own positions."""
    pos = torch.arange(T)
    seen = method.last_query_keys(pos).key_positions  # [T] float64: each key's position as the last query sees it
    return float((pos[-1].to(torch.float64) - seen).max())


@pytest.mark.parametrize("L,G,W", REACH_GRID, ids=[f"L{L}-G{G}-W{W}" for L, G, W in REACH_GRID])
def test_self_extend_reach_is_the_longest_sequence_within_the_trained_distances(L, G, W):
    m = SelfExtend(group_size=G, window=W)
    T = m.context_len(L)
    if T is None:  # no extension: the window alone spans the context, or G = 1
        assert G == 1 or W >= L
        assert _max_distance(m, L) <= L - 1
        return
    assert T > L
    assert _max_distance(m, T) <= L - 1, "the reach scores a distance the model never saw"
    assert _max_distance(m, T + 1) > L - 1, "the reach is not the longest such sequence"
    if W % G == 0:
        assert T == (L - W) * G + W  # the paper's reach


def test_only_self_extend_lengthens_the_context():
    """The other registered methods keep the model's length (bounded ones serve by memory)."""
    for name, cls in ATTENTION_METHODS.items():
        for ex in cls.examples:
            got = cls(**ex).context_len(1000)
            assert (got is not None) == (name == "self_extend"), (name, ex, got)


class _Cfg:
    max_position_embeddings = 256
    rope_theta = 10000.0
    hidden_size = 64
    num_attention_heads = 4


def test_method_config_context_len_adds_self_extend_to_the_rope_factor():
    se = {"attention": {"type": "self_extend", "group_size": 4, "window": 64}}
    assert MethodConfig.from_dict(se).context_len(_Cfg) == 832  # the probe of issue #75: 256 -> 832
    both = MethodConfig.from_dict({"rope": {"rope_type": "linear", "factor": 2}, **se})
    assert both.context_len(_Cfg) == (512 - 64) * 4 + 64
    assert MethodConfig.from_dict({"attention": {"type": "self_extend", "group_size": 4,
                                                 "window": 300}}).context_len(_Cfg) is None


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[2] is not None])
def test_lcx_engine_serves_the_extended_context_by_default(case):
    from lcx.models.tiny import tiny_llama

    _, methods, want = next(c for c in CASES if c[0] == case)
    model, tok = tiny_llama(seed=0)  # private: the engine patches its model
    cfg = MethodConfig.from_dict(methods)
    limit, how = lengths.default_max_model_len(model, cfg, memory=GiB)
    assert limit is None and "--max-model-len" in how  # the engine's own default, stated
    if want != L0:
        assert f"to {want}" in how, how
    assert Engine(model, tok, EngineConfig(methods=cfg)).max_model_len == want


def test_self_extend_serves_beyond_the_training_context():
    """A prompt longer than L0 within Self-Extend's reach is served by default, not refused."""
    from lcx.engine import SamplingParams
    from lcx.models.tiny import tiny_llama

    model, tok = tiny_llama(seed=0)
    eng = Engine(model, tok, EngineConfig(methods=MethodConfig.from_dict(SELF_EXTEND)))
    prompt = [3 + i % 250 for i in range(3 * L0 + 7)]  # 391 tokens, > L0, < 416
    out = eng.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


# ------------------------------------------------------------------------------ --engine vllm
def _serve_args(model_dir, methods: dict, *extra: str) -> argparse.Namespace:
    from lcx.serve.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--model", str(model_dir), "--engine", "vllm", "--dtype", "float32", "--port", "8123",
                         *(["--methods", json.dumps(methods)] if methods else []), *extra])


@pytest.fixture
def private():
    """A short private directory for vLLM's environment (its IPC socket paths live there)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="lcx-vllm-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _argv_value(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, cmd
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_engine_vllm_gets_the_builtin_engines_default(case, tiny_model_dir, private):
    """The vLLM server's argv (built, not run) carries the max_model_len lcx's engine derives
    for the same model, methods, dtype and memory, and its KV cache holds one such sequence."""
    from transformers import AutoConfig

    from lcx.models import load_model
    from lcx.serve.cli import vllm_launch
    from lcx.serve.vllm_plugin.args import vllm_kv_cache_gb

    _, methods, _ = next(c for c in CASES if c[0] == case)
    args = _serve_args(tiny_model_dir, methods)
    cmd, env, how = vllm_launch(args, private, python="/nonexistent/python", memory=GiB)
    model, _ = load_model(str(tiny_model_dir), dtype="float32")
    cfg = method_config_from_args(args)
    builtin, builtin_how = lengths.default_max_model_len(model, cfg, memory=GiB)
    if builtin is None:  # the engine's own default: what Engine computes
        builtin = int(cfg.context_len(model.config) or model.config.max_position_embeddings)
    got = int(_argv_value(cmd, "--max-model-len"))
    assert got == builtin, (case, got, builtin)
    assert builtin_how in how and "--max-model-len" in how
    overrides = json.loads(_argv_value(cmd, "--hf-overrides"))
    assert overrides.get("max_position_embeddings", L0) == max(L0, got)  # vLLM's rotary cache covers it
    hf = AutoConfig.from_pretrained(str(tiny_model_dir))
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) == vllm_kv_cache_gb(hf, got, "float32") >= 1
    if case == "lm-infinite":
        assert got > 100 * L0  # what issue #75 saw: vLLM served the model's 128 (256) here


def test_engine_vllm_kv_cache_is_sized_for_a_long_default(tiny_model_dir, private):
    """A bounded method on plenty of memory: vLLM's CPU KV cache grows past its 1 GiB floor to
    hold one sequence of the derived length."""
    from transformers import AutoConfig

    from lcx.hf.models import model_shape
    from lcx.serve.cli import vllm_launch

    methods = {"attention": {"type": "lm_infinite", "n_global": 4, "n_local": 64}}
    cmd, env, _ = vllm_launch(_serve_args(tiny_model_dir, methods), private, python="/x/python",
                              memory=2000 * GiB)
    got = int(_argv_value(cmd, "--max-model-len"))
    assert got == lengths.MAX_BOUNDED_LEN
    kv = model_shape(AutoConfig.from_pretrained(str(tiny_model_dir))).kv_bytes_per_token(4) * got
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) * GiB >= kv
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) == max(1, math.ceil(kv * 1.1 / GiB))


def test_explicit_max_model_len_wins_on_both_engines(tiny_model_dir, private):
    from lcx.serve.cli import vllm_launch

    args = _serve_args(tiny_model_dir, SELF_EXTEND, "--max-model-len", "301")
    cmd, _, how = vllm_launch(args, private, python="/x/python", memory=GiB)
    assert _argv_value(cmd, "--max-model-len") == "301" and "--max-model-len 301" in how


def test_vllm_args_prints_the_same_default(tiny_model_dir, capsys):
    """`lcx vllm-args` (lm-eval's --model vllm JSON, and `vllm serve` flags) derives it too."""
    from lcx.serve.vllm_plugin import args as vargs

    assert vargs.main(["--model", str(tiny_model_dir), "--methods", json.dumps(SELF_EXTEND)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["max_model_len"] == 416
    assert "max_model_len 416 (lcx engine default)" in out.err and "VLLM_CPU_KVCACHE_SPACE >= 1" in out.err
    assert vargs.main(["--model", str(tiny_model_dir), "--format", "serve"]) == 0
    flags = capsys.readouterr().out.split()
    assert flags[flags.index("--max-model-len") + 1] == str(L0)


@pytest.mark.parametrize("dtype,nbytes", [("float32", 4), ("float", 4), ("bfloat16", 2), ("half", 2),
                                          ("auto", 4)])
def test_vllm_dtype_bytes(dtype, nbytes, tiny_model_dir):
    from transformers import AutoConfig

    from lcx.serve.vllm_plugin.args import dtype_bytes

    hf = AutoConfig.from_pretrained(str(tiny_model_dir))
    hf.dtype = None if dtype != "auto" else torch.float32
    assert dtype_bytes(dtype, hf) == nbytes
    with pytest.raises(ValueError, match="unknown dtype 'float13'"):
        dtype_bytes("float13", hf)


@pytest.mark.vllm
def test_engine_vllm_serves_self_extends_reach_by_default(vllm_python, tmp_path):
    """vLLM tier (not run where vLLM is missing): `lcx serve --engine vllm` with Self-Extend and no
    --max-model-len reports lcx's engine's default in /v1/models and serves a prompt beyond L0."""
    import httpx

    from lcx.models import load_model

    from _servers import lcx_serve, wait_healthy

    methods = {"attention": {"type": "self_extend", "group_size": 4, "window": 64}}
    model, tok = load_model("tiny-5m")
    want = Engine(model, tok, EngineConfig(methods=MethodConfig.from_dict(methods))).max_model_len
    L = model.config.max_position_embeddings
    assert want > L
    log = tmp_path / "vllm.log"
    with lcx_serve("tiny-5m", log, "--engine", "vllm", "--threads", "1", "--methods", json.dumps(methods),
                   stop_timeout_s=60) as (url, proc):
        wait_healthy(url, proc, log, timeout_s=600)
        card = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        assert card["max_model_len"] == want, card
        prompt = [3 + i % 250 for i in range(L + 40)]
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-5m", "prompt": prompt, "max_tokens": 2,
                                                      "temperature": 0}, timeout=600)
        assert r.status_code == 200, r.text
