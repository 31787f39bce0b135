"""STRING (arXiv 2410.18745, "Why Does the Effective Context Length of LLMs Fall Short?"):
shifted RoPE. Code: github.com/HKUNLP/STRING (`string_for_llama.py`, `string_for_qwen2.py`, and
the vLLM fork's `vllm_string/vllm/attention/backends/flash_attn_string.py`).

Training-free: a model uses its largest relative distances poorly (they were rare in
pretraining), so STRING drops them and scores the distant keys at well-trained distances
instead. Two parameters, named as the official code names them (`replace_with_string(
max_test_length, shifted_offset, small_local_value)`; the vLLM fork's `string_config` =
{`shifted_offset`, `local_value`}):

    S  shifted_offset  how many of the largest distances are discarded; the official scripts
                       use int(0.33 * L), L the test length (`--shifted_ratio 0.33`; README:
                       0.25 - 0.4 L). The paper writes S = L/3.
    W  local_value     a small distance every shifted key starts from, so a shifted key is
                       never scored as if it were the query's neighbour: 128 (Llama scripts,
                       README; the README also suggests 256 or 512; the Qwen2 RULER script
                       uses 512).

Position map, for query i and key j (positions p_i, p_j, index distance i - j):

    i - j <  S   true distance:     p_i - p_j               (q at p_i,         k at p_j)
    i - j >= S   shifted distance:  p_i - p_j - S + W       (q at p_i - S + W, k at p_j)

one softmax over all keys. Only the QUERY moves for the shifted keys, so every key keeps one
rotation (its true position) and the largest distance seen is L - 1 - S + W. The paper's
illustration (its Figure 5: L = 9, S = 3) is this matrix: the diagonals with i - j < 3 keep
their index, the others are shifted down by S and lifted by W.

The official code realises it as two flash passes merged by their log-sum-exp:

    prefill (`string_flash_forward`)
      diag pass     q at p_i, k at p_j, `flash_attn_func(causal=True, window_size=[S, 0])`:
                    keys i - S <= j <= i, i.e. S + 1 keys (distances 0..S)
      shifted pass  q at p_i - S + W for the last N - S queries, the first N - S keys, causal:
                    keys j <= i - S (distances >= S)
    decode (`do_flash_decoding` on a cache of keys rotated at p_j)
      diag pass     the last S cached keys (distances 0..S-1), q at p_i
      shifted pass  the other keys (distances >= S), q at p_i - S + W

Where they differ: flash's `window_size=[S, 0]` spans S + 1 keys, so the official PREFILL
scores the key at distance exactly S twice, at distance S in the diag pass and at W in the
shifted pass (two entries of one softmax). Its decode does not (S keys in the diag pass), and
neither does the paper's matrix. lcx follows the matrix, the official decode, by default
(`overlap=False`); `overlap=True` is the official prefill's form: the window pass spans S + 1
keys and the key at distance S is in both passes, on every row (prefill rows and decode steps
alike: lcx has one definition per method, so it cannot give the decode steps the official
decode's form while the prompt rows keep the prefill's). Other code details not taken:
the vLLM fork's decode rounds the shifted keys down to a block multiple (its diag pass holds
S to S + block_size - 1 keys); the HF code's decode indexes the cache out of range below S
keys, and its prefill at exactly S keys runs the shifted pass on an empty key set.

Attention factor: both official codes also multiply cos and sin by 0.1 ln 2 + 1 (`attention_factor`
in `string_for_llama.py`, `mscale` in the vLLM fork; "STRING will make the attention map smooth,
we use the attention_factor to recover it, similar with Yarn"): every logit x (0.1 ln 2 + 1)^2,
at every distance. The paper's method description has no such factor. lcx keeps it out of the
attention method (which is the position map alone) and states it as the RoPE's attention
factor, where every lcx path (reference, backends, decode rule, engine) already applies it:
`{"rope": {"rope_type": "yarn", "factor": 1, "attention_factor": 0.1 ln 2 + 1}}` on a model with
plain RoPE is exactly the official Llama code (YaRN at factor 1 leaves the frequencies alone; on
a model whose RoPE is scaled already, Llama 3.1's `llama3` bands or Gemma 3's `linear`, the preset
keeps that spec and adds `attention_factor`, which every lcx RoPE type takes);
the Qwen2 code pairs STRING with YaRN's frequencies at factor (L / L0)(1 - 0.33) and the same
constant factor (not YaRN's 0.1 ln s + 1): `{"rope_type": "yarn", "factor": ...,
"attention_factor": 0.1 ln 2 + 1}`. `lcx.presets`' `string` is that recipe (`ATTENTION_FACTOR`,
`SHIFTED_RATIO`, `LOCAL_VALUE` below).

    ┌ keys ──────────────────────────────────────────────▶
    │ j <= i - S: q at p_i - S + W │ i - S < j <= i: true positions (window of S keys)
    query i

Reference: `string_ref` (the relative position matrix `string_distances`, scores q.R(d)k per
pair, one softmax). `STRING.attend`: the two passes above over `lcx.attention` backends, each a
shape every backend runs natively, merged by `lcx.attention.merge_attention`:

    window pass   q, k at true positions, mask `sliding_window(left=S - 1)` (`left=S` with
                  overlap), over all keys
    shifted pass  q at p_i - S + W, keys [0, Tk - S) at true positions under plain `causal`
                  (queries are the last Tq of the keys, so query i maps to mask index i - S,
                  which sees exactly the keys j <= i - S)

Decode rule (overlap=False): a window branch of S keys at true positions; a side branch of every
older key, stored rotated at its true position (side_key p_k), scored with the query at
p_q - S + W (side_query). With overlap=True no rule (a key in both branches is no single
softmax over keys rotated once): `lcx.engine` decodes through `attend`.

Prefix cache and chunked prefill: exact (`call_dependence` None): a query's keys and their
distances depend only on the keys up to it. Exactly causal attention while no key is S or more
behind its query (`causal_up_to` = S). Unbounded (every key stays visible): no bounded cache.
Keys: the side branch moves only the query, so keys could be cached rotated at their true
positions (the engine's decode rule does exactly that); `needs_unrotated_keys` is True in the
registry's sense, "some query sees a key at other than its true distance", so a cache that
hands keys to `attend` (the HF path) keeps them unrotated; the vLLM plugin, like the engine,
decodes through the rule on keys rotated once (`overlap=True`, which has no rule: unrotated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from lcx.attention import AttentionSpec, Rotary, attention, merge_attention, soft_cap
from lcx.attention.rotary import table_dtype
from lcx.masks import causal_mask
from lcx.masks import sliding_window as sliding_window_mask
from lcx.masks.base import check_count
from lcx.rope import apply_rotary_ref, rope_cos_sin

from .base import AttentionMethod, DecodeRule, LastQueryKeys

# The official code's defaults (module docstring): S = int(SHIFTED_RATIO * L) for a test length L,
# W = LOCAL_VALUE, and the constant attention factor on cos and sin (logits x its square).
SHIFTED_RATIO = 0.33
LOCAL_VALUE = 128
ATTENTION_FACTOR = 0.1 * math.log(2) + 1


def string_distances(q_positions: torch.Tensor, k_positions: torch.Tensor, shifted_offset: int,
                     local_value: int) -> torch.Tensor:
    """STRING's relative position matrix: `[..., Tq, Tk]` float64, query i (the last Tq of the
    Tk keys) to key j: p_i - p_j when i - j < S, p_i - p_j - S + W when i - j >= S (entries
    with j > i are the plain difference; the caller masks them). `q_positions` `[..., Tq]`,
    `k_positions` `[..., Tk]`."""
    Tq, Tk = q_positions.shape[-1], k_positions.shape[-1]
    d = q_positions.to(torch.float64)[..., :, None] - k_positions.to(torch.float64)[..., None, :]
    i = torch.arange(Tk - Tq, Tk, device=d.device)[:, None]
    j = torch.arange(Tk, device=d.device)[None, :]
    return torch.where(i - j >= shifted_offset, d - (shifted_offset - local_value), d)


def _relative_scores(q: torch.Tensor, k: torch.Tensor, dist: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Scores `[B, H, Tq, Tk]` of every (query, key) pair at distance `dist` `[(B,) Tq, Tk]`:
    (a R(p_i) q).(a R(p_j) k) = (a^2 R(p_i - p_j) q).k on the rotary channels, q.k on the rest."""
    B, Tq, H, D = q.shape
    wide = torch.promote_types(q.dtype, torch.float32)
    cos, sin = rope_cos_sin(dist, rotary.inv_freq, rotary.attention_factor ** 2, wide)  # [(B,) Tq, Tk, r]
    qr = apply_rotary_ref(q.to(wide)[:, :, None].expand(B, Tq, k.shape[1], H, D), cos, sin)  # [B, Tq, Tk, H, D]
    kr = k.to(wide).repeat_interleave(H // k.shape[2], dim=2)  # [B, Tk, H, D]
    return torch.einsum("bqkhd,bkhd->bhqk", qr, kr)


def string_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rotary: Rotary, shifted_offset: int,
               local_value: int, overlap: bool = False, scale: float | None = None,
               softcap: float | None = None) -> torch.Tensor:
    """The definition, densely: unrotated q `[B, Tq, H, D]`, k `[B, Tk, Hkv, D]`, v -> `[B, Tq, H, Dv]`.

    Queries are the last Tq keys (`lcx.masks` convention); `rotary.positions` the keys' positions.
    One softmax over the keys j <= i at `string_distances`; with `overlap`, the key at index
    distance S is in it a second time, at its true distance (the official prefill)."""
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    pos = rotary.key_positions(Tk, q.device)  # [Tk] or [B, Tk]
    qpos = pos[..., Tk - Tq:]
    S, W = shifted_offset, local_value
    i = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]
    j = torch.arange(Tk, device=q.device)[None, :]
    c = scale if scale is not None else D ** -0.5
    logits = soft_cap(_relative_scores(q, k, string_distances(qpos, pos, S, W), rotary) * c, softcap)
    logits = logits.masked_fill(j > i, float("-inf"))
    values = v.repeat_interleave(H // k.shape[2], dim=2)
    if overlap:  # the key at distance S again, at its true distance
        true = qpos.to(torch.float64)[..., :, None] - pos.to(torch.float64)[..., None, :]
        twice = soft_cap(_relative_scores(q, k, true, rotary) * c, softcap)
        logits = torch.cat((logits, twice.masked_fill(i - j != S, float("-inf"))), dim=-1)
        values = torch.cat((values, values), dim=1)
    p = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, values.to(p.dtype))
    return out.to(v.dtype)


def _rotate(x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """x `[B, T, H, D]` rotated to `positions` `[T]` or `[B, T]` (float64 angles, tables in
    `lcx.attention.rotary.table_dtype`, as every lcx.attention call rotates)."""
    cos, sin = rope_cos_sin(positions, rotary.inv_freq, rotary.attention_factor, table_dtype(x.dtype))
    return apply_rotary_ref(x, cos, sin)


@dataclass(frozen=True)
class STRING(AttentionMethod):
    """STRING (arXiv 2410.18745): true distances below `shifted_offset` S, distance d scored at
    d - S + `local_value` W from S on. See the module docstring.

    shifted_offset: S >= 1, how many of the largest distances are dropped (official: int(0.33 L)).
    local_value:    W, 0 <= W < S, the distance the shifted keys start from (official: 128).
    overlap:        False (default): the paper's matrix and the official decode; True: the
                    official prefill's form, the key at distance S in both passes.
    """

    name: ClassVar[str] = "string"
    needs_unrotated_keys: ClassVar[bool] = True
    examples = (
        {"shifted_offset": 4, "local_value": 1},
        {"shifted_offset": 7, "local_value": 0},  # shifted keys start at distance 0
        {"shifted_offset": 5, "local_value": 2, "overlap": True},  # the official prefill's form
    )
    shifted_offset: int
    local_value: int = LOCAL_VALUE
    overlap: bool = False

    def __post_init__(self) -> None:
        check_count("shifted_offset", self.shifted_offset, 1)
        check_count("local_value", self.local_value, 0)
        if self.local_value >= self.shifted_offset:
            raise ValueError(f"string: local_value={self.local_value} must be < shifted_offset="
                             f"{self.shifted_offset} (shifted keys at d - S + W would be no nearer)")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"string: overlap must be a bool, got {self.overlap!r}")

    @classmethod
    def for_length(cls, length: int, *, shifted_ratio: float = SHIFTED_RATIO,
                   local_value: int = LOCAL_VALUE) -> "STRING":
        """The official scripts' setting for a test length L: S = int(shifted_ratio * L) and W =
        local_value, W lowered to S - 1 where S is that small (tiny test models)."""
        check_count("length", length, 2)
        if not 0 < shifted_ratio < 1:
            raise ValueError(f"string: shifted_ratio must be in (0, 1), got {shifted_ratio!r}")
        S = max(1, int(shifted_ratio * length))
        return cls(S, min(local_value, S - 1))

    @property
    def _left(self) -> int:
        """The window pass's `left` (keys before the query): S - 1, or S with overlap."""
        return self.shifted_offset if self.overlap else self.shifted_offset - 1

    def attend(self, q, k, v, *, rotary, backend="blockwise", scale=None, layer_idx=None, softcap=None):
        Tq, Tk = q.shape[1], k.shape[1]
        S, W = self.shifted_offset, self.local_value
        near, lse_near = attention(q, k, v, AttentionSpec(mask=sliding_window_mask(left=self._left), scale=scale,
                                                          softcap=softcap),
                                   backend=backend, rotary=rotary, return_lse=True)
        first = max(0, S - (Tk - Tq))  # the first query (of Tq) with a key S or more behind it
        if first >= Tq:  # no query reaches the shift
            return near
        pos = rotary.key_positions(Tk, q.device)
        qs = _rotate(q[:, first:], pos[..., Tk - Tq + first:] - (S - W), rotary)  # the query moved
        ks = _rotate(k[:, : Tk - S], pos[..., : Tk - S], rotary)  # the keys at their own positions
        far, lse_far = attention(qs, ks, v[:, : Tk - S], AttentionSpec(mask=causal_mask, scale=scale, softcap=softcap),
                                 backend=backend, return_lse=True)
        B, _, H, Dv = near.shape
        if first:  # queries without shifted keys: an empty pass (o = 0, lse = -inf)
            far = torch.cat((far.new_zeros(B, first, H, Dv), far), 1)
            lse_far = torch.cat((lse_far.new_full((B, H, first), float("-inf")), lse_far), 2)
        out, _ = merge_attention(near, lse_near, far, lse_far)
        return out

    def last_query_keys(self, positions):
        if self.overlap:
            return None  # a key in both passes: not one softmax over keys at one position each
        # keys S or more behind the query: q at p_i - S + W, k at p_j, i.e. k moved to
        # p_j + S - W against the query at p_i
        Tk = positions.shape[-1]
        near = torch.arange(Tk, device=positions.device) > Tk - 1 - self.shifted_offset
        p = positions.to(torch.float64)
        return LastQueryKeys(None, torch.where(near, p, p + (self.shifted_offset - self.local_value)))

    def query_keys(self, positions, n_queries):
        return None if self.overlap else super().query_keys(positions, n_queries)

    def decode_rule(self):
        if self.overlap:
            return None
        # every key stored rotated at its own position, once; the query at p_q - S + W for the older ones
        shift = self.shifted_offset - self.local_value
        return DecodeRule(window=self.shifted_offset, side=None, side_key=torch.clone,
                          side_query=lambda p: p - shift)

    def causal_up_to(self):
        # every key less than S behind its query: the window pass alone, at true distances
        return self.shifted_offset

    def _spec(self, scale):
        raise NotImplementedError("string is two attention calls (see STRING.attend), not one spec")

    def _call_specs(self):
        return (AttentionSpec(mask=sliding_window_mask(left=self._left)), AttentionSpec(mask=causal_mask))


def string(shifted_offset: int, local_value: int = LOCAL_VALUE, overlap: bool = False) -> STRING:
    """STRING with shift S = `shifted_offset` and local value W (see `STRING`)."""
    return STRING(shifted_offset, local_value, overlap)
