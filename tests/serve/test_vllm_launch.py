"""Where lcx finds vLLM (`lcx.serve.vllm_plugin.launch.vllm_python`): no vLLM needed.

Order: an explicit venv / $LCX_VLLM_VENV, then this interpreter when vLLM is importable from it
(scripts/install_vllm_cpu.sh's default), then `.venv-vllm` at the repository root; otherwise a
named error that says how to install it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from lcx.serve.vllm_plugin import launch
from lcx.serve.vllm_plugin.launch import VllmNotInstalled, vllm_python


def _fake_venv(root: Path) -> Path:
    py = root / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    return py


@pytest.fixture
def no_vllm_here(monkeypatch, tmp_path):
    """This interpreter without vLLM, a repository root without .venv-vllm, no LCX_VLLM_VENV."""
    real = importlib.util.find_spec
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setattr(launch, "REPO_ROOT", tmp_path / "repo")
    monkeypatch.delenv("LCX_VLLM_VENV", raising=False)
    return tmp_path


def test_missing_vllm_is_a_named_error_naming_the_installer(no_vllm_here):
    with pytest.raises(VllmNotInstalled, match="install_vllm_cpu.sh"):
        vllm_python()


def test_this_interpreter_when_vllm_is_importable(no_vllm_here, monkeypatch):
    _fake_venv(no_vllm_here / "repo" / ".venv-vllm")  # present, but the current environment wins
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name, *a: object())
    assert vllm_python() == Path(sys.executable)


def test_repo_venv_when_this_interpreter_lacks_vllm(no_vllm_here):
    py = _fake_venv(no_vllm_here / "repo" / ".venv-vllm")
    assert vllm_python() == py


def test_explicit_venv_wins_and_must_exist(no_vllm_here, monkeypatch):
    py = _fake_venv(no_vllm_here / "elsewhere")
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setenv("LCX_VLLM_VENV", str(no_vllm_here / "elsewhere"))
    assert vllm_python() == py
    assert vllm_python(no_vllm_here / "elsewhere") == py
    monkeypatch.setenv("LCX_VLLM_VENV", str(no_vllm_here / "missing"))
    with pytest.raises(VllmNotInstalled, match="LCX_VLLM_VENV"):
        vllm_python()


def test_server_command_uses_the_found_python(no_vllm_here, monkeypatch):
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name, *a: object())
    cmd = launch.serve_command("/m", {}, host="127.0.0.1", port=1, served_model_name="m")
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
