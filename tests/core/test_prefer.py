"""The ``Prefer`` header parser (RFC 7240 §2)."""

from __future__ import annotations

import pytest

from ringserve.core.prefer import Preference, parse_prefer


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("", {}),
        ("respond-async", {"respond-async": Preference()}),
        ("Respond-Async", {"respond-async": Preference()}),
        ("respond-async, wait=5", {"respond-async": Preference(), "wait": Preference("5")}),
        ("respond-async; wait=5", {"respond-async": Preference("", {"wait": "5"})}),
        ("respond-async ;wait = 5 ; x", {"respond-async": Preference("", {"wait": "5", "x": ""})}),
        ('return=minimal; foo="a, b; c", respond-async',
         {"return": Preference("minimal", {"foo": "a, b; c"}), "respond-async": Preference()}),
        ('x="q\\"uote"', {"x": Preference('q"uote')}),
        ("wait=1, wait=9", {"wait": Preference("1")}),  # the first one counts
        (" , respond-async,,", {"respond-async": Preference()}),  # empty list elements
        ("bad token!?=(, respond-async", {"respond-async": Preference()}),  # a malformed one is ignored
    ],
)
def test_parse_prefer(header, expected):
    assert parse_prefer(header) == expected
