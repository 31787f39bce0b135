"""The fair scheduler (`lcx.engine`, "Fair service"): with a token budget per step a long prompt
is prefilled in chunks while running requests keep decoding, a short request arriving beside a
long prefill or a many-sample request is served within a bounded number of steps, and the
slow-tier test measures its latency as a multiple of its solo latency (ratios, not times)."""

from __future__ import annotations

import time

import pytest
import torch

from lcx.engine import Engine, EngineConfig, SamplingParams
from lcx.models.tiny import tiny_llama

BUDGET = 64
BLOCK = 16
LONG = 700  # a long prompt: 11 steps of chunks at this budget
SHORT = 12
SHORT_TOKENS = 4
# the stated bound (module docstring of lcx.engine, docs/serving.md): a short request beside a
# heavy neighbour finishes within this multiple of its solo latency
LATENCY_BOUND = 10.0  # measured 1.5x (n = 256) and 3.5-7.5x (16k prompt) on a busy 2-core machine




def _engine(budget=BUDGET, max_batch=8, max_len=1024, **kw):
    model, tok = tiny_llama(seed=0, max_position_embeddings=max_len)
    return Engine(model, tok, EngineConfig(max_batch=max_batch, max_model_len=max_len, max_num_batched_tokens=budget,
                                           prefix_block_size=BLOCK, prefix_caching=False, **kw))


def _ids(n, seed=0):
    return [int(x) for x in torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed))]


def _steps_until_done(eng, rid, limit=10_000):
    for n in range(1, limit):
        if any(ev.request_id == rid and ev.finished for ev in eng.step()):
            return n
    raise AssertionError(f"{rid} did not finish in {limit} steps")


def test_running_request_decodes_every_step_beside_a_long_prefill():
    eng = _engine()
    a = eng.add_request(_ids(SHORT), SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()  # a is running
    eng.add_request(_ids(LONG, 1), SamplingParams(max_tokens=1, ignore_eos=True))
    for _ in range((LONG + BUDGET - 1) // BUDGET):
        evs = eng.step()
        assert [len(ev.token_ids) for ev in evs if ev.request_id == a] == [1]  # a token every step
    assert eng.stats.prefill_chunks >= LONG // BUDGET - 1


def test_short_request_overtakes_a_long_prefill():
    eng = _engine()
    eng.add_request(_ids(LONG, 1), SamplingParams(max_tokens=1, ignore_eos=True))
    eng.step()  # the long prompt's first chunk
    short = eng.add_request(_ids(SHORT), SamplingParams(max_tokens=SHORT_TOKENS, ignore_eos=True))
    # first token in the next step (shortest remaining prompt first), then one per step
    assert _steps_until_done(eng, short) == SHORT_TOKENS
    assert eng._prefilling  # the long prompt is still being prefilled


def test_short_request_admitted_beside_many_samples():
    """The n samples of one call are one group: it holds at most max_batch - max(1, max_batch // 8)
    slots, so another client's request is admitted at once."""
    eng = _engine(budget=None, max_batch=8)
    for i in range(64):
        eng.add_request(_ids(SHORT, i), SamplingParams(max_tokens=32, ignore_eos=True), group="heavy")
    eng.step()
    assert eng.num_running == 7
    short = eng.add_request(_ids(SHORT), SamplingParams(max_tokens=SHORT_TOKENS, ignore_eos=True))
    assert _steps_until_done(eng, short) == SHORT_TOKENS  # admitted the next step, then a token per step


def test_scheduled_results_equal_unscheduled():
    """Chunks and order change nothing: greedy tokens equal a run without a budget."""
    prompts = [_ids(LONG, 1), _ids(SHORT), _ids(200, 2)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in _engine(budget=None).generate(prompts, sp)]
    assert [o.token_ids for o in _engine().generate(prompts, sp)] == want


def _short_latency(eng, heavy) -> float:
    """Seconds from a short request's arrival to its last token, with `heavy` (a callable adding
    the neighbour's requests) started one step before."""
    if heavy is not None:
        heavy(eng)
        eng.step()
    t0 = time.perf_counter()
    rid = eng.add_request(_ids(SHORT), SamplingParams(max_tokens=SHORT_TOKENS, ignore_eos=True))
    _steps_until_done(eng, rid)
    dt = time.perf_counter() - t0
    eng.reset()
    return dt


@pytest.mark.slow
@pytest.mark.parametrize("neighbour", ["n256", "prompt16k"])
def test_short_request_latency_within_bound_of_solo(neighbour):
    """Latency of a short request beside a heavy neighbour / solo, medians of interleaved runs
    (robust to a busy machine): within LATENCY_BOUND."""
    L = 16384
    eng = _engine(budget=256, max_batch=16, max_len=L + 64)
    if neighbour == "n256":
        def heavy(e):
            for i in range(256):
                e.add_request(_ids(SHORT, i), SamplingParams(max_tokens=32, ignore_eos=True), group="heavy")
    else:
        def heavy(e):
            e.add_request(_ids(L, 1), SamplingParams(max_tokens=1, ignore_eos=True))
    _short_latency(eng, None)  # warm-up
    solo, busy = [], []
    for _ in range(5):
        solo.append(_short_latency(eng, None))
        busy.append(_short_latency(eng, heavy))
    ratio = sorted(busy)[2] / sorted(solo)[2]
    assert ratio <= LATENCY_BOUND, f"{neighbour}: short request {ratio:.1f}x its solo latency"
