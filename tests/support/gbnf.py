"""A small GBNF recogniser for tests: does a grammar accept a text?

GBNF is llama.cpp's grammar notation (``grammars/README.md``): ``name ::= expression``
rules, string literals, character classes (``[^...]``, ranges), ``.``, groups and the
repetitions ``* + ? {m} {m,} {m,n}``. The recogniser parses the grammar and matches by
memoised sets of end positions, which is plenty for the short texts of tests (it is not
llama.cpp's stack machine, and it does not look at tokens).
"""

from __future__ import annotations

import re
import sys
from functools import cache
from typing import Any

_ESC = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^", "/": "/"}


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def ws(self, newlines: bool = True) -> None:
        while self.i < len(self.text):
            c = self.text[self.i]
            if c == "#":
                while self.i < len(self.text) and self.text[self.i] != "\n":
                    self.i += 1
            elif c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            else:
                break

    def char(self) -> str:
        c = self.text[self.i]
        if c != "\\":
            self.i += 1
            return c
        e = self.text[self.i + 1]
        if e == "x":
            self.i += 4
            return chr(int(self.text[self.i - 2 : self.i], 16))
        if e == "u":
            self.i += 6
            return chr(int(self.text[self.i - 4 : self.i], 16))
        if e == "U":
            self.i += 10
            return chr(int(self.text[self.i - 8 : self.i], 16))
        self.i += 2
        return _ESC[e]

    def rules(self) -> dict[str, Any]:
        rules: dict[str, Any] = {}
        self.ws()
        while self.i < len(self.text):
            m = re.compile(r"[\w-]+").match(self.text, self.i)
            assert m, self.text[self.i : self.i + 40]
            self.i = m.end()
            self.ws()
            assert self.text.startswith("::=", self.i), self.text[self.i : self.i + 40]
            self.i += 3
            rules[m.group()] = self.alternatives(top=True)
            self.ws()
        return rules

    def alternatives(self, top: bool = False) -> Any:
        alts = [self.sequence(top)]
        while self.i < len(self.text) and self.text[self.i] == "|":
            self.i += 1
            alts.append(self.sequence(top))
        return ("alt", tuple(alts))

    def _at_rule_start(self) -> bool:
        return re.compile(r"[\w-]+\s*::=").match(self.text, self.i) is not None

    def sequence(self, top: bool) -> Any:
        items = []
        while True:
            self.ws(newlines=not top)
            if top and self.i < len(self.text) and self.text[self.i] in "\r\n":
                # a rule may go on after a newline when the next line does not start a rule
                self.ws()
                if self.i >= len(self.text) or self._at_rule_start():
                    break
            if self.i >= len(self.text) or self.text[self.i] in "|)":
                break
            items.append(self.repeat(self.atom()))
        return ("seq", tuple(items))

    def atom(self) -> Any:
        c = self.text[self.i]
        if c == '"':
            self.i += 1
            out = []
            while self.text[self.i] != '"':
                out.append(self.char())
            self.i += 1
            return ("lit", "".join(out))
        if c == "[":
            self.i += 1
            negate = self.text[self.i] == "^"
            if negate:
                self.i += 1
            ranges = []
            while self.text[self.i] != "]":
                a = self.char()
                b = a
                if self.text[self.i] == "-" and self.text[self.i + 1] != "]":
                    self.i += 1
                    b = self.char()
                ranges.append((a, b))
            self.i += 1
            return ("cls", negate, tuple(ranges))
        if c == ".":
            self.i += 1
            return ("cls", True, ())
        if c == "(":
            self.i += 1
            inner = self.alternatives()
            self.ws()
            assert self.text[self.i] == ")"
            self.i += 1
            return inner
        m = re.compile(r"[\w-]+").match(self.text, self.i)
        assert m, self.text[self.i : self.i + 40]
        self.i = m.end()
        return ("ref", m.group())

    def repeat(self, node: Any) -> Any:
        if self.i >= len(self.text):
            return node
        c = self.text[self.i]
        if c in "*+?":
            self.i += 1
            return ("rep", node, {"*": 0, "+": 1, "?": 0}[c], {"*": None, "+": None, "?": 1}[c])
        if c == "{":
            m = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}").match(self.text, self.i)
            assert m
            self.i = m.end()
            lo = int(m.group(1))
            hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
            return ("rep", node, lo, hi)
        return node


def accepts(grammar: str, text: str, root: str = "root") -> bool:
    """Whether ``grammar`` (GBNF text) derives exactly ``text`` from ``root``."""
    rules = _Parser(grammar).rules()

    @cache
    def ends(node: Any, pos: int) -> frozenset[int]:
        kind = node[0]
        if kind == "lit":
            return frozenset({pos + len(node[1])}) if text.startswith(node[1], pos) else frozenset()
        if kind == "cls":
            if pos >= len(text):
                return frozenset()
            c = text[pos]
            inside = any(a <= c <= b for a, b in node[2])
            return frozenset({pos + 1}) if inside != node[1] else frozenset()
        if kind == "ref":
            return ends(rules[node[1]], pos)
        if kind == "alt":
            return frozenset().union(*(ends(a, pos) for a in node[1]))
        if kind == "seq":
            current = frozenset({pos})
            for item in node[1]:
                current = frozenset().union(*(ends(item, p) for p in current)) if current else current
            return current
        if kind == "rep":
            _, inner, lo, hi = node
            result: set[int] = set()
            current = frozenset({pos})
            count = 0
            seen: set[frozenset[int]] = set()
            while current:
                if count >= lo:
                    result |= current
                if hi is not None and count >= hi:
                    break
                if current in seen and count >= lo:
                    break
                seen.add(current)
                current = frozenset().union(*(ends(inner, p) for p in current))
                count += 1
            return frozenset(result)
        raise AssertionError(kind)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))  # a right-recursive rule recurses once per character
    try:
        return len(text) in ends(("ref", root), 0)
    finally:
        sys.setrecursionlimit(limit)
