"""Every family of `lcx.hf.models.FAMILIES` × every registered attention method
(`lcx.methods.examples()`): the attention patch runs the family's own attention code and hands
the method that code's q/k/v before rotation (`lcx.hf.attention_patch`).

(a) a method whose window covers the sequence equals the unpatched model (HF's own attention);
(b) each layer of the patched model equals o_proj(method.attend(q, k, v)) on the q/k/v the
    family's own forward makes (obtained from transformers' code alone: the stock forward with
    identity rotation tables and a test attention function); on Gemma 3's sliding layers, the
    family's own window (`layers="global"`) or the method (`layers="all"`);
(c) RoPE scaling equals transformers' own: tests/hf/test_patch.py (its grid runs every family);
(d) `lcx.engine`'s greedy tokens equal the reference loop (`lcx.hf.greedy_generate`).

Tiny random float64 models (`lcx.hf.models.tiny_model`: 2 layers, hidden 64, 4/2 heads of 16);
a new family is one line in `FAMILIES` and is tested here automatically.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from lcx.testing import attention_layer_io
from lcx.attention import Rotary
from lcx.hf import FAMILIES, BoundedKVCache, current_patch, greedy_generate, layer_methods
from lcx.hf.attention_patch import attention_patched, channel_order, patch_attention, unpatch_attention
from lcx.hf.models import attention_layers, decoder, model_shape, tiny_model
from lcx.hf.rope_patch import rope_basis
from lcx.methods import causal, examples, method_id, sliding_window

FAMILY_NAMES = list(FAMILIES)
METHODS = {method_id(m): m for m in examples()}
T = 23  # odd, far past the examples' windows (and Gemma 3's tiny sliding window of 8)


def _covered_len(method, max_len: int = 16) -> int:
    """The longest T <= max_len at which `method` equals causal attention on random q/k/v (its
    window covers the sequence); 0 if none >= 2 (SWAT: sigmoid, never softmax)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, max_len, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, max_len, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, max_len, 2, 16, generator=g, dtype=torch.float64)
    inv = 1.0 / 10_000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    best = 0
    for n in range(2, max_len + 1):
        rot = Rotary(inv, torch.arange(n), 1.0)
        args = (q[:, :n], k[:, :n], v[:, :n])
        same = all(torch.allclose(method.attend(*args, rotary=rot, layer_idx=i),
                                  causal().attend(*args, rotary=rot), rtol=1e-10, atol=1e-12) for i in (0, 1))
        if not same:
            break
        best = n
    return best


# (a): every example whose window covers some sequence of >= 3 tokens, at the longest it covers
WIDE = {name: (m, n) for name, m in METHODS.items() if (n := _covered_len(m)) >= 3}
GRID_A = [(f, name) for f in FAMILY_NAMES for name in WIDE]
GRID_B = [(f, name) for f in FAMILY_NAMES for name in METHODS]
# (d): each method's plain case (its first example) on every family, a third of those pairs by
# default (rotating: each family with two methods, each method on a third of the families; an engine
# case costs ~1 s, the whole product ~4 min of the default tier); the other pairs and every other
# example: -m slow
FIRST = {cls_name: m for m in reversed(examples()) for cls_name in [m.name]}
GRID_D = [(f, method_id(m)) for i, f in enumerate(FAMILY_NAMES) for j, m in enumerate(FIRST.values())
          if (i + j) % 3 == 0]
GRID_D_SLOW = [(f, name) for f in FAMILY_NAMES for name in METHODS if (f, name) not in GRID_D]

_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family, seed=7, max_position_embeddings=64).double()
    return _MODELS[family]


def _ids(n: int, B: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (B, n), generator=torch.Generator().manual_seed(seed))


def _is_sliding(model, i: int) -> bool:
    types_ = getattr(model.config, "layer_types", None) or []
    return "full_attention" in types_ and types_[i] == "sliding_attention"


# ------------------------------------------------------------------------------ (a)


@pytest.mark.parametrize("family,name", GRID_A, ids=[f"{f}-{n}" for f, n in GRID_A])
def test_wide_method_equals_unpatched_model(family, name):
    model = _model(family)
    method, n = WIDE[name]
    ids = _ids(n)
    with torch.no_grad():
        want = model(ids).logits
        with attention_patched(model, method):
            got = model(ids).logits
    # lcx rotates with float64 angles from HF's float32 inv_freq; HF with float32 angles
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


PARTIAL = [f for f in FAMILY_NAMES if model_shape(_model(f)).rotary_dim < model_shape(_model(f)).head_dim]
ORDERED = [f for f in FAMILY_NAMES if not channel_order(_model(f)).identity]  # partial, interleaved, flipped


@pytest.mark.parametrize("family", ORDERED)
@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}],
                         ids=["yarn", "dynamic"])
@pytest.mark.parametrize("name", ["causal()", "lm_infinite(n_global=3,n_local=5)", "self_extend(group_size=2,window=4)"])
def test_ordered_family_method_under_scaled_rope(family, rope, name):
    """A family held in lcx's channel order (partial rotary, interleaved pairs) under a RoPE spec
    patched by lcx (its tables in the family's layout) whose attention factor is not 1 (YaRN):
    on a partial head lcx scales every channel, transformers only the rotated ones, and
    `fix_query` makes up the difference. A method whose window covers the sequence equals the
    family's own attention under the same spec (transformers' rotation of the first r channels,
    with lcx's tables); an exact method (causal) equals it at every length."""
    import lcx

    model = _model(family)
    method = METHODS[name]
    n = T if name == "causal()" else WIDE[name][1]
    ids = _ids(n)
    with torch.no_grad(), lcx.patched(model, {"rope": rope}):
        want = model(ids).logits
    with torch.no_grad(), lcx.patched(model, {"rope": rope, "attention": method.to_dict()}):
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_head_logits_equal_the_familys_own(family):
    """What lcx forms logits with from hidden states (the engine, chunked loss, lm-eval:
    `lcx.hf.head.head_logits`: lm_head, then the family's soft-cap or scaling from the family
    table) is the family's own forward (Granite divides by logits_scaling, HyperCLOVA X
    multiplies by it, Cohere by logit_scale, NanoChat soft-caps; the tiny configs make each
    differ from 1)."""
    from lcx.hf.head import check_head, head_logits, hidden_states

    model = _model(family)
    ids = _ids(T)
    with torch.no_grad():
        want = model(ids).logits
        raw = model.get_output_embeddings()(hidden_states(model, ids))
        got = head_logits(model, hidden_states(model, ids))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if FAMILIES[family].logits is not None or getattr(model.config, "final_logit_softcapping", None):
        assert (raw - want).abs().max() > 1e-3  # (the transform is not the identity here)
    check_head(model)


def test_narrow_methods_change_every_family():
    """(a) is not vacuous: a narrow window changes every family's logits past it."""
    for family in FAMILY_NAMES:
        model = _model(family)
        ids = _ids(T)
        with torch.no_grad():
            want = model(ids).logits
            with attention_patched(model, sliding_window(window=3)):
                got = model(ids).logits
        assert (got - want).abs().max() > 1e-3, family
        torch.testing.assert_close(got[:, :3], want[:, :3], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ (b)

_REF_IMPL = "lcx_test_reference"


@contextlib.contextmanager
def _reference_attention(model, fn):
    """Run the model's attention interface calls through `fn(module, q, k, v, scaling, softcap)`
    (transformers' layout: q `[B, H, T, D]`; `softcap`: what the family's code passed, Gemma 2's
    attention-logit cap) -> out `[B, T, H, D]`."""
    from transformers import AttentionInterface

    def reference(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
        return fn(module, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling, softcap), None

    AttentionInterface.register(_REF_IMPL, reference)
    before = model.config._attn_implementation
    model.config._attn_implementation = _REF_IMPL
    try:
        yield
    finally:
        model.config._attn_implementation = before


def _check_layers_equal_reference(model, method, layers: str):
    ids = _ids(T, seed=5)
    B = ids.shape[0]
    with attention_patched(model, method, layers=layers):
        seen = attention_layer_io(model, ids, attention_layers(model))
        assert len(seen) == model.config.num_hidden_layers
        for i, (attn, (h, out)) in enumerate(zip(attention_layers(model), seen)):
            own = layers == "global" and _is_sliding(model, i)
            want_method = sliding_window(window=model.config.sliding_window) if own else method
            assert layer_methods(model)[i] == want_method
            layer_type = model.config.layer_types[i] if isinstance(
                model.config.rope_parameters.get("full_attention"), dict) else None
            inv, af = rope_basis(model, T, layer_type=layer_type)
            r = model_shape(model).rotary_dim
            order = channel_order(model)

            def ref(module, q, k, v, scaling, softcap):
                # a family whose RoPE is not rotate-half on the whole head: in lcx's channel order
                # (lcx.hf.channel_order; af = 1 here, nothing to correct)
                q, k, basis = order.to_lcx(q), order.to_lcx(k), order.basis(inv)
                return want_method.attend(q, k, v, rotary=Rotary(basis, torch.arange(T), af), scale=scaling,
                                          layer_idx=i, softcap=softcap)

            # the family's own forward, unrotated: its rotation function replaced by the identity
            # (not run on cos 1 / sin 0 tables: some families round q and k through float32 there)
            ones = torch.ones(B, T, r, dtype=h.dtype)
            unrotated = {"apply_rotary_pos_emb": lambda q, k, *args, **kwargs: (q, k)}
            with torch.no_grad(), _reference_attention(model, ref), \
                    mock.patch.dict(type(attn).forward.__globals__, unrotated):
                want, _ = type(attn).forward(attn, hidden_states=h, position_embeddings=(ones, torch.zeros_like(ones)),
                                             attention_mask=None, position_ids=torch.arange(T)[None].expand(B, T))
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"layer {i}: {m}")


@pytest.mark.parametrize("family,name", GRID_B, ids=[f"{f}-{n}" for f, n in GRID_B])
def test_layers_equal_method_on_the_familys_own_qkv(family, name):
    _check_layers_equal_reference(_model(family), METHODS[name], "global")


HYBRID = [f for f in FAMILY_NAMES if "full_attention" in (dict(FAMILIES[f].tiny).get("layer_types") or [])]


@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("name", list(METHODS))
def test_hybrid_all_layers_option(family, name):
    """`layers="all"`: the sliding layers run the method too (still on their own RoPE base)."""
    _check_layers_equal_reference(_model(family), METHODS[name], "all")


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_sliding_layers_keep_their_window(family):
    """Gemma 3 (`layers="global"`): a causal patch leaves the model as loaded, sliding layers
    included (their own window, their own RoPE base); `layers="all"` lifts their window."""
    model = _model(family)
    ids = _ids(T)
    with torch.no_grad():
        want = model(ids).logits
        with attention_patched(model, causal()):
            got = model(ids).logits
        with attention_patched(model, causal(), layers="all"):
            lifted = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    w = model.config.sliding_window
    assert (lifted - want)[:, w:].abs().max() > 1e-3
    torch.testing.assert_close(lifted[:, :w], want[:, :w], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ cached decoding


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bounded_cache_decoding_equals_full_cache(family):
    """Per family: greedy tokens over `BoundedKVCache` (each layer bounded by its own method:
    on Gemma 3 the sliding layers by their window) == over a full cache, far past the window."""
    model = _model(family)
    method = METHODS[method_id(FIRST["lm_infinite"])]
    ids = _ids(9, B=1)
    with attention_patched(model, method):
        full = greedy_generate(model, ids, 24)
        cache = BoundedKVCache(method)
        bounded = greedy_generate(model, ids, 24, cache=cache)
    assert torch.equal(bounded.tokens, full.tokens)
    n_first, n_recent = method.cache_window
    held = [int(layer.keys.shape[-2]) for layer in cache.layers]
    for i, n in enumerate(held):
        cap = (model.config.sliding_window - 1) if _is_sliding(model, i) else n_first + n_recent - 1
        assert n == min(cap, 9 + 24 - 1), (i, held)


# ------------------------------------------------------------------------------ (d) the engine


PROMPT_LENS = (3, 14)  # ragged: left-padded in the batch
# hybrid cases with the prefix cache: a third prompt shares 3 blocks of 4 with the second (reused a
# step later), and a token budget cuts prompts into chunks continuing from held KV
REUSE = dict(prefix_block_size=4, max_num_batched_tokens=8)


def _prompts(reuse: bool) -> list[list[int]]:
    prompts = [[5 + i for i in range(n)] for n in PROMPT_LENS]
    return prompts + [prompts[1][:12] + [40, 41, 42]] if reuse else prompts


def _reference_tokens(model, method, prompts, gen: int, layers: str = "global") -> list[list[int]]:
    """Each prompt alone through the reference loop (`greedy_generate`): over a `BoundedKVCache`
    (each layer bounded by its own method) where one reproduces the method, else a full cache."""
    want = []
    for p in prompts:
        cache = None
        if method is not None and method.cache_window is not None:
            try:
                method.check_bounded()
                cache = BoundedKVCache(method)
            except ValueError:
                pass
        with attention_patched(model, method, layers=layers):
            want.append(greedy_generate(model, torch.tensor([p]), gen, cache=cache).tokens[0].tolist())
    return want


def _run_engine(engine, prompts, gen: int, *, each_step=None):
    """(tokens per prompt, error messages) of the engine's greedy decoding of `prompts`."""
    from lcx.engine import SamplingParams

    sp = SamplingParams(max_tokens=gen, ignore_eos=True)
    rids = [engine.add_request(p, sp) for p in prompts]
    got = {r: [] for r in rids}
    errors = []
    while engine.has_work():
        for ev in engine.step():
            got[ev.request_id] += ev.token_ids
            if getattr(ev, "error", None):
                errors.append(str(ev.error))
        if each_step is not None:
            each_step(engine)
    return [got[r] for r in rids], errors


def _engine_case(family: str, name: str | None, *, layers: str | None = None, reuse: bool = False,
                 prefix_caching: bool = True, rope: dict | None = None):
    """(engine tokens, reference tokens, errors, engine stats) of ragged prompts under method
    `name` (None: the model as loaded) and RoPE spec `rope`; `reuse`: a third prompt reusing the
    second's prefix, prompts prefilled in chunks (`REUSE`)."""
    import lcx
    from lcx.engine import Engine, EngineConfig
    from lcx.models.tiny import byte_tokenizer

    model = _model(family)
    method = METHODS[name] if name is not None else None
    prompts = _prompts(reuse)
    gen = 16
    with lcx.patched(model, {"rope": rope} if rope else None):
        want = _reference_tokens(model, method, prompts, gen, layers or "global")
    methods = {"attention": method.to_dict()} if method is not None else {}
    if rope:
        methods["rope"] = rope
    if layers is not None:
        methods["layers"] = layers
    try:
        engine = Engine(model, byte_tokenizer(), EngineConfig(methods=methods, max_model_len=64,
                                                              prefix_caching=prefix_caching,
                                                              **(REUSE if reuse else {})))
        got, errors = _run_engine(engine, prompts, gen)
        return got, want, errors, engine
    finally:
        unpatch_attention(model)
        lcx.unpatch(model)


def _check_engine(family: str, name: str | None, **kw):
    got, want, errors, engine = _engine_case(family, name, **kw)
    assert not errors and got == want
    return engine


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_engine_vanilla_equals_reference_loop(family):
    """The model as loaded: the engine's decode hook (decode calls through the family's own
    q/k/v, every other call stock) decodes what transformers does."""
    _check_engine(family, None)


@pytest.mark.parametrize("family,name", GRID_D, ids=[f"{f}-{n}" for f, n in GRID_D])
def test_engine_greedy_equals_reference_loop(family, name):
    _check_engine(family, name)


@pytest.mark.parametrize("family", ORDERED)
@pytest.mark.parametrize("name", [None, "lm_infinite(n_global=3,n_local=5)", "self_extend(group_size=2,window=4)"],
                         ids=lambda n: n or "vanilla")
def test_engine_ordered_family_under_yarn(family, name):
    """A family held in lcx's channel order under YaRN (attention factor != 1) through the
    engine's fast path (keys rotated once in lcx's channel order, a partial head's query
    corrected per step)
    decodes what the reference loop does, and each generated token's logprob is the patched
    model's own over the whole sequence (a method's attention is defined per query, so one
    forward of prompt + tokens scores every step)."""
    import lcx
    from lcx.engine import Engine, EngineConfig, SamplingParams
    from lcx.models.tiny import byte_tokenizer

    rope = {"rope_type": "yarn", "factor": 2.0}
    _check_engine(family, name, rope=rope)
    model = _model(family)
    prompt = _prompts(False)[1]
    cfg = {"rope": rope, **({"attention": METHODS[name].to_dict()} if name else {})}
    try:
        engine = Engine(model, byte_tokenizer(), EngineConfig(methods=cfg, max_model_len=64))
        rid = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0))
        got = []
        while engine.has_work():
            got += [lp for ev in engine.step() if ev.request_id == rid for lp in ev.logprobs]
    finally:
        unpatch_attention(model)
        lcx.unpatch(model)
    ids = torch.tensor([prompt + [t.token_id for t in got]])
    with torch.no_grad(), lcx.patched(model, cfg):
        want = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1], -1)
    want = want.gather(1, ids[0, len(prompt):, None])[:, 0]
    torch.testing.assert_close(torch.tensor([t.logprob for t in got], dtype=want.dtype), want,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ORDERED)
@pytest.mark.parametrize("name", ["lm_infinite(n_global=3,n_local=5)", "self_extend(group_size=2,window=4)"])
def test_engine_ordered_family_prefix_reuse(family, name):
    """A family held in lcx's channel order, under YaRN, with the prefix cache reused and prompts
    prefilled in chunks: held keys (the family's order, unrotated) continue into new prefills
    and into the fast path's rotated store; the reference loop's tokens."""
    _check_engine(family, name, reuse=True, rope={"rope_type": "yarn", "factor": 2.0})


@pytest.mark.slow
@pytest.mark.parametrize("family,name", GRID_D_SLOW, ids=[f"{f}-{n}" for f, n in GRID_D_SLOW])
def test_engine_greedy_equals_reference_loop_every_example(family, name):
    _check_engine(family, name)


# ------------------------------------------------------------------------------ (d) hybrid models

HYBRID_NAMES = [None] + list(METHODS)  # the model as loaded, then every registered example


def _hybrid_id(name):
    return "vanilla" if name is None else name


@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("name", HYBRID_NAMES, ids=_hybrid_id)
def test_engine_hybrid_prefix_reuse_equals_reference_loop(family, name):
    """Gemma 3 × every method and the model as loaded, prefix cache on and reused, prompts cut
    into chunks: the engine's per-layer caches (sliding layers: their own window and RoPE base;
    global layers: the method) decode what the reference loop decodes, on the fast path
    wherever every layer's method has a decode rule."""
    engine = _check_engine(family, name, reuse=True)
    method = METHODS[name] if name is not None else None
    assert engine.cache_layout.rotated == (method is None or method.decode_rule() is not None)
    # refused exactly where a method's keys depend on the call (not on the prefix alone)
    refused = method is not None and method.call_dependence is not None
    assert (engine.prefix_cache_refusal is not None) == refused, engine.prefix_cache_refusal
    assert refused or engine.stats.prefix_cache_hit_tokens >= REUSE["prefix_block_size"]
    assert engine.stats.prefill_chunks > 0 or engine.prefix_cache_refusal is not None or (
        method is not None and method.last_query_extra)


@pytest.mark.slow
@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("name", HYBRID_NAMES, ids=_hybrid_id)
@pytest.mark.parametrize("mode", ["no-prefix-cache", "all-layers"])
def test_engine_hybrid_variants_equal_reference_loop(family, name, mode):
    """The same without the prefix cache, and with the method on every layer (`layers="all"`)."""
    if mode == "all-layers" and name is None:
        pytest.skip("layers= needs an attention method")
    if mode == "no-prefix-cache":
        engine = _check_engine(family, name, reuse=True, prefix_caching=False)
        assert engine.prefix_cache is None
    else:
        _check_engine(family, name, reuse=True, layers="all")


@pytest.mark.parametrize("reuse", [False, True], ids=["whole-prompts", "prefix-reuse"])
def test_engine_uniform_sliding_window_as_loaded(reuse):
    """A model whose every layer has the same `sliding_window` (Mistral's), as loaded: the engine
    holds a ring of that window per layer, prefills per row on lcx's backend (`loaded_rows`) and
    decodes what transformers does, prefix cache reused and prompts cut into chunks included."""
    from lcx.engine import Engine, EngineConfig
    from lcx.models.tiny import byte_tokenizer

    model = tiny_model("mistral", seed=7, max_position_embeddings=64, sliding_window=6).double()
    prompts = _prompts(reuse)
    want = _reference_tokens(model, None, prompts, 16)
    engine = Engine(model, byte_tokenizer(), EngineConfig(max_model_len=64, **(REUSE if reuse else {})))
    lens = []
    got, errors = _run_engine(engine, prompts, 16, each_step=lambda e: lens.append(e.layer_cache_lens))
    assert not errors and got == want
    assert [lay.window for lay, _ in engine.cache_layout.groups] == [6]
    assert engine._whole_prompt_rows  # every prefill per row on lcx's backend, in O(T * w), no [T, T] mask
    assert max(max(x) for x in lens) == 6  # a ring of the window, whatever the length
    assert engine.prefix_cache_refusal is None
    if reuse:
        assert engine.stats.prefix_cache_hit_tokens >= REUSE["prefix_block_size"] and engine.stats.prefill_chunks


@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("name", [None, "sinks(n_sink=2,window=3)", "lm_infinite(n_global=3,n_local=5)"],
                         ids=_hybrid_id)
def test_engine_hybrid_sliding_layers_hold_their_window(family, name):
    """KV bytes per layer, measured on the engine's cache after a prompt longer than the sliding
    window and while decoding past it: the sliding layers hold their window (a ring of
    `sliding_window` slots per row) whatever the length, even for the model as loaded; the global
    layers hold every key (model as loaded) or the method's window (G + L slots), so a bounded
    method makes the whole cache constant."""
    from lcx.engine import Engine, EngineConfig
    from lcx.models.tiny import byte_tokenizer

    model = _model(family)
    w = model.config.sliding_window
    method = METHODS[name] if name is not None else None
    prompt = [5 + i for i in range(3 * w)]  # 24 tokens, 3 windows
    gen = 20
    want = _reference_tokens(model, method, [prompt], gen)
    methods = {"attention": method.to_dict()} if method is not None else {}
    sliding = [_is_sliding(model, i) for i in range(model.config.num_hidden_layers)]
    seen: list[tuple[list[int], list[int], int]] = []
    try:
        engine = Engine(model, byte_tokenizer(), EngineConfig(methods=methods, max_model_len=64))
        got, errors = _run_engine(engine, [prompt], gen, each_step=lambda e: seen.append(
            (e.layer_cache_lens, e.layer_kv_cache_bytes, e.kv_cache_bytes)) if e.num_running else None)
    finally:
        unpatch_attention(model)
    assert not errors and got == want
    assert len(seen) == gen - 1  # the last step finishes the request (and drops its cache)
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * 8  # k + v, float64
    bound = None if method is None else sum(method.cache_window)
    for step, (lens, nbytes, total) in enumerate(seen):
        n = len(prompt) + step + 1  # positions held after this step's token
        for i, is_sliding in enumerate(sliding):
            if is_sliding:
                assert lens[i] == w, (step, i, lens)
            elif bound is not None:
                assert lens[i] == bound, (step, i, lens)
            else:
                assert lens[i] >= n, (step, i, lens)
            assert nbytes[i] == lens[i] * per_token
        assert total == sum(nbytes)
    if bound is not None:  # constant: every layer bounded
        assert len({t for _, _, t in seen}) == 1
    # the model card's window covers every layer's (the sliding layers' w too)
    assert engine.methods_info()["kv_window"] == (
        None if method is None else [method.cache_window[0], max(method.cache_window[1], w)])


# ------------------------------------------------------------------------------ hybrid models as loaded, fast

# (family, MethodConfig dict without attention, the engine runs the fast path): every family (a
# hybrid one takes it, the others stay as loaded), and on hybrid ones a static RoPE spec (the
# global layers' rope patched; still exact) and a length-dependent one (HF's dynamic rope rotates
# each key once at its call's basis: stays as loaded)
AS_LOADED = [(f, {}, f in HYBRID) for f in FAMILY_NAMES] + [
    (f, {"rope": {"rope_type": r, "factor": 2.0}}, r != "dynamic") for f in HYBRID for r in ("yarn", "dynamic")]


def _as_loaded_id(case):
    family, cfg, _ = case
    return family + "".join(f"-{cfg['rope']['rope_type']}" for _ in [0] if "rope" in cfg)


@pytest.mark.parametrize("case", AS_LOADED, ids=[_as_loaded_id(c) for c in AS_LOADED])
def test_engine_as_loaded_hybrid_fast_path(case, monkeypatch):
    """No attention method on a hybrid local/global model (Gemma 3): the engine runs the model as
    loaded on lcx's flash backend (`as_loaded_method`: causal on the global layers, each sliding
    layer its own window, O(T * w) instead of a masked O(T^2) pass) and equals the unpatched
    model: prompt logprobs, greedy tokens and their logprobs, and the patched model's own
    forward (what `lm_eval --model lcx` scores loglikelihoods with) past the window."""
    from lcx import MethodConfig, unpatch
    from lcx.engine import Engine, EngineConfig, SamplingParams
    from lcx.hf import current_patch
    import lcx.hf.attention_call as ac  # the per-call part, where the hooked calls look these up
    import lcx.hf.attention_patch as ap
    from lcx.hf import attention_softcap
    from lcx.hf.attention_patch import as_loaded_method
    from lcx.models.tiny import byte_tokenizer

    family, cfg, fast = case
    model = _model(family)
    prompt = [5 + (7 * i) % 50 for i in range(19)]  # 19 tokens: past Gemma's tiny window of 8
    gen = 8
    ids = torch.tensor([prompt])
    with torch.no_grad(), MethodConfig.from_dict(cfg).apply(model):  # the unpatched model (its RoPE spec)
        assert current_patch(model) is None
        want_logits = model(ids).logits.log_softmax(-1)  # [1, T, V]
        want = greedy_generate(model, ids, gen).tokens[0].tolist()
        full = torch.tensor([prompt + want[:-1]])
        want_gen_lp = model(full).logits.log_softmax(-1)[0, len(prompt) - 1:]  # [gen, V]
    rows = []  # calls of the per-row path (`loaded_rows`), with whether a mask was built for them
    real_attend = ac.attend_loaded_rows
    monkeypatch.setattr(ac, "attend_loaded_rows", lambda *a, **k: rows.append(1) or real_attend(*a, **k))
    try:
        engine = Engine(model, byte_tokenizer(), EngineConfig(methods=cfg, max_model_len=64))
        out = engine.generate([prompt], SamplingParams(max_tokens=gen, ignore_eos=True, logprobs=0,
                                                      prompt_logprobs=0))[0]
        patch = current_patch(model)
        layers = layer_methods(model)
        with torch.no_grad():
            got_logits = model(ids).logits.log_softmax(-1)
            with engine.forward_scope(ids):  # what the lm-eval model scores loglikelihoods in
                scoped_logits = model(ids).logits.log_softmax(-1)
    finally:
        unpatch(model)  # attention and RoPE: the model as loaded for the other tests
        ap.remove_decode_hook(model)
    assert out.token_ids == want
    got_plp = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]], dtype=torch.float64)
    want_plp = want_logits[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(got_plp, want_plp, rtol=1e-5, atol=1e-5)
    got_lp = torch.tensor([lp.logprob for lp in out.logprobs], dtype=torch.float64)
    torch.testing.assert_close(got_lp, want_gen_lp.gather(-1, torch.tensor(want)[:, None])[:, 0],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scoped_logits, want_logits, rtol=1e-5, atol=1e-5)
    if not fast:
        assert patch is None and engine.methods.attention is None
        # a hybrid left as loaded (length-dependent RoPE): every prefill still runs per row on
        # lcx's backend, each sliding layer its own window, no [T, T] mask (`loaded_rows`)
        assert engine._whole_prompt_rows == (family in HYBRID)
        assert bool(rows) == (family in HYBRID)
        return
    assert not rows
    assert as_loaded_method(model, "flash") == causal()
    # (soft-capped calls, Gemma 2's, on the backend that caps them: torch's fused kernels do not)
    backend = "blockwise" if attention_softcap(model) else "flash"
    assert (patch.method, patch.backend, patch.layers) == (causal(), backend, "global")
    w = model.config.sliding_window
    assert layers == [sliding_window(window=w) if _is_sliding(model, i) else causal() for i in range(len(layers))]
    assert engine.methods_info()["attention"] == {"type": "causal"}


def test_as_loaded_method_refusals():
    """`as_loaded_method` leaves a model as loaded where lcx does not run it faster: layers all
    alike (nothing quadratic to save), an unknown backend. A soft-capping hybrid (Gemma 2) runs
    on lcx's attention too, its calls on the backend that caps (`blockwise` for `flash`)."""
    from lcx.hf.attention_patch import as_loaded_method

    for family in FAMILY_NAMES:
        assert as_loaded_method(_model(family), "flash") == (causal() if family in HYBRID else None), family
    for family in HYBRID:
        model = _model(family)
        assert as_loaded_method(model, "no-such-backend") is None
        cap = model.config.attn_logit_softcapping if hasattr(model.config, "attn_logit_softcapping") else None
        model.config.attn_logit_softcapping = 50.0
        try:
            assert as_loaded_method(model, "flash") == causal()
            with attention_patched(model, causal(), backend="flash"):
                assert current_patch(model).backend == "blockwise", family
        finally:
            model.config.attn_logit_softcapping = cap


def test_patch_unpatch_leaves_every_family_as_loaded():
    for family in FAMILY_NAMES:
        # a fresh model: the shared ones carry the engine's decode hook from the engine tests
        model = tiny_model(family, seed=7, max_position_embeddings=64).double()
        ids = _ids(7)
        impl = model.config._attn_implementation
        with torch.no_grad():
            want = model(ids).logits
            patch_attention(model, sliding_window(window=2))
            unpatch_attention(model)
            got = model(ids).logits
        assert model.config._attn_implementation == impl
        assert all("forward" not in vars(attn) for attn in attention_layers(model))
        assert "forward" not in vars(decoder(model))  # (the decoder's per-call-inputs hook is gone too)
        assert torch.equal(got, want), family


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_per_layer_capabilities(family):
    """What a decode loop needs per layer (`lcx.hf`): each layer's method (its cache window), the
    family's own windows, each layer's RoPE basis (the sliding layers' own base)."""
    from lcx.hf import layer_rope_bases, layer_rope_types, own_windows

    model = _model(family)
    types_ = model.config.layer_types
    w = model.config.sliding_window
    assert own_windows(model) == [w if t == "sliding_attention" else None for t in types_]
    rope = model.config.rope_parameters
    per_type = all(t in rope for t in set(types_))  # Gemma 3: a basis per layer type; Ministral: one
    assert layer_rope_types(model) == (types_ if per_type else [None] * len(types_))
    bases = layer_rope_bases(model)
    for t, (inv, af) in zip(types_, bases):
        theta = rope[t]["rope_theta"] if per_type else rope["rope_theta"]
        torch.testing.assert_close(inv, 1.0 / theta ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16),
                                   rtol=1e-6, atol=0)
    method = METHODS[method_id(FIRST["lm_infinite"])]
    with attention_patched(model, method):
        assert layer_methods(model) == [sliding_window(window=w) if t == "sliding_attention" else method
                                        for t in types_]
        if per_type:
            with pytest.raises(ValueError, match="layer_type"):
                rope_basis(model, 8)  # no one basis serves every layer
        else:
            rope_basis(model, 8)  # one basis serves every layer
    with attention_patched(model, method, layers="all"):
        assert layer_methods(model) == [method] * len(types_)
    assert layer_methods(model) == [None] * len(types_)


@pytest.mark.slow
def test_gemma3_270m_shape():
    """Gemma-3-270m's attention shape (18 layers, 15 sliding at 512 and 3 global, 4 query heads /
    1 KV head of 256, two RoPE bases from transformers' own defaults; random weights, small
    vocabulary), past the window: a causal patch equals transformers, and bounded decoding equals
    full-cache decoding with each layer bounded by its own method (511 / G + L - 1 keys)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lcx.methods import lm_infinite

    cfg = AutoConfig.for_model("gemma3_text", vocab_size=512, hidden_size=640, intermediate_size=2048,
                               num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                               sliding_window=512, max_position_embeddings=32768, query_pre_attn_scalar=256)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(3, 512, (1, 600), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        with attention_patched(model, causal()):
            got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32
    method = lm_infinite(4, 128)
    with attention_patched(model, method):
        full = greedy_generate(model, ids[:, :560], 6)
        cache = BoundedKVCache(method)
        bounded = greedy_generate(model, ids[:, :560], 6, cache=cache)
    assert torch.equal(bounded.tokens, full.tokens)
    assert [int(layer.keys.shape[-2]) for layer in cache.layers] == [
        511 if t == "sliding_attention" else 4 + 128 - 1 for t in cfg.layer_types]


@pytest.mark.slow
def test_gemma3_270m_shape_engine_as_loaded():
    """Gemma-3-270m's shape as loaded (random weights, small vocabulary, float32), a 600-token
    prompt past the 512 window: the engine's fast path (sliding layers on flash in O(T * w))
    scores the prompt and decodes as transformers' own masked pass does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lcx.engine import Engine, EngineConfig, SamplingParams
    from lcx.hf import current_patch
    from lcx.models.tiny import byte_tokenizer

    cfg = AutoConfig.for_model("gemma3_text", vocab_size=512, hidden_size=640, intermediate_size=2048,
                               num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                               sliding_window=512, max_position_embeddings=32768, query_pre_attn_scalar=256,
                               attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    prompt = torch.randint(3, 512, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want_lp = model(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    want = greedy_generate(model, ids, 4).tokens[0].tolist()
    engine = Engine(model, byte_tokenizer(), EngineConfig(max_model_len=1024))
    assert current_patch(model).method == causal()
    out = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0))[0]
    got_lp = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-4, atol=1e-4)
    assert out.token_ids == want


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_perplexity_scores_a_hybrid_model_as_loaded_on_the_fast_path(family):
    """`lcx eval ppl` with no method (`lcx.eval.perplexity._patched`): a hybrid model (Gemma 3)
    runs its sliding layers on lcx's backend as the engine does, a model whose layers are alike
    stays as loaded; the score equals the unpatched model's, past the sliding window."""
    from lcx.eval.perplexity import _patched, perplexity_of_stream
    from lcx.hf import current_patch

    model = _model(family)
    ids = torch.tensor([5 + (7 * i) % 50 for i in range(19)])  # one window of 19: past Gemma's tiny window of 8
    with torch.no_grad():
        logp = model(ids[None]).logits.log_softmax(-1)[0]
    want = -logp[:-1].gather(-1, ids[1:, None]).mean().item()
    with _patched(model, None):
        assert (current_patch(model) is not None) == (family == "gemma3_text")
    assert current_patch(model) is None  # restored on exit
    (res,) = perplexity_of_stream(model, ids, [19], progress=False).values()
    assert res.windows == 1 and res.nll == pytest.approx(want, abs=1e-5)
