"""The modular-addition encoder classifier of arXiv 2601.04283, with pluggable position encodings.

A character-level transformer encoder that reads `[CLS] c_0 c_1 ... c_{T-1}` (ids from
`lcx.data.modadd.encode_chars`, one id per character) and classifies `(a + b) mod 97` from the
final hidden state of `[CLS]`:

    ids [B, T] -> embed [B, T, D] (+ learned positions) -> n_layers x pre-LN block -> LN
       -> h[:, 0] [B, D] -> Linear -> logits [B, 97]
    (the last block computes the [CLS] query alone: nothing else reaches the head)

    block: h = h + Attn(LN(h))   (bidirectional; padding keys masked)
           h = h + MLP(LN(h))    (D -> d_ff -> D, GELU)

`[CLS]` sits at position 0; the expression text follows at positions 1.. so a text rendered at
character offset `o` starts at absolute position `o + 1`.

Position encodings are one registry, `POSITION_ENCODINGS` (name -> module class). Each entry
acts at up to three places, and only where it means something:

    embed(h, pos)      added to the token embeddings (learned absolute)
    rotate(q, k, pos)  q, k: [B, T, H, Dh] turned by their positions (RoPE, `lcx.rope`)
    bias(pos)          [H, T, T] added to the attention logits (ALiBi, `lcx.attention.alibi`,
                       the symmetric encoder form -m_h |i - j|)

`nope` does nothing at all: a bidirectional encoder without positions sees a bag of characters
(it cannot tell `12+34=` from `21+43=`), which is part of what the study measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

# ------------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class EncoderConfig:
    """Shape of the encoder. Defaults are the paper's: 2 layers, d_model 128, 4 heads, learned
    absolute positions. `vocab_size` covers `lcx.data.modadd.encode_chars` (byte ids + 3)."""

    vocab_size: int = 259
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512
    max_positions: int = 256
    position: str = "learned"
    rope_theta: float = 10000.0
    n_classes: int = 97
    dropout: float = 0.0
    # Initial values of the learned position table: "normal" (N(0, 0.02), BERT-style: no
    # relation between positions at the start) or "sinusoidal" (the Transformer's sin/cos
    # table, scaled to the same 0.02 root-mean-square per entry: p[i + k] is a fixed rotation of p[i], so
    # attention by relative offset is available from step 0). Still learned either way.
    position_init: str = "normal"
    # A second head on every position's final hidden state that predicts the character there
    # (`ModAddEncoder.forward(..., tokens=True)`), for the auxiliary masked-character loss of
    # `RunConfig.mlm_weight`; off by default, and then the model is exactly the paper's.
    token_head: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_positions", "n_classes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.position not in POSITION_ENCODINGS:
            raise ValueError(f"position={self.position!r} is not known; known: {sorted(POSITION_ENCODINGS)}")
        if self.position == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError(f"position='rope' needs an even head dim, got {self.d_model // self.n_heads}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a finite number > 0, got {self.rope_theta}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not isinstance(self.token_head, bool):
            raise ValueError(f"token_head must be true or false, got {self.token_head!r}")
        if self.position_init not in POSITION_INITS:
            raise ValueError(f"position_init must be one of {POSITION_INITS}, got {self.position_init!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EncoderConfig":
        from lcx.configs import strict_from_dict

        return strict_from_dict(cls, d)


# ------------------------------------------------------------------------ position encodings


class PositionEncoding(nn.Module):
    """Base: no-op at every place (this is NoPE). Subclasses override what they use."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def embed(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """h: [B, T, D], pos: [T] -> [B, T, D]."""
        return h

    def rotate(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: [B, T, H, Dh], pos: [T]."""
        return q, k

    def bias(self, pos: torch.Tensor) -> torch.Tensor | None:
        """Additive logit bias [H, T, T] or None."""
        return None


POSITION_INITS = ("normal", "sinusoidal")


def sinusoidal_table(n_positions: int, d_model: int, std: float = 0.02) -> torch.Tensor:
    """`[n_positions, d_model]`: sin/cos of position x 10000^(-2i/d) (Vaswani et al.), interleaved
    per frequency, scaled to root-mean-square `std` per entry (each sin/cos pair has unit norm),
    the magnitude of an N(0, std) initialisation."""
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    angles = pos * inv_freq[None]  # [P, D/2]
    table = torch.stack((angles.sin(), angles.cos()), dim=-1).reshape(n_positions, d_model)
    return (table * (std * math.sqrt(2.0))).float()  # entries' mean square is 1/2 before scaling


class LearnedPositions(PositionEncoding):
    """Learned absolute position embeddings (the paper's model); positions < max_positions;
    initialised per `EncoderConfig.position_init`."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__(cfg)
        self.table = nn.Embedding(cfg.max_positions, cfg.d_model)
        if cfg.position_init == "sinusoidal":
            with torch.no_grad():
                self.table.weight.copy_(sinusoidal_table(cfg.max_positions, cfg.d_model))
        else:
            nn.init.normal_(self.table.weight, std=0.02)

    def embed(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if int(pos.max()) >= self.cfg.max_positions:
            raise ValueError(f"position {int(pos.max())} >= max_positions {self.cfg.max_positions}")
        return h + self.table(pos)[None]


class AlibiPositions(PositionEncoding):
    """Symmetric ALiBi for an encoder: logit(i, j) -= m_h |i - j| (Press et al.'s slopes)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__(cfg)
        from lcx.attention.alibi import alibi_slopes

        self.register_buffer("slopes", torch.tensor(alibi_slopes(cfg.n_heads)), persistent=False)

    def bias(self, pos: torch.Tensor) -> torch.Tensor:
        from lcx.attention.alibi import alibi_bias

        return alibi_bias(self.slopes, pos, pos, torch.float32)  # [H, T, T]


class RotaryPositions(PositionEncoding):
    """RoPE (default type, `rope_theta`) on q and k of every layer, through `lcx.rope`."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__(cfg)
        from lcx.rope import compute_inv_freq

        inv_freq, _ = compute_inv_freq({"rope_type": "default", "rope_theta": cfg.rope_theta}, cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate(self, q, k, pos):
        from lcx.rope.rotary import apply_rotary_ref, rope_cos_sin

        cos, sin = rope_cos_sin(pos, self.inv_freq, 1.0, q.dtype)  # [T, Dh]
        return apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)


# name -> module class; the only list of position encodings (tests iterate over it).
POSITION_ENCODINGS: dict[str, type[PositionEncoding]] = {
    "learned": LearnedPositions,
    "alibi": AlibiPositions,
    "rope": RotaryPositions,
    "nope": PositionEncoding,
}


# ------------------------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, pe: PositionEncoding,
                mask: torch.Tensor, n_queries: int | None = None) -> torch.Tensor:
        """h: [B, T, D]; mask: [B or 1, H or 1, T, T] additive float (padding keys -inf, + bias).

        `n_queries=n` computes only the first n outputs ([B, n, D]; every key still attends):
        the last block of the classifier needs [CLS] alone, which skips ~3/4 of its work."""
        B, T, D = h.shape
        H, Dh = self.cfg.n_heads, self.cfg.head_dim
        q, k, v = self.qkv(self.ln1(h)).view(B, T, 3, H, Dh).unbind(2)  # each [B, T, H, Dh]
        q, k = pe.rotate(q, k, pos)
        if n_queries is not None:
            q, mask, h = q[:, :n_queries], mask[:, :, :n_queries], h[:, :n_queries]
        Tq = q.shape[1]
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask)  # [B, H, Tq, Dh]
        h = h + self.drop(self.proj(att.transpose(1, 2).reshape(B, Tq, D)))
        return h + self.drop(self.mlp(self.ln2(h)))


class ModAddEncoder(nn.Module):
    """Encoder classifier; `forward(ids, lengths) -> logits [B, n_classes]`.

    ids: [B, T] int64, `[CLS]` first, right-padded; lengths: [B] real lengths (CLS included).
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.pe = POSITION_ENCODINGS[cfg.position](cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)
        self.token_head = nn.Linear(cfg.d_model, cfg.vocab_size) if cfg.token_head else None

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor,
                tokens: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """logits [B, n_classes]; with `tokens=True` also the token head's logits [B, T, vocab]
        (the last block then computes every position, not [CLS] alone)."""
        if tokens and self.token_head is None:
            raise ValueError("tokens=True needs a model built with EncoderConfig(token_head=True)")
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        keep = pos[None, :] < lengths[:, None]  # [B, T] real keys
        h = self.pe.embed(self.tok(ids), pos)  # [B, T, D]
        mask = torch.zeros(B, 1, 1, T, device=ids.device, dtype=h.dtype).masked_fill(
            ~keep[:, None, None, :], float("-inf"))
        bias = self.pe.bias(pos)
        if bias is not None:
            mask = mask + bias[None].to(h.dtype)  # [B, H, T, T]
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            h = blk(h, pos, self.pe, mask, n_queries=1 if i == last and not tokens else None)
        h = self.ln_f(h)
        logits = self.head(h[:, 0])  # [B, n_classes]
        return (logits, self.token_head(h)) if tokens else logits


__all__ = ["POSITION_ENCODINGS", "EncoderConfig", "ModAddEncoder", "PositionEncoding"]
