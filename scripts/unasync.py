#!/usr/bin/env python3
"""Write the client's sync shell from its Trio shell: ``ringserve/client/_trio.py`` → ``_sync.py``.

httpcore's pattern (``encode/httpcore`` ``scripts/unasync.py``): one table of
substitutions applied line by line, so the two shells cannot drift apart.
``--check`` writes nothing and exits 1 when ``_sync.py`` is not what this
script would write (``tests/client/test_unasync.py`` runs the same check).

Usage: ``python scripts/unasync.py [--check]``
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CLIENT = Path(__file__).resolve().parent.parent / "ringserve" / "client"
SOURCE, TARGET = CLIENT / "_trio.py", CLIENT / "_sync.py"

HEADER = "# Generated from _trio.py by scripts/unasync.py: edit _trio.py, then run the script.\n"

#: (pattern, replacement), applied in order to every line; a pattern that starts or ends with a
#: word character matches whole words only there.
SUBS = [
    (r"AsyncGenerator\[(.+?), None\]", r"Generator[\1, None, None]"),
    ("AsyncIterator", "Iterator"),
    (r"Async([A-Z]\w*)", r"\1"),  # AsyncClient, AsyncMessageStream, httpx.AsyncBaseTransport, AsyncGenerator
    ("async def", "def"),
    ("async with", "with"),
    ("async for", "for"),
    ("await ", ""),
    ("aclosing", "closing"),
    ("aclose", "close"),
    ("aread", "read"),
    ("aiter_bytes", "iter_bytes"),
    ("__aenter__", "__enter__"),
    ("__aexit__", "__exit__"),
    ("__aiter__", "__iter__"),
    ("__anext__", "__next__"),
    ("StopAsyncIteration", "StopIteration"),
    ("TrioBackend", "SyncBackend"),
    ("Trio", "sync"),  # prose: "The Trio shell"
]


def _compiled(pattern: str) -> re.Pattern[str]:
    head = r"\b" if re.match(r"\w", pattern) else ""
    tail = r"\b" if re.search(r"\w$", pattern) else ""
    return re.compile(head + pattern + tail)


COMPILED = [(_compiled(pattern), replacement) for pattern, replacement in SUBS]


def unasync(source: str) -> tuple[str, set[int]]:
    """The sync text of ``source``, and the indexes of the substitutions it used."""
    used: set[int] = set()
    lines = []
    for line in source.splitlines(keepends=True):
        for index, (regex, replacement) in enumerate(COMPILED):
            line, count = regex.subn(replacement, line)
            if count:
                used.add(index)
        lines.append(line)
    return HEADER + "".join(lines), used


def main(argv: list[str]) -> int:
    text, used = unasync(SOURCE.read_text())
    if unused := [SUBS[i] for i in range(len(SUBS)) if i not in used]:
        print(f"substitutions that {SOURCE.name} no longer needs: {unused}", file=sys.stderr)
        return 1
    if "--check" in argv:
        if TARGET.read_text() != text:
            print(f"{TARGET} is not up to date: run python scripts/unasync.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
