"""What Claude Code sends, read by the Anthropic surface (issue 33, item 2): values in, values out.

The bodies are the captures of ``tests/data/agents/`` (docs/agents.md); the parse is
``surfaces/base.py`` ``read_request`` over ``AnthropicSurface.parse_request``, as the server runs it.
"""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import anthropic.types as a
import anthropic.types.beta as b
import attrs
import pytest

from ringserve.core.errors import RingserveError
from ringserve.core.events import (
    ChatMessage,
    ClearThinking,
    ClearToolUses,
    Effort,
    ReasoningConfig,
    SamplingParams,
    Trigger,
)
from ringserve.core.signing import ReasoningSigner, new_key
from ringserve.engine.fake import FakeEngine
from ringserve.surfaces.anthropic import EFFORTS, THINKING_TYPES, AnthropicSurface
from ringserve.surfaces.base import ParsedRequest, read_request

AGENTS = Path(__file__).resolve().parents[1] / "data" / "agents"
KEY = new_key()
SURFACE = AnthropicSurface()


def captured(run: str) -> list[dict]:
    """The ``/v1/messages`` bodies of one capture, in order."""
    lines = (AGENTS / f"{run}.jsonl").read_text().splitlines()
    return [r["body"] for r in map(json.loads, lines) if r["path"] == "/v1/messages"]


def parse(body: dict, key: str = KEY) -> ParsedRequest:
    return read_request(SURFACE.parse_request, body, key)


CLAUDE_RUNS = sorted(p.stem for p in AGENTS.glob("claude_*.jsonl"))


@pytest.mark.parametrize("run", CLAUDE_RUNS)
def test_every_captured_claude_code_request_parses_with_the_same_system_prefix(run):
    """Every body parses; each prompt (the fake engine's rendering, tools in its system turn)
    starts with the whole prompt of the request before it, but its generation prompt: the prefix
    cache hits turn after turn. (Tool search is the exception once: the tool it loads joins the
    tools, at the head of the prompt.)"""
    engine = FakeEngine()
    prompts = [bytes(engine.tokenize_chat(parse(body).request).tokens) for body in captured(run)]
    assert len(prompts) >= 3
    generation_prompt = engine.generation_prompt.encode()
    for i, (before, after) in enumerate(zip(prompts, prompts[1:])):
        if run == "claude_mcp_tool_search" and i == 0:
            continue
        assert after.startswith(before.removesuffix(generation_prompt)), (run, i)
    assert b"x-anthropic-billing-header" not in prompts[0]


def test_the_billing_stamp_is_dropped_and_reported():
    first = captured("claude_default")[0]
    parsed = parse(first)
    assert first["system"][0]["text"].startswith("x-anthropic-billing-header: cc_version=")
    assert parsed.request.messages[0] == ChatMessage("system", first["system"][1]["text"] + first["system"][2]["text"])
    assert parsed.ignored == ("metadata", "system[0]", "system[1].cache_control", "system[2].cache_control",
                              "messages[1].content[0].cache_control")
    # another session's stamp (another version, another hex): the same prompt
    other = json.loads(json.dumps(first).replace("cc_version=2.1.332.21e", "cc_version=2.1.400.9f3"))
    assert parse(other).request == parsed.request
    as_string = {**first, "system": "x-anthropic-billing-header: cc_version=1; cc_entrypoint=cli;\nBe brief."}
    assert parse(as_string).request.messages[0] == ChatMessage("system", "Be brief.")
    assert "system" in parse(as_string).ignored


@pytest.mark.parametrize(
    ("run", "reasoning"),
    [
        ("claude_default", ReasoningConfig(enabled=True, effort=Effort.MEDIUM)),  # the system message's effort
        ("claude_bare", ReasoningConfig(enabled=True, effort=Effort.MEDIUM)),  # the same on a control message
        ("claude_custom_model", ReasoningConfig(enabled=True, effort=Effort.HIGH)),
        ("claude_sonnet45", ReasoningConfig(enabled=True, budget_tokens=31999)),
        ("claude_thinking_off", ReasoningConfig(effort=Effort.MEDIUM)),  # no thinking: the model's default
    ],
)
def test_thinking_and_effort_become_the_reasoning_controls(run, reasoning):
    for body in captured(run):
        assert parse(body).request.reasoning == reasoning


def test_a_system_messages_effort_overrides_the_requests():
    body = {"model": "m", "max_tokens": 10, "output_config": {"effort": "low"},
            "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "system", "content": "now think hard", "output_config": {"effort": "max"}}]}
    assert parse(body).request.reasoning == ReasoningConfig(enabled=False, effort=Effort.MAX)
    assert parse({**body, "messages": body["messages"][:1]}).request.reasoning == ReasoningConfig(False, Effort.LOW)


def test_claude_codes_bare_control_message_sets_the_effort_and_renders_nothing():
    """Under ``--bare`` the per-turn control message has no content (issue 43, item 0): each
    request is its system prompt, then its turns as if the message were not there."""
    bodies = captured("claude_bare")
    assert bodies[0]["messages"][1] == {"role": "system", "content": [], "output_config": {"effort": "medium"}}
    for body in bodies:
        without = {**body, "messages": [m for m in body["messages"] if m["role"] != "system"]}
        assert parse(body).request == attrs.evolve(parse(without).request, reasoning=ReasoningConfig(True, Effort.MEDIUM))
        assert [m.role for m in parse(body).request.messages][:2] == ["system", "user"]
    assert parse({**bodies[0], "output_config": {"effort": "max"}}).request.reasoning.effort is Effort.MEDIUM


CONTROL = {"role": "system", "content": [], "output_config": {"effort": "low"}}


@pytest.mark.parametrize(
    ("messages", "roles"),
    [
        ([{"role": "user", "content": "hi"}, CONTROL], ["user"]),
        ([CONTROL, {"role": "user", "content": "hi"}], ["user"]),
        ([{"role": "user", "content": "hi"}, {**CONTROL, "content": ""}], ["user"]),
        ([{"role": "user", "content": "hi"}, {**CONTROL, "content": [{"type": "text", "text": ""}]}], ["user"]),
        ([{"role": "user", "content": "hi"}, {**CONTROL, "content": "be brief"}], ["user", "system"]),
        # a last assistant turn may be empty (the Messages API's rule): an empty prefill
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}], ["user", "assistant"]),
    ],
)
def test_a_message_with_nothing_to_render_is_accepted_where_the_messages_api_accepts_it(messages, roles):
    request = parse({"model": "m", "max_tokens": 10, "messages": messages}).request
    assert [m.role for m in request.messages] == roles
    assert all(m.content == "" for m in request.messages if m.role == "assistant")
    assert request.reasoning.effort is (Effort.LOW if any(m["role"] == "system" for m in messages) else None)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        # BetaSystemMessageParam: "a message with neither content nor output_config fields is rejected"
        ([{"role": "user", "content": "hi"}, {"role": "system", "content": []}], "messages[1].content: a system message"),
        ([{"role": "user", "content": "hi"}, {**CONTROL, "output_config": {}}], "messages[1].content: a system message"),
        ([{"role": "user", "content": "hi"}, {**CONTROL, "output_config": {"effort": None}}],
         "messages[1].content: a system message"),
        ([{"role": "user", "content": []}], "messages[0].content: must not be an empty list"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}, {"role": "user", "content": "and?"}],
         "messages[1].content: must not be an empty list"),
    ],
)
def test_a_message_with_nothing_at_all_is_a_400(messages, error):
    with pytest.raises(RingserveError, match=re.escape(error)):
        parse({"model": "m", "max_tokens": 10, "messages": messages})


def test_the_sdk_values_of_thinking_and_effort_are_all_read():
    types = {typing.get_args(typing.get_type_hints(td)["type"])[0] for td in b.BetaThinkingConfigParam.__args__}
    assert types == set(THINKING_TYPES)
    effort = typing.get_args(typing.get_type_hints(a.OutputConfigParam)["effort"])[0]
    assert set(typing.get_args(effort)) == set(EFFORTS)


def test_mid_conversation_system_messages_stay_where_they_stand():
    request = parse(captured("claude_haiku")[2]).request
    assert [m.role for m in request.messages] == ["system", "user", "system", "assistant", "tool", "system",
                                                  "assistant", "tool", "system"]


def test_deferred_tools_join_the_prompt_once_referenced():
    first, second, third = captured("claude_mcp_tool_search")
    names = [t["name"] for t in first["tools"]]
    assert [t["name"] for t in first["tools"] if t.get("defer_loading")] == ["DeferredToolPlaceholder"]
    assert [t.name for t in parse(first).request.tools] == [n for n in names if n != "DeferredToolPlaceholder"]
    loaded = [t["name"] for t in second["tools"] if t.get("defer_loading")]
    assert loaded == ["DeferredToolPlaceholder", "mcp__inventory__lookup_3"]
    for body in (second, third):
        assert [t.name for t in parse(body).request.tools][-1] == "mcp__inventory__lookup_3"
    # referenced from the tool result, which keeps its text blocks
    result = next(m for m in parse(second).request.messages if m.role == "tool")
    assert "mcp__inventory__lookup_3" not in result.content
    # a deferred tool no block names stays out; a reference to no tool is a 400
    unreferenced = {**second, "messages": second["messages"][:2]}
    assert "mcp__inventory__lookup_3" not in [t.name for t in parse(unreferenced).request.tools]
    wrong = json.loads(json.dumps(second).replace('"tool_name": "mcp__inventory__lookup_3"', '"tool_name": "nope"'))
    with pytest.raises(RingserveError, match=r"tool_name: 'nope' names no tool of tools"):
        parse(wrong)


def _with_thinking(*blocks: dict) -> dict:
    return {"model": "m", "max_tokens": 10, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "go"},
                         {"role": "assistant", "content": [*blocks, {"type": "text", "text": "done"}]},
                         {"role": "user", "content": "and then?"}]}


def test_signed_thinking_is_restored_and_foreign_thinking_dropped():
    signer = ReasoningSigner.from_text(KEY)
    ours = {"type": "thinking", "thinking": "plan A", "signature": signer.sign("plan A")}
    sealed = {"type": "thinking", "thinking": "", "signature": signer.seal("plan B")}  # display "omitted"
    claude = {"type": "thinking", "thinking": "real Claude's", "signature": "ErUBCkYIBBgCIkB" + "A" * 80}
    redacted = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"}
    parsed = parse(_with_thinking(ours, claude, sealed, redacted))
    assert parsed.request.messages[1] == ChatMessage("assistant", "done", reasoning="plan A\n\nplan B")
    assert parsed.ignored == ("messages[1].content[1]", "messages[1].content[3]")
    # with another key, or none, nothing verifies: dropped, never an error
    for key in (new_key(), ""):
        other = parse(_with_thinking(ours), key)
        assert other.request.messages[1].reasoning == "" and other.ignored == ("messages[1].content[0]",)
    edited = {**ours, "thinking": "plan C"}
    assert parse(_with_thinking(edited)).request.messages[1].reasoning == ""


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"type": "thinking", "thinking": "x"}, "a thinking block has a string thinking and a string signature"),
        ({"type": "thinking", "signature": 3, "thinking": "x"}, "signature"),
    ],
)
def test_malformed_thinking_blocks_are_400(block, message):
    with pytest.raises(RingserveError, match=message):
        parse(_with_thinking(block))
    user_thinking = _with_thinking()
    user_thinking["messages"][0] = {"role": "user", "content": [{"type": "thinking", "thinking": "", "signature": ""}]}
    with pytest.raises(RingserveError, match="thinking blocks belong in assistant messages"):
        parse(user_thinking)


@pytest.mark.parametrize(
    ("management", "edits"),
    [
        ({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, (ClearThinking(None),)),
        ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "all"}}]}, (ClearThinking(None),)),
        ({"edits": [{"type": "clear_thinking_20251015"}]}, (ClearThinking(1),)),
        ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 3}}]},
         (ClearThinking(3),)),
        ({"edits": [{"type": "clear_tool_uses_20250919"}]}, (ClearToolUses(),)),
        ({"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 5},
                     "keep": {"type": "tool_uses", "value": 1}, "clear_at_least": {"type": "input_tokens", "value": 9},
                     "exclude_tools": ["Read"], "clear_tool_inputs": ["Bash"]}]},
         (ClearToolUses(5, Trigger.TOOL_USES, 1, 9, frozenset({"Read"}), frozenset({"Bash"})),)),
        ({"edits": [{"type": "clear_tool_uses_20250919", "clear_tool_inputs": True},
                    {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]},
         (ClearToolUses(clear_inputs=True), ClearThinking(0))),
        ({}, ()),
        ({"edits": []}, ()),
    ],
)
def test_context_management_becomes_context_edits(management, edits):
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            "context_management": management}
    assert parse(body).request.context_edits == edits
    assert read_request(SURFACE.parse_count, body, KEY).request.context_edits == edits


@pytest.mark.parametrize(
    ("management", "message"),
    [
        ({"edits": [{"type": "compact_20260112"}]}, "compaction"),
        ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "tool_uses", "value": 1}}]}, "keep.type"),
        ({"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": -1}}]},
         "trigger.value"),
        ({"edits": [{"type": "clear_tool_uses_20250919", "exclude_tools": "Read"}]}, "exclude_tools"),
        ({"edits": {"type": "clear_thinking_20251015"}}, "edits: must be a list"),
    ],
)
def test_bad_context_management_is_400_naming_it(management, message):
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            "context_management": management}
    with pytest.raises(RingserveError, match=message) as info:
        parse(body)
    assert info.value.param == "context_management"


def test_count_tokens_reads_the_same_prompt_from_a_whole_request_body():
    for run in CLAUDE_RUNS:
        for body in captured(run):
            counted = read_request(SURFACE.parse_count, body, KEY)
            generated = parse(body).request
            assert counted.request == attrs.evolve(generated, max_tokens=None, sampling=SamplingParams(), stop=())
            assert {"max_tokens", "stream"} <= set(counted.ignored)
