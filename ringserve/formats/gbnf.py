"""Small GBNF builders for the call grammars: literals, alternatives, raw text up to a delimiter.

GBNF is llama.cpp's grammar notation (``grammars/README.md`` in llama.cpp): rules
``name ::= expression``, string literals in double quotes, character classes, groups,
``*`` ``+`` ``?`` and ``{m,n}``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ringserve.core.lark import _char  # GBNF's escapes, in one place

__all__ = ["alternatives", "literal", "raw_text"]


def literal(text: str) -> str:
    """``text`` as a GBNF string literal (``""`` for the empty string), escaped as
    :mod:`ringserve.core.lark` escapes it."""
    return '"' + "".join(_char(ord(c), in_class=False) for c in text) + '"'


def alternatives(expressions: Sequence[str]) -> str:
    """``a | b | ...`` (``expressions`` is not empty)."""
    assert expressions, "no alternatives"
    return " | ".join(expressions)


def raw_text(delimiter: str, name: str) -> tuple[tuple[str, str], ...]:
    """Rules ``name-0`` ... for any text that does not contain ``delimiter`` (the text that
    stands before it; ``name-0`` is the expression to use).

    One rule per state of the delimiter's prefix automaton (Knuth-Morris-Pratt): rule ``k``
    is the rest of the text after a part that ends with the delimiter's first ``k``
    characters; each character leads to the state it makes, and none may complete the
    delimiter. Right recursion only, which llama.cpp's grammar stacks take without growing.
    """
    assert delimiter
    rules = []
    for k in range(len(delimiter)):
        alts = ['""']
        moves = {c: _next_state(delimiter, k, c) for c in sorted(set(delimiter))}
        for c, state in moves.items():
            if 0 < state < len(delimiter):
                alts.append(f"{literal(c)} {name}-{state}")
        others = "".join(_char(ord(c), in_class=True) for c, state in moves.items() if state != 0)
        alts.append(f"[^{others}] {name}-0")
        rules.append((f"{name}-{k}", " | ".join(alts)))
    return tuple(rules)


def _next_state(delimiter: str, k: int, c: str) -> int:
    """The longest prefix of ``delimiter`` that ends the text ``delimiter[:k] + c``."""
    text = delimiter[:k] + c
    for n in range(min(len(text), len(delimiter)), 0, -1):
        if text.endswith(delimiter[:n]):
            return n
    return 0
