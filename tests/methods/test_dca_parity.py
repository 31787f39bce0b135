"""Parity of lcx's DCA with the authors' published algorithm (issue 77, item 3).

`_chunkllama_prefill` and `_chunkllama_decode` below restate HKUNLP/ChunkLlama's
`chunkllama_attn_replace.py` independently of `lcx.methods.dca`: its three RoPE tables (`q_t`,
`qc_t` clamped at chunk_size, `k_t = t % chunk_len`), keys rotated at `k_t`, the prefill loop over
chunks of `chunk_len` queries with its three flash passes (intra causal, successive unmasked over
the previous chunk, inter unmasked over every older key with the query at `qc_t[chunk_len - 1]`),
merged as `merge_attn_outputs` merges them (softmax weights of the passes' log-sum-exps), and the
decode branch (three score blocks, one softmax). Flash calls become dense float64 softmax with
their log-sum-exp; the merge runs in float64 (ChunkLlama casts its weights to bfloat16).

On random-weight float64 Llama and Qwen2 models (2 layers, GQA), a model whose attention runs the
restatement (registered with transformers' attention interface, fed the unrotated q/k/v) gives
the same logits as the model under `lcx.patched(model, {"attention": {"type": "dca", ...}})` to
1e-6, at odd lengths; and lcx's engine decodes greedily what the restated model decodes.
"""

from __future__ import annotations

import pytest
import torch

import lcx
from lcx.attention import Rotary
from lcx.methods import dca
from lcx.rope import compute_inv_freq

ATTN = "chunkllama_restated"
VOCAB = 259  # lcx.models.tiny's byte tokenizer (the engine test decodes with it)
LENGTHS = [1, 7, 33, 61]
# (chunk_size, local_window): ChunkLlama's own shape (3/4 L0 and L0/16 for L0 = 32), a small
# chunk with many chunks in 61 tokens, and local_window >= chunk_len (qc never clamped)
PARAMS = [(24, 2), (8, 3), (7, 4)]


# ---------------------------------------------------------------------- the restatement
def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary_pos_emb(x, cos, sin, position_ids):
    """ChunkLlama's `apply_rotary_pos_emb`: x `[bs, heads, T, D]`, tables `[N, D]`, ids `[bs, T]`."""
    cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def _tables(t, inv_freq):
    freqs = torch.outer(t.to(torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _chunkllama_tables(inv_freq, chunk_size, local_window, seq_len):
    """`ChunkLlamaRotaryEmbedding._set_cos_sin_cache` (scaling_factor 1, no mscale)."""
    chunk_len = chunk_size - local_window
    q_t = torch.arange(chunk_len)
    qc_t = (torch.arange(chunk_len) + chunk_len).clamp(max=chunk_size)
    k_t = torch.arange(seq_len) % chunk_len
    return (*_tables(q_t, inv_freq), *_tables(qc_t, inv_freq), *_tables(k_t, inv_freq))


def _flash(q, k, v, causal, scale):
    """`do_flash_attn`: (out `[bs, H, Tq, D]`, softmax_lse `[bs, H, Tq]`); causal as flash-attn's
    (bottom-right aligned; ChunkLlama only calls it with Tq == Tk)."""
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        Tq, Tk = q.shape[-2], k.shape[-2]
        i = torch.arange(Tq)[:, None] + (Tk - Tq)
        s = s.masked_fill(torch.arange(Tk)[None, :] > i, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _merge_attn_outputs(flash_results):
    """`merge_attn_outputs` (the fixed, max-subtracted version)."""
    outs_all = [flash_results[0][0]]
    for per_chunk in flash_results[1:]:
        outs = torch.stack([o for o, _ in per_chunk])
        logits = torch.stack([lse for _, lse in per_chunk])
        w = torch.exp(logits - logits.max(0).values.unsqueeze(0))
        w = w / w.sum(0)
        outs_all.append((outs * w.unsqueeze(-1)).sum(0))
    return torch.cat(outs_all, dim=2)


def _chunkllama_prefill(q, k, v, inv_freq, chunk_size, local_window, scale):
    """The `not has_kv_cache` branch of ChunkLlama's `forward`: q `[bs, H, T, D]` and k, v
    (kv heads already repeated) unrotated, positions 0..T-1 -> out `[bs, H, T, D]`."""
    chunk_len = chunk_size - local_window
    bs, _, kv_seq_len, _ = k.shape
    q_cos, q_sin, qc_cos, qc_sin, k_cos, k_sin = _chunkllama_tables(inv_freq, chunk_size, local_window, kv_seq_len)
    position_ids = torch.arange(kv_seq_len)[None].expand(bs, -1)
    key_states = _apply_rotary_pos_emb(k, k_cos, k_sin, position_ids)
    position_ids = position_ids % chunk_len

    flash_results = []
    q_states_intra = _apply_rotary_pos_emb(q[:, :, :chunk_len], q_cos, q_sin, position_ids[:, :chunk_len])
    k_states_prev, v_states_prev = key_states[:, :, :chunk_len], v[:, :, :chunk_len]
    flash_results.append(_flash(q_states_intra, k_states_prev, v_states_prev, True, scale))
    remain_len = kv_seq_len - chunk_len
    while remain_len > 0:
        flash_per_chunk = []
        begin = kv_seq_len - remain_len
        curr_chunk_len = min(chunk_len, remain_len)
        end = begin + curr_chunk_len
        q_states_intra = _apply_rotary_pos_emb(q[:, :, begin:end], q_cos, q_sin, position_ids[:, begin:end])
        k_states_intra, v_states_intra = key_states[:, :, begin:end], v[:, :, begin:end]
        flash_per_chunk.append(_flash(q_states_intra, k_states_intra, v_states_intra, True, scale))
        q_states_succ = _apply_rotary_pos_emb(q[:, :, begin:end], qc_cos, qc_sin, position_ids[:, begin:end])
        flash_per_chunk.append(_flash(q_states_succ, k_states_prev, v_states_prev, False, scale))
        if begin - k_states_prev.size(-2) > 0:
            prev_len = k_states_prev.size(-2)
            inter_ids = position_ids[:, chunk_len - 1][:, None].repeat(1, curr_chunk_len)
            q_states_inter = _apply_rotary_pos_emb(q[:, :, begin:end], qc_cos, qc_sin, inter_ids)
            flash_per_chunk.append(_flash(q_states_inter, key_states[:, :, :begin - prev_len],
                                          v[:, :, :begin - prev_len], False, scale))
        flash_results.append(flash_per_chunk)
        k_states_prev, v_states_prev = k_states_intra, v_states_intra
        remain_len = remain_len - chunk_len
    return _merge_attn_outputs(flash_results)


def _chunkllama_decode(q, k, v, inv_freq, chunk_size, local_window, scale):
    """The `has_kv_cache` branch for one new token: q `[bs, H, 1, D]` at position kv_len - 1, k, v
    `[bs, H, kv_len, D]` unrotated (ChunkLlama caches them rotated at `k_t`) -> `[bs, H, 1, D]`."""
    chunk_len = chunk_size - local_window
    kv_seq_len = k.shape[2]
    q_cos, q_sin, qc_cos, qc_sin, k_cos, k_sin = _chunkllama_tables(inv_freq, chunk_size, local_window, kv_seq_len)
    key_states = _apply_rotary_pos_emb(k, k_cos, k_sin, torch.arange(kv_seq_len)[None])
    position_ids = torch.tensor([[kv_seq_len - 1]]) % chunk_len
    chunk_num_curr = (kv_seq_len - 1) // chunk_len
    q_states_intra = _apply_rotary_pos_emb(q, q_cos, q_sin, position_ids)
    k_states_intra = key_states[:, :, chunk_len * chunk_num_curr:kv_seq_len]
    attn_scores = [q_states_intra @ k_states_intra.transpose(2, 3) * scale]
    if chunk_num_curr >= 1:
        q_states_succ = _apply_rotary_pos_emb(q, qc_cos, qc_sin, position_ids)
        k_states_succ = key_states[:, :, chunk_len * (chunk_num_curr - 1):chunk_len * chunk_num_curr]
        attn_scores = [q_states_succ @ k_states_succ.transpose(2, 3) * scale] + attn_scores
    if chunk_num_curr >= 2:
        q_states_inter = _apply_rotary_pos_emb(q, qc_cos, qc_sin, torch.tensor([[chunk_len - 1]]))
        k_states_inter = key_states[:, :, :chunk_len * (chunk_num_curr - 1)]
        attn_scores = [q_states_inter @ k_states_inter.transpose(2, 3) * scale] + attn_scores
    return torch.softmax(torch.cat(attn_scores, dim=-1), dim=-1) @ v


# ---------------------------------------------------------------------- attention level
@pytest.mark.parametrize("chunk_size,local_window", PARAMS)
@pytest.mark.parametrize("T", LENGTHS + [2, 24, 48])
def test_restatement_equals_dca_attention(T, chunk_size, local_window):
    g = torch.Generator().manual_seed(T)
    D, H, HKV = 16, 4, 2
    q = torch.randn(2, T, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, T, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    inv_freq = compute_inv_freq({"rope_type": "default", "rope_theta": 100.0}, D)[0]
    rep = lambda x: x.repeat_interleave(H // HKV, dim=2).transpose(1, 2)  # noqa: E731  # [bs, H, T, D]
    want = _chunkllama_prefill(q.transpose(1, 2), rep(k), rep(v), inv_freq, chunk_size, local_window, 0.25)
    method = dca(chunk_size, local_window)
    for backend in ("ref", "blockwise", "flash"):
        got = method.attend(q, k, v, rotary=Rotary(inv_freq), backend=backend, scale=0.25)
        torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-10, atol=1e-10)
    # ChunkLlama's decode branch for the last token = lcx's one-query call over the same keys
    last = _chunkllama_decode(q[:, -1:].transpose(1, 2), rep(k), rep(v), inv_freq, chunk_size, local_window, 0.25)
    got = method.attend(q[:, -1:], k, v, rotary=Rotary(inv_freq), scale=0.25)
    torch.testing.assert_close(got, last.transpose(1, 2), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, want[:, :, -1:], rtol=1e-10, atol=1e-10)  # its decode = its prefill


# ---------------------------------------------------------------------- model level
def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      rope_theta=1000.0, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).double().eval()


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
                      rope_theta=1000.0, use_sliding_window=False, attn_implementation="eager")
    torch.manual_seed(1)
    return Qwen2ForCausalLM(cfg).double().eval()


MODELS = {"llama": _llama, "qwen2": _qwen2}


class _Restated:
    """Run a model's attention as the restatement: forward hooks keep each layer's unrotated q and
    k (the projections' outputs; Llama and Qwen2 have no q/k norm), and the attention function
    registered as `ATTN` computes ChunkLlama's prefill on them (the model's own rotation of q/k is
    discarded; v is unaffected by RoPE)."""

    def __init__(self, model, chunk_size, local_window):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        self.model, self.params, self.unrotated = model, (chunk_size, local_window), {}
        AttentionInterface.register(ATTN, self.attention)
        AttentionMaskInterface.register(ATTN, lambda **kw: None)
        self.inv_freq = model.model.rotary_emb.inv_freq.to(torch.float64)  # the model's basis, as lcx takes it

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        bs, H, T, D = query.shape
        q, k = (self.unrotated[module][name].view(bs, T, -1, D).transpose(1, 2) for name in ("q", "k"))
        rep = H // k.shape[1]
        out = _chunkllama_prefill(q, k.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1),
                                  self.inv_freq, *self.params, scaling)
        return out.transpose(1, 2), None  # [bs, T, H, D]

    def logits(self, ids):
        hooks = []
        for layer in self.model.model.layers:
            attn = layer.self_attn
            self.unrotated[attn] = {}
            for name, proj in (("q", attn.q_proj), ("k", attn.k_proj)):
                hooks.append(proj.register_forward_hook(
                    lambda mod, inp, out, a=attn, n=name: self.unrotated[a].__setitem__(n, out)))
        before = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTN)
        try:
            with torch.no_grad():
                return self.model(ids).logits
        finally:
            self.model.set_attn_implementation(before)
            for h in hooks:
                h.remove()


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.mark.parametrize("chunk_size,local_window", PARAMS)
def test_model_logits_equal_the_restatement(model, chunk_size, local_window):
    restated = _Restated(model, chunk_size, local_window)
    cfg = {"attention": {"type": "dca", "chunk_size": chunk_size, "local_size": local_window}}
    for T in LENGTHS:
        ids = torch.randint(3, VOCAB, (2, T), generator=torch.Generator().manual_seed(T))
        want = restated.logits(ids)
        for backend in ("blockwise", "flash"):
            with lcx.patched(model, {**cfg, "backend": backend}), torch.no_grad():
                got = model(ids).logits
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        with torch.no_grad():
            vanilla = model(ids).logits
        if T > dca(chunk_size, local_window).causal_from_start():  # not vacuous: DCA changed the model
            assert (vanilla - want).abs().max() > 1e-4
        else:  # (up to HF's float32 rotary angles)
            torch.testing.assert_close(vanilla, want, rtol=1e-4, atol=1e-4)


def test_engine_decodes_what_the_restatement_decodes(model):
    """lcx's engine (cache of unrotated keys, `attend` per step) generates greedily what the
    restated model generates by full recomputation, past several chunk boundaries."""
    from lcx.engine import Engine, EngineConfig, SamplingParams
    from lcx.models.tiny import byte_tokenizer

    chunk_size, local_window = 8, 3
    restated = _Restated(model, chunk_size, local_window)
    prompt = torch.randint(3, VOCAB, (1, 19), generator=torch.Generator().manual_seed(5))
    ids = prompt
    for _ in range(12):
        ids = torch.cat((ids, restated.logits(ids)[:, -1:].argmax(-1)), dim=1)
    engine = Engine(model, byte_tokenizer(), EngineConfig(
        methods={"attention": {"type": "dca", "chunk_size": chunk_size, "local_size": local_window}}))
    out = engine.generate([prompt[0].tolist()], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == ids[0, 19:].tolist()
