"""`torch.utils.cpp_extension.load` behind a lock that dies with its holder.

torch serialises builds of one extension with a `lock` file in the build directory
(`FileBaton`): a process killed while building (Ctrl-C during set-up, a CI job's timeout, an
out-of-memory kill) leaves that file behind, and every later `load` of the same extension waits
for it forever, silently. lcx's loaders take an `fcntl.flock` on a file next to the build
directory first: the kernel releases it when its holder exits, however it exits, so whoever
holds it is the only lcx process building that extension, and a torch `lock` file found then is
stale and removed (logged). Where `fcntl` is missing (Windows) torch's own baton is all there is.

Each build lives in a directory named by the extension and a hash of its sources and flags
(`build_directory`): torch keys its directory by name alone and rebuilds in place whenever the
source differs from the last build there, so two checkouts of different kernel source sharing
one extensions root (a worktree running a sweep beside the main checkout, an older install)
would rebuild over each other on every load; keyed by content, each keeps its own build.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def build_directory(name: str, sources: list[str] | tuple[str, ...] = (), **flags) -> Path:
    """Where torch builds and caches the extension `name` (its own rule: $TORCH_EXTENSIONS_DIR
    or torch's default root with a py/accelerator folder, then the name), created; with `sources`,
    the name suffixed by a hash of their bytes and of `flags` (module docstring)."""
    from torch.utils.cpp_extension import _get_build_directory

    if sources:
        h = hashlib.sha256(json.dumps(flags, sort_keys=True, default=str).encode())
        for src in sources:
            h.update(Path(src).read_bytes())
        name = f"{name}-{h.hexdigest()[:10]}"
    return Path(_get_build_directory(name, verbose=False))


@contextlib.contextmanager
def exclusive_build(directory: Path):
    """Hold an exclusive lock on `<directory>.lcx-lock` for a build in `directory`; inside it,
    torch's `lock` file there (a killed build's leftover, since no lcx process can be building
    beside the holder) is removed."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with open(f"{directory}.lcx-lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("lcx: removing %s, left by an interrupted build of this extension", stale)
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load(name: str, sources: list[str], **kwargs):
    """`torch.utils.cpp_extension.load(name, sources, **kwargs)` under `exclusive_build`."""
    from torch.utils.cpp_extension import load as torch_load

    flags = {k: v for k, v in kwargs.items() if k not in ("verbose", "build_directory")}
    directory = Path(kwargs.pop("build_directory", None) or build_directory(name, sources, **flags))
    with exclusive_build(directory):
        return torch_load(name=name, sources=sources, build_directory=str(directory), **kwargs)
