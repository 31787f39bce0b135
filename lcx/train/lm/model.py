"""The `lcx train lm` model: a stock `transformers.LlamaForCausalLM` (or an `ATTENTION_VARIANTS`
entry built from the same `LlamaConfig`), so `lcx.patch`, `save_pretrained` and every HF tool
work on it unchanged. Default shape (`ModelConfig()`), ~5.0M parameters:

    vocab 4096 (byte-level BPE, tied input/output embeddings)   1.05M
    5 layers x [q 256x256, k/v 256x128 (GQA: 4 query heads share 2 kv heads), o 256x256,
                SwiGLU 256->768->256, 2 RMSNorms]                5 x 0.79M
    head_dim 64, RoPE theta 10000, trained at 256 positions (max_position_embeddings)

Fine-tuning (`--init PRESET_OR_DIR`, `TrainConfig.init`): start from an existing model's weights
and tokenizer instead of a fresh init; its shape and attention variant (sdpa or SWAT) are kept
and recorded as `TrainConfig.model` (`model_config_of`). `--init` also takes a GGUF preset such
as `smollm2-135m` (its dequantized float32 directory, `resolve_init`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .variants import ATTENTION_VARIANTS


def llama_config(mc: ModelConfig, *, bos_token_id: int = 0, eos_token_id: int = 1, pad_token_id: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers,
        num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        max_position_embeddings=mc.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(mc.rope_theta)},
        tie_word_embeddings=mc.tie_word_embeddings,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
        **({"sliding_window": mc.window} if mc.window is not None else {}),
    )


def build_model(mc: ModelConfig, *, seed: int | None = None, **token_ids: int) -> torch.nn.Module:
    """A freshly initialised model; with `seed`, the initialisation is reproducible."""
    config = llama_config(mc, **token_ids)
    if seed is not None:
        torch.manual_seed(seed)
    return ATTENTION_VARIANTS[mc.attention](config)


def model_config_of(config: Any) -> ModelConfig:
    """The `ModelConfig` of an HF Llama config (a model written by `lcx train lm`, or any plain
    Llama-family checkpoint with default RoPE); SWAT configs map to attention="swat"."""
    from lcx.hf.models import model_shape
    from lcx.hf.swat import is_swat

    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"init: only default RoPE can be fine-tuned here, got rope_parameters={rope}")
    swat = is_swat(config)
    head_dim = model_shape(config).head_dim
    return ModelConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=head_dim, max_position_embeddings=config.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        tie_word_embeddings=bool(config.tie_word_embeddings),
        attention="swat" if swat else "sdpa", window=int(config.sliding_window) if swat else None,
    )


def resolve_init(init: str) -> Path:
    """The HF directory of `--init` (a preset name or a directory, `lcx.load_model`'s rules; a GGUF
    file or preset gives the float32 HF directory `lcx.models` dequantizes it to)."""
    from lcx.models import resolve_source

    kind, path = resolve_source(init)
    if kind == "gguf":  # the dequantized float32 HF directory lcx.models caches for a GGUF (built once)
        from lcx.models import gguf_cache_dir, is_gguf_cached, load_model

        if not is_gguf_cached(path):
            load_model(path)
        return gguf_cache_dir(path)
    if kind != "hf":
        raise ValueError(f"--init {init!r} is a {kind} file; fine-tuning needs a Hugging Face model directory")
    return path


def init_model_config(init: str) -> ModelConfig:
    """`ModelConfig` of the `--init` model, read from its config.json (weights not loaded)."""
    from transformers import AutoConfig

    from lcx.hf.swat import from_pretrained_kwargs

    path = resolve_init(init)
    return model_config_of(AutoConfig.from_pretrained(path, local_files_only=True, **from_pretrained_kwargs(path)))


def load_init(init: str, expected: ModelConfig) -> torch.nn.Module:
    """The `--init` model (float32, train mode). Its `ModelConfig` must equal `expected`."""
    from lcx.models import load_model

    model, _ = load_model(resolve_init(init))
    got = model_config_of(model.config)
    if got != expected:
        diff = {k: (v, getattr(expected, k)) for k, v in dataclasses.asdict(got).items() if getattr(expected, k) != v}
        raise ValueError(f"init {init!r}: model config differs from the run's (init, run): {diff}")
    return model.float().train()


def file_sha256(path: str | os.PathLike) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
