"""`passkey_primed` (issue #76, item 4): the published passkey prompt with RULER's kind of question
and answer prefix instead of the bare "The pass key is": the same keys, depths, filler and needle,
so the two tasks pair prompt by prompt; each prompt with its answer budget still fits its length.
(`passkey_primed` is in `lcx.eval_tasks.TASK_NAMES`: tests/eval_tasks/test_eval_tasks.py checks every YAML.)"""

from __future__ import annotations

import pytest

from lcx.eval_tasks.passkey.data import (ANSWER_BUDGET, QUESTION, QUESTION_PRIMED, SPARE_TOKENS,
                                         docs_from_metadata)

LENGTHS = [383, 512, 611]  # odd sizes included (the byte tokenizer: the scaffold alone takes ~300)


@pytest.fixture(scope="module")
def both(tiny_model_dir):
    meta = {"tokenizer": str(tiny_model_dir), "max_seq_lengths": LENGTHS, "depths": 3, "samples_per_depth": 2}
    return docs_from_metadata(meta), docs_from_metadata({**meta, "primed": True})


def test_primed_prompts_pair_with_the_published_ones(both):
    plain, primed = both
    assert [(d["key"], d["depth"], d["sample"]) for d in plain] == [(d["key"], d["depth"], d["sample"]) for d in primed]
    for a, b in zip(plain, primed):
        for pa, pb in zip(a["prompts"], b["prompts"]):
            assert pa.endswith("\n" + QUESTION) and pb.endswith("\n" + QUESTION_PRIMED)
            head_a, head_b = pa.rsplit("\n", 1)[0], pb.rsplit("\n", 1)[0]
            # the same scaffold and needle; the longer question costs as much filler (byte tokenizer:
            # characters), within a filler sentence
            assert head_a.split("\n")[0] == head_b.split("\n")[0]
            assert f"The pass key is {a['key']}." in head_b
            assert abs((len(head_a) - len(head_b)) - (len(QUESTION_PRIMED) - len(QUESTION))) <= 25


def test_primed_prompts_fit_their_lengths(both, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for d in both[1]:
        for L, prompt in zip(d["lengths"], d["prompts"]):
            n = len(tok(prompt).input_ids)
            assert n + SPARE_TOKENS + ANSWER_BUDGET <= L


def test_primed_must_be_a_bool(tiny_model_dir):
    with pytest.raises(ValueError, match="'primed' must be true or false"):
        docs_from_metadata({"tokenizer": str(tiny_model_dir), "max_seq_lengths": [384], "primed": "yes"})
