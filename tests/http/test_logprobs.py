"""Log probabilities through the whole server, on the scripted fake engine (issue 40 item 4).

Chat Completions (``logprobs``, ``top_logprobs``) and Responses (``include:
["message.output_text.logprobs"]``, ``top_logprobs``): every event validates under the official
SDK's strict types, the tokens' bytes add up to the text, and a resume in the middle reads the same
bytes from the live log and from the store once the log is gone; the non-stream answer, GET and the
Response object say what the stream carried.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from ringserve.core.sse import SSEParser
from tests.http.test_responses import check_object
from tests.http.test_responses import check_stream as check_responses
from tests.support.conformance import check_answer, check_stream, stream_bytes
from tests.support.server import fake_config, running_server

TEXT = "Héllo 👋 wörld, " * 12
PATHS = {"openai": "/v1/chat/completions", "responses": "/v1/responses"}


def body(surface: str, stream: bool) -> dict[str, Any]:
    if surface == "openai":
        return {"model": "m", "messages": [{"role": "user", "content": "echo:" + TEXT}], "stream": stream,
                "logprobs": True, "top_logprobs": 2}
    return {"model": "m", "input": "echo:" + TEXT, "stream": stream, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}


def streamed_logprobs(surface: str, raw: bytes) -> list[dict[str, Any]]:
    """Every log probability the stream's text events carried, in order."""
    out: list[dict[str, Any]] = []
    for event in SSEParser().feed(raw):
        if event.data == "[DONE]":
            continue
        data = json.loads(event.data)
        if surface == "openai":
            choice = data["choices"][0] if data["choices"] else {}
            out += (choice.get("logprobs") or {}).get("content", [])
            assert (choice.get("logprobs") is not None) == bool(choice.get("delta", {}).get("content")), data
        elif data["type"] == "response.output_text.delta":
            assert data["logprobs"] and all("bytes" not in lp for lp in data["logprobs"])
            out += data["logprobs"]
    return out


def after(raw: bytes, seq: int) -> bytes:
    """The SSE blocks of ``raw`` after the one with ``seq`` (heartbeat comments left out)."""
    blocks = [b + b"\n\n" for b in raw.split(b"\n\n") if b and not b.startswith(b":")]
    return b"".join(blocks[seq + 1:])


async def resumed(client: httpx.AsyncClient, surface: str, message_id: str, seq: int) -> bytes:
    if surface == "responses":
        _, raw = await stream_bytes(client, "GET", f"/v1/responses/{message_id}",
                                    params={"stream": "true", "starting_after": str(seq)})
    else:
        _, raw = await stream_bytes(client, "GET", f"/v1/messages/{message_id}/stream",
                                    headers={"Last-Event-ID": f"{message_id}:{seq}"})
    return raw


@pytest.mark.parametrize("surface", PATHS)
async def test_logprobs_stream_answer_and_resume_from_the_log_and_from_the_store(tmp_path, surface):
    # the default coalescing window over 2 ms steps: the deltas' boundaries are the producer's, not the text's
    async with running_server(fake_config(tmp_path), step_seconds=0.002, piece_bytes=3) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            resp, raw = await stream_bytes(client, "POST", PATHS[surface], json=body(surface, stream=True))
            assert resp.status_code == 200, raw
            seen = check_stream("openai", raw) if surface == "openai" else check_responses(raw)
            assert seen.text == TEXT
            logprobs = streamed_logprobs(surface, raw)
            encoded = TEXT.encode()
            # tokens of 3 bytes: "é" and "👋" are cut across tokens
            assert [lp["token"] for lp in logprobs][:3] == ["Hé", "llo", " "]
            assert len(logprobs) == -(-len(encoded) // 3)
            assert all(len(lp["top_logprobs"]) == 2 for lp in logprobs)
            message_id = resp.headers["x-message-id"]
            n = len([b for b in raw.split(b"\n\n") if b and not b.startswith(b":")])
            cuts = (3, n // 2, n - 3)
            assert state.hub.logs.get(message_id) is not None
            for cut in cuts:  # the live log
                assert await resumed(client, surface, message_id, cut) == after(raw, cut), cut
            state.hub.logs.forget(message_id)  # the log is gone: rebuilt from the store, the same bytes
            for cut in cuts:
                assert await resumed(client, surface, message_id, cut) == after(raw, cut), cut
            whole = await client.post(PATHS[surface], json=body(surface, stream=False))
            stored = await client.get(f"/v1/responses/{message_id}") if surface == "responses" else None
    if surface == "openai":
        check_answer("openai", whole)
        content = whole.json()["choices"][0]["logprobs"]["content"]
        assert content == logprobs
        assert b"".join(bytes(lp["bytes"]) for lp in content) == encoded
    else:
        for answer in (check_object(whole), check_object(stored)):
            [part] = answer["output"][0]["content"]
            assert [{k: lp[k] for k in ("token", "logprob")} for lp in part["logprobs"]] == [
                {k: lp[k] for k in ("token", "logprob")} for lp in logprobs]
            assert b"".join(bytes(lp["bytes"]) for lp in part["logprobs"]) == encoded
            assert answer["top_logprobs"] == 2


async def test_without_asking_there_are_none(fake_server):
    _state, client = fake_server
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat = await client.post(PATHS["openai"], json=chat_body)
    assert chat.json()["choices"][0]["logprobs"] is None
    response = check_object(await client.post(PATHS["responses"], json={"model": "m", "input": "hi"}))
    assert response["output"][0]["content"][0]["logprobs"] == [] and response["top_logprobs"] is None
