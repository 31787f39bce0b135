"""Model loading: presets, local HF directories, GGUF files (cached), and the tiny test model.

>>> from lcx.models import load_model
>>> model, tokenizer = load_model("smollm2-135m")   # or a path, or "tiny-5m"
"""

from .loading import (
    MODELS,
    ModelPreset,
    cache_root,
    gguf_cache_dir,
    hf_directory,
    is_gguf_cached,
    load_model,
    model_family,
    resolve_source,
)
from .tiny import save_tiny_llama, tiny_config, tiny_llama

__all__ = [
    "MODELS",
    "ModelPreset",
    "cache_root",
    "gguf_cache_dir",
    "hf_directory",
    "is_gguf_cached",
    "load_model",
    "model_family",
    "resolve_source",
    "save_tiny_llama",
    "tiny_config",
    "tiny_llama",
]
