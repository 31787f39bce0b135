"""Modular addition `(a + b) mod 97` as text: the pair split, the templates and the renderer.

Shared by training (issue 6) and evaluation (`lcx.eval_tasks.modadd_shift`) so both sides agree
on which pairs are held out and which templates a model may have seen. Source: arXiv 2601.04283
("Mitigating Position-Shift Failures in Text-Based Modular Arithmetic via Position Curriculum
and Template Diversity"); see METHODS.md.

The split. All `97 * 97 = 9,409` ordered pairs `(a, b)`, `0 <= a, b < 97`, are shuffled with
`random.Random(seed)` and cut in half: `train` gets the first 4,704, `test` the other 4,705.
`(a, b)` and `(b, a)` are different pairs and may fall on different sides (the paper splits
ordered pairs too). The split depends only on `seed`, never on Python's hash seed or platform.

    >>> s = split_pairs(seed=0)
    >>> len(s.train), len(s.test), len(set(s.train) & set(s.test))
    (4704, 4705, 0)

Rendering. `render(a, b, template, offset)` puts `offset` padding characters (spaces) in front
of the templated expression, so the expression starts at absolute character `offset` of the
text; the answer is `str((a + b) % 97)` and is not part of the rendered text.

    >>> render(3, 95, CANONICAL, offset=4)
    '    3+95='
    >>> answer(3, 95)
    '1'

Templates. `CANONICAL` is the in-distribution format. `TRAIN_TEMPLATES` are formats a training
recipe may mix in ("template diversity"), `NL_TRAIN_TEMPLATES` natural-language ones a recipe may
add; `OOD_TEMPLATES` are natural-language formats reserved for evaluation and must never be used
in training (a test checks the sets are disjoint).
Every template has exactly one `{a}` and one `{b}`, `{a}` first; operands never equal 97, so the
literal "97" in a template cannot be mistaken for an operand.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MODULUS = 97
N_PAIRS = MODULUS * MODULUS  # 9,409 ordered pairs

# Boundary markers of the paper's recipe; `render(..., markers=True)` wraps the expression.
EXPR_OPEN, EXPR_CLOSE = "<EXPR>", "</EXPR>"

CANONICAL = "{a}+{b}="

TRAIN_TEMPLATES: tuple[str, ...] = (
    CANONICAL,
    "{a} + {b} =",
    "{a}+{b} mod 97=",
    "({a}+{b})%97=",
    "add {a} {b}:",
)

# Natural-language phrasings a training recipe may add to `TRAIN_TEMPLATES` (Recipe.template_pool
# "mixed"): they share words with `OOD_TEMPLATES` ("plus", "modulo 97", "Answer:") but never a
# whole template, so template OOD then tests new combinations of seen words, not unseen words.
NL_TRAIN_TEMPLATES: tuple[str, ...] = (
    "{a} plus {b} mod 97 is",
    "Add {a} and {b} modulo 97:",
    "The sum of {a} and {b} mod 97 equals",
    "What is {a}+{b} mod 97? Answer:",
    "{a} added to {b}, modulo 97, gives",
)

OOD_TEMPLATES: tuple[str, ...] = (
    "What is {a} plus {b} modulo 97? Answer:",
    "Compute ({a} + {b}) mod 97. Result:",
    "If you add {a} to {b} and reduce modulo 97, you get",
    "Q: the sum of {a} and {b}, mod 97. A:",
    "{a} and {b} added together, modulo 97, equals",
)

# Absolute character offsets at which the position-shift evaluation places the expression.
SHIFT_OFFSETS: tuple[int, ...] = (8, 32, 128)

PAD = " "

# Character ids, shared by the encoder classifier and the exported decoder: the ids of
# `lcx.models.tiny.byte_tokenizer` (0 <pad>, 1 <s>, 2 </s>, then 3 + byte). Every template is
# ASCII, so one character is one id. The encoder uses `<s>` as its [CLS].
PAD_ID, CLS_ID, EOS_ID = 0, 1, 2
N_SPECIAL = 3
VOCAB_SIZE = N_SPECIAL + 256


@dataclass(frozen=True)
class ModAddSplit:
    """Disjoint train/test halves of all ordered pairs, in shuffled order."""

    seed: int
    train: tuple[tuple[int, int], ...]
    test: tuple[tuple[int, int], ...]


def all_pairs() -> list[tuple[int, int]]:
    """Every ordered pair `(a, b)`, `0 <= a, b < MODULUS`, in lexicographic order."""
    return [(a, b) for a in range(MODULUS) for b in range(MODULUS)]


def split_pairs(seed: int = 0) -> ModAddSplit:
    """The seeded 50/50 split: `train` = first `N_PAIRS // 2` of a seeded shuffle, `test` = rest."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    pairs = all_pairs()
    random.Random(seed).shuffle(pairs)
    half = N_PAIRS // 2
    return ModAddSplit(seed=seed, train=tuple(pairs[:half]), test=tuple(pairs[half:]))


def answer(a: int, b: int) -> str:
    """The target text: `(a + b) mod 97` in decimal."""
    _check_operands(a, b)
    return str((a + b) % MODULUS)


def render(a: int, b: int, template: str = CANONICAL, offset: int = 0, *, markers: bool = False,
           pad: str = PAD) -> str:
    """The expression `template` filled with `a`, `b`, starting at character `offset`.

    `offset` padding characters (`pad`, one character) come first; with `markers=True` the
    filled template is wrapped as `<EXPR>...</EXPR>` (the markers start at `offset`).
    """
    _check_operands(a, b)
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if len(pad) != 1:
        raise ValueError(f"pad must be one character, got {pad!r}")
    if template.count("{a}") != 1 or template.count("{b}") != 1:
        raise ValueError(f"template must contain {{a}} and {{b}} exactly once: {template!r}")
    body = template.format(a=a, b=b)
    if markers:
        body = f"{EXPR_OPEN}{body}{EXPR_CLOSE}"
    return pad * offset + body


def encode_chars(text: str) -> list[int]:
    """Character ids of `text` (byte value + `N_SPECIAL`; the byte tokenizer's ids).

    >>> encode_chars("1+2=")
    [52, 46, 53, 64]
    """
    return [N_SPECIAL + b for b in text.encode("utf-8")]


def _check_operands(a: int, b: int) -> None:
    for name, v in (("a", a), ("b", b)):
        if not (isinstance(v, int) and 0 <= v < MODULUS):
            raise ValueError(f"{name} must be an int in [0, {MODULUS}), got {v!r}")
