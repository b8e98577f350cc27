"""The official TypeScript SDKs (``@anthropic-ai/sdk``, ``openai``; pinned in ``tests/ts/package.json``)
against an in-process ringserve on the fake engine: ``tests/ts/sdk_streams.mjs`` streams every surface
through the SDKs' own helpers, text and tool calls, and what their accumulators make of the stream
equals what the server answers without streaming (issue 33, "Proof (CI)"); a thinking model's
reply too (issue 34).

Skipped where Node or the SDKs are not installed (``npm ci --prefix tests/ts``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import trio

from ringserve.core.toolcalls import format_call
from tests.support.server import fake_config, running_server

TS = Path(__file__).resolve().parents[1] / "ts"
SCRIPT = TS / "sdk_streams.mjs"

pytestmark = pytest.mark.skipif(shutil.which("node") is None or not (TS / "node_modules").is_dir(),
                                reason="Node or the TypeScript SDKs are not installed: npm ci --prefix tests/ts")

#: What the fake engine answers to the script's prompts (``PROMPTS`` there). "text" is an ``echo:``
#: (multi-byte characters cut across tokens); "forced" names the tool, so the engine writes its
#: grammar's example; "mixed" offers it, and the reply writes text, then a call.
ECHO = "Grüße aus Köln, 世界! 👋🏽"
LEAD = "Let me look that up."
MIXED_REPLY = f"{LEAD}\n{format_call('get_weather', json.dumps({'city': 'Paris', 'unit': 'celsius'}))}"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
#: The stop of a reply with a call, and of one without, per surface.
STOPS = {"anthropic": ("tool_use", "end_turn"), "chat": ("tool_calls", "stop"), "responses": ("completed", "completed")}


async def node(tmp_path: Path, *args: str, **engine: Any) -> dict[str, Any]:
    """Run the script with ``args`` against a fresh fake-engine server (``engine``: the FakeEngine's
    arguments); its JSON answer."""
    with trio.fail_after(120):
        async with running_server(fake_config(tmp_path), **engine) as state:
            done = await trio.run_process(["node", str(SCRIPT), state.urls[0], *args], capture_stdout=True,
                                          capture_stderr=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"node exited with status {done.returncode}: {done.stderr.decode()}")
    return json.loads(done.stdout)


def reply(last_user_text: str) -> str:
    return MIXED_REPLY if last_user_text == "Look it up." else "unexpected prompt"


async def test_the_sdks_stream_text_and_tool_calls_on_every_surface_as_the_server_answers_them(tmp_path):
    results = await node(tmp_path, "streams", reply=reply, piece_bytes=3)
    assert set(results) == {f"{s}/{k}" for s in STOPS for k in ("text", "forced", "mixed")}
    for case, result in results.items():
        surface, kind = case.split("/")
        stream, plain = result["stream"], result["plain"]
        assert "error" not in stream and "error" not in plain, (case, result)
        deltas = stream.pop("deltas")
        assert stream == plain, case  # the accumulator's message is the server's non-stream answer
        assert deltas["text"] == stream["text"], case  # and the deltas the helper handed out add up to it
        if surface == "anthropic":
            assert json.loads(deltas["arguments"] or "null") == (stream["calls"][0]["arguments"] if stream["calls"] else None)
        else:
            assert deltas["arguments"] == "".join(call["raw"] for call in stream["calls"]), case
        match kind:
            case "text":
                assert (stream["text"], stream["calls"], stream["stop"]) == (ECHO, [], STOPS[surface][1]), case
            case "forced" | "mixed":
                assert [call["name"] for call in stream["calls"]] == ["get_weather"], case
                jsonschema.validate(stream["calls"][0]["arguments"], WEATHER)
                assert stream["text"].strip() == ("" if kind == "forced" else LEAD), case
                assert stream["stop"] == STOPS[surface][0], case


async def test_the_responses_stream_helper_takes_the_keepalives_of_a_paused_stream_as_its_snapshot(tmp_path):
    """The server pauses 1.1 s between tokens, heartbeat 1 s: ``response.in_progress`` comes again
    in the middle of the text and of the call, with the response so far. The Node helper replaces
    its snapshot with each (ResponseAccumulator) and goes on from there: its final response and its
    deltas are the whole answer; the Python helper (which checks each one's id) reads the same
    stream at the same time (issue 33, item 4)."""
    python: list[Any] = []

    def python_helper(url: str) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": False}]
        with client.responses.stream(model="any", input="Look it up.", tools=tools, max_output_tokens=256) as stream:
            python.append(sum(1 for event in stream if event.type == "response.in_progress"))
            python.append(stream.get_final_response())

    with trio.fail_after(120):
        async with running_server(fake_config(tmp_path, server={"heartbeat_interval": 1.0}), reply=reply,
                                  piece_bytes=40, step_seconds=1.1) as state:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, python_helper, state.urls[0])
                done = await trio.run_process(["node", str(SCRIPT), state.urls[0], "silences"],
                                              capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    keepalives, final = python
    assert keepalives >= 3 and final.output_text.strip() == LEAD
    assert [(i.type, i.name, json.loads(i.arguments)) for i in final.output if i.type == "function_call"] == [
        ("function_call", "get_weather", {"city": "Paris", "unit": "celsius"})]
    result = json.loads(done.stdout)
    assert "error" not in result, result
    assert result["keepalives"] >= 3, result  # the opening one, then one per pause (in the text, in the call)
    assert result["text"].strip() == LEAD and result["deltas"]["text"] == result["text"]
    assert [call["name"] for call in result["calls"]] == ["get_weather"]
    assert result["deltas"]["arguments"] == result["calls"][0]["raw"]
    assert result["calls"][0]["arguments"] == {"city": "Paris", "unit": "celsius"} and result["stop"] == "completed"


@pytest.mark.parametrize("surface", ["anthropic", "chat", "responses"])
def test_a_chat_loop_sends_back_what_the_stream_helper_returned(tmp_path, surface):
    """The next turn of a loop carries the first turn's message as the helper returned it; the OpenAI
    helpers add ``parsed`` (messages, output text) and ``parsed_arguments`` (calls) to it, which
    ringserve accepts and names in Ringserve-Ignored-Fields, as llama-server ignores them (issue 33, item 1)."""
    result = trio.run(node, tmp_path, "loop", surface)  # a sync test: pytest-trio would group the assertion
    assert result == {"ok": True}


THOUGHT = "Plan it: 世界 👋, then answer."
#: Where the first turn's reasoning sits in the second turn's request.
HANDED_BACK = {"anthropic": "messages[1].content[0]", "chat": "messages[1].reasoning_content",
               "responses": "input[1]"}


async def test_the_sdks_accumulate_a_thinking_reply_on_every_surface(tmp_path):
    """A thinking model (the Hermes family's <think> block) through each SDK's stream helper: the
    reasoning its deltas add up to is the plain answer's, the helper ends without an error, and the
    message it returns goes back as the next turn's history with its reasoning kept, not reported
    ignored (Anthropic's thinking block with its signature, which ringserve verifies; Chat's
    ``reasoning_content``; the Responses output's reasoning item). The OpenAI Node helper keeps
    only the last ``reasoning_content`` fragment in its final message (it assigns delta fields it
    does not know), so Chat's reasoning is compared by its deltas."""
    results = await node(tmp_path, "thinking", reply=f"<think>{THOUGHT}</think>Done.", chat_format="hermes",
                         piece_bytes=3)
    for surface, result in results.items():
        stream, plain = result["stream"], result["plain"]
        assert "error" not in stream and "error" not in plain, (surface, result)
        assert stream["deltas"]["reasoning"] == plain["reasoning"] == THOUGHT, surface
        assert stream["text"] == plain["text"] == "Done.", surface
        assert "error" not in result["loop"], (surface, result)
        assert HANDED_BACK[surface] not in result["loop"]["ignored"], (surface, result)
    anthropic = results["anthropic"]["stream"]
    assert anthropic["reasoning"] == THOUGHT and anthropic["signatures"] == [anthropic["deltas"]["signature"]]
    assert results["responses"]["stream"]["reasoning"] == THOUGHT
