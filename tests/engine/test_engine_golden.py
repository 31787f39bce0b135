"""Greedy text on the bundled retrieval model is what the engine produced before its decode path
was rewritten (keys rotated once, per-method decode rules; issue #30): 3 ragged prompts batched,
40 tokens past the 256-token window, for every preset that runs on tiny-ret-5m."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GOLDEN = json.loads((Path(__file__).parent / "golden_greedy_tiny_ret.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(GOLDEN["tokens"]))
def test_greedy_tokens_unchanged(preset):
    from lcx import presets
    from lcx.engine import Engine, EngineConfig, SamplingParams
    from lcx.models import load_model

    model, tok = load_model(GOLDEN["model"])
    L0 = int(model.config.max_position_embeddings)
    cfg = presets.config(preset, L0=L0, factor=GOLDEN["factor"])
    eng = Engine(model, tok, EngineConfig(methods=cfg, max_model_len=2048, max_batch=4))
    outs = eng.generate(GOLDEN["prompts"], SamplingParams(max_tokens=GOLDEN["max_tokens"], ignore_eos=True))
    assert [o.token_ids for o in outs] == GOLDEN["tokens"][preset]
