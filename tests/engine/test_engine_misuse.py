"""An engine whose model is re-patched behind its back refuses to run instead of running the
model it no longer describes."""

from __future__ import annotations

import pytest
import torch

import lcx
from lcx.engine import Engine, EngineConfig, SamplingParams
from lcx.hf.attention_patch import patch_attention
from lcx.hf.models import tiny_model
from lcx.methods import sliding_window
from lcx.models.tiny import byte_tokenizer


@pytest.mark.parametrize("change", ["unpatch", "attention"])
def test_engine_refuses_a_model_patched_after_it_was_built(change):
    model = tiny_model("llama", seed=0).double()
    engine = Engine(model, byte_tokenizer(), EngineConfig(methods={"rope": {"rope_type": "yarn", "factor": 2.0}},
                                                          max_model_len=64))
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    assert len(engine.generate([[5, 6, 7]], sp)[0].token_ids) == 3
    if change == "unpatch":
        lcx.unpatch(model)
        match = "RoPE patch changed"
    else:
        patch_attention(model, sliding_window(window=2))
        match = "attention patch changed"
    with pytest.raises(RuntimeError, match=match):
        engine.generate([[5, 6, 7]], sp)
    lcx.unpatch(model)
    torch.testing.assert_close(model(torch.tensor([[5, 6]])).logits, tiny_model("llama", seed=0).double()(
        torch.tensor([[5, 6]])).logits)
