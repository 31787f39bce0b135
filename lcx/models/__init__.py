"""Model loading: presets, local HF directories, GGUF files (cached), and the tiny test model.

One module per part: `presets` (`MODELS`), `store` (the atomic cache store both caches share),
`gguf` (GGUF files dequantized once into the store), `compressed` (`X.xz` directories unpacked
once into the store), `loading` (`load_model`, `resolve_source`, `hf_directory`), `tiny`, `swat`.

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
