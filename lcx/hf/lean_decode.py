"""The engine's decode step through a Llama-like decoder without transformers' per-call
machinery: the same modules, the same operations in the same order, so the same bits.

A decode step of `lcx.engine` feeds one token per row and hands every attention layer its
`DecodeStep` (`lcx.hf.engine_hook`). Through the model's own forward, each step also builds a
causal mask nobody reads, computes the rotary tables again, and runs every layer through
keyword-argument plumbing, output capturing and the attention-function registry: on a small model
that is a large share of a step at batch 1 (docs/benchmarks.md, "Where the time goes"). vLLM runs
its own model code for the same reason.

`lean_decoder(model)` returns a callable `(input_ids [B, 1], positions [B], step) -> last hidden
state [B, 1, d]` for the decoders whose every layer is one of `LEAN_LAYERS` as transformers
defines it (Llama, Mistral, Qwen2, Qwen3: pre-norm, q/k/v projections, an optional per-head q/k
RMSNorm, o_proj, a gated MLP), with no sliding window of their own and no lcx method that needs
more than the decode step (a patched layer's method is the step's; a model as loaded gets the
family's own rotation, as its forward applies it). Anything else returns None and the engine runs
the model's forward, as before. tests/engine/test_lean_decode.py checks that both give identical
logits (`torch.equal`) on every listed family, patched and as loaded.

**One forward per step.** The same callable takes, beside the decode rows, a step's prefill
chunks (`MixedPrefill`): the rows' tokens run as one token matrix `[B + R, d]` (B decode rows, R
real prefill tokens, no padding) through every linear, norm and MLP, so a step that has both reads
the weights once, as vLLM's (its scheduler hands the model runner one flattened batch of decode
and prefill tokens). Only attention is per part: the decode rows through the step, the prefill
chunks, scattered into their left-padded `[P, C]` layout, over their held keys plus the new ones
as the model's own prefill call attends them in the engine: a patched layer with its method per
row on the held-keys view (`attend_rows`), a model as loaded per row on lcx's backend
(`attend_loaded_rows`, causal). The decode rows' logits equal a decode-only step's to float
rounding (the GEMMs see more rows), and the prefill part the engine's two-forward prefill's
(tests/engine/test_mixed_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .attention_call import STATE, LoadedRows, attend_loaded_rows, attend_rows, current_patch, hooked_forward
from .models import decoder

# decoder layer class -> whether its attention normalises q and k per head (Qwen3)
LEAN_LAYERS = {"LlamaDecoderLayer": False, "MistralDecoderLayer": False, "Qwen2DecoderLayer": False,
               "Qwen3DecoderLayer": True}
LEAN_DECODERS = {"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"}


def _stock(module: nn.Module, cls_prefix: str) -> bool:
    """A module of transformers' own class whose forward nothing replaced on the instance."""
    t = type(module)
    return t.__module__.startswith("transformers.models.") and t.__name__.startswith(cls_prefix) and (
        "forward" not in module.__dict__)


def why_not_lean(model: nn.Module) -> str | None:
    """Why the lean decode does not apply to `model` (None: it does)."""
    dec = decoder(model)
    if type(dec).__name__ not in LEAN_DECODERS or not type(dec).__module__.startswith("transformers.models."):
        return f"decoder {type(dec).__name__} is not one of {sorted(LEAN_DECODERS)}"
    fwd = dec.__dict__.get("forward")  # (lcx's own hook keeps the call's inputs: `hook_decoder`)
    if fwd is not None and getattr(getattr(fwd, "__func__", None), "__name__", None) != "_hooked_decoder_forward":
        return "a decoder forward other than lcx's hook is installed"
    cfg = dec.config
    if getattr(cfg, "sliding_window", None) is not None and (
            getattr(cfg, "use_sliding_window", True) or type(dec).__name__ == "MistralModel"):
        return "the model runs a sliding window of its own"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "not every layer is a full-attention layer"
    patch = current_patch(model)
    for layer in dec.layers[: cfg.num_hidden_layers]:
        name = type(layer).__name__
        if name not in LEAN_LAYERS or not _stock(layer, name):
            return f"layer {type(layer).__name__} is not one of {sorted(LEAN_LAYERS)} as transformers defines it"
        prefix = name[: -len("DecoderLayer")]
        attn = layer.self_attn
        if not (type(attn).__name__ == f"{prefix}Attention" and type(attn).__module__ == type(layer).__module__):
            return f"attention {type(attn).__name__} is not {prefix}Attention"
        fwd = attn.__dict__.get("forward")
        if fwd is not None and getattr(fwd, "__func__", None) is not hooked_forward:
            return "an attention forward other than lcx's hook is installed"
        st = attn.__dict__.get(STATE)
        if st is None:
            return "the attention layers do not take lcx's decode step"
        if patch is not None and (st.method is None or st.own_window or getattr(st, "order", None) is not None
                                  and not st.order.identity):
            return "a patched layer runs the family's own window or another channel order"
        if getattr(attn, "sliding_window", None) is not None:
            return "a layer runs a sliding window of its own"
        if not (_stock(layer.mlp, f"{prefix}MLP") and _stock(layer.input_layernorm, f"{prefix}RMSNorm")
                and _stock(layer.post_attention_layernorm, f"{prefix}RMSNorm")):
            return "a layer's MLP or norm is not the family's own"
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                    layer.mlp.down_proj):
            if type(lin) is not nn.Linear:
                return f"a projection is a {type(lin).__name__}, not nn.Linear"
    if not _stock(dec.norm, f"{type(dec).__name__[:-len('Model')]}RMSNorm"):
        return "the final norm is not the family's own"
    if type(dec.embed_tokens) is not nn.Embedding:
        return "the embedding is not nn.Embedding"
    return None


@dataclass
class MixedPrefill:
    """The prefill part of a step run in one forward with its decode rows (module docstring): P
    rows of C slots, left-padded, continuing from held keys.

    ids / positions `[R]`: the real tokens (row by row) and their positions; slots `[R]`: each
    one's index into the flattened `[P * C]` layout; key_positions `[P, N + C]`: each row's held
    slots then its new ones (-1: not a key of the row); held_keys / held_values: per layer
    `[P, Hkv, N, D]`, or `[P, Hkv, N + C, D]` with the last C slots for the new keys (filled
    here, no concatenation) (None: nothing held); loaded: a model as loaded attends per row on lcx's
    backend (`LoadedRows`), None on a patched model (its method per row). The forward fills keys
    / values (per layer `[P, Hkv, N + C, D]`, zeros on padding) and hidden `[P, C, d]`."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    shape: tuple[int, int]
    key_positions: torch.Tensor
    held_keys: list[torch.Tensor] | None
    held_values: list[torch.Tensor] | None
    loaded: LoadedRows | None
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    hidden: torch.Tensor | None = None

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """Real tokens' rows `[R, ...]` -> the padded layout `[P, C, ...]` (zeros on padding)."""
        P, C = self.shape
        if self.slots.numel() == P * C:  # no padding (rows of one length): no copy
            return x.reshape((P, C) + tuple(x.shape[1:]))
        out = x.new_zeros((P * C,) + tuple(x.shape[1:]))
        out[self.slots] = x
        return out.view((P, C) + tuple(x.shape[1:]))

    def real(self, x: torch.Tensor) -> torch.Tensor:
        """`[P, C, ...]` -> the real tokens' rows `[R, ...]`."""
        flat = x.reshape((-1,) + tuple(x.shape[2:]))
        return flat if self.slots.numel() == flat.shape[0] else flat[self.slots]


def _separate(mods: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    return [m(x) for m in mods]


def lean_decoder(model: nn.Module, project: Callable[[list[nn.Module], torch.Tensor], list[torch.Tensor]] = _separate
                 ) -> Callable[..., torch.Tensor] | None:
    """The lean decode forward of `model` (module docstring), or None where it does not apply:
    `(input_ids [B, 1], positions [B], step, prefill: MixedPrefill | None = None) -> the decode
    rows' last hidden state [B, 1, d]`. `project(linears, x)`: the outputs of linears reading the
    same input (q/k/v, the MLP's gate/up), each as its own forward would give them (the engine's
    `lcx.engine.packed.merged`: one GEMM); with `prefill`, its chunks run in the same forward and
    their keys, values and hidden states are filled in. Call it while the model's state is the one
    checked here (the engine checks every step that its patch is unchanged:
    `lcx.engine.runner.ModelRunner.check_hook`)."""
    if why_not_lean(model) is not None:
        return None
    dec = decoder(model)
    layers = list(dec.layers[: dec.config.num_hidden_layers])
    qk_norm = LEAN_LAYERS[type(layers[0]).__name__]
    rotate = None
    if current_patch(model) is None:  # a model as loaded: the family's own rotation, as its forward
        fn = type(layers[0].self_attn).forward.__globals__["apply_rotary_pos_emb"]
        rotate = getattr(fn, "_lcx_original", fn)
    embed, rotary, norm = dec.embed_tokens, dec.rotary_emb, dec.norm

    def attend_prefill(attn: nn.Module, pre: MixedPrefill, q, k, v) -> torch.Tensor:
        """The prefill chunks' attention: q/k/v `[R, 1, H(kv), D]` -> `[R, H, D]`."""
        i = attn.layer_idx
        k, v = pre.padded(k[:, 0]).transpose(1, 2), pre.padded(v[:, 0]).transpose(1, 2)  # [P, Hkv, C, D]
        if pre.held_keys is not None:
            hk, hv = pre.held_keys[i], pre.held_values[i]
            if hk.shape[2] == pre.key_positions.shape[1]:  # room left for the new keys (`stack_rows`)
                hk[:, :, -k.shape[2]:], hv[:, :, -v.shape[2]:] = k, v
                k, v = hk, hv
            else:
                k, v = torch.cat([hk, k], 2), torch.cat([hv, v], 2)
        pre.keys.append(k)
        pre.values.append(v)
        q, k, v = pre.padded(q[:, 0]), k.transpose(1, 2), v.transpose(1, 2)  # [P, C, H, D], [P, N + C, Hkv, D]
        if pre.loaded is not None:
            o = attend_loaded_rows(attn, q, k, v, pre.loaded, attn.scaling)
        else:
            o = attend_rows(attn.__dict__[STATE], q, k, v, pre.key_positions, dec, attn.scaling, i)
        return pre.real(o)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, step: Any,
                prefill: MixedPrefill | None = None) -> torch.Tensor:
        B = input_ids.shape[0]
        if prefill is not None:  # one token matrix: the decode rows, then the chunks' real tokens
            input_ids = torch.cat([input_ids, prefill.ids[:, None]])
            positions = torch.cat([positions, prefill.positions])
        h = embed(input_ids)
        N = h.shape[0]
        if rotate is not None:
            cos, sin = rotary(h, position_ids=positions[:, None])
        for layer in layers:
            attn = layer.self_attn
            res = h
            x = layer.input_layernorm(h)
            shape = (N, 1, -1, attn.head_dim)
            q, k, v = (t.view(shape) for t in project([attn.q_proj, attn.k_proj, attn.v_proj], x))
            if qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            if rotate is not None:  # (the family rotates [B, H, 1, D], as its attention forward)
                q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
                q, k = q.transpose(1, 2), k.transpose(1, 2)
            if prefill is None:
                o = step.attend(attn, q, k, v).reshape(B, 1, -1)
            else:
                o = torch.cat([step.attend(attn, q[:B], k[:B], v[:B]).reshape(B, -1),
                               attend_prefill(attn, prefill, q[B:], k[B:], v[B:]).reshape(N - B, -1)])[:, None]
            h = res + attn.o_proj(o.contiguous())
            res = h
            mlp = layer.mlp  # (the family's gated MLP, as its forward: down(act(gate(x)) * up(x)))
            gate, up = project([mlp.gate_proj, mlp.up_proj], layer.post_attention_layernorm(h))
            h = res + mlp.down_proj(mlp.act_fn(gate) * up)
        h = norm(h)
        if prefill is None:
            return h
        prefill.hidden = prefill.padded(h[B:, 0])
        return h[:B]

    return forward


__all__ = ["LEAN_DECODERS", "LEAN_LAYERS", "MixedPrefill", "lean_decoder", "why_not_lean"]
