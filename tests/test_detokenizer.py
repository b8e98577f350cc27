"""core/detokenizer.py: whole UTF-8 characters from split token pieces (case C6)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.core.detokenizer import Detokenizer

SETTINGS = settings(max_examples=200, deadline=None)

C6_TEXT = "👍🏽 你好 🇯🇵 Привет ½"
C6_BYTES = C6_TEXT.encode("utf-8")


def run(pieces) -> tuple[list[str], str]:
    detok = Detokenizer()
    outs = [detok.feed(p) for p in pieces]
    return outs, detok.flush()


def split_at(data: bytes, cuts) -> list[bytes]:
    cuts = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def test_c6_whole():
    assert run([C6_BYTES]) == ([C6_TEXT], "")


def test_c6_one_byte_at_a_time():
    outs, tail = run([C6_BYTES[i : i + 1] for i in range(len(C6_BYTES))])
    assert "".join(outs) + tail == C6_TEXT
    assert tail == ""
    assert not any("\ufffd" in o for o in outs)
    # A character comes out on the feed of its last byte, never later.
    assert "".join(outs) == C6_TEXT


@pytest.mark.parametrize("cut", range(len(C6_BYTES) + 1))
def test_c6_every_two_way_split(cut):
    outs, tail = run([C6_BYTES[:cut], C6_BYTES[cut:]])
    assert "".join(outs) + tail == C6_TEXT
    assert "\ufffd" not in "".join(outs)
    assert tail == ""
    # The first feed gives exactly the characters wholly inside it.
    assert outs[0] == C6_BYTES[:cut].decode("utf-8", "ignore")


def test_holds_partial_character():
    detok = Detokenizer()
    assert detok.feed("你".encode()[:2]) == ""
    assert detok.pending_bytes == 2
    assert detok.feed("你".encode()[2:] + b"a") == "你a"
    assert detok.pending_bytes == 0


@pytest.mark.parametrize(
    ("pieces", "text"),
    [
        ([b"\xff"], "\ufffd"),
        ([b"a\x80b"], "a\ufffdb"),
        ([b"\xc0\xaf"], "\ufffd\ufffd"),  # overlong
        ([b"\xed\xa0\x80"], "\ufffd\ufffd\ufffd"),  # UTF-16 surrogate
        ([b"\xe4\xbd", b"a"], "\ufffda"),  # a sequence cut short by a byte that cannot continue it
        ([b"\xf0", b"\x9f", b"\x91", b"A"], "\ufffdA"),
    ],
)
def test_invalid_bytes_give_replacement(pieces, text):
    outs, tail = run(pieces)
    assert "".join(outs) + tail == text


def test_flush_replaces_incomplete_and_resets():
    detok = Detokenizer()
    assert detok.feed(b"ok \xe4\xbd") == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.pending_bytes == 0
    assert detok.flush() == ""
    assert detok.feed("½".encode()) == "½"


@SETTINGS
@given(data=st.binary(max_size=64) | st.text(max_size=24).map(str.encode),
       cuts=st.lists(st.integers(min_value=0), max_size=10))
def test_any_split_equals_whole_decode(data, cuts):
    pieces = split_at(data, cuts)
    outs, tail = run(pieces)
    assert "".join(outs) + tail == data.decode("utf-8", "replace")
    single, single_tail = run([data[i : i + 1] for i in range(len(data))])
    assert "".join(single) + single_tail == data.decode("utf-8", "replace")


@SETTINGS
@given(text=st.text(max_size=24), cuts=st.lists(st.integers(min_value=0), max_size=10))
def test_valid_text_never_gives_replacement(text, cuts):
    data = text.encode("utf-8")
    detok = Detokenizer()
    fed = b""
    released = ""
    for piece in split_at(data, cuts):
        fed += piece
        released += detok.feed(piece)
        # Everything complete is released at once; at most 3 bytes of one character wait.
        assert released == fed[: len(fed) - detok.pending_bytes].decode("utf-8")
        assert detok.pending_bytes <= 3
    assert released + detok.flush() == text
