"""Idempotency-Key retries (issue 18, items 2 and 4): concurrent retries of an attempt that fails to
start, and retries of a message that a crash, a drain or an engine failure ended."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import trio

from ringserve.core.sse import SSEParser
from ringserve.engine.fake import FakeEngine
from ringserve.store.sqlite import MessageStore
from tests.support.server import fake_config, running_server
from tests.support.helpers import anthropic_text, openai_text, sse_events
from tests.http.test_resume import ASYNC, LONG_TEXT, body_for, wait_until

PATHS = {"/v1/messages": "anthropic", "/v1/chat/completions": "openai"}
KEY = {"Idempotency-Key": "one-key"}
REPLY = LONG_TEXT.removeprefix("echo:")


def text_of(path: str, events: list) -> str:
    return anthropic_text(events) if path == "/v1/messages" else openai_text(events)


def is_terminal(path: str, event) -> bool:
    return event.event == "message_stop" if path == "/v1/messages" else event.data == "[DONE]"


async def post(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, str | None, object]:
    """POST with the key; (status, X-Message-Id, the SSE events of a 200 stream, else the JSON answer)."""
    if body.get("stream"):
        resp, events, raw = await sse_events(client, "POST", url, json=body, headers=KEY)
        return resp.status_code, resp.headers.get("x-message-id"), events if resp.status_code == 200 else json.loads(raw)
    resp = await client.post(url, json=body, headers=KEY)
    return resp.status_code, resp.headers.get("x-message-id"), resp.json()


# -- item 2: concurrent retries of an attempt that fails after tokenization ---------------------


@pytest.mark.parametrize("failure", ["prompt_too_long", "queue_full"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", PATHS)
async def test_concurrent_retries_of_an_attempt_that_fails_to_start_all_get_its_error(tmp_path, path, stream,
                                                                                      failure):
    armed, gate, tokenizing = threading.Event(), threading.Event(), []

    def hook() -> None:  # once armed, the first attempt's tokenizer waits until the retries wait on it
        if armed.is_set():
            tokenizing.append(1)
            assert gate.wait(30)

    too_long = failure == "prompt_too_long"
    engine = {"slots": 1, "queue_size": 0, "ctx_per_slot": 64 if too_long else 4096}
    async with running_server(fake_config(tmp_path, engine=engine), tokenize_hook=hook, piece_bytes=1,
                              step_seconds=0.005, reply="r" * 3000) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        busy = None
        if not too_long:  # one generation holds the only slot, nothing may queue
            busy = (await client.post(path, json=body_for(path, "occupy"), headers=ASYNC)).json()["id"]
            await wait_until(lambda: state.hub.live(busy).view().text)
        # 60 bytes of text pass the byte bound; with the template they are 69 tokens, over the 64 of a slot
        body = body_for(path, "x" * 60 if too_long else "go", stream=stream, max_tokens=8)
        armed.set()
        answers = []

        async def attempt() -> None:
            answers.append(await post(client, path, body))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(attempt)
            key = f"{PATHS[path]}:{KEY['Idempotency-Key']}"
            await wait_until(lambda: tokenizing and key in state.hub.keys.pending
                             and state.hub.keys.pending[key].started.statistics().tasks_waiting == 3)
            gate.set()
        if busy is not None:
            await client.post(f"/v1/messages/{busy}/cancel")
        statuses = [status for status, _, _ in answers]
        expected = 400 if too_long else {"/v1/messages": 529, "/v1/chat/completions": 503}[path]
        assert statuses == [expected] * 4
        assert all(answer == answers[0][2] for _, _, answer in answers)  # one error, the first attempt's
        assert len(tokenizing) == 1  # the retries did not start attempts of their own
        assert state.hub.keys.pending == {}


# -- item 4: a retry after a crash, a drain or a failure generates the message again --------------


async def first_attempt_cut_by_drain(config, path: str, body: dict) -> tuple[str, int, object]:
    """Send ``body`` with the key, drain the server while it generates: (message id, status, answer)."""
    answers = []
    async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as nursery:
        async with running_server(config, step_seconds=0.01) as state:

            async def attempt(url: str) -> None:
                answers.append(await post(client, url, body))

            nursery.start_soon(attempt, state.urls[0] + path)
            await wait_until(lambda: any(m.view().text for m in state.hub._live.values()))
            (message_id,) = state.hub._live
        # leaving the server's block drained it; the answer came during the drain
    status, _, answer = answers[0]
    return message_id, status, answer


@pytest.mark.parametrize(("path", "stream", "cause"), [
    ("/v1/messages", True, "drain"),
    ("/v1/chat/completions", False, "drain"),
    ("/v1/messages", False, "crash"),
    ("/v1/chat/completions", True, "crash"),
])
async def test_a_retry_after_a_crash_or_drain_generates_the_message_again_under_a_new_id(tmp_path, path,
                                                                                         stream, cause):
    config = fake_config(tmp_path, server={"drain_timeout": 0})
    body = body_for(path, LONG_TEXT, stream=stream)
    if cause == "drain":
        old, status, answer = await first_attempt_cut_by_drain(config, path, body)
        if stream:  # the stream ended with a retryable in-band error
            assert status == 200 and not is_terminal(path, answer[-1]) and "error" in answer[-1].data
        else:  # a retryable 503, not the text so far as if it were the answer
            assert status == 503 and "shutting down" in json.dumps(answer)
    else:
        async with running_server(config, step_seconds=0.01) as state, \
                httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            old = (await client.post(path, json=body, headers={**KEY, **ASYNC})).json()["id"]
            await wait_until(lambda: state.hub.live(old).view().text)
        store = MessageStore(config.store.path)
        store.update(old, status="generating")  # what kill -9 leaves behind
        store.close()
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        assert (await client.get(f"/v1/messages/{old}")).json()["status"] == "interrupted"
        status, new, answer = await post(client, path, body)
        assert status == 200 and new is not None and new != old
        if stream:
            assert is_terminal(path, answer[-1]) and text_of(path, answer) == REPLY
            assert answer[0].id == f"{new}:0"
        else:
            assert answer["id"] == new
            text = answer["content"][0]["text"] if path == "/v1/messages" else answer["choices"][0]["message"]["content"]
            assert text == REPLY
        prompt_tokens = state.hub.runner.statistics().prompt_tokens_total
        # the key now names the new, complete message: a further retry returns it as stored
        assert await post(client, path, body) == (200, new, answer)
        assert state.hub.runner.statistics().prompt_tokens_total == prompt_tokens
        old_row = (await client.get(f"/v1/messages/{old}")).json()
        assert old_row["status"] == "interrupted" and REPLY.startswith(old_row["text"])
        assert (await client.get(f"/v1/messages/{new}")).json()["status"] == "complete"


async def test_failed_messages_are_generated_again_and_cancelled_ones_returned_as_stored(tmp_path):
    path = "/v1/messages"
    async with running_server(fake_config(tmp_path), crash_after_steps=3, step_seconds=0.005) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        # the engine crashes once, at its fourth decode call: the first attempt fails
        body = body_for(path, "echo:fails once, then works")
        status, _, answer = await post(client, path, body)
        assert status == 500 and answer["error"]["type"] == "api_error"
        failed = state.hub.store.by_idempotency_key(f"anthropic:{KEY['Idempotency-Key']}").id
        assert (await client.get(f"/v1/messages/{failed}")).json()["status"] == "failed"
        status, new, answer = await post(client, path, body)
        assert status == 200 and new != failed and answer["content"][0]["text"] == "fails once, then works"
        assert (await client.get(f"/v1/messages/{failed}")).json()["status"] == "failed"

        # a cancelled message is returned as stored: replayed, or its JSON (before: a 409)
        for stream in (True, False):
            body = body_for(path, LONG_TEXT, stream=stream)
            headers = {"Idempotency-Key": f"cancelled-{stream}"}
            cancelled = (await client.post(path, json=body, headers={**headers, **ASYNC})).json()["id"]
            await wait_until(lambda: state.hub.live(cancelled).view().text)
            await client.post(f"/v1/messages/{cancelled}/cancel")
            prompt_tokens = state.hub.runner.statistics().prompt_tokens_total
            if stream:
                resp, events, _ = await sse_events(client, "POST", path, json=body, headers=headers)
                assert resp.headers["x-message-id"] == cancelled and events[-1].event == "message_stop"
                delta = json.loads(events[-2].data)["delta"]
                assert delta["stop_reason"] == "end_turn" and delta["ringserve_cancelled"] is True
            else:
                resp = await client.post(path, json=body, headers=headers)
                assert resp.status_code == 200 and resp.json()["id"] == cancelled
                assert resp.json()["stop_reason"] == "end_turn" and resp.json()["ringserve_cancelled"] is True
            assert state.hub.runner.statistics().prompt_tokens_total == prompt_tokens


# -- issue 33 item 5: one generation per logical turn of an agent's session ----------------------

#: Each surface's request (a long reply) and the session headers its agent sends (docs/agents.md).
SESSIONS = {
    "anthropic": ("/v1/messages", {"model": "m", "max_tokens": 1000, "stream": True,
                                   "messages": [{"role": "user", "content": LONG_TEXT}]},
                  {"x-claude-code-session-id": "4b0f5c3e-claude"}),
    "responses": ("/v1/responses", {"model": "m", "stream": True, "store": False, "input": LONG_TEXT},
                  {"session-id": "0199-codex", "x-client-request-id": "0199-codex"}),
}


def session_server(tmp_path):
    """A server whose fake engine replies slowly (a long echo, 2 ms a token), and the engine."""
    engines = []

    def factory(config):
        engines.append(FakeEngine(n_slots=2, n_ctx=4096, piece_bytes=4, step_seconds=0.002))
        return engines[0]

    return running_server(fake_config(tmp_path, engine={"slots": 2}), engine_factory=factory), engines


async def raw_stream(client, path, body, headers, *, events: int | None = None) -> tuple[str | None, bytes]:
    """POST a stream; (X-Message-Id, its raw body), or only its first ``events`` events (then close)."""
    raw, parser, seen = bytearray(), SSEParser(), 0
    async with client.stream("POST", path, json=body, headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for chunk in resp.aiter_raw():
            raw += chunk
            seen += len(parser.feed(chunk))
            if events is not None and seen >= events:
                break
    return resp.headers.get("x-message-id"), bytes(raw)


def reply_text(raw: bytes) -> str:
    """The text of an Anthropic or Responses stream."""
    text = ""
    for event in SSEParser().feed(raw):
        data = json.loads(event.data)
        if data["type"] in ("content_block_delta", "response.output_text.delta"):
            text += data["delta"]["text"] if data["type"] == "content_block_delta" else data["delta"]
    return text


@pytest.mark.parametrize("surface", SESSIONS)
async def test_identical_requests_under_one_session_header_are_one_generation_and_stream_the_same_bytes(
        tmp_path, surface):
    """Claude Code's and Codex's retry of a turn (the same body, the same session header) while its
    first attempt runs attaches to it: the engine begins one generation, and both streams are
    the same bytes, the retry's from the first event."""
    path, body, headers = SESSIONS[surface]
    server, engines = session_server(tmp_path)
    async with server as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        answers = []

        async def attempt() -> None:
            answers.append(await raw_stream(client, path, body, headers))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(attempt)
            await wait_until(lambda: engines[0].begins)
            nursery.start_soon(attempt)
        assert len(engines[0].begins) == 1
        (first_id, first), (again_id, again) = answers
        assert first_id == again_id and first == again and first.count(b"id: ") > 20


@pytest.mark.parametrize("surface", SESSIONS)
async def test_a_retry_after_the_stream_broke_attaches_to_the_generation_and_after_its_end_replays_it(
        tmp_path, surface):
    """The first connection drops after 5 events (the abort policy, grace 0: a message of a
    session waits SESSION_GRACE_SECONDS for its client's retry); the retry attaches and reads the
    whole answer; a retry after the end (its log held; Codex's store: false deleted the row) is a
    replay. Another session, another body, or no session header: generations of their own."""
    path, body, headers = SESSIONS[surface]
    server, engines = session_server(tmp_path)
    async with server as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        first_id, cut = await raw_stream(client, path, body, headers, events=5)
        retry_id, whole = await raw_stream(client, path, body, headers)
        assert retry_id == first_id and whole.startswith(cut) and len(whole) > len(cut)
        assert reply_text(whole) == REPLY
        again_id, again = await raw_stream(client, path, body, headers)
        assert (again_id, again) == (retry_id, whole)
        assert len(engines[0].begins) == 1
        others = [({**body, "max_tokens" if surface == "anthropic" else "max_output_tokens": 999}, headers),
                  (body, {name: "another-session" for name in headers}), (body, {})]
        for other_body, other_headers in others:
            other_id, _ = await raw_stream(client, path, other_body, other_headers, events=3)
            assert other_id != first_id
        assert len(engines[0].begins) == 4


async def test_a_retry_of_a_failed_turn_under_a_session_is_a_new_generation(tmp_path):
    path, body, headers = SESSIONS["anthropic"]
    async with running_server(fake_config(tmp_path), fail_after_tokens=3) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        first_id, first = await raw_stream(client, path, body, headers)
        assert b"event: error" in first
        retry_id, _ = await raw_stream(client, path, body, headers)
        assert retry_id != first_id


async def test_a_retry_whose_json_lists_its_keys_in_another_order_is_the_same_turn(tmp_path):
    """Codex re-serializes its ``client_metadata`` (a map) in another order on a retry (the captures
    in ``codex_retries``): the same turn. (Here a map of the API's own, ``metadata``.)"""
    path, body, headers = SESSIONS["responses"]
    first = {**body, "metadata": {"a": "1", "b": "2"}}
    again = {**body, "metadata": {"b": "2", "a": "1"}}
    assert json.dumps(first) != json.dumps(again)
    server, engines = session_server(tmp_path)
    async with server as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        first_id, _ = await raw_stream(client, path, first, headers)
        again_id, _ = await raw_stream(client, path, again, headers)
        assert first_id == again_id and len(engines[0].begins) == 1
