"""What a surface's renderer is: one message's generation events in, wire events out.

The producer (``core/producer.py``) drives a renderer and appends what it returns to the
message's log; the surfaces (``surfaces/*``) implement it. ``core/sse.py`` encodes a wire
event's bytes.
"""

from __future__ import annotations

import json
from typing import Protocol, assert_never

import attrs

from ringserve.core.events import BlockDelta, BlockStart, BlockStop, Failure, Finish, GenerationEvent, Usage


SEQ_VALUE = "\x00ringserve seq\x00"
"""What a renderer puts where a ``numbered`` :class:`WireEvent`'s seq goes (its JSON is replaced by
the number; it comes before any text of the event, which is then never taken for it)."""
_SEQ_JSON = json.dumps(SEQ_VALUE)


@attrs.frozen
class WireEvent:
    """One SSE event before encoding: optional event name and its data line(s).

    ``numbered``: the data holds the JSON of :data:`SEQ_VALUE` where the event's seq (its number
    in the message's log) goes, for a format that numbers its events in their data (the Responses
    API's ``sequence_number``): the producer, which counts the seqs, fills it in (:meth:`text`).
    """

    data: str
    event: str | None = None
    numbered: bool = False

    def text(self, seq: int) -> str:
        """The data of the event with seq ``seq``."""
        return self.data.replace(_SEQ_JSON, str(seq), 1) if self.numbered else self.data


class Renderer(Protocol):
    """Turns one message's events into wire events, in order.

    ``start`` comes first, then the blocks in the order ``core/events.py``
    guarantees (``block_start``, any number of ``delta``, ``block_stop``;
    block after block), then exactly one of ``finish`` (every block stopped)
    or ``fail`` (a block may be open). Renderers are per message and hold its
    ids and what they need of its state (the open block's kind, say). The
    producer appends every wire event a renderer returns to the log, in
    order from seq 0, so the n-th wire event has seq n.

    ``keepalive`` may come between any two of these after ``start``, when nothing was written
    for a while: events that the surface's clients read as data and ignore (their idle timers
    count data events, not SSE comments); it changes nothing of the message.
    """

    def start(self, usage: Usage) -> list[WireEvent]: ...

    def block_start(self, start: BlockStart) -> list[WireEvent]: ...

    def delta(self, delta: BlockDelta) -> list[WireEvent]: ...

    def block_stop(self, stop: BlockStop) -> list[WireEvent]: ...

    def finish(self, finish: Finish) -> list[WireEvent]: ...

    def fail(self, failure: Failure) -> list[WireEvent]: ...

    def keepalive(self) -> list[WireEvent]: ...


def render(renderer: Renderer, event: GenerationEvent) -> list[WireEvent]:
    """The wire events of one generation event (after ``renderer.start``): the one exhaustive
    dispatch from event kinds to renderer methods, so a new kind is a type error here."""
    match event:
        case BlockStart():
            return renderer.block_start(event)
        case BlockDelta():
            return renderer.delta(event)
        case BlockStop():
            return renderer.block_stop(event)
        case Finish():
            return renderer.finish(event)
        case Failure():
            return renderer.fail(event)
        case _:
            assert_never(event)
