"""Every model family's reply through every surface's renderer, on plain values (issue 34, "Through
the whole server"; tests/http/test_reasoning.py takes a handful of families through HTTP).

The scripted engine plays each family's canonical reply (bench/format_parsers.py: thinking where the
family has it, text, then a call in the family's own syntax, cut into random tokens) through the
runner; its events are rendered by each surface as the server does (``core/producer.py``, with a
coalescing window), in each way the surface shows reasoning. Every event validates under the SDKs'
strict types, the non-stream answer says what the stream added up to, a stream resumed inside the
thinking or inside the call validates from there, and the stream rebuilt from the stored trace
(a log that expired) is the same bytes.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import httpx
import pytest

from bench.format_parsers import EXAMPLES, TOOLS
from bench.format_parsers import reply as bench_reply
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ChatMessage,
    Finish,
    GenerationRequest,
    SamplingParams,
    StopReason,
    Usage,
)
from ringserve.core.producer import Producer, replay
from ringserve.core.signing import ReasoningSigner, new_key
from ringserve.core.status import MessageStatus
from ringserve.core.view import MessageView
from ringserve.engine.fake import FakeEngine
from ringserve.formats.families import FAMILIES
from ringserve.surfaces.registry import SURFACES
from tests.engine.test_runner import generate, serving
from tests.engine.test_runner_formats import random_split
from tests.http.test_reasoning import said_by_answer, said_by_stream

SIGNER = ReasoningSigner.from_text(new_key())
IDS = {"anthropic": "msg_" + "1" * 24, "openai": "chatcmpl-" + "2" * 24, "responses": "resp_" + "3" * 24}
#: Each surface in each way it shows reasoning (the echo of a request that asks for it).
SHOWN = [("anthropic", ""), ("anthropic", '{"thinking_display":"omitted"}'), ("openai", ""), ("responses", ""),
         ("responses", '{"reasoning":{"summary":"auto"},"include":["reasoning.encrypted_content"]}')]
#: Where a resume starts: after the first delta of the thinking, after the first fragment of the call.
INSIDE = {"anthropic": ('"thinking_delta"', '"input_json_delta"'), "openai": ('"reasoning_content"', '"arguments":"'),
          "responses": ("\"response.reasoning_", "arguments.delta")}


async def events_of(family: str, seed: int) -> list[Any]:
    engine = FakeEngine(chat_format=family, reply=bench_reply(family, FAMILIES[family], 8), split=random_split(seed))
    request = GenerationRequest((ChatMessage("user", "weather?"),), 400, SamplingParams(temperature=0), tools=tuple(TOOLS))
    async with serving(engine) as runner:
        events, _text, _terminal, _gen = await generate(runner, request)
    return events


def produced(surface: Any, message_id: str, events: list[Any]) -> tuple[list[bytes], Producer]:
    """The entries the server's producer appends for ``events`` (a 10 ms coalescing window, one
    event every 4 ms), and the producer."""
    producer = Producer(message_id, surface.renderer(message_id, "fake", 1700000000, True), Usage(9, 0),
                        flush_seconds=0.01, flush_tokens=16, persist_seconds=math.inf, retry_ms=3000)
    entries = list(producer.start().entries)
    for i, event in enumerate(events):
        now = i * 0.004
        entries += producer.tick(now).entries
        entries += producer.event(event, getattr(event, "usage", Usage(9, i)), now).entries
    return entries, producer


@pytest.mark.parametrize("family", sorted(EXAMPLES))
async def test_every_familys_reply_on_every_surface(family: str) -> None:
    events = await events_of(family, seed=sum(map(ord, family)))
    for name, echo in SHOWN:
        surface = SURFACES.by_name(name).restored(echo, SIGNER)
        entries, producer = produced(surface, IDS[name], events)
        raw = b"".join(entries)
        text, reasoning, calls = said_by_stream(name, raw)
        assert calls == [("get_weather", {"city": "Paris", "days": 3})], (name, echo)
        thinks = FAMILIES[family].reasoning is not None and family != "functionary-v3.2"
        assert bool(reasoning) == (thinks and "omitted" not in echo), (name, echo, reasoning)
        # the answer says the same
        snap = producer.snapshot()
        view = MessageView(IDS[name], name, "fake", 1700000000, MessageStatus.COMPLETE, snap.content,
                           producer.stop_reason, None, producer.usage, echo=echo)
        assert said_by_answer(name, httpx.Response(200, json=surface.message_json(view))) == (text, reasoning, calls)
        # a resume inside the thinking and inside the call
        datas = [entry.split(b"\ndata: ", 1)[1] for entry in entries]
        cuts = [next((i for i, data in enumerate(datas) if marker.encode() in data), None) for marker in INSIDE[name]]
        assert cuts[1] is not None and (cuts[0] is not None) == bool(reasoning), (name, echo)
        for cut in cuts:
            if cut is not None:
                said_by_stream(name, b"".join(entries[cut + 1:]), first=cut + 1)
        # the stream rebuilt from the store's trace: the same bytes
        fresh = SURFACES.by_name(name).restored(echo, SIGNER).renderer(IDS[name], "fake", 1700000000, True)
        assert list(replay(IDS[name], fresh, Usage(9, 0), snap.content, snap.trace, events[-1], 3000)) == entries


def test_a_thinking_blocks_signature_restores_it() -> None:
    """What the Anthropic stream signs is what a later request's history restores: the text with
    its signature, or (display omitted) the sealed signature alone."""
    events = _thinking_events("Plan: 👋 then go.")
    for echo, text in (("", "Plan: 👋 then go."), ('{"thinking_display":"omitted"}', "")):
        surface = SURFACES.by_name("anthropic").restored(echo, SIGNER)
        entries, _ = produced(surface, IDS["anthropic"], events)
        deltas = [json.loads(e.split(b"\ndata: ", 1)[1])["delta"] for e in entries if b"content_block_delta" in e]
        (signature,) = [d["signature"] for d in deltas if d["type"] == "signature_delta"]
        assert SIGNER.restore(text, signature) == "Plan: 👋 then go."
        assert ReasoningSigner.from_text(new_key()).restore(text, signature) is None


def _thinking_events(text: str) -> list[Any]:
    """A thinking block of ``text`` cut in four deltas, then an answer."""
    rng = random.Random(7)
    cuts = sorted(rng.sample(range(1, len(text)), 3))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [BlockStart(0, BlockKind.REASONING), *(BlockDelta(0, p, 1) for p in pieces), BlockStop(0),
            BlockStart(1, BlockKind.TEXT), BlockDelta(1, "ok", 1), BlockStop(1),
            Finish(StopReason.END, Usage(9, 6, reasoning_tokens=4))]
