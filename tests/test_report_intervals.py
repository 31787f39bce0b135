"""`lcx report`: every passkey cell carries n and a Wilson 95% interval (tables, plots, report.json)."""

from __future__ import annotations

import math

import pytest

from lcx.report import format_interval, markdown, passkey_counts, passkey_interval, passkey_intervals, plot_report
from lcx.stats import wilson_interval

# (k, n) -> (lo, hi), from the closed form: centre (p + z²/2n)/(1 + z²/n), half-width
# z/(1 + z²/n) sqrt(p(1-p)/n + z²/4n²), z = 1.96
WILSON = {(3, 4): (0.3006, 0.9544), (0, 4): (0.0, 0.4899), (4, 4): (0.5101, 1.0), (8, 16): (0.2800, 0.7200),
          (0, 30): (0.0, 0.1135), (1, 1): (0.2065, 1.0)}


@pytest.mark.parametrize("kn", list(WILSON), ids=str)
def test_wilson_known_values_contain_the_estimate(kn):
    lo, hi = wilson_interval(*kn)
    assert (lo, hi) == pytest.approx(WILSON[kn], abs=1e-4)
    assert lo <= kn[0] / kn[1] <= hi  # also at 0/n and n/n, where rounding could push it out


def _samples(correct, depths):
    return [{"depth": d, "key": str(i), "correct": float(c), "output": None}
            for i, (c, d) in enumerate(zip(correct, depths))]


def test_counts_come_from_the_per_prompt_results():
    cell = {"passkey": 0.75, "passkey_docs": 4, "passkey_samples": _samples([1, 1, 0, 1], [0.1, 0.1, 0.9, 0.9])}
    assert passkey_counts(cell) == (3, 4)
    assert passkey_counts(cell, "0.900") == (1, 2) and passkey_counts(cell, "0.500") is None
    assert passkey_counts({"passkey": 0.7, "passkey_docs": 10}) == (7, 10)  # an old cell without samples
    assert passkey_counts(None) is None and passkey_interval(None) is None
    iv = passkey_interval(cell)
    assert (iv["k"], iv["n"], iv["acc"]) == (3, 4, 0.75)
    assert format_interval(iv) == "0.75 [0.30, 0.95] n=4"
    assert format_interval(None) == "—"


def _record(results, lengths=(256, 512)):
    cfg = {"model": "m", "context": 256, "lengths": list(lengths), "decode_lengths": list(lengths), "rope_factor": 2.0,
           "depths": 2, "samples_per_depth": 2, "ppl_docs": 1, "decode_tokens": 4, "methods_resolved": {},
           "methods_skipped": {}}
    return {"config": cfg, "results": results, "environment": {}, "git": {"sha": "x" * 40}, "wall_s": 1.0,
            "cells_reused": 0, "cells_total": 4 * len(results)}


def test_tables_plots_and_record_carry_intervals(tmp_path):
    a = {"passkey": 0.75, "passkey_docs": 4, "passkey_samples": _samples([1, 1, 0, 1], [0, 0, 1, 1]),
         "passkey_by_depth": {"0.000": 1.0, "1.000": 0.5}, "ppl": {"word_perplexity": 10.0}}
    b = {"passkey": 0.0, "passkey_docs": 4, "passkey_samples": _samples([0, 0, 0, 0], [0, 0, 1, 1]),
         "passkey_by_depth": {"0.000": 0.0, "1.000": 0.0}, "ppl": {"word_perplexity": 20.0}}
    rec = _record({"vanilla": {"lmeval": {"256": a, "512": b}, "decode": {}},
                   "yarn": {"lmeval": {"256": a}, "decode": {}}})  # yarn @ 512 not measured yet
    ivs = passkey_intervals(rec)
    assert set(ivs["vanilla"]) == {"256", "512"} and set(ivs["yarn"]) == {"256"}
    assert ivs["vanilla"]["512"]["n"] == 4 and ivs["vanilla"]["512"]["hi"] == pytest.approx(0.4899, abs=1e-4)
    md = markdown(rec)
    assert "| vanilla | 0.75 [0.30, 0.95] n=4 | 0.00 [0.00, 0.49] n=4 |" in md
    assert "| yarn | 0.75 [0.30, 0.95] n=4 | — |" in md
    assert "passkey_by_length.png" in md
    plot_report(rec, tmp_path)
    for f in ("passkey_heatmap.png", "passkey_by_length.png", "ppl_by_length.png", "decode_by_length.png"):
        assert (tmp_path / f).stat().st_size > 0
    assert all(math.isfinite(v) for m in ivs.values() for iv in m.values() for v in (iv["lo"], iv["hi"]))


def test_no_decode_lengths_means_no_decode_cells_section_or_plot(tmp_path):
    """`--decode-lengths none` (a passkey/perplexity sweep): the config keeps () through
    `resolved` (None still means the passkey lengths), the report has no decoding section and
    writes no decoding plot."""
    from lcx.report.cli import _int_list
    from lcx.report.config import ReportConfig

    assert _int_list("none") == () and _int_list("16,32") == (16, 32)
    assert ReportConfig(lengths=(256, 512), decode_lengths=()).resolved(256).decode_lengths == ()
    assert ReportConfig(lengths=(256, 512)).resolved(256).decode_lengths == (256, 512)
    with pytest.raises(ValueError, match="lengths"):
        ReportConfig(lengths=())
    a = {"passkey": 0.75, "passkey_docs": 4, "passkey_samples": _samples([1, 1, 0, 1], [0, 0, 1, 1]),
         "passkey_by_depth": {"0.000": 1.0, "1.000": 0.5}, "ppl": {"word_perplexity": 10.0}}
    rec = _record({"vanilla": {"lmeval": {"256": a, "512": a}, "decode": {}}})
    rec["config"]["decode_lengths"] = []
    md = markdown(rec)
    assert "## Decoding" not in md and "decode_by_length.png" not in md and "## Methods (resolved)" in md
    plot_report(rec, tmp_path)
    assert (tmp_path / "ppl_by_length.png").exists() and not (tmp_path / "decode_by_length.png").exists()
    rec["config"]["decode_lengths"] = [256]
    assert "## Decoding" in markdown(rec)


def test_paired_tests_match_prompts_by_depth_and_key_and_orient_each_pair():
    """`passkey_paired` pairs prompts by (depth, key), not by list order; the README's tables read a
    pair in either orientation (a - b, prompts only a : only b) and give the exact McNemar p."""
    from lcx.report import passkey_paired

    depths = [0.0] * 8 + [1.0] * 8
    van = _samples([0] * 16, depths)
    se = _samples([1] * 9 + [0] * 7, depths)
    se = se[::-1]  # stored in another order: pairing must follow (depth, key)
    mixed = _samples([1, 0] * 8, depths)

    def cell(s):
        return {"passkey_docs": len(s), "passkey_samples": s, "ppl": {"word_perplexity": 1.0}}

    rec = _record({"vanilla": {"lmeval": {"256": cell(van), "512": cell(van)}, "decode": {}},
                   "self_extend": {"lmeval": {"512": cell(se)}, "decode": {}},
                   "yarn": {"lmeval": {"512": cell(mixed)}, "decode": {}},
                   "old": {"lmeval": {"512": {"passkey": 0.5, "passkey_docs": 16}}, "decode": {}}})  # no samples
    paired = passkey_paired(rec)
    assert "256" not in paired  # one method measured there: no pair
    by = {(p["a"], p["b"]): p for p in paired["512"]}
    assert set(by) == {("vanilla", "self_extend"), ("vanilla", "yarn"), ("self_extend", "yarn")}
    p = by[("vanilla", "self_extend")]
    assert (p["n"], p["x_only"], p["y_only"]) == (16, 0, 9)
    assert p["mcnemar_p"] == pytest.approx(2 / 2 ** 9)  # 9 vs 0 discordant: 2 * 0.5^9
    q = by[("self_extend", "yarn")]  # se right on keys 0..8 (depths 0 x8, 1 x1); yarn on even keys
    assert (q["x_only"], q["y_only"], q["both"]) == (4, 3, 5)
    rec["passkey_paired"] = paired
    md = markdown(rec)
    assert "## Paired tests on the same prompts" in md
    assert "| self_extend | — | +0.56 [" in md and "9:0 p=0.004 |" in md  # oriented as method - vanilla
    assert "| old | — | — |" in md
    assert "At 512 tokens, every pair" in md and "| vanilla |  | 0:9 (0.004) | 0:8 (0.008) |" in md
    alone = _record({"vanilla": {"lmeval": {"256": cell(van)}, "decode": {}}})
    assert passkey_paired(alone) == {} and "## Paired tests" not in markdown(alone)


def test_a_render_before_any_lm_eval_cell_draws_its_plots(tmp_path):
    """`lcx report --render` mid-run, when only decode cells exist: the perplexity plot has nothing
    to log-scale and must still be written (matplotlib raises on a log axis without data)."""
    rec = _record({"vanilla": {"lmeval": {}, "decode": {"256": {"tokens_per_s": 10.0, "kv_cache_mb": 1.0}}}})
    plot_report(rec, tmp_path)
    assert (tmp_path / "ppl_by_length.png").stat().st_size > 0
    assert "| vanilla | — | — |" in markdown(rec)


def test_renders_outside_a_git_checkout():
    """A report measured where `git` found no checkout (sha None) still renders; the README says '?'."""
    from pathlib import Path

    from lcx.data.io import read_json
    from lcx.report.render import markdown

    rec = read_json(Path(__file__).resolve().parents[1] / "results/report/report.json.gz")
    rec["git"] = {"sha": None, "dirty": None}
    assert "git ?. lm-eval seconds" in markdown(rec)
