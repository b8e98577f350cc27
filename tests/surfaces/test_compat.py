"""Request fields the surfaces support, accept and ignore, or refuse (issue 12), and
``max_tokens`` beyond the context (issue 22), on the fake engine."""

from __future__ import annotations

import json

import httpx
import pytest
from anthropic.types import MessageCreateParams as AnthropicParams
from anthropic.types.beta import MessageCreateParams as AnthropicBetaParams
from openai.types.chat import CompletionCreateParams as OpenAIParams
from openai.types.chat import ChatCompletionMessageParam

from ringserve.surfaces import anthropic as anthropic_surface
from ringserve.surfaces import openai as openai_surface
from ringserve.surfaces.base import MAX_IGNORED_FIELDS_CHARS, ignored_fields_header
from tests.support.server import fake_config, running_server
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY, anthropic_text, openai_text, sse_events


def _keys(union) -> set[str]:
    """Every key of every TypedDict in a ``Union`` of them (the SDKs' request params)."""
    keys: set[str] = set()
    for td in union.__args__:
        keys |= td.__required_keys__ | td.__optional_keys__
    return keys


@pytest.mark.parametrize(
    ("table", "params"),
    [
        (anthropic_surface.REQUEST_FIELDS, AnthropicParams),
        (anthropic_surface.REQUEST_FIELDS, AnthropicBetaParams),
        (openai_surface.REQUEST_FIELDS, OpenAIParams),
    ],
)
def test_every_sdk_request_field_is_decided(table, params):
    """A field the SDK can send is supported, ignored or refused: none is dropped unseen.

    (``betas`` is the ``anthropic-beta`` header, not a body field.)
    """
    decided = table.supported | table.ignored | set(table.refused)
    assert not table.supported & table.ignored
    assert not (table.supported | table.ignored) & set(table.refused)
    assert _keys(params) - {"betas"} <= decided


def _decided(table) -> set[str]:
    return table.supported | table.ignored | set(table.refused)


def test_every_sdk_message_field_is_decided():
    for td in ChatCompletionMessageParam.__args__:
        if td.__name__ == "ChatCompletionFunctionMessageParam":
            continue  # refused by role
        table = (openai_surface.TOOL_MESSAGE_FIELDS if td.__name__ == "ChatCompletionToolMessageParam"
                 else openai_surface.MESSAGE_FIELDS)
        assert td.__required_keys__ | td.__optional_keys__ <= _decided(table), td.__name__


def test_every_sdk_tool_field_is_decided():
    """The tool, tool-choice, tool-block and output-format tables cover their SDK TypedDicts."""
    from anthropic import types as a
    from anthropic.types import beta as b
    from openai.types import chat as o
    from openai.types import shared_params as sp
    from openai.types.chat.chat_completion_message_function_tool_call_param import Function
    from openai.types.shared_params.response_format_json_schema import JSONSchema

    A, O = anthropic_surface, openai_surface
    pairs = [
        (A.TOOL_FIELDS, a.ToolParam), (A.TOOL_FIELDS, b.BetaToolParam),
        (A.TOOL_USE_FIELDS, a.ToolUseBlockParam), (A.TOOL_USE_FIELDS, b.BetaToolUseBlockParam),
        (A.TOOL_RESULT_FIELDS, a.ToolResultBlockParam), (A.TOOL_RESULT_FIELDS, b.BetaToolResultBlockParam),
        (A.OUTPUT_CONFIG_FIELDS, a.OutputConfigParam), (A.OUTPUT_CONFIG_FIELDS, b.BetaOutputConfigParam),
        (A.OUTPUT_FORMAT_FIELDS, a.JSONOutputFormatParam), (A.COUNT_TOKENS_FIELDS, a.MessageCountTokensParams),
        (O.TOOL_FIELDS, o.ChatCompletionFunctionToolParam), (O.FUNCTION_FIELDS, sp.FunctionDefinition),
        (O.TOOL_CALL_FIELDS, o.ChatCompletionMessageFunctionToolCallParam), (O.CALL_FUNCTION_FIELDS, Function),
        (O.TOOL_FIELDS, o.ChatCompletionNamedToolChoiceParam),
        (O.RESPONSE_FORMAT_FIELDS, sp.ResponseFormatJSONSchema), (O.JSON_SCHEMA_FIELDS, JSONSchema),
    ]
    pairs += [
        (A.THINKING_BLOCK_FIELDS, a.ThinkingBlockParam), (A.THINKING_BLOCK_FIELDS, b.BetaThinkingBlockParam),
        (A.REDACTED_THINKING_FIELDS, a.RedactedThinkingBlockParam),
        (A.REDACTED_THINKING_FIELDS, b.BetaRedactedThinkingBlockParam),
        (A.TOOL_REFERENCE_FIELDS, b.BetaToolReferenceBlockParam),
        (A.CONTEXT_MANAGEMENT_FIELDS, b.BetaContextManagementConfigParam),
        (A.CLEAR_THINKING_FIELDS, b.BetaClearThinking20251015EditParam),
        (A.CLEAR_TOOL_USES_FIELDS, b.BetaClearToolUses20250919EditParam),
        (A.THRESHOLD_FIELDS, b.BetaInputTokensTriggerParam), (A.THRESHOLD_FIELDS, b.BetaToolUsesTriggerParam),
        (A.THRESHOLD_FIELDS, b.BetaToolUsesKeepParam), (A.THRESHOLD_FIELDS, b.BetaThinkingTurnsParam),
        (A.THRESHOLD_FIELDS, b.BetaInputTokensClearAtLeastParam),
    ]
    pairs += [(A.THINKING_FIELDS, td) for td in a.ThinkingConfigParam.__args__]
    pairs += [(A.THINKING_FIELDS, td) for td in b.BetaThinkingConfigParam.__args__]
    pairs += [(A.TOOL_CHOICE_FIELDS, td) for td in a.ToolChoiceParam.__args__]
    pairs += [(A.TOOL_CHOICE_FIELDS, td) for td in b.BetaToolChoiceParam.__args__]
    for table, td in pairs:
        assert td.__required_keys__ | td.__optional_keys__ <= _decided(table), td.__name__


# -- refused fields: a 400 naming the field, in the surface's shape --------------------------

ANTHROPIC_REFUSED = [
    ("tools", [{"type": "web_search_20250305", "name": "web_search"}]),  # a server tool
    ("tools", [{"name": "f", "input_schema": {"type": "object"}, "allowed_callers": ["code_execution_20250825"]}]),
    ("mcp_servers", [{"type": "url", "url": "https://example.com", "name": "x"}]),
    ("compaction", {}),
    ("thread", {"type": "create"}),
    ("context_management", {"edits": [{"type": "compact_20260112"}]}),  # compaction, as an edit
    ("thinking", {"type": "enabled"}),  # without its budget_tokens
    ("output_config", {"effort": "extreme"}),
]

ANTHROPIC_BLOCKS = [
    ("user", {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}),
    ("user", {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "a doc"}}),
]


def assert_anthropic_400(resp: httpx.Response, name: str) -> None:
    assert resp.status_code == 400, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert name in err["error"]["message"]


def assert_openai_400(resp: httpx.Response, name: str, param: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert name in err["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("field", "value"), ANTHROPIC_REFUSED)
async def test_anthropic_refused_field_is_400_naming_it(fake_server, field, value, stream):
    _state, client = fake_server
    resp = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "stream": stream, field: value})
    assert_anthropic_400(resp, field)
    assert b"event:" not in resp.content


@pytest.mark.parametrize(("role", "block"), ANTHROPIC_BLOCKS)
async def test_anthropic_non_text_block_is_400_naming_its_type(fake_server, role, block):
    _state, client = fake_server
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": [{"type": "text", "text": "x"}, block]}]
    if role == "assistant":
        messages.append({"role": "user", "content": "go on"})
    resp = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "messages": messages})
    assert_anthropic_400(resp, "messages[1].content[1]")
    assert repr(block["type"]) in resp.json()["error"]["message"]
    resp = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "system": [block]})
    assert_anthropic_400(resp, "system[0]")


OPENAI_REFUSED = [
    ("tools", [{"type": "custom", "custom": {"name": "f"}}]),
    ("tool_choice", {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}),
    ("functions", [{"name": "f"}]),
    ("function_call", {"name": "f"}),
    ("top_logprobs", 3),  # without logprobs: true
    ("n", 2),
    ("n", True),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("reasoning_effort", "extreme"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("field", "value"), OPENAI_REFUSED)
async def test_openai_refused_field_is_400_naming_it(fake_server, field, value, stream):
    _state, client = fake_server
    resp = await client.post("/v1/chat/completions", json={**OPENAI_BODY, "stream": stream, field: value})
    assert_openai_400(resp, field, field)
    assert b"data:" not in resp.content


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}]},
        {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "custom", "custom": {"name": "f", "input": "x"}}]},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},  # no earlier call c1
        {"role": "function", "name": "f", "content": "42"},
    ],
)
async def test_openai_unsupported_message_parts_are_400(fake_server, message):
    _state, client = fake_server
    messages = [{"role": "user", "content": "hi"}, message]
    resp = await client.post("/v1/chat/completions", json={**OPENAI_BODY, "messages": messages})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith("messages")
    assert "messages[1]" in err["message"]


HI = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # Claude Code --bare's per-turn control message (issue 43, item 0); an empty last assistant turn
        ("/v1/messages", {**ANTHROPIC_BODY, "messages": [HI, {"role": "system", "content": [],
                                                              "output_config": {"effort": "low"}}]}),
        ("/v1/messages", {**ANTHROPIC_BODY, "messages": [HI, {"role": "assistant", "content": []}]}),
        ("/v1/chat/completions", {**OPENAI_BODY, "messages": [{"role": "developer", "content": []}, HI,
                                                              {"role": "assistant", "content": []}, HI]}),
        ("/v1/responses", {"model": "any", "input": [{"role": "developer", "content": []}, HI,
                                                     {"type": "message", "role": "assistant", "content": []}, HI]}),
    ],
)
async def test_an_empty_content_a_client_may_send_is_answered_on_every_surface(fake_server, path, body):
    _state, client = fake_server
    resp = await client.post(path, json=body)
    assert resp.status_code == 200, resp.text


# -- neutral values and harmless fields are accepted -------------------------------------------

ECHO = [{"role": "user", "content": "echo:same answer"}]


async def test_anthropic_harmless_fields_and_neutral_values_are_accepted(fake_server):
    _state, client = fake_server
    base = {**ANTHROPIC_BODY, "messages": ECHO}
    plain = (await client.post("/v1/messages", json=base)).json()
    extra = {
        "metadata": {"user_id": "u-1"}, "service_tier": "auto", "inference_geo": "eu", "speed": "standard",
        "user_profile_id": "p", "workspace_id": "w", "cache_control": {"type": "ephemeral"},
        "diagnostics": {"previous_message_id": "msg_1"}, "container": "c", "billing_policy": None,
        "fallbacks": None, "fallback_credit_token": None,
        "tools": [], "tool_choice": {"type": "none"}, "thinking": {"type": "disabled"}, "output_config": {},
        "mcp_servers": [], "context_management": None,
    }
    headers = {"anthropic-beta": "some-future-feature-2031-01-01,another", "anthropic-version": "2023-06-01"}
    resp = await client.post("/v1/messages", json={**base, **extra}, headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.json()["content"] == plain["content"] == [{"type": "text", "text": "same answer"}]
    system = [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "system", "content": "a system turn"}, *ECHO]
    resp = await client.post("/v1/messages", json={**base, "system": system, "messages": messages})
    assert resp.status_code == 200, resp.text


async def test_openai_harmless_fields_and_neutral_values_are_accepted(fake_server):
    _state, client = fake_server
    base = {**OPENAI_BODY, "messages": ECHO}
    plain = (await client.post("/v1/chat/completions", json=base)).json()
    extra = {
        "metadata": {"k": "v"}, "user": "u-1", "store": False, "service_tier": "auto", "safety_identifier": "s",
        "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
        "prediction": {"type": "content", "content": "x"}, "parallel_tool_calls": True,
        "tools": [], "tool_choice": "none", "functions": [], "response_format": {"type": "text"},
        "logprobs": False, "top_logprobs": 0, "n": 1, "frequency_penalty": 0, "presence_penalty": 0.0,
        "logit_bias": {}, "modalities": ["text"], "reasoning_effort": None, "audio": None,
    }
    resp = await client.post("/v1/chat/completions", json={**base, **extra})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    messages = [{"role": "developer", "content": "d", "name": "dev"},
                {"role": "assistant", "content": "earlier", "refusal": None, "tool_calls": []}, *ECHO]
    resp = await client.post("/v1/chat/completions", json={**base, "messages": messages})
    assert resp.status_code == 200, resp.text


# -- accepted and reported: the Ringserve-Ignored-Fields header (issue 33) --------------------

ANTHROPIC_IGNORED = {
    "metadata": {"user_id": "u-1"},
    "cache_control": {"type": "ephemeral"},
    "thinking": {"type": "adaptive", "block_binding": {}},  # a beta check of Anthropic's own signatures
    "logprobs": True,  # not an Anthropic field at all
}
ANTHROPIC_IGNORED_MESSAGES = [
    {"role": "user", "content": [{"type": "text", "text": "echo:same answer", "cache_control": {"type": "ephemeral"},
                                  "foo": 1}]},
]
ANTHROPIC_IGNORED_PATHS = ("metadata, cache_control, logprobs, messages[0].content[0].cache_control,"
                           " messages[0].content[0].foo, thinking.block_binding")


@pytest.mark.parametrize("shape", ["json", "stream", "202"])
async def test_anthropic_ignored_fields_are_named_in_a_header_on_every_answer(fake_server, shape):
    _state, client = fake_server
    body = {**ANTHROPIC_BODY, **ANTHROPIC_IGNORED, "messages": ANTHROPIC_IGNORED_MESSAGES, "stream": shape == "stream"}
    headers = {"Prefer": "respond-async"} if shape == "202" else {}
    if shape == "stream":
        resp, events, _raw = await sse_events(client, "POST", "/v1/messages", json=body)
        assert anthropic_text(events) == "same answer"
    else:
        resp = await client.post("/v1/messages", json=body, headers=headers)
        assert resp.status_code == (202 if shape == "202" else 200), resp.text
    assert resp.headers["ringserve-ignored-fields"] == ANTHROPIC_IGNORED_PATHS
    plain = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "messages": ECHO})
    assert "ringserve-ignored-fields" not in plain.headers


async def test_openai_ignored_fields_are_named_in_a_header(fake_server):
    """The Node SDK's ``parsed`` and ``parsed_arguments`` (its stream helpers add them) and fields
    that cannot change the answer: accepted, the same answer, named."""
    _state, client = fake_server
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "parsed_arguments": {}}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call], "parsed": None},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
                {"role": "assistant", "content": "ok", "parsed": {"a": 1}, "cache_control": {"type": "ephemeral"}},
                *ECHO]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    extra = {"verbosity": "low", "web_search_options": {}, "user": "u", "grammar": "root ::= x"}
    resp = await client.post("/v1/chat/completions", json={**OPENAI_BODY, **extra, "messages": messages, "tools": tools})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "same answer"
    assert resp.headers["ringserve-ignored-fields"] == (
        "verbosity, web_search_options, user, grammar, messages[1].tool_calls[0].function.parsed_arguments,"
        " messages[3].parsed, messages[3].cache_control")


async def test_count_tokens_names_its_ignored_fields(fake_server):
    _state, client = fake_server
    body = {"model": "m", "messages": ECHO, "max_tokens": 10, "stream": True, "metadata": {"user_id": "u"}}
    resp = await client.post("/v1/messages/count_tokens", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["ringserve-ignored-fields"] == "max_tokens, stream, metadata"


def test_the_ignored_fields_header_is_bounded_and_printable():
    paths = tuple(f"messages[{i}].content[0].cache_control" for i in range(200))
    value = ignored_fields_header(paths)
    assert len(value) <= MAX_IGNORED_FIELDS_CHARS
    kept = value.split(", ")
    assert kept[:-1] == list(paths[: len(kept) - 1]) and kept[-1] == f"+{200 - len(kept) + 1} more"
    assert ignored_fields_header(("a\r\nb", "é")) == "a\\r\\nb, \\xe9"
    assert ignored_fields_header(("x" * 5000, "y")) == "+2 more"


# -- the fields of content blocks, stream_options, and the shapes both APIs refuse -------------


def test_every_sdk_block_and_stream_options_field_is_decided():
    """The block/part and ``stream_options`` tables cover their SDK TypedDicts, like the request tables."""
    from anthropic.types import TextBlockParam
    from openai.types.chat import ChatCompletionContentPartTextParam, ChatCompletionStreamOptionsParam

    for table, td in [
        (anthropic_surface.TEXT_BLOCK_FIELDS, TextBlockParam),
        (openai_surface.TEXT_PART_FIELDS, ChatCompletionContentPartTextParam),
        (openai_surface.STREAM_OPTIONS_FIELDS, ChatCompletionStreamOptionsParam),
    ]:
        decided = table.supported | table.ignored | set(table.refused)
        assert td.__required_keys__ | td.__optional_keys__ <= decided, td.__name__


@pytest.mark.parametrize(
    ("change", "name"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "citations": [{"type": "x"}]}]}]},
         "messages[0].content[0].citations"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"stop_sequences": ["ok", ""]}, "stop_sequences"),
        ({"stop_sequences": "e"}, "stop_sequences"),
    ],
)
async def test_anthropic_bad_blocks_and_stops_are_400(fake_server, change, name):
    _state, client = fake_server
    resp = await client.post("/v1/messages", json={**ANTHROPIC_BODY, **change})
    assert_anthropic_400(resp, name)


async def test_anthropic_neutral_citations_are_accepted(fake_server):
    _state, client = fake_server
    for citations in (None, []):
        block = {"type": "text", "text": "echo:same answer", "citations": citations, "cache_control": None}
        resp = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "messages": [{"role": "user", "content": [block]}]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["content"] == [{"type": "text", "text": "same answer"}]


@pytest.mark.parametrize(
    ("change", "name", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "only allowed when stream is true", "stream_options"),
        ({"stream": False, "stream_options": {}}, "only allowed when stream is true", "stream_options"),
        ({"stop": ""}, "stop", "stop"),
        ({"stop": [""]}, "stop", "stop"),
        ({"max_tokens": 3, "max_completion_tokens": 5}, "max_completion_tokens", "max_tokens"),
    ],
)
async def test_openai_bad_parts_and_options_are_400(fake_server, change, name, param):
    _state, client = fake_server
    resp = await client.post("/v1/chat/completions", json={**OPENAI_BODY, **change})
    assert_openai_400(resp, name, param)


async def test_openai_include_obfuscation_and_equal_max_tokens_are_accepted(fake_server):
    _state, client = fake_server
    body = {**OPENAI_BODY, "messages": ECHO, "stream": True, "max_tokens": 5, "max_completion_tokens": 5,
            "stream_options": {"include_obfuscation": True, "include_usage": True}, "stop": "zzz"}
    resp, events, _raw = await sse_events(client, "POST", "/v1/chat/completions", json=body)
    assert resp.status_code == 200
    assert openai_text(events) == "same answer"
    assert json.loads(events[-2].data)["usage"]["completion_tokens"] > 0


# -- max_tokens beyond the context (issue 22) --------------------------------------------------

CTX = 64


@pytest.fixture
async def small_context_server(tmp_path):
    """A fake-engine server with 64-token slots and a reply longer than any of them."""
    config = fake_config(tmp_path, engine={"ctx_per_slot": CTX, "slots": 2})
    async with running_server(config, piece_bytes=1, reply="z" * 500) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            yield state, client


def _n_prompt(text: str = "hello") -> int:
    return len(f"<|user|>{text}\n")  # the fake engine: one token per byte


async def test_anthropic_max_tokens_over_the_context_ends_model_context_window_exceeded(small_context_server):
    _state, client = small_context_server
    room = CTX - _n_prompt()
    body = {**ANTHROPIC_BODY, "max_tokens": 16384}
    full = (await client.post("/v1/messages", json=body)).json()
    assert full["stop_reason"] == "model_context_window_exceeded"
    assert full["content"][0]["text"] == "z" * room
    assert full["usage"] == {"input_tokens": _n_prompt(), "cache_read_input_tokens": 0, "output_tokens": room,
                             "output_tokens_details": {"thinking_tokens": 0}}
    resp, events, _ = await sse_events(client, "POST", "/v1/messages", json={**body, "stream": True})
    assert resp.status_code == 200
    assert anthropic_text(events) == "z" * room
    delta = json.loads(next(e.data for e in events if e.event == "message_delta"))
    assert delta["delta"]["stop_reason"] == "model_context_window_exceeded"
    assert delta["usage"]["output_tokens"] == room
    # the stored message says the same
    stored = (await client.get(f"/v1/messages/{full['id']}")).json()
    assert stored["stop_reason"] == "model_context_window_exceeded"
    # a max_tokens the context holds still ends with max_tokens
    exact = (await client.post("/v1/messages", json={**ANTHROPIC_BODY, "max_tokens": room})).json()
    assert (exact["stop_reason"], exact["usage"]["output_tokens"]) == ("max_tokens", room)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", None])
async def test_openai_max_tokens_over_the_context_ends_with_length(small_context_server, field):
    _state, client = small_context_server
    room = CTX - _n_prompt()
    body = {k: v for k, v in OPENAI_BODY.items() if k != "max_tokens"}
    if field is not None:
        body[field] = 32000
    full = (await client.post("/v1/chat/completions", json=body)).json()
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["choices"][0]["message"]["content"] == "z" * room
    assert full["usage"] == {"prompt_tokens": _n_prompt(), "completion_tokens": room, "total_tokens": CTX,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 0}}
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    _, events, _ = await sse_events(client, "POST", "/v1/chat/completions", json=stream)
    assert openai_text(events) == "z" * room
    chunks = [json.loads(e.data) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == room


async def test_the_400s_that_stay(small_context_server):
    """A prompt that does not fit by itself, and max_tokens outside 1..1,000,000."""
    _state, client = small_context_server
    fills = [{"role": "user", "content": "x" * (CTX - _n_prompt(""))}]
    resp = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "messages": fills})
    assert_anthropic_400(resp, f"{CTX} tokens")
    resp = await client.post("/v1/chat/completions", json={**OPENAI_BODY, "messages": fills})
    assert_openai_400(resp, f"{CTX} tokens", "messages")
    for value in (0, 1_000_001):
        resp = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "max_tokens": value})
        assert_anthropic_400(resp, "max_tokens")
        resp = await client.post("/v1/chat/completions", json={**OPENAI_BODY, "max_completion_tokens": value})
        assert_openai_400(resp, "max_completion_tokens", "max_completion_tokens")
    # the limit itself is accepted
    resp = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "max_tokens": 1_000_000})
    assert resp.status_code == 200 and resp.json()["stop_reason"] == "model_context_window_exceeded"

