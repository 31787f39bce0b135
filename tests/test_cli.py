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


def _options(path: tuple[str, ...]) -> dict[str, object]:
    """option string -> argparse action of the command `path` (its parser, built as `lcx` builds it)."""
    from lcx.cli import build_parser

    parser = build_parser([*path, "--help"])
    for name in path:  # descend into the chosen subparser
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[name]
    return {opt: a for a in parser._actions for opt in a.option_strings}


@pytest.mark.parametrize("path", [p for p, _, _ in COMMANDS], ids=[" ".join(p) for p, _, _ in COMMANDS])
def test_one_meaning_per_flag(path, capsys):
    """`--methods` is an lcx.MethodConfig as JSON wherever it is taken; a list of preset names is
    `--presets`, where `--methods` is only its deprecated spelling (it warns, #45)."""
    opts = _options(path)
    if "--presets" in opts:
        assert opts["--presets"].dest == "presets"
        alias = opts.get("--methods")
        assert alias is not None and alias.dest == "presets" and "deprecated" in alias.help
    elif "--methods" in opts:
        assert opts["--methods"].dest == "method_json" and opts["--methods"].metavar == "JSON", (
            f"lcx {' '.join(path)}: --methods must be the MethodConfig JSON flag (lcx.method_config.add_method_arguments)")


PRESET_LIST_COMMANDS = [p for p, _, _ in COMMANDS if p[0] in ("report", "demo", "bench")]


@pytest.mark.parametrize("path", PRESET_LIST_COMMANDS, ids=[" ".join(p) for p in PRESET_LIST_COMMANDS])
def test_methods_as_a_preset_list_still_parses_and_warns(path, capsys):
    import argparse

    opts = _options(path)
    if "--presets" not in opts:
        pytest.skip(f"lcx {' '.join(path)} takes no preset list")
    parser = argparse.ArgumentParser(prog="lcx " + " ".join(path))
    from importlib import import_module

    from lcx.cli import EXPERIMENTS, import_experiment

    module = next(m for p, m, _ in COMMANDS if p == path)
    mod = import_experiment(module) if module.split(".")[0] in EXPERIMENTS else import_module(module)
    mod.add_arguments(parser)
    value = ["vanilla"] if opts["--presets"].nargs == "+" else "vanilla"
    capsys.readouterr()
    new = parser.parse_args(["--presets", *([value] if isinstance(value, str) else value)])
    assert "deprecated" not in capsys.readouterr().err  # the new spelling is silent
    old = parser.parse_args(["--methods", *([value] if isinstance(value, str) else value)])
    assert old.presets == new.presets == value
    err = capsys.readouterr().err
    assert "--methods for a list of presets is deprecated, use --presets" in err


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
