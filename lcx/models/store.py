"""The atomic cache store every lcx model cache shares (the GGUF cache, the unpacked xz
directories): entries under `cache_root()`, each a directory built in a temporary sibling and
renamed into place only once complete, with a manifest (`lcx_cache.json`: `format`, what the
entry was built from, and the size of every file) that says whether an entry is whole.

    build_entry(entry, fill)      # fill(tmp) writes the files and returns what the manifest records
    entry_valid(entry)            # manifest present, format current, every file at its size

A crash never leaves a half entry under the final name; an entry whose manifest or file sizes do
not match is rebuilt. Loaded models may memory-map an entry's safetensors file, so entries are
only ever replaced (rename), never modified in place. Temporary directories left by crashed
builds are removed after an hour.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# Bump when the layout or the post-processing of cached entries changes.
CACHE_FORMAT = 1
MANIFEST = "lcx_cache.json"
TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600.0


def cache_root() -> Path:
    """Root of lcx's caches: `$LCX_CACHE_DIR`, else `~/.cache/lcx`."""
    env = os.environ.get("LCX_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lcx"


def entry_valid(entry: Path) -> bool:
    """True when `entry` is a complete cache entry of an HF directory (its manifest, of the
    current format, lists config.json, and every file it lists has its size)."""
    try:
        man = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if man.get("format") != CACHE_FORMAT or "config.json" not in man.get("files", {}):
        return False
    for name, size in man["files"].items():
        f = entry / name
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


def build_entry(entry: Path, fill: Callable[[Path], dict[str, Any]]) -> None:
    """Build the cache entry `entry` atomically: `fill(tmp)` writes its files into a fresh
    temporary sibling directory and returns what the manifest records of the source; the
    manifest (`{"format", **that, "files": {name: size}}`) is written, then the directory is
    renamed into place (`install`)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(entry.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{entry.name}-", dir=entry.parent))
    try:
        source = fill(tmp)
        sizes = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file() and f.name != MANIFEST}
        (tmp / MANIFEST).write_text(json.dumps({"format": CACHE_FORMAT, **source, "files": sizes}, indent=1))
        install(tmp, entry)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def install(tmp: Path, entry: Path) -> None:
    """Make the finished `tmp` readable by all and rename it to `entry`, replacing an invalid
    old entry."""
    # mkdtemp (and safetensors) create owner-only modes; a cache is fine to share read-only.
    for f in tmp.iterdir():
        f.chmod(0o644)
    tmp.chmod(0o755)
    if entry.exists():
        if entry_valid(entry):  # another process finished first: keep theirs
            return
        trash = entry.with_name(f"{TMP_PREFIX}trash-{entry.name}-{os.getpid()}-{time.time_ns()}")
        entry.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        tmp.rename(entry)
    except OSError:
        if not entry_valid(entry):  # lost a race to a broken writer; nothing sensible left
            raise


def remove_stale_tmp(root: Path) -> None:
    """Delete temporary build directories left by crashed builds (older than an hour)."""
    now = time.time()
    for d in root.glob(f"{TMP_PREFIX}*"):
        try:
            if now - d.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass
