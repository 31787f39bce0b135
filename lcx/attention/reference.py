"""Exact reference attention: the definition every backend is tested against.

Two entry points, both `[B, T, H, D]` in, `[B, Tq, H, Dv]` out (plus lse `[B, H, Tq]`):

- `attention_ref(q, k, v, *, mask, alibi_slopes, activation, scale, softcap, q_offset)` takes
  q/k ALREADY rotated (or position-free): logits `s_ij = cap(scale * q_i.k_j) - m_h |i - j|`,
  cap(s) = softcap * tanh(s / softcap) with a `softcap` (Gemma 2), else s.
- `lambda_attention_ref(q, k, v, *, rotary, n_global, n_local, limit_distance, ...)` takes q/k
  UNROTATED: LM-Infinite's Λ-mask with its distance cap (see `lcx.attention.rotary`);
  `lambda_topk_attention_ref(..., top_k, top_k_insert_at)` adds the paper's top-k middle keys
  to the last query.

Activation over the visible keys V(i) (mask, `lcx.masks` convention):
  softmax: o_i = sum_j exp(s_ij) v_j / Z_i,   Z_i = sum_{j in V(i)} exp(s_ij)
  sigmoid: o_i = sum_j sigmoid(s_ij) v_j        (SWAT; no normalisation), Z_i = sum sigmoid(s_ij)
and lse_i = log Z_i: the log of the row's total weight (what `merge_attention` combines).
A row with no visible key gives o_i = 0 and lse_i = -inf.

Precision: q.k and P.v run in the input dtype (float64 in, float64 throughout); mask, bias,
activation and lse run in at least float32, as a low-precision kernel would. Run it in
float64 to check a backend, and in the backend's dtype to measure the error budget
(`lcx.testing`).
"""

from __future__ import annotations

import math

import torch

from lcx.masks import MaskMod, causal_mask, lambda_mask, mask_matrix
from lcx.masks.base import check_count

from .alibi import alibi_bias
from .rotary import rotate_to, lambda_inputs, rotate_qk
from .spec import AttentionSpec, LambdaParams, Rotary, check_call, scale_of, soft_cap

NEG_INF = float("-inf")


def normalize_scores(
    scores: torch.Tensor, visible: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and lse from logits: scores `[..., Tq, n]`, visible bool broadcastable.

    The activation step of the definition above (shared by the blockwise backend).
    Returns weights `[..., Tq, n]` (0 where masked) and lse `[..., Tq]`.
    """
    s = scores.masked_fill(~visible, NEG_INF)
    if activation == "softmax":
        m = s.amax(dim=-1, keepdim=True).detach()
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # empty rows
        e = torch.exp(s - m)
        z = e.sum(dim=-1, keepdim=True)
        lse = (m + torch.log(z)).squeeze(-1)  # log 0 = -inf on empty rows
        return e / torch.where(z > 0, z, torch.ones_like(z)), lse
    if activation == "sigmoid":
        return torch.sigmoid(s), torch.logsumexp(torch.nn.functional.logsigmoid(s), dim=-1)
    raise ValueError(f"activation={activation!r}")


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def gqa_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]` -> `[B, H, Tq, Tk]` in q's dtype (GQA by repeat)."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)  # [B, Tk, H, D]
    return torch.einsum("bqhd,bkhd->bhqk", q, k)


def gqa_weighted_values(
    weights: torch.Tensor, lse: torch.Tensor, v: torch.Tensor, n_heads: int, return_lse: bool
):
    v = v.repeat_interleave(n_heads // v.shape[2], dim=2)  # [B, Tk, H, Dv]
    out = torch.einsum("bhqk,bkhd->bqhd", weights.to(v.dtype), v)  # [B, Tq, H, Dv]
    return (out, lse) if return_lse else out


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: MaskMod | None = causal_mask,
    alibi_slopes=None,
    activation: str = "softmax",
    scale: float | None = None,
    q_offset: int | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
):
    """Attention of rotated q `[B, Tq, H, D]` on k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]`.

    Returns out `[B, Tq, H, Dv]` (q's dtype), and lse `[B, H, Tq]` (>= float32) if asked.
    """
    spec = AttentionSpec(mask=mask, activation=activation, alibi_slopes=alibi_slopes, scale=scale, softcap=softcap)
    off = check_call(q, k, v, spec, q_offset, None)
    Tq, Tk, H = q.shape[1], k.shape[1], q.shape[2]
    wide = _wide(q.dtype)
    s = soft_cap(gqa_scores(q, k).to(wide) * scale_of(spec, q.shape[-1]), spec.softcap)  # [B, H, Tq, Tk]
    if spec.alibi_slopes is not None:
        slopes = torch.tensor(spec.alibi_slopes, dtype=torch.float64, device=q.device)
        i = torch.arange(off, off + Tq, device=q.device)
        s = s + alibi_bias(slopes, i, torch.arange(Tk, device=q.device), wide)
    visible = mask_matrix(mask, Tq, Tk, q_offset=off, device=q.device)  # [Tq, Tk]
    weights, lse = normalize_scores(s, visible, activation)
    return gqa_weighted_values(weights, lse, v, H, return_lse)


def lambda_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rotary: Rotary,
    n_global: int,
    n_local: int,
    limit_distance: int | None = None,
    activation: str = "softmax",
    scale: float | None = None,
    q_offset: int | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
):
    """LM-Infinite attention of UNROTATED q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`.

    Visible keys are `lambda_mask(n_global, n_local)`. Key j for query i is scored
      - as a local key, scale * R(p_i) q_i . R(p_j) k_j, if i - n_local < j <= i;
      - as a global key, scale * R(d) q_i . R(0) k_j with d = min(limit_distance, Tk - 1),
        if j < n_global and i - j >= n_local;
    so a global key inside the window is counted once, as local. One softmax (or sigmoid)
    runs over both kinds, as in the official implementation. limit_distance defaults to
    n_local. Rotation: `rotary` (positions of the keys; the query at index i has p_i).
    `softcap`: both kinds of logit soft-capped (`AttentionSpec.softcap`).
    """
    s, visible, _ = _lambda_logits(q, k, v, rotary, n_global, n_local, limit_distance, activation, scale, q_offset,
                                   softcap)
    weights, lse = normalize_scores(s, visible, activation)
    return gqa_weighted_values(weights, lse, v, q.shape[2], return_lse)


def _lambda_logits(q, k, v, rotary, n_global, n_local, limit_distance, activation, scale, q_offset, softcap=None):
    """Λ logits `[B, H, Tq, Tk]` (>= float32, soft-capped), visible `[Tq, Tk]`, resolved q_offset."""
    lp = LambdaParams(n_global, n_local, limit_distance)
    spec = AttentionSpec(
        mask=lambda_mask(n_global, n_local), activation=activation, scale=scale, lambda_params=lp, softcap=softcap
    )
    off = check_call(q, k, v, spec, q_offset, rotary)
    Tq, Tk = q.shape[1], k.shape[1]
    li = lambda_inputs(q, k, rotary, lp, off)
    n_glob = li.k_glob.shape[1]
    wide, sc = _wide(q.dtype), scale_of(spec, q.shape[-1])
    s_loc = soft_cap(gqa_scores(li.q_rot, li.k_rot).to(wide) * sc, spec.softcap)  # [B, H, Tq, Tk]
    s_glob = soft_cap(gqa_scores(li.q_cap, li.k_glob).to(wide) * sc, spec.softcap)  # [B, H, Tq, G']
    i = torch.arange(off, off + Tq, device=q.device)[:, None]
    j = torch.arange(n_glob, device=q.device)[None, :]
    is_global = i - j >= n_local  # [Tq, G']: outside the window (hence j < i)
    s = torch.cat((torch.where(is_global, s_glob, s_loc[..., :n_glob]), s_loc[..., n_glob:]), -1)
    visible = mask_matrix(spec.mask, Tq, Tk, q_offset=off, device=q.device)
    return s, visible, off


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest `scores` along the last dim, ties to the lower index (the earlier
    key): the one tie rule of LM-Infinite's top-k middle keys, here and in `lcx.engine` (whose
    slots are in position order). torch.topk leaves ties unspecified, and a tie is no corner case:
    a query of zeros (a token whose embedding is zero, e.g. the pad token's) scores every middle
    key 0. -> `[..., k]` long."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def lambda_topk_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rotary: Rotary,
    n_global: int,
    n_local: int,
    limit_distance: int | None = None,
    top_k: int,
    top_k_insert_at: int,
    scale: float | None = None,
    q_offset: int | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
):
    """LM-Infinite with top-k middle tokens (the paper's passkey/Qasper configuration).

    UNROTATED q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`, v -> out `[B, Tq, H, Dv]` (softmax only).
    Every row but the last is `lambda_attention_ref`. The LAST query (mask index
    i = q_offset + Tq - 1) also sees, per query head, the `top_k` middle keys
    j in [n_global, i - n_local + 1) (the keys the Λ-mask hides from it) with the largest

        m_j = scale * R(top_k_insert_at) q_i . R(0) k_j

    (every middle key at relative distance `top_k_insert_at`, whatever its real distance), and
    their logits ARE those scores (soft-capped with a `softcap`, which keeps their order): one
    softmax over [global (capped) | top-k middle | local].
    When the middle span holds fewer than `top_k` keys the last row is plain Λ. Ties go to the
    earlier key (`top_k_indices`).

        keys:   0 .. G-1  | G ............. i-L | i-L+1 ... i
        row i:  global    | k best by m_j       | local (true distance)

    As the official `models/llama.py::detailed_lambda_attention` (Glaciohound/LM-Infinite), whose
    middle span is [global_branch, kv_len - local_branch) for its last row; with GQA each query
    head picks its own k keys. Rotation follows `lcx.attention.rotary` (the key at 0 carries the
    attention factor too; the official code leaves it unrotated: equal when the factor is 1).
    Which layers run it is the method's business (`lcx.methods.LMInfinite`), not this function's.
    """
    check_count("top_k", top_k, 1)
    check_count("top_k_insert_at", top_k_insert_at, 0)
    s, visible, off = _lambda_logits(q, k, v, rotary, n_global, n_local, limit_distance, "softmax", scale, q_offset,
                                     softcap)
    B, Tq, H = q.shape[:3]
    lo, hi = n_global, off + Tq - 1 - n_local + 1  # the last row's middle span [lo, hi)
    visible = visible.expand(B, H, Tq, k.shape[1])
    if hi - lo >= top_k:
        sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        q_near = rotate_to(q[:, -1:], rotary, top_k_insert_at)  # [B, 1, H, D]
        k_mid = rotate_to(k[:, lo:hi], rotary, 0)  # [B, M, Hkv, D]
        m = soft_cap(gqa_scores(q_near, k_mid).to(s.dtype) * sc, softcap)  # [B, H, 1, M]
        best = torch.zeros_like(m, dtype=torch.bool).scatter_(-1, top_k_indices(m, top_k), True)
        s, visible = s.clone(), visible.clone()
        s[..., -1:, lo:hi] = m
        visible[..., -1:, lo:hi] = best
    weights, lse = normalize_scores(s, visible, "softmax")
    return gqa_weighted_values(weights, lse, v, H, return_lse)


def attention_ref_spec(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    *,
    q_offset: int | None = None,
    rotary: Rotary | None = None,
    return_lse: bool = False,
):
    """The reference under the backend signature (registered as backend "ref")."""
    off = check_call(q, k, v, spec, q_offset, rotary)
    lp = spec.lambda_params
    if lp is not None:
        return lambda_attention_ref(
            q, k, v, rotary=rotary, n_global=lp.n_global, n_local=lp.n_local,
            limit_distance=lp.limit_distance, activation=spec.activation, scale=spec.scale,
            q_offset=off, return_lse=return_lse, softcap=spec.softcap,
        )  # fmt: skip
    if rotary is not None:
        q, k = rotate_qk(q, k, rotary, off)
    return attention_ref(
        q, k, v, mask=spec.mask, alibi_slopes=spec.alibi_slopes, activation=spec.activation,
        scale=spec.scale, q_offset=off, return_lse=return_lse, softcap=spec.softcap,
    )  # fmt: skip
