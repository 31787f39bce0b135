"""`studies/ruler_equivalent_bounds.py`: the bound lcx report checks, written as a record; it covers
the prompts' own RULER length and stays within the cell's length plus the answer prefix."""

from __future__ import annotations

import pytest

from studies.ruler_equivalent_bounds import main


@pytest.mark.slow
def test_bounds_record(tmp_path):
    from lcx.data.io import read_json
    from lcx.report.ruler import load_ruler_tasks

    out = tmp_path / "b.json"
    main(["--model", "tiny-ret-5m", "--lengths", "1024", "--tasks", "niah_single_1", "--samples", "2", "--out", str(out)])
    rec = read_json(out)
    bound = rec["longest_sequence"]["1024"]
    docs = list(load_ruler_tasks("tiny-ret-5m", 1024, ["niah_single_1"])[2]["niah_single_1"].eval_docs)[:2]
    assert max(d["length"] for d in docs) + rec["margin"] < bound <= 1024 + 64
    with pytest.raises(SystemExit):
        main(["--model", "tiny-ret-5m", "--lengths", "1024", "--tasks", "niah_single_1", "--samples", "0", "--out", str(out)])
