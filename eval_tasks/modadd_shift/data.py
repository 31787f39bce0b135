"""Docs for the `modadd_shift` tasks: held-out pairs of `lcx.data.modadd`, one prompt per variant.

Variants (YAML `dataset_kwargs: {variant: ...}`):
- `id`: the canonical expression `a+b=` at offset 0 (one prompt per doc).
- `pos`: the canonical expression padded to start at each of `offsets` characters.
- `template`: the expression in each natural-language template of `OOD_TEMPLATES`.

Metadata keys: `seed` (the split's seed, default 0), `num_pairs` (first N held-out pairs in the
split's shuffled order; default all 4,705), `offsets` (default `SHIFT_OFFSETS`), `markers`
(wrap every expression in `<EXPR>...</EXPR>`, for models trained that way; default false).
"""

from __future__ import annotations

from typing import Any

from lcx.data.modadd import CANONICAL, OOD_TEMPLATES, SHIFT_OFFSETS, answer, render, split_pairs
from lcx.eval_tasks.common import get_int, int_list

VARIANTS = ("id", "pos", "template")


def variant_names(variant: str, meta: dict[str, Any]) -> list[str]:
    """Names of the prompts a doc carries, in order (also the per-variant metric names)."""
    if variant == "id":
        return ["offset_0"]
    if variant == "pos":
        return [f"offset_{o}" for o in offsets(meta)]
    if variant == "template":
        return [f"template_{i}" for i in range(len(OOD_TEMPLATES))]
    raise ValueError(f"modadd_shift: variant must be one of {VARIANTS}, got {variant!r}")


def offsets(meta: dict[str, Any]) -> list[int]:
    value = meta.get("offsets")
    return list(SHIFT_OFFSETS) if value is None else int_list(value, "offsets")


def _markers(meta: dict[str, Any]) -> bool:
    value = meta.get("markers", False)
    if isinstance(value, str):
        value = value.strip().lower() in ("1", "true", "yes")
    return bool(value)


def make_docs(variant: str, meta: dict[str, Any]) -> list[dict]:
    names = variant_names(variant, meta)
    split = split_pairs(get_int(meta, "seed", 0))
    n = get_int(meta, "num_pairs", len(split.test), minimum=1)
    markers = _markers(meta)
    docs = []
    for a, b in split.test[:n]:
        if variant == "id":
            prompts = [render(a, b, CANONICAL, 0, markers=markers)]
        elif variant == "pos":
            prompts = [render(a, b, CANONICAL, o, markers=markers) for o in offsets(meta)]
        else:
            prompts = [render(a, b, t, 0, markers=markers) for t in OOD_TEMPLATES]
        docs.append({"a": a, "b": b, "answer": answer(a, b), "variant": variant,
                     "variant_names": names, "prompts": prompts})
    return docs


def dataset(variant: str = "id", **meta: Any):
    """lm-eval `custom_dataset`: `{"test": Dataset}`."""
    import datasets

    return {"test": datasets.Dataset.from_list(make_docs(variant, meta), split=datasets.Split.TEST)}
