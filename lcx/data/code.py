"""Python code from the running interpreter's standard library, split by file for training and eval.

The code-edit benchmark (`studies.code_edit`) samples windows from stdlib files; a model
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

import functools
import hashlib
import re
import sysconfig
from dataclasses import dataclass
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


# ------------------------------------------------------------- third-party code (site-packages)
# More *kinds* of code than the stdlib's train packages hold: Python files of the installed
# third-party packages, filtered and decontaminated against the stdlib's val and eval packages
# (`site_code`). The selection depends on what is installed, so it is recorded (`SiteCode.record`).
SITE_CODE_ID = "site-code-v1"
SITE_SKIP_DIRS = CODE_SKIP_DIRS | frozenset({"_vendor", "vendor", "_vendored", "vendored", "externals"})
# Top-level distributions that are copies or backports of standard-library modules: excluded by
# name as well as by the content rule below.
STDLIB_BACKPORTS = frozenset({"multiprocess", "backports", "typing_extensions", "importlib_metadata",
                              "importlib_resources", "zipp", "tomli", "exceptiongroup", "dataclasses",
                              "enum", "six", "mock", "_distutils_hack", "distutils", "pathlib2", "futures"})
SITE_MIN_LINE = 30           # a "long" line, stripped: only these count for contamination
SITE_MAX_SHARED_LINES = 2    # a file sharing more long lines with the stdlib val/eval packages is dropped
SITE_MAX_SHARED_FRACTION = 0.02  # ... or a larger fraction of its long lines
SITE_UNIT_BYTES = 200_000    # at most this much text per top-level package (diversity)
SITE_FILE_BYTES = (1_000, 100_000)  # file size range
SITE_MAX_MEAN_LINE, SITE_MAX_LINE, SITE_MIN_ALNUM = 100, 1_000, 0.25  # The Stack / Codex-style filters
_GENERATED = re.compile(r"generated by|auto-?generated|do not edit", re.I)


def site_packages_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _long_lines(text: str) -> list[str]:
    return [s for s in (ln.strip() for ln in text.splitlines()) if len(s) >= SITE_MIN_LINE]


def _quality_reason(text: str) -> str | None:
    """Why a file is not kept as training code (None: kept)."""
    n = len(text.encode("utf-8"))
    if not SITE_FILE_BYTES[0] <= n <= SITE_FILE_BYTES[1]:
        return "size"
    lines = text.splitlines()
    if max(map(len, lines)) > SITE_MAX_LINE or n / max(len(lines), 1) > SITE_MAX_MEAN_LINE:
        return "line_length"
    if sum(c.isalnum() for c in text) / max(len(text), 1) < SITE_MIN_ALNUM:
        return "alnum"
    if _GENERATED.search("\n".join(lines[:5])):
        return "generated"
    return None


@dataclass
class SiteCode:
    documents: list[Document]
    record: dict  # the rule, counts per reason, units, and (files) every kept file's path


def site_code(root: Path | None = None, reference: list[Path] | None = None) -> SiteCode:
    """Third-party Python files under `root` (default: site-packages) kept as training code.

    A file is kept when it is UTF-8, outside `SITE_SKIP_DIRS`, not in a `STDLIB_BACKPORTS`
    distribution, passes the size / line-length / alphanumeric / generated-file filters, is not
    an exact duplicate of a kept file, and shares at most `SITE_MAX_SHARED_LINES` long lines
    (and at most `SITE_MAX_SHARED_FRACTION` of them) with the `reference` files (default: the
    stdlib's val and eval packages, so neither the held-out loss nor the code-edit benchmark
    sees text the model trained on). Per top-level package, files are taken in
    sha256(SITE_CODE_ID:path) order until `SITE_UNIT_BYTES`. Deterministic for one environment.
    """
    root = site_packages_root() if root is None else Path(root)
    if reference is None:
        split = code_split()
        reference = split["val"] + split["eval"]
    ref: set[str] = set()
    for p in reference:
        try:
            ref.update(_long_lines(p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    key = lambda rel: hashlib.sha256(f"{SITE_CODE_ID}:{rel}".encode()).hexdigest()
    by_unit: dict[str, list[str]] = {}
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if SITE_SKIP_DIRS & set(rel.parts[:-1]) or len(rel.parts) < 2 and rel.name.startswith("_"):
            continue
        by_unit.setdefault(code_unit(rel), []).append(str(rel))
    dropped: dict[str, int] = {}
    seen: set[str] = set()
    docs: list[Document] = []
    unit_bytes: dict[str, int] = {}
    for unit in sorted(by_unit):
        if unit in STDLIB_BACKPORTS or unit.endswith((".dist-info", ".egg-info")):
            dropped["backport"] = dropped.get("backport", 0) + len(by_unit[unit])
            continue
        used = 0
        for rel in sorted(by_unit[unit], key=key):
            try:
                text = (root / rel).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                reason = "unreadable"
            else:
                reason = _quality_reason(text)
                if reason is None:
                    digest = hashlib.sha256(text.encode()).hexdigest()
                    long = _long_lines(text)
                    shared = sum(s in ref for s in long)
                    if digest in seen:
                        reason = "duplicate"
                    elif shared > SITE_MAX_SHARED_LINES or shared > SITE_MAX_SHARED_FRACTION * len(long):
                        reason = "shares_reference_lines"
                    elif used + len(text) > SITE_UNIT_BYTES:
                        reason = "package_budget"
            if reason is not None:
                dropped[reason] = dropped.get(reason, 0) + 1
                continue
            seen.add(digest)
            used += len(text)
            docs.append(Document(rel, text, unit, "python-site-packages"))
        if used:
            unit_bytes[unit] = used
    docs.sort(key=lambda d: d.name)
    rels = [d.name for d in docs]
    record = {"site_code_id": SITE_CODE_ID, "root": str(root),
              "rule": {"skip_dirs": sorted(SITE_SKIP_DIRS), "backports": sorted(STDLIB_BACKPORTS),
                       "file_bytes": list(SITE_FILE_BYTES), "max_mean_line": SITE_MAX_MEAN_LINE,
                       "max_line": SITE_MAX_LINE, "min_alnum_fraction": SITE_MIN_ALNUM,
                       "generated_regex": _GENERATED.pattern, "unit_bytes": SITE_UNIT_BYTES,
                       "decontamination": f"drop a file sharing > {SITE_MAX_SHARED_LINES} stripped lines of "
                                          f">= {SITE_MIN_LINE} chars (or > {SITE_MAX_SHARED_FRACTION:.0%} of its "
                                          f"such lines) with the reference files",
                       "reference_long_lines": len(ref)},
              "n_files": len(docs), "n_bytes": sum(unit_bytes.values()), "n_units": len(unit_bytes),
              "dropped": dict(sorted(dropped.items())),
              "files_sha256": hashlib.sha256("\n".join(rels).encode()).hexdigest(), "files": rels}
    return SiteCode(docs, record)


@functools.lru_cache(maxsize=1)
def default_site_code() -> SiteCode:
    """`site_code()` of this environment, computed once per process (a trainer needs both its
    documents and its record; the scan reads ~400 MB of files)."""
    return site_code()


__all__ = ["CODE_SPLITS", "CODE_SKIP_DIRS", "SITE_CODE_ID", "SPLIT_ID", "STDLIB_BACKPORTS", "SiteCode",
           "code_split", "code_unit", "default_site_code", "load_code_corpus", "site_code", "site_packages_root", "split_of",
           "split_record", "stdlib_py_files", "stdlib_root"]
