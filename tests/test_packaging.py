"""Packaging: kernels/, eval_tasks/, serve/ ship as lcx.*; `import lcx` needs only core deps."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"lcx.kernels": "kernels", "lcx.eval_tasks": "eval_tasks", "lcx.serve": "serve"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _source_packages() -> set[str]:
    """Every folder with an __init__.py under lcx/, the mapped folders and the experiments
    (benchmarks/, studies/), as dotted names."""
    from lcx.cli import EXPERIMENTS

    found = set()
    roots = {"lcx": ROOT / "lcx", **{k: ROOT / v for k, v in MAPPED.items()}, **{e: ROOT / e for e in EXPERIMENTS}}
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_every_package_is_listed_in_pyproject():
    """Every package under lcx/ ships; the experiments (`lcx.cli.EXPERIMENTS`: top-level
    benchmarks/ and studies/) do not, and none of them lives inside lcx/."""
    from lcx.cli import EXPERIMENTS

    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    source_only = {p for p in _source_packages() if p.split(".")[0] in EXPERIMENTS}
    assert source_only >= {"benchmarks", "studies", "studies.modadd"}
    missing = _source_packages() - listed - source_only
    assert not missing, f"add to [tool.setuptools].packages in pyproject.toml: {sorted(missing)}"
    assert not listed & source_only, f"source-only packages listed for the wheel: {sorted(listed & source_only)}"
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == {"lcx": "lcx", **MAPPED}


def test_import_lcx_pulls_no_optional_or_heavy_package():
    code = (
        "import sys, lcx, lcx.rope, lcx.kernels, lcx.eval_tasks, lcx.serve\n"
        "bad = [m for m in ('triton', 'vllm', 'lm_eval', 'flash_attn', 'transformers') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "", f"import lcx imported {out.stdout.strip()}"


@pytest.mark.slow
def test_wheel_contains_mapped_packages_and_no_generic_top_level(tmp_path):
    """A regular (non-editable) install ships lcx/kernels etc. and no top-level `kernels`."""
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, env=env, capture_output=True)
    (wheel,) = tmp_path.glob("lcx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in MAPPED:
        assert f"{pkg.replace('.', '/')}/__init__.py" in names
    # the experiments stay in the source checkout (lcx.cli.EXPERIMENTS)
    assert not [n for n in names if n.startswith(("benchmarks/", "studies/", "lcx/bench/", "lcx/studies/"))]
    tops = {n.split("/")[0] for n in names}
    # The only top-level file besides lcx/ is the lm-eval start-up hook (a .pth must sit in
    # site-packages itself; it imports lcx._lmeval_hook lazily, see eval_tasks/README.md).
    dist_info = f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"
    assert tops <= {"lcx", dist_info, "lcx-lmeval-hook.pth"}, tops
    top_level = [n for n in names if n.endswith("top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["lcx"]


# The GPU machines receive the whole working tree with each call, 64 MiB at most together with
# what a call carries (scripts/gpu_session.sh; docs/contributing.md, "Layout"). The tracked tree keeps to half
# of it, so a call can also carry lm-eval's wheels (~18 MB) or a model: the bundled models are
# stored compressed (lcx.models.loading), large per-sample records gzipped, plots as palette PNGs.
DEVICE_PAYLOAD_BUDGET = 32 * 2**20
# ... and keeps 12 MiB of that free (#74: the tracked tree at most 20 MiB): tiny-swat-5m (#45),
# tiny-5m (#74) and the modadd decoder keep their weights' provenance in the tree, not the weights
# (`lcx train build`, weights.json); sweeps' journals live in a cache, not the tree.
HEADROOM = 12 * 2**20


def test_tracked_tree_fits_the_gpu_machines_payload():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / os.fsdecode(p) for p in listed.split(b"\0") if p]
    # lstat: a tracked symlink (tiny-swat-5m's tokenizer.json -> tiny-llama-5m's) travels as a link
    sizes = {f: f.lstat().st_size for f in files if f.is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    limit = DEVICE_PAYLOAD_BUDGET - HEADROOM
    assert total <= limit, (
        f"tracked files take {total / 2**20:.2f} MiB, over the {limit / 2**20:.0f} MiB that leave "
        f"{HEADROOM / 2**20:.0f} MiB free of the {DEVICE_PAYLOAD_BUDGET / 2**20:.0f} MiB a GPU call can carry; "
        f"largest: {[f'{f.relative_to(ROOT)} {sizes[f] / 2**20:.1f} MiB' for f in largest]}")


# results/README.md, "Budget": what results/ may take of the tracked tree (with the library, tests,
# docs and the bundled tiny-ret-5m's 8.8 MiB, at most 20 MiB: the 12 MiB of headroom above).
RESULTS_BUDGET = 6 * 2**20


def test_results_keep_to_their_budget():
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "results"], cwd=ROOT, capture_output=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / os.fsdecode(p) for p in listed.split(b"\0") if p]
    total = sum(f.lstat().st_size for f in files if f.is_file())
    assert total <= RESULTS_BUDGET, (
        f"results/ takes {total / 2**20:.2f} MiB of the tracked tree, over its "
        f"{RESULTS_BUDGET / 2**20:.1f} MiB budget (results/README.md): gzip per-sample records, or replace older results")


def test_experiment_command_from_a_wheel_names_the_problem(monkeypatch, capsys):
    """`lcx bench ...` with no source checkout beside lcx (an installed wheel): exit 2 and one
    line saying where the command lives, not a traceback."""
    from lcx import cli

    for name in cli.EXPERIMENTS:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(cli, "checkout_root", lambda: None)
    assert cli.main(["bench", "decode", "--help"]) == 2
    err = capsys.readouterr().err
    assert "lcx: error: benchmarks.decode is not installed" in err and "source checkout" in err
    assert cli.main(["models"]) == 0  # other commands are unaffected


def test_experiment_commands_load_from_the_checkout_beside_lcx(tmp_path):
    """In a checkout, `lcx bench <name> --help` and `lcx train modadd --help` load benchmarks/ and
    studies/ from the folder lcx/ sits in, from any working directory and with no PYTHONPATH (as
    the `lcx` console script runs)."""
    from lcx.cli import checkout_root

    assert checkout_root() == ROOT
    # the checkout root off sys.path: only lcx.cli can find benchmarks/ and studies/
    code = ("import importlib.util, sys; sys.path[:] = [p for p in sys.path if p not in ('', %r)]\n"
            "assert importlib.util.find_spec('benchmarks') is None\n"
            "import lcx; assert lcx.__file__.startswith(%r), lcx.__file__\n"
            "from lcx.cli import main; sys.exit(main(sys.argv[1:]))" % (str(ROOT), str(ROOT)))
    for argv in (["bench", "threads", "--help"], ["train", "modadd", "--help"]):
        out = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert "usage: lcx" in out.stdout
