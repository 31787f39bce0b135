"""vLLM model classes that run lcx methods (imported by vLLM through the ModelRegistry only).

`LcxLlamaForCausalLM` is vLLM's `LlamaForCausalLM` (same weights, same kernels) whose layers
take their rotary embedding from lcx (`VllmRotaryEmbedding`) and whose attention layers get the
sliding window of an lcx `sliding_window` method from the HF config (see `.config`). The methods
come from the config attribute `lcx_methods`, written by `lcx.serve.vllm_plugin.hf_overrides`.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

from lcx.rope import RopeSpec, compute_inv_freq, rope_cos_sin

from .config import keys_rotated, methods_from_hf_config, needs_unrotated, rope_spec, runs_lcx_attention
from .method_attention import method_for_rank, switch_to_method


class VllmRotaryEmbedding(RotaryEmbedding):
    """vLLM's rotary embedding (its kernels, GPT-NeoX layout) with an lcx RoPE basis.

    The cos/sin cache is `[max_position, rotary_dim]` = `cat(cos, sin)` of half width each,
    vLLM's layout; angles come from `lcx.rope.compute_inv_freq` and are formed in float64 by
    `lcx.rope.rope_cos_sin`, multiplied by the spec's attention factor (as lcx and HF do).
    """

    def __init__(self, spec: RopeSpec, head_size: int, max_position: int, dtype: torch.dtype):
        object.__setattr__(self, "spec", spec)  # read by _compute_cos_sin_cache during super().__init__
        super().__init__(head_size=head_size, rotary_dim=spec.rotary_dim(head_size),
                         max_position_embeddings=max_position, base=float(spec.rope_theta),
                         is_neox_style=True, dtype=dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq, attention_factor = compute_inv_freq(self.spec, self.head_size, None)  # [r/2] f64
        positions = torch.arange(self.max_position_embeddings)
        cos, sin = rope_cos_sin(positions, inv_freq, attention_factor, dtype=torch.float32)  # [P, r]
        half = self.rotary_dim // 2
        return torch.cat((cos[:, :half], sin[:, :half]), dim=-1)  # [P, r]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lcx={self.spec.describe()}"


class LcxLlamaAttention(LlamaAttention):
    """LlamaAttention whose rotary embedding is the lcx spec of `config.lcx_methods` (if any),
    and which runs the other lcx methods (LM-Infinite, StreamingLLM, Self-Extend, SWAT) itself
    (`.method_attention`): on q/k rotated by this layer's rotary (methods with a decode rule:
    keys cached after RoPE, as plain vLLM caches them), or on unrotated q/k (SWAT, LM-Infinite
    with top-k)."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        methods = methods_from_hf_config(config)
        self.lcx_unrotated = needs_unrotated(methods)
        if runs_lcx_attention(methods):
            spec = rope_spec(methods) or RopeSpec.for_model({}, config)
            inv_freq, attention_factor = compute_inv_freq(spec, self.head_dim, None)
            method = method_for_rank(methods.attention, self.total_num_heads, self.num_heads,
                                     get_tensor_model_parallel_rank())
            switch_to_method(self.attn, method, inv_freq, attention_factor, rotated=keys_rotated(methods))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.lcx_unrotated:
            return super().forward(positions, hidden_states)
        # Unrotated layout: no rotary here, the lcx method rotates inside attention.
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output

    def _init_rotary_emb(self, config, quant_config) -> None:
        methods = methods_from_hf_config(config)
        if methods.rope is None and not keys_rotated(methods):
            return super()._init_rotary_emb(config, quant_config)
        # lcx's table also for the model's own RoPE under a rotated-key method: the cached keys
        # then carry exactly the rotation the method's re-rotation tables assume.
        spec = rope_spec(methods) or RopeSpec.for_model({}, config)
        # Cover every position vLLM may schedule (max_model_len can exceed the config's length).
        max_len = get_current_vllm_config().model_config.max_model_len
        self.rotary_emb = VllmRotaryEmbedding(spec, self.head_dim,
                                              max(self.max_position_embeddings, int(max_len)),
                                              torch.get_default_dtype())


class LcxLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None,
                 attn_layer_type: type[torch.nn.Module] = LcxLlamaAttention) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type)


class LcxLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's Llama with lcx methods; registered as architecture "LcxLlamaForCausalLM"."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        # Validate once, before any layer is built: a bad config fails with lcx's message.
        self.lcx_methods = None
        methods = methods_from_hf_config(vllm_config.model_config.hf_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=LcxLlamaDecoderLayer)
        self.lcx_methods = methods
