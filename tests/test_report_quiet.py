"""A quiet console (issue #76, item 5): `lcx report --quick` prints the report's bar and its cell
lines, not lm-eval's per-cell warnings about lcx's own use or lm-eval's/transformers' bars;
`--verbose` brings them back."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from lcx.report.quiet import HARMLESS, VERBOSE_ENV, quiet

LM_EVAL_LINES = ("WARNING  [", "`pretrained` model kwarg", "Passed an already-initialized model",
                 "Custom kwargs can be passed", "Running loglikelihood requests", "Running generate_until requests",
                 "Checking cached requests", "Loading weights")


def test_quiet_drops_only_the_harmless_warnings(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    log = logging.getLogger("lm_eval.models.huggingface")
    shown: list[str] = []

    class Keep(logging.Handler):  # on the logger itself: lm-eval may stop its loggers propagating
        def emit(self, record):
            shown.append(record.getMessage())

    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    try:
        with quiet():
            for text in HARMLESS:
                log.warning("... %s ...", text)
            log.warning("something lcx did not cause")
        log.warning(HARMLESS[0])  # outside the block: shown
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert shown == ["something lcx did not cause", HARMLESS[0]]


def test_quiet_hides_lm_eval_bars_and_restores_them(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    import lm_eval.api.model
    import tqdm

    before = (tqdm.tqdm, lm_eval.api.model.tqdm)
    with quiet():
        assert tqdm.tqdm(range(3)).disable and lm_eval.api.model.tqdm(range(3)).disable
    assert (tqdm.tqdm, lm_eval.api.model.tqdm) == before
    monkeypatch.setenv(VERBOSE_ENV, "1")
    with quiet():
        assert tqdm.tqdm is before[0]


@pytest.mark.slow  # a 4-cell --quick report: ~1-2 min on 2 cores
@pytest.mark.parametrize("verbose", [False, True])
def test_quick_report_prints_no_lm_eval_lines(tmp_path, verbose):
    cmd = [sys.executable, "-m", "lcx.cli", "report", "--quick", "--presets", "vanilla", "--lengths", "256,1024",
           "--decode-lengths", "256", "--ruler-tasks", "niah_single_1,ruler_vt", "--out", str(tmp_path / "r"),
           *(["--verbose"] if verbose else [])]
    env = {k: v for k, v in os.environ.items() if k != VERBOSE_ENV} | {"HF_HUB_OFFLINE": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "vanilla @ 256: passkey" in out and "vanilla @ 1024: RULER" in out
    found = [x for x in LM_EVAL_LINES if x in out]
    if verbose:
        assert "Passed an already-initialized model" in found and "Running generate_until requests" in found
        assert "| Noises:" in out  # RULER's variable-tracking generator searching its haystack size
    else:
        assert found == [], found
        assert "| Noises:" not in out and "Num noises" not in out
