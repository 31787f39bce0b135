"""A model whose config.json carries Qwen's `dual_chunk_attention_config` loads running Dual Chunk
Attention (`lcx.hf.config_attention`, called by `lcx.load_model`), says so in one log line, and
runs it in every entry point that takes the model as loaded (a forward, `lcx.engine`); an
attention method in a method config replaces it (`attention=causal`: the stock attention).
Random-weight Qwen2 directories written here; no hub."""

from __future__ import annotations

import logging

import pytest
import torch

import lcx
from lcx.hf.attention_patch import current_attention
from lcx.methods import dca

DCA_CONFIG = {"chunk_size": 8, "local_size": 3, "original_max_position_embeddings": 16}
T = 41  # five chunks of 5


def _qwen2_dir(path, dca_config=None):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lcx.models.tiny import byte_tokenizer

    # served context 64 > DCA's chunks (as Qwen2.5-1M: max_position_embeddings 1,010,000, chunk 262,144)
    cfg = Qwen2Config(vocab_size=259, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                      rope_theta=1000.0, use_sliding_window=False)
    if dca_config is not None:
        cfg.dual_chunk_attention_config = dca_config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2")
    return _qwen2_dir(root / "dca", DCA_CONFIG), _qwen2_dir(root / "plain")


def _ids():
    return torch.randint(3, 259, (1, T), generator=torch.Generator().manual_seed(3))


def _logits(model):
    with torch.no_grad():
        return model(_ids()).logits


def test_loads_with_dca_and_says_so(dirs, caplog):
    with caplog.at_level(logging.INFO, logger="lcx"):
        model, _ = lcx.load_model(dirs[0], dtype="float64")
    said = [r.getMessage() for r in caplog.records if "dual_chunk_attention_config" in r.getMessage()]
    assert len(said) == 1, said
    assert "dca(chunk_size=8, local_size=3)" in said[0] and "original_max_position_embeddings" in said[0]
    assert current_attention(model) == dca(8, 3)
    plain, _ = lcx.load_model(dirs[1], dtype="float64")  # the same weights, no key: as transformers loads it
    assert current_attention(plain) is None
    with lcx.patched(plain, {"attention": {"type": "dca", "chunk_size": 8, "local_size": 3}}):
        want = _logits(plain)
    torch.testing.assert_close(_logits(model), want, rtol=0, atol=0)
    assert (_logits(plain) - want).abs().max() > 1e-4  # DCA changes this model at 41 tokens


def test_a_method_config_replaces_it(dirs):
    model, _ = lcx.load_model(dirs[0], dtype="float64")
    plain, _ = lcx.load_model(dirs[1], dtype="float64")
    stock = {"attention": {"type": "causal"}}
    with lcx.patched(model, stock), lcx.patched(plain, stock):
        torch.testing.assert_close(_logits(model), _logits(plain), rtol=0, atol=0)
    assert current_attention(model) == dca(8, 3)  # back to DCA on leaving the context
    with lcx.patched(model, lcx.MethodConfig.from_flat("attention=none")):  # "not given": as loaded
        assert current_attention(model) == dca(8, 3)
    lcx.unpatch(model)
    torch.testing.assert_close(_logits(model), _logits(plain), rtol=0, atol=0)


def test_the_engine_runs_it(dirs):
    from lcx.engine import Engine, EngineConfig, SamplingParams

    def greedy(path, methods):
        model, tok = lcx.load_model(path, dtype="float64")
        engine = Engine(model, tok, EngineConfig(methods=methods))
        out = engine.generate([_ids()[0].tolist()], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        return engine, out[0].token_ids

    engine, got = greedy(dirs[0], {})
    assert engine.methods.attention == dca(8, 3)
    _, want = greedy(dirs[1], {"attention": {"type": "dca", "chunk_size": 8, "local_size": 3}})
    assert got == want
    engine, got = greedy(dirs[0], {"attention": {"type": "causal"}})
    assert engine.methods.attention.name == "causal"
    assert got == greedy(dirs[1], {"attention": {"type": "causal"}})[1]


def test_a_bad_config_raises_naming_the_key(tmp_path):
    path = _qwen2_dir(tmp_path / "bad", {"chunk_size": 8, "local_size": 8})
    with pytest.raises(ValueError, match="dual_chunk_attention_config: local_size must be < chunk_size"):
        lcx.load_model(path)


def test_the_engine_keeps_a_backend_the_patch_names(dirs):
    """A model patched with a backend of its own (not the patch's default) keeps it in the engine;
    the patch's default gives way to the engine's fast one."""
    from lcx.engine import Engine, EngineConfig

    model, tok = lcx.load_model(dirs[0], dtype="float64")
    assert Engine(model, tok, EngineConfig()).methods.backend == "flash"
    lcx.patch(model, {"attention": {"type": "dca", "chunk_size": 8, "local_size": 3}, "backend": "ref"})
    assert Engine(model, tok, EngineConfig()).methods.backend == "ref"
