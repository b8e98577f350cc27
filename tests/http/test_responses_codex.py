"""What Codex CLI sends on the Responses API and what it reads back (issue 33, item 3; docs/agents.md).

Its input items (developer messages anywhere, reasoning items of every shape, calls and outputs of
function, namespaced and custom tools, items without ids), its tools (functions, a ``namespace``
flattened into functions the model calls as ``namespace.name``, ``custom`` freeform tools with a
Lark grammar, hosted tools accepted and left out), and the items it builds its history from:
``function_call`` with its ``namespace``, ``custom_tool_call`` with its ``input`` and the
``response.custom_tool_call_input.*`` events. Every event is validated in strict mode against the
official SDK's types (``tests.http.test_responses``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response

from ringserve.core.events import (
    FREEFORM_ARGUMENT,
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ChatMessage,
    Finish,
    StopReason,
    ToolCall,
    Usage,
)
from ringserve.core.toolcalls import format_call
from ringserve.surfaces.responses import RESPONSES, CallName, ResponseOptions, parse_create
from tests.http.test_responses import _render, check_object, check_stream
from tests.support.conformance import stream_bytes
from tests.support.server import fake_config, running_server

#: Codex's apply_patch grammar (as in tests/data/agents/codex_gpt55.jsonl) and a patch it accepts.
APPLY_PATCH_GRAMMAR = json.loads(
    (__import__("pathlib").Path(__file__).parents[1] / "data" / "agents" / "codex_gpt55.jsonl")
    .read_text().splitlines()[0])["body"]["tools"][3]["format"]["definition"]
PATCH = '*** Begin Patch\n*** Add File: g.txt\n+written by "apply_patch" \\ é😀\n*** End Patch\n'
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files. FREEFORM.",
               "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR}}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Spawn one.", "strict": False,
     "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}},
    {"type": "custom", "name": "note", "description": "A note."}]}
HOSTED = [{"type": "web_search", "external_web_access": True, "search_content_types": ["text", "image"]},
          {"type": "tool_search", "execution": "client", "description": "Search deferred tools.",
           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}},
          {"type": "image_generation"}]
TOOLS = [EXEC, APPLY_PATCH, AGENTS, *HOSTED]


def msg(role: str, *texts: str, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": t} for t in texts], **extra}


#: A conversation as Codex replays it: every item shape of its history, most without ids.
INPUT = [
    msg("developer", "You are Codex.", id="msg_1"),
    msg("developer", "<skills>", "<permissions>"),
    msg("user", "<environment_context>"),
    msg("user", "Write f.txt, then g.txt."),
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "a summary"}],
     "content": [{"type": "reasoning_text", "text": "I will run echo."}], "encrypted_content": "gAAA"},
    {"type": "function_call", "status": "completed", "name": "exec_command", "call_id": "call_1",
     "arguments": '{"cmd": "echo hi > f.txt"}', "parsed_arguments": {"cmd": "echo hi > f.txt"}},
    {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "exit 0"}]},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "only a summary"}],
     "encrypted_content": "gAAB"},
    {"type": "custom_tool_call", "id": "ctc_2", "status": "completed", "call_id": "call_2", "name": "apply_patch",
     "input": PATCH},
    {"type": "custom_tool_call_output", "id": "ctco_2", "call_id": "call_2", "output": "Success."},
    {"type": "reasoning", "summary": [], "encrypted_content": "gAAC"},
    {"type": "function_call", "name": "spawn_agent", "namespace": "multi_agent_v1", "call_id": "call_3",
     "arguments": '{"task": "x"}'},
    {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "q"}},
    {"type": "function_call_output", "call_id": "call_3", "output": "spawned", "namespace": "multi_agent_v1"},
    msg("developer", "<turn context>"),
    {"role": "user", "content": "Now say done."},
]


def test_every_item_codex_replays_becomes_the_conversation_it_stands_for():
    """Developer messages are system turns where they stand; a reasoning item's readable text is
    the reasoning of the assistant turn after it, one with only a summary or encrypted content is
    dropped; calls keep their ids, a custom call's input is its one argument, a namespaced call is
    named ``namespace.name``; outputs as strings or parts; hosted tools' items are dropped; the
    Node SDK's ``parsed_arguments`` is accepted."""
    create = parse_create({"model": "m", "input": INPUT, "tools": TOOLS})
    assert create.input == (
        ChatMessage("system", "You are Codex."),
        ChatMessage("system", "<skills><permissions>"),
        ChatMessage("user", "<environment_context>"),
        ChatMessage("user", "Write f.txt, then g.txt."),
        ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "exec_command", '{"cmd": "echo hi > f.txt"}'),),
                    reasoning="I will run echo."),
        ChatMessage("tool", "exit 0", tool_call_id="call_1"),
        ChatMessage("assistant", "", tool_calls=(
            ToolCall("call_2", "apply_patch", json.dumps({FREEFORM_ARGUMENT: PATCH}, ensure_ascii=False,
                                                         separators=(",", ":"))),)),
        ChatMessage("tool", "Success.", tool_call_id="call_2"),
        ChatMessage("assistant", "", tool_calls=(ToolCall("call_3", "multi_agent_v1.spawn_agent", '{"task": "x"}'),)),
        ChatMessage("tool", "spawned", tool_call_id="call_3"),
        ChatMessage("system", "<turn context>"),
        ChatMessage("user", "Now say done."),
    )


def test_tools_namespaces_are_flattened_custom_tools_are_freeform_and_hosted_ones_left_out():
    options = parse_create({"model": "m", "input": "hi", "tools": TOOLS}).options
    assert [t.name for t in options.tools] == ["exec_command", "apply_patch", "multi_agent_v1.spawn_agent",
                                               "multi_agent_v1.note"]
    patch, spawn, note = options.tools[1], options.tools[2], options.tools[3]
    assert patch.strict and patch.grammar == APPLY_PATCH_GRAMMAR and note.grammar == ""
    schema = json.loads(patch.parameters)
    assert schema["required"] == [FREEFORM_ARGUMENT] and APPLY_PATCH_GRAMMAR in schema["properties"]["input"]["description"]
    assert spawn.description == "Tools for sub-agents.\n\nSpawn one."
    assert options.calls == {"apply_patch": CallName("apply_patch", custom=True),
                             "multi_agent_v1.spawn_agent": CallName("spawn_agent", "multi_agent_v1"),
                             "multi_agent_v1.note": CallName("note", "multi_agent_v1", custom=True)}
    # a regex grammar is a Lark grammar of one terminal
    regex = {"type": "custom", "name": "digits", "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]+/\n"}}
    [digits] = parse_create({"model": "m", "input": "hi", "tools": [regex]}).options.tools
    assert digits.grammar == "start: /[0-9]+\\/\\n/"


def _custom_options() -> ResponseOptions:
    return parse_create({"model": "m", "input": "hi", "tools": TOOLS}).options


@pytest.mark.parametrize("cuts", [[len('{"input": "')], [3, 14, 15, 40, 41, 60], list(range(1, 120))])
def test_a_custom_tools_call_streams_as_a_custom_tool_call_with_its_input_deltas(cuts):
    """The model writes the input as the JSON string of its one argument, in fragments cut anywhere
    (inside an escape too): the deltas are the text, their join the done event's ``input`` and
    the item's, the item a ``custom_tool_call`` (``ctc_`` id, no status), all strict-valid."""
    arguments = json.dumps({FREEFORM_ARGUMENT: PATCH})
    pieces = [arguments[a:b] for a, b in zip([0, *cuts], [*cuts, len(arguments)]) if arguments[a:b]]
    call = BlockStart(0, BlockKind.TOOL_CALL, "apply_patch", "cd" * 12)
    events = _render([call, *[BlockDelta(0, p) for p in pieces], BlockStop(0), Finish(StopReason.TOOL_USE, Usage(3, 9))],
                     _custom_options())
    added = events[2]
    assert added["type"] == "response.output_item.added"
    item = {"id": "ctc_" + "cd" * 12, "call_id": "call_" + "cd" * 12, "name": "apply_patch",
            "type": "custom_tool_call", "input": PATCH}
    assert added["item"] == {**item, "input": ""}
    deltas = [e for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert "".join(d["delta"] for d in deltas) == PATCH and all(d["item_id"] == item["id"] for d in deltas)
    assert [e["type"] for e in events[-3:]] == ["response.custom_tool_call_input.done", "response.output_item.done",
                                                "response.completed"]
    assert events[-3]["input"] == PATCH and events[-2]["item"] == item == events[-1]["response"]["output"][0]
    Response.model_validate(events[-1]["response"], strict=True)


def test_a_namespaced_call_is_a_function_call_with_its_namespace():
    call = BlockStart(0, BlockKind.TOOL_CALL, "multi_agent_v1.spawn_agent", "ef" * 12)
    events = _render([call, BlockDelta(0, '{"task":'), BlockDelta(0, '"x"}'), BlockStop(0),
                      Finish(StopReason.TOOL_USE, Usage(3, 9))], _custom_options())
    done = events[-2]["item"]
    assert done == {"id": "fc_" + "ef" * 12, "call_id": "call_" + "ef" * 12, "name": "spawn_agent",
                    "namespace": "multi_agent_v1", "type": "function_call", "arguments": '{"task":"x"}',
                    "status": "completed"}
    assert events[-1]["response"]["output"] == [done]


def _reply(text: str) -> str:
    """The fake model's turn: a namespaced call when asked to spawn, else text."""
    if text == "spawn":
        return format_call("multi_agent_v1.spawn_agent", '{"task": "count"}')
    return "done"


async def test_codex_shaped_requests_stream_valid_events_and_a_namespaced_call_it_can_route(tmp_path):
    """Over HTTP, on the fake engine: the whole conversation above with Codex's tools and fields
    streams a valid answer; the model's call of a namespaced function comes back as the
    ``function_call`` item Codex routes (``name`` and ``namespace``), and the Response object
    echoes every tool as sent (valid as ``Response`` in strict mode)."""
    body = {"model": "m", "input": INPUT, "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True,
            "stream": True, "store": False, "prompt_cache_key": "0199-session"}
    async with running_server(fake_config(tmp_path), reply=_reply) as state:
        import httpx

        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            resp, raw = await stream_bytes(client, "POST", "/v1/responses", json=body)
            assert resp.status_code == 200, raw
            seen = check_stream(raw)
            assert seen.text == "done" and seen.final["tools"] == [EXEC, APPLY_PATCH, AGENTS, *HOSTED]
            # what was dropped is named: reasoning without readable text, a hosted tool's item, the
            # hosted tools, the Node SDK's parsed_arguments, ids and bookkeeping
            ignored = resp.headers["ringserve-ignored-fields"].split(", ")
            assert {"input[7]", "input[10]", "input[12]", "tools[3]", "tools[4]", "tools[5]",
                    "input[5].parsed_arguments"} <= set(ignored), ignored
            assert "input[4]" not in ignored  # its reasoning text is the turn's
            # (no freeform tool here: its grammar would apply to the scripted call, and the fake
            # engine then writes the grammar's example instead)
            functions = [EXEC, {**AGENTS, "tools": AGENTS["tools"][:1]}, *HOSTED]
            spawn = {**body, "tools": functions, "input": [*INPUT[:-1], {"role": "user", "content": "spawn"}]}
            resp, raw = await stream_bytes(client, "POST", "/v1/responses", json=spawn)
            [call] = check_stream(raw).calls
            assert (call["name"], call["namespace"], json.loads(call["arguments"])) == (
                "spawn_agent", "multi_agent_v1", {"task": "count"})
            forced = {**spawn, "stream": False, "tools": TOOLS, "tool_choice": {"type": "custom", "name": "apply_patch"}}
            answer = check_object(await client.post("/v1/responses", json=forced))
            assert answer["tool_choice"] == {"type": "custom", "name": "apply_patch"}
            assert answer["output"][0]["type"] == "custom_tool_call"


async def test_parallel_tool_calls_false_keeps_the_first_call_of_a_reply_that_makes_two(tmp_path):
    """Codex sends ``parallel_tool_calls``; with false the reply ends after its first whole call."""
    two = format_call("exec_command", '{"cmd": "a"}') + "\n" + format_call("exec_command", '{"cmd": "b"}')
    async with running_server(fake_config(tmp_path), reply=lambda _text: two) as state:
        import httpx

        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            for parallel, commands in ((True, ["a", "b"]), (False, ["a"])):
                body = {"model": "m", "input": "run", "tools": [EXEC], "parallel_tool_calls": parallel, "stream": True}
                _resp, raw = await stream_bytes(client, "POST", "/v1/responses", json=body)
                seen = check_stream(raw)
                assert [json.loads(c["arguments"])["cmd"] for c in seen.calls] == commands
                assert seen.final["parallel_tool_calls"] is parallel
