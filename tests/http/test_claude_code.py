"""Every request Claude Code sent in the captures (``tests/data/agents/claude_*.jsonl``), replayed
against an in-process ringserve on the fake engine (issue 33, item 2 and its proof).

The fake engine tokenizes a byte per token, so its slots are made large enough for Claude Code's
prompts (13,000-22,000 tokens of a real tokenizer, 50-90 KB here). Each request is sent as captured
(its headers, ``?beta=true``, its body): a 200, every streamed event valid under the official SDK's
strict types (the standard and the beta ones, which Claude Code's bundled SDK reads), the fields
accepted and ignored named in ``Ringserve-Ignored-Fields``; ``count_tokens`` with the same body
gives the call's input tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from anthropic.types.beta import BetaMessage, BetaMessageTokensCount, BetaRawMessageStreamEvent
from pydantic import TypeAdapter

from ringserve.core.sse import SSEParser
from ringserve.store.sqlite import stored_render
from ringserve.surfaces.registry import SURFACES
from tests.support.conformance import check_answer, check_stream, stream_bytes
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until

AGENTS = Path(__file__).resolve().parents[1] / "data" / "agents"
BETA_EVENT = TypeAdapter(BetaRawMessageStreamEvent)
#: Per slot: the largest captured prompt is about 90,000 bytes, one fake token each.
CTX = 131072
#: Headers a client sends that a replay keeps (the rest are the stub's transport).
KEPT_HEADERS = ("anthropic-version", "anthropic-beta", "x-app", "user-agent", "x-claude-code-session-id")
REPLY = "Hi! How can I help?"


def claude_requests() -> list[tuple[str, int, dict[str, Any]]]:
    """(run, index, request) of every captured Claude Code model call."""
    out = []
    for capture in sorted(AGENTS.glob("claude_*.jsonl")):
        for i, line in enumerate(capture.read_text().splitlines()):
            request = json.loads(line)
            assert request["path"] == "/v1/messages", request["path"]
            out.append((capture.stem, i, request))
    return out


REQUESTS = claude_requests()


@pytest.fixture
async def big_server(tmp_path):
    config = fake_config(tmp_path, engine={"ctx_per_slot": CTX, "slots": 2})
    async with running_server(config, reply=REPLY, piece_bytes=4) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client:
            yield state, client


def _headers(request: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in request["headers"].items() if k.lower() in KEPT_HEADERS}


def _query(request: dict[str, Any]) -> dict[str, Any]:
    return {k: v[0] for k, v in request["query"].items()}


def test_the_captures_hold_every_mode():
    runs = {run for run, _, _ in REQUESTS}
    assert {"claude_default", "claude_bare", "claude_sonnet45", "claude_thinking_off", "claude_mcp_tool_search"} <= runs
    assert len(REQUESTS) >= 20
    assert any(r["body"].get("stream") is False for _, _, r in REQUESTS)  # the non-streaming fallback


async def test_every_captured_request_is_answered_and_every_event_is_valid(big_server):
    """Each capture in order: 200, valid events, the reply; its count is its prompt's tokens."""
    _state, client = big_server
    for run, i, request in REQUESTS:
        body, where = request["body"], f"{run}[{i}]"
        kwargs = {"json": body, "headers": _headers(request), "params": _query(request)}
        if body.get("stream"):
            resp, raw = await stream_bytes(client, "POST", "/v1/messages", **kwargs)
            assert resp.status_code == 200, (where, raw[:500])
            seen = check_stream("anthropic", raw)
            events = SSEParser().feed(raw)
            for event in events:  # and Claude Code's own SDK's types (beta), strictly
                BETA_EVENT.validate_json(event.data, strict=True)
            usage = json.loads(events[0].data)["message"]["usage"]
        else:
            resp = await client.post("/v1/messages", **kwargs)
            assert resp.status_code == 200, (where, resp.text[:500])
            seen = check_answer("anthropic", resp)
            BetaMessage.model_validate_json(resp.text, strict=True)
            usage = resp.json()["usage"]
        assert seen.text == REPLY and seen.stop_reason == "end_turn", where
        # what was accepted and ignored is named: the billing stamp, the caching hints, the bookkeeping
        ignored = resp.headers["ringserve-ignored-fields"].split(", ")
        assert {"metadata", "system[0]", "system[1].cache_control"} <= set(ignored), (where, ignored)
        # count_tokens with the same body (it takes every field) counts the call's prompt
        count = await client.post("/v1/messages/count_tokens", json=body, headers=_headers(request),
                                  params=_query(request))
        assert count.status_code == 200, (where, count.text)
        BetaMessageTokensCount.model_validate_json(count.text, strict=True)
        assert count.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"], where


async def test_turns_of_one_session_hit_the_prefix_cache(big_server):
    """Turn after turn, the prompt before is a prefix of the next one: it comes from the cache."""
    _state, client = big_server
    for run in ("claude_default", "claude_haiku", "claude_mcp_tool_search"):
        usages = []
        for _, _, request in (r for r in REQUESTS if r[0] == run):
            body = {**request["body"], "stream": False}
            resp = await client.post("/v1/messages", json=body, headers=_headers(request))
            usages.append(resp.json()["usage"])
        for before, after in zip(usages, usages[1:]):
            prompt_before = before["input_tokens"] + before["cache_read_input_tokens"]
            # the cache holds the previous prompt; the new turn is prefilled after it (the tool
            # search turn adds a tool to the tools, which come first: a miss there)
            if run != "claude_mcp_tool_search":
                assert after["cache_read_input_tokens"] >= prompt_before, (run, usages)


async def test_max_tokens_past_the_context_is_served_not_refused(tmp_path):
    """Claude Code asks for 32,000-128,000 tokens; a slot of 8,192 serves what is left."""
    request = next(r for run, _, r in REQUESTS if run == "claude_custom_model")
    config = fake_config(tmp_path, engine={"ctx_per_slot": 65536, "slots": 1})
    async with running_server(config, reply=REPLY) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client:
            body = {**request["body"], "stream": False}
            assert body["max_tokens"] == 32000
            resp = await client.post("/v1/messages", json=body, headers=_headers(request))
            assert resp.status_code == 200, resp.text
            assert resp.json()["content"] == [{"type": "text", "text": REPLY}]


async def test_context_edits_are_reported_in_the_count_and_the_answer(big_server):
    """A clear_tool_uses edit past its trigger: the count is the trimmed prompt's and says what it
    was; the call's prompt is the same, and its Message and message_delta say what was cleared."""
    state, client = big_server
    request = next(r for run, i, r in REQUESTS if run == "claude_default" and i == 2)
    body = json.loads(json.dumps({k: request["body"][k] for k in ("model", "messages", "system", "tools")}))
    body["messages"][3]["content"][0]["content"] = "a long output\n" * 200  # the first call's result
    plain = (await client.post("/v1/messages/count_tokens", json=body)).json()
    assert plain.keys() == {"input_tokens"}
    edits = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
                        "keep": {"type": "tool_uses", "value": 1}}]}
    edited = (await client.post("/v1/messages/count_tokens", json={**body, "context_management": edits})).json()
    assert edited["context_management"] == {"original_input_tokens": plain["input_tokens"]}
    assert edited["input_tokens"] < plain["input_tokens"]
    call = await client.post("/v1/messages", json={**body, "max_tokens": 100, "context_management": edits})
    usage = call.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == edited["input_tokens"]
    # the answer says what was cleared, as Anthropic's does: the Message and the stream's message_delta
    applied = {"applied_edits": [{"type": "clear_tool_uses_20250919", "cleared_tool_uses": 1,
                                  "cleared_input_tokens": plain["input_tokens"] - edited["input_tokens"]}]}
    assert call.json()["context_management"] == applied
    BetaMessage.model_validate_json(call.text, strict=True)
    resp, raw = await stream_bytes(client, "POST", "/v1/messages",
                                   json={**body, "max_tokens": 100, "context_management": edits, "stream": True})
    check_stream("anthropic", raw)
    delta = next(json.loads(e.data) for e in SSEParser().feed(raw) if e.event == "message_delta")
    assert delta["context_management"] == applied
    BETA_EVENT.validate_json(json.dumps(delta), strict=True)
    # and so will the stream rebuilt from the store: the row keeps them
    message_id = resp.headers["x-message-id"]
    await wait_until(lambda: (row := state.hub.store.get(message_id)) is not None and row.status.final)
    render = stored_render(state.hub.store.get(message_id))
    assert render is not None and SURFACES.by_name("anthropic").restored(render.echo, state.hub.signer).edits == applied
    # keep-all clears nothing: no context_management in the answer
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    plain_call = await client.post("/v1/messages", json={**body, "max_tokens": 100, "context_management": keep_all})
    assert "context_management" not in plain_call.json()
