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
    # with sources: keyed by their content and the flags, so checkouts of other kernel source
    # sharing the root never rebuild over each other
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int f() { return 1; }")
    b.write_text("int f() { return 2; }")
    da = build_directory("lcx_x", [str(a)], extra_cflags=["-O3"])
    assert da.parent == tmp_path and da.name.startswith("lcx_x-") and da.is_dir()
    assert build_directory("lcx_x", [str(b)], extra_cflags=["-O3"]) != da
    assert build_directory("lcx_x", [str(a)], extra_cflags=["-O2"]) != da
    b.write_text(a.read_text())
    assert build_directory("lcx_x", [str(b)], extra_cflags=["-O3"]) == da  # the content, not the path


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None, reason="no C++ toolchain")
def test_the_cpu_kernel_loads_past_a_stale_torch_lock():
    from lcx.kernels.cpu import unavailable
    from lcx.kernels.cpu.relative_attention import build_args, isa

    assert unavailable() is None  # built (set-up builds it), so the next load only imports
    args = build_args(isa())
    lock = build_directory(args.pop("name"), args.pop("sources"), **args) / "lock"
    assert lock.parent.is_dir() and any(lock.parent.glob("*.so"))  # the build the loader used
    lock.touch()
    try:
        code = "from lcx.kernels.cpu import unavailable; assert unavailable() is None"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=240)
        assert not lock.exists()
    finally:
        lock.unlink(missing_ok=True)  # never leave the planted lock behind, whatever failed
