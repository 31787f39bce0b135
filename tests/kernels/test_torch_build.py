"""lcx's lock around torch extension builds: a build killed half-way (its torch `lock` file left
in the build directory) never stalls the next load, which torch's own baton would do forever."""

import multiprocessing
import shutil
import subprocess
import sys

import pytest

from lcx.kernels._torch_build import build_directory, exclusive_build


def _hold(path, ready):
    with exclusive_build(path):
        (path / "lock").touch()  # as torch's baton does while building
        ready.set()
        multiprocessing.Event().wait(60)  # killed before this returns


def test_a_killed_holder_releases_the_lock_and_its_torch_lock_is_removed(tmp_path):
    path = tmp_path / "ext"
    ready = multiprocessing.get_context("fork").Event()
    holder = multiprocessing.get_context("fork").Process(target=_hold, args=(path, ready))
    holder.start()
    assert ready.wait(30)
    holder.kill()
    holder.join(30)
    assert (path / "lock").exists()  # what a killed build leaves
    with exclusive_build(path):
        assert not (path / "lock").exists()


def test_build_directory_is_torchs_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_directory("lcx_x") == tmp_path / "lcx_x" and (tmp_path / "lcx_x").is_dir()


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None, reason="no C++ toolchain")
def test_the_cpu_kernel_loads_past_a_stale_torch_lock():
    from lcx.kernels.cpu import unavailable
    from lcx.kernels.cpu.relative_attention import isa

    assert unavailable() is None  # built (set-up builds it), so the next load only imports
    name = "lcx_relative_attention_cpu" + ("" if isa() == "portable" else f"_{isa().lower()}")
    lock = build_directory(name) / "lock"
    lock.touch()
    try:
        code = "from lcx.kernels.cpu import unavailable; assert unavailable() is None"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=240)
        assert not lock.exists()
    finally:
        lock.unlink(missing_ok=True)  # never leave the planted lock behind, whatever failed
