"""The run record every `lcx bench` benchmark writes: one JSON shape, written atomically.

    {"description": ..., "config": {...}, "environment": {... "git": {"sha", "dirty"}},
     <extra keys: summary, timings, notes ...>, "results": {...}}

Paths are relative to the working directory (run from the repository root to update the
committed `results/`; see results/README.md), never to the installed package. A benchmark that
saves after every case (so a run cut off keeps what it measured) calls this each time with
`quiet=True` and once more at the end; `benchmarks.harness.Run.save` does both for the ported
benchmarks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def build_record(*, description: str, config: dict[str, Any], results: Any,
                 environment: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The record's keys in their order: description, config, environment, `extra`, results."""
    return {"description": description, "config": config, "environment": environment, **extra, "results": results}


def write_record(out: str | Path, *, description: str, config: dict[str, Any], results: Any,
                 environment: dict[str, Any] | None = None, quiet: bool = False, **extra: Any) -> Path:
    """Write the record to `out` atomically and return its path (printed unless `quiet`).

    The environment is `lcx.data.io.environment()` (versions, machine, git SHA), updated with
    `environment` (facts only the benchmark knows: device, load average); `extra` keys go
    between it and `results`.
    """
    from lcx.data.io import atomic_write_json
    from lcx.data.io import environment as lcx_environment

    env = {**lcx_environment(), **(environment or {})}
    path = atomic_write_json(Path(out), build_record(description=description, config=config, results=results,
                                                     environment=env, **extra))
    if not quiet:
        print(f"wrote {path}")
    return path
