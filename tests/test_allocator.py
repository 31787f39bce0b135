"""lcx.allocator: with freed memory kept for reuse, a loop of large tensors stops faulting pages in
(glibc's default maps and unmaps each block, so every iteration faults all of its pages again);
LCX_MALLOC=system leaves the default; a bad value is a named error. Each case runs in its own
process: the setting is per process and lasts until it exits."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

LOOP = r'''
import json, resource, sys, torch
from lcx.allocator import reuse_freed_memory
state = reuse_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(30):
    before = faults()
    x = torch.ones(16 << 20)  # 64 MiB, and a second block of the same size
    y = x * 2
    del x, y
    counts.append(faults() - before)
print(json.dumps({"state": state, "faults": counts}))
'''
PAGES = (2 * (64 << 20)) // os.sysconf("SC_PAGE_SIZE")  # pages of the two blocks


def _loop(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", LOOP], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_reuse_stops_the_page_faults():
    reuse = _loop()
    assert reuse["state"]["allocator"] == "reuse", reuse
    assert sum(reuse["faults"][-10:]) < PAGES // 10, reuse  # once the heap has settled, the blocks are reused
    system = _loop(LCX_MALLOC="system")
    assert system["state"] == {"allocator": "system", "reason": "LCX_MALLOC=system"}
    assert min(system["faults"][-10:]) > PAGES // 2, system  # every iteration faults its blocks in again


def test_bad_value_is_named():
    out = subprocess.run([sys.executable, "-c", "from lcx.allocator import reuse_freed_memory; reuse_freed_memory()"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "LCX_MALLOC": "jemalloc"})
    assert out.returncode != 0 and "LCX_MALLOC must be 'reuse' or 'system', got 'jemalloc'" in out.stderr


@pytest.mark.slow  # a benchmark run on the bundled model: ~13 s (#76 item 7)
def test_bench_allocator_runs_as_documented(tmp_path):
    """`lcx bench allocator` from the installed entry point, on the bundled model (one run each)."""
    out = tmp_path / "a.json"
    run = subprocess.run(["lcx", "bench", "allocator", "--cases", "tiny-5m:256", "--repeats", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())["results"]["tiny-5m:256"]
    assert res["same_tokens"] is True
    assert [r["allocator"] for r in res["runs"]["system"]] == ["system"]
    assert [r["allocator"] for r in res["runs"]["reuse"]] == ["reuse"]
