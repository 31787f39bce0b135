"""Training batches of `lcx train lm`: each step's batch is `batch_size` random windows of
`seq_len + 1` tokens from the train token stream; the window offsets come from a generator seeded
with `(seed, step)`, so a batch depends only on the seed and the step number. With the saved
optimizer state this makes `--resume` continue exactly as an uninterrupted run would (bitwise on
the same machine and thread count; tested). Validation windows (`val_windows`): `val_windows`
fixed windows of `seq_len + 1` tokens spread evenly over the held-out stream (all held-out works
contribute).

Passkey mix (`--passkey-mix F`, `TrainConfig.passkey_mix`): the first round(F * batch_size)
rows of every batch start with a passkey-retrieval example in exactly the prompt format of the
lm-eval `passkey` task (`lcx.eval_tasks.passkey.data`: task line, filler, needle, filler,
question), followed by " <key>" and `</s>`; the rest of the row is the row's own text window,
so no position is padding. An example is at most `seq_len` tokens: a random 5-digit key, a
random depth in [0, 1] and a filler size drawn uniformly from 0 to the most that fits (the
eval's own `PromptSizer`), all from `random.Random(f"{seed}:{step}:passkey")`, so a batch is
still a function of (seed, step) and `--resume` stays exact. Prompt and answer are tokenized
separately, as the eval tokenizes its context and then generates, and no BOS is added (the eval
adds none). The loss is the usual mean next-token NLL over ALL positions: the template and
filler are near-free after a few steps, the needle's first key is unpredictable noise the
model cannot reduce, and the answer (plus the needle's second, short-range copy of the key) is
the retrieval signal; keeping text and examples under one loss keeps the fine-tune a plain LM
fine-tune whose held-out perplexity stays comparable. `--passkey-answer-weight W`
(`TrainConfig.passkey_answer_weight`) weights the answer targets (key tokens and `</s>`) W times
every other target in that mean, to lift the few retrieval tokens above the filler.
Retrieval rows (`--retrieval-mix`, `lcx.train.retrieval`) follow the passkey rows, drawn from
`random.Random(f"{seed}:{step}:retrieval")`.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from .config import TrainConfig, passkey_rows, retrieval_rows


class PasskeyExamples:
    """Passkey-retrieval training examples in the lm-eval `passkey` task's exact prompt format.

    `example(seq_len, rng)` -> (ids, info): `ids` = tokens(prompt) + tokens(" " + key) + [eos],
    at most `seq_len` ids, no BOS; `info` has key, depth, filler size and where the answer
    starts (`answer_start`, `answer_len` in ids). Sizing reuses the eval's `PromptSizer`.
    """

    def __init__(self, tokenizer: Any):
        from lcx.eval_tasks.passkey.data import PromptSizer

        if tokenizer.eos_token_id is None:
            raise ValueError("passkey examples need a tokenizer with an eos token")
        self.tok = tokenizer
        self.sizer = PromptSizer(tokenizer)

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def example(self, seq_len: int, rng: random.Random, *, full: bool = False) -> tuple[list[int], dict[str, Any]]:
        """One example of at most `seq_len` tokens; `full=True` uses the most filler that fits
        (the size the eval uses at `seq_len`) instead of a uniform draw."""
        from lcx.eval_tasks.passkey.data import build_prompt

        key = str(rng.randint(10_000, 99_999))
        depth = rng.random()
        try:
            n_max = self.sizer.fit(key, depth, seq_len)
        except ValueError as e:
            raise ValueError(f"passkey_mix: seq_len {seq_len} is too short for a passkey example: {e}") from e
        n = n_max if full else rng.randint(0, n_max)
        answer = self._ids(" " + key)
        while True:  # prompt and answer tokenized apart; the sizer measured them joined
            b = round(depth * n)
            prompt = self._ids(build_prompt(key, b, n - b))
            ids = prompt + answer + [self.tok.eos_token_id]
            if len(ids) <= seq_len or n == 0:
                break
            n -= 1
        if len(ids) > seq_len:
            raise ValueError(f"passkey_mix: seq_len {seq_len} is too short for a passkey example "
                             f"({len(ids)} tokens without filler)")
        return ids, {"key": key, "depth": depth, "filler_sentences": n, "n_before": b,
                     "answer_start": len(prompt), "answer_len": len(answer)}


def batch_at(stream: torch.Tensor, cfg: TrainConfig, step: int,
             passkey: PasskeyExamples | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) `[B, T]` for `step`: B random windows of T+1 tokens, a function of (seed, step).

    With `cfg.passkey_mix > 0` the first `passkey_rows(cfg)` rows become [passkey example,
    then the first T+1-m tokens of that row's window] (m = the example's length); `passkey`
    supplies the examples.
    """
    x, y, _ = weighted_batch_at(stream, cfg, step, passkey)
    return x, y


def weighted_batch_at(stream: torch.Tensor, cfg: TrainConfig, step: int, passkey: PasskeyExamples | None = None,
                      retrieval: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`batch_at` plus the per-target loss weights `[B, T]`: `cfg.passkey_answer_weight` on the
    targets that are an example's answer tokens and its `</s>`, 1 elsewhere; None when that
    weight is 1 (the plain mean). Rows: `passkey_rows` eval-format passkey examples (`passkey`),
    then `retrieval_rows` `lcx.train.retrieval` examples (`retrieval`), then text windows; an
    example row continues with the first tokens of its own window."""
    n = stream.numel() - cfg.seq_len - 1
    if n < 1:
        raise ValueError(f"train stream has {stream.numel()} tokens; need more than seq_len + 1 = {cfg.seq_len + 1}")
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    offsets = torch.randint(0, n + 1, (cfg.batch_size,), generator=g)
    idx = offsets[:, None] + torch.arange(cfg.seq_len + 1)[None, :]  # [B, T+1]
    win = stream[idx].long()
    k, r = passkey_rows(cfg), retrieval_rows(cfg)
    spans = []
    if k:
        if passkey is None:
            raise ValueError("passkey_mix > 0 needs passkey=PasskeyExamples(tokenizer)")
        rng = random.Random(f"{cfg.seed}:{step}:passkey")
        for i in range(k):
            ids, info = passkey.example(cfg.seq_len, rng)
            m = len(ids)
            win[i] = torch.cat([torch.tensor(ids, dtype=torch.long), win[i, : cfg.seq_len + 1 - m]])
            spans.append((i, info["answer_start"], info["answer_len"]))
    if r:
        if retrieval is None:
            raise ValueError("retrieval_mix > 0 needs retrieval=RetrievalExamples(tokenizer, train ids)")
        rng = random.Random(f"{cfg.seed}:{step}:retrieval")
        for i in range(k, k + r):
            ids, info = retrieval.example(cfg.seq_len, rng)
            m = len(ids)
            win[i] = torch.cat([torch.tensor(ids, dtype=torch.long), win[i, : cfg.seq_len + 1 - m]])
            if info["format"] != "copy":  # a copy's whole second half is signal already
                spans.append((i, info["answer_start"], info["answer_len"]))
    weights = None
    if spans and cfg.passkey_answer_weight != 1.0:
        weights = torch.ones(cfg.batch_size, cfg.seq_len)
        for i, a, n_ans in spans:  # target t predicts token t+1: answer ids a..a+n-1, then </s>
            weights[i, a - 1 : a + n_ans] = cfg.passkey_answer_weight
    return win[:, :-1], win[:, 1:], weights


def val_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """`[N, seq_len+1]` windows at evenly spaced offsets over the whole held-out stream."""
    n = stream.numel() - seq_len - 1
    if n < 0:
        raise ValueError(f"validation stream has {stream.numel()} tokens; need at least seq_len + 1")
    count = min(count, n // (seq_len + 1) + 1)  # keep them non-overlapping
    offsets = torch.linspace(0, n, count).round().long()
    return stream[offsets[:, None] + torch.arange(seq_len + 1)[None, :]].long()
