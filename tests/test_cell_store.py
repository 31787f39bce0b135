"""The report's cell store (`lcx.report.cells`, "The cell store"): one xz JSON Lines file per report
folder, written atomically under a lock, reading the per-cell files of earlier versions."""

from __future__ import annotations

import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lcx.data.io import atomic_write_json
from lcx.report.cells import (
    STORE_NAME,
    CellStoreError,
    cell_path,
    load_cell,
    migrate_cells,
    plan_run,
    read_cell,
    read_cells,
    read_run,
    remove_cell,
    store_path,
    update_store,
    write_cell,
    write_run,
)

ROOT = Path(__file__).resolve().parents[1]
FP = {"cell_version": 2, "code": {"lmeval": {"lcx.rope": "abc"}}, "models": {"m": "123"}, "environment": {"torch": "x"}}
LENGTHS = (1, 63, 217, 4097)  # odd sizes: the cells' names sort as strings, not numbers


def _cell(i: int, answers: int = 3) -> dict:
    """A cell shaped as `run_report` writes one, with `answers` per-prompt outputs (unicode too)."""
    return {"settings": {"kind": "lmeval", "method": "yarn", "length": i}, "fingerprint": FP, "run_id": "r1",
            "finished_at": "2026-12-07T05:00:00", "wall_s": 1.5 + i,
            "result": {"passkey": i / 7, "ppl": {"word_perplexity": float(i) + 0.1},
                       "passkey_samples": [{"key": k, "output": f"the key is {k} – ünïcode ✓\nline", "correct": 1.0}
                                           for k in range(answers)]}}


def test_cells_and_the_run_round_trip_in_one_file_with_the_same_bytes_for_the_same_cells(tmp_path):
    cells = {L: _cell(L) for L in LENGTHS}
    for L, c in cells.items():
        write_cell(cell_path(tmp_path, "yarn", "lmeval", L), c)
    write_run(tmp_path, {"run_id": "r1", "finished": False})
    assert sorted(p.name for p in (tmp_path / "cells").iterdir()) == [STORE_NAME]  # one file, no leftovers
    for L, c in cells.items():
        assert read_cell(cell_path(tmp_path, "yarn", "lmeval", L)) == c
        # an earlier version's file name of the same cell finds it in the store
        assert read_cell(tmp_path / "cells" / f"yarn.lmeval.{L}.json.gz") == c
    assert read_cells(tmp_path) == {f"yarn.lmeval.{L}": cells[L] for L in sorted(LENGTHS, key=str)}
    assert read_run(tmp_path) == {"run_id": "r1", "finished": False}
    # xz JSON Lines: a header, the run, one cell per line in name order
    lines = lzma.decompress(store_path(tmp_path).read_bytes()).decode().splitlines()
    assert json.loads(lines[0]) == {"format": "lcx report cells", "version": 1}
    assert json.loads(lines[1]) == {"run": {"run_id": "r1", "finished": False}}
    assert [json.loads(x)["cell"] for x in lines[2:]] == [f"yarn.lmeval.{L}" for L in sorted(LENGTHS, key=str)]
    # the same cells written in another order: the same bytes (a re-run that changes nothing changes no file)
    other = tmp_path / "other"
    write_run(other, {"run_id": "r1", "finished": False})
    for L in reversed(LENGTHS):
        write_cell(cell_path(other, "yarn", "lmeval", L), cells[L])
    assert store_path(other).read_bytes() == store_path(tmp_path).read_bytes()
    # replace, remove
    write_cell(cell_path(tmp_path, "yarn", "lmeval", 63), _cell(64))
    assert read_cell(cell_path(tmp_path, "yarn", "lmeval", 63)) == _cell(64)
    assert remove_cell(cell_path(tmp_path, "yarn", "lmeval", 63)) is True
    assert remove_cell(cell_path(tmp_path, "yarn", "lmeval", 63)) is False
    with pytest.raises(FileNotFoundError, match="yarn.lmeval.63"):
        read_cell(cell_path(tmp_path, "yarn", "lmeval", 63))
    assert load_cell(cell_path(tmp_path, "yarn", "lmeval", 63), _cell(63)["settings"], FP) is None
    assert load_cell(cell_path(tmp_path, "yarn", "lmeval", 217), _cell(217)["settings"], FP) == _cell(217)
    assert set(read_cells(tmp_path)) == {"yarn.lmeval.1", "yarn.lmeval.217", "yarn.lmeval.4097"}
    # the run manifest in the store is what plan_run resumes from
    write_run(tmp_path, {"run_id": "r1", "finished": False, "config": _Cfg().to_dict(), "fingerprint": FP})
    assert plan_run(tmp_path, _Cfg(), FP, fresh=False, reuse=False)[:2] == ("r1", {"r1"})


def test_an_old_layout_folder_loads_and_its_first_write_moves_it_into_the_store(tmp_path):
    """Per-cell files of earlier versions (gzipped, plain) and cells/run.json: read as they are;
    the next write moves every readable one into the store; a file that does not read stays."""
    cells = tmp_path / "cells"
    atomic_write_json(cells / "yarn.lmeval.63.json.gz", _cell(63))
    (cells / "yarn.lmeval.217.json").write_text(json.dumps(_cell(217)))
    (cells / "yarn.lmeval.1.json.gz").write_bytes(b"\x1f\x8b truncated")
    (cells / "run.json").write_text(json.dumps({"run_id": "r0", "finished": True}))
    assert read_cell(cell_path(tmp_path, "yarn", "lmeval", 63)) == _cell(63)
    assert read_cell(cells / "yarn.lmeval.217.json") == _cell(217)
    assert load_cell(cell_path(tmp_path, "yarn", "lmeval", 217), _cell(217)["settings"], FP) == _cell(217)
    assert load_cell(cell_path(tmp_path, "yarn", "lmeval", 1), _cell(1)["settings"], FP) is None  # unreadable
    assert read_cells(tmp_path) == {"yarn.lmeval.217": _cell(217), "yarn.lmeval.63": _cell(63)}
    assert read_run(tmp_path) == {"run_id": "r0", "finished": True}
    assert "finished" in plan_run(tmp_path, _Cfg(), FP, fresh=False, reuse=False)[2]

    write_cell(cell_path(tmp_path, "yarn", "lmeval", 4097), _cell(4097))
    assert sorted(p.name for p in cells.iterdir()) == [STORE_NAME, "yarn.lmeval.1.json.gz"]
    assert read_cells(tmp_path) == {"yarn.lmeval.217": _cell(217), "yarn.lmeval.4097": _cell(4097),
                                    "yarn.lmeval.63": _cell(63)}
    assert read_run(tmp_path) == {"run_id": "r0", "finished": True}
    # the store comes first: a stale per-cell file of a stored cell is not read, and is dropped
    (cells / "yarn.lmeval.63.json").write_text(json.dumps(_cell(5)))
    assert read_cell(cell_path(tmp_path, "yarn", "lmeval", 63)) == _cell(63)
    assert update_store(tmp_path)["moved"] == 1 and not (cells / "yarn.lmeval.63.json").exists()


class _Cfg:
    def to_dict(self):
        return {"x": 1}


def _old_layout_copy(src: Path, dst: Path) -> dict:
    """`src`'s cells written as earlier versions wrote them (a gzipped JSON per cell, run.json)."""
    cells = read_cells(src)
    assert cells, f"{src}: no cells"
    for stem, cell in cells.items():
        atomic_write_json(dst / "cells" / f"{stem}.json.gz", cell)
    (dst / "cells" / "run.json").write_text(json.dumps(read_run(src), indent=2))
    return cells


@pytest.mark.parametrize("report", ["smollm2-135m-ruler4k", "gemma3-270m-ruler8k"])
def test_migrating_an_old_layout_copy_of_a_committed_report_gives_equal_cells(report, tmp_path, capsys):
    """A committed report's cells as per-cell files, moved by `lcx report --compact-cells` (which
    finds report folders under the one named): the same cells and run, one file, smaller."""
    from lcx.cli import main

    src = ROOT / "results" / "report" / report
    dst = tmp_path / "reports" / report
    cells = _old_layout_copy(src, dst)
    before = sum(f.stat().st_size for f in (dst / "cells").iterdir())
    assert read_cells(dst) == cells and read_run(dst) == read_run(src)
    assert main(["report", "--compact-cells", str(tmp_path / "reports")]) == 0
    assert f"{len(cells)} cells in {STORE_NAME}, {len(cells) + 1} file(s) moved in" in capsys.readouterr().out
    assert sorted(p.name for p in (dst / "cells").iterdir()) == [STORE_NAME]
    assert read_cells(dst) == cells and read_run(dst) == read_run(src)
    assert store_path(dst).stat().st_size < before
    assert store_path(dst).read_bytes() == store_path(src).read_bytes()  # the committed store is this migration's
    assert migrate_cells(dst)["written"] is False  # compact already: nothing rewritten
    assert main(["report", "--compact-cells", str(tmp_path / "none")]) == 2


def test_a_damaged_store_is_an_error_never_an_empty_store(tmp_path):
    write_cell(cell_path(tmp_path, "yarn", "lmeval", 63), _cell(63))
    data = store_path(tmp_path).read_bytes()
    store_path(tmp_path).write_bytes(data[: len(data) // 2])
    with pytest.raises(CellStoreError, match="not a readable lcx cell store"):
        read_cell(cell_path(tmp_path, "yarn", "lmeval", 63))
    with pytest.raises(CellStoreError):
        load_cell(cell_path(tmp_path, "yarn", "lmeval", 63), _cell(63)["settings"], FP)
    with pytest.raises(CellStoreError):
        write_cell(cell_path(tmp_path, "yarn", "lmeval", 217), _cell(217))
    assert store_path(tmp_path).read_bytes() == data[: len(data) // 2]  # left for a person to look at
    with pytest.raises(ValueError, match="no cells/ folder"):
        migrate_cells(tmp_path / "missing")


# A writer process: writes cells `first`..`first+n-1` (big enough that a write takes a while),
# printing each name once write_cell has returned.
WRITER = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_cell_store import _cell
from lcx.report.cells import cell_path, write_cell
out, first, n, answers = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for i in range(first, first + n):
    write_cell(cell_path(out, "yarn", "lmeval", i), _cell(i, answers))
    print(f"yarn.lmeval.{{i}}", flush=True)
"""


def _writer(out: Path, first: int, n: int, answers: int) -> subprocess.Popen:
    code = WRITER.format(tests=str(Path(__file__).resolve().parent))
    return subprocess.Popen([sys.executable, "-c", code, str(out), str(first), str(n), str(answers)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)


def test_a_writer_killed_mid_write_leaves_a_whole_store_with_every_cell_it_wrote(tmp_path):
    """SIGKILL while the temporary file of a write exists (mid-write; tried until a kill lands
    there, which leaves that file): the store reads and holds every cell written before, and the
    next write clears the leftover temporary file."""
    tmp_glob = f".{STORE_NAME}.*.tmp"
    for attempt in range(8):
        out = tmp_path / str(attempt)
        proc = _writer(out, 0, 10_000, 400)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                if store_path(out).exists() and any((out / "cells").glob(tmp_glob)):
                    os.kill(proc.pid, signal.SIGKILL)
                    break
        finally:
            if proc.poll() is None and time.monotonic() >= deadline:
                proc.kill()
            done = proc.communicate(timeout=60)[0].split()
        assert proc.returncode == -signal.SIGKILL, "the writer ended before it was killed"
        stored = read_cells(out)  # whole, whatever the kill interrupted
        assert done and set(done) <= set(stored)
        assert all(stored[f"yarn.lmeval.{i}"] == _cell(i, 400) for i in range(len(done)))
        if list((out / "cells").glob(tmp_glob)):  # killed mid-write
            break
    else:
        pytest.fail("no kill landed mid-write in 8 tries")
    write_cell(cell_path(out, "yarn", "lmeval", 99_999), _cell(1))
    assert not list((out / "cells").glob(tmp_glob))
    assert set(done) | {"yarn.lmeval.99999"} <= set(read_cells(out))


@pytest.mark.slow  # two real writer processes (~3 s): the slow tier
def test_two_writer_processes_at_once_lose_no_cell(tmp_path):
    """Read-modify-replace by two processes on one folder: the lock keeps both's cells."""
    n = 15
    procs = [_writer(tmp_path, 0, n, 200), _writer(tmp_path, 1000, n, 200)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and [len(o) for o in outs] == [n, n]
    stored = read_cells(tmp_path)
    assert set(stored) == {f"yarn.lmeval.{i}" for i in (*range(n), *range(1000, 1000 + n))}
    assert all(stored[f"yarn.lmeval.{i}"] == _cell(i, 200) for i in (*range(n), *range(1000, 1000 + n)))


def test_the_committed_reports_keep_one_cell_store_each():
    """Every report folder under results/ commits its cells as one store (no per-cell files), and
    each store reads."""
    listed = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = listed.stdout.split()
    folders = sorted({Path(f).parent.parent for f in files if Path(f).parent.name == "cells"})
    assert folders, "no committed report folder"
    for folder in folders:
        assert sorted(f for f in files if Path(f).parent == folder / "cells") == [str(folder / "cells" / STORE_NAME)]
        assert read_cells(ROOT / folder) and read_run(ROOT / folder)["run_id"]


def test_a_legacy_copy_is_not_touched_by_reading(tmp_path):
    """Reading (load_cell, read_cells, read_run) never writes: a render of an old folder leaves it as it is."""
    src = ROOT / "results" / "report" / "smollm2-135m-ruler4k"
    _old_layout_copy(src, tmp_path)
    names = sorted(p.name for p in (tmp_path / "cells").iterdir())
    assert read_cells(tmp_path) and read_run(tmp_path)
    assert sorted(p.name for p in (tmp_path / "cells").iterdir()) == names
    shutil.rmtree(tmp_path / "cells")
    assert read_cells(tmp_path) == {} and read_run(tmp_path) is None
