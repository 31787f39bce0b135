"""The loss and the held-out measurements of `lcx train lm`.

`lm_loss`: mean next-token NLL (optionally weighted); `evaluate`: the validation loss, mean token
NLL over the run's fixed held-out windows (`batches.val_windows`), every `eval_every` steps.

With a passkey mix (or any retrieval mix whose seq_len fits an eval-format example), each
evaluation also logs `passkey`: the fraction of `PASSKEY_VAL_COUNT` fixed held-out prompts
(seq_len long, keys from their own seed) whose answer tokens are all the model's greedy
predictions (what the lm-eval `passkey_ll` task scores). With the `copy` retrieval format, each
evaluation also logs `copy`: greedy per-token accuracy on the last repetition of
`COPY_VAL_COUNT` fixed copy examples (a random run of tokens repeated), the signature of an
induction head. `--stop-at-passkey` / `--stop-at-copy` end a phase once it holds at two
evaluations in a row (`loop.train`).
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from .batches import PasskeyExamples


def lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token NLL (nats), or its `weights`-weighted mean. inputs, targets, weights: `[B, T]`."""
    logits = model(input_ids=inputs, use_cache=False).logits  # [B, T, V]
    flat = logits.float().reshape(-1, logits.shape[-1])
    if weights is None:
        return F.cross_entropy(flat, targets.reshape(-1))
    nll = F.cross_entropy(flat, targets.reshape(-1), reduction="none")
    w = weights.reshape(-1).to(nll.dtype)
    return (nll * w).sum() / w.sum()


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 32, autocast: Any = None) -> float:
    """Mean NLL over `windows` `[N, T+1]`; `autocast`: a context manager factory (training's precision)."""
    import contextlib

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    dev = _model_device(model)
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i : i + batch_size].to(dev)
        with (autocast or contextlib.nullcontext)():
            loss = lm_loss(model, w[:, :-1], w[:, 1:])
        total += loss.item() * w[:, 1:].numel()
        count += w[:, 1:].numel()
    model.train(was_training)
    return total / count


PASSKEY_VAL_COUNT = 32
PASSKEY_VAL_SEED = "passkey-val"  # a fixed seed, not the run's: the held-out prompts never change


def passkey_val_examples(passkey: PasskeyExamples, seq_len: int, count: int = PASSKEY_VAL_COUNT):
    """`count` fixed full-length examples (ids, info) for `passkey_accuracy`."""
    rng = random.Random(PASSKEY_VAL_SEED)
    return [passkey.example(seq_len, rng, full=True) for _ in range(count)]


def _model_device(model: torch.nn.Module) -> torch.device:
    """Where `model`'s parameters live (the CPU for a module without any)."""
    return next(iter(model.parameters()), torch.empty(0)).device


@torch.no_grad()
def _greedy_rows(model: torch.nn.Module, examples: Sequence[tuple[list[int], Mapping[str, Any]]], pad_id: int,
                 batch_size: int):
    """Yield (ids `[T]`, greedy next-token predictions `[T]`, info) per example, run in batches of
    right-padded rows (padding a causal model cannot see), in eval mode."""
    was_training = model.training
    model.eval()
    dev = _model_device(model)
    try:
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            T = max(len(ids) for ids, _ in chunk)
            x = torch.full((len(chunk), T), pad_id, dtype=torch.long)
            for r, (ids, _) in enumerate(chunk):
                x[r, : len(ids)] = torch.tensor(ids)
            pred = model(input_ids=x.to(dev), use_cache=False).logits.argmax(-1).cpu()  # [b, T]
            for r, (_, info) in enumerate(chunk):
                yield x[r], pred[r], info
    finally:
        model.train(was_training)


def passkey_accuracy(model: torch.nn.Module, examples: Sequence[tuple[list[int], Mapping[str, Any]]],
                     pad_id: int = 0, batch_size: int = 16) -> float:
    """Fraction of examples whose answer tokens are all the model's greedy next-token predictions
    (teacher-forced over the answer, like lm-eval's `is_greedy`)."""
    correct = 0
    for x, pred, info in _greedy_rows(model, examples, pad_id, batch_size):
        a, n = info["answer_start"], info["answer_len"]
        correct += bool(torch.equal(pred[a - 1 : a - 1 + n], x[a : a + n]))
    return correct / max(1, len(examples))


COPY_VAL_COUNT = 64
COPY_VAL_SEED = "copy-val"


def copy_val_examples(retrieval: Any, seq_len: int, count: int = COPY_VAL_COUNT):
    """`count` fixed `copy` examples (a random run of tokens repeated, `lcx.train.retrieval`)."""
    rng = random.Random(COPY_VAL_SEED)
    return [retrieval.copy(seq_len, rng) for _ in range(count)]


def copy_accuracy(model: torch.nn.Module, examples: Sequence[tuple[list[int], Mapping[str, Any]]],
                  pad_id: int = 0, batch_size: int = 32) -> float:
    """Per-token greedy accuracy on the last repetition of each copy example's run: the tokens
    predictable only by finding the previous occurrence of the current token and copying what
    followed it (an induction head). Chance is ~1/vocab; a model that formed the circuit is near 1."""
    hit = total = 0
    for x, pred, info in _greedy_rows(model, examples, pad_id, batch_size):
        a, n = info["answer_start"], info["answer_len"]
        # the answer's first token follows a separator (ambiguous at the run's first copy); score the rest
        hit += int((pred[a : a + n - 1] == x[a + 1 : a + n]).sum())
        total += n - 1
    return hit / max(1, total)
