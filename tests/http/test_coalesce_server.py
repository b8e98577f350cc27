"""A coalesced stream over HTTP (the fake engine): a text block and two tool-call blocks through a
safety stage and the coalescing window, on both surfaces and in both ``[engine] overlap`` modes.

The window's logic is tested on plain values in ``tests/core/test_coalesce.py``; here the server's
shell drives it (the hub's pump, its flush deadline, the flushes at block boundaries), and the
stream must say exactly what the answer says and resume byte for byte after any of its events.
"""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from ringserve.core.sse import SSEParser
from ringserve.core.toolcalls import format_call
from tests.support.conformance import check_answer, check_stream, stream_bytes
from tests.support.server import fake_config, running_server

GUARD = 20  # seconds: a guard against hangs, not a wait
TEXT = "Let me check, é😀."
REPLY = (TEXT + format_call("get_weather", '{"city": "Zürich", "unit": "c"}') + "\n"
         + format_call("get_time", "{}") + "\n")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}
TOOLS = {
    "anthropic": [{"name": "get_weather", "input_schema": SCHEMA},
                  {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}],
    "openai": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
               {"type": "function", "function": {"name": "get_time"}}],
}
PATH = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("surface", ["anthropic", "openai"])
async def test_a_coalesced_stream_with_tool_calls_says_what_the_answer_says_and_resumes_byte_for_byte(
        tmp_path, surface, overlap):
    config = fake_config(tmp_path, engine={"overlap": overlap}, stream={"flush_ms": 25.0, "flush_tokens": 4},
                         safety={"window_tokens": 3, "patterns": ["never matches"]})
    body = {"model": "any", "max_tokens": 1000, "messages": [{"role": "user", "content": "weather?"}],
            "tools": TOOLS[surface]}
    async with running_server(config, step_seconds=0.005, piece_bytes=2, reply=REPLY) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=GUARD) as client:
        with trio.fail_after(GUARD):
            resp, raw = await stream_bytes(client, "POST", PATH[surface], json={**body, "stream": True})
            answer = await client.post(PATH[surface], json=body)
        assert resp.status_code == 200
        streamed, answered = check_stream(surface, raw), check_answer(surface, answer)
        assert streamed.text == answered.text == TEXT
        calls = [[(c.name, json.loads(c.arguments)) for c in seen.tool_calls] for seen in (streamed, answered)]
        assert calls[0] == calls[1] == [("get_weather", {"city": "Zürich", "unit": "c"}), ("get_time", {})]
        assert streamed.stop_reason == answered.stop_reason
        events, entries = SSEParser().feed(raw), raw.split(b"\n\n")[:-1]
        assert len(events) == len(entries)
        message_id = events[0].id.rsplit(":", 1)[0]
        for k in range(len(events) - 1):
            with trio.fail_after(GUARD):
                rest = await client.get(f"/v1/messages/{message_id}/stream", headers={"Last-Event-ID": events[k].id})
            assert rest.status_code == 200
            assert rest.content == b"".join(entry + b"\n\n" for entry in entries[k + 1:]), k
