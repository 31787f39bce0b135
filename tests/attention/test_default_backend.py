"""Fast by default (issue #46): with no backend named, every entry point runs an attention
method on the same backend, the fastest exact one that supports the method's calls
(`lcx.method_config.INFERENCE_BACKEND`, `flash`), else `lcx.methods`' default (blockwise: SWAT's
sigmoid). One row per registered example method; per entry point its own config path:

  engine        `Engine(model, tok, EngineConfig(methods=...))`: the backend it applies
  lcx serve     `serve.cli`'s flags (`--methods JSON`) -> EngineConfig -> Engine
  lm-eval       the `lcx` model's `split_model_args` (the flat `--model_args` keys)
  lcx report    `ReportConfig()`'s `attn_backend`, as `lcx.report.measure` fills it in
  vLLM plugin   `method_attention.prefill_backend` (its multi-query calls)

and none of them names a decode backend, so decode calls follow the same backend
(`_ModuleState.backend_for`). A backend named explicitly is kept (the engine's own test,
tests/engine/test_engine_attention.py, checks that)."""

from __future__ import annotations

import argparse
import json

import pytest

from lcx.hf.attention_patch import current_patch, unpatch_attention
from lcx.method_config import INFERENCE_BACKEND, MethodConfig
from lcx.methods import examples, method_id

METHODS = {method_id(m): m for m in examples()}


@pytest.fixture(scope="module")
def tiny():
    import torch

    from lcx.models.tiny import tiny_llama

    torch.manual_seed(0)
    return tiny_llama()


def _want(method) -> str | None:
    return INFERENCE_BACKEND if method.supports(INFERENCE_BACKEND) is None else None


def _serve_methods(method) -> MethodConfig:
    from lcx.method_config import method_config_from_args
    from lcx.serve.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", "tiny-5m", "--methods", json.dumps({"attention": method.to_dict()})])
    return method_config_from_args(args)


@pytest.mark.parametrize("name", list(METHODS))
def test_every_entry_point_defaults_to_the_same_fastest_backend(tiny, name):
    from lcx.engine import Engine, EngineConfig
    from lcx.lmeval_model import split_model_args
    from lcx.report.config import ReportConfig
    from lcx.serve.vllm_plugin.method_attention import prefill_backend

    method = METHODS[name]
    want = _want(method)
    cfg = MethodConfig(attention=method)
    model, tok = tiny
    chosen = {}
    try:
        eng = Engine(model, tok, EngineConfig(methods=cfg, max_model_len=64))
        chosen["engine"] = (eng.methods.backend, eng.methods.decode_backend, current_patch(model).backend)
        serve_cfg = _serve_methods(method)
        assert serve_cfg.backend is None and serve_cfg.decode_backend is None  # nothing pinned on the way
        eng = Engine(model, tok, EngineConfig(methods=serve_cfg, max_model_len=64))
        chosen["lcx serve"] = (eng.methods.backend, eng.methods.decode_backend, current_patch(model).backend)
    finally:
        unpatch_attention(model)
    lm = split_model_args(cfg.to_flat())[0]
    chosen["lm-eval"] = (lm.backend, lm.decode_backend, lm.backend or "blockwise")
    rep = cfg.with_default_backend(ReportConfig().attn_backend)
    chosen["lcx report"] = (rep.backend, rep.decode_backend, rep.backend or "blockwise")
    vllm = prefill_backend(method)
    chosen["vLLM plugin prefill"] = (want if vllm == INFERENCE_BACKEND else None, None, vllm)
    expected = (want, None, want or "blockwise")
    assert chosen == {k: expected for k in chosen}, f"{name}: {chosen}"


def test_the_default_is_flash_for_the_bounded_methods():
    """The methods whose prefill cost issue #46 bounds (LM-Infinite, sinks, sliding window,
    Self-Extend) all run on `flash` by default: none falls back to blockwise."""
    assert INFERENCE_BACKEND == "flash"
    kinds = {m.to_dict()["type"]: _want(m) for m in examples()}
    for kind in ("lm_infinite", "sinks", "sliding_window", "self_extend"):
        assert kinds.get(kind) == "flash", (kind, kinds.get(kind))
