"""Training data of the modular-addition encoder: texts rendered per the recipe (`sample_texts`),
packed as `[CLS]` + characters (`pack`), and each step's batch as a function of (seed, step)
only (`batch_at`), so a run is reproducible step by step. Also the auxiliary masked-character
loss's mask (`mask_characters`, `RunConfig.mlm_weight`).

Task: `(a + b) mod 97` read as characters. Pairs: `lcx.data.modadd.split_pairs(split_seed)`, the
same 4,704 / 4,705 ordered-pair halves the `modadd_shift` lm-eval task holds out.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from lcx.data.modadd import CANONICAL, CLS_ID, MODULUS, PAD_ID, encode_chars, render

from .config import RunConfig
from .recipes import TEMPLATE_POOLS, Recipe


def pack(texts: Sequence[str], *, cls: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids `[B, T]` (`[CLS]` first when `cls`) and lengths `[B]`."""
    seqs = [([CLS_ID] if cls else []) + encode_chars(t) for t in texts]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, torch.tensor([len(s) for s in seqs])


def sample_texts(recipe: Recipe, pairs: Sequence[tuple[int, int]], rng: random.Random, max_offset: int,
                 templates: bool | None = None) -> list[str]:
    """One training rendering per pair, template per the recipe (`templates` overrides whether
    the mixture is sampled, e.g. during `template_delay_frac`), at offsets drawn uniformly
    from [0, max_offset]: one offset for the whole call (`offset_sampling="batch"`) or one per
    example (`"example"`).

    One offset per call (i.e. per batch, or per half-batch with the consistency loss) keeps rows
    at nearly equal lengths, so a batch costs its mean length instead of its longest row's (a ~2x
    saving on CPU); over the run every offset is still seen equally often, but each step's
    gradient then comes from a single offset.
    """
    per_example = recipe.offset_sampling == "example"
    mixture = recipe.templates if templates is None else templates
    offset = rng.randint(0, max_offset)
    out = []
    for a, b in pairs:
        template = rng.choice(TEMPLATE_POOLS[recipe.template_pool]) if mixture else CANONICAL
        if per_example:
            offset = rng.randint(0, max_offset)
        out.append(render(a, b, template, offset, markers=recipe.markers))
    return out


def batch_at(cfg: RunConfig, train_pairs: Sequence[tuple[int, int]], step: int):
    """(ids [B, T], lengths [B], labels [B], n_pairs) for `step`, a function of (seed, step) only.

    With the consistency loss the batch is `B/2` pairs, each rendered twice: rows `i` and
    `i + B/2` are the same pair.
    """
    recipe = cfg.recipe_obj
    rng = random.Random(cfg.seed * 1_000_003 + step)
    twice = recipe.consistency_at(step, cfg.steps)
    n = cfg.batch_size // 2 if twice else cfg.batch_size
    pairs = [train_pairs[rng.randrange(len(train_pairs))] for _ in range(n)]
    m = recipe.max_offset_at(step, cfg.steps)
    mixture = recipe.templates_at(step, cfg.steps)
    texts = sample_texts(recipe, pairs, rng, m, mixture)
    if twice:
        texts += sample_texts(recipe, pairs, rng, m, mixture)
        pairs = pairs + pairs
    ids, lengths = pack(texts)
    labels = torch.tensor([(a + b) % MODULUS for a, b in pairs])
    return ids, lengths, labels, n


# The masked-character loss's mask: byte 0 (NUL), which no template or operand contains.
MASK_ID = encode_chars("\0")[0]
DIGIT_IDS = torch.tensor(encode_chars("0123456789"))


def mask_characters(ids: torch.Tensor, lengths: torch.Tensor, rate: float,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked ids, which [B, T] bool): each non-digit character of the text ([CLS] and padding
    excluded) is replaced by MASK_ID with probability `rate`, drawn from `generator`."""
    T = ids.shape[1]
    text = (torch.arange(T)[None, :] < lengths[:, None]) & (torch.arange(T)[None, :] > 0)
    candidates = text & ~torch.isin(ids, DIGIT_IDS)
    which = candidates & (torch.rand(ids.shape, generator=generator) < rate)
    return ids.masked_fill(which, MASK_ID), which
