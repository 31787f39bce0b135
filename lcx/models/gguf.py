"""GGUF files, through the cache store. transformers dequantizes a GGUF on every
`from_pretrained(dir, gguf_file=...)` (~15-30 s for SmolLM2-135M on 2 cores), so the first load
writes the dequantized model and the tokenizer as a plain HF directory (float32 safetensors) under

    $LCX_CACHE_DIR/gguf/<stem>-<key>/        (default $LCX_CACHE_DIR = ~/.cache/lcx)

where `key` hashes the GGUF's absolute path, size and mtime, the transformers version and
`CACHE_FORMAT`; a changed file or library therefore gets a fresh entry. Every load, the first
one included, then reads that directory, so both return the same objects. An entry is built
atomically (`lcx.models.store.build_entry`) and only after its tokenizer has been checked to
round-trip.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .store import CACHE_FORMAT, build_entry, cache_root, entry_valid

log = logging.getLogger(__name__)


def gguf_cache_dir(gguf_path: str | os.PathLike) -> Path:
    """The cache entry a GGUF file maps to (it may not exist yet): keyed by the file it resolves
    to, named after the name it was given (a Hub snapshot's `x.gguf` is a link to a blob named by
    its hash)."""
    given = Path(gguf_path).expanduser()
    p = given.resolve()
    st = p.stat()
    ident = "|".join([str(p), str(st.st_size), str(st.st_mtime_ns),
                      metadata.version("transformers"), str(CACHE_FORMAT)])
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{given.stem}-{key}"


def is_gguf_cached(gguf_path: str | os.PathLike) -> bool:
    """True when the GGUF has a complete cache entry (manifest and file sizes match)."""
    return entry_valid(gguf_cache_dir(gguf_path))


def build_gguf_cache(gguf: Path, entry: Path) -> None:
    """Dequantize `gguf` and write it as an HF directory at `entry`, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log.info("dequantizing %s into the cache at %s (once per file)", gguf, entry)

    def fill(tmp: Path) -> dict[str, Any]:
        kw = dict(gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        _align_special_tokens(tok, model.config)
        # BPE tokenizers must not "clean up" spaces before punctuation on decode: it breaks
        # decode(encode(s)) == s.
        tok.clean_up_tokenization_spaces = False
        # The weights are plain float32 tensors now; drop the GGUF "quantizer" so the model saves
        # (and reloads) as an ordinary checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _check_tokenizer_round_trip(tok, tmp)
        st = gguf.stat()
        return {"source": str(gguf), "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns,
                "transformers": metadata.version("transformers")}

    build_entry(entry, fill)
    log.info("cached %s in %.1f s", gguf.name, time.perf_counter() - t0)


def _align_special_tokens(tok: Any, config: Any) -> None:
    """Make the tokenizer's bos/eos/pad/unk agree with the ids the GGUF metadata declares.

    transformers 5.17's GGUF tokenizer conversion for Llama-arch BPE files (e.g. SmolLM2) sets
    eos to the BOS token (`<|im_start|>`, id 1) although the file says eos id 2 (`<|im_end|>`),
    and leaves pad unset. The config it parses from the same file has the right ids.
    """
    for role in ("bos", "eos", "pad", "unk"):
        tid = getattr(config, f"{role}_token_id", None)
        if not isinstance(tid, int) or not 0 <= tid < len(tok):
            continue
        if getattr(tok, f"{role}_token_id") != tid:
            setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(tid))


_ROUND_TRIP_TEXTS = (
    "The capital of France is Paris.",
    "  leading spaces, tabs\tand\nnewlines , before punctuation !",
    "Unicode: café, naïve, Straße, 東京, emoji 🙂.",
    "def f(x):\n    return x ** 2  # code",
)


def _check_tokenizer_round_trip(tok: Any, saved: Path) -> None:
    """The saved tokenizer must encode like the in-memory one, decode back to the input, and
    keep the special tokens and the chat template. Raises `RuntimeError` otherwise."""
    from transformers import AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    problems = []
    for s in _ROUND_TRIP_TEXTS:
        ids = tok(s, add_special_tokens=False).input_ids
        if tok2(s, add_special_tokens=False).input_ids != ids:
            problems.append(f"encoding of {s!r} changed")
        if tok2.decode(ids) != s:
            problems.append(f"decode(encode({s!r})) = {tok2.decode(ids)!r}")
    for role in ("bos", "eos", "pad", "unk"):
        if getattr(tok2, f"{role}_token_id") != getattr(tok, f"{role}_token_id"):
            problems.append(f"{role}_token_id changed")
    if tok2.chat_template != tok.chat_template:
        problems.append("chat template changed")
    elif tok.chat_template:
        msgs = [{"role": "user", "content": "Hi"}]
        a = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        b = tok2.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if a != b:
            problems.append("chat template renders differently")
    if problems:
        raise RuntimeError(f"cached tokenizer at {saved} does not round-trip: {problems}")
