"""lcx.data.io: gzipped JSON records (written, found and read like plain ones) and PNG plots
stored as palette images."""

from __future__ import annotations

import gzip
import json

import pytest

from lcx.data import io

RECORD = {"config": {"a": 1}, "samples": [{"i": i, "text": "x" * i} for i in range(5)]}


def test_gzipped_record_round_trips_and_is_deterministic(tmp_path):
    plain, gz = tmp_path / "r.json", tmp_path / "r.json.gz"
    io.atomic_write_json(plain, RECORD, rows=("samples",))
    io.atomic_write_json(gz, RECORD, rows=("samples",))
    assert gzip.decompress(gz.read_bytes()).decode() == plain.read_text()  # the same text, one sample a line
    first = gz.read_bytes()
    io.atomic_write_json(gz, RECORD, rows=("samples",))
    assert gz.read_bytes() == first  # no timestamp or file name in the gzip header
    assert io.read_json(gz) == io.read_json(plain) == RECORD


def test_a_json_path_finds_its_gzipped_sibling(tmp_path):
    p = tmp_path / "r.json"
    assert io.json_path(p) == p  # neither exists: the plain name
    io.atomic_write_json(p.with_name("r.json.gz"), RECORD)
    assert io.json_path(p) == tmp_path / "r.json.gz" and io.read_json(p) == RECORD
    io.atomic_write_json(p, {"plain": True})
    assert io.json_path(p) == p and io.read_json(p) == {"plain": True}  # a plain file wins
    with pytest.raises(FileNotFoundError):
        io.read_json(tmp_path / "missing.json")
    assert io.with_suffix(tmp_path / "x.json.gz", ".png") == tmp_path / "x.png"
    assert io.with_suffix(tmp_path / "x.json", ".png") == tmp_path / "x.png"


def test_saved_plots_are_palette_pngs(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    fig, ax = plt.subplots()
    ax.plot(range(10), [x * x for x in range(10)], label="x^2")
    ax.legend()
    io.atomic_savefig(fig, tmp_path / "p.png", dpi=80)
    io.atomic_savefig(fig, tmp_path / "t.png", dpi=80, transparent=True)
    plt.close(fig)
    with Image.open(tmp_path / "p.png") as im:
        assert im.mode == "P" and im.size == (512, 384)
    with Image.open(tmp_path / "t.png") as im:
        assert im.mode == "RGBA"  # transparency asked for: kept as saved
