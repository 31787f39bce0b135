"""Helpers shared by lcx's lm-eval tasks that need no lm-eval: metadata parsing, the model's
tokenizer, token counting, and the order in which a grid is visited.

Metadata. lm-eval hands every task the merged `--model_args` and `--metadata` dicts (RULER's
convention): `max_seq_lengths` lists context lengths in tokens of the model's own tokenizer,
and the tokenizer is named by `tokenizer`, else `pretrained`, else `model` (the first non-empty
string wins, as in lm-eval's RULER tasks). Anything `lcx.load_model` accepts works: a local
Hugging Face directory, a `.gguf` file or a preset name (`tiny-5m`, `smollm2-135m`).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

TOKENIZER_KEYS = ("tokenizer", "pretrained", "model")


# ---------------------------------------------------------------------------- metadata
def int_list(value: Any, name: str) -> list[int]:
    """Parse `[256, 512]`, `"256,512"`, `"[256, 512]"` or `256` into a sorted, de-duplicated
    list of positive ints; anything else raises `ValueError` naming `name`."""
    if isinstance(value, str):
        s = value.strip()
        value = json.loads(s) if s.startswith("[") else [v for v in s.split(",") if v.strip()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{name} must be a non-empty list of positive integers, got {value!r}")
    out = []
    for v in value:
        try:
            iv = int(v)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: {v!r} is not an integer") from None
        if iv != float(v) or iv <= 0:
            raise ValueError(f"{name}: {v!r} is not a positive integer")
        out.append(iv)
    return sorted(set(out))


def lengths_from(meta: Mapping[str, Any], default: Sequence[int]) -> list[int]:
    """`max_seq_lengths` from task metadata (RULER's key), else `default`."""
    value = meta.get("max_seq_lengths")
    return int_list(default if value is None else value, "max_seq_lengths")


def get_int(meta: Mapping[str, Any], key: str, default: int, minimum: int = 0) -> int:
    value = meta.get(key, default)
    if value is None:
        return default
    try:
        iv = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"metadata {key!r} must be an integer, got {value!r}") from None
    if iv != float(value) or iv < minimum:
        raise ValueError(f"metadata {key!r} must be an integer >= {minimum}, got {value!r}")
    return iv


# ---------------------------------------------------------------------------- tokenizer
def tokenizer_name(meta: Mapping[str, Any]) -> str:
    for key in TOKENIZER_KEYS:
        value = meta.get(key)
        if isinstance(value, str) and value:
            return value
    raise ValueError(
        "this task sizes its prompts in tokens of the model's tokenizer but none was named: pass "
        "--model_args pretrained=<dir, .gguf or preset> or --metadata '{\"tokenizer\": \"<...>\"}'"
    )


def tokenizer_from(meta: Mapping[str, Any]):
    """The tokenizer named in task metadata (see the module docstring)."""
    return load_tokenizer(tokenizer_name(meta))


@lru_cache(maxsize=8)
def load_tokenizer(name: str):
    """A tokenizer from anything `lcx.load_model` accepts, else a locally cached hub name.

    GGUF files go through lcx's dequantization cache (built on first use by `lcx.load_model`); a
    Hub id `org/name[@revision]` through the Hugging Face cache as `lcx.load_model` resolves it
    (its config and tokenizer files, downloaded unless `HF_HUB_OFFLINE=1`); everything else
    loads with `local_files_only=True`.
    """
    from transformers import AutoTokenizer

    from lcx.models import gguf_cache_dir, is_gguf_cached, load_model, resolve_source

    try:
        kind, path = resolve_source(name, weights=False)  # a Hub id: config and tokenizer suffice
    except ValueError:
        kind, path = None, None
    if kind == "hf":
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    if kind == "gguf":
        if not is_gguf_cached(path):
            return load_model(path)[1]
        return AutoTokenizer.from_pretrained(gguf_cache_dir(path), local_files_only=True)
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load a tokenizer for {name!r}: not a local model directory, .gguf file or lcx "
            f"preset, and not in the local Hugging Face cache ({e})"
        ) from e


def n_tokens(tokenizer: Any, text: str) -> int:
    """Tokens of `text` without special tokens (what lm-eval's HF backends feed as context)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------- grids
def coverage_order(n: int) -> list[int]:
    """Indices `0..n-1` of an evenly spaced grid, ordered so every prefix spreads over the grid.

    Farthest-point order: first and last, then the middle, then the middles of the gaps (ties go
    to the lower index). `lm_eval --limit k` evaluates the first k docs, so docs built in this
    order cover shallow and deep insertion depths for any k >= 2.

    >>> coverage_order(11)
    [0, 10, 5, 2, 7, 1, 3, 4, 6, 8, 9]
    """
    if n <= 0:
        return []
    order = [0] + ([n - 1] if n > 1 else [])
    chosen = set(order)
    while len(order) < n:
        best = max((i for i in range(n) if i not in chosen),
                   key=lambda i: (min(abs(i - j) for j in chosen), -i))
        order.append(best)
        chosen.add(best)
    return order


def first_int(text: str) -> str | None:
    """The first run of decimal digits in `text` (a model's answer), or None."""
    import re

    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def round_robin(groups: Iterable[Sequence[Any]]) -> list[Any]:
    """Interleave sequences: first items of each, then second items, ... (shorter ones drop out)."""
    groups = [list(g) for g in groups]
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out
