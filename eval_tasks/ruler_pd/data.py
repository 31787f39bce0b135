"""RULER's essay-haystack needle-in-a-haystack tasks with lcx's held-out corpus as the haystack.

lm-eval's `niah_single_2`, `niah_single_3`, `niah_multikey_1`, `niah_multivalue` and
`niah_multiquery` hide their needles in Paul Graham essays fetched from a hub at run time. The
`*_pd` tasks here run lm-eval's own generator (`lm_eval.tasks.ruler.prepare_niah.generate_samples`,
imported) with the same template (`niah_utils.TEMPLATE`), needle kinds and counts (`NEEDLES`, the
arguments `niah_utils` passes), sizing (the generator's, 500 samples per length, 128 answer tokens)
and scoring (`common_utils.process_results`, in the YAMLs); only the haystack text differs: the
documents of the lcx corpus' validation split (`lcx.data.corpus`: four Shakespeare plays, both
editions, and four books of the King James Bible, public domain), joined and split on whitespace
as RULER splits the essays. tests/eval_tasks/test_ruler.py checks that lm-eval's own task function
given this haystack produces the same samples.

Sentences (where needles may go) come from nltk's Punkt, as in RULER; without nltk's English
parameters (a download) lcx's hook supplies parameter-free ones (`lcx._lmeval_hook.nltk_data_dir`).
"""

from __future__ import annotations

import re
from functools import cache

# RULER's arguments per task (lm_eval/tasks/ruler/niah_utils.py), besides the essay haystack.
NEEDLES: dict[str, dict[str, object]] = {
    "niah_single_2": {"type_needle_k": "words", "type_needle_v": "numbers"},
    "niah_single_3": {"type_needle_k": "words", "type_needle_v": "uuids"},
    "niah_multikey_1": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_k": 4},
    "niah_multivalue": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_v": 4},
    "niah_multiquery": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_q": 4},
}
SUFFIX = "_pd"
NUM_SAMPLES = 500  # per length, as RULER


@cache
def haystack() -> list[str]:
    """The held-out corpus as RULER's essay haystack: documents joined by spaces, whitespace runs
    collapsed, split into words (`prepare_niah.get_haystack("essay")` does the same to the essays)."""
    from lcx.data.corpus import load_corpus

    text = " ".join(doc.text for doc in load_corpus("validation"))
    return re.sub(r"\s+", " ", text).split(" ")


def _dataset(task: str, kwargs: dict):
    from lm_eval.tasks.ruler.common_utils import DEFAULT_SEQ_LENGTHS, get_tokenizer, resolve_tokenizer_name
    from lm_eval.tasks.ruler.niah_utils import TEMPLATE, download_dataset
    from lm_eval.tasks.ruler.prepare_niah import generate_samples

    seq_lengths = kwargs.pop("max_seq_lengths", DEFAULT_SEQ_LENGTHS)
    tokenizer = get_tokenizer(resolve_tokenizer_name(kwargs))
    return download_dataset(
        generate_samples(haystack(), max_seq_length=seq, template=TEMPLATE, type_haystack="essay",
                         num_samples=NUM_SAMPLES, TOKENIZER=tokenizer, **NEEDLES[task])
        for seq in seq_lengths)


def niah_single_2_pd(**kwargs):
    return _dataset("niah_single_2", kwargs)


def niah_single_3_pd(**kwargs):
    return _dataset("niah_single_3", kwargs)


def niah_multikey_1_pd(**kwargs):
    return _dataset("niah_multikey_1", kwargs)


def niah_multivalue_pd(**kwargs):
    return _dataset("niah_multivalue", kwargs)


def niah_multiquery_pd(**kwargs):
    return _dataset("niah_multiquery", kwargs)
