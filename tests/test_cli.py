"""The `lcx` command line: every registered command has --help; commands run end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lcx.cli import COMMANDS, main


@pytest.mark.parametrize("path", [p for p, _, _ in COMMANDS], ids=[" ".join(p) for p, _, _ in COMMANDS])
def test_every_command_has_help(path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*path, "--help"])
    assert e.value.code == 0
    assert "usage: lcx" in capsys.readouterr().out


def test_top_level_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "lcx.cli", "--help"], capture_output=True, text=True, check=True)
    for path, _, _ in COMMANDS:
        assert path[0] in out.stdout


def test_bad_rope_spec_is_one_line_error(capsys):
    assert main(["rope", "--rope", "yarn", "--factor", "0.5", "--original-max-position-embeddings", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lcx: error:") and "factor must be >= 1" in err


def test_train_stream_writes_results(tmp_path):
    out = tmp_path / "s.json"
    assert main(["train", "stream", "--steps", "5", "--eval-n", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["reencoded_tokens_saved"] > 0
    assert set(data["encoded_tokens"]) == {"interleaved", "group"}
    assert out.with_suffix(".png").exists()


@pytest.mark.parametrize("argv", [
    ["rope", "--rope", "llama3", "--factor", "8", "--original-max-position-embeddings", "8192", "--check-hf"],
    ["rope", "--rope", "yarn", "--factor", "16", "--original-max-position-embeddings", "256", "--check-hf"],
], ids=["llama3", "yarn"])
def test_rope_check_hf_as_in_readme(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    rel = float(out.rsplit("max relative difference vs transformers:", 1)[1])
    assert rel < 2e-6
