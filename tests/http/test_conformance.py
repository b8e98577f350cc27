"""Conformance (issue 12): every event and answer, over every way a message ends, judged by the SDKs.

The oracle is ``tests/support/conformance.py``: the official SDKs' SSE decoders and their pydantic types
in strict mode. Every case runs on both surfaces, on the fake engine: end of turn, max_tokens, a
stop sequence, a cancel, a refusal, an in-band error, the drain, a resume, the reconnect hint; then
heartbeats in every silence (queue wait, prefill, a slow safety checker, after a resume), the
overload answers' retry headers, and the SDKs' own retry and stream classes over all of it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from ringserve.core.sse import SSEParser, encode_comment
from ringserve.engine.fake import DEFAULT_REPLY
from ringserve.core.status import CancelReason
from tests.support.conformance import PATHS, Seen, check_answer, check_stream, sdk_answer, sdk_stream_text, stream_bytes
from tests.support.server import fake_config, running_server
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY
from tests.http.test_metrics import scrape

SURFACES = ["anthropic", "openai"]
ASYNC = {"Prefer": "respond-async"}
LONG = " ".join(f"w{i}" for i in range(200))  # about 250 fake tokens
PING = encode_comment("ping")
SDK_REQUEST = {"max_tokens": 64, "messages": [{"role": "user", "content": "hello"}]}
HINT = re.compile(rb": reconnect (\{.*\})\n\Z")

#: How each ending is spelled: (Anthropic stop_reason, OpenAI finish_reason).
STOP_REASONS = {
    "end": ("end_turn", "stop"),
    "max_tokens": ("max_tokens", "length"),
    "stop_sequence": ("stop_sequence", "stop"),
    "refusal": ("refusal", "content_filter"),
    "cancel": ("end_turn", "stop"),
}


def stop_reason(surface: str, ending: str) -> str:
    return STOP_REASONS[ending][surface == "openai"]


def body(surface: str, *, stream: bool, content: str = "hello", **extra: Any) -> dict[str, Any]:
    base = ANTHROPIC_BODY if surface == "anthropic" else OPENAI_BODY
    return {**base, "messages": [{"role": "user", "content": content}], "stream": stream, **extra}


async def stream_and_answer(client: httpx.AsyncClient, surface: str, **extra: Any) -> tuple[Seen, Seen]:
    """The same request streamed (OpenAI: with and without include_usage) and not; each checked."""
    path = PATHS[surface]
    variants = [{}] if surface == "anthropic" else [{}, {"stream_options": {"include_usage": True}}]
    streams = []
    for variant in variants:
        resp, raw = await stream_bytes(client, "POST", path, json=body(surface, stream=True, **extra, **variant))
        assert resp.status_code == 200, raw
        streams.append(check_stream(surface, raw))
    assert len({(s.text, s.stop_reason, s.cancelled) for s in streams}) == 1
    return streams[0], check_answer(surface, await client.post(path, json=body(surface, stream=False, **extra)))


def has_text(surface: str, raw_events: list[Any]) -> bool:
    """Whether these parsed SSE events hold reply text yet."""
    for event in raw_events:
        if event.data == "[DONE]":
            continue
        data = json.loads(event.data)
        if surface == "anthropic" and data.get("type") == "content_block_delta":
            return True
        if surface == "openai" and any((c.get("delta") or {}).get("content") for c in data.get("choices", [])):
            return True
    return False


# -- endings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("ending", ["end", "max_tokens", "stop_sequence"])
async def test_natural_endings(fake_server, surface: str, ending: str) -> None:
    _state, client = fake_server
    stop_key = "stop_sequences" if surface == "anthropic" else "stop"
    extra = {"end": {}, "max_tokens": {"max_tokens": 3}, "stop_sequence": {stop_key: ["fox"]}}[ending]
    streamed, answered = await stream_and_answer(client, surface, **extra)
    assert streamed.stop_reason == answered.stop_reason == stop_reason(surface, ending)
    assert streamed.text == answered.text
    assert DEFAULT_REPLY.startswith(streamed.text) and streamed.text
    assert not streamed.cancelled and not answered.cancelled and streamed.error is None


@pytest.mark.parametrize("surface", SURFACES)
async def test_refusal(tmp_path: Path, surface: str) -> None:
    config = fake_config(tmp_path, stream={"flush_ms": 0.0}, safety={"window_tokens": 2, "patterns": ["lazy"]})
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        streamed, answered = await stream_and_answer(client, surface)
    assert streamed.stop_reason == answered.stop_reason == stop_reason(surface, "refusal")
    assert streamed.text == answered.text and "lazy" not in streamed.text


@pytest.mark.parametrize("surface", SURFACES)
async def test_in_band_error(tmp_path: Path, surface: str) -> None:
    async with running_server(fake_config(tmp_path), fail_after_tokens=3) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        resp, raw = await stream_bytes(client, "POST", PATHS[surface], json=body(surface, stream=True))
        streamed = check_stream(surface, raw)
        answer = await client.post(PATHS[surface], json=body(surface, stream=False))
    assert streamed.error is not None and streamed.stop_reason is None
    assert answer.status_code == 500 and check_answer(surface, answer).error is not None


async def _end_while_streaming(tmp_path: Path, surface: str, end) -> tuple[Seen, httpx.Response, Any]:
    """One message read by a stream and by a non-stream request at once; ``end(state, id)`` once text flows.

    Returns the checked stream, the non-stream answer and the server state.
    """
    config = fake_config(tmp_path, stream={"flush_ms": 0.0})
    async with running_server(config, step_seconds=0.01, reply=LONG) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        path, request = PATHS[surface], body(surface, stream=False)
        key = {"Idempotency-Key": f"end-{surface}"}  # the same key and body: the non-stream request waits for it
        created = (await client.post(path, json=request, headers={**ASYNC, **key})).json()
        text_flows = trio.Event()
        got: dict[str, Any] = {}

        async def read_stream() -> None:
            parser, raw, events = SSEParser(), bytearray(), []
            async with client.stream("GET", created["stream_url"]) as resp:
                async for chunk in resp.aiter_raw():
                    raw += chunk
                    events += parser.feed(chunk)
                    if has_text(surface, events):
                        text_flows.set()
            got["raw"] = bytes(raw)

        async def wait_for_answer() -> None:
            got["answer"] = await client.post(path, json=request, headers=key)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stream)
            nursery.start_soon(wait_for_answer)
            await text_flows.wait()
            await end(state, client, created["id"])
        return check_stream(surface, got["raw"]), got["answer"], created["id"]


@pytest.mark.parametrize("surface", SURFACES)
async def test_cancel(tmp_path: Path, surface: str) -> None:
    """A cancel ends the turn with a stop reason of the SDKs' types, marked ringserve_cancelled."""
    async def cancel(_state, client, message_id):
        assert (await client.post(f"/v1/messages/{message_id}/cancel")).json()["status"] == "cancelled"

    streamed, answer, _ = await _end_while_streaming(tmp_path, surface, cancel)
    answered = check_answer(surface, answer)
    assert answer.status_code == 200
    assert streamed.stop_reason == answered.stop_reason == stop_reason(surface, "cancel")
    assert streamed.cancelled and answered.cancelled
    assert streamed.text == answered.text and 0 < len(streamed.text) < len(LONG)


@pytest.mark.parametrize("surface", SURFACES)
async def test_drain(tmp_path: Path, surface: str) -> None:
    """The drain ends a generation with a retryable in-band error; waiting and new requests get a 503."""
    after: dict[str, httpx.Response] = {}

    async def drain(state, client, _message_id):
        state.hub.drain()
        after["new"] = await client.post(PATHS[surface], json=body(surface, stream=True))
        state.hub.cancel_all(CancelReason.DRAIN)

    streamed, answer, _ = await _end_while_streaming(tmp_path, surface, drain)
    assert streamed.error is not None and streamed.stop_reason is None and streamed.text
    for resp in (answer, after["new"]):
        assert resp.status_code == 503, resp.text
        assert check_answer(surface, resp).error is not None


@pytest.mark.parametrize("surface", SURFACES)
async def test_resume(fake_server, surface: str) -> None:
    """A replay from the start is the stream again; a resume after each event continues it."""
    _state, client = fake_server
    resp, raw = await stream_bytes(client, "POST", PATHS[surface], json=body(surface, stream=True))
    whole = check_stream(surface, raw)
    message_id = resp.headers["x-message-id"]
    events = SSEParser().feed(raw)
    _, replay = await stream_bytes(client, "GET", f"/v1/messages/{message_id}/stream")
    assert replay == raw
    for event in events[:-1]:
        _, rest = await stream_bytes(client, "GET", f"/v1/messages/{message_id}/stream",
                                     headers={"Last-Event-ID": event.id})
        assert raw.endswith(rest)
        head = check_stream(surface, raw[: len(raw) - len(rest)], complete=False)
        assert head.text + check_stream(surface, rest, resumed=True).text == whole.text


@pytest.mark.parametrize("surface", SURFACES)
async def test_reconnect_hint(tmp_path: Path, surface: str) -> None:
    """Each connection cut by max_stream_seconds holds only valid events and ends with the hint comment."""
    config = fake_config(tmp_path, server={"max_stream_seconds": 0.3}, stream={"flush_ms": 0.0})
    async with running_server(config, step_seconds=0.01, reply=LONG) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        resp, raw = await stream_bytes(client, "POST", PATHS[surface], json=body(surface, stream=True, max_tokens=1000))
        message_id, text, hints = resp.headers["x-message-id"], "", 0
        while (hint := HINT.search(raw)) is not None:
            seen = check_stream(surface, raw, resumed=hints > 0, complete=False)
            text += seen.text
            hints += 1
            last = json.loads(hint.group(1))["last_event_id"]
            assert last == SSEParser().feed(raw)[-1].id
            _, raw = await stream_bytes(client, "GET", f"/v1/messages/{message_id}/stream",
                                        headers={"Last-Event-ID": last})
            assert hints < 50
        text += check_stream(surface, raw, resumed=hints > 0).text
    assert hints >= 1 and text == LONG


# -- heartbeats in every silence -------------------------------------------------------------


def _reply(text: str) -> str:
    """The fake's reply: about 1.5 s of tokens at 0.01 s a step for "long" (a request that holds the slot)."""
    return LONG[:600] if text == "long" else DEFAULT_REPLY


SILENCES = {
    # name: (config sections, fake engine settings)
    "prefill": ({}, {"prefill_seconds": 1.3}),
    "queue": ({"engine": {"slots": 1}}, {"step_seconds": 0.01, "reply": _reply}),
    "safety": ({"safety": {"window_tokens": 2, "checker": "tests.support.safety_checkers:slow_first"}}, {}),
    "resume": ({}, {"prefill_seconds": 1.3}),
    "error": ({}, {"prefill_seconds": 1.3, "fail_after_tokens": 2}),  # pings, then an in-band error
}


async def _stream_through(client: httpx.AsyncClient, surface: str, silence: str) -> list[tuple[bytes, bool]]:
    """Stream one request through ``silence``: each connection's body, and whether it was a resume."""
    path = PATHS[surface]
    if silence == "queue":  # a long request takes the only slot first
        await client.post(path, json=body(surface, stream=False, content="long", max_tokens=1000), headers=ASYNC)
    if silence != "resume":
        return [((await stream_bytes(client, "POST", path, json=body(surface, stream=True)))[1], False)]
    created = (await client.post(path, json=body(surface, stream=True), headers=ASYNC)).json()
    url = f"/v1/messages/{created['id']}/stream"
    out: list[tuple[bytes, bool]] = []

    async def read(last_event_id: str | None) -> None:
        headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id}
        out.append(((await stream_bytes(client, "GET", url, headers=headers))[1], last_event_id is not None))

    async with trio.open_nursery() as nursery:  # both read while the prompt is prefilled
        nursery.start_soon(read, None)
        nursery.start_soon(read, f"{created['id']}:0")
    return out


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("silence", sorted(SILENCES))
async def test_heartbeats_in_every_silence_are_invisible_to_the_sdks(tmp_path: Path, surface: str, silence: str) -> None:
    """heartbeat_interval 1 s and a silence longer than that after the first event: pings flow (the
    readers' comments; on Anthropic the producer's ``ping`` events come first, and a comment only
    when both are due at once), and the SDKs' decoders see exactly the events (the OpenAI SDK used
    to parse the ping's blank line as JSON)."""
    sections, engine = SILENCES[silence]
    config = fake_config(tmp_path, server={"heartbeat_interval": 1.0}, **sections)
    async with running_server(config, **engine) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        bodies = await _stream_through(client, surface, silence)
    for raw, resumed in bodies:
        seen = check_stream(surface, raw, resumed=resumed)
        assert PING in raw or seen.pings, raw[:300]
        if silence == "error":
            assert seen.error is not None and seen.stop_reason is None
        else:
            assert seen.stop_reason == stop_reason(surface, "end") and DEFAULT_REPLY.endswith(seen.text)
    if surface == "openai":  # a comment after an id: the old crash
        assert any(raw.index(PING) > raw.index(b"id: ") for raw, _ in bodies)


# -- overload answers and the SDKs' retry -----------------------------------------------------


async def test_overload_answers_carry_retry_headers(tmp_path: Path) -> None:
    """Queue full (Anthropic 529, OpenAI 503), too many readers (429), draining (503): all say when to retry."""
    config = fake_config(tmp_path, engine={"slots": 1, "queue_size": 0}, limits={"max_readers_per_message": 1})
    async with running_server(config, step_seconds=0.01, reply=_reply) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        busy = (await client.post("/v1/messages", json=body("anthropic", stream=False, content="long", max_tokens=1000),
                                  headers=ASYNC)).json()
        answers = []
        for surface in SURFACES:
            answers.append((surface, 529 if surface == "anthropic" else 503,
                            await client.post(PATHS[surface], json=body(surface, stream=False))))
        async with client.stream("GET", busy["stream_url"]) as first:
            assert first.status_code == 200
            answers.append(("anthropic", 429, await client.get(busy["stream_url"])))
        state.hub.drain()
        for surface in SURFACES:
            answers.append((surface, 503, await client.post(PATHS[surface], json=body(surface, stream=False))))
    for surface, status, resp in answers:
        assert resp.status_code == status, (surface, resp.text)
        assert check_answer(surface, resp).error is not None
        assert (resp.headers["retry-after"], resp.headers["retry-after-ms"]) == ("1", "1000")


async def test_a_body_over_the_size_limit_is_the_413_each_sdk_knows(tmp_path: Path) -> None:
    """Over ``server.max_body_bytes``, streamed or not: a 413 valid for the oracle (Anthropic:
    ``request_too_large``, the type its docs give), which each SDK's client raises as its 413 error."""
    config = fake_config(tmp_path, server={"max_body_bytes": 2000})
    big = "x" * 4000
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        for surface in SURFACES:
            for stream in (False, True):
                resp = await client.post(PATHS[surface], json=body(surface, stream=stream, content=big))
                assert resp.status_code == 413, resp.text
                error = check_answer(surface, resp).error
                assert error is not None and "2000 bytes" in error["message"]
                assert error["type" if surface == "anthropic" else "code"] == "request_too_large"
        request = {**SDK_REQUEST, "messages": [{"role": "user", "content": big}]}
        for sdk, raised in (("anthropic", anthropic.ContentTooLargeError), ("openai", openai.APIStatusError)):
            with pytest.raises(raised) as caught:
                await trio.to_thread.run_sync(lambda: sdk_answer(sdk, state.urls[0], **request))
            assert caught.value.status_code == 413
            assert getattr(caught.value, "type" if sdk == "anthropic" else "code") == "request_too_large"


@pytest.mark.parametrize("sdk", SURFACES)
async def test_the_sdks_retry_a_full_queue_after_the_given_delay(tmp_path: Path, sdk: str, caplog) -> None:
    """slots 1, no queue: the SDK (max_retries 8) is refused while the slot is busy, waits exactly what
    retry-after-ms says each time, and gets its answer once the slot is free."""
    caplog.set_level(logging.INFO, logger=sdk)
    config = fake_config(tmp_path, engine={"slots": 1, "queue_size": 0})
    async with running_server(config, step_seconds=0.01, reply=_reply) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        await client.post("/v1/messages", json=body("anthropic", stream=False, content="long", max_tokens=1000), headers=ASYNC)
        text, reason = await trio.to_thread.run_sync(lambda: sdk_answer(sdk, state.urls[0], max_retries=8, **SDK_REQUEST))
        refused = (await scrape(client))("ringserve_errors_total", type="overloaded", stage="http")
    assert (text, reason) == (DEFAULT_REPLY, stop_reason(sdk, "end"))
    delays = [float(m) for m in re.findall(r"Retrying request .*in ([0-9.]+) seconds", caplog.text)]
    assert refused >= 1 and len(delays) == refused
    assert delays == [1.0] * len(delays)


# -- the SDKs' own stream classes ---------------------------------------------------------------


@pytest.mark.parametrize("sdk", SURFACES)
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_the_sdks_stream_classes_read_through_queue_waits_and_resumes(tmp_path: Path, sdk: str,
                                                                          use_async: bool) -> None:
    """The report of issue 12, with the SDKs' own classes: queued behind a long request for more than the
    heartbeat interval, then a resume of that message; both complete and give the whole reply."""
    config = fake_config(tmp_path, server={"heartbeat_interval": 1.0}, engine={"slots": 1})
    async with running_server(config, step_seconds=0.01, reply=_reply) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        await client.post(PATHS[sdk], json=body(sdk, stream=False, content="long", max_tokens=1000), headers=ASYNC)
        assert await trio.to_thread.run_sync(lambda: sdk_stream_text(sdk, state.urls[0], use_async=use_async,
                                                                     **SDK_REQUEST)) == DEFAULT_REPLY
        await client.post(PATHS[sdk], json=body(sdk, stream=False, content="long", max_tokens=1000), headers=ASYNC)
        created = (await client.post(PATHS[sdk], json=body(sdk, stream=True), headers=ASYNC)).json()
        text = await trio.to_thread.run_sync(
            lambda: sdk_stream_text(sdk, state.urls[0], use_async=use_async, resume=created["id"]))
        assert text == DEFAULT_REPLY
        if sdk == "openai":  # the readers' comments
            assert (await scrape(client))("ringserve_heartbeats_total") >= 2
        else:  # the producer's keepalives, in the log the resume read
            _, raw = await stream_bytes(client, "GET", f"/v1/messages/{created['id']}/stream")
            assert check_stream(sdk, raw).pings >= 1
