"""Test helpers: read an SSE response with the project's own parser; write one as the server does."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import httpx

from ringserve.core.events import ChatMessage, GenerationRequest, SamplingParams, ToolChoice, ToolSpec, Usage
from ringserve.core.producer import Producer
from ringserve.core.sampling import LLAMA_SERVER_DEFAULTS, ResolvedSampling, resolve_sampling
from ringserve.core.sse import ServerSentEvent, SSEParser
from ringserve.core.render import WireEvent
from ringserve.engine.protocol import ChatPrompt

ANTHROPIC_BODY = {"model": "any", "max_tokens": 64, "messages": [{"role": "user", "content": "hello"}]}
OPENAI_BODY = {"model": "any", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 64}


def sampler(**fields: Any) -> ResolvedSampling:
    """Sampler settings for an engine's ``begin``: ``fields`` over llama-server's defaults."""
    return resolve_sampling(SamplingParams(**fields), LLAMA_SERVER_DEFAULTS)


#: Greedy sampling, nothing else changing the logits.
GREEDY = sampler(temperature=0)


def chat_prompt(
    engine: Any, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = (), choice: ToolChoice = ToolChoice()
) -> ChatPrompt:
    """What ``engine.tokenize_chat`` gives for a conversation with ``tools``."""
    return engine.tokenize_chat(GenerationRequest(tuple(messages), None, tools=tuple(tools), tool_choice=choice))


def prompt_tokens(
    engine: Any, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = (), choice: ToolChoice = ToolChoice()
) -> list[int]:
    """The prompt's token ids of :func:`chat_prompt`."""
    return list(chat_prompt(engine, messages, tools, choice).tokens)


async def sse_events(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> tuple[httpx.Response, list[ServerSentEvent], bytes]:
    """Send a request and read its whole SSE body: (response, events, raw bytes)."""
    parser = SSEParser()
    events: list[ServerSentEvent] = []
    raw = bytearray()
    async with client.stream(method, url, **kwargs) as resp:
        async for chunk in resp.aiter_raw():
            raw += chunk
            events += parser.feed(chunk)
    return resp, events, bytes(raw)


def anthropic_text(events: list[ServerSentEvent]) -> str:
    return "".join(
        json.loads(e.data)["delta"]["text"] for e in events if e.event == "content_block_delta"
    )


def openai_text(events: list[ServerSentEvent]) -> str:
    out = []
    for e in events:
        if e.data == "[DONE]":
            continue
        for choice in json.loads(e.data).get("choices", []):
            out.append(choice["delta"].get("content") or "")
    return "".join(out)


class RecordingRenderer:
    """A ``Renderer`` (``surfaces/base.py``) that spells each event as one readable wire event:
    ``start``, ``block_start 0 text``, ``delta 0 'hi'``, ``block_stop 0``, ``finish end``,
    ``fail api_error``; for producer tests that read what reached the log."""

    def start(self, usage):
        return [WireEvent("start")]

    def block_start(self, start):
        return [WireEvent(f"block_start {start.index} {start.kind.value}")]

    def delta(self, delta):
        return [WireEvent(f"delta {delta.index} {delta.text!r}")]

    def block_stop(self, stop):
        return [WireEvent(f"block_stop {stop.index}")]

    def finish(self, finish):
        return [WireEvent(f"finish {finish.stop_reason.value}")]

    def fail(self, failure):
        return [WireEvent(f"fail {failure.kind.name.lower()}")]

    def keepalive(self):
        return [WireEvent("keepalive")]


def entry_data(entries) -> list[str]:
    """The data of SSE entries made by the producer (one data line each), in order."""
    return [e.data for entry in entries for e in SSEParser().feed(entry)]


def rendered(surface, events, *, message_id: str, usage=None, model: str = "fake", include_usage: bool = True) -> bytes:
    """The event stream the server writes for ``events`` on ``surface`` (a ``surfaces/`` surface):
    its renderer driven by the server's own producer (``core/producer.py``, no coalescing), each
    entry encoded by ``core/sse.py`` with its id ``<message_id>:<seq>``."""
    usage = usage or Usage(5, 0)
    renderer = surface.renderer(message_id, model, 1700000000, include_usage)
    producer = Producer(message_id, renderer, usage, flush_seconds=0.0, flush_tokens=1, persist_seconds=math.inf)
    entries = list(producer.start(0.0).entries)
    for event in events:
        entries += producer.event(event, getattr(event, "usage", usage), 0.0).entries
    return b"".join(entries)
