"""Every request Codex CLI sent in the captures (``tests/data/agents/codex_*.jsonl``), replayed on the
Responses surface of an in-process ringserve on the fake engine (issue 33, item 3 and its proof).

Each request is sent as captured (its body and the headers Codex sends: ``session-id``,
``x-client-request-id``, ...): a 200; every event valid in strict mode under the official SDK's
types (``tests.http.test_responses.check_stream``: ``ResponseStreamEvent``, the terminal
``Response``), the stream ending with the ``response.completed`` Codex needs (its id, usage with
input, output, total tokens and their details); its ``reasoning`` and ``include`` honoured, what
was accepted and ignored named in ``Ringserve-Ignored-Fields``. Codex's retries of one turn (the
same body under its session header, after a 500, a 503 and a cut stream in ``codex_retries``) make
one generation; the turns of a session read the previous turn's prompt from the prefix cache (the
cached-token share is printed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from ringserve.core.sse import SSEParser
from ringserve.engine.fake import FakeEngine
from tests.http.test_responses import check_stream
from tests.support.conformance import stream_bytes
from tests.support.server import fake_config, running_server

AGENTS = Path(__file__).resolve().parents[1] / "data" / "agents"
#: Per slot: a captured body is about 41 KB; its prompt (the tools' JSON, the instructions) about
#: as many fake tokens (a byte each).
CTX = 65536
#: The headers of Codex's that a replay keeps (the rest are the stub's transport).
KEPT_HEADERS = ("session-id", "thread-id", "x-client-request-id", "originator", "user-agent",
                "x-codex-turn-metadata", "x-codex-window-id", "x-codex-beta-features")
REPLY = "Done."


def codex_requests() -> dict[str, list[dict[str, Any]]]:
    """Each Codex run's captured model calls, in order."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for capture in sorted(AGENTS.glob("codex_*.jsonl")):
        runs[capture.stem] = [json.loads(line) for line in capture.read_text().splitlines()]
        assert all(r["path"] == "/v1/responses" for r in runs[capture.stem])
    return runs


RUNS = codex_requests()


def _headers(request: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in request["headers"].items() if k.lower() in KEPT_HEADERS}


@pytest.fixture
async def server(tmp_path):
    """A server on the fake engine with slots for Codex's prompts; yields (engine, client)."""
    engines: list[FakeEngine] = []

    def factory(config):
        engines.append(FakeEngine(n_slots=2, n_ctx=CTX, reply=REPLY, piece_bytes=2))
        return engines[0]

    config = fake_config(tmp_path, engine={"ctx_per_slot": CTX, "slots": 2})
    async with running_server(config, engine_factory=factory) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client:
            yield engines[0], client


def test_the_captures_hold_every_mode():
    assert {"codex_custom_model", "codex_gpt55", "codex_reasoning", "codex_retries", "codex_429"} <= set(RUNS)
    kinds = {tool["type"] for run in RUNS.values() for r in run for tool in r["body"]["tools"]}
    assert {"function", "namespace", "custom", "web_search", "tool_search"} <= kinds
    items = {item.get("type") for run in RUNS.values() for r in run for item in r["body"]["input"]}
    assert {"message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output"} <= items


async def test_every_captured_request_is_answered_with_valid_events_and_one_generation_per_turn(server):
    """Run by run, in order: each request a 200 whose stream is valid and ends with a whole
    response.completed; a retry of a turn (the same body, the same session) replays the turn's
    generation instead of making another one."""
    engine, client = server
    turns = 0
    for run, requests in RUNS.items():
        answers: dict[str, bytes] = {}
        for i, request in enumerate(requests):
            body, where = request["body"], f"{run}[{i}]"
            resp, raw = await stream_bytes(client, "POST", "/v1/responses", json=body, headers=_headers(request))
            assert resp.status_code == 200, (where, raw[:500])
            seen = check_stream(raw)
            final = seen.final
            assert final is not None and final["status"] == "completed" and seen.text == REPLY, where
            usage = final["usage"]
            assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0, where
            assert {"cached_tokens"} <= usage["input_tokens_details"].keys(), where
            assert "reasoning_tokens" in usage["output_tokens_details"], where
            ignored = set(resp.headers["ringserve-ignored-fields"].split(", "))
            assert "client_metadata" in ignored and not {"include", "reasoning"} & ignored, (where, ignored)
            asked = body.get("reasoning") or {}  # honoured: the controls, and the summary echoed
            assert final["reasoning"] == {"effort": asked.get("effort"), "summary": asked.get("summary")}, where
            assert any(path.startswith("tools[") for path in ignored), (where, ignored)  # web_search and co.
            key = json.dumps(body, sort_keys=True)
            if key in answers:  # a retry: the same bytes, from the same generation
                assert raw == answers[key], where
            answers[key] = raw
        turns += len(answers)
    assert len(engine.begins) == turns == 9


async def test_a_retry_after_a_cut_stream_attaches_to_the_running_turn(server):
    """Codex's re-POST after a stream cut short (codex_retries' third attempt): the first attempt
    is still generating (its message waits for its client's retry), the retry reads it whole."""
    engine, client = server
    request = RUNS["codex_retries"][0]
    kwargs = {"json": request["body"], "headers": _headers(request)}
    async with client.stream("POST", "/v1/responses", **kwargs) as resp:
        assert resp.status_code == 200
        async for chunk in resp.aiter_raw():
            if b"response.in_progress" in chunk:
                break  # the client gives up on this stream
    resp, raw = await stream_bytes(client, "POST", "/v1/responses", **kwargs)
    assert check_stream(raw).text == REPLY
    assert len(engine.begins) == 1


async def test_the_turns_of_a_session_read_the_previous_prompt_from_the_prefix_cache(server):
    """Each turn's input extends the one before (the call and its output appended): the turn reads
    the previous turn's prompt from the cache. The share of input tokens that came from the cache
    over the later turns is printed (the figure docs/agents.md quotes)."""
    _engine, client = server
    cached = total = 0
    for run in ("codex_custom_model", "codex_gpt55", "codex_reasoning"):
        usages = []
        for request in RUNS[run]:
            _resp, raw = await stream_bytes(client, "POST", "/v1/responses", json=request["body"],
                                            headers=_headers(request))
            usages.append(check_stream(raw).final["usage"])
        for before, after in zip(usages, usages[1:]):
            assert after["input_tokens_details"]["cached_tokens"] >= before["input_tokens"], (run, usages)
            cached += after["input_tokens_details"]["cached_tokens"]
            total += after["input_tokens"]
    share = cached / total
    print(f"\ncodex replay: {cached} of {total} input tokens of the later turns came from the prefix cache"
          f" ({share:.1%})")
    assert share > 0.9
