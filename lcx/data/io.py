"""Atomic file writes and the environment record every result file carries.

A reader (another process, a crashed run being resumed) must never see half a file, so each
write goes to a temporary file in the same directory, is flushed to disk, and is moved over the
target with `os.replace` (atomic on POSIX when both are on one filesystem).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call `write(tmp_path)` and move the result to `path` atomically. Returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_files(out: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call `write(tmp_dir)` (e.g. `save_pretrained`), then move every file it wrote into the
    directory `out`, each atomically and with normal permissions. Returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".save-") as tmp:
        write(tmp)
        for name in sorted(os.listdir(tmp)):
            os.chmod(os.path.join(tmp, name), 0o666 & ~_umask())
            os.replace(os.path.join(tmp, name), out / name)
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return atomic_write(path, write)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, rows: tuple[str, ...] = ()) -> Path:
    """`obj` as indented JSON, atomically; gzipped when `path` ends in `.gz` (`read_json` reads
    both). `rows`: top-level keys holding lists (per-sample records) written last, one compact
    item per line: the file stays readable and ~1/3 smaller."""
    if str(path).endswith(".gz"):
        text = _json_text(obj, rows)
        return atomic_write(path, lambda tmp: _write_gzip(tmp, text.encode("utf-8")))
    return atomic_write_text(path, _json_text(obj, rows))


def _write_gzip(tmp: str, data: bytes) -> None:
    import gzip

    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        f.write(data)  # mtime 0: the same record gives the same bytes


def json_path(path: str | os.PathLike) -> Path:
    """`path` itself, or its gzipped sibling `path.gz` when only that exists: the large
    per-sample records under results/ are stored gzipped (the repository must fit a GPU call's
    payload, docs/contributing.md), and every command that names `X.json` finds `X.json.gz`."""
    path = Path(path)
    gz = path.with_name(path.name + ".gz")
    return gz if not path.exists() and gz.exists() else path


def read_json(path: str | os.PathLike) -> Any:
    """A JSON file written by `atomic_write_json`, plain or gzipped (`json_path`'s rule)."""
    path = json_path(path)
    if path.name.endswith(".gz"):
        import gzip

        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text(encoding="utf-8"))


def with_suffix(path: str | os.PathLike, suffix: str) -> Path:
    """`Path.with_suffix` that replaces `.json.gz` as one suffix: `x.json.gz` -> `x.png`."""
    path = Path(path)
    return (path.with_suffix("") if path.suffix == ".gz" else path).with_suffix(suffix)


def _json_text(obj: Any, rows: tuple[str, ...]) -> str:
    if not rows or not isinstance(obj, dict):
        return json.dumps(obj, indent=2, sort_keys=False) + "\n"
    head = {k: v for k, v in obj.items() if k not in rows}
    parts = [json.dumps(head, indent=2)[:-2]] if head else ["{"]
    for i, k in enumerate(r for r in rows if r in obj):
        items = ",\n".join("    " + json.dumps(x, separators=(",", ":")) for x in obj[k])
        sep = "," if head or i else ""
        parts.append(f'{sep}\n  {json.dumps(k)}: [' + (f"\n{items}\n  ]" if items else "]"))
    return "".join(parts) + "\n}\n"


def atomic_savefig(fig, path: str | os.PathLike, **kwargs) -> Path:
    """`fig.savefig` through a temporary file (format taken from `path`'s suffix). A PNG is
    stored as a 256-colour palette image (`quantize_png`): a third of the bytes, the same plot."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    if fmt != "png" or kwargs.get("transparent"):
        return atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, **kwargs))

    def write(tmp: str) -> None:
        fig.savefig(tmp, format=fmt, **kwargs)
        quantize_png(tmp)

    return atomic_write(path, write)


def quantize_png(path: str | os.PathLike) -> None:
    """Rewrite an opaque PNG in place as a 256-colour palette PNG (median cut), which is how
    the plots under results/ are stored: matplotlib's lines, text and antialiasing need far fewer
    colours, and the repository travels whole to GPU machines (a 64 MiB payload, docs/contributing.md)."""
    from PIL import Image

    with Image.open(path) as im:
        im.load()
    if im.mode == "P" or (im.mode == "RGBA" and im.getextrema()[3][0] < 255):
        return  # already a palette, or truly transparent: left as it is
    im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(path, format="PNG", optimize=True)


def git_info(repo: str | os.PathLike | None = None) -> dict[str, Any]:
    """`{"sha": ..., "dirty": bool}` of the lcx checkout, or sha None outside a git checkout."""
    repo = Path(repo) if repo else Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10, check=True).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": dirty}


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded next to every result."""
    import tokenizers
    import torch
    import transformers

    from lcx.allocator import allocator_state

    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a str subclass torch.load(weights_only) refuses
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "allocator": allocator_state()["allocator"],  # lcx.allocator: freed memory kept for reuse or not
        "git": git_info(),
    }


__all__ = ["atomic_savefig", "atomic_write", "atomic_write_json", "atomic_write_text", "environment", "git_info",
           "json_path", "quantize_png", "read_json", "with_suffix"]
