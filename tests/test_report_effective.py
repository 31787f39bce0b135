"""Effective context length (issue #76, item 2): the longest measured length whose Wilson lower
bound stays at or above a threshold, RULER's absolute 0.856 and 0.85x vanilla inside L0."""

from __future__ import annotations

import pytest

from lcx.report.effective import (RELATIVE_FRACTION, RULER_THRESHOLD, describe, effective_length,
                                  effective_lengths, markdown_section, report_effective_lengths)
from lcx.stats import wilson_interval


def iv(k, n):
    lo, hi = wilson_interval(k, n)
    return {"k": k, "n": n, "acc": k / n, "lo": lo, "hi": hi}


def test_stays_above_means_every_shorter_length_passes():
    # 100/100 has lo ~0.963; 90/100 lo ~0.826 (< 0.856); a pass after a failure does not count
    by_len = {"1024": iv(100, 100), "2048": iv(100, 100), "4096": iv(90, 100), "8192": iv(100, 100)}
    e = effective_length(by_len, RULER_THRESHOLD)
    assert e == {"length": 2048, "capped": False, "measured": [1024, 2048, 4096, 8192]}
    assert describe(e) == "2048"
    assert describe(effective_length({"1024": iv(99, 100)}, RULER_THRESHOLD)) == ">= 1024"
    assert describe(effective_length({"1024": iv(5, 6), "2048": iv(100, 100)}, RULER_THRESHOLD)) == "< 1024"


def test_point_score_above_but_lower_bound_below_fails():
    small = iv(15, 16)  # 0.94 on 16 prompts: lower bound ~0.72
    assert small["acc"] > RULER_THRESHOLD > small["lo"]
    assert effective_length({"4096": small}, RULER_THRESHOLD)["length"] is None


def test_relative_threshold_is_a_fraction_of_vanilla_inside_l0():
    ivs = {"vanilla": {"256": iv(40, 50), "512": iv(5, 50)},
           "yarn": {"256": iv(45, 50), "512": iv(40, 50), "1024": iv(20, 50)}}
    e = effective_lengths(ivs, context=256)
    assert e["reference"] == {"method": "vanilla", "length": 256, "acc": 0.8}
    assert e["thresholds"]["relative"] == pytest.approx(RELATIVE_FRACTION * 0.8)
    # yarn: lo(45/50) ~0.79, lo(40/50) ~0.67 >= 0.68? no: 0.667 < 0.68 -> 256
    lo512 = ivs["yarn"]["512"]["lo"]
    want = 512 if lo512 >= RELATIVE_FRACTION * 0.8 else 256
    assert e["methods"]["yarn"]["relative"]["length"] == want
    assert e["methods"]["vanilla"]["absolute"]["length"] is None


def test_no_relative_threshold_without_vanilla_inside_l0():
    e = effective_lengths({"vanilla": {"1024": iv(10, 30)}, "yarn": {"1024": iv(20, 30)}}, context=256)
    assert e["reference"] is None and e["thresholds"]["relative"] is None
    assert "relative" not in e["methods"]["yarn"]
    zero = effective_lengths({"vanilla": {"256": iv(0, 30)}, "yarn": {"256": iv(20, 30)}}, context=256)
    assert zero["reference"] is None  # 0.85 x 0 would pass everything


def test_report_record_and_markdown():
    def cell(k, n):
        return {"passkey_samples": [{"depth": 0.5, "correct": i < k} for i in range(n)]}

    record = {"config": {"context": 256, "model": "m", "lengths": [256, 512]},
              "results": {"vanilla": {"lmeval": {"256": cell(30, 30), "512": cell(2, 30)}},
                          "yarn": {"lmeval": {"256": cell(30, 30), "512": cell(30, 30)}}}}
    from lcx.report.render import passkey_intervals

    record["passkey_intervals"] = passkey_intervals(record)
    eff = report_effective_lengths(record)
    assert set(eff) == {"passkey"}
    assert eff["passkey"]["methods"]["yarn"]["absolute"]["length"] == 512
    assert eff["passkey"]["methods"]["vanilla"]["absolute"]["length"] == 256
    text = "\n".join(markdown_section({**record, "effective_length": eff}))
    assert "| yarn | >= 512 | >= 512 |" in text and "| vanilla | 256 | 256 |" in text
    assert "vanilla scores 1.00 at 256" in text
