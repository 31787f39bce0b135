"""The README and docs/: the README stays a few screens long and opens with the three commands
that .ci/run and the project's rules rely on; every relative link in README.md and docs/*.md
points to a file (and, into a Markdown file, to a heading) that exists."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 200
# The README's first code block, commands only (comments after `#` dropped).
FIRST_COMMANDS = ["bash scripts/setup.sh", "python -m pytest -q", "lcx report"]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    lines, fence = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path.read_text()):
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[str]:
    return [t for line in _prose(path.read_text()) for t in LINK.findall(line)
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, mailto:, ... are not checked here


def test_readme_is_a_few_screens():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_readme_opens_with_the_three_commands():
    text = README.read_text()
    lines = text.split("\n")
    assert lines[0].startswith("# ") and lines[1] == "" and lines[2] == "```bash", lines[:3]
    block = lines[3:lines.index("```", 3)]
    assert [line.split("#")[0].strip() for line in block] == FIRST_COMMANDS


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, broken


def test_every_docs_page_is_indexed():
    index = DOCS / "README.md"
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in _links(index)}
    readme = {(ROOT / t.partition("#")[0]).resolve() for t in _links(README)}
    for page in DOCS.glob("*.md"):
        if page != index:
            assert page.resolve() in linked, f"docs/README.md does not link {page.name}"
    assert index.resolve() in readme, "README.md does not link docs/README.md"
