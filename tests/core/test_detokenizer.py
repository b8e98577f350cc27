"""core/detokenizer.py: whole UTF-8 characters from split token pieces (case C6)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.core.detokenizer import Detokenizer

SETTINGS = settings(max_examples=200, deadline=None)

C6_TEXT = "👍🏽 你好 🇯🇵 Привет ½"
C6_BYTES = C6_TEXT.encode("utf-8")


def run(pieces) -> tuple[list[str], int]:
    """The feeds' outputs and the bytes dropped at the end."""
    detok = Detokenizer()
    outs = [detok.feed(p) for p in pieces]
    return outs, detok.flush()


def split_at(data: bytes, cuts) -> list[bytes]:
    cuts = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def test_c6_whole():
    assert run([C6_BYTES]) == ([C6_TEXT], 0)


def test_c6_one_byte_at_a_time():
    outs, dropped = run([C6_BYTES[i : i + 1] for i in range(len(C6_BYTES))])
    assert dropped == 0
    assert not any("\ufffd" in o for o in outs)
    # A character comes out on the feed of its last byte, never later.
    assert "".join(outs) == C6_TEXT


@pytest.mark.parametrize("cut", range(len(C6_BYTES) + 1))
def test_c6_every_two_way_split(cut):
    outs, dropped = run([C6_BYTES[:cut], C6_BYTES[cut:]])
    assert "".join(outs) == C6_TEXT
    assert dropped == 0
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
    outs, dropped = run(pieces)
    assert ("".join(outs), dropped) == (text, 0)


def test_flush_drops_an_incomplete_character_and_resets():
    """Issue 12: the end of a generation never turns a cut character into U+FFFD."""
    detok = Detokenizer()
    assert detok.feed(b"ok \xe4\xbd") == "ok "
    assert detok.flush() == 2
    assert detok.pending_bytes == 0
    assert detok.flush() == 0
    assert detok.feed("½".encode()) == "½"


@pytest.mark.parametrize("cut", range(1, 4))
def test_flush_after_a_cut_emoji_leaves_no_replacement(cut):
    detok = Detokenizer()
    assert detok.feed("a👍".encode()[: 1 + cut]) == "a"
    assert detok.flush() == cut
    assert detok.feed(b"b") == "b"  # a fresh start: the dropped bytes are forgotten


def answer_after(pieces) -> str:
    """The text a generation of exactly these token pieces ends with (feeds, then flush)."""
    outs, _ = run(pieces)
    return "".join(outs)


@SETTINGS
@given(text=st.text(max_size=24), cuts=st.lists(st.integers(min_value=0), max_size=10))
def test_answer_for_n_tokens_is_a_prefix_of_the_answer_for_n_plus_1(text, cuts):
    """Issue 12's rule for a cut reply: no U+FFFD, and each answer extends the previous one."""
    pieces = split_at(text.encode("utf-8"), cuts)
    answers = [answer_after(pieces[:n]) for n in range(len(pieces) + 1)]
    assert answers[-1] == text
    for shorter, longer in itertools.pairwise(answers):
        assert "\ufffd" not in shorter
        assert longer.startswith(shorter)


@SETTINGS
@given(data=st.binary(max_size=64) | st.text(max_size=24).map(str.encode),
       cuts=st.lists(st.integers(min_value=0), max_size=10))
def test_any_split_equals_whole_decode(data, cuts):
    pieces = split_at(data, cuts)
    outs, dropped = run(pieces)
    assert 0 <= dropped <= 3
    assert "".join(outs) == data[: len(data) - dropped].decode("utf-8", "replace")
    single, single_dropped = run([data[i : i + 1] for i in range(len(data))])
    assert ("".join(single), single_dropped) == ("".join(outs), dropped)


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
    assert detok.flush() == 0
    assert released == text
