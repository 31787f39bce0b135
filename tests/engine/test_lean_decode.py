"""The engine's lean decode forward (`lcx.hf.lean_decode`): the same tokens and the same logits,
bit for bit, as the model's own forward, on every family it takes, as loaded and patched; and it
declines every model it does not describe."""

from __future__ import annotations

import pytest
import torch

from lcx.engine import Engine, EngineConfig, SamplingParams
from lcx.hf.lean_decode import lean_decoder, why_not_lean
from lcx.hf.models import tiny_model
from lcx.models.tiny import byte_tokenizer

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
METHODS = {
    "as-loaded": {},
    "yarn": {"rope": {"rope_type": "yarn", "factor": 2.0}},
    "lm_infinite": {"attention": {"type": "lm_infinite", "n_global": 2, "n_local": 9}},
    "sliding_window": {"attention": {"type": "sliding_window", "window": 7}},
}
PROMPTS = [[(7 * i + 3 * j) % 120 + 5 for j in range(5 + 11 * i)] for i in range(4)]  # 5, 16, 27, 38 tokens


def _model(family: str, dtype: torch.dtype = torch.float32):
    extra = {"sliding_window": None} if family == "mistral" else {}
    return tiny_model(family, seed=1, **extra).to(dtype)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", FAMILIES)
def test_lean_decode_gives_the_models_own_logits(family, method):
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    outs = {}
    for lean in (False, True):
        model = _model(family)
        cfg = EngineConfig(methods=METHODS[method], max_model_len=64, max_batch=3, prefix_caching=False,
                           lean_decode=lean, mixed_step=False)
        engine = Engine(model, byte_tokenizer(), cfg)
        assert (engine.runner.lean is not None) is lean, why_not_lean(model)
        assert engine.runner.store is None and engine.runner.cache_layout.rotated  # the fast path decodes
        outs[lean] = engine.generate(PROMPTS, sp)
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]  # the same bits
        assert [x.top for x in a.logprobs] == [x.top for x in b.logprobs]


def test_lean_decode_declines_what_it_does_not_describe():
    assert why_not_lean(tiny_model("mistral", seed=1, sliding_window=16)) == "the model runs a sliding window of its own"
    gemma = tiny_model("gemma3_text", seed=1)
    assert lean_decoder(gemma) is None and "decoder" in why_not_lean(gemma)
    llama = _model("llama")
    assert "lcx's decode step" in why_not_lean(llama)  # no decode hook yet: the engine installs it
    engine = Engine(llama, byte_tokenizer(), EngineConfig(max_model_len=64))
    assert engine.runner.lean is not None
    llama.model.layers[1].mlp.forward = lambda x: x  # someone else's forward on one module
    assert why_not_lean(llama) == "a layer's MLP or norm is not the family's own"


def test_lean_decode_is_an_engine_setting():
    with pytest.raises(ValueError, match="lean_decode"):
        EngineConfig(lean_decode="yes")
    assert EngineConfig().to_dict()["lean_decode"] is True
    assert EngineConfig.from_dict({"lean_decode": False}).lean_decode is False
