"""The run record every `lcx bench` benchmark writes: one JSON shape, written atomically.

    {"description": ..., "config": {...}, "environment": {... "git": {"sha", "dirty"}}, "results": {...}}

Paths are relative to the working directory (run from the repository root to update the
committed `results/`; see results/README.md), never to the installed package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_record(out: str | Path, *, description: str, config: dict[str, Any], results: Any,
                 **extra: Any) -> Path:
    """Write the record (environment and git SHA added) to `out` atomically; prints the path."""
    from lcx.data.io import atomic_write_json, environment

    path = atomic_write_json(Path(out), {"description": description, "config": config,
                                         "environment": environment(), **extra, "results": results})
    print(f"wrote {path}")
    return path
