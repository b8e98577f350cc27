"""The docs (README.md and docs/*.md), read with markdown-it-py: every relative link and anchor
resolves, and docs/compatibility.md says what each surface's FieldTables do with each field."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import attrs
import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

from ringserve.surfaces.base import FieldTable
from ringserve.surfaces.registry import SURFACES

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MD = MarkdownIt("commonmark").enable("table")


def inline_text(token: Token) -> str:
    """The text of an inline token as rendered (code spans without their backticks)."""
    return "".join(c.content for c in token.children or () if c.type in ("text", "code_inline"))


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-`` (github/cmark-gfm's anchors, as rendered on github.com)."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading gets ``-1``, ``-2``, ...)."""
    tokens = MD.parse(path.read_text())
    seen: dict[str, int] = {}
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type == "heading_open":
            base = slug(inline_text(inline))
            n = seen.get(base, 0)
            seen[base] = n + 1
    return {base if n == 0 else f"{base}-{n}" for base, count in seen.items() for n in range(count)}


def links(path: Path) -> list[str]:
    """Every link and image target of a Markdown file (not those in code)."""
    found = []
    for token in MD.parse(path.read_text()):
        for child in token.children or ():
            if child.type == "link_open":
                found.append(str(child.attrs["href"]))
            elif child.type == "image":
                found.append(str(child.attrs["src"]))
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` whose file does not exist, or whose anchor is no heading of
    the Markdown file it names. Links with a scheme (``https:``, ``mailto:``) are not followed."""
    broken = []
    for href in links(path):
        if urlsplit(href).scheme:
            continue
        file, _, fragment = href.partition("#")
        target = (path.parent / unquote(file)).resolve() if file else path
        if not target.exists():
            broken.append(f"{href}: no such file")
        elif fragment and target.suffix == ".md" and unquote(fragment) not in anchors(target):
            broken.append(f"{href}: no such heading in {target.name}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    assert broken_links(doc) == []


def test_broken_links_finds_missing_files_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Context and max_tokens\n\n## Notes\n\n## Notes\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc: `the` title\n\n"
        "[ok](other.md#context-and-max_tokens) [ok](other.md#notes-1) [ok](#doc-the-title) [ok](https://x.org/#no)\n"
        "[bad](missing.md) [bad](other.md#notes-2) [bad](#nowhere) ![bad](gone.png) `[code](skipped.md)`\n"
    )
    assert broken_links(doc) == [
        "missing.md: no such file",
        "other.md#notes-2: no such heading in other.md",
        "#nowhere: no such heading in doc.md",
        "gone.png: no such file",
    ]
