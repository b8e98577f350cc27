"""The machinery of the incremental parsers: a reader coroutine over streamed text, with hold-back.

A family's parser is written as a plain sequential reader, a generator function that takes
what it needs from a :class:`Stream` with the steps below (``yield from until(...)``). When
the text fed so far does not decide a step, the step suspends the generator (it yields) and
the next :meth:`CoroutineParser.feed` resumes it where it stopped; text that may still turn
out to be the start of a marker is held back, never released. At the end of the reply
(:meth:`CoroutineParser.flush`) the steps see :attr:`Stream.ended` and finish with what there
is.

The pieces go through :class:`Out`, which also tidies the whitespace at the seams of blocks:
leading whitespace of a text or reasoning block is dropped, and trailing whitespace is held
until more of the block comes (dropped when a call, the end of reasoning or the end of the
reply follows; text keeps it at the end of the reply).

Cost: each feed resumes the reader once; each step scans only text it has not consumed, plus
the held tail (shorter than the longest marker it looks for).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator, Sequence
from functools import lru_cache

import attrs

from ringserve.core.toolcalls import CallArgs, CallEnd, CallStart, JsonScan, Text, ToolCallError
from ringserve.formats.base import Piece, Reasoning

__all__ = [
    "CoroutineParser",
    "Out",
    "Step",
    "Stream",
    "accept",
    "closing",
    "cut",
    "expect",
    "json_string",
    "json_value",
    "peek",
    "skip_ws",
    "take_until",
    "until",
]

Step = Generator[None, None, object]
"""A reader step: yields while it waits for more text."""


@attrs.define(eq=False)
class Stream:
    """The fed text a reader has not consumed yet (``text[pos:]``) and whether the reply ended."""

    text: str = ""
    pos: int = 0
    ended: bool = False

    def rest(self) -> str:
        return self.text[self.pos :]

    def compact(self) -> None:
        if self.pos:
            self.text = self.text[self.pos :]
            self.pos = 0


class _Kind:
    NONE = 0
    TEXT = 1
    REASONING = 2


@attrs.define(eq=False)
class Out:
    """Where a reader puts its pieces (see the module docstring for the whitespace rules)."""

    pieces: list[Piece] = attrs.field(factory=list)
    _kind: int = _Kind.NONE
    _held: str = ""
    calls: int = 0
    """Calls completed so far."""
    in_call: bool = False
    """A call's opening marker was consumed and its end not yet (the reader sets it)."""
    in_reasoning: bool = False
    _args: list[str] = attrs.field(factory=list)
    _name: str = ""

    def has_args(self) -> bool:
        """Some of the open call's arguments were put out."""
        return bool(self._args)

    def text(self, text: str) -> None:
        self._add(_Kind.TEXT, text)

    def reasoning(self, text: str) -> None:
        self._add(_Kind.REASONING, text)

    def _add(self, kind: int, text: str) -> None:
        if self._kind != kind:
            text = text.lstrip()
            if not text:
                return
            self._kind = kind
            self._held = ""
        body = (self._held + text).rstrip()
        self._held = (self._held + text)[len(body) :]
        if body:
            self.pieces.append(Text(body) if kind == _Kind.TEXT else Reasoning(body))

    def end_block(self) -> None:
        """The open text or reasoning block ends here (its held whitespace is dropped)."""
        self._kind = _Kind.NONE
        self._held = ""

    def finish(self) -> None:
        """The reply ended: held whitespace of text is text."""
        if self._kind == _Kind.TEXT and self._held:
            self.pieces.append(Text(self._held))
        self.end_block()

    def call_start(self, name: str) -> None:
        self.end_block()
        self._name = name
        self._args = []
        self.pieces.append(CallStart(name))

    def args(self, text: str) -> None:
        if text:
            self._args.append(text)
            self.pieces.append(CallArgs(text))

    def call_end(self) -> None:
        """The call is complete: its arguments must be one JSON object.

        Raises:
            ToolCallError: they are not.
        """
        text = "".join(self._args)
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ToolCallError(f"the arguments of a call of {self._name!r} are not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ToolCallError(f"the arguments of a call of {self._name!r} are not a JSON object")
        self.pieces.append(CallEnd())
        self.calls += 1
        self.in_call = False


Reader = Callable[[Stream, Out], Generator[None, None, None]]
"""A whole reply's reader: takes text from the stream and puts pieces out until the end."""


@attrs.define(eq=False)
class CoroutineParser:
    """An :class:`~ringserve.formats.base.OutputParser` that runs a :data:`Reader`."""

    reader: Reader
    _stream: Stream = attrs.field(init=False, factory=Stream)
    _out: Out = attrs.field(init=False, factory=Out)
    _run: Generator[None, None, None] | None = attrs.field(init=False, default=None)
    _done: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        # The reader runs up to its first wait, so the state before any text is its own (a
        # reply that starts inside the thinking block is in_reasoning from the start); with
        # no text it puts nothing out, and whatever it would is kept for the first feed.
        self._run = self.reader(self._stream, self._out)
        try:
            next(self._run)
        except StopIteration:
            self._done = True

    @property
    def in_call(self) -> bool:
        return self._out.in_call

    @property
    def in_reasoning(self) -> bool:
        return self._out.in_reasoning

    @property
    def calls(self) -> int:
        """Calls completed so far."""
        return self._out.calls

    def feed(self, text: str) -> list[Piece]:
        self._stream.compact()
        self._stream.text += text
        return self._step()

    def flush(self) -> list[Piece]:
        """See :meth:`~ringserve.formats.base.OutputParser.flush`: a reply cut inside a call
        is not an error here (:attr:`in_call` stays true; the caller decides)."""
        self._stream.ended = True
        pieces: list[Piece] = []
        try:
            pieces = self._step()
        except ToolCallError:
            if not self._out.in_call:
                raise
        self._out.finish()
        return pieces + self._take()

    def _step(self) -> list[Piece]:
        """Run the reader until it waits; return the pieces it put out."""
        assert self._run is not None
        if not self._done:
            try:
                next(self._run)
            except StopIteration:
                self._done = True
            except ToolCallError:
                self._done = True
                raise
        return self._take()

    def _take(self) -> list[Piece]:
        pieces, self._out.pieces = self._out.pieces, []
        return pieces


@lru_cache(maxsize=256)
def _matcher(markers: tuple[str, ...]) -> tuple[re.Pattern[str], frozenset[str], int, dict[str, tuple[str, ...]]]:
    """The search pattern of ``markers`` (longest first), their proper prefixes, the longest
    length, and for each marker the longer markers it starts."""
    ordered = sorted(markers, key=len, reverse=True)
    prefixes = frozenset(m[:k] for m in markers for k in range(1, len(m)))
    longer = {m: tuple(o for o in markers if len(o) > len(m) and o.startswith(m)) for m in markers}
    return re.compile("|".join(re.escape(m) for m in ordered)), prefixes, max(map(len, markers)), longer


def _held(tail: str, prefixes: frozenset[str], longest: int) -> int:
    """The length of the longest end of ``tail`` that is a proper prefix of a marker."""
    for k in range(min(len(tail), longest - 1), 0, -1):
        if tail[-k:] in prefixes:
            return k
    return 0


def until(
    s: Stream, markers: Sequence[str], emit: Callable[[str], None], *, consume: bool = True
) -> Generator[None, None, str | None]:
    """Pass text to ``emit`` up to the first of ``markers``; return that marker (consumed
    unless ``consume`` is False), or None at the end of the reply (all text passed on; with no
    markers, text is passed on as it comes)."""
    if not markers:
        while True:
            if s.pos < len(s.text):
                emit(s.text[s.pos :])
                s.pos = len(s.text)
            if s.ended:
                return None
            yield
    pattern, prefixes, longest, longer = _matcher(tuple(markers))
    while True:
        m = pattern.search(s.text, s.pos)
        if m is not None:
            if m.start() > s.pos:
                emit(s.text[s.pos : m.start()])
            s.pos = m.start()
            rest = s.text[s.pos :]
            if not s.ended and any(o.startswith(rest) for o in longer[m.group()]):
                yield  # a longer marker may still come
                continue
            s.pos = m.end() if consume else m.start()
            return m.group()
        keep = 0 if s.ended else _held(s.text[s.pos :], prefixes, longest)
        end = len(s.text) - keep
        if end > s.pos:
            emit(s.text[s.pos : end])
            s.pos = end
        if s.ended:
            return None
        yield


def take_until(s: Stream, markers: Sequence[str], limit: int, what: str) -> Generator[None, None, tuple[str, str]]:
    """The text up to the first of ``markers`` (consumed) and that marker.

    Raises:
        ToolCallError: more than ``limit`` characters without a marker, or the end of the reply.
    """
    parts: list[str] = []
    size = 0

    def keep(text: str) -> None:
        nonlocal size
        parts.append(text)
        size += len(text)
        if size > limit:
            raise ToolCallError(f"{what} does not end within {limit} characters: {''.join(parts)[:80]!r}")

    marker = yield from until(s, markers, keep)
    if marker is None:
        raise ToolCallError(f"the reply ended inside {what}")
    return "".join(parts), marker


def peek(s: Stream, markers: Sequence[str]) -> Generator[None, None, str | None]:
    """The marker of ``markers`` the unconsumed text starts with (not consumed), or None when
    it cannot start with any of them (or the reply ended first)."""
    while True:
        rest = s.text[s.pos : s.pos + max(map(len, markers))]
        undecided = not s.ended and any(len(m) > len(rest) and m.startswith(rest) for m in markers)
        if not undecided:
            for m in sorted(markers, key=len, reverse=True):
                if rest.startswith(m):
                    return m
            if s.ended or not any(m.startswith(rest) for m in markers):
                return None
        yield


def accept(s: Stream, marker: str) -> Generator[None, None, bool]:
    """Consume ``marker`` if the text starts with it."""
    if (yield from peek(s, (marker,))) is None:
        return False
    s.pos += len(marker)
    return True


def expect(s: Stream, marker: str, where: str) -> Generator[None, None, None]:
    """Consume ``marker``.

    Raises:
        ToolCallError: the text does not start with it (``where`` says what was read).
    """
    if not (yield from accept(s, marker)):
        raise ToolCallError(f"{where}: expected {marker!r}, got {s.rest()[:40]!r}")


def closing(s: Stream, marker: str, where: str) -> Generator[None, None, None]:
    """Consume whitespace and ``marker``, which closes something already complete: at the end
    of the reply it may be missing or cut.

    Raises:
        ToolCallError: other text instead.
    """
    yield from skip_ws(s)
    if (yield from accept(s, marker)):
        return
    if not cut(s, (marker,)):
        raise ToolCallError(f"{where}: expected {marker!r}, got {s.rest()[:40]!r}")
    s.pos = len(s.text)


def cut(s: Stream, markers: Sequence[str]) -> bool:
    """The reply ended here, or inside one of ``markers`` (what is left is the start of one)."""
    rest = s.text[s.pos :]
    return s.ended and (not rest or any(m.startswith(rest) for m in markers))


def skip_ws(s: Stream) -> Generator[None, None, None]:
    """Consume whitespace up to the next other character (or the end of the reply)."""
    while True:
        rest = s.text[s.pos :]
        stripped = rest.lstrip()
        s.pos += len(rest) - len(stripped)
        if stripped or s.ended:
            return
        yield


def json_value(s: Stream, emit: Callable[[str], None], where: str) -> Generator[None, None, None]:
    """Pass one JSON value's text to ``emit`` as it comes (not checked beyond its bounds:
    brackets, strings; a number or literal ends at the first character that cannot go on).

    Raises:
        ToolCallError: the reply ended inside the value, or it does not start like a value.
    """
    yield from skip_ws(s)
    if s.pos >= len(s.text):
        raise ToolCallError(f"the reply ended before {where}")
    first = s.text[s.pos]
    if first not in '{["':
        while True:
            m = _SCALAR.match(s.text, s.pos)
            assert m is not None
            if m.end() < len(s.text) or s.ended:
                if m.end() == s.pos:
                    raise ToolCallError(f"{where} is not a JSON value: {s.rest()[:40]!r}")
                emit(m.group())
                s.pos = m.end()
                return
            yield
    scan = JsonScan()
    while True:
        end = scan.end(s.text[s.pos :])
        stop = len(s.text) if end is None else s.pos + end
        if stop > s.pos:
            emit(s.text[s.pos : stop])
            s.pos = stop
        if end is not None:
            return
        if s.ended:
            raise ToolCallError(f"the reply ended inside {where}")
        yield


_SCALAR = re.compile(r"[-+.\w]*")


def json_string(s: Stream, where: str) -> Generator[None, None, str]:
    """Read one JSON string; return its value.

    Raises:
        ToolCallError: not a JSON string.
    """
    yield from skip_ws(s)
    parts: list[str] = []
    yield from json_value(s, parts.append, where)
    text = "".join(parts)
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, str):
        raise ToolCallError(f"{where} is not a JSON string: {text[:40]!r}")
    return value
