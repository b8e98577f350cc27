"""Protocol tests on the deterministic fake engine: event order, ids, headers, errors (C3, C4, C5, C9, C11)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
import trio

from ringserve.core.sse import SSEParser
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY, anthropic_text, openai_text, sse_events
from tests.support.server import fake_config, running_server

FAKE_REPLY = "echo:The quick brown fox jumps over the lazy dog."


def _body(base: dict, **changes) -> dict:
    return {**base, **changes}


def _ids(events) -> list[tuple[str, int]]:
    out = []
    for e in events:
        owner, _, seq = e.id.rpartition(":")
        out.append((owner, int(seq)))
    return out


async def test_anthropic_stream_event_order_ids_and_headers(fake_server):
    _state, client = fake_server
    body = _body(ANTHROPIC_BODY, stream=True, messages=[{"role": "user", "content": FAKE_REPLY}])
    resp, events, raw = await sse_events(client, "POST", "/v1/messages", json=body)
    assert resp.status_code == 200
    # C9: no proxy buffering, no caching, the SSE content type.
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["cache-control"] == "no-cache"
    assert resp.headers["x-accel-buffering"] == "no"
    names = [e.event for e in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    ids = _ids(events)
    message_id = json.loads(events[0].data)["message"]["id"]
    assert message_id.startswith("msg_")
    assert [owner for owner, _ in ids] == [message_id] * len(events)
    assert [seq for _, seq in ids] == list(range(len(events)))
    assert anthropic_text(events) == FAKE_REPLY[len("echo:"):]
    delta = json.loads(events[-2].data)
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    start = json.loads(events[0].data)["message"]
    assert delta["usage"]["input_tokens"] == start["usage"]["input_tokens"] > 0
    assert delta["usage"]["output_tokens"] > 0
    assert b"[DONE]" not in raw
    # the reconnection hint rides on the first event (a lone retry block confuses the OpenAI SDK)
    assert events[0].retry == 3000
    assert all(e.retry is None for e in events[1:])


async def test_openai_stream_ends_with_done_and_usage_only_when_asked(fake_server):
    _state, client = fake_server
    messages = [{"role": "user", "content": FAKE_REPLY}]
    _, events, raw = await sse_events(
        client, "POST", "/v1/chat/completions", json=_body(OPENAI_BODY, stream=True, messages=messages)
    )
    # C5: the last event is data: [DONE] followed by a blank line.
    assert events[-1].data == "[DONE]"
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = [json.loads(e.data) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert openai_text(events) == FAKE_REPLY[len("echo:"):]
    assert [seq for _, seq in _ids(events)] == list(range(len(events)))

    _, events, _ = await sse_events(
        client, "POST", "/v1/chat/completions",
        json=_body(OPENAI_BODY, stream=True, messages=messages, stream_options={"include_usage": True}),
    )
    usage_chunk = json.loads(events[-2].data)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] > 0
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + usage_chunk["usage"]["completion_tokens"]
    assert all(json.loads(e.data)["usage"] is None for e in events[:-2])


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
async def test_stream_and_non_stream_agree_on_text_and_usage(fake_server, surface):
    """C11: same request streamed and not streamed: same text, same output token count."""
    _state, client = fake_server
    messages = [{"role": "user", "content": FAKE_REPLY}]
    if surface == "anthropic":
        body = _body(ANTHROPIC_BODY, messages=messages, temperature=0)
        full = (await client.post("/v1/messages", json=body)).json()
        _, events, _ = await sse_events(client, "POST", "/v1/messages", json={**body, "stream": True})
        assert full["content"][0]["text"] == anthropic_text(events)
        final = json.loads([e for e in events if e.event == "message_delta"][0].data)
        assert full["usage"]["output_tokens"] == final["usage"]["output_tokens"]
        assert full["stop_reason"] == "end_turn"
    else:
        body = _body(OPENAI_BODY, messages=messages, temperature=0)
        full = (await client.post("/v1/chat/completions", json=body)).json()
        _, events, _ = await sse_events(
            client, "POST", "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert full["choices"][0]["message"]["content"] == openai_text(events)
        usage = json.loads(events[-2].data)["usage"]
        # the second request found the whole prompt in the prefix cache (all but the last token)
        assert usage["prompt_tokens_details"] == {"cached_tokens": full["usage"]["prompt_tokens"] - 1}
        assert full["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert {**full["usage"], "prompt_tokens_details": None} == {**usage, "prompt_tokens_details": None}
        assert full["choices"][0]["finish_reason"] == "stop"


async def test_max_tokens_reports_length(fake_server):
    _state, client = fake_server
    body = _body(OPENAI_BODY, messages=[{"role": "user", "content": FAKE_REPLY}], max_tokens=3)
    full = (await client.post("/v1/chat/completions", json=body)).json()
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == 3
    body = _body(ANTHROPIC_BODY, messages=[{"role": "user", "content": FAKE_REPLY}], max_tokens=3)
    full = (await client.post("/v1/messages", json=body)).json()
    assert full["stop_reason"] == "max_tokens"
    assert full["usage"]["output_tokens"] == 3


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode(), "max_tokens"),
        (json.dumps({**ANTHROPIC_BODY, "max_tokens": "12"}).encode(), "max_tokens"),
        (json.dumps({**ANTHROPIC_BODY, "messages": []}).encode(), "messages"),
        (json.dumps({**ANTHROPIC_BODY, "messages": [{"role": "robot", "content": "x"}]}).encode(), "messages"),
        (json.dumps({**ANTHROPIC_BODY, "temperature": 7}).encode(), "temperature"),
        (json.dumps({**ANTHROPIC_BODY, "stream": "yes"}).encode(), "stream"),
        (json.dumps({**ANTHROPIC_BODY, "messages": [{"role": "user", "content": [{"type": "image"}]}]}).encode(), "messages"),
    ],
)
async def test_anthropic_bad_input_is_400_in_anthropic_shape(fake_server, body, param):
    _state, client = fake_server
    resp = await client.post("/v1/messages", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    err = resp.json()
    assert err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error"
    assert isinstance(err["error"]["message"], str) and err["error"]["message"]
    if param:
        assert param in err["error"]["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (json.dumps({"model": "m"}).encode(), "messages"),
        (json.dumps({**OPENAI_BODY, "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({**OPENAI_BODY, "stop": 5}).encode(), "stop"),
        (json.dumps({**OPENAI_BODY, "n": 2}).encode(), "n"),
        (json.dumps({**OPENAI_BODY, "stream_options": []}).encode(), "stream_options"),
    ],
)
async def test_openai_bad_input_is_400_in_openai_shape(fake_server, body, param):
    _state, client = fake_server
    resp = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


async def test_prompt_longer_than_context_is_400_before_any_sse_byte(tmp_path):
    """C4: a prompt longer than the slot's context gets HTTP 400 in the surface's shape, no SSE."""
    config = fake_config(tmp_path, engine={"ctx_per_slot": 64})
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0]) as client:
        long = "x" * 500
        resp = await client.post("/v1/messages", json=_body(ANTHROPIC_BODY, stream=True, messages=[{"role": "user", "content": long}]))
        assert resp.status_code == 400
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.json()["error"]["type"] == "invalid_request_error"
        resp = await client.post("/v1/chat/completions", json=_body(OPENAI_BODY, stream=True, messages=[{"role": "user", "content": long}]))
        assert resp.status_code == 400
        assert resp.json()["error"]["type"] == "invalid_request_error"
        assert b"data:" not in resp.content
        # a prompt that leaves no token to generate (tests/surfaces/test_compat.py has prompt + max_tokens over it)
        fills = "x" * (64 - len("<|user|>\n"))
        resp = await client.post("/v1/messages", json=_body(ANTHROPIC_BODY, stream=True, messages=[{"role": "user", "content": fills}]))
        assert resp.status_code == 400
        assert "64 tokens" in resp.json()["error"]["message"]


async def test_mid_stream_failure_is_in_band_on_both_surfaces(tmp_path):
    """C3: the fake engine fails after 5 tokens: Anthropic event: error; OpenAI data: {"error"} and no [DONE]."""
    config = fake_config(tmp_path)
    async with running_server(config, fail_after_tokens=5) as state, httpx.AsyncClient(base_url=state.urls[0]) as client:
        body = _body(ANTHROPIC_BODY, stream=True, messages=[{"role": "user", "content": FAKE_REPLY}])
        _, events, _ = await sse_events(client, "POST", "/v1/messages", json=body)
        assert events[-1].event == "error"
        err = json.loads(events[-1].data)
        assert err["type"] == "error" and err["error"]["type"] == "api_error"
        assert "message_stop" not in [e.event for e in events]
        body = _body(OPENAI_BODY, stream=True, messages=[{"role": "user", "content": FAKE_REPLY}])
        _, events, raw = await sse_events(client, "POST", "/v1/chat/completions", json=body)
        assert "error" in json.loads(events[-1].data)
        assert b"[DONE]" not in raw


async def test_raw_socket_framing_byte_by_byte(fake_server):
    """Read the stream one byte at a time off a raw socket and check the SSE framing exactly."""
    state, _client = fake_server
    host, port = state.urls[0].removeprefix("http://").rsplit(":", 1)
    body = json.dumps(_body(ANTHROPIC_BODY, stream=True, messages=[{"role": "user", "content": "echo:a\nb\r\nc 😀"}])).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(
            b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        raw = bytearray()
        while True:
            byte = await stream.receive_some(1)
            if not byte:
                break
            raw += byte
    head, _, payload = bytes(raw).partition(b"\r\n\r\n")
    assert b"HTTP/1.1 200" in head
    assert b"text/event-stream; charset=utf-8" in head.lower()
    # The body is chunked: de-chunk it.
    body_bytes = bytearray()
    rest = payload
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body_bytes += rest[:size]
        rest = rest[size + 2:]
    parser = SSEParser()
    events = []
    for i in range(len(body_bytes)):
        events += parser.feed(body_bytes[i:i + 1])
    assert body_bytes.endswith(b"\n\n")
    assert parser.pending_bytes == 0
    assert anthropic_text(events) == "a\nb\r\nc 😀"
    for block in bytes(body_bytes).split(b"\n\n")[:-1]:
        lines = block.split(b"\n")
        assert all(line.split(b":", 1)[0] in (b"id", b"event", b"data", b"retry", b"") for line in lines), block
        assert b"\r" not in block


async def test_models_and_health(fake_server):
    state, client = fake_server
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == state.model_id
    assert models["data"][0]["max_input_tokens"] == state.hub.runner.context_window == 16384  # a request's window
    assert (await client.get("/health")).status_code == 200


async def test_unknown_route_is_json_404(fake_server):
    _state, client = fake_server
    resp = await client.get("/v1/messages/x/nope")
    assert resp.status_code == 404
    assert resp.json()["type"] == "error"  # Anthropic's shape under /v1/messages
    resp = await client.get("/v1/nope")
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "invalid_request_error"  # OpenAI's shape elsewhere in /v1


async def test_models_answer_in_the_shape_of_the_sdk_that_asks(fake_server):
    """Anthropic's SDK (it sends ``anthropic-version``) gets its list and ``ModelInfo``; any other
    client OpenAI's (``ringserve launch`` reads ``max_input_tokens`` there)."""
    state, client = fake_server
    one = (await client.get(f"/v1/models/{state.model_id}")).json()
    assert one["id"] == state.model_id and one["object"] == "model" and "type" not in one
    version = {"anthropic-version": "2023-06-01"}
    one = (await client.get(f"/v1/models/{state.model_id}", headers=version)).json()
    assert one["id"] == state.model_id and one["type"] == "model" and one["lifecycle"] == "active"
    page = (await client.get("/v1/models", headers=version)).json()
    assert page == {"data": [one], "has_more": False, "first_id": state.model_id, "last_id": state.model_id}
    sdk = anthropic.AsyncAnthropic(base_url=state.urls[0], api_key="unused")
    listed = [m async for m in sdk.models.list()]
    assert [(m.id, m.max_input_tokens) for m in listed] == [(state.model_id, 16384)]
    assert (await sdk.models.retrieve(state.model_id)).display_name == state.model_id
    resp = await client.get("/v1/embeddings")
    assert resp.status_code == 404 and set(resp.json()["error"]) == {"message", "type", "param", "code"}


async def test_idempotency_keys_are_scoped_per_surface(fake_server):
    _state, client = fake_server
    body = {**ANTHROPIC_BODY, "messages": [{"role": "user", "content": "echo:same body"}]}
    a = await client.post("/v1/messages", json=body, headers={"Idempotency-Key": "shared"})
    o = await client.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "shared"})
    assert a.json()["id"].startswith("msg_")
    assert o.json()["id"].startswith("chatcmpl-") and o.json()["object"] == "chat.completion"


async def test_seed_makes_sampling_reproducible_and_extension_fields_validate(fake_server):
    """min_p, top_k and seed are accepted on both surfaces (as llama.cpp's server does) and range-checked."""
    _state, client = fake_server
    for path, base in (("/v1/messages", ANTHROPIC_BODY), ("/v1/chat/completions", OPENAI_BODY)):
        ok = await client.post(path, json={**base, "min_p": 0.05, "top_k": 40, "seed": 7})
        assert ok.status_code == 200
        for field, value in (("min_p", 2), ("top_k", -1), ("seed", "x")):
            bad = await client.post(path, json={**base, field: value})
            assert bad.status_code == 400 and field in bad.text
