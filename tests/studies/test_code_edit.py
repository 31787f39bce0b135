"""The PIE code-edit study (`studies.code_edit`): its line and diff helpers and the stdlib
evaluation end to end on the tiny model. The cache edits it runs are tested in
tests/cache/test_pie.py."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import pytest

from lcx.cache import apply_edits
from studies.code_edit import evaluate, make_samples, next_line, summarize, token_edits


def test_token_edits_round_trip():
    """The edits derived from a diff of two token lists turn the first into the second."""
    rng = random.Random(0)
    for _ in range(200):
        old = [rng.randint(0, 9) for _ in range(rng.randint(0, 30))]
        new = list(old)
        for _ in range(rng.randint(0, 3)):
            a = rng.randint(0, len(new))
            b = rng.randint(a, min(len(new), a + 4))
            new[a:b] = [rng.randint(0, 9) for _ in range(rng.randint(0, 3))]
        assert apply_edits(old, token_edits(old, new)) == new


@pytest.mark.parametrize("text,expected", [
    ("\n    x = 1\n", ("    x = 1", True)),  # the line after the generated line break
    ("\n    x = 1", ("    x = 1", False)),  # not finished yet
    ("\n\n  y\n", ("  y", True)),  # blank lines are skipped
    (")\n", ("", False)),
    ("abc", ("", False)),
])
def test_next_line(text, expected):
    assert next_line(text) == expected


def test_code_edit_eval_smoke(tiny_model):
    """The stdlib code-editing evaluation end to end on 3 tiny samples (one per edit kind)."""
    model, tok = tiny_model
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    samples = make_samples(tok, 3, 200, seed=1, files=[stdlib / "textwrap.py", stdlib / "argparse.py"])
    assert [s.kind for s in samples] == ["insertion", "deletion", "multi"]
    for s in samples:
        assert apply_edits(s.old_ids[:-1], s.edits) == s.new_ids[:-1]
    summary = summarize(evaluate(model, tok, samples, max_new_tokens=4))
    rec, pie = summary["all"]["recompute"], summary["all"]["pie"]
    assert rec["em_vs_recompute"] == 1.0 and rec["tokens_ratio_to_recompute"] == 1.0
    assert pie["tokens_encoded_sum"] < rec["tokens_encoded_sum"]
    assert set(summary) == {"all", "insertion", "deletion", "multi"}
