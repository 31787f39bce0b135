"""The fast path's decode step over the engine's KV cache (`lcx.engine.kv` states the layout):
what a model's attention layers run when the model runner hands them `lcx_decode` (the interface:
`lcx.hf.engine_hook.DecodeStep`).

`DecodeStep.build(store, p_q, dtype)` reads one layer group's store (`lcx.engine.kv.KVStore`): the
slots this step writes, which held keys are visible in which branch of the method's `DecodeRule`
(`lcx.methods.plan.branches`), and the rotation tables of the step. Each layer's `attend` rotates
its new query and key, writes the key, and runs one softmax over [main | side] (`decode_attention`).
`ModelStep` hands each layer its group's step (a hybrid model's layers differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..attention.reference import top_k_indices
from ..attention.spec import soft_cap
from ..hf.attention_call import native_rows
from ..methods.plan import branches
from ..rope import apply_rotary_ref, rope_cos_sin

if TYPE_CHECKING:  # (kv imports this module; the store is only read here)
    from .kv import KVStore, StepSlots

NEG_INF = float("-inf")


@dataclass
class DecodeStep:
    """The fast path's decode step, handed to every attention layer as the `lcx_decode` keyword
    of the model's forward (`lcx.hf.attention_patch` calls its `attend` with each layer's q/k/v):
    rotation tables of the step, visibility of every slot, and the slots to write. Layers rotate
    their new query and key, write the key, and attend over [main | side] in one softmax
    (`decode_attention`)."""

    slots: StepSlots
    main_len: int  # the main store's slots this step reads (an unbounded store: up to the newest key)
    side_len: int  # the side store's slots this step reads (0: no side key is visible: no side branch)
    main_visible: torch.Tensor  # [B, main_len] bool
    side_visible: torch.Tensor | None  # [B, side_len] bool
    mid_len: int = 0  # top-k branch: side-store slots holding its candidates (0: none this step)
    mid_visible: torch.Tensor | None = None  # [B, 1, 1, mid_len] bool: the middle keys of each row
    mid_rows: torch.Tensor | None = None  # [B, 1, 1, 1] bool: rows whose middle holds >= k keys
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name -> cos, sin [B, 1, r]
    hidden: torch.Tensor | None = None  # [B, 1, 1, main_len + side_len] True where a slot is not attended

    @classmethod
    def build(cls, store: KVStore, p_q: torch.Tensor, dtype: torch.dtype) -> "DecodeStep":
        lay = store.layout
        slots = store.step(p_q)
        # Read only slots that can hold a visible key: a key's slot is at most its position, so
        # nothing past the newest key (a store may be allocated for the rows' whole budget); a
        # side store only up to the newest key outside the window.
        # Which held key is in which branch is the rule's (`lcx.methods.plan.branches`, the one
        # statement of it, shared with the vLLM plugin's plan); a slot's position -1 is empty.
        main_len = min(store.main.capacity, int(p_q.max()) + 1)  # (a ring's slot is p % window <= p)
        rule = lay.rule
        pos = store.main.pos[:, :main_len]
        main_visible = pos >= 0  # a ring holds only its window, an unbounded store every key
        if rule is not None:
            main_visible &= branches(rule, pos, p_q[:, None])[0]
        side_len, side_visible = 0, None
        mid = {}
        if store.side is not None:  # (a rotated layout with a side store has a rule: `CacheLayout.for_method`)
            reach = max(0, min(store.side.capacity, int(p_q.max()) - lay.window + 1))  # keys <= p_q - window
            pos = store.side.pos[:, :reach]
            _, side, middle = branches(rule, pos, p_q[:, None])
            side, middle = side & (pos >= 0), middle & (pos >= 0)
            side_len = min(reach, rule.side) if rule.top_k else reach  # a top-k side store keeps every key
            if side_len:
                side_visible = side[:, :side_len]
            if rule.top_k and reach > rule.side:
                # LM-Infinite's middle: side <= p <= p_q - window, in rows holding >= k of them
                rows = middle.sum(1) >= rule.top_k
                if bool(rows.any()):
                    mid = dict(mid_len=reach, mid_rows=rows[:, None, None, None],
                               mid_visible=middle[:, None, None, :])
        step = cls(slots, main_len, side_len, main_visible, side_visible, **mid)
        if lay.basis is not None:  # lcx rotates (patched model); else the model's own code did
            inv_freq, af = lay.basis
            if lay.order is not None:  # (zero frequencies for passed channels: lcx.hf.channel_order)
                inv_freq = lay.order.basis(inv_freq)
            inv_freq = inv_freq.to(p_q.device)
            tdt = torch.promote_types(dtype, torch.float32)
            p = p_q.to(torch.float64)[:, None]  # [B, 1]
            step.tables["main"] = rope_cos_sin(p, inv_freq, af, tdt)
            if store.side is not None:
                step.tables["side_query"] = rope_cos_sin(lay.rule.side_query(p), inv_freq, af, tdt)
                rows = slots.side_rows
                step.tables["side_key"] = rope_cos_sin(lay.rule.side_key(p[rows]), inv_freq, af, tdt)
            if step.mid_len:
                step.tables["top_k_query"] = rope_cos_sin(torch.full_like(p, rule.top_k_query), inv_freq, af, tdt)
        return step

    def attend(self, attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               softcap: float | None = None) -> torch.Tensor:
        """One attention layer's step (`attn`: the HF attention module, for `layer_idx` and
        `scaling`; `softcap`: the family's attention-logit soft-capping, Gemma 2, on every logit
        of the step): its new q `[B, 1, H, D]`, k/v `[B, 1, Hkv, D]` as the family's own code made
        them (`lcx.hf.attention_patch` hands them over) -> out `[B, 1, H, Dv]` (the module applies
        o_proj). With a basis (a patched model) q and k arrive before RoPE, in lcx's channel
        order, and are rotated here (a partial head's query corrected for the attention factor
        first); without one (an unpatched model) the family's own code
        rotated them."""
        if "main" in self.tables:
            lay = self.slots.store.layout
            if lay.order is not None:  # a partial head's passed query channels (lcx.hf.channel_order)
                q = lay.order.fix_query(q, lay.basis[1])
            cos, sin = self.tables["main"]
            qm, km = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
        else:
            qm, km = q, k
        ks = None
        store = self.slots.store
        if store.side is not None:
            rows = self.slots.side_rows
            if rows.numel():
                ks = apply_rotary_ref(k[rows], *self.tables["side_key"])[:, 0]
        layer = store.local(attn.layer_idx)  # index in this group's per-layer lists
        self.slots.write(layer, km[:, 0], v[:, 0], ks)
        side = None
        if self.side_len:
            n = self.side_len
            side = (apply_rotary_ref(q, *self.tables["side_query"]), store.side.k[layer][:, :, :n],
                    store.side.v[layer][:, :, :n], self.side_visible)
        if self.hidden is None:  # the step's mask, built once for every layer
            vis = self.main_visible if side is None else torch.cat([self.main_visible, self.side_visible], -1)
            self.hidden = ~vis[:, None, None, :]
        extra = None
        if self.mid_len and store.layout.rule.top_k_in_layer(attn.layer_idx):  # the rule counts model layers
            extra = self._top_k(q, store.side.k[layer], store.side.v[layer], store.layout.rule.top_k, attn.scaling,
                                softcap)
        n = self.main_len
        return decode_attention(qm, store.main.k[layer][:, :, :n], store.main.v[layer][:, :, :n], self.main_visible,
                                side=side, scale=attn.scaling, hidden=self.hidden, extra=extra, softcap=softcap)


    def _top_k(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, top_k: int, scale: float,
               softcap: float | None = None):
        """LM-Infinite's top-k middle keys of the step's query: (logits `[B, Hkv, g, k]`, scaled
        and soft-capped, -inf in rows whose middle holds fewer than k keys; their values
        `[B, Hkv, g, k, Dv]`)."""
        B, _, H, D = q.shape
        Hkv, n = k.shape[1], self.mid_len
        wide = torch.promote_types(q.dtype, torch.float32)
        qt = apply_rotary_ref(q, *self.tables["top_k_query"]).reshape(B, Hkv, H // Hkv, D)
        m = soft_cap(torch.matmul(qt.to(wide), k[:, :, :n].to(wide).transpose(-1, -2)) * scale, softcap)  # [B, Hkv, g, n]
        m = m.masked_fill_(~self.mid_visible, NEG_INF)
        idx = top_k_indices(m, top_k)  # per query head; ties to the earlier key (slots are in position order)
        best = m.gather(-1, idx)
        best = best.masked_fill(~self.mid_rows, NEG_INF)
        vals = v[:, :, :n].unsqueeze(2).expand(B, Hkv, H // Hkv, n, v.shape[-1])
        return best, vals.gather(3, idx[..., None].expand(*idx.shape, v.shape[-1]))


class ModelStep:
    """A decode step of a whole model (`lcx_decode`): each attention layer attends with its
    group's `DecodeStep` (same `attend` signature)."""

    per_layer = True  # each layer attends with its own group's cache (`lcx.hf.attention_patch`)

    def __init__(self, by_layer: dict[int, DecodeStep]):
        self.by_layer = by_layer

    def attend(self, attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               softcap: float | None = None) -> torch.Tensor:
        return self.by_layer[attn.layer_idx].attend(attn, q, k, v, softcap=softcap)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, *,
                     side: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     scale: float | None = None, hidden: torch.Tensor | None = None,
                     extra: tuple[torch.Tensor, torch.Tensor] | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """One query per row over a slot store: rotated q `[B, 1, H, D]`, k/v `[B, Hkv, C, D]`,
    visible `[B, C]`; `side` = (q rotated for the side branch, its k, v, visible) joins the
    same softmax. -> `[B, 1, H, Dv]`. `hidden`: the inverse of [visible | side visible] as
    `[B, 1, 1, C + Cs]`, when the caller has it (one per step, shared by the layers). `extra`:
    (logits `[B, Hkv, g, n]` already scaled, -inf where not visible; their values
    `[B, Hkv, g, n, Dv]`) of keys chosen per query head (LM-Infinite's top-k), in the same softmax.
    `softcap`: every scaled logit soft-capped (`lcx.attention.soft_cap`; `extra`'s already are).

    float32 on the CPU without a side branch or `extra` (vanilla, sliding window): lcx's C++
    kernel (`lcx.kernels.cpu.causal_attention.decode_attention_cpu`, where it builds: 1.7-2.5x
    the matmul path at 1-32 rows over 544-2048 slots, `lcx bench rows`). Otherwise GQA without copies: the H // Hkv query heads of
    a kv head are one [g, D] block against its keys. float32/float64: scores and softmax in that dtype (matmuls over the cache as it is).
    float16/bfloat16 without a side branch (vanilla, sliding window): torch's fused SDPA, which
    accumulates in float32. float16/bfloat16 with a side branch: the cache is upcast per call
    (exact, but a copy of the window's keys and values; a fused two-branch kernel would avoid it
    — not yet measured on a GPU).
    """
    B, _, H, D = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    scale = D ** -0.5 if scale is None else scale
    if side is None and extra is None and k.dtype == v.dtype == q.dtype and native_rows(q):
        from ..kernels.cpu.causal_attention import decode_attention_cpu

        return decode_attention_cpu(q, k, v, visible, scale, softcap)
    wide = torch.promote_types(q.dtype, torch.float32)
    if side is None and extra is None and softcap is None and q.dtype in (torch.float16, torch.bfloat16):
        mask = visible[:, None, None, :] if hidden is None else ~hidden
        out = F.scaled_dot_product_attention(q.reshape(B, Hkv, g, D), k, v, attn_mask=mask, scale=scale)
        return out.reshape(B, 1, H, v.shape[-1])

    def scores(qx, kx):  # [B, Hkv, g, C]
        return torch.matmul(qx.reshape(B, Hkv, g, D).to(wide), kx.to(wide).transpose(-1, -2))

    s = scores(q, k)
    if side is not None:
        s = torch.cat([s, scores(side[0], side[1])], -1)
    if hidden is None:
        vis = visible if side is None else torch.cat([visible, side[3]], -1)
        hidden = ~vis[:, None, None, :]
    s = soft_cap(s * scale, softcap).masked_fill_(hidden, NEG_INF)
    if extra is not None:
        s = torch.cat([s, extra[0].to(wide)], -1)
    p = torch.softmax(s, dim=-1)
    C = k.shape[2]
    Cs = side[1].shape[2] if side is not None else 0
    out = torch.matmul(p[..., :C], v.to(wide))  # [B, Hkv, g, Dv]
    if side is not None:
        out = out + torch.matmul(p[..., C:C + Cs], side[2].to(wide))
    if extra is not None:
        out = out + torch.matmul(p[..., C + Cs:].unsqueeze(-2), extra[1].to(wide)).squeeze(-2)
    return out.reshape(B, 1, H, v.shape[-1]).to(v.dtype)


__all__ = ["CacheLayout", "DecodeStep", "KVLayout", "KVStore", "ModelKV", "ModelStep", "StepSlots", "decode_attention",
           "rotate_rows"]


__all__ = ["DecodeStep", "ModelStep", "decode_attention"]
