"""Dual Chunk Attention (DCA; arXiv 2402.17463, "Training-Free Long-Context Scaling of Large
Language Models"; code github.com/HKUNLP/ChunkLlama): attention in three parts, each with its own
position map, so that no query-key distance exceeds `chunk_size`.

Parameters, named as Qwen's `dual_chunk_attention_config` names them (so a config moves between
Qwen / vLLM and lcx unchanged): `chunk_size` s and `local_size` w, with s > w > 0. Derived:

    chunk_len  c = s - w            (ChunkLlama's `chunk_len`, vLLM's `chunk_len`)

Position maps (p: a token's position; chunk(p) = floor(p / c); r(p) = p mod c). Keys are
rotated ONCE, at r(p_k), in every part; the query is rotated three ways:

    part        keys of query i (index j <= i)        query rotated at        distance q - k
    intra       chunk(p_j) == chunk(p_i)              r(p_i)                  p_i - p_j (the true one)
    successive  chunk(p_j) == chunk(p_i) - 1          min(r(p_i) + c, s)      min(r_i + c, s) - r_j
    inter       chunk(p_j) <= chunk(p_i) - 2          min(2c - 1, s)          min(2c - 1, s) - r_j

and ONE softmax over all keys of query i (the paper's definition; `dca_ref`). So:
- intra: exact attention inside a chunk of c tokens;
- successive: the previous chunk at its true distance r_i + c - r_j while r_i <= w (the first w + 1
  queries of a chunk, the "local window" across the chunk boundary), beyond it the query is held
  at position s, so successive distances are at most s;
- inter: every older chunk seen from the one query position min(2c - 1, s) (vLLM and ChunkLlama
  both take their `qc` table at index c - 1): s when w < c, the usual case, with distances in
  [s - c + 1, s] = [w + 1, s] (2c - 1 and [c, 2c - 1] when w >= c): beyond the successive chunk a
  key's distance no longer grows.
The largest distance any query sees is s, whatever the length: DCA sets no length of its own
(`context_len` None: the engine's and servers' default max_model_len stays the model's; Qwen's 1M
configs give 1,010,000 there; pass `max_model_len` to serve more).

    ┌ keys ────────────────────────────────────────────────────────────▶
    │ chunks 0 .. m-2: inter │ chunk m-1: successive │ chunk m up to i: intra (causal)
    query i in chunk m

Sources and where they differ (lcx follows ChunkLlama's and vLLM's dense attention, which agree):
- ChunkLlama (`chunkllama_attn_replace.py`): tables `q_t = arange(c)`, `qc_t = (arange(c) + c)
  .clamp(max=s)`, `k_t = arange(T) % c`; keys rotated at `k_t[p]`, `position_ids % c` indexes the
  query tables; the inter query takes `qc_t[position_ids[:, c - 1]] = qc_t[c - 1]`. Prefill: per
  chunk of c queries, a causal flash pass (intra), an unmasked pass over the previous chunk
  (successive) and an unmasked pass over every older key (inter), merged by their log-sum-exp
  (`merge_attn_outputs`, which equals one softmax over the union: tested); decode: the same three
  score blocks concatenated under one softmax. Chunks are counted from index 0 of the sequence in
  prefill and from `(kv_len - 1) // c` in decode, i.e. from position 0 when positions are
  0, 1, ...; lcx counts them from position 0 (chunk(p)), which is the same for a sequence and
  also defines chunked prefill and decode from a cache.
  Defaults: `replace_with_chunkllama(pretraining_length=L0)`: s = 3 L0 // 4; w = L0 // 16 in its
  first released code, L0 // 8 in its current code. `chunkllama_dca(L0)` gives
  the former; pass `local_size` for the latter. ChunkLlama's current code also multiplies cos/sin
  by an mscale 0.05 ln(T / L0) + 1 once the length T exceeds its table (it notes that the paper's
  results did not use it): lcx leaves it out (a RoPE spec's attention_factor can add one).
- vLLM V0 (`DualChunkRotaryEmbedding`, `attention/backends/dual_chunk_flash_attn.py`, deleted
  with V0 in PR #25351): the same q / qc / k tables and the same three dense parts (intra causal,
  succ and inter unmasked, chunks by position), merged by log-sum-exp. It adds (1) MInference
  sparse attention (vertical-and-slash, `sparse_attention_config`, with two more query rotations
  `qc_no_clamp` = r + c and `q_inter` = r + s used only to pick the sparse indices): lcx leaves it
  out, it is an approximation for speed; (2) with `original_max_position_embeddings` > 0, a
  length-dependent logit scale max(1, 0.1 ln(T / L_orig) + 1) (T: the request's length; applied
  to the keys as they are cached, and again to the prefill softmax scale or the decode query):
  lcx leaves it out, since it makes a query's output depend on the request's total length (no
  exact chunked prefill or prefix cache) and is 1 at every length up to L_orig (262,144 for
  Qwen2.5-1M).
- Qwen2.5-7B/14B-Instruct-1M's config.json: `dual_chunk_attention_config = {"chunk_size": 262144,
  "local_size": 8192, "original_max_position_embeddings": 262144, ...}`: s and w given explicitly
  (`dca_from_hf_config` reads it).

`DCA.attend` computes `dca_ref` as passes over `lcx.attention` backends merged by log-sum-exp
(`lcx.attention.merge.merge_many`), per chunk m of the call's queries, each a causal call that
every backend runs natively (no mask is materialised beyond what a backend does for `causal`):

    intra       queries of chunk m at r(p), keys of chunk m up to the last query (causal)
    successive  queries at min(r(p) + c, s), keys of chunk m - 1, all visible (causal with the
                queries placed after every key: q_offset = number of keys)
    inter       queries at min(2c - 1, s), keys of chunks <= m - 2, all visible (same)

Keys are found by their positions, which must not decrease along a row (a compressed cache's gaps
are fine); rows of a batch with different positions run separately.

Decode: a decoded token at p_q attends every cached key exactly as above (its chunk by p_q). Three
query rotations per step do not fit `DecodeRule`'s two branches (one side rotation per key), so
DCA has no decode rule: `lcx.engine` keeps keys UNROTATED (`needs_unrotated_keys`) and decodes
through `attend` (one query: at most three calls). The last query is plain softmax over keys moved
to p_q - (query position of the key's part - r(p_k)) (`DCA.moved_key_positions`, tested equal to
`attend`), but lcx's methods offer `last_query_keys` only with a decode rule, so it is not used as
a fast path yet. (A DCA-only cache could instead hold keys rotated at r(p), as ChunkLlama and vLLM
do, and rotate the query three ways per step.)

Chunked prefill and prefix cache: exact. A query's output depends only on the keys up to it and
their positions (chunks are anchored at position 0, not at the call), so `call_dependence` is None.

Exactly causal attention: up to `causal_up_to()` = min(w + 2, c + 1) tokens wherever a sequence
starts (a window of that many consecutive positions sees no inter key and only successive keys at
their true distance); a sequence starting at position 0 stays exact up to min(s + 1, 2c) tokens
(`causal_from_start`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from lcx.attention import AttentionSpec, Rotary, attention, soft_cap
from lcx.attention.merge import merge_many
from lcx.attention.rotary import table_dtype
from lcx.masks import causal_mask
from lcx.masks.base import check_count
from lcx.rope import apply_rotary_ref, rope_cos_sin

from .base import AttentionMethod

# the keys of Qwen's `dual_chunk_attention_config` that lcx reads; the others it leaves out (named
# in the log line of `dca_from_hf_config`)
HF_CONFIG_KEY = "dual_chunk_attention_config"
_SPARSE_KEYS = ("sparse_attention_config", "sparse_attention_enabled", "sparse_attention_threshold",
                "sparse_attention_last_q")


def _rotate(x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """x `[B, T, H, D]` rotated to `positions` `[T]` or `[B, T]` (float64 angles, tables in
    `table_dtype`, as every lcx.attention call rotates)."""
    cos, sin = rope_cos_sin(positions, rotary.inv_freq, rotary.attention_factor, table_dtype(x.dtype))
    return apply_rotary_ref(x, cos, sin)


def _int_positions(pos: torch.Tensor) -> torch.Tensor:
    if pos.is_floating_point():
        if not bool(torch.equal(pos, pos.round())):
            raise ValueError("dca needs integer key positions (chunks are floor(p / chunk_len))")
        pos = pos.round()
    return pos.to(torch.int64)


def dca_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rotary: Rotary, chunk_size: int,
            local_size: int, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """The definition, densely (module docstring): unrotated q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`,
    v `[B, Tk, Hkv, Dv]` -> `[B, Tq, H, Dv]`; one softmax over the three parts' scores.

    Queries are the last Tq keys (`lcx.masks` convention); `rotary.positions` the keys' positions."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    s, c = chunk_size, chunk_size - local_size
    pos = _int_positions(rotary.key_positions(Tk, q.device))  # [Tk] or [B, Tk]
    qpos = pos[..., Tk - Tq:]
    chunk_k, chunk_q = torch.div(pos, c, rounding_mode="floor"), torch.div(qpos, c, rounding_mode="floor")
    r_k, r_q = pos - chunk_k * c, qpos - chunk_q * c
    wide = torch.promote_types(q.dtype, torch.float32)
    kr = _rotate(k, r_k.to(torch.float64), rotary).repeat_interleave(H // Hkv, dim=2).to(wide)

    def scores(qpos_part):  # [B, H, Tq, Tk]
        return torch.einsum("bqhd,bkhd->bhqk", _rotate(q, qpos_part.to(torch.float64), rotary).to(wide), kr)

    intra = scores(r_q)
    succ = scores(torch.clamp(r_q + c, max=s))
    inter = scores(torch.full_like(r_q, min(2 * c - 1, s)))
    d = (chunk_q[..., :, None] - chunk_k[..., None, :])  # [Tq, Tk] or [B, Tq, Tk]: chunks back
    d = d if d.dim() == 3 else d[None]
    d = d[:, None]  # [B or 1, 1, Tq, Tk]
    sc = torch.where(d == 0, intra, torch.where(d == 1, succ, inter))
    sc = soft_cap(sc * (scale if scale is not None else D ** -0.5), softcap)
    i = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]
    j = torch.arange(Tk, device=q.device)[None, :]
    sc = sc.masked_fill(j > i, float("-inf"))
    p = torch.softmax(sc, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(H // Hkv, dim=2).to(wide))
    return out.to(v.dtype)


@dataclass(frozen=True)
class DCA(AttentionMethod):
    """Dual Chunk Attention (arXiv 2402.17463): intra-chunk, successive-chunk and inter-chunk parts
    over chunks of `chunk_size - local_size` tokens; no distance beyond `chunk_size`. See the module
    docstring for every position map."""

    name: ClassVar[str] = "dca"
    needs_unrotated_keys: ClassVar[bool] = True
    # c = 5 with w < c (the successive query clamped at s past the local window), and c = 3 with
    # w >= c (no clamp; the inter query at 2c - 1 < s): both branches of min(.., s)
    examples = ({"chunk_size": 8, "local_size": 3}, {"chunk_size": 7, "local_size": 4})
    chunk_size: int
    local_size: int

    def __post_init__(self) -> None:
        check_count("chunk_size", self.chunk_size, 2)
        check_count("local_size", self.local_size, 1)
        if self.local_size >= self.chunk_size:
            raise ValueError(f"local_size must be < chunk_size, got local_size={self.local_size}, "
                             f"chunk_size={self.chunk_size}")

    @property
    def chunk_len(self) -> int:
        """c = chunk_size - local_size: the tokens per chunk."""
        return self.chunk_size - self.local_size

    @property
    def inter_query_position(self) -> int:
        """The one position every inter-chunk query is rotated at: min(2c - 1, chunk_size)."""
        return min(2 * self.chunk_len - 1, self.chunk_size)

    # ------------------------------------------------------------------ what a query computes
    def attend(self, q, k, v, *, rotary, backend="blockwise", scale=None, layer_idx=None, softcap=None):
        B, Tq = q.shape[:2]
        Tk = k.shape[1]
        pos = _int_positions(rotary.key_positions(Tk, q.device))
        if pos.dim() == 2:
            if B > 1 and not bool((pos == pos[:1]).all()):  # rows chunked differently: one at a time
                return torch.cat([self.attend(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                              rotary=Rotary(rotary.inv_freq, pos[b], rotary.attention_factor),
                                              backend=backend, scale=scale, softcap=softcap) for b in range(B)])
            pos = pos[0]
        if Tk > 1 and bool((pos[1:] < pos[:-1]).any()):
            raise ValueError("dca needs key positions that do not decrease along a row")
        c, s = self.chunk_len, self.chunk_size
        chunk = torch.div(pos, c, rounding_mode="floor")  # [Tk]
        r = (pos - chunk * c).to(torch.float64)
        kr = _rotate(k, r, rotary)  # every part sees keys at p mod c
        chunks = chunk.tolist()
        spec = AttentionSpec(mask=causal_mask, scale=scale, softcap=softcap)
        q0 = Tk - Tq  # key index of the first query
        outs, lses = [], []
        a = q0
        while a < Tk:  # the queries of one chunk m: key indices [a, e)
            m = chunks[a]
            e = bisect.bisect_right(chunks, m, lo=a)
            start = bisect.bisect_left(chunks, m, hi=a)  # chunk m's first key
            prev = bisect.bisect_left(chunks, m - 1, hi=start)  # chunk m-1's first key (start if none)
            qm, rq = q[:, a - q0:e - q0], r[a:e]
            parts = [attention(_rotate(qm, rq, rotary), kr[:, start:e], v[:, start:e], spec, backend=backend,
                               return_lse=True)]
            if prev < start:  # successive: every key of chunk m-1
                qs = _rotate(qm, torch.clamp(rq + c, max=s), rotary)
                parts.append(attention(qs, kr[:, prev:start], v[:, prev:start], spec, backend=backend,
                                       q_offset=start - prev, return_lse=True))
            if prev > 0:  # inter: every key of chunks <= m-2
                qi = _rotate(qm, torch.full_like(rq, self.inter_query_position), rotary)
                parts.append(attention(qi, kr[:, :prev], v[:, :prev], spec, backend=backend, q_offset=prev,
                                       return_lse=True))
            if len(parts) == 1:
                o, lse = parts[0]
            else:
                o, lse = merge_many([o for o, _ in parts], [lse for _, lse in parts], dim=1)
            outs.append(o), lses.append(lse)
            a = e
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def last_query_keys(self, positions):
        # DCA's last query IS plain softmax over moved keys (`moved_key_positions`, tested equal to
        # `attend`), but lcx's rule is that a method without a `DecodeRule` declares no last-query
        # form and decodes through `attend` (tests/methods/test_decode_rule.py), so it is not
        # offered as the fast path here.
        return None

    def moved_key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The last query's keys as plain softmax over keys rotated to these positions (`[..., Tk]`
        float64; the query at its own position `positions[..., -1]`, every key visible): a key of
        part x (query rotated at P_x, key at r(p_k)) scores at distance P_x - r(p_k), i.e. as the
        key moved to p_q - (P_x - r(p_k)). What `last_query_keys` would return."""
        p = _int_positions(positions)
        c, s = self.chunk_len, self.chunk_size
        chunk = torch.div(p, c, rounding_mode="floor")
        r = p - chunk * c
        pq, cq, rq = p[..., -1:], chunk[..., -1:], r[..., -1:]
        succ = pq - (torch.clamp(rq + c, max=s) - r)
        inter = pq - (self.inter_query_position - r)
        back = cq - chunk
        return torch.where(back == 0, p, torch.where(back == 1, succ, inter)).to(torch.float64)

    def causal_up_to(self):
        # any window of min(w + 2, c + 1) consecutive positions: no key two chunks back (that
        # needs a distance >= c + 1), and a query past a chunk boundary has r <= w, where the
        # successive query position r + c is not clamped
        return min(self.local_size + 2, self.chunk_len + 1)

    def causal_from_start(self) -> int:
        """Like `causal_up_to`, for sequences whose positions start at 0: min(s + 1, 2c) tokens
        (chunk 0 intra; chunk 1's queries up to r = w unclamped; chunk 2 starts at 2c)."""
        return min(self.chunk_size + 1, 2 * self.chunk_len)

    def _spec(self, scale):
        raise NotImplementedError("dca is several attention calls per chunk (see DCA.attend), not one spec")

    def _call_specs(self):
        return (AttentionSpec(mask=causal_mask),)


def dca(chunk_size: int, local_size: int) -> DCA:
    return DCA(chunk_size, local_size)


def chunkllama_dca(pretraining_length: int, local_size: int | None = None) -> DCA:
    """ChunkLlama's defaults for a model trained on `pretraining_length` L0 tokens
    (`replace_with_chunkllama`): chunk_size 3 L0 // 4, local_size L0 // 16 (its first release;
    its current code uses L0 // 8: pass local_size)."""
    check_count("pretraining_length", pretraining_length, 4)
    return DCA(pretraining_length * 3 // 4, local_size if local_size is not None else pretraining_length // 16)


def dca_from_hf_config(config: Any) -> DCA | None:
    """The DCA a model's HF config asks for through `dual_chunk_attention_config` (Qwen2.5-1M,
    Qwen3-2507 1M: `{"chunk_size", "local_size", "original_max_position_embeddings", ...}`), or
    None when it has none. Takes a config object or a config.json dict. `chunk_size` and
    `local_size` are required (`ValueError` naming the missing one); the sparse (MInference) keys
    and `original_max_position_embeddings` (vLLM's length-dependent logit scale) are read but not
    applied (module docstring)."""
    d = config.get(HF_CONFIG_KEY) if isinstance(config, Mapping) else getattr(config, HF_CONFIG_KEY, None)
    if d is None:
        return None
    if not isinstance(d, Mapping):
        raise ValueError(f"{HF_CONFIG_KEY} must be a dict, got {d!r}")
    missing = [k for k in ("chunk_size", "local_size") if k not in d]
    if missing:
        raise ValueError(f"{HF_CONFIG_KEY} lacks {missing}; it has {sorted(d)}")
    orig = d.get("original_max_position_embeddings")
    if orig is not None:
        check_count(f"{HF_CONFIG_KEY}.original_max_position_embeddings", orig, 0)
    try:
        return DCA(d["chunk_size"], d["local_size"])
    except ValueError as e:
        raise ValueError(f"{HF_CONFIG_KEY}: {e}") from None


def hf_config_left_out(config: Any) -> list[str]:
    """The keys of a config's `dual_chunk_attention_config` lcx does not apply (sparse attention,
    a positive `original_max_position_embeddings`), for the log line that says what runs."""
    d = config.get(HF_CONFIG_KEY) if isinstance(config, Mapping) else getattr(config, HF_CONFIG_KEY, None)
    if not isinstance(d, Mapping):
        return []
    out = [k for k in _SPARSE_KEYS if d.get(k)]
    if d.get("original_max_position_embeddings"):
        out.append("original_max_position_embeddings")
    return out
