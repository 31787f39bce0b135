"""`lcx train lm --retrieval-mix/--split-digits`: the retrieval/copy example formats (answer spans,
lengths, held-out keys, determinism), their rows in a batch and their loss weights, the
digit-splitting tokenizer, and flag validation."""

from __future__ import annotations

import random

import pytest
import torch

from lcx.train.lm import TrainConfig, passkey_rows, retrieval_rows, weighted_batch_at
from lcx.train.retrieval import FORMATS, PHRASINGS, RetrievalExamples, draw_key, eval_keys

SEQ_LENS = (128, 256, 301)


@pytest.fixture(scope="module")
def tok():
    """A small digit-splitting BPE trained on a few lines (seconds)."""
    from lcx.data.tokenizer import train_tokenizer

    text = ("The grass is green. The sky is blue. What is the pass key? The pass key is 12345. "
            "alpha: 42\nRecords:\nWhat is the value of bravo? bravo: 7\nAgain:\n")
    return train_tokenizer([text] * 40, vocab_size=400, split_digits=True)


@pytest.fixture(scope="module")
def examples(tok):
    stream = torch.tensor(tok(("To be, or not to be, that is the question. " * 200), add_special_tokens=False)["input_ids"])
    return RetrievalExamples(tok, stream)


def test_digits_are_single_tokens(tok):
    ids = tok(" 48213 and 7", add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[:6] == [" ", "4", "8", "2", "1", "3"] and pieces[-1] == "7"
    assert tok.decode(ids) == " 48213 and 7"


@pytest.mark.parametrize("fmt", sorted(set(FORMATS)))
@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_every_format_fits_and_marks_its_answer(tok, examples, fmt, seq_len):
    rng = random.Random(f"{fmt}:{seq_len}")
    for _ in range(20):
        ids, info = getattr(examples, fmt)(seq_len, rng)
        assert len(ids) <= seq_len and ids[-1] == tok.eos_token_id and tok.bos_token_id not in ids[:-1]
        a, n = info["answer_start"], info["answer_len"]
        assert a + n == len(ids) - 1 and n >= 1
        if fmt == "copy":  # the run, repeated: the answer is its last repetition
            assert ids[a:-1] == ids[:n] and info["repeats"] >= 2
            assert ids[:a] == (ids[:n] + ids[n : a // (info["repeats"] - 1)]) * (info["repeats"] - 1)
        else:  # the answer is " <key>", and the key appears in the context before it
            assert tok.decode(ids[a:-1]) == " " + info["key"] and info["key"].isdigit()
            assert info["key"] in tok.decode(ids[:a])
        if fmt == "passkey":
            assert 3 <= len(info["key"]) <= 8 and 0.0 <= info["depth"] <= 1.0
            ctx = tok.decode(ids[:a])
            assert any(q in ctx for _, q in PHRASINGS)


def test_examples_are_a_function_of_the_rng(examples):
    a = [examples.example(256, random.Random("s:1")) for _ in range(3)]
    b = [examples.example(256, random.Random("s:1")) for _ in range(3)]
    assert a == b


def test_training_keys_never_take_an_eval_key():
    from lcx.eval_tasks.passkey.data import make_docs
    from lcx.models.tiny import byte_tokenizer

    docs = make_docs(byte_tokenizer(), [400], [0.0, 0.5, 1.0], samples=3, seed=0)
    assert {d["key"] for d in docs} <= eval_keys()
    rng = random.Random(0)
    drawn = {draw_key(rng, 5) for _ in range(3000)}
    assert not drawn & eval_keys() and all(len(k) == 5 for k in drawn)


def test_batch_rows_and_answer_weights(tok, examples):
    stream = torch.tensor(tok(("The sun is yellow. " * 400), add_special_tokens=False)["input_ids"])
    cfg = TrainConfig(batch_size=8, seq_len=128, retrieval_mix=0.5, passkey_answer_weight=4.0,
                      model={"vocab_size": 4096, "max_position_embeddings": 128})
    assert (passkey_rows(cfg), retrieval_rows(cfg)) == (0, 4)
    x, y, w = weighted_batch_at(stream, cfg, 5, None, examples)
    assert x.shape == y.shape == w.shape == (8, 128)
    assert torch.equal(x[:, 1:], y[:, :-1])
    rng = random.Random(f"{cfg.seed}:5:retrieval")
    for i in range(4):
        ids, info = examples.example(128, rng)
        assert x[i, : len(ids)].tolist() == ids
        a, n = info["answer_start"], info["answer_len"]
        heavy = (w[i] == 4.0).nonzero().squeeze(1).tolist()
        assert heavy == ([] if info["format"] == "copy" else list(range(a - 1, a + n)))
    assert bool((w[4:] == 1).all())  # text rows
    x2, _, _ = weighted_batch_at(stream, cfg, 5, None, examples)
    assert torch.equal(x, x2)


@pytest.mark.parametrize("kwargs,match", [
    ({"retrieval_mix": 1.5}, r"retrieval_mix must be a fraction in \[0, 1\]"),
    ({"retrieval_mix": 0.6, "passkey_mix": 0.6}, r"passkey_mix \+ retrieval_mix must be <= 1"),
    ({"retrieval_mix": 0.01}, "gives no retrieval row"),
])
def test_retrieval_mix_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_weight_accepted_with_retrieval_only():
    TrainConfig(retrieval_mix=0.25, passkey_answer_weight=3.0)
    with pytest.raises(ValueError, match="needs passkey_mix or retrieval_mix"):
        TrainConfig(passkey_answer_weight=3.0)


@pytest.mark.parametrize("kwargs,match", [
    ({"stop_at_copy": 0.9}, "stop_at_copy needs retrieval_mix > 0 with the copy format"),
    ({"stop_at_copy": 0.9, "retrieval_mix": 1.0, "retrieval_formats": ("passkey",)}, "stop_at_copy needs"),
    ({"stop_at_copy": 1.5, "retrieval_mix": 1.0}, r"stop_at_copy must be a fraction in \(0, 1\]"),
])
def test_stop_at_copy_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_copy_accuracy_scores_the_last_repetition(tok, examples):
    """An oracle that copies scores ~1, a model that never looks back scores ~0 (chance)."""
    from lcx.train.lm import copy_accuracy, copy_val_examples

    val = copy_val_examples(examples, 64, count=8)
    assert val == copy_val_examples(examples, 64, count=8)  # fixed examples

    class Oracle(torch.nn.Module):
        """Predicts the token that followed the previous occurrence of the current token."""

        def forward(self, input_ids, use_cache=False):
            B, T = input_ids.shape
            logits = torch.zeros(B, T, len(tok))
            for b in range(B):
                ids = input_ids[b].tolist()
                for t in range(T):
                    prev = [j for j in range(t) if ids[j] == ids[t]]
                    logits[b, t, ids[prev[-1] + 1] if prev else 0] = 1.0
            return type("Out", (), {"logits": logits})()

    class Unigram(torch.nn.Module):
        def forward(self, input_ids, use_cache=False):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, len(tok))})()

    assert copy_accuracy(Oracle(), val) > 0.9  # < 1 only where a run repeats a token (vocab 400)
    assert copy_accuracy(Unigram(), val) < 0.1


def test_copy_vocab_draws_runs_from_the_most_frequent_tokens(tok):
    stream = torch.tensor(tok(("To be, or not to be, that is the question. " * 50), add_special_tokens=False)["input_ids"])
    top = set(torch.bincount(stream).argsort(descending=True, stable=True)[:5].tolist())
    ex = RetrievalExamples(tok, stream, ("copy",), copy_vocab=5)
    for seed in range(20):
        ids, info = ex.copy(64, random.Random(seed))
        a, n = info["answer_start"], info["answer_len"]
        assert set(ids[a : a + n]) <= top
    with pytest.raises(ValueError, match="copy_vocab must be an integer >= 2"):
        TrainConfig(retrieval_mix=1.0, copy_vocab=1)
