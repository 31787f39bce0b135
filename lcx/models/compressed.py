"""Compressed HF directories. An HF directory may store its weights as `model.safetensors.xz`
(any file `X.xz` stands for `X`; standard xz, `xz -d` opens it). The bundled models do: the
repository travels whole to a GPU machine, whose calls carry 64 MiB (docs/contributing.md, "What
may travel to a GPU"), and xz with a 2-byte literal alignment stores bfloat16/float16 weights in
~70/85% of their bytes, losslessly. Such a directory is unpacked once, through the cache store
(`lcx.models.store`), into

    $LCX_CACHE_DIR/unpacked/<dir name>-<key>/

where `key` hashes the names and bytes of the directory's files (so a checkout anywhere, or an
installed wheel, finds the same entry, and any edit gets a new one). `lcx.models.resolve_source`
returns that entry, so everything downstream (transformers, lm-eval, vLLM, the report's model
fingerprint) sees a plain HF directory with the original bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

from .store import CACHE_FORMAT, build_entry, cache_root, entry_valid

log = logging.getLogger(__name__)

COMPRESSED_SUFFIX = ".xz"
# xz settings for weights: LZMA2 at preset 9 with 2-byte literal position/alignment (lp=1, pb=1),
# which models 16-bit floats' sign/exponent byte apart from their mantissa byte (bfloat16
# weights: 6.7 MB instead of 7.1 MB with the default settings for a 10 MB file).
# (lzma is imported where used: a Python built without it still loads plain directories.)
XZ_LZMA2_OPTIONS = {"preset": 9, "lc": 3, "lp": 1, "pb": 1}


def is_compressed(path: str | os.PathLike) -> bool:
    """True when the HF directory `path` stores a file only xz-compressed (`model.safetensors.xz`
    without `model.safetensors`; a plain file, e.g. freshly trained weights, wins over its .xz)."""
    return any(f.suffix == COMPRESSED_SUFFIX and f.is_file() and not f.with_suffix("").exists()
               for f in Path(path).iterdir())


def unpacked_dir(path: str | os.PathLike) -> Path:
    """The plain HF directory for `path`: `path` itself when none of its files is compressed,
    else its cache entry with every `X.xz` decompressed to `X` (built once, atomically)."""
    path = Path(path)
    if not is_compressed(path):
        return path
    files = sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
    h = hashlib.sha256(f"lcx-unpacked|{CACHE_FORMAT}".encode())
    for f in files:
        h.update(b"\0" + f.name.encode() + b"\0")
        h.update(f.read_bytes())
    key = h.hexdigest()
    entry = cache_root() / "unpacked" / f"{path.name}-{key[:16]}"
    if not entry_valid(entry):
        _build_unpacked(files, key, entry)
    return entry


def compress_file(path: str | os.PathLike) -> Path:
    """Replace `path` by `path.xz` (lcx's xz settings for weights), atomically; returns the new path."""
    import lzma

    from lcx.data.io import atomic_write

    path = Path(path)
    filters = [{"id": lzma.FILTER_LZMA2, **XZ_LZMA2_OPTIONS}]
    data = lzma.compress(path.read_bytes(), format=lzma.FORMAT_XZ, filters=filters)
    out = atomic_write(path.with_name(path.name + COMPRESSED_SUFFIX), lambda tmp: Path(tmp).write_bytes(data))
    path.unlink()
    return out


def _build_unpacked(files: list[Path], key: str, entry: Path) -> None:
    import lzma

    t0 = time.perf_counter()

    def fill(tmp: Path) -> dict[str, str]:
        for f in files:
            if f.suffix == COMPRESSED_SUFFIX and f.with_suffix("").exists():
                continue  # the plain file wins (is_compressed)
            if f.suffix == COMPRESSED_SUFFIX:
                (tmp / f.stem).write_bytes(lzma.decompress(f.read_bytes()))
            else:
                shutil.copyfile(f, tmp / f.name)
        # No paths or times in the manifest: the entry's bytes depend on the source's bytes only
        # (the report fingerprints a model by the files of the directory it loads).
        return {"source_sha256": key}

    build_entry(entry, fill)
    log.info("unpacked %s into %s in %.1f s", files[0].parent, entry, time.perf_counter() - t0)
