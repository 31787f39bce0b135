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


def _fenced(text: str):
    """(line number, fence, line) for each line of a Markdown text that is not a fence marker:
    fence is None outside code blocks, else the block's info string ("python", "bash", "")."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
        else:
            yield n, fence, line


def _prose(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    return [line for _, fence, line in _fenced(text) if fence is None]


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


RESULTS = ROOT / "results"
# folders whose entries each need their own row (the others are listed as one folder)
RESULTS_LISTED_ONE_BY_ONE = ("", "report", "gemma3-270m")


def _results_patterns() -> list[re.Pattern]:
    """The first column of results/README.md's table as path patterns: `a.{json,png}` is both,
    `<L>` any name part, `X.json` also its gzipped `X.json.gz`, `dir/` the folder."""
    patterns = []
    for line in (RESULTS / "README.md").read_text().split("\n"):
        if not line.startswith("| `"):
            continue
        first = re.sub(r"\([^)]*\)", "", line.split("|")[1])  # "(`README.md`, ...)": a folder's contents
        for token in re.findall(r"`([^`]+)`", first):
            token = token.split(" ")[0]
            m = re.search(r"\{([^}]*)\}", token)
            variants = [token[:m.start()] + alt + token[m.end():] for alt in m.group(1).split(",")] if m else [token]
            for v in variants:
                rx = re.sub(r"<[^>]+>", "[^/]+", re.escape(v).replace(r"\<", "<").replace(r"\>", ">"))
                patterns.append(re.compile(rx + (r"(\.gz)?" if v.endswith(".json") else "")))
    return patterns


def test_results_readme_lists_every_result():
    """results/README.md "lists every result file with the command that wrote it": every file and
    folder at the top of results/, every report folder in results/report/ and every entry of
    results/gemma3-270m/ has a row (a folder's own files are its own row's or README's business)."""
    patterns = _results_patterns()
    missing = []
    for folder in RESULTS_LISTED_ONE_BY_ONE:
        base = RESULTS / folder
        for entry in sorted(base.iterdir()):
            if entry.name in ("README.md", "cells") or entry.name.startswith("."):
                continue
            if folder == "" and entry.name in RESULTS_LISTED_ONE_BY_ONE:
                continue  # entry by entry below
            if folder == "report" and not entry.is_dir():
                continue  # the default report's own files: the `report/` row
            rel = entry.relative_to(RESULTS).as_posix() + ("/" if entry.is_dir() else "")
            if not any(p.fullmatch(rel) for p in patterns):
                missing.append(rel)
    assert not missing, f"results/README.md has no row for: {missing}"


def test_readme_names_every_preset():
    """The README's list of `lcx.presets` names is the registry's, in its order."""
    from lcx.presets import PRESETS

    text = " ".join(README.read_text().split())
    m = re.search(r"`lcx\.presets` is the one table of named settings \(([^)]*)\)", text)
    assert m, "README: the sentence listing lcx.presets' names is gone"
    assert re.findall(r"`([^`]+)`", m.group(1)) == list(PRESETS)


def _python_blocks() -> list[tuple[str, int, str]]:
    """(page, first line, source) of every ```python block in the README and docs/."""
    blocks: dict[tuple[str, int], list[str]] = {}
    for page in PAGES:
        start = last = None
        for n, fence, line in _fenced(page.read_text()):
            if fence != "python":
                continue
            if last != n - 1:  # a fence marker (not yielded) or prose came between: a new block
                start = n
            last = n
            blocks.setdefault((page.relative_to(ROOT).as_posix(), start), []).append(line)
    return [(page, n, "\n".join(lines)) for (page, n), lines in blocks.items()]


@pytest.mark.parametrize("page,line,source", _python_blocks(), ids=lambda x: str(x)[:40])
def test_python_block_parses_and_its_lcx_imports_exist(page, line, source):
    """Every Python example in the docs is valid Python, and every name it imports from lcx (or
    the repository's benchmarks/studies) exists: a renamed or moved function breaks the page here
    rather than for a reader."""
    import ast
    import importlib
    import importlib.util

    tree = ast.parse(source, filename=f"{page}:{line}")
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in ("lcx", "benchmarks", "studies"):
            module = importlib.import_module(node.module)
            missing += [f"{node.module}.{a.name}" for a in node.names
                        if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("lcx", "benchmarks", "studies"):
                    importlib.import_module(a.name)
    for node in ast.walk(tree):  # `lcx.a.b` (after `import lcx`): each attribute in turn
        chain = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == "lcx" and chain:
            obj, path = importlib.import_module("lcx"), "lcx"
            for attr in chain:
                path += f".{attr}"
                if not hasattr(obj, attr) and importlib.util.find_spec(path) is None:
                    missing.append(path)
                    break
                obj = getattr(obj, attr) if hasattr(obj, attr) else importlib.import_module(path)
                if not hasattr(obj, "__dict__"):
                    break
    assert not missing, f"{page}:{line}: names that do not exist: {missing}"


# Placeholders the docs write where a reader fills in a name (`lcx COMMAND --help`, `lcx bench <name>`).
_PLACEHOLDER = re.compile(r"<[^>]*>|[A-Z][A-Z_]+")


def _documented_commands() -> list[tuple[str, int, list[str]]]:
    """(page, line, argv) of every `lcx ...` command the README, docs/ and results/README.md show,
    in inline code or in a shell block; elided ones (`...`) and shell around them dropped,
    `[optional]` brackets opened."""
    import shlex

    found = []
    for page in [*PAGES, ROOT / "results" / "README.md"]:
        for n, fence, line in _fenced(page.read_text()):
            if fence is not None:
                spans = [line.strip()] if fence in ("bash", "sh", "") and line.strip().startswith("lcx ") else []
            else:
                spans = re.findall(r"`(lcx [^`]+)`", line)
            for span in spans:
                for cmd in re.split(r"\s+(?:#|\\?\||&&|&|;|>)\s*", span):
                    if not cmd.startswith("lcx ") or "..." in cmd or "…" in cmd:
                        continue
                    try:
                        argv = shlex.split(cmd.replace("[", " ").replace("]", " "))[1:]
                    except ValueError:
                        continue
                    found.append((page.relative_to(ROOT).as_posix(), n, argv))
    return found


def test_documented_commands_name_real_commands_and_flags():
    """Every `lcx` command line in the docs parses with lcx's own CLI up to what a reader fills in:
    no subcommand it names is unknown and no flag it passes is unrecognized (a renamed or removed
    flag fails here). Missing required arguments and placeholder values (`--length L`) are the
    prose's shorthand and pass; nothing is run."""
    import argparse
    from unittest import mock

    from lcx.cli import build_parser

    class _ArgError(Exception):
        pass

    def error(self, message):
        raise _ArgError(message)

    commands = _documented_commands()
    wrong = []
    for page, line, argv in commands:
        argv = [a for a in argv if a not in ("--help", "-h")]
        try:
            with mock.patch.object(argparse.ArgumentParser, "error", error):
                build_parser(argv).parse_args(argv)
        except _ArgError as e:
            message = str(e)
            choice = re.search(r"invalid choice: '([^']*)'", message)
            if "unrecognized arguments" in message or (choice and not _PLACEHOLDER.fullmatch(choice.group(1))):
                wrong.append(f"{page}:{line}: lcx {' '.join(argv)}: {message}")
    assert len(commands) > 100 and not wrong, wrong
