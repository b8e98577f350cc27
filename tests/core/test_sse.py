"""core/sse.py: encoder bytes, parser rules (WHATWG HTML "Server-sent events"), round trips.

h11's habit: every stream is parsed whole, one byte at a time and in random
splits, and the outcomes must be equal.
"""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.core.sse import (
    ServerSentEvent,
    SSEParser,
    encode_comment,
    encode_event,
    encode_reconnect,
)

SETTINGS = settings(max_examples=150, deadline=None)


# ---------------------------------------------------------------- helpers


def parse(chunks) -> tuple[list[ServerSentEvent], SSEParser]:
    parser = SSEParser()
    events = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return events, parser


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def split_at(data: bytes, cuts) -> list[bytes]:
    cuts = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def snapshot(parser: SSEParser) -> tuple:
    return parser.comments, parser.last_event_id, parser.retry, parser.pending_bytes


def assert_same_every_way(data: bytes, cuts=()) -> list[ServerSentEvent]:
    """Parse whole, byte by byte and split at ``cuts``; all must agree."""
    whole, p1 = parse([data])
    single, p2 = parse(bytewise(data))
    split, p3 = parse(split_at(data, cuts))
    assert single == whole
    assert split == whole
    assert snapshot(p1) == snapshot(p2) == snapshot(p3)
    return whole


def normalise(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


_LINE = re.compile(r"([^\r\n]*)(\r\n|\r|\n)")


def reference_parse(data: bytes):
    """The spec's algorithm read literally, on the whole stream at once.

    Returns (events, comments, last_event_id, retry).
    """
    text = data.decode("utf-8", "replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    events, comments, retry = [], 0, None
    data_buf, event_type, id_buf, last_id = "", "", "", ""
    block_id = block_retry = None
    for m in _LINE.finditer(text):  # a trailing line without an end is discarded
        line = m.group(1)
        if line == "":
            last_id = id_buf
            if data_buf == "":
                event_type, block_id, block_retry = "", None, None
                continue
            if data_buf.endswith("\n"):
                data_buf = data_buf[:-1]
            events.append(ServerSentEvent(event_type or "message", data_buf, block_id, block_retry))
            data_buf, event_type, block_id, block_retry = "", "", None, None
            continue
        if line.startswith(":"):
            comments += 1
            continue
        if ":" in line:
            field, value = line.split(":", 1)
            if value.startswith(" "):
                value = value[1:]
        else:
            field, value = line, ""
        if field == "event":
            event_type = value
        elif field == "data":
            data_buf += value + "\n"
        elif field == "id":
            if "\0" not in value:
                id_buf = block_id = value
        elif field == "retry":
            if value and all(c in "0123456789" for c in value):
                retry = block_retry = int(value)
    return events, comments, last_id, retry


# ---------------------------------------------------------------- encoder bytes


def test_encode_event_plain():
    assert encode_event("hello") == b"data: hello\n\n"
    assert encode_event("") == b"data: \n\n"
    assert encode_event("½ 你好") == "data: ½ 你好\n\n".encode()


def test_encode_event_field_order_and_lines():
    assert encode_event("a\r\nb\rc\nd", event="delta", id="7", retry=1500) == (
        b"id: 7\nevent: delta\nretry: 1500\ndata: a\ndata: b\ndata: c\ndata: d\n\n"
    )
    assert encode_event("x\n") == b"data: x\ndata: \n\n"


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\r\nb", "a\0b", "\n"])
def test_encode_event_rejects_framing_breakers(bad):
    with pytest.raises(ValueError):
        encode_event("x", id=bad)
    with pytest.raises(ValueError):
        encode_event("x", event=bad)


def test_encode_event_rejects_bad_retry():
    with pytest.raises(ValueError):
        encode_event("x", retry=-1)
    with pytest.raises(TypeError):
        encode_event("x", retry=1.5)


def test_encode_event_lone_surrogate_is_value_error():
    with pytest.raises(ValueError):
        encode_event("\ud800")


def test_encode_comment():
    # One line and no blank line: it joins the next block instead of ending one (see encode_comment).
    assert encode_comment() == b": ping\n"
    assert encode_comment("keep-alive") == b": keep-alive\n"
    for bad in ("a\nb", "a\rb"):
        with pytest.raises(ValueError):
            encode_comment(bad)
    events, parser = parse(bytewise(encode_comment() * 3))
    assert events == []
    assert parser.comments == 3
    assert parser.pending_bytes == 3 * len(b": ping\n")  # an open block holding only comments
    events, parser = parse([encode_comment() * 2 + encode_event("x", id="m:0") + encode_comment()])
    assert events == [ServerSentEvent(data="x", id="m:0")]
    assert parser.comments == 3


def test_encode_reconnect():
    assert encode_reconnect("msg_1:4") == b': reconnect {"last_event_id":"msg_1:4"}\n'
    assert encode_reconnect(None) == b': reconnect {"last_event_id":null}\n'
    events, parser = parse([encode_event("x", id="msg_1:4"), encode_comment(), encode_reconnect("msg_1:4")])
    assert [e.data for e in events] == ["x"]
    assert parser.last_event_id == "msg_1:4"  # what EventSource sends when it reconnects by itself


# ---------------------------------------------------------------- parser rules


def test_parser_basic_and_defaults():
    data = b"data: hi\n\nevent: e\ndata\ndata:x\ndata:  two spaces\n\n"
    events = assert_same_every_way(data)
    assert events == [
        ServerSentEvent("message", "hi"),
        ServerSentEvent("e", "\nx\n two spaces"),
    ]


@pytest.mark.parametrize("eol", [b"\n", b"\r", b"\r\n"])
def test_parser_line_ends(eol):
    data = eol.join([b"id: 1", b"event: a", b"data: x", b"data: y", b"", b"data: z", b"", b""])
    events = assert_same_every_way(data)
    assert events == [ServerSentEvent("a", "x\ny", "1"), ServerSentEvent("message", "z")]


def test_parser_mixed_line_ends_and_cr_lf_split():
    data = b"data: a\r\r\ndata: b\r\n\ndata: c\n\r"
    events = assert_same_every_way(data, cuts=[8])  # cut between CR and LF
    assert [e.data for e in events] == ["a", "b", "c"]
    # CR then LF in the next feed is one line end, not two (no empty event, no extra blank line).
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\ndata: b\r") == []
    assert parser.feed(b"\n\r") == [ServerSentEvent("message", "a\nb")]
    assert parser.pending_bytes == 0
    assert parser.feed(b"\n") == []
    assert parser.pending_bytes == 0


def test_parser_bom_only_at_start():
    bom = b"\xef\xbb\xbf"
    events = assert_same_every_way(bom + b"data: a\n\n" + bom + b"data: b\n\ndata: c\n\n")
    # The second BOM makes the field "\ufeffdata", which is unknown and ignored.
    assert events == [ServerSentEvent(data="a"), ServerSentEvent(data="c")]
    parser = SSEParser()
    assert parser.feed(b"\xef") == []
    assert parser.feed(b"\xbb") == []
    assert parser.pending_bytes == 2
    assert parser.feed(b"\xbf") == []
    assert parser.feed(b"data: x\n\n") == [ServerSentEvent(data="x")]
    assert parser.pending_bytes == 0
    # Only a whole BOM is dropped: a lone 0xEF decodes to U+FFFD.
    assert parse([b"\xef", b"data: y\n\n"])[0] == []  # field "\ufffddata" is unknown
    assert parse([b"\xefa\ndata: y\n\n"])[0] == [ServerSentEvent(data="y")]


def test_parser_utf8_split_and_invalid():
    raw = "data: 👍🏽 你好 🇯🇵 Привет ½\n\n".encode()
    events = assert_same_every_way(raw, cuts=[7, 9, 14])
    assert events == [ServerSentEvent(data="👍🏽 你好 🇯🇵 Привет ½")]
    assert parse([b"data: a\xffb\n\n"])[0] == [ServerSentEvent(data="a\ufffdb")]


def test_parser_empty_data_not_dispatched():
    data = b"event: x\nid: 4\n\nretry: 10\n\n: c\n\ndata\n\n"
    events, parser = parse([data])
    # Only the last block had a data line; the event type "x" was reset by the first blank line.
    assert events == [ServerSentEvent("message", "")]
    assert parser.last_event_id == "4"
    assert parser.retry == 10
    assert parser.comments == 1


def test_parser_id_rules():
    events, parser = parse([b"id: 1\ndata: a\n\ndata: b\n\nid: 2\0\ndata: c\n\nid\ndata: d\n\n"])
    assert events == [
        ServerSentEvent(data="a", id="1"),
        ServerSentEvent(data="b", id=None),  # the block set no id...
        ServerSentEvent(data="c", id=None),  # ...an id with NUL is ignored...
        ServerSentEvent(data="d", id=""),  # ...and an empty id resets it.
    ]
    assert parser.last_event_id == ""
    events, parser = parse([b"id: 9\ndata: a\n\ndata: b\n\n"])
    assert parser.last_event_id == "9"  # carried forward, as a browser's lastEventId


def test_parser_last_event_id_committed_at_blank_line():
    parser = SSEParser()
    parser.feed(b"id: 5\ndata: x\n")
    assert parser.last_event_id == ""
    parser.feed(b"\n")
    assert parser.last_event_id == "5"


@pytest.mark.parametrize(
    ("value", "expected"),
    [(b"100", 100), (b"0", 0), (b"", None), (b"1.5", None), (b"-1", None), (b" 1", 1),
     (b"  1", None), (b"1a", None), ("١٢".encode(), None), ("²".encode(), None)],
)
def test_parser_retry_only_ascii_digits(value, expected):
    events, parser = parse([b"retry:" + value + b"\ndata: x\n\n"])
    assert parser.retry == expected
    assert events == [ServerSentEvent(data="x", retry=expected)]


def test_parser_comments_and_unknown_fields():
    events, parser = parse([b":\n: ping\n:x\nfoo: bar\nDATA: no\ndata: yes\n\n"])
    assert events == [ServerSentEvent(data="yes")]
    assert parser.comments == 3


def test_parser_incomplete_block_and_pending_bytes():
    parser = SSEParser()
    assert parser.feed(b"data: a\n\ndata: b\n") == [ServerSentEvent(data="a")]
    assert parser.pending_bytes == len(b"data: b\n")
    assert parser.feed(b"da") == []
    assert parser.pending_bytes == len(b"data: b\nda")
    assert parser.feed(b"ta: c\r") == []
    assert parser.feed(b"\n") == []
    assert parser.pending_bytes == len(b"data: b\ndata: c\r\n")
    assert parser.feed(b"\n") == [ServerSentEvent(data="b\nc")]
    assert parser.pending_bytes == 0


def test_parser_empty_feed():
    parser = SSEParser()
    assert parser.feed(b"") == []
    assert snapshot(parser) == (0, "", None, 0)


# ---------------------------------------------------------------- properties

ids = st.text().filter(lambda s: not any(c in s for c in "\r\n\0"))
# Text that encodes: no lone surrogates (st.characters() draws them; encode_event refuses them, tested above).
line_text = st.text(alphabet=st.sampled_from(list("ab :\r\n\0é你👍\ufeff")) | st.characters(codec="utf-8"))
datas = st.one_of(st.text(), line_text, st.sampled_from(["", "\n", "\r", "\r\n", "\n\n", "a\r\r\nb"]))
retries = st.none() | st.integers(min_value=0, max_value=10**12)


@st.composite
def events_args(draw):
    return (
        draw(datas),
        draw(st.none() | ids),
        draw(st.none() | ids),
        draw(retries),
    )


def expected_event(data, event, id_, retry) -> ServerSentEvent:
    return ServerSentEvent(event=event or "message", data=normalise(data), id=id_, retry=retry)


@SETTINGS
@given(args=events_args(), cuts=st.lists(st.integers(min_value=0), max_size=6))
def test_round_trip_one_event(args, cuts):
    data, event, id_, retry = args
    wire = encode_event(data, event=event, id=id_, retry=retry)
    assert wire.endswith(b"\n\n")
    events = assert_same_every_way(wire, cuts)
    assert events == [expected_event(*args)]


@SETTINGS
@given(
    items=st.lists(st.one_of(events_args(), st.text().filter(lambda s: "\r" not in s and "\n" not in s)), max_size=6),
    retry=st.integers(min_value=0, max_value=60_000),
    cuts=st.lists(st.integers(min_value=0), max_size=12),
)
def test_round_trip_stream(items, retry, cuts):
    wire = encode_event("first", id="m:0", retry=retry)
    expected, comments, last_id = [ServerSentEvent("message", "first", "m:0", retry)], 0, "m:0"
    for item in items:
        if isinstance(item, str):
            wire += encode_comment(item)
            comments += 1
        else:
            data, event, id_, r = item
            wire += encode_event(data, event=event, id=id_, retry=r)
            expected.append(expected_event(*item))
            if id_ is not None:
                last_id = id_
    events = assert_same_every_way(wire, cuts)
    assert events == expected
    _, parser = parse(split_at(wire, cuts))
    assert parser.comments == comments
    assert parser.last_event_id == last_id
    assert parser.pending_bytes == len(wire) - _last_boundary(wire)  # trailing comment lines, if any
    # Cut the stream anywhere: only whole blocks come out, the rest is pending.
    for cut in cuts[:3]:
        cut %= len(wire) + 1
        head = wire[:cut]
        head_events, head_parser = parse(bytewise(head))
        assert head_events == expected[: len(head_events)]
        assert head_parser.pending_bytes == len(head) - _last_boundary(head)


def _last_boundary(data: bytes) -> int:
    """Offset just after the last blank line of an encoder-made (LF-only) stream."""
    i = data.rfind(b"\n\n")
    return 0 if i < 0 else i + 2


# Raw streams built from SSE-ish pieces, to exercise the parser beyond what the encoder writes.
raw_pieces = st.sampled_from(
    [b"data", b"data:", b"data: ", b"event:", b"event: ", b"id:", b"id: ", b"retry:", b"retry: ",
     b":", b": ping", b"x", b" ", b"12", b"\0", b"\r", b"\n", b"\r\n", b"\r\n", b"\n\n",
     b"\xef\xbb\xbf", b"\xff", "é你👍".encode(), "👍".encode()[:2], b"foo:bar"]
)


@SETTINGS
@given(pieces=st.lists(raw_pieces | st.binary(max_size=4), max_size=40),
       cuts=st.lists(st.integers(min_value=0), max_size=10))
def test_parser_matches_reference_on_raw_streams(pieces, cuts):
    data = b"".join(pieces)
    events = assert_same_every_way(data, cuts)
    ref_events, ref_comments, ref_last_id, ref_retry = reference_parse(data)
    _, parser = parse(split_at(data, cuts))
    assert events == ref_events
    assert (parser.comments, parser.last_event_id, parser.retry) == (
        ref_comments, ref_last_id, ref_retry,
    )


# ---------------------------------------------------------------- the official SDKs' decoders

# Both SDKs decode with a copy of httpx-sse's SSEDecoder, which keeps the last event id across
# blocks and dispatches any blank line once one is set, even with an empty data buffer (the spec
# dispatches nothing then). The OpenAI SDK parses every dispatched block as JSON, so an empty one
# raises; the Anthropic SDK yields every named event but "ping".
SDK_DECODERS = {
    "openai": pytest.importorskip("openai._streaming").SSEDecoder,
    "anthropic": pytest.importorskip("anthropic._streaming").SSEDecoder,
}


@SETTINGS
@pytest.mark.parametrize("sdk", sorted(SDK_DECODERS))
@given(
    items=st.lists(st.one_of(events_args(), st.just("ping"), st.just("reconnect")), max_size=8),
    cuts=st.lists(st.integers(min_value=0), max_size=12),
)
def test_sdk_decoders_dispatch_exactly_the_encoded_events(sdk, items, cuts):
    """Heartbeats and the reconnect hint never reach an SDK as an event, wherever they fall."""
    wire, expected = b"", []
    for item in items:
        if item == "ping":
            wire += encode_comment()
        elif item == "reconnect":
            wire += encode_reconnect("m:1")
        else:
            wire += encode_event(item[0], event=item[1], id=item[2], retry=item[3])
            expected.append(expected_event(*item))
    got = list(SDK_DECODERS[sdk]().iter_bytes(iter(split_at(wire, cuts))))
    assert [(e.event or "message", e.data) for e in got] == [(e.event, e.data) for e in expected]
