"""Evaluation of a modular-addition encoder run.

`evaluate`, on the first `eval_pairs` held-out pairs, accuracy of argmax:
    id         canonical template at offset 0 (every recipe trains there)
    pos        mean over `SHIFT_OFFSETS` (8, 32, 128: the lm-eval task's offsets); `shift` keeps
               every offset of `eval_offsets` (the curriculum reaches `max_offset` = 32, so 48..128
               lies beyond every recipe's training offsets)
    template   mean over `OOD_TEMPLATES` at offset 0 (never trained on); `templates` per template
    train_id   like id, on training pairs (fit)
    place_value_errors   how the held-out offset-0 answers are wrong (`place_value_errors`)
Markers are applied at evaluation exactly when the recipe trained with them. `curve_metrics` is
the cheaper learning-curve point (`RunConfig.eval_every`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lcx.data.modadd import CANONICAL, MODULUS, OOD_TEMPLATES, SHIFT_OFFSETS, render, split_pairs

from .config import RunConfig
from .data import pack
from .model import ModAddEncoder


@torch.no_grad()
def predict(model: ModAddEncoder, texts: Sequence[str], batch_size: int = 500) -> list[int]:
    """The model's class (argmax) for each text."""
    was = model.training
    model.eval()
    out: list[int] = []
    for i in range(0, len(texts), batch_size):
        ids, lengths = pack(texts[i : i + batch_size])
        out += model(ids, lengths).argmax(-1).tolist()
    model.train(was)
    return out


def accuracy(model: ModAddEncoder, texts: Sequence[str], labels: Sequence[int], batch_size: int = 500) -> float:
    pred = predict(model, texts, batch_size)
    return sum(int(p == y) for p, y in zip(pred, labels)) / len(texts)


# Errors a reader of the right digits in the wrong places makes: giving a tens digit the weight of
# a units digit (or back) moves the sum by 9 x (tens - units); any set of such swaps over the four
# digits moves it by 9k with 0 < |k| <= 18.
PLACE_VALUE_SHIFTS = frozenset((9 * k) % MODULUS for k in range(-18, 19) if k)


def place_value_errors(pairs: Sequence[tuple[int, int]], pred: Sequence[int]) -> dict[str, float]:
    """How a model's wrong answers on `pairs` are wrong: `share` of them off by a nonzero multiple
    of 9 (mod 97, |k| <= 18: the right digits read at the wrong place value), `reversed` the share
    equal to the answer with one or both operands' digits reversed, and `chance`, the share a
    uniformly wrong answer would have (|PLACE_VALUE_SHIFTS| / 96). Shares are None when all are right."""
    rev = lambda x: int(str(x)[::-1])  # noqa: E731
    wrong = [((a, b), p) for (a, b), p in zip(pairs, pred) if p != (a + b) % MODULUS]
    n = len(wrong)
    nine = sum(1 for (a, b), p in wrong if (p - a - b) % MODULUS in PLACE_VALUE_SHIFTS)
    swapped = sum(1 for (a, b), p in wrong
                  if p in {(rev(a) + b) % MODULUS, (a + rev(b)) % MODULUS, (rev(a) + rev(b)) % MODULUS})
    return {"errors": n, "share": nine / n if n else None, "reversed": swapped / n if n else None,
            "chance": len(PLACE_VALUE_SHIFTS) / (MODULUS - 1)}


def rendered_accuracy(model: ModAddEncoder, pairs: Sequence[tuple[int, int]], template: str, offset: int, *,
                      markers: bool) -> float:
    """Accuracy on `pairs` rendered with `template` at `offset`."""
    return accuracy(model, [render(a, b, template, offset, markers=markers) for a, b in pairs],
                    [(a + b) % MODULUS for a, b in pairs])


def evaluate(model: ModAddEncoder, cfg: RunConfig) -> dict[str, Any]:
    """Accuracy per split (see the module docstring)."""
    split = split_pairs(cfg.split_seed)
    test, train = split.test[: cfg.eval_pairs], split.train[: cfg.eval_pairs]

    def acc(pairs, template, offset):
        return rendered_accuracy(model, pairs, template, offset, markers=cfg.recipe_obj.markers)

    # held-out predictions at offset 0, canonical template: the id split, and what its errors look like
    canonical = predict(model, [render(a, b, CANONICAL, 0, markers=cfg.recipe_obj.markers) for a, b in test])
    id_acc = sum(int(p == (a + b) % MODULUS) for p, (a, b) in zip(canonical, test)) / len(test)
    shift = {str(o): id_acc if o == 0 else acc(test, CANONICAL, o) for o in cfg.eval_offsets}
    templates = [acc(test, t, 0) for t in OOD_TEMPLATES]
    return {
        "id": id_acc,
        "pos": sum(shift[str(o)] for o in SHIFT_OFFSETS) / len(SHIFT_OFFSETS),
        "template": sum(templates) / len(templates),
        "train_id": acc(train, CANONICAL, 0),
        "shift": shift,
        "templates": templates,
        "place_value_errors": place_value_errors(test, canonical),
    }


CURVE_PAIRS = 200  # held-out (and training) pairs scored at each learning-curve point
CURVE_SPLITS = ("id", "pos8", "pos32", "template", "train_id")


def curve_metrics(model: ModAddEncoder, cfg: RunConfig, n_pairs: int = CURVE_PAIRS) -> dict[str, float]:
    """The learning-curve point: accuracy on the first `n_pairs` held-out pairs at offset 0
    (`id`), at offsets 8 and 32 (`pos8`, `pos32`: inside the curriculum's range), on the OOD
    templates (`template`, mean), and on training pairs at offset 0 (`train_id`)."""
    split = split_pairs(cfg.split_seed)
    test, train = split.test[:n_pairs], split.train[:n_pairs]

    def acc(pairs, template, offset):
        return rendered_accuracy(model, pairs, template, offset, markers=cfg.recipe_obj.markers)

    return {"id": acc(test, CANONICAL, 0), "pos8": acc(test, CANONICAL, 8), "pos32": acc(test, CANONICAL, 32),
            "template": sum(acc(test, t, 0) for t in OOD_TEMPLATES) / len(OOD_TEMPLATES),
            "train_id": acc(train, CANONICAL, 0)}
