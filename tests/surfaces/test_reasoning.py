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
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ChatMessage,
    Effort,
    Failure,
    Finish,
    GenerationRequest,
    ReasoningConfig,
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
from ringserve.surfaces.base import read_request
from ringserve.surfaces.registry import ANTHROPIC, OPENAI, SURFACES
from ringserve.surfaces.responses import RESPONSES
from tests.engine.test_runner import generate, serving
from tests.engine.test_runner_formats import random_split
from tests.http.test_reasoning import said_by_answer, said_by_stream

SIGNER = ReasoningSigner.from_text(new_key())
IDS = {"anthropic": "msg_" + "1" * 24, "openai": "chatcmpl-" + "2" * 24, "responses": "resp_" + "3" * 24}
#: Each surface in each way it shows reasoning (the echo of a request that asks for it).
SHOWN = [("anthropic", ""), ("anthropic", '{"thinking_display":"omitted"}'), ("openai", ""),
         ("responses", ""),
         ("responses", '{"reasoning":{"summary":"auto"},"include":["reasoning.encrypted_content"]}')]
#: Where a resume starts: after the first delta of the thinking, after the first fragment of the call.
INSIDE = {"anthropic": ('"thinking_delta"', '"input_json_delta"'),
          "openai": ('"reasoning_content"', '"arguments":"'),
          "responses": ("\"response.reasoning_", "arguments.delta")}


async def events_of(family: str, seed: int) -> list[Any]:
    engine = FakeEngine(chat_format=family, reply=bench_reply(family, FAMILIES[family], 8),
                        split=random_split(seed))
    request = GenerationRequest((ChatMessage("user", "weather?"),), 400, SamplingParams(temperature=0),
                                tools=tuple(TOOLS))
    async with serving(engine) as runner:
        events, _text, _terminal, _gen = await generate(runner, request)
    return events


def produced(surface: Any, message_id: str, events: list[Any]) -> tuple[list[bytes], Producer]:
    """The entries the server's producer appends for ``events`` (a 10 ms coalescing window, one
    event every 4 ms), and the producer."""
    producer = Producer(message_id, surface.renderer(message_id, "fake", 1700000000, True), Usage(9, 0),
                        flush_seconds=0.01, flush_tokens=16, persist_seconds=math.inf, retry_ms=3000)
    entries = list(producer.start(0.0).entries)
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
        answer = httpx.Response(200, json=surface.message_json(view))
        assert said_by_answer(name, answer) == (text, reasoning, calls)
        # a resume inside the thinking and inside the call
        datas = [entry.split(b"\ndata: ", 1)[1] for entry in entries]
        cuts = [next((i for i, data in enumerate(datas) if marker.encode() in data), None)
                for marker in INSIDE[name]]
        assert cuts[1] is not None and (cuts[0] is not None) == bool(reasoning), (name, echo)
        for cut in cuts:
            if cut is not None:
                said_by_stream(name, b"".join(entries[cut + 1:]), first=cut + 1)
        # the stream rebuilt from the store's trace: the same bytes
        fresh = SURFACES.by_name(name).restored(echo, SIGNER).renderer(IDS[name], "fake", 1700000000, True)
        rebuilt = replay(IDS[name], fresh, Usage(9, 0), snap.content, snap.trace, events[-1], 3000)
        assert list(rebuilt) == entries


def test_a_thinking_blocks_signature_restores_it() -> None:
    """What the Anthropic stream signs is what a later request's history restores: the text with
    its signature, or (display omitted) the sealed signature alone."""
    events = _thinking_events("Plan: 👋 then go.")
    for echo, text in (("", "Plan: 👋 then go."), ('{"thinking_display":"omitted"}', "")):
        surface = SURFACES.by_name("anthropic").restored(echo, SIGNER)
        entries, _ = produced(surface, IDS["anthropic"], events)
        deltas = [json.loads(e.split(b"\ndata: ", 1)[1])["delta"]
                  for e in entries if b"content_block_delta" in e]
        (signature,) = [d["signature"] for d in deltas if d["type"] == "signature_delta"]
        assert SIGNER.restore(text, signature) == "Plan: 👋 then go."
        assert ReasoningSigner.from_text(new_key()).restore(text, signature) is None


def _thinking_events(text: str) -> list[Any]:
    """A thinking block of ``text`` cut in four deltas, then an answer."""
    rng = random.Random(7)
    cuts = sorted(rng.sample(range(1, len(text)), 3))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return [BlockStart(0, BlockKind.REASONING), *(BlockDelta(0, p, 1) for p in pieces), BlockStop(0),
            BlockStart(1, BlockKind.TEXT), BlockDelta(1, "ok", 1), BlockStop(1),
            Finish(StopReason.END, Usage(9, 6, reasoning_tokens=4))]


@pytest.mark.parametrize(("name", "echo"), SHOWN)
@pytest.mark.parametrize("end", ["max_tokens", "cancel", "failure"])
def test_a_reply_cut_inside_its_thinking_ends_as_the_sdks_expect(name: str, echo: str, end: str) -> None:
    """Cut by ``max_tokens`` (the runner stops the block), a cancel (the producer stops it) or a
    failure (the block stays open, the in-band error ends the stream)."""
    cut: list[Any] = [BlockStart(0, BlockKind.REASONING), BlockDelta(0, "Hmm, ", 1),
                      BlockDelta(0, "let me", 1)]
    usage = Usage(9, 3, reasoning_tokens=3)
    ending = {"max_tokens": [BlockStop(0), Finish(StopReason.MAX_TOKENS, usage)],
              "cancel": [Finish(StopReason.CANCELLED, usage)],
              "failure": [Failure(ErrorKind.API_ERROR, "the engine failed", usage, retryable=True)]}[end]
    surface = SURFACES.by_name(name).restored(echo, SIGNER)
    entries, producer = produced(surface, IDS[name], [*cut, *ending])
    text, reasoning, calls = said_by_stream(name, b"".join(entries))  # ends with its terminal event
    assert (text, reasoning, calls) == ("", "" if "omitted" in echo else "Hmm, let me", [])
    if end == "failure":
        return
    status = MessageStatus.CANCELLED if end == "cancel" else MessageStatus.COMPLETE
    view = MessageView(IDS[name], name, "fake", 1700000000, status, producer.snapshot().content,
                       producer.stop_reason, None, usage, echo=echo)
    answer = httpx.Response(200, json=surface.message_json(view))
    assert said_by_answer(name, answer) == (text, reasoning, calls)


# -- the controls and the reasoning handed back, as each surface reads them -------------------------

KEY = new_key()


@pytest.mark.parametrize(("value", "controls"), [
    ("none", ReasoningConfig(enabled=False)), ("minimal", ReasoningConfig(effort=Effort.MINIMAL)),
    ("low", ReasoningConfig(effort=Effort.LOW)), ("high", ReasoningConfig(effort=Effort.HIGH)),
    ("xhigh", ReasoningConfig(effort=Effort.XHIGH)), ("max", ReasoningConfig(effort=Effort.MAX)),
])
def test_openais_efforts_are_the_reasoning_controls_on_chat_and_responses(
        value: str, controls: ReasoningConfig) -> None:
    chat = read_request(OPENAI.parse_request, {"messages": [{"role": "user", "content": "hi"}],
                                               "reasoning_effort": value}, KEY)
    responses = read_request(RESPONSES.parse_request, {"input": "hi", "reasoning": {"effort": value}}, KEY)
    assert chat.request.reasoning == responses.request.reasoning == controls
    with pytest.raises(RingserveError, match="reasoning_effort: must be one of"):
        OPENAI.parse_request({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "lots"})


@pytest.mark.parametrize(("display", "omitted"), [
    (None, False), ("summarized", False), ("highlights", False), ("updates", False), ("omitted", True)])
def test_every_thinking_display_claude_code_asks_for_is_honoured(display: str | None, omitted: bool) -> None:
    """Claude Code 2.1.332 sends ``updates`` with ``--output-format stream-json`` and ``highlights``
    beside ``summarized``: each shows the thinking (whole: nothing here summarises it); ``omitted``
    withholds it."""
    thinking = {"type": "adaptive"} if display is None else {"type": "adaptive", "display": display}
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}],
            "thinking": thinking}
    parsed = read_request(ANTHROPIC.parse_request, body, KEY)
    assert parsed.ignored == ()
    assert parsed.echo == ('{"thinking_display":"omitted"}' if omitted else "")
    with pytest.raises(RingserveError, match="thinking.display: must be one of"):
        ANTHROPIC.parse_request({**body, "thinking": {"type": "adaptive", "display": "loud"}})


def test_a_responses_summary_and_encrypted_content_are_what_its_objects_show() -> None:
    body = {"input": "hi", "reasoning": {"effort": "low", "summary": "detailed", "context": "all_turns"},
            "include": ["file_search_call.results", "reasoning.encrypted_content"]}
    parsed = read_request(RESPONSES.parse_request, body, KEY)
    assert parsed.ignored == ("reasoning.context", "include[0]")
    options = RESPONSES.restored(parsed.echo, SIGNER).options
    assert (options.effort, options.summary, options.encrypted_content) == ("low", "detailed", True)
    deprecated = RESPONSES.restored(read_request(RESPONSES.parse_request, {
        "input": "hi", "reasoning": {"generate_summary": "auto"}}, KEY).echo, SIGNER).options
    assert (deprecated.summary, deprecated.encrypted_content) == ("auto", False)
    for bad, match in (({"summary": "long"}, "reasoning.summary: must be one of"),
                       (3, "reasoning: must be an object")):
        with pytest.raises(RingserveError, match=match):
            RESPONSES.parse_request({"input": "hi", "reasoning": bad})
    with pytest.raises(RingserveError, match="include: must be a list of strings"):
        RESPONSES.parse_request({"input": "hi", "include": "reasoning.encrypted_content"})


def test_chat_history_carries_an_assistants_reasoning() -> None:
    messages = [{"role": "user", "content": "hi", "reasoning_content": "not mine"},
                {"role": "assistant", "content": "A.", "reasoning_content": "Plan A."},
                {"role": "user", "content": "and?"},
                {"role": "assistant", "content": None, "reasoning": "Plan B.", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    parsed = read_request(OPENAI.parse_request, {"messages": messages, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, KEY)
    assert [m.reasoning for m in parsed.request.messages] == ["", "Plan A.", "", "Plan B.", ""]
    assert parsed.ignored == ("messages[0].reasoning_content",)
    with pytest.raises(RingserveError, match=r"messages\[1\].reasoning_content: must be a string"):
        OPENAI.parse_request({"messages": [messages[0], {**messages[1], "reasoning_content": ["x"]}]})


def test_a_reasoning_item_sent_back_restores_its_reasoning() -> None:
    """Its readable content, else the text its encrypted content carries when ringserve sealed it
    (what Codex sends back under ``store: false``: the summary and the encrypted content); a
    summary alone or another key's seal is dropped and reported."""
    signer = ReasoningSigner.from_text(KEY)

    def item(**fields: Any) -> dict[str, Any]:
        summary = [{"type": "summary_text", "text": "Plan A."}]
        return {"type": "reasoning", "id": "rs_1", "summary": summary, **fields}

    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A."}]}
    for sent, restored, ignored in [
        (item(content=[{"type": "reasoning_text", "text": "Plan A."}]), "Plan A.", ()),
        (item(encrypted_content=signer.seal("Plan A.")), "Plan A.", ()),
        (item(encrypted_content=SIGNER.seal("Plan A.")), "", ("input[1]",)),  # another server's key
        (item(encrypted_content="gAAAAABo-openai's-own"), "", ("input[1]",)),
        (item(), "", ("input[1]",)),
    ]:
        parsed = read_request(RESPONSES.parse_request, {"input": [
            {"role": "user", "content": "hi"}, sent, answer, {"role": "user", "content": "and?"}]}, KEY)
        assert parsed.request.messages[1] == ChatMessage("assistant", "A.", reasoning=restored), sent
        assert parsed.ignored == ignored
