"""scripts/gpu_session.sh, dry-run here (no CUDA): each stage reports the right PASS/FAIL/SKIP
line and reason, at most 8 files come back, and a second call resumes what the first did.

The first GPU session has one call of a few minutes; this is how the script is tested before it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"
STAGES = ("build", "pytest_gpu", "kernels", "tune", "profile", "scale", "report")
MAX_FILES = 8  # what a device call brings back


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


def _run(tmp_path: Path, name: str, **env: str) -> tuple[int, dict[str, str], Path]:
    out = tmp_path / name
    full = dict(os.environ, OUT=str(out), GPU_SESSION_STATE=str(tmp_path / "state"), **env)
    p = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=900)
    lines = (out / "summary.txt").read_text().splitlines()
    stages = {}
    for line in lines:
        m = re.match(r"(PASS|FAIL|SKIP) (\w+): (.*)", line)
        if m:
            stages[m.group(2)] = f"{m.group(1)} {m.group(3)}"
    assert re.fullmatch(rf"total \d+s, status {p.returncode}", lines[-1]), (lines[-1], p.returncode)
    files = [f for f in out.rglob("*") if f.is_file()]
    assert len(files) <= MAX_FILES, files
    assert {"summary.txt", "env.txt", "logs.tar"} <= {f.name for f in files}
    return p.returncode, stages, out


@pytest.mark.slow
@pytest.mark.skipif("not _no_cuda()", reason="a GPU is here: the script would run for real")
def test_without_cuda_every_gpu_stage_is_skipped_with_its_reason_and_imports_pass(tmp_path):
    rc, stages, out = _run(tmp_path, "plain")
    assert rc == 0
    assert stages["env"].startswith("PASS python ") and "gpu=none" in stages["env"]
    # what the GPU stages import works without lm-eval, fastapi, uvicorn, gguf and a network
    assert stages["imports"].startswith("PASS ") and "lm_eval, fastapi, uvicorn, gguf blocked and no network" \
        in stages["imports"], stages["imports"]
    for s in STAGES:
        assert stages[s] == "SKIP no CUDA device", (s, stages[s])
    assert [f.name for f in out.iterdir()] and not (out / "scale-cpu.json").exists()


@pytest.mark.slow
@pytest.mark.skipif("not _no_cuda()", reason="a GPU is here: the script would run for real")
def test_dry_run_passes_fails_and_resumes(tmp_path):
    """LCX_GPU_DRY_RUN=1: the kernel and scale stages run as CPU smoke runs. A scale run that
    fails says FAIL with its exit status; the next call runs it again (the kernels, done, are
    skipped as such, their JSON still returned); a third call skips both."""
    rc, stages, out = _run(tmp_path, "first", LCX_GPU_DRY_RUN="1", SCALE_ARGS="--cases no-such-case")
    assert rc == 1
    assert stages["kernels"].startswith("PASS regressions or missing: 0"), stages["kernels"]
    assert stages["tune"].startswith("PASS best {'block_m'"), stages["tune"]
    assert json.loads((out / "tune-cpu.json").read_text())["smoke"] is True
    assert stages["profile"].startswith("PASS decode steps profiled: "), stages["profile"]
    with tarfile.open(out / "logs.tar") as tar:
        prof = [n for n in tar.getnames() if n.startswith("./profile/decode_")]
        assert prof, tar.getnames()
        assert "by self CPU time" in tar.extractfile(prof[0]).read().decode()
    assert re.match(r"FAIL rc=\d+; .*see logs\.tar:scale\.log", stages["scale"]), stages["scale"]
    assert stages["report"] == "SKIP no CUDA device" and stages["build"] == "SKIP no CUDA device"
    assert (out / "kernels-cpu.json").is_file() and not (out / "scale-cpu.json").exists()

    rc, stages, out = _run(tmp_path, "second", LCX_GPU_DRY_RUN="1")
    assert rc == 0
    assert stages["kernels"] == "SKIP done in an earlier call"
    assert stages["profile"] == "SKIP done in an earlier call" and stages["tune"] == "SKIP done in an earlier call"
    assert stages["scale"].startswith("PASS wrote"), stages["scale"]
    assert (out / "kernels-cpu.json").is_file() and (out / "scale-cpu.json").is_file()

    rc, stages, _ = _run(tmp_path, "third", LCX_GPU_DRY_RUN="1")
    assert rc == 0 and stages["scale"] == "SKIP done in an earlier call"


def test_failures_log_names_each_failure_as_it_happens(tmp_path):
    """LCX_FAILURES_LOG (tests/conftest.py; the GPU session's pytest stage): every failure is
    appended with its id, phase and traceback tail when it happens, passes are not."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_x.py").write_text("def test_ok():\n    pass\n\n\ndef test_bad():\n"
                                        "    assert 1 == 2, 'the message'\n")
    log = tmp_path / "failures.log"
    env = dict(os.environ, LCX_FAILURES_LOG=str(log))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout[-2000:]
    text = log.read_text()
    assert text.startswith("FAILED ") and "test_x.py::test_bad (call)" in text and "the message" in text
    assert "test_ok" not in text
