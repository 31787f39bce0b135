"""Passkey retrieval prompts (Landmark Attention's `run_test.py`, reused by LongLoRA), sized in
tokens of the model's own tokenizer. Pure Python + a tokenizer; no lm-eval needed.

Prompt (five lines joined by "\\n", as in Landmark Attention)::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.
    The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. The grass ...   <- n_before filler sentences
    The pass key is 48213. Remember it. 48213 is the pass key.
    The grass is green. The sky is blue. ...                                                               <- n_after filler sentences
    What is the pass key? The pass key is

Sizing. For a context length L the filler has the most whole sentences n = n_before + n_after
such that `tokens(prompt) + 1 + ANSWER_BUDGET <= L`: one spare position for a BOS token a backend
may add, and the whole generation budget of the `passkey` task (`max_gen_toks`, 12) inside L, as
RULER budgets its answers. So prompt plus answer never exceed L: a server started with
`--max-model-len L` accepts every request of length L (`lm_eval --model local-completions`). The
prompt is within one filler sentence of that budget; n_before = round(depth * n). A length too
short for the scaffold alone raises.

Docs. One doc per (sample, depth): the same key and depth at every requested length
(`doc["prompts"][i]` is the prompt for `doc["lengths"][i]`). Depths are visited in
`coverage_order`, sample-major, so `--limit k` covers the shallowest and deepest insertion
first. Keys are 5-digit numbers drawn from `random.Random(f"{seed}:{sample}:{depth_index}")`.
"""

from __future__ import annotations

import random
from typing import Any

from lcx.eval_tasks.common import coverage_order, get_int, lengths_from, n_tokens, tokenizer_from

TASK_DESCRIPTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                    "memorize them. I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
# `passkey_primed` (metadata `primed: true`): RULER's kind of question and answer prefix (NIAH: "What
# are all the special magic numbers for X mentioned in the provided text? The special magic number
# for X mentioned in the provided text is"): the answer's type named, the text referred back to.
# Everything else (task description, filler, needle, sizing, keys) is the published prompt's.
QUESTION_PRIMED = ("What is the pass key number mentioned in the provided text? "
                   "The pass key number mentioned in the provided text is")

DEFAULT_LENGTHS = (256, 512, 1024)
DEFAULT_DEPTHS = 11  # 0%, 10%, ..., 100%
DEFAULT_SAMPLES = 2  # docs per depth
SPARE_TOKENS = 1  # room for a BOS token
ANSWER_BUDGET = 12  # the `passkey` task's max_gen_toks (passkey.yaml): generated tokens fit inside L


def filler(n: int) -> str:
    """n filler sentences, cycling through `FILLER` from its start."""
    return " ".join(FILLER[i % len(FILLER)] for i in range(n))


def build_prompt(key: str, n_before: int, n_after: int, *, primed: bool = False) -> str:
    question = QUESTION_PRIMED if primed else QUESTION
    return "\n".join([TASK_DESCRIPTION, filler(n_before), NEEDLE.format(key=key), filler(n_after), question])


def depth_grid(meta: dict[str, Any]) -> list[float]:
    """Insertion depths in [0, 1]: `depths` is a grid size (int) or an explicit list."""
    value = meta.get("depths", DEFAULT_DEPTHS)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
        n = int(value)
        if n < 1:
            raise ValueError(f"metadata 'depths' must be >= 1, got {value}")
        return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0 for v in value):
        return sorted({float(v) for v in value})
    raise ValueError(f"metadata 'depths' must be a grid size or a list of fractions in [0, 1], got {value!r}")


class PromptSizer:
    """Finds the filler size of a length, caching the estimate between docs."""

    def __init__(self, tokenizer: Any, *, primed: bool = False):
        self.tok = tokenizer
        self.primed = primed
        self._guess: dict[int, int] = {}

    def tokens(self, key: str, depth: float, n: int) -> int:
        """Positions a length must hold: the prompt, a spare BOS slot and the answer budget."""
        b = round(depth * n)
        return n_tokens(self.tok, build_prompt(key, b, n - b, primed=self.primed)) + SPARE_TOKENS + ANSWER_BUDGET

    def fit(self, key: str, depth: float, length: int) -> int:
        """The largest filler size n whose prompt fits in `length` tokens."""
        fits = lambda n: self.tokens(key, depth, n) <= length  # noqa: E731
        if not fits(0):
            raise ValueError(
                f"passkey: max_seq_length {length} is too short for the prompt without filler "
                f"({self.tokens(key, depth, 0)} tokens with this tokenizer)")
        n = self._guess.get(length)
        if n is None:  # exponential + binary search, once per length
            hi = 1
            while fits(hi):
                hi *= 2
            lo = hi // 2 if hi > 1 else 0
            while lo + 1 < hi:  # fits(lo), not fits(hi)
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            n = lo
        else:  # other keys/depths tokenize within a token or two of the cached size
            while n > 0 and not fits(n):
                n -= 1
            while fits(n + 1):
                n += 1
        self._guess[length] = n
        return n


def make_docs(tokenizer: Any, lengths: list[int], depths: list[float], samples: int, seed: int,
              primed: bool = False) -> list[dict]:
    sizer = PromptSizer(tokenizer, primed=primed)
    docs = []
    for s in range(samples):
        for di in coverage_order(len(depths)):
            depth = depths[di]
            key = str(random.Random(f"{seed}:{s}:{di}").randint(10_000, 99_999))
            prompts, counts, fillers = [], [], []
            for L in lengths:
                n = sizer.fit(key, depth, L)
                b = round(depth * n)
                prompt = build_prompt(key, b, n - b, primed=primed)
                prompts.append(prompt)
                counts.append(n_tokens(tokenizer, prompt))
                fillers.append(n)
            docs.append({"sample": s, "depth": depth, "key": key, "answer": key, "lengths": list(lengths),
                         "prompts": prompts, "prompt_tokens": counts, "filler_sentences": fillers})
    return docs


def docs_from_metadata(meta: dict[str, Any]) -> list[dict]:
    return make_docs(
        tokenizer_from(meta),
        lengths_from(meta, DEFAULT_LENGTHS),
        depth_grid(meta),
        get_int(meta, "samples_per_depth", DEFAULT_SAMPLES, minimum=1),
        get_int(meta, "seed", 0),
        primed=_primed(meta),
    )


def _primed(meta: dict[str, Any]) -> bool:
    value = meta.get("primed", False)
    if not isinstance(value, bool):
        raise ValueError(f"metadata 'primed' must be true or false, got {value!r}")
    return value


def dataset(**meta: Any):
    """lm-eval `custom_dataset`: `{"test": Dataset}` built from the task metadata."""
    import datasets

    return {"test": datasets.Dataset.from_list(docs_from_metadata(meta), split=datasets.Split.TEST)}
