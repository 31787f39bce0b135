"""One forward per step (`EngineConfig.mixed_step`, `lcx.hf.lean_decode.MixedPrefill`): a step's
decode rows and prefill chunks run as one token matrix through the weights. The runner's mixed
forward equals its decode forward plus its prefill forward (logits, the prefill's keys, values
and hidden states, the cache the decode wrote), fresh prompts and continuations from held keys,
on every family the lean forward takes, as loaded and patched; the engine gives the same tokens
with it as without; a failed mixed forward falls back to the two forwards."""

from __future__ import annotations

import pytest
import torch

from lcx.engine import Engine, EngineConfig, SamplingParams
from lcx.hf.models import tiny_model
from lcx.models.tiny import byte_tokenizer

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
METHODS = {
    "as-loaded": {},
    "yarn": {"rope": {"rope_type": "yarn", "factor": 2.0}},
    "lm_infinite": {"attention": {"type": "lm_infinite", "n_global": 2, "n_local": 9}},
    "self_extend": {"attention": {"type": "self_extend", "group_size": 3, "window": 8}},
}
PROMPTS = [[(7 * i + 3 * j) % 120 + 5 for j in range(5 + 11 * i)] for i in range(6)]  # 5, 16, ..., 60 tokens


def _model(family: str):
    extra = {"sliding_window": None} if family == "mistral" else {}
    return tiny_model(family, seed=1, **extra)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5, msg=lambda m: f"{what}: {m}")


@torch.no_grad()
@pytest.mark.parametrize("rows", ["ragged", "even"])
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", FAMILIES)
def test_the_mixed_forward_is_a_decode_plus_a_prefill(family, method, rows):
    engine = Engine(_model(family), byte_tokenizer(),
                    EngineConfig(methods=METHODS[method], max_model_len=128, max_batch=8, prefix_caching=False))
    runner = engine.runner
    for p in PROMPTS[:3]:
        engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):  # prefill, then decode steps: 3 running rows
        engine.step()
    running = engine.scheduler.running
    assert len(running) == 3 and runner.can_mix(runner.store)
    toks, pos = [s.out_ids[-1] for s in running], [s.next_position for s in running]
    # a prompt continuing from held keys (its first 16 tokens prefilled before), fresh prompts of odd lengths
    long = PROMPTS[5]
    head = runner.prefill([(long[:16], 0, None)])
    held = head.held(0, 16, engine._window)
    rows = ([(long[16:], 16, held), (PROMPTS[3][:13], 0, None), (PROMPTS[4][:1], 0, None)] if rows == "ragged"
            else [(PROMPTS[3][:13], 0, None), (PROMPTS[4][:13], 0, None)])  # (no padding: the chunks' views)

    store_a, store_b = runner.store.rows(list(range(3))), runner.store.rows(list(range(3)))
    logits_a, out_a = runner.decode(store_a, toks, pos), runner.prefill(rows)
    logits_b, out_b = runner.mixed(store_b, toks, pos, rows)
    _close(logits_b, logits_a, "decode logits")
    assert torch.equal(out_b.pos, out_a.pos)
    real = out_a.pos >= 0  # [P, N + C]
    for layer, (ka, kb, va, vb) in enumerate(zip(out_a.keys, out_b.keys, out_a.values, out_b.values)):
        _close(kb.transpose(1, 2)[real], ka.transpose(1, 2)[real], f"layer {layer} keys")
        _close(vb.transpose(1, 2)[real], va.transpose(1, 2)[real], f"layer {layer} values")
    new = real[:, -out_a.n_new:]
    _close(out_b.hidden[new], out_a.hidden[new], "prefill hidden states")
    # the decode part wrote the same cache: the next decode step agrees
    nxt = [p + 1 for p in pos]
    _close(runner.decode(store_b, toks, nxt), runner.decode(store_a, toks, nxt), "the next step's logits")


@pytest.mark.parametrize("method", ["as-loaded", "lm_infinite"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_engine_gives_the_same_tokens_in_one_forward_per_step(family, method):
    shared = PROMPTS[5][:40]  # a shared head: later prompts continue from the prefix cache's blocks
    prompts = PROMPTS[:5] + [shared + [9, 8, 7], shared + [1, 2, 3, 4, 5, 6, 7]]
    sp = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2)
    outs, stats = {}, {}
    for mixed in (False, True):
        engine = Engine(_model(family), byte_tokenizer(),
                        EngineConfig(methods=METHODS[method], max_model_len=128, max_batch=3,
                                     max_num_batched_tokens=24, prefix_block_size=8, mixed_step=mixed))
        outs[mixed], stats[mixed] = engine.generate(prompts, sp), engine.stats
    assert stats[False].mixed_steps == 0 and stats[True].mixed_steps > 0
    assert stats[True].prefix_cache_hits > 0 and stats[True].prefill_chunks > 0
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-4)


def test_a_failed_mixed_forward_runs_the_step_as_two(monkeypatch, caplog):
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    cfg = dict(max_model_len=128, max_batch=2, max_num_batched_tokens=16, prefix_caching=False)
    want = Engine(_model("llama"), byte_tokenizer(), EngineConfig(mixed_step=False, **cfg)).generate(PROMPTS[:4], sp)
    engine = Engine(_model("llama"), byte_tokenizer(), EngineConfig(**cfg))

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.runner, "mixed", broken)
    got = engine.generate(PROMPTS[:4], sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.stats.mixed_steps == 0 and "running them apart" in caplog.text


def test_where_one_forward_per_step_does_not_apply():
    gemma = Engine(tiny_model("gemma3_text", seed=1), byte_tokenizer(), EngineConfig(max_model_len=64))
    assert gemma.runner.lean is None and not gemma.runner.can_mix(gemma.runner.store)
    general = Engine(_model("llama"), byte_tokenizer(),
                     EngineConfig(max_model_len=64, methods={"attention": {"type": "lm_infinite", "n_global": 2,
                                                                           "n_local": 9},
                                                             "decode_backend": "blockwise"}))
    general.add_request(PROMPTS[1], SamplingParams(max_tokens=4))
    general.step()
    assert not general.runner.store.layout.rotated and not general.runner.can_mix(general.runner.store)
    with pytest.raises(ValueError, match="mixed_step"):
        EngineConfig(mixed_step=1)
    assert EngineConfig().to_dict()["mixed_step"] is True
    assert EngineConfig.from_dict({"mixed_step": False}).mixed_step is False
