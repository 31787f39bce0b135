"""Parity of lcx's STRING with the authors' code (issue 77, item 3), on random-weight float64
Llama and Qwen2 models (transformers' own classes, 2 layers, 4/2 heads of 16).

The authors' algorithm is restated here, independently of `lcx.methods.string`, from
github.com/HKUNLP/STRING: `string_for_llama.py` (`forward`, `string_flash_forward`,
`do_flash_decoding`, `RotaryEmbedding._set_cos_sin_cache`, `replace_with_string`) and
`string_for_qwen2.py` (`_compute_yarn_parameters`, `replace_with_string`). It runs as the models'
attention function (transformers' `AttentionInterface`), on q/k left unrotated by the layer (its
`apply_rotary_pos_emb` made the identity for the run), so it rotates them itself as the official
code does: cos and sin tables x attention_factor = 0.1 ln 2 + 1, q at p and at p - S + W, k at p.
flash-attn's two calls are written out densely with flash's conventions (bottom-right aligned
causal mask, `window_size=[S, 0]` = the S + 1 keys i - S..i, log-sum-exp out).

What is compared (logits, float64, to 1e-6):
- official PREFILL (the whole sequence in one call) == lcx `string(S, W, overlap=True)`;
- official DECODE (a one-token prompt, then every token decoded against the cache) == lcx
  `string(S, W)` prefilled in one call, and == lcx decoding the same way;
- the official code's constant attention factor as lcx states it, the RoPE's:
  `{"rope_type": "yarn", "factor": 1, "attention_factor": 0.1 ln 2 + 1}`; on Qwen2 also the
  authors' Qwen2 recipe, YaRN's frequencies at factor (L / L0)(1 - 0.33) with that constant
  factor (their code hard-codes Qwen2's L0 = 32768; here the tiny model's L0).
Two deviations of the HF code are not restated: its decode reads the cache out of range below S
keys (the restatement takes the last min(S, n) keys, as the vLLM fork does), and its prefill at
exactly S keys runs flash on an empty key set (no grid length equals an S); lse stays float64
(the code casts it to float32 for its bf16 runs).
"""

from __future__ import annotations

import math

import pytest
import torch

import lcx
from lcx.methods.string import ATTENTION_FACTOR

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402

LENGTHS = (1, 7, 33, 61)
STRINGS = ((5, 2), (16, 3))  # (S, W): small, so the shift is exercised at every length but 1
L0 = 16  # the tiny models' max_position_embeddings (Qwen2's YaRN recipe scales from it)
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM, modeling_llama),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM, modeling_qwen2)}
IMPLEMENTATION = "string_official_restated"
TOL = 1e-6


# ----------------------------------------------------------------------- the authors' code, restated
def official_inv_freq(D: int, base: float, yarn_factor: float | None) -> torch.Tensor:
    """`_compute_default_rope_parameters`, or `string_for_qwen2._compute_yarn_parameters` (beta_fast
    32, beta_slow 1, original length L0), in float64."""
    pos_freqs = base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    if yarn_factor is None:
        return 1.0 / pos_freqs

    def correction_dim(num_rotations):
        return (D * math.log(L0 / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(32)), 0)
    high = min(math.ceil(correction_dim(1)), D - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(D // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    extrapolation_mask = 1 - ramp
    return (1.0 / (yarn_factor * pos_freqs)) * (1 - extrapolation_mask) + (1.0 / pos_freqs) * extrapolation_mask


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _official_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_pos_emb` with `RotaryEmbedding`'s tables: emb = cat(freqs, freqs), cos and sin
    x attention_factor. x `[B, T, H, D]`, positions `[T]`."""
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = ATTENTION_FACTOR * emb.cos(), ATTENTION_FACTOR * emb.sin()
    return x * cos[None, :, None, :] + _rotate_half(x) * sin[None, :, None, :]


def _flash(q, k, v, *, causal: bool, left: int = -1):
    """flash_attn_func / flash_attn_with_kvcache, densely: q `[B, Tq, H, D]`, k/v `[B, Tk, Hkv, D]`;
    query i sees keys j <= i + Tk - Tq (causal) and j >= i + Tk - Tq - left (left >= 0); softmax
    scale D^-0.5; returns (out `[B, Tq, H, D]`, lse `[B, H, Tq]`); no key: out 0, lse -inf."""
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    k, v = (x.repeat_interleave(H // x.shape[2], dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    i = torch.arange(Tq)[:, None] + Tk - Tq
    j = torch.arange(Tk)[None, :]
    seen = torch.ones(Tq, Tk, dtype=torch.bool)
    if causal:
        seen &= j <= i
    if left >= 0:
        seen &= j >= i - left
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]))
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def string_flash_forward(q1, q2, k, v, diag_size):
    """`string_flash_forward` (the prefill): a sliding-window pass of window_size [S, 0] at true
    positions and a causal pass of the last N - S shifted queries over the first N - S keys,
    merged with the code's sigmoid weights."""
    diag_out, diag_lse = _flash(q1, k, v, causal=True, left=diag_size)
    triangle_len = k.shape[1] - diag_size
    if triangle_len <= 0:
        return diag_out
    shifted_out, shifted_lse = _flash(q2[:, -triangle_len:], k[:, :triangle_len], v[:, :triangle_len], causal=True)
    L, N = diag_out.size(1), shifted_out.size(1)
    S = L - N
    diag_out_head, diag_lse_tail, diag_out_tail = diag_out[:, :S], diag_lse[:, :, S:], diag_out[:, S:]
    lse_gap = (1 / (1 + torch.exp(diag_lse_tail - shifted_lse))).transpose(1, 2).unsqueeze(-1)
    lse_gap_re = (1 / (1 + torch.exp(shifted_lse - diag_lse_tail))).transpose(1, 2).unsqueeze(-1)
    return torch.cat([diag_out_head, diag_out_tail * lse_gap_re + shifted_out * lse_gap], dim=1)


def string_decode(q1, q2, k_cache, v_cache, diag_size):
    """`forward`'s decode branch: the last S cached keys with the query at p, the other keys with
    the query at p - S + W, merged with the code's sigmoid weights (batch 1, as the code)."""
    kv_seq_len = k_cache.shape[1]
    shifted_size = kv_seq_len - diag_size
    out1, lse1 = _flash(q1, k_cache[:, max(shifted_size, 0):], v_cache[:, max(shifted_size, 0):], causal=False)
    out2, lse2 = _flash(q2, k_cache[:, :max(shifted_size, 0)], v_cache[:, :max(shifted_size, 0)], causal=False)
    gap21 = 1 / (1 + torch.exp(lse2 - lse1))
    gap12 = 1 / (1 + torch.exp(lse1 - lse2))
    return out1 * gap21 + torch.nan_to_num(out2) * gap12  # [1, 1, H, D] * [1, H, 1]


OFFICIAL: dict = {}  # the restated run's parameters: S, W, inv_freq


def official_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The restatement as a transformers attention function: query `[B, H, Tq, D]`, key/value
    `[B, Hkv, Tk, D]` UNROTATED (the run's identity rotation), the queries the last Tq of the keys."""
    S, W, inv_freq = OFFICIAL["S"], OFFICIAL["W"], OFFICIAL["inv_freq"]
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, T, H, D]
    Tq, Tk = q.shape[1], k.shape[1]
    position_ids = torch.arange(Tk - Tq, Tk)
    k = _official_rope(k, torch.arange(Tk), inv_freq)  # the cache holds keys rotated at their positions
    q1 = _official_rope(q, position_ids, inv_freq)
    q2 = _official_rope(q, position_ids - S + W, inv_freq)
    if Tq == Tk:  # has_kv_cache = q_len != kv_seq_len
        out = string_flash_forward(q1, q2, k, v, S)
    else:
        assert Tq == 1, "the official code decodes one token at a time"
        out = string_decode(q1, q2, k, v, S)
    return out, None


AttentionInterface.register(IMPLEMENTATION, official_attention)


# ----------------------------------------------------------------------- the models and runs
def _model(family: str):
    config_cls, model_cls, _ = FAMILIES[family]
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = config_cls(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=L0,
                     rope_parameters=rope, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_cls(cfg).to(torch.float64).eval()
    if family == "qwen2":  # q/k/v biases: random, so they matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model


def _ids(n: int) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(n))


def _lcx_config(S, W, overlap, yarn_factor, backend="flash"):
    rope = {"rope_type": "yarn", "factor": yarn_factor or 1.0, "attention_factor": ATTENTION_FACTOR}
    return {"rope": rope, "attention": {"type": "string", "shifted_offset": S, "local_value": W, "overlap": overlap},
            "backend": backend}


def _official_run(model, family, S, W, yarn_factor, monkeypatch, fn):
    OFFICIAL.update(S=S, W=W, inv_freq=official_inv_freq(16, 10000.0, yarn_factor))
    before = model.config._attn_implementation
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(FAMILIES[family][2], "apply_rotary_pos_emb", lambda q, k, cos, sin, *a, **kw: (q, k))
        model.set_attn_implementation(IMPLEMENTATION)
        try:
            return fn()
        finally:
            model.set_attn_implementation(before)


def _decode_logits(model, ids):
    """A one-token prompt, then every token decoded against the cache: each row's logits `[1, n, V]`."""
    out = model(ids[:, :1], use_cache=True)
    cache, rows = out.past_key_values, [out.logits]
    for t in range(1, ids.shape[1]):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits)
    return torch.cat(rows, dim=1)


def _factor(recipe, n):
    return None if recipe is None else n / L0 * (1 - 0.33)


# (family, recipe, length); recipe: Qwen2's YaRN at (L / L0)(1 - 0.33), at the lengths it scales (> 1)
CASES = [(f, r, n) for f, r in [("llama", None), ("qwen2", None), ("qwen2", "recipe")] for n in LENGTHS
         if r is None or _factor(r, n) > 1]
CASE_IDS = [f"{f}-{r or 'rope'}-n{n}" for f, r, n in CASES]


@pytest.mark.parametrize("S,W", STRINGS, ids=[f"S{s}W{w}" for s, w in STRINGS])
@pytest.mark.parametrize("family,recipe,n", CASES, ids=CASE_IDS)
def test_lcx_overlap_equals_official_prefill(family, recipe, n, S, W, monkeypatch):
    model = _model(family)
    ids = _ids(n)
    f = _factor(recipe, n)
    want = _official_run(model, family, S, W, f, monkeypatch, lambda: model(ids).logits)
    with torch.no_grad(), lcx.patched(model, _lcx_config(S, W, True, f)):
        got = model(ids).logits
    assert (got - want).abs().max() <= TOL
    if n > S:  # the shift is exercised: the plain model differs
        with torch.no_grad():
            assert (model(ids).logits - want).abs().max() > 1e3 * TOL


@pytest.mark.parametrize("S,W", STRINGS, ids=[f"S{s}W{w}" for s, w in STRINGS])
@pytest.mark.parametrize("family,recipe,n", CASES, ids=CASE_IDS)
def test_lcx_equals_official_decode(family, recipe, n, S, W, monkeypatch):
    """The official decode path at every row == lcx's STRING (the paper's matrix), prefilled in one
    call on the flash backend and decoded token by token on blockwise."""
    model = _model(family)
    ids = _ids(n)
    f = _factor(recipe, n)
    want = _official_run(model, family, S, W, f, monkeypatch, lambda: _decode_logits(model, ids))
    with torch.no_grad(), lcx.patched(model, _lcx_config(S, W, False, f)):
        got = model(ids).logits
    assert (got - want).abs().max() <= TOL
    with torch.no_grad(), lcx.patched(model, _lcx_config(S, W, False, f, backend="blockwise")):
        got = _decode_logits(model, ids)
    assert (got - want).abs().max() <= TOL
    if n > S + 1:  # the two official paths differ (the key at distance S counted twice in prefill)
        prefill = _official_run(model, family, S, W, f, monkeypatch, lambda: model(ids).logits)
        assert (prefill - want).abs().max() > 1e3 * TOL
