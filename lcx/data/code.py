"""Python code from the running interpreter's standard library, split by file for training and eval.

The code-edit benchmark (`lcx.studies.code_edit`) samples windows from stdlib files; a model
fine-tuned on stdlib code must never have seen the files it is evaluated on. The split is
therefore by *unit*, never by lines inside a file:

    unit  = the first component of the file's path under the stdlib root
            (`asyncio/events.py` -> `asyncio`, `argparse.py` -> `argparse`)
    u     = int(sha256(f"{SPLIT_ID}:{unit}")[:8], 16) / 2**32          in [0, 1)
    split = "eval" if u < 0.30, "val" if u < 0.40, else "train"

A whole package is one unit because its files share text: the 100-odd `encodings/*.py`
codecs repeat the same Unicode character-name tables, so a per-file split would leak eval
lines into training. The rule depends only on path names (not on file contents or the Python
version's file list), so it is deterministic and identical on every machine; a file added to a
new Python release lands in its package's split. Files: every `.py` under the stdlib root except
tests, site-packages, caches, IDLE's tests, lib2to3 and the generated `_sysconfigdata*`
(`CODE_SKIP_DIRS`), all lengths, sorted by path.

>>> split_of("encodings"), split_of("asyncio")    # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from .corpus import Document

SPLIT_ID = "stdlib-code-v1"
CODE_SPLITS = ("train", "val", "eval")
EVAL_FRACTION = 0.30
VAL_FRACTION = 0.10
CODE_SKIP_DIRS = frozenset({"test", "tests", "site-packages", "__pycache__", "idle_test", "lib2to3"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_py_files() -> list[Path]:
    """Every stdlib `.py` file outside `CODE_SKIP_DIRS` (and not `_sysconfigdata*`), sorted."""
    root = stdlib_root()
    return [p for p in sorted(root.rglob("*.py"))
            if not (CODE_SKIP_DIRS & set(p.relative_to(root).parts[:-1]) or p.name.startswith("_sysconfigdata"))]


def code_unit(rel: str | Path) -> str:
    """The split unit of a path relative to the stdlib root: its package, or its module name."""
    parts = Path(rel).parts
    return parts[0] if len(parts) > 1 else Path(parts[0]).stem


def split_of(unit: str) -> str:
    """`"train"`, `"val"` or `"eval"` for a unit (see the module docstring)."""
    u = int(hashlib.sha256(f"{SPLIT_ID}:{unit}".encode()).hexdigest()[:8], 16) / 2**32
    return "eval" if u < EVAL_FRACTION else "val" if u < EVAL_FRACTION + VAL_FRACTION else "train"


def code_split(files: list[Path] | None = None) -> dict[str, list[Path]]:
    """`{"train": [...], "val": [...], "eval": [...]}`: `files` (default `stdlib_py_files()`) by split."""
    root = stdlib_root()
    out: dict[str, list[Path]] = {s: [] for s in CODE_SPLITS}
    for p in stdlib_py_files() if files is None else files:
        out[split_of(code_unit(p.relative_to(root)))].append(p)
    return out


def split_record(files: dict[str, list[Path]] | None = None) -> dict:
    """A JSON-able description of the split: the rule, and each split's units and files
    (relative paths) with a sha256 over the sorted file list (to compare two runs' splits)."""
    root = stdlib_root()
    files = code_split() if files is None else files
    rec: dict = {"split_id": SPLIT_ID, "stdlib_root": str(root),
                 "rule": f"unit = first path component under the stdlib root; u = int(sha256('{SPLIT_ID}:' + "
                         f"unit)[:8], 16) / 2**32; eval if u < {EVAL_FRACTION}, val if u < "
                         f"{EVAL_FRACTION + VAL_FRACTION}, else train",
                 "skip_dirs": sorted(CODE_SKIP_DIRS)}
    for s in CODE_SPLITS:
        rels = sorted(str(p.relative_to(root)) for p in files[s])
        rec[s] = {"n_files": len(rels), "units": sorted({code_unit(r) for r in rels}),
                  "files_sha256": hashlib.sha256("\n".join(rels).encode()).hexdigest(), "files": rels}
    return rec


def load_code_corpus(split: str = "train") -> list[Document]:
    """Stdlib files of a split as `Document`s (name: path under the stdlib root, work: its unit),
    sorted by name; files that are not UTF-8 are skipped."""
    if split not in CODE_SPLITS:
        raise ValueError(f"unknown code split {split!r}; choose one of {CODE_SPLITS}")
    root = stdlib_root()
    docs = []
    for p in code_split()[split]:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = str(p.relative_to(root))
        docs.append(Document(rel, text, code_unit(rel), "python-stdlib"))
    return docs


__all__ = ["CODE_SPLITS", "CODE_SKIP_DIRS", "SPLIT_ID", "code_split", "code_unit", "load_code_corpus",
           "split_of", "split_record", "stdlib_py_files", "stdlib_root"]
