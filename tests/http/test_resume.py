"""Stream log behaviour over HTTP: resume with Last-Event-ID, policies, cancel, idempotency, expiry, restart (issue 4)."""

from __future__ import annotations

import json
import logging
import random

import httpx
import pytest
import trio

from bench.common import default_runner
from ringserve.core.sse import SSEParser
from ringserve.engine.llama import LlamaLoader
from ringserve.store.sqlite import MessageStore
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY, anthropic_text, openai_text, sse_events
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until

LONG_TEXT = "echo:" + " ".join(f"w{i}·é😀" for i in range(120))
ASYNC = {"Prefer": "respond-async"}


def body_for(path: str, content: str, **extra) -> dict:
    base = ANTHROPIC_BODY if path == "/v1/messages" else OPENAI_BODY
    return {**base, "max_tokens": 1000, "messages": [{"role": "user", "content": content}], **extra}


async def read_some(client, message_id: str, last_id: str | None, limit: int | None) -> tuple[list, bool]:
    """Read up to ``limit`` events of a resumed stream; returns (events, saw_the_end).

    A read whose limit stopped at the terminal event is followed by a resume
    answered 204 (the stream had ended at ``last_id``): that is the end too.
    """
    headers = {"Last-Event-ID": last_id} if last_id else {}
    parser, events = SSEParser(), []
    async with client.stream("GET", f"/v1/messages/{message_id}/stream", headers=headers) as resp:
        if resp.status_code == 204 and last_id is not None:
            return [], True
        assert resp.status_code == 200, await resp.aread()
        async for chunk in resp.aiter_raw():
            events += parser.feed(chunk)
            if limit is not None and len(events) >= limit:
                return events[:limit], False
    return events, True


async def chaos_round(client, path: str, rng: random.Random, content: str, max_tokens: int = 1000) -> None:
    created = await client.post(path, json=body_for(path, content, stream=True, max_tokens=max_tokens), headers=ASYNC)
    assert created.status_code == 202
    message_id = created.json()["id"]
    assert created.headers["location"] == f"/v1/messages/{message_id}"
    got, last, ended = [], None, False
    while not ended:
        events, ended = await read_some(client, message_id, last, rng.choice([1, 2, 3, 5, 8, None]))
        got += events
        if events:
            last = events[-1].id
    _, full, _ = await sse_events(client, "GET", f"/v1/messages/{message_id}/stream")
    assert [e.id for e in got] == [e.id for e in full]  # no seq missing or repeated
    assert got == full  # byte-identical content, event names and ids
    seqs = [int(e.id.rpartition(":")[2]) for e in got]
    assert seqs == list(range(len(seqs)))
    text = anthropic_text(got) if path == "/v1/messages" else openai_text(got)
    stored = (await client.get(f"/v1/messages/{message_id}")).json()
    assert stored["status"] == "complete"
    assert stored["text"] == text


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
async def test_chaos_readers_drop_and_resume_fake_engine(tmp_path, path):
    config = fake_config(tmp_path, stream={"flush_ms": 0.0})
    rng = random.Random(1234)
    async with running_server(config, step_seconds=0.001, piece_bytes=3) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        for _ in range(6):
            await chaos_round(client, path, rng, LONG_TEXT)
        # the uninterrupted text is the fake reply
        created = await client.post(path, json=body_for(path, LONG_TEXT, stream=True), headers=ASYNC)
        _, full, _ = await sse_events(client, "GET", created.json()["stream_url"])
        text = anthropic_text(full) if path == "/v1/messages" else openai_text(full)
        assert text == LONG_TEXT.removeprefix("echo:")


@pytest.mark.model
async def test_chaos_readers_drop_and_resume_real_model(tmp_path):
    config = fake_config(tmp_path, engine={"slots": 2, "ctx_per_slot": 512}, stream={"flush_ms": 0.0})
    rng = random.Random(99)
    async with running_server(config, engine_factory=LlamaLoader()) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client:
        for path in ("/v1/messages", "/v1/chat/completions"):
            for _ in range(2):
                await chaos_round(client, path, rng, "Tell me about the sea in two sentences.", max_tokens=64)


async def test_two_readers_tail_one_message(tmp_path):
    async with running_server(fake_config(tmp_path), step_seconds=0.002) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        created = (await client.post("/v1/messages", json=body_for("/v1/messages", LONG_TEXT), headers=ASYNC)).json()
        results = []

        async def reader() -> None:
            results.append((await sse_events(client, "GET", created["stream_url"]))[1])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(reader)
        assert results[0] == results[1]
        assert results[0][-1].event == "message_stop"


async def test_continue_policy_finishes_and_persists(tmp_path):
    config = fake_config(tmp_path, policy={"anthropic": "continue"})
    async with running_server(config, step_seconds=0.001) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        async with client.stream("POST", "/v1/messages", json=body_for("/v1/messages", LONG_TEXT, stream=True)) as resp:
            message_id = resp.headers["x-message-id"]
            async for _ in resp.aiter_raw():
                break
        await wait_until(lambda: default_runner(state.hub).statistics().slots_busy == 0)
        status = (await client.get(f"/v1/messages/{message_id}")).json()
        assert status["status"] == "complete"
        assert status["text"] == LONG_TEXT.removeprefix("echo:")
        assert status["stop_reason"] == "end_turn"
        # resume after completion within the TTL: the whole stream, ending with message_stop
        events, ended = await read_some(client, message_id, f"{message_id}:3", None)
        assert ended and events[-1].event == "message_stop"
        assert int(events[0].id.rpartition(":")[2]) == 4


async def test_per_request_policy_override(tmp_path):
    async with running_server(fake_config(tmp_path), step_seconds=0.001) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        headers = {"Ringserve-Disconnect-Policy": "continue"}
        async with client.stream("POST", "/v1/chat/completions", headers=headers,
                                 json=body_for("/v1/chat/completions", LONG_TEXT, stream=True)) as resp:
            message_id = resp.headers["x-message-id"]
            async for _ in resp.aiter_raw():
                break
        await wait_until(lambda: default_runner(state.hub).statistics().slots_busy == 0)
        assert (await client.get(f"/v1/messages/{message_id}")).json()["status"] == "complete"
        bad = await client.post("/v1/chat/completions", headers={"Ringserve-Disconnect-Policy": "maybe"},
                                json=body_for("/v1/chat/completions", "hi"))
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


async def test_explicit_cancel_ends_every_reader_with_a_terminal_event(tmp_path):
    async with running_server(fake_config(tmp_path), step_seconds=0.01) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        created = (await client.post("/v1/chat/completions", headers=ASYNC,
                                     json=body_for("/v1/chat/completions", LONG_TEXT))).json()
        results = []

        async def reader() -> None:
            results.append((await sse_events(client, "GET", created["stream_url"]))[1])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(reader)
            await wait_until(lambda: state.hub.live(created["id"]).view().text)
            answer = await client.post(f"/v1/messages/{created['id']}/cancel")
        assert answer.status_code == 200
        assert answer.json()["status"] == "cancelled"
        for events in results:
            assert events[-1].data == "[DONE]"
            final = json.loads(events[-2].data)
            assert final["choices"][0]["finish_reason"] == "stop"
            assert final["choices"][0]["ringserve_cancelled"] is True
        await wait_until(lambda: default_runner(state.hub).statistics().slots_busy == 0)  # within one step
        usage = answer.json()["usage"]
        assert 0 < usage["output_tokens"] < 200


@pytest.mark.parametrize("prefer", ["respond-async; wait=5", "wait=5, Respond-Async", "return=minimal; a=\"x, y\""])
async def test_prefer_respond_async_with_parameters_answers_202_with_the_message_id(tmp_path, prefer):
    """RFC 7240 preferences may carry ``;`` parameters and come in any order (``core/prefer.py``)."""
    async with running_server(fake_config(tmp_path)) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        resp = await client.post("/v1/messages", json=body_for("/v1/messages", "echo:hi"), headers={"Prefer": prefer})
        if "respond-async" not in prefer.lower():
            assert resp.status_code == 200 and "preference-applied" not in resp.headers
            return
        assert resp.status_code == 202, resp.text
        assert resp.headers["preference-applied"] == "respond-async"
        assert resp.headers["x-message-id"] == resp.json()["id"]


async def test_idempotent_retry_returns_the_same_message(tmp_path):
    async with running_server(fake_config(tmp_path), step_seconds=0.001) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        body = body_for("/v1/messages", "echo:once only")
        first = await client.post("/v1/messages", json=body, headers={"Idempotency-Key": "k-1"})
        second = await client.post("/v1/messages", json=body, headers={"Idempotency-Key": "k-1"})
        assert first.status_code == second.status_code == 200
        assert first.json() == second.json()
        assert default_runner(state.hub).statistics().prompt_tokens_total == first.json()["usage"]["input_tokens"]
        other = await client.post("/v1/messages", json={**body, "max_tokens": 7}, headers={"Idempotency-Key": "k-1"})
        assert other.status_code == 422
        assert other.json()["error"]["type"] == "invalid_request_error"
        # concurrent retries with one key start one generation
        body = body_for("/v1/messages", "echo:" + "x " * 50)
        answers = []

        async def retry() -> None:
            answers.append((await client.post("/v1/messages", json=body, headers={"Idempotency-Key": "k-2"})).json())

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(retry)
        assert answers[0] == answers[1] == answers[2]
        expected = first.json()["usage"]["input_tokens"] + answers[0]["usage"]["input_tokens"]
        assert default_runner(state.hub).statistics().prompt_tokens_total == expected


async def test_resume_answers_for_bad_ids_unknown_and_expired(tmp_path):
    config = fake_config(tmp_path, stream={"ttl_seconds": 0.2, "ring_max_entries": 8})
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        done = (await client.post("/v1/messages", json=body_for("/v1/messages", LONG_TEXT))).json()
        mid = done["id"]
        # id older than what the ring still holds (8 entries, the message has many more): the ended
        # log is rebuilt from the store
        gap = await client.get(f"/v1/messages/{mid}/stream", headers={"Last-Event-ID": f"{mid}:0"})
        assert gap.status_code == 200 and SSEParser().feed(gap.content)[0].id == f"{mid}:1"
        for bad in ("garbage", f"{mid}:x", "msg_other:3", f"{mid}:99999", f"{mid}:01", f"{mid}:+1"):
            resp = await client.get(f"/v1/messages/{mid}/stream", headers={"Last-Event-ID": bad})
            assert resp.status_code == 400, bad
            assert resp.json()["error"]["type"] == "invalid_request_error"
        resp = await client.get("/v1/messages/msg_unknown/stream")
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
        resp = await client.get("/v1/messages/chatcmpl-unknown/stream")
        assert resp.status_code == 404 and "error" in resp.json()
        # query parameter for a first EventSource connection
        log = state.hub.logs.get(mid)
        last_seq = log.next_seq - 2
        resp = await client.get(f"/v1/messages/{mid}/stream", params={"last_event_id": f"{mid}:{last_seq}"})
        assert [e.event for e in SSEParser().feed(resp.content)] == ["message_stop"]
        # after the TTL the log is gone: rebuilt from the store, the same bytes; the message answers
        await wait_until(lambda: state.hub.logs.get(mid) is None, timeout=5)
        resp = await client.get(f"/v1/messages/{mid}/stream", headers={"Last-Event-ID": f"{mid}:0"})
        assert resp.status_code == 200 and resp.content == gap.content
        stored = (await client.get(f"/v1/messages/{mid}")).json()
        assert stored["status"] == "complete"
        assert stored["text"] == done["content"][0]["text"]


async def test_restart_marks_generating_messages_interrupted(tmp_path):
    config = fake_config(tmp_path)
    async with running_server(config, step_seconds=0.01) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        created = (await client.post("/v1/messages", headers=ASYNC, json=body_for("/v1/messages", LONG_TEXT))).json()
        await wait_until(lambda: state.hub.live(created["id"]).view().text)
        # simulate a crash: the row stays "generating" in the file while a new process starts
        crashed = MessageStore(config.store.path)
        await wait_until(lambda: crashed.get(created["id"]).status == "generating")  # (written off the loop)
        crashed.close()
    store = MessageStore(config.store.path)
    store.update(created["id"], status="generating")  # what a killed process leaves behind
    store.close()
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        status = (await client.get(f"/v1/messages/{created['id']}")).json()
        assert status["status"] == "interrupted"


async def test_a_second_server_on_the_store_leaves_the_first_ones_messages_generating(tmp_path, caplog):
    """``ringserve run`` and ``launch`` start servers on the default store: one started beside a
    generating server must not mark that server's message interrupted."""
    caplog.set_level(logging.INFO)
    config = fake_config(tmp_path)
    async with running_server(config, step_seconds=0.01) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        created = (await client.post("/v1/messages", headers=ASYNC, json=body_for("/v1/messages", LONG_TEXT))).json()
        store = MessageStore(config.store.path)
        try:
            await wait_until(lambda: store.get(created["id"]).status == "generating")  # (written off the loop)
            async with running_server(config):
                assert store.get(created["id"]).status == "generating"
        finally:
            store.close()
        assert "another running server uses this message store" in caplog.text
        assert "as interrupted" not in caplog.text


async def test_idempotent_stream_retry_replays_the_log(tmp_path):
    async with running_server(fake_config(tmp_path)) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        body = body_for("/v1/messages", "echo:replay me", stream=True)
        _, first, _ = await sse_events(client, "POST", "/v1/messages", json=body, headers={"Idempotency-Key": "s"})
        _, again, _ = await sse_events(client, "POST", "/v1/messages", json=body, headers={"Idempotency-Key": "s"})
        assert first == again and first[-1].event == "message_stop"


async def test_text_so_far_is_persisted_while_generating(tmp_path):
    """A crash loses at most ``[stream] persist_seconds`` of text: the store has the text so far."""
    config = fake_config(tmp_path)
    async with running_server(config, step_seconds=0.01) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        created = (await client.post("/v1/messages", headers=ASYNC, json=body_for("/v1/messages", LONG_TEXT))).json()
        store = MessageStore(config.store.path)
        try:
            await wait_until(lambda: store.get(created["id"]).text != "", timeout=10)
            row = store.get(created["id"])
            assert row.status == "generating"
            assert LONG_TEXT.removeprefix("echo:").startswith(row.text)
            assert row.output_tokens > 0
        finally:
            store.close()
