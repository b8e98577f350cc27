"""The HTTP ``Prefer`` request header (RFC 7240 §2), parsed without I/O.

Grammar (RFC 7240 §2, with RFC 9110 lists)::

    Prefer     = 1#preference
    preference = token [ BWS "=" BWS word ] *( OWS ";" [ OWS parameter ] )
    parameter  = token [ BWS "=" BWS word ]
    word       = token / quoted-string

So ``respond-async, wait=5`` holds two preferences and ``respond-async; wait=5``
one with a parameter. Names are case-insensitive (kept lowercased); the first of
a repeated preference counts (§2); a malformed list element is ignored, as a
server ignores a preference it does not understand.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

__all__ = ["Preference", "parse_prefer"]

_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_PAIR = re.compile(rf"\s*({_TOKEN})(?:\s*=\s*({_TOKEN}|{_QUOTED}))?\s*")
_ESCAPE = re.compile(r"\\(.)")


@attrs.frozen
class Preference:
    """One preference: its value (``""`` when it has none) and its parameters (lowercased names)."""

    value: str = ""
    params: Mapping[str, str] = attrs.field(factory=dict)


def _split(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside quoted strings."""
    parts, start, quoted, escaped = [], 0, False, False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif quoted and ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == sep and not quoted:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _pair(text: str) -> tuple[str, str] | None:
    match = _PAIR.fullmatch(text)
    if match is None:
        return None
    name, word = match.group(1).lower(), match.group(2) or ""
    if word.startswith('"'):
        word = _ESCAPE.sub(r"\1", word[1:-1])
    return name, word


def parse_prefer(header: str) -> dict[str, Preference]:
    """The preferences of a ``Prefer`` header value (several headers joined with ``,``).

    Returns:
        preference name (lowercased) → :class:`Preference`, e.g.
        ``parse_prefer("respond-async; wait=5")`` is
        ``{"respond-async": Preference("", {"wait": "5"})}``.
    """
    prefs: dict[str, Preference] = {}
    for element in _split(header, ","):
        head, *rest = _split(element, ";")
        pair = _pair(head)
        if pair is None or pair[0] in prefs:
            continue
        params = dict(p for p in map(_pair, rest) if p is not None)
        prefs[pair[0]] = Preference(pair[1], params)
    return prefs
