"""Tool use and structured output on the surfaces (issue 14): parsing into the neutral request
values, every bad input a 400 naming its field, and the rendering of tool-call blocks.

The parser tests call ``parse_request`` on plain dicts (no server); the renderer tests feed
``BlockStart``/``BlockDelta``/``BlockStop``/``Finish`` values straight into a renderer.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import httpx
import pydantic
import pytest
import trio

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ChatMessage,
    ContentBlock,
    Failure,
    Finish,
    GenerationRequest,
    OutputFormat,
    OutputKind,
    StopReason,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
    Usage,
)
from ringserve.core.render import render
from ringserve.core.ringlog import format_event_id
from ringserve.core.schema import MAX_REPEATS
from ringserve.core.sse import SSEParser, encode_event
from ringserve.core.status import MessageStatus
from ringserve.core.view import MessageView
from ringserve.surfaces.anthropic import AnthropicSurface
from ringserve.surfaces.base import MAX_TOOLS, dumps
from ringserve.surfaces.openai import OpenAISurface
from tests.support.conformance import check_answer, check_stream, stream_bytes
from tests.support.server import fake_config, running_server

ANTHROPIC = AnthropicSurface()
OPENAI = OpenAISurface()

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
A_WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_SCHEMA}
A_TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
O_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                              "parameters": WEATHER_SCHEMA, "strict": True}}
O_TIME = {"type": "function", "function": {"name": "get_time"}}


def anthropic_request(**body: Any) -> GenerationRequest:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ANTHROPIC.parse_request({"model": "m", "max_tokens": 16, **body}).request


def openai_request(**body: Any) -> GenerationRequest:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return OPENAI.parse_request({"model": "m", **body}).request


def refused(parse, body: dict[str, Any]) -> RingserveError:
    with pytest.raises(RingserveError) as info:
        parse(**copy.deepcopy(body))
    assert info.value.kind is ErrorKind.INVALID_REQUEST and info.value.status == 400
    return info.value


# -- Anthropic: what a good request becomes ------------------------------------------------------


def test_anthropic_tools_and_choices():
    request = anthropic_request(tools=[A_WEATHER, {**A_TIME, "type": "custom", "cache_control": {"type": "ephemeral"},
                                                   "strict": True, "eager_input_streaming": True}])
    assert request.tools == (
        ToolSpec("get_weather", "The weather in a city.", dumps(WEATHER_SCHEMA)),
        ToolSpec("get_time", "", dumps(A_TIME["input_schema"]), strict=True),
    )
    assert request.tool_choice == ToolChoice()
    choices = {
        "auto": ToolChoice(ToolChoiceMode.AUTO),
        "any": ToolChoice(ToolChoiceMode.REQUIRED),
        "none": ToolChoice(ToolChoiceMode.NONE),
    }
    for kind, expected in choices.items():
        assert anthropic_request(tools=[A_WEATHER], tool_choice={"type": kind}).tool_choice == expected
    named = anthropic_request(tools=[A_WEATHER, A_TIME],
                              tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True})
    assert named.tool_choice == ToolChoice(ToolChoiceMode.NAMED, "get_time", parallel=False)
    assert anthropic_request(tools=[A_WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": False}
                             ).tool_choice == ToolChoice(ToolChoiceMode.REQUIRED, parallel=True)


def test_anthropic_tool_use_and_tool_result_history():
    messages = [
        {"role": "user", "content": "weather in Paris and Oslo?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_01A", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_01B", "name": "get_weather", "input": {"city": "Oslo"},
             "cache_control": {"type": "ephemeral"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "21 C"},
            {"type": "tool_result", "tool_use_id": "toolu_01B", "is_error": True,
             "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "station"}]},
            {"type": "text", "text": "thanks"},
        ]},
        {"role": "assistant", "content": "Paris is warm."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01A"}]},
    ]
    request = anthropic_request(tools=[A_WEATHER], messages=messages, system="be brief")
    assert request.messages == (
        ChatMessage("system", "be brief"),
        ChatMessage("user", "weather in Paris and Oslo?"),
        ChatMessage("assistant", "Checking.", tool_calls=(
            ToolCall("toolu_01A", "get_weather", '{"city":"Paris"}'),
            ToolCall("toolu_01B", "get_weather", '{"city":"Oslo"}'),
        )),
        ChatMessage("tool", "21 C", tool_call_id="toolu_01A"),
        ChatMessage("tool", "no station", tool_call_id="toolu_01B", is_error=True),
        ChatMessage("user", "thanks"),
        ChatMessage("assistant", "Paris is warm."),
        ChatMessage("tool", "", tool_call_id="toolu_01A"),
    )


def test_anthropic_output_config_format():
    schema = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string"}}}}
    request = anthropic_request(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert request.output == OutputFormat(OutputKind.JSON_SCHEMA, dumps(schema))
    for neutral in ({}, {"format": None}, {"effort": None}):
        assert anthropic_request(output_config=neutral).output == OutputFormat()


class Colours(pydantic.BaseModel):
    names: list[str]


def mock_client(module: Any, status: int, **answer: Any) -> tuple[Any, list[dict[str, Any]]]:
    """A ``module.Client`` (``httpx``, or ``httpx2``, the anthropic SDK's fork) that answers every
    request with ``module.Response(status, **answer)`` and records the JSON bodies sent."""
    sent: list[dict[str, Any]] = []

    def handler(request: Any) -> Any:
        sent.append(json.loads(request.content))
        return module.Response(status, **answer)

    return module.Client(transport=module.MockTransport(handler)), sent


def test_anthropic_sdk_parse_sends_output_config_format():
    """What ``messages.parse(output_format=Model)`` puts on the wire (anthropic 2.14), parsed."""
    import anthropic
    import httpx2  # the anthropic SDK's own httpx fork

    error = {"type": "error", "error": {"type": "invalid_request_error", "message": "x"}}
    http, sent = mock_client(httpx2, 400, json=error)
    client = anthropic.Anthropic(api_key="k", base_url="http://test", max_retries=0, http_client=http)
    for api in (client.messages, client.beta.messages):
        with pytest.raises(anthropic.BadRequestError):
            api.parse(model="m", max_tokens=16, messages=[{"role": "user", "content": "hi"}], output_format=Colours)
    for body in sent:
        assert set(body["output_config"]) == {"format"} and "output_format" not in body
        request = ANTHROPIC.parse_request(body).request
        assert request.output.kind is OutputKind.JSON_SCHEMA
        assert json.loads(request.output.schema)["properties"]["names"]["type"] == "array"


# -- Anthropic: bad input, a 400 naming the field --------------------------------------------------

TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                              "input": {"city": "Paris"}}]}


def _result(tool_use_id: Any, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, **extra}]}


ANTHROPIC_BAD = [
    ({"tools": [A_WEATHER, {**A_WEATHER, "description": "again"}]}, "tools[1].name: duplicate tool name"),
    ({"tools": [A_WEATHER] * 2}, "duplicate tool name 'get_weather'"),
    ({"tools": [{**A_WEATHER, "name": f"t{i}"} for i in range(MAX_TOOLS + 1)]}, f"at most {MAX_TOOLS} tools"),
    ({"tools": {"name": "x"}}, "tools: must be a list"),
    ({"tools": ["get_weather"]}, "tools[0]: must be an object"),
    ({"tools": [{**A_WEATHER, "input_schema": "object"}]}, "tools[0].input_schema: a JSON schema must be a JSON object"),
    ({"tools": [{**A_WEATHER, "input_schema": {"type": "string"}}]}, 'tools[0].input_schema: a tool\'s arguments schema'),
    ({"tools": [{"name": "get_weather"}]}, "tools[0].input_schema"),
    ({"tools": [{**A_WEATHER, "name": "get weather"}]}, "tools[0].name"),
    ({"tools": [{**A_WEATHER, "name": "x" * 65}]}, "tools[0].name"),
    ({"tools": [{**A_WEATHER, "description": 3}]}, "tools[0].description"),
    ({"tools": [{**A_WEATHER, "strict": "yes"}]}, "tools[0].strict"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({"tools": [A_WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}}, "no tool named 'get_time'"),
    ({"tool_choice": {"type": "tool", "name": "get_time"}}, "no tool named 'get_time'"),
    ({"tool_choice": {"type": "any"}}, "tool_choice: a tool call is required but the request has no tools"),
    ({"tools": [A_WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [A_WEATHER], "tool_choice": {"type": "required"}}, "tool_choice.type: must be one of"),
    ({"tools": [A_WEATHER], "tool_choice": {"type": ["any"]}}, "tool_choice.type: must be one of"),
    ({"tools": [A_WEATHER], "tool_choice": "any"}, "tool_choice: must be an object"),
    ({"tools": [A_WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": 1}},
     "tool_choice.disable_parallel_tool_use"),
    ({"messages": [{"role": "user", "content": "hi"}, TOOL_USE, _result("toolu_1")]},
     "tools: requests which include tool_use or tool_result blocks must define tools"),
    ({"messages": [{"role": "user", "content": "hi"}, TOOL_USE]}, "must define tools"),
    ({"messages": [{"role": "user", "content": "hi"}, TOOL_USE, _result("toolu_2")]},
     "messages[2].content[0].tool_use_id: 'toolu_2' matches no earlier tool call id"),
    ({"messages": [_result("toolu_1"), TOOL_USE]}, "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": "hi"}, TOOL_USE, _result(None)]}, "messages[2].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": "hi"}, TOOL_USE, TOOL_USE]}, "duplicate tool call id 'toolu_1'"),
    ({"messages": [{"role": "user", "content": "hi"}, TOOL_USE, _result("toolu_1", is_error="no")]},
     "messages[2].content[0].is_error"),
    ({"messages": [{"role": "user", "content": "hi"}, TOOL_USE, _result("toolu_1", content=[{"type": "image"}])]},
     "messages[2].content[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}, TOOL_USE, _result("toolu_1", content=3)]},
     "messages[2].content[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}, TOOL_USE, _result("toolu_1", toolset_name="x")]},
     "messages[2].content[0].toolset_name"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{**TOOL_USE["content"][0], "input": '{"city": "Paris"}'}]}]},
     "messages[1].content[0].input: must be an object"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{**TOOL_USE["content"][0], "id": ""}]}]},
     "messages[1].content[0].id"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{**TOOL_USE["content"][0], "name": "a b"}]}]},
     "messages[1].content[0].name"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{**TOOL_USE["content"][0], "caller": {"type": "code"}}]}]},
     "messages[1].content[0].caller"),
    ({"messages": [{"role": "user", "content": TOOL_USE["content"]}]}, "tool_use blocks belong in assistant messages"),
    ({"messages": [{"role": "user", "content": "hi"}, TOOL_USE,
                   {"role": "assistant", "content": _result("toolu_1")["content"]}]},
     "messages[2].content[0]: tool_result blocks belong in user messages"),
    ({"system": [TOOL_USE["content"][0]]}, "system[0]"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "json_schema", "schema": "{}"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": "json"}, "output_config: must be an object"),
    ({"output_config": {"effort": "lowest"}}, "output_config.effort: must be one of"),
    ({"output_format": {"type": "json_object"}}, "output_format.type"),
    ({"tools": [{**A_WEATHER, "defer_loading": "yes"}]}, "tools[0].defer_loading"),
]


UNENFORCEABLE = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}


@pytest.mark.parametrize(
    ("parse", "body", "param", "message"),
    [
        (anthropic_request, {"tools": [{"name": "f", "input_schema": UNENFORCEABLE}], "tool_choice": {"type": "any"}},
         "tools", "tools[0].input_schema.properties.n: keyword 'minimum' is not supported"),
        (anthropic_request, {"output_config": {"format": {"type": "json_schema", "schema": UNENFORCEABLE}}},
         "output_config", "output_config.format.schema.properties.n: keyword 'minimum' is not supported"),
        (openai_request, {"tools": [{"type": "function", "function": {"name": "f", "parameters": UNENFORCEABLE}}],
                          "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools", "tools[0].function.parameters.properties.n: keyword 'minimum' is not supported"),
        (openai_request, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNENFORCEABLE}}},
         "response_format", "response_format.json_schema.schema.properties.n: keyword 'minimum' is not supported"),
    ],
)
def test_a_schema_keyword_the_grammar_cannot_enforce_is_named_in_the_surfaces_spelling(parse, body, param, message):
    error = refused(parse, body)
    assert (error.param, error.message) == (param, message)


def test_an_unenforced_keyword_is_fine_where_the_model_only_reads_the_schema():
    request = anthropic_request(tools=[{"name": "f", "input_schema": UNENFORCEABLE}])  # auto, not strict
    assert request.tools[0].name == "f"


@pytest.mark.parametrize(("body", "message"), ANTHROPIC_BAD)
def test_anthropic_bad_tool_input_is_400_naming_the_field(body, message):
    error = refused(anthropic_request, body)
    assert message in error.message


# -- OpenAI: what a good request becomes --------------------------------------------------------


def test_openai_tools_and_choices():
    request = openai_request(tools=[O_WEATHER, O_TIME])
    assert request.tools == (
        ToolSpec("get_weather", "The weather in a city.", dumps(WEATHER_SCHEMA), strict=True),
        ToolSpec("get_time", "", '{"type":"object","properties":{}}'),
    )
    assert request.tool_choice == ToolChoice()
    for wire, mode in [("none", ToolChoiceMode.NONE), ("auto", ToolChoiceMode.AUTO),
                       ("required", ToolChoiceMode.REQUIRED)]:
        assert openai_request(tools=[O_TIME], tool_choice=wire).tool_choice == ToolChoice(mode)
    named = openai_request(tools=[O_WEATHER, O_TIME], parallel_tool_calls=False,
                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_choice == ToolChoice(ToolChoiceMode.NAMED, "get_weather", parallel=False)
    assert openai_request(tools=[O_TIME], parallel_tool_calls=False).tool_choice == ToolChoice(parallel=False)


def test_openai_tool_calls_and_tool_messages_history():
    messages = [
        {"role": "user", "content": "weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_A", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_B", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_A", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_B", "content": [{"type": "text", "text": "no station"}]},
        {"role": "assistant", "content": "Paris is warm.", "tool_calls": []},
    ]
    request = openai_request(tools=[O_WEATHER], messages=messages)
    assert request.messages == (
        ChatMessage("user", "weather in Paris and Oslo?"),
        ChatMessage("assistant", "", tool_calls=(  # the arguments as the client wrote them, as llama-server keeps them
            ToolCall("call_A", "get_weather", '{"city": "Paris"}'),
            ToolCall("call_B", "get_weather", '{"city":"Oslo"}'),
        )),
        ChatMessage("tool", "21 C", tool_call_id="call_A"),
        ChatMessage("tool", "no station", tool_call_id="call_B"),
        ChatMessage("assistant", "Paris is warm."),
    )


def test_openai_response_formats():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    assert openai_request(response_format={"type": "text"}).output == OutputFormat()
    assert openai_request(response_format={"type": "json_object"}).output == OutputFormat(OutputKind.JSON_OBJECT)
    spec = {"name": "A", "schema": schema, "strict": True, "description": "an A"}
    assert openai_request(response_format={"type": "json_schema", "json_schema": spec}).output == \
        OutputFormat(OutputKind.JSON_SCHEMA, dumps(schema))
    assert openai_request(response_format={"type": "json_schema", "json_schema": {"name": "A"}}).output == \
        OutputFormat(OutputKind.JSON_OBJECT)


def test_openai_sdk_parse_sends_response_format_json_schema():
    """What ``chat.completions.parse(response_format=Model)`` sends (openai 3.57), parsed."""
    import openai

    error = {"error": {"message": "x", "type": "invalid_request_error", "param": None, "code": None}}
    http, sent = mock_client(httpx, 400, json=error)
    client = openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=0, http_client=http)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "hi"}],
                                      response_format=Colours)
    (body,) = sent
    output = OPENAI.parse_request(body).request.output
    assert output.kind is OutputKind.JSON_SCHEMA
    assert json.loads(output.schema)["required"] == ["names"]


# -- OpenAI: bad input, a 400 naming the field ------------------------------------------------------

CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}


def _calls(**function: Any) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}", **function}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


OPENAI_BAD = [
    ({"tools": [O_WEATHER, O_WEATHER]}, "tools", "tools[1].name: duplicate tool name 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": f"t{i}"}} for i in range(MAX_TOOLS + 1)]}, "tools",
     f"at most {MAX_TOOLS} tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools",
     "tools[0].function.parameters: a JSON schema must be a JSON object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]}, "tools", "tools[0].function.strict"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].function: must be an object"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools", "tools[0].type"),
    ({"tools": "get_weather"}, "tools", "tools: must be a list"),
    ({"tools": [O_WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "no tool named 'get_time'"),
    ({"tool_choice": "required"}, "tool_choice", "the request has no tools"),
    ({"tools": [O_WEATHER], "tool_choice": "any"}, "tool_choice", "tool_choice: must be"),
    ({"tools": [O_WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice.function"),
    ({"tools": [O_WEATHER], "tool_choice": {"type": "custom", "custom": {"name": "get_weather"}}}, "tool_choice",
     "tool_choice.type"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, _calls(arguments="{city: Paris}")]}, "messages",
     "messages[1].tool_calls[0].function.arguments: must be JSON text of an object"),
    ({"messages": [{"role": "user", "content": "hi"}, _calls(arguments='["Paris"]')]}, "messages",
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "hi"}, _calls(arguments={"city": "Paris"})]}, "messages",
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "hi"}, _calls(name="")]}, "messages",
     "messages[1].tool_calls[0].function.name"),
    ({"messages": [{"role": "user", "content": "hi"}, CALLS, CALLS]}, "messages", "duplicate tool call id 'call_1'"),
    ({"messages": [{"role": "user", "content": "hi"}, {**CALLS, "tool_calls": {"id": "x"}}]}, "messages",
     "messages[1].tool_calls: must be a list"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x", "tool_calls": []}]},
     "messages", "messages[1].tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, CALLS, {"role": "tool", "tool_call_id": "call_2", "content": "x"}]},
     "messages", "messages[2].tool_call_id: 'call_2' matches no earlier tool call id"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}, "messages",
     "messages[1].tool_call_id"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, "response_format",
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}}, "response_format",
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}}, "response_format",
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "a"}}}, "response_format",
     "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type"),
    ({"response_format": "json_object"}, "response_format", "response_format: must be an object"),
]


@pytest.mark.parametrize(("body", "param", "message"), OPENAI_BAD)
def test_openai_bad_tool_input_is_400_naming_the_field(body, param, message):
    error = refused(openai_request, body)
    assert error.param == param and message in error.message


# -- on a server (fake engine): accepted requests, count_tokens -----------------------------------

HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01A", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01A", "content": "21 C"}]},
]

COUNTED = [
    {},
    {"system": [{"type": "text", "text": "be brief"}]},
    {"tools": [A_WEATHER, A_TIME], "tool_choice": {"type": "auto"}},
    {"tools": [A_WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": HISTORY},
    {"output_config": {"format": {"type": "json_schema", "schema": WEATHER_SCHEMA}}, "system": "json"},
]


@pytest.mark.parametrize("extra", COUNTED)
async def test_count_tokens_equals_the_usage_of_the_same_request(fake_server, extra):
    """``count_tokens`` is the prompt of the same request: its usage's input and cache-read
    tokens (so it still holds once tools are rendered into the prompt)."""
    from anthropic.types import MessageTokensCount

    _state, client = fake_server
    body = {"model": "any", "messages": [{"role": "user", "content": "hello"}], **extra}
    resp = await client.post("/v1/messages/count_tokens", json=body)
    assert resp.status_code == 200, resp.text
    count = MessageTokensCount.model_validate(resp.json(), strict=True)
    answer = await client.post("/v1/messages", json={**body, "max_tokens": 8})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert count.input_tokens == usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    if extra.get("system"):
        plain = await client.post("/v1/messages/count_tokens", json={**body, "system": None})
        assert plain.json()["input_tokens"] < count.input_tokens


async def test_a_prompt_longer_than_a_slot_is_counted_and_its_generation_refused(fake_server):
    """``count_tokens`` counts a prompt the context cannot hold (how a client such as Claude Code
    learns how much to trim), where the generation route answers its 400."""
    state, client = fake_server
    ctx = state.hub.runner.context_window
    body = {"model": "any", "messages": [{"role": "user", "content": "w " * ctx}]}
    resp = await client.post("/v1/messages/count_tokens", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["input_tokens"] > ctx
    refused = await client.post("/v1/messages", json={**body, "max_tokens": 8})
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
    assert f"but the context is {ctx} tokens" in refused.json()["error"]["message"]


async def test_count_tokens_through_the_sdk(fake_server):
    import anthropic

    state, _client = fake_server

    def count() -> int:
        client = anthropic.Anthropic(base_url=state.urls[0], api_key="unused", max_retries=0)
        return client.messages.count_tokens(model="any", messages=HISTORY, tools=[A_WEATHER],
                                            system="be brief").input_tokens

    n = await trio.to_thread.run_sync(count)
    answer = await _client.post("/v1/messages", json={"model": "any", "max_tokens": 8, "messages": HISTORY,
                                                      "tools": [A_WEATHER], "system": "be brief"})
    usage = answer.json()["usage"]
    assert n == usage["input_tokens"] + usage["cache_read_input_tokens"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "model: field required"),
        ({"model": "any", "messages": []}, "messages: must be a non-empty list"),
        ({"model": "any", "messages": [{"role": "user", "content": "hi"}], "tools": [A_WEATHER, A_WEATHER]},
         "duplicate tool name"),
        ({"model": "any", "messages": HISTORY[:1] + HISTORY[2:]}, "matches no earlier tool call id"),
        ({"model": "any", "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled"}},
         "thinking"),
    ],
)
async def test_count_tokens_bad_input_is_400(fake_server, body, message):
    _state, client = fake_server
    resp = await client.post("/v1/messages/count_tokens", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]
    resp = await client.post("/v1/messages/count_tokens", content=b"{not json")
    assert resp.status_code == 400 and resp.json()["type"] == "error"


async def test_tool_requests_are_accepted_on_both_surfaces(fake_server):
    """A request with tools, a tool history and an output format is served (no longer a 400)."""
    _state, client = fake_server
    resp = await client.post("/v1/messages", json={
        "model": "any", "max_tokens": 8, "messages": HISTORY, "tools": [A_WEATHER],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    })
    assert resp.status_code == 200, resp.text
    resp = await client.post("/v1/chat/completions", json={
        "model": "any", "max_tokens": 8, "tools": [O_WEATHER], "tool_choice": "auto", "parallel_tool_calls": False,
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        ],
    })
    assert resp.status_code == 200, resp.text


# -- rendering tool-call blocks: events fed straight into a renderer, judged by the SDKs ---------------

MSG = {"anthropic": "msg_" + "a" * 24, "openai": "chatcmpl-" + "b" * 24}
SURFACES = {"anthropic": ANTHROPIC, "openai": OPENAI}
CALL_A, CALL_B = "0123456789abcdef01234567", "89abcdef0123456789abcdef"
WEATHER_ARGS = ['{"city', '": "Par', 'is", "unit": "c"}']
TEXT_THEN_TWO_CALLS = [
    BlockStart(0, BlockKind.TEXT), BlockDelta(0, "Let me "), BlockDelta(0, "check."), BlockStop(0),
    BlockStart(1, BlockKind.TOOL_CALL, "get_weather", CALL_A), *[BlockDelta(1, a, 2) for a in WEATHER_ARGS],
    BlockStop(1),
    BlockStart(2, BlockKind.TOOL_CALL, "get_time", CALL_B), BlockDelta(2, "{}"), BlockStop(2),
    Finish(StopReason.TOOL_USE, Usage(10, 9)),
]
ONE_CALL = [
    BlockStart(0, BlockKind.TOOL_CALL, "get_weather", CALL_A), *[BlockDelta(0, a) for a in WEATHER_ARGS],
    BlockDelta(0, ""), BlockStop(0), Finish(StopReason.TOOL_USE, Usage(10, 6)),
]
CUT_CALL = [
    BlockStart(0, BlockKind.TEXT), BlockDelta(0, "ok"), BlockStop(0),
    BlockStart(1, BlockKind.TOOL_CALL, "get_weather", CALL_A), BlockDelta(1, WEATHER_ARGS[0]), BlockStop(1),
    Finish(StopReason.MAX_TOKENS, Usage(10, 3)),
]
WEATHER = ("get_weather", {"city": "Paris", "unit": "c"})


def wire_bytes(surface: str, events: list[Any], *, include_usage: bool = False) -> bytes:
    """What the hub would log for these events: the renderer's wire events, encoded with ids."""
    renderer = SURFACES[surface].renderer(MSG[surface], "m", 1700000000, include_usage)
    wire = renderer.start(Usage(10, 0)) + [w for event in events for w in render(renderer, event)]
    return b"".join(encode_event(w.data, event=w.event, id=format_event_id(MSG[surface], i))
                    for i, w in enumerate(wire))


def collected(events: list[Any]) -> tuple[ContentBlock, ...]:
    """The whole blocks of these events, as ``Generation.collect`` gives them."""
    blocks: list[ContentBlock] = []
    for event in events:
        match event:
            case BlockStart():
                blocks.append(ContentBlock(event.kind, name=event.name, call_id=event.call_id))
            case BlockDelta():
                blocks[-1] = attrs.evolve(blocks[-1], text=blocks[-1].text + event.text)
    return tuple(blocks)


def answer(surface: str, events: list[Any]) -> httpx.Response:
    finish = events[-1]
    view = MessageView(MSG[surface], surface, "m", 1700000000, MessageStatus.COMPLETE, collected(events),
                       finish.stop_reason, None, finish.usage)
    return httpx.Response(200, json=SURFACES[surface].message_json(view))


def calls(seen) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in seen.tool_calls]


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
def test_text_then_two_tool_calls_stream_and_answer(surface):
    stop = {"anthropic": "tool_use", "openai": "tool_calls"}[surface]
    prefix = {"anthropic": "toolu_", "openai": "call_"}[surface]
    for include_usage in (False, True) if surface == "openai" else (False,):
        streamed = check_stream(surface, wire_bytes(surface, TEXT_THEN_TWO_CALLS, include_usage=include_usage))
        assert streamed.text == "Let me check." and streamed.stop_reason == stop
        assert calls(streamed) == [WEATHER, ("get_time", {})]
        assert [c.call_id for c in streamed.tool_calls] == [prefix + CALL_A, prefix + CALL_B]
        assert streamed.json_deltas >= len(WEATHER_ARGS) + 1  # fragments as decoded, not one piece at the end
    answered = check_answer(surface, answer(surface, TEXT_THEN_TWO_CALLS))
    assert answered.text == "Let me check." and answered.stop_reason == stop
    assert [c.value() for c in answered.tool_calls] == [c.value() for c in streamed.tool_calls]
    if surface == "anthropic":
        assert streamed.blocks == answered.blocks == ["text", "tool_use", "tool_use"]


def test_anthropic_tool_use_wire_shape():
    events = [json.loads(e.data) for e in SSEParser().feed(wire_bytes("anthropic", TEXT_THEN_TWO_CALLS))]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [e["index"] for e in starts] == [0, 1, 2]
    assert starts[1]["content_block"] == {"type": "tool_use", "id": "toolu_" + CALL_A, "name": "get_weather",
                                          "input": {}}
    deltas = [e for e in events if e["type"] == "content_block_delta" and e["index"] == 1]
    assert [d["delta"] for d in deltas] == [{"type": "input_json_delta", "partial_json": a} for a in WEATHER_ARGS]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    content = answer("anthropic", TEXT_THEN_TWO_CALLS).json()["content"]
    assert content[1] == {"type": "tool_use", "id": "toolu_" + CALL_A, "name": "get_weather",
                          "input": {"city": "Paris", "unit": "c"}}


def test_openai_tool_call_wire_shape():
    chunks = [json.loads(e.data) for e in SSEParser().feed(wire_bytes("openai", TEXT_THEN_TWO_CALLS))[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls_ = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls_[0] == [{"index": 0, "id": "call_" + CALL_A, "type": "function",
                          "function": {"name": "get_weather", "arguments": ""}}]
    assert calls_[1:4] == [[{"index": 0, "function": {"arguments": a}}] for a in WEATHER_ARGS]
    assert calls_[4] == [{"index": 1, "id": "call_" + CALL_B, "type": "function",
                          "function": {"name": "get_time", "arguments": ""}}]
    assert calls_[5] == [{"index": 1, "function": {"arguments": "{}"}}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    message = answer("openai", TEXT_THEN_TWO_CALLS).json()["choices"][0]["message"]
    assert message["content"] == "Let me check."
    assert message["tool_calls"][0] == {"id": "call_" + CALL_A, "type": "function",
                                        "function": {"name": "get_weather", "arguments": "".join(WEATHER_ARGS)}}
    only_calls = answer("openai", ONE_CALL).json()["choices"][0]["message"]
    assert only_calls["content"] is None and len(only_calls["tool_calls"]) == 1


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
def test_a_message_that_is_one_tool_call(surface):
    streamed = check_stream(surface, wire_bytes(surface, ONE_CALL))
    answered = check_answer(surface, answer(surface, ONE_CALL))
    assert streamed.text == answered.text == "" and calls(streamed) == calls(answered) == [WEATHER]
    if surface == "anthropic":
        assert streamed.blocks == answered.blocks == ["tool_use"]
    else:  # an empty fragment sends no chunk
        assert streamed.json_deltas == len(WEATHER_ARGS)


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
def test_a_tool_call_cut_by_max_tokens(surface):
    """Arguments cut before they form an object: the stream has the fragments; the Anthropic answer's
    ``input`` is ``{}`` (an object, as the type requires), OpenAI's ``arguments`` the text as cut."""
    streamed = check_stream(surface, wire_bytes(surface, CUT_CALL))
    answered = check_answer(surface, answer(surface, CUT_CALL))
    assert streamed.stop_reason == answered.stop_reason == {"anthropic": "max_tokens", "openai": "length"}[surface]
    assert streamed.tool_calls[0].arguments == WEATHER_ARGS[0]
    assert answered.tool_calls[0].arguments == {"anthropic": "{}", "openai": WEATHER_ARGS[0]}[surface]


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
def test_a_failure_inside_a_tool_call(surface):
    events = [*ONE_CALL[:3], Failure(ErrorKind.API_ERROR, "the engine failed", Usage(10, 2))]
    seen = check_stream(surface, wire_bytes(surface, events))
    assert seen.error is not None and seen.stop_reason is None
    assert seen.tool_calls[0].arguments == "".join(WEATHER_ARGS[:2])


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
def test_resuming_inside_a_tool_call_continues_the_arguments(surface):
    """Cut after every event: the head and the resumed rest are valid, and together say the same."""
    raw = wire_bytes(surface, TEXT_THEN_TWO_CALLS)
    whole = check_stream(surface, raw)
    blocks = raw.split(b"\n\n")[:-1]
    for cut in range(1, len(blocks)):
        head, rest = b"".join(b + b"\n\n" for b in blocks[:cut]), b"".join(b + b"\n\n" for b in blocks[cut:])
        first, second = check_stream(surface, head, complete=False), check_stream(surface, rest, resumed=True)
        assert first.text + second.text == whole.text
        joined = [*first.tool_calls]
        for i, call in enumerate(second.tool_calls):
            if not call.call_id:  # more of a call the head began: OpenAI's by index, Anthropic's the last
                j = i if surface == "openai" else len(joined) - 1
                joined[j] = attrs.evolve(joined[j], arguments=joined[j].arguments + call.arguments)
            else:
                joined.append(call)
        assert [c.value() for c in joined] == [c.value() for c in whole.tool_calls], cut


def _sse_client(module: Any, raw: bytes) -> Any:
    return mock_client(module, 200, content=raw, headers={"content-type": "text/event-stream"})[0]


def test_anthropic_sdk_stream_helper_accumulates_tool_use():
    """``messages.stream(...)``'s own accumulator (partial JSON of the input_json_delta events)."""
    import anthropic
    import httpx2

    client = anthropic.Anthropic(api_key="k", base_url="http://test", max_retries=0,
                                 http_client=_sse_client(httpx2, wire_bytes("anthropic", TEXT_THEN_TWO_CALLS)))
    with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                tools=[A_WEATHER, A_TIME], tool_choice={"type": "any"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds  # the SDK's own per-fragment event
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert final.content[1].input == {"city": "Paris", "unit": "c"} and final.content[2].input == {}
    assert final.content[1].id == "toolu_" + CALL_A and final.stop_reason == "tool_use"


def test_openai_sdk_stream_helper_parses_tool_calls():
    """``chat.completions.stream(...)`` with strict tools: the SDK parses each call's arguments."""
    import openai

    tools = [O_WEATHER, {"type": "function", "function": {**O_TIME["function"], "strict": True,
                                                          "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}}]
    client = openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=0,
                           http_client=_sse_client(httpx, wire_bytes("openai", TEXT_THEN_TWO_CALLS)))
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "hi"}],
                                        tools=tools) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert kinds.count("tool_calls.function.arguments.done") == 2
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    parsed = [(c.function.name, c.function.parsed_arguments) for c in choice.message.tool_calls]
    assert parsed == [WEATHER, ("get_time", {})]
    assert choice.message.tool_calls[0].id == "call_" + CALL_A


# -- end to end on the fake engine, through the SDKs (needs the tool-use engine, issue 14) -----------

needs_engine = pytest.mark.skipif(
    importlib.util.find_spec("ringserve.core.toolcalls") is None,
    reason="needs the tool-use engine (grammars, the tool-call parser): issue 14's engine branch",
)


@pytest.fixture
async def unbatched_server(tmp_path):
    """A fake-engine server that flushes every delta (so arguments arrive in several fragments)."""
    async with running_server(fake_config(tmp_path, stream={"flush_ms": 0.0})) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            yield state, client


def _valid(schema: dict[str, Any], value: Any) -> bool:
    import jsonschema

    return jsonschema.Draft202012Validator(schema).is_valid(value)


@needs_engine
async def test_anthropic_sdk_forced_tool_call_then_tool_result(unbatched_server):
    """The issue's Anthropic test on the fake engine: a forced tool, streamed through the SDK."""
    import anthropic

    state, client = unbatched_server
    request = {"model": "any", "max_tokens": 256, "messages": [{"role": "user", "content": "weather in Paris?"}],
               "tools": [A_WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}

    def run() -> tuple[Any, Any]:
        sdk = anthropic.Anthropic(base_url=state.urls[0], api_key="unused", max_retries=0)
        with sdk.messages.stream(**request) as stream:
            final = stream.get_final_message()
        call = final.content[-1]
        second = sdk.messages.create(**{**request, "tool_choice": {"type": "auto"}, "messages": [
            *request["messages"],
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}]},
        ]})
        return final, second

    final, second = await trio.to_thread.run_sync(run)
    call = final.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and final.stop_reason == "tool_use"
    assert _valid(WEATHER_SCHEMA, call.input)
    assert second.stop_reason == "end_turn" and second.content[0].type == "text" and second.content[0].text
    # the raw stream: every event valid, several fragments that join to that input
    resp, raw = await stream_bytes(client, "POST", "/v1/messages", json={**request, "stream": True})
    seen = check_stream("anthropic", raw)
    assert seen.json_deltas >= 2 and seen.stop_reason == "tool_use"
    assert [json.loads(c.arguments) for c in seen.tool_calls] == [call.input]  # the fake is deterministic
    answered = check_answer("anthropic", await client.post("/v1/messages", json=request))
    assert [c.value()[1:] for c in answered.tool_calls] == [c.value()[1:] for c in seen.tool_calls]


@needs_engine
async def test_openai_sdk_required_tools_and_parse(unbatched_server):
    import openai

    class Weather(pydantic.BaseModel):
        city: str
        unit: str

    state, client = unbatched_server
    tools = [O_WEATHER, {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
        "additionalProperties": False}}}]
    request = {"model": "any", "messages": [{"role": "user", "content": "weather and time in Paris?"}],
               "tools": tools, "tool_choice": "required", "parallel_tool_calls": True, "max_tokens": 256}

    def run() -> tuple[Any, Any]:
        sdk = openai.OpenAI(base_url=state.urls[0] + "/v1", api_key="unused", max_retries=0)
        with sdk.chat.completions.stream(**request) as stream:
            final = stream.get_final_completion()
        parsed = sdk.chat.completions.parse(model="any", messages=[{"role": "user", "content": "Paris?"}],
                                            response_format=Weather, max_tokens=256)
        return final, parsed

    final, parsed = await trio.to_thread.run_sync(run)
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and _valid(schemas[call.function.name], call.function.parsed_arguments)
    assert isinstance(parsed.choices[0].message.parsed, Weather)
    resp, raw = await stream_bytes(client, "POST", "/v1/chat/completions", json={**request, "stream": True})
    seen = check_stream("openai", raw)
    answered = check_answer("openai", await client.post("/v1/chat/completions", json=request))
    assert seen.stop_reason == answered.stop_reason == "tool_calls"
    assert [c.value()[1:] for c in seen.tool_calls] == [c.value()[1:] for c in answered.tool_calls]


@needs_engine
async def test_anthropic_sdk_messages_parse(unbatched_server):
    import anthropic

    state, _client = unbatched_server

    def run() -> Any:
        sdk = anthropic.Anthropic(base_url=state.urls[0], api_key="unused", max_retries=0)
        return sdk.messages.parse(model="any", max_tokens=256, output_format=Colours,
                                  messages=[{"role": "user", "content": "three colours"}])

    message = await trio.to_thread.run_sync(run)
    assert isinstance(message.parsed_output, Colours)


def forced_weather(surface: str) -> tuple[str, dict[str, Any]]:
    """(path, body) of a request that must call get_weather, on ``surface``."""
    if surface == "anthropic":
        path, choice, tools = "/v1/messages", {"type": "tool", "name": "get_weather"}, [A_WEATHER]
    else:
        path, choice, tools = "/v1/chat/completions", {"type": "function", "function": {"name": "get_weather"}}, [O_WEATHER]
    return path, {"model": "any", "max_tokens": 256, "tools": tools, "tool_choice": choice,
                  "messages": [{"role": "user", "content": "weather?"}]}


@needs_engine
@pytest.mark.parametrize("surface", ["anthropic", "openai"])
async def test_resume_inside_a_tool_call_is_byte_identical(unbatched_server, surface):
    """Cut the stream after each event of the call; a resume gives exactly the bytes that followed."""
    _state, client = unbatched_server
    path, request = forced_weather(surface)
    resp, raw = await stream_bytes(client, "POST", path, json={**request, "stream": True})
    message_id = resp.headers["X-Message-Id"]
    events = SSEParser().feed(raw)
    whole = check_stream(surface, raw)
    assert whole.tool_calls and whole.json_deltas >= 2
    for event in events[1:-2]:
        resumed, rest = await stream_bytes(client, "GET", f"/v1/messages/{message_id}/stream",
                                           headers={"Last-Event-ID": event.id})
        assert resumed.status_code == 200
        assert raw.endswith(rest) and raw[: len(raw) - len(rest)].endswith(b"\n\n")
        check_stream(surface, rest, resumed=True)
    stored = (await client.get(f"/v1/messages/{message_id}")).json()
    assert json.dumps(whole.tool_calls[0].call_id) in json.dumps(stored)  # GET shows the tool call


@needs_engine
@pytest.mark.parametrize("surface", ["anthropic", "openai"])
async def test_an_idempotent_retry_returns_the_tool_calls(unbatched_server, surface):
    _state, client = unbatched_server
    path, request = forced_weather(surface)
    headers = {"Idempotency-Key": f"tools-{surface}"}
    first = await client.post(path, json=request, headers=headers)
    again = await client.post(path, json=request, headers=headers)
    assert first.status_code == again.status_code == 200
    assert first.json() == again.json()
    assert check_answer(surface, again).tool_calls


# -- the SDK tests on the real bundled model (needs the tool-use engine) ------------------------


@pytest.fixture(scope="module")
def model_server(tmp_path_factory):
    """A real-model server: one slot of 2048 tokens (tool definitions take a few hundred)."""
    from bench.common import ServerProcess
    from tests.support.server import SERVE

    cfg = tmp_path_factory.mktemp("tools_model") / "config.toml"
    cfg.write_text(f'[engine]\nslots = 1\nctx_per_slot = 2048\n[store]\npath = "{cfg.parent / "s.sqlite3"}"\n')
    server = ServerProcess([*SERVE, "--config", str(cfg)])
    yield server
    server.stop()


@needs_engine
@pytest.mark.model
def test_real_anthropic_sdk_forced_tool_stream_then_tool_result(model_server):
    import anthropic

    sdk = anthropic.Anthropic(base_url=model_server.url, api_key="unused", max_retries=0)
    request = {"model": "m", "max_tokens": 128, "extra_body": {"temperature": 0}, "tools": [A_WEATHER],
               "tool_choice": {"type": "tool", "name": "get_weather"},
               "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    with sdk.messages.stream(**request) as stream:
        fragments = [e.delta.partial_json for e in stream
                     if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    call = final.content[-1]
    assert final.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather"
    assert _valid(WEATHER_SCHEMA, call.input)
    assert len(fragments) >= 2 and json.loads("".join(fragments)) == call.input
    second = sdk.messages.create(**{**request, "tool_choice": {"type": "auto"}, "messages": [
        *request["messages"],
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C, sunny"}]},
    ]})
    assert second.content and second.content[0].type == "text" and second.content[0].text.strip()


@needs_engine
@pytest.mark.model
def test_real_openai_sdk_required_parallel_tools(model_server):
    import openai

    sdk = openai.OpenAI(base_url=model_server.url + "/v1", api_key="unused", max_retries=0)
    tools = [O_WEATHER, {"type": "function", "function": {"name": "get_time", "description": "The local time.",
                                                          "parameters": {"type": "object", "properties": {
                                                              "city": {"type": "string"}}, "required": ["city"]}}}]
    with sdk.chat.completions.stream(model="m", temperature=0, max_tokens=200, tools=tools, tool_choice="required",
                                     parallel_tool_calls=True,
                                     messages=[{"role": "user", "content": "Weather and time in Oslo?"}]) as stream:
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in choice.message.tool_calls:
        assert _valid(schemas[call.function.name], json.loads(call.function.arguments))
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


@needs_engine
@pytest.mark.model
@pytest.mark.timeout(900)  # 20 grammar-constrained replies on the CPU
def test_real_openai_sdk_parse_every_run_at_temperature_0_7(model_server):
    import openai

    class City(pydantic.BaseModel):  # bounded strings (maxLength is enforced), so 128 tokens always suffice
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)

    sdk = openai.OpenAI(base_url=model_server.url + "/v1", api_key="unused", max_retries=0)

    def parse(_run: int) -> Any:
        return sdk.chat.completions.parse(model="m", temperature=0.7, max_tokens=128, response_format=City,
                                          messages=[{"role": "user", "content": "Name a city and its country."}])

    with ThreadPoolExecutor(4) as pool:  # the shared server's 4 slots decode them in batches
        answers = list(pool.map(parse, range(20)))
    for run, answer in enumerate(answers):
        assert isinstance(answer.choices[0].message.parsed, City), (run, answer.choices[0].message.content)


@needs_engine
@pytest.mark.model
@pytest.mark.parametrize("tools", [[], [A_WEATHER, A_TIME]])
def test_real_count_tokens_equals_the_calls_usage(model_server, tools):
    import anthropic

    sdk = anthropic.Anthropic(base_url=model_server.url, api_key="unused", max_retries=0)
    request = {"model": "m", "system": "Answer briefly.", "messages": [{"role": "user", "content": "Hello there"}],
               **({"tools": tools} if tools else {})}
    counted = sdk.messages.count_tokens(**request).input_tokens
    usage = sdk.messages.create(max_tokens=4, **request).usage
    assert counted == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def _strings(n: int, max_length: int) -> dict[str, Any]:
    props = {f"p{i}": {"type": "string", "maxLength": max_length} for i in range(n)}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


def test_bounds_that_add_up_past_the_grammar_limit_are_a_400_not_a_stalled_decode():
    # 128 strict tools of 20 strings of maxLength 1000: a 20.7 MB grammar that took llama.cpp 7 s and
    # 1.18 GB to parse on the decode thread, while every stream waited.
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": _strings(20, 1000), "strict": True}}
            for i in range(128)]
    error = refused(openai_request, {"tools": many})
    assert error.param == "tools" and "add up to 2560000 repetitions" in error.message
    huge = {"type": "object", "properties": {"a": {"type": "string", "minLength": 10**7}}}
    error = refused(anthropic_request, {"output_config": {"format": {"type": "json_schema", "schema": huge}}})
    assert error.param == "output_config" and f"over the limit of {MAX_REPEATS}" in error.message
    # at the limit it is fine, and bounds the model only reads (not strict, under auto) do not count
    at_limit = [{"type": "function", "function": {"name": f"f{i}", "parameters": _strings(10, 1000), "strict": True}}
                for i in range(2)]
    assert len(openai_request(tools=at_limit).tools) == 2
    loose = [{**t, "function": {**t["function"], "strict": False}} for t in many]
    assert len(openai_request(tools=loose).tools) == 128
