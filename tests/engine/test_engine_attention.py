"""Attention methods in `lcx.engine`: a padded, continuously batched engine with per-row bounded
caches decodes exactly what one unpadded row with `BoundedKVCache` decodes (float64 model, greedy),
and its cache stays bounded while the requests run past the window. The unpadded row is the
reference decode loop (`lcx.hf.greedy_generate`, i.e. `lcx.hf.generate.greedy_decode_ref`
over a transformers `Cache`)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lcx.engine import Engine, EngineConfig, SamplingParams
from lcx.hf.attention_patch import attention_patched
from lcx.hf.bounded_cache import BoundedKVCache, greedy_generate
from lcx.methods import examples, method_from_dict, method_id
from lcx.models.tiny import tiny_llama

GEN = 40
PROMPT_LENS = (3, 29, 17)  # ragged: the batch is left-padded
# every registered method's examples (`lcx.methods.registry.examples`) as a config's dicts: windows
# of a few keys, so prompts + GEN tokens run far past them (max_position_embeddings 128); among
# them unbounded methods, LM-Infinite's cap past G + L - 1 (no BoundedKVCache can run it; the
# engine's rule still bounds it) and its top-k middle keys (unbounded: any middle key may be picked)
METHODS = {method_id(m): m.to_dict() for m in examples()}
LM_INFINITE = {"type": "lm_infinite", "n_global": 3, "n_local": 12}  # the tests below that need one method


@pytest.fixture(scope="module")
def model64():
    m, tok = tiny_llama(seed=3)
    return m.double().eval(), tok


def _prompts(tok):
    text = "Sphinx of black quartz, judge my vow; the five boxing wizards jump quickly."
    return [tok(text[:n], add_special_tokens=False)["input_ids"] for n in PROMPT_LENS]


def _reference(model, method, prompt):
    """One unpadded row: a `BoundedKVCache` where one can reproduce the method, else the full
    history (`DynamicCache`)."""
    try:
        method.check_bounded()
        cache = BoundedKVCache(method)
    except ValueError:
        cache = None
    with attention_patched(model, method):
        ids = torch.tensor([prompt])
        return greedy_generate(model, ids, GEN, cache=cache).tokens[0].tolist()


@contextlib.contextmanager
def _method_engine(model, tok, params):
    """`(engine, method, prompts, want)`: an engine running the method of `params`, its prompts and
    each prompt's reference tokens; the model's attention patch is removed on exit."""
    from lcx.hf.attention_patch import unpatch_attention

    method = method_from_dict(params)
    prompts = _prompts(tok)
    want = [_reference(model, method, p) for p in prompts]
    try:
        yield Engine(model, tok, EngineConfig(methods={"attention": params}, max_model_len=256)), method, prompts, want
    finally:
        unpatch_attention(model)


@pytest.mark.parametrize("name", list(METHODS))
def test_engine_batch_equals_bounded_cache_rows(model64, name):
    model, tok = model64
    with _method_engine(model, tok, METHODS[name]) as (engine, method, prompts, want):
        sp = SamplingParams(max_tokens=GEN, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, sp)
        got: dict[str, list[int]] = {}
        order: list[str] = []
        layout = engine.cache_layout
        rule = method.decode_rule()
        # every method with a decode rule decodes on the fast path (keys rotated once)
        assert layout.rotated == (rule is not None)
        bound = None  # slots per row, fixed for a bounded method
        if rule is not None and rule.window is not None and rule.side is not None and not rule.top_k:
            bound = rule.window + rule.side
        elif rule is None and method.cache_window is not None:
            bound = sum(method.cache_window)
        while engine.has_work():
            for ev in engine.step():
                if ev.request_id not in got:
                    order.append(ev.request_id)
                    got[ev.request_id] = []
                got[ev.request_id] += ev.token_ids
            if bound is not None and engine.num_running:
                # each row holds at most the window + the first keys, however long it runs
                assert engine.cache_len == bound
                assert int(engine._store.held().max()) <= bound
        assert [got[r] for r in order] == want


def test_engine_attention_joins_running_batch(model64):
    """A request added while others decode (merged into the running batch) still matches."""
    model, tok = model64
    with _method_engine(model, tok, LM_INFINITE) as (engine, _, prompts, want):
        sp = SamplingParams(max_tokens=GEN, ignore_eos=True)
        ids = [engine.add_request(prompts[0], sp)]
        got: dict[str, list[int]] = {ids[0]: []}
        steps = 0
        while engine.has_work():
            for ev in engine.step():
                got.setdefault(ev.request_id, []).extend(ev.token_ids)
            steps += 1
            if steps in (7, 19):  # late arrivals, after the first row ran past its window
                rid = engine.add_request(prompts[len(ids)], sp)
                ids.append(rid)
                got[rid] = []
        assert [got[r] for r in ids] == want


def test_engine_rejects_bad_attention_params():
    model, tok = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="n_local must be >= 1"):
        Engine(model, tok, EngineConfig(methods={"attention": {"type": "lm_infinite", "n_global": 2, "n_local": 0}}))
    with pytest.raises(ValueError, match="not an lcx.attention backend"):
        Engine(model, tok, EngineConfig(methods={"attention": {"type": "sliding_window", "window": 8},
                                                 "backend": "nope"}))


def test_served_lm_infinite_concurrent_requests(model64):
    """`lcx serve`'s app over an LM-Infinite engine: concurrent completions (batched together)
    return what unbatched bounded-cache decoding gives."""
    import socket
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import uvicorn

    from lcx.hf.attention_patch import unpatch_attention
    from lcx.serve.app import create_app

    model, tok = model64
    params = LM_INFINITE
    method = method_from_dict(params)
    prompts = _prompts(tok)
    want = [tok.decode(_reference(model, method, p)) for p in prompts]
    engine = Engine(model, tok, EngineConfig(methods={"attention": params}, max_model_len=256))
    app = create_app(engine, model_name="m", batch_window_s=0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)

        def call(p):
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "m", "prompt": p, "max_tokens": GEN, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(call, prompts))
        assert got == want
        snap = app.state.scheduler.snapshot()
        assert snap["engine"]["max_batch_size"] > 1  # decoded together, not one by one
    finally:
        server.should_exit = True
        thread.join(15)
        unpatch_attention(model)


def test_engine_swat_model_batched_with_bounded_cache():
    """A SWAT model (window w) in the engine: ragged prompts batched together decode what each
    prompt alone decodes with a full DynamicCache, while the cache keeps <= w - 1 keys per row."""
    from lcx.models.swat import build_swat_model

    _, tok = tiny_llama(seed=0)
    cfg = tiny_llama(seed=0)[0].config
    torch.manual_seed(5)
    model = build_swat_model(cfg, window=8).double().eval()
    prompts = _prompts(tok)
    with torch.no_grad():
        want = [greedy_generate(model, torch.tensor([p]), GEN).tokens[0].tolist() for p in prompts]
    engine = Engine(model, tok, EngineConfig(max_model_len=256))
    sp = SamplingParams(max_tokens=GEN, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for ev in engine.step():
            got[ev.request_id] += ev.token_ids
        assert engine.cache_len <= 8
    assert [got[i] for i in ids] == want


def test_engine_takes_a_swat_models_recorded_method():
    """A model trained with a method (SWAT) needs no `attention` entry: the engine runs the
    method its config records (bounded, window (0, w)), without patching, and names it in
    `Engine.methods`; an `attention` entry asked for replaces it."""
    from lcx.hf.recorded import recorded_method
    from lcx.methods import sliding_window, swat
    from lcx.models.swat import build_swat_model

    model, tok = tiny_llama(seed=0)
    model = build_swat_model(model.config, window=8).eval()
    own = recorded_method(model)
    assert own.attention == swat(8).for_heads(4) and own.backend == "blockwise"
    engine = Engine(model, tok, EngineConfig(max_model_len=64))
    assert engine.methods.attention == own.attention and engine.methods.backend == "blockwise"
    assert engine.methods.kv_window == (0, 8) and engine.methods_info()["kv_window"] == [0, 8]
    assert engine._row_attention and not engine.cache_layout.rotated
    assert model.config._attn_implementation == "lcx_swat"  # runs as loaded, not patched
    asked = Engine(model, tok, EngineConfig(methods={"attention": {"type": "sliding_window", "window": 5}}))
    assert asked.methods.attention == sliding_window(window=5)
    from lcx.hf.attention_patch import unpatch_attention

    unpatch_attention(model)
    assert recorded_method(tiny_llama(seed=0)[0]) is None  # stock attention


def test_decode_backend_is_used_for_one_token_calls(model64, monkeypatch):
    """`decode_backend` (e.g. the decode-only "cuda" kernel on a GPU) runs the Tq = 1 calls;
    prefill stays on `backend`. Same tokens with flash as the decode backend."""
    import lcx.attention.backends as backends_mod
    from lcx.hf.attention_patch import unpatch_attention

    model, tok = model64
    params = LM_INFINITE
    want = [_reference(model, method_from_dict(params), p) for p in _prompts(tok)[:2]]
    seen: list[tuple[str, int]] = []
    orig = backends_mod.attention

    def spy(q, k, v, spec, *, backend, **kw):
        seen.append((backend, q.shape[1]))
        return orig(q, k, v, spec, backend=backend, **kw)

    monkeypatch.setattr("lcx.methods.base.attention", spy)
    engine = Engine(model, tok, EngineConfig(methods={"attention": params, "backend": "blockwise",
                                                      "decode_backend": "flash"}, max_model_len=256))
    try:
        outs = engine.generate(_prompts(tok)[:2], SamplingParams(max_tokens=GEN, ignore_eos=True))
        assert [o.token_ids for o in outs] == want
        assert {b for b, tq in seen if tq == 1} == {"flash"} and {b for b, tq in seen if tq > 1} == {"blockwise"}
        assert engine.methods.decode_backend == "flash" and engine.methods_info()["decode_backend"] == "flash"
    finally:
        unpatch_attention(model)


# ------------------------------------------------------------------ the decode step's attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_side", [False, True])
def test_decode_attention_equals_dense_softmax(dtype, with_side):
    """`lcx.engine.kv.decode_attention` (GQA by blocks, empty slots masked, an optional side
    branch in the same softmax) against a dense float64 softmax over the visible keys; low
    precision within twice the error of a dense reference run in that precision."""
    from lcx.engine.kv import decode_attention
    from lcx.testing import assert_within_budget

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, C, Cs = 3, 6, 2, 16, 13, 5
    q, qs = torch.randn(B, 1, H, D, generator=g), torch.randn(B, 1, H, D, generator=g)
    k, v = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
    ks, vs = torch.randn(B, Hkv, Cs, D, generator=g), torch.randn(B, Hkv, Cs, D, generator=g)
    vis = torch.rand(B, C, generator=g) > 0.3
    vis[:, 0] = True  # the row's own new key is always visible
    vis_s = torch.rand(B, Cs, generator=g) > 0.5

    def dense(dt):
        kk, vv, vv_mask = k, v, vis
        qq = q.to(dt).reshape(B, Hkv, H // Hkv, D)
        s = qq @ kk.to(dt).transpose(-1, -2)
        if with_side:
            s = torch.cat([s, qs.to(dt).reshape(B, Hkv, H // Hkv, D) @ ks.to(dt).transpose(-1, -2)], -1)
            vv = torch.cat([v, vs], 2)
            vv_mask = torch.cat([vis, vis_s], -1)
        s = (s.float() if dt != torch.float64 else s) * D ** -0.5
        p = torch.softmax(s.masked_fill(~vv_mask[:, None, None, :], float("-inf")), -1)
        return (p.to(dt) @ vv.to(dt)).reshape(B, 1, H, D)

    side = (qs.to(dtype), ks.to(dtype), vs.to(dtype), vis_s) if with_side else None
    got = decode_attention(q.to(dtype), k.to(dtype), v.to(dtype), vis, side=side)
    want = dense(torch.float64)
    assert got.dtype == dtype and got.shape == (B, 1, H, D)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:
        assert_within_budget(got, dense(dtype), want)


@pytest.mark.parametrize("name", list(METHODS))
def test_engine_picks_fastest_supported_backend_by_default(model64, name):
    """No backend named: the engine runs the fastest exact backend the method supports (flash,
    `lcx.method_config.INFERENCE_BACKEND`), else `lcx.methods`' default (blockwise: SWAT's sigmoid);
    a backend named is kept."""
    from lcx.hf.attention_patch import current_patch, unpatch_attention
    from lcx.method_config import INFERENCE_BACKEND

    model, tok = model64
    method = method_from_dict(METHODS[name])
    try:
        eng = Engine(model, tok, EngineConfig(methods={"attention": METHODS[name]}, max_model_len=256))
        want = INFERENCE_BACKEND if method.supports(INFERENCE_BACKEND) is None else None
        assert eng.methods.backend == want
        assert current_patch(model).backend == (want or "blockwise")
        named = Engine(model, tok, EngineConfig(methods={"attention": METHODS[name], "backend": "ref"}, max_model_len=256))
        assert named.methods.backend == "ref" and current_patch(model).backend == "ref"
    finally:
        unpatch_attention(model)
