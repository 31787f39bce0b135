"""Retrieval and copy examples for `lcx train lm --retrieval-mix F`: the skill behind passkey
retrieval, taught in several formats so a small model learns to look a value up, not one template.

Every example is `(ids, info)`: at most `seq_len` token ids (no BOS), ending in `</s>`, with the
answer span (`answer_start`, `answer_len`: the ids the loss weights by `passkey_answer_weight`).
Formats (`FORMATS`, drawn uniformly per example):

- `passkey`: a needle with a number among filler, then a question whose answer is the number.
  Needle/question phrasings come in matched pairs (`PHRASINGS`; the lm-eval `passkey` task's own
  pair is one of them), the filler is either the eval's five sentences in a random order or a
  window of training-split text (Shakespeare, KJV), the key has 3 to 8 digits, the depth is
  uniform and the task line (the eval's) is present half of the time.
- `lookup`: a table of `name: number` lines (2 to 12 rows, random names from `NAMES`), then
  "What is the value of NAME? NAME:" -> " number".
- `copy`: a random run of 8 to 48 tokens (ordinary vocabulary ids), then the run again and again
  (separated by a newline) up to a random length: dense induction signal, every token after the
  first run is predictable only by looking back (the classic induction-head curriculum).

Keys never take a value an lm-eval `passkey` prompt uses (`eval_keys`: seeds 0-9, 10 samples,
up to 21 depths), so the task's scores are on held-out keys. Everything is drawn from the
`random.Random` handed in, so a batch stays a function of (seed, step) and `--resume` is exact.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

from lcx.eval_tasks.passkey.data import FILLER, NEEDLE, QUESTION, TASK_DESCRIPTION

# (needle with {key}, question whose answer is " {key}")
PHRASINGS: tuple[tuple[str, str], ...] = (
    (NEEDLE, QUESTION),  # the lm-eval passkey task's
    ("The secret number is {key}. Keep it in mind.", "What is the secret number? The secret number is"),
    ("Remember this code: {key}.", "What was the code to remember? The code is"),
    ("The magic number for today is {key}.", "What is the magic number for today? It is"),
    ("Important: the access key is {key}. The access key is {key}.", "Tell me the access key. The access key is"),
    ("My favourite number is {key}, write it down.", "What is my favourite number? My favourite number is"),
)
NAMES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform",
         "victor", "whiskey", "xray", "yankee", "zulu", "apple", "river", "stone", "cloud", "tiger", "maple")


@lru_cache(maxsize=1)
def eval_keys() -> frozenset[str]:
    """Every key an lm-eval `passkey` prompt draws for seeds 0-9, 10 samples, up to 21 depths
    (`lcx.eval_tasks.passkey.data.make_docs`' rule): never used for training."""
    return frozenset(str(random.Random(f"{seed}:{s}:{di}").randint(10_000, 99_999))
                     for seed in range(10) for s in range(10) for di in range(21))


def draw_key(rng: random.Random, digits: int) -> str:
    while True:
        key = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if key not in eval_keys():
            return key


class RetrievalExamples:
    """`example(seq_len, rng) -> (ids, info)` in one of `FORMATS` (see the module docstring).

    `filler_ids`: a token stream (the training split) whose windows serve as natural filler;
    `formats`: the formats drawn uniformly (repeats weight them; default `FORMATS`);
    `copy_vocab`: `copy` runs draw from the `copy_vocab` most frequent tokens of `filler_ids`
    instead of the whole vocabulary (each token then recurs often enough in a batch for an
    induction head to form quickly; None: every ordinary token).
    """

    def __init__(self, tokenizer: Any, filler_ids: Any, formats: tuple[str, ...] | None = None,
                 copy_vocab: int | None = None):
        if tokenizer.eos_token_id is None:
            raise ValueError("retrieval examples need a tokenizer with an eos token")
        self.tok = tokenizer
        self.filler_ids = filler_ids
        self.specials = set(tokenizer.all_special_ids)
        self.formats = tuple(formats) if formats else FORMATS
        bad = sorted(set(self.formats) - set(FORMATS))
        if bad:
            raise ValueError(f"unknown retrieval format(s) {bad}; known: {sorted(set(FORMATS))}")
        self.copy_pool: list[int] | None = None
        if copy_vocab is not None:
            import torch

            counts = torch.bincount(torch.as_tensor(filler_ids).long().flatten(), minlength=len(tokenizer))
            for t in self.specials:
                counts[t] = -1
            order = torch.argsort(counts, descending=True, stable=True)[:copy_vocab]
            self.copy_pool = [int(t) for t in order if counts[t] > 0]
            if len(self.copy_pool) < 2:
                raise ValueError(f"copy_vocab={copy_vocab}: fewer than 2 tokens occur in the filler stream")

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _finish(self, prefix: list[int], answer: list[int], fmt: str, **info: Any) -> tuple[list[int], dict]:
        ids = prefix + answer + [self.tok.eos_token_id]
        return ids, {"format": fmt, "answer_start": len(prefix), "answer_len": len(answer), **info}

    # ---------------------------------------------------------------------------- formats
    def passkey(self, seq_len: int, rng: random.Random) -> tuple[list[int], dict]:
        needle_t, question_t = rng.choice(PHRASINGS)
        key = draw_key(rng, rng.randint(3, 8))
        head = self._ids(TASK_DESCRIPTION + "\n") if rng.random() < 0.5 else []
        needle = self._ids(("\n" if rng.random() < 0.5 else " ") + needle_t.format(key=key) + " ")
        question = self._ids("\n" + question_t)
        answer = self._ids(" " + key)
        budget = seq_len - len(head) - len(needle) - len(question) - len(answer) - 1
        if budget < 0 and head:  # the task line is optional: drop it where it does not fit
            budget, head = budget + len(head), []
        if budget < 0:
            raise ValueError(f"seq_len {seq_len} is too short for a retrieval example")
        n = rng.randint(0, budget)
        if rng.random() < 0.5:  # the eval's sentences, shuffled
            sentences = []
            while sum(len(x) for x in sentences) < n:
                sentences.append(self._ids(" " + rng.choice(FILLER)))
            filler = [t for x in sentences for t in x][:n]
        else:  # natural text from the training split
            start = rng.randrange(0, max(1, len(self.filler_ids) - n))
            filler = [int(t) for t in self.filler_ids[start : start + n] if int(t) not in self.specials]
        cut = round(rng.random() * len(filler))
        prefix = head + filler[:cut] + needle + filler[cut:] + question
        return self._finish(prefix, answer, "passkey", key=key, depth=cut / max(1, len(filler)))

    def lookup(self, seq_len: int, rng: random.Random) -> tuple[list[int], dict]:
        rows = rng.randint(2, 12)
        names = rng.sample(NAMES, rows)
        values = [draw_key(rng, rng.randint(2, 6)) for _ in names]
        lines = [self._ids(f"{n}: {v}\n") for n, v in zip(names, values)]
        q = rng.randrange(rows)
        question = self._ids(f"What is the value of {names[q]}? {names[q]}:")
        key = values[q]
        answer = self._ids(" " + key)
        head = self._ids("Records:\n")
        while lines and len(head) + sum(map(len, lines)) + len(question) + len(answer) + 1 > seq_len:
            drop = rng.randrange(len(lines))  # keep the queried row
            if drop == q:
                continue
            lines.pop(drop)
            q -= drop < q
        prefix = head + [t for ln in lines for t in ln] + question
        return self._finish(prefix, answer, "lookup", key=key)

    def copy(self, seq_len: int, rng: random.Random) -> tuple[list[int], dict]:
        n = rng.randint(8, min(48, max(8, (seq_len - 8) // 2)))
        vocab = len(self.tok)
        run = []
        while len(run) < n:
            t = rng.choice(self.copy_pool) if self.copy_pool is not None else rng.randrange(vocab)
            if t not in self.specials:
                run.append(t)
        sep = self._ids("\n")
        reps = rng.randint(2, max(2, (seq_len - 1) // (n + len(sep))))  # the run 2+ times
        body = (run + sep) * (reps - 1)
        return self._finish(body, run, "copy", repeats=reps)

    def example(self, seq_len: int, rng: random.Random) -> tuple[list[int], dict]:
        fmt = rng.choice(self.formats)
        ids, info = getattr(self, fmt)(seq_len, rng)
        if len(ids) > seq_len:
            raise ValueError(f"{fmt} example of {len(ids)} tokens exceeds seq_len {seq_len}")
        return ids, info


# drawn uniformly: half copies (the dense signal that forms induction heads), a quarter each
# passkey variants and lookups (the retrieval formats built on them)
FORMATS: tuple[str, ...] = ("copy", "copy", "passkey", "lookup")


__all__ = ["FORMATS", "NAMES", "PHRASINGS", "RetrievalExamples", "draw_key", "eval_keys"]
