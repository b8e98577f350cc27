"""The Responses API on the bundled model behind a real server process, with the official SDK (issue 15).

Kept short: greedy decoding, few tokens, the session's shared ``model_server`` (no prefix cache).
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.http.test_responses import check_stream, read_to_seq_10

pytestmark = pytest.mark.model

GREEDY = {"model": "any", "temperature": 0}
STORY = "Write a long story about a lighthouse keeper."


@pytest.fixture(scope="module")
def client(model_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=model_server.url + "/v1", api_key="unused", max_retries=0)


def kv_cells_used(url: str) -> int:
    text = httpx.get(url + "/metrics").text
    return int(re.search(r"^ringserve_kv_cells_used (\d+)", text, re.M).group(1))


def test_stream_equals_plain_with_equal_usage(client):
    kwargs = dict(input="Name three colours.", max_output_tokens=24, **GREEDY)
    plain = client.responses.create(**kwargs)
    assert plain.output_text and plain.status in ("completed", "incomplete")
    with client.responses.stream(**kwargs) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response() if plain.status == "completed" else None
    assert streamed == plain.output_text
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[-1].response.usage == plain.usage and events[-1].response.status == plain.status
    assert plain.usage.input_tokens > 0 and plain.usage.output_tokens > 0
    if final is not None:
        assert final.output_text == plain.output_text


def test_background_stream_to_10_then_resume_and_the_helper(client, model_server):
    response_id, head = read_to_seq_10(client, input=STORY, max_output_tokens=64, **GREEDY)
    seqs, tail = [], ""
    for event in client.responses.retrieve(response_id, stream=True, starting_after=10):
        seqs.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            tail += event.delta
    assert seqs[0] == 11 and seqs == list(range(11, 11 + len(seqs)))
    final = client.responses.retrieve(response_id)
    assert final.status in ("completed", "incomplete") and head + tail == final.output_text
    with client.responses.stream(response_id=response_id, starting_after=10) as helper:
        first = next(iter(helper)).sequence_number
        helper.until_done()
    assert first == 11
    # raw bytes of the whole log, validated event by event
    raw = httpx.get(f"{model_server.url}/v1/responses/{response_id}", params={"stream": "true"}).content
    assert check_stream(raw).text == final.output_text


def test_cancel_while_generating_frees_the_kv_cells(client, model_server):
    """Few requests on purpose: every model test shares the session's one real-model server."""
    created = client.responses.create(input=STORY, max_output_tokens=2000, background=True, **GREEDY)
    with client.responses.stream(response_id=created.id) as reader:
        events = iter(reader)
        head = []
        for event in events:  # until the first text: the response is generating
            head.append(event)
            if event.type == "response.output_text.delta":
                break
        cancelled = client.responses.cancel(created.id)
        rest = list(events)  # the reader ends: the cancel is a terminal event for every reader
    assert cancelled.status == "cancelled" and cancelled.output_text
    assert rest[-1].type == "response.incomplete" and rest[-1].response.status == "cancelled"
    assert "".join(e.delta for e in head + rest if e.type == "response.output_text.delta") == cancelled.output_text
    deadline = time.monotonic() + 10
    while kv_cells_used(model_server.url) != 0:  # freed within a decode step of the cancel
        assert time.monotonic() < deadline, "the KV cells of a cancelled response were not freed"
        time.sleep(0.1)
    again = client.responses.cancel(created.id)
    assert again.status == "cancelled" and again.output_text == cancelled.output_text


def test_forced_function_call_streams_arguments_that_validate(client, model_server):
    """A named function on the bundled model: the streamed arguments join to the item's, and
    they validate against the tool's schema (issue 14's grammar, through the Responses surface)."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": schema, "strict": True}
    with client.responses.stream(input="What is the weather in Paris?", tools=[tool], max_output_tokens=96,
                                 tool_choice={"type": "function", "name": "get_weather"}, **GREEDY) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (call,) = final.output
    assert final.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert len(deltas) >= 2 and "".join(deltas) == call.arguments
    jsonschema.Draft202012Validator(schema).validate(json.loads(call.arguments))
    raw = httpx.get(f"{model_server.url}/v1/responses/{final.id}", params={"stream": "true"}).content
    assert check_stream(raw).calls[0]["arguments"] == call.arguments


@pytest.mark.parametrize("lark, says", [
    ('start: start "a" | "a"', "start: leads back to itself"),  # was a 500: llama.cpp could not parse the grammar
    ('start: a\na: b "x"\nb: a "y" | "z"', "a: leads back to itself"),
    ('start: a start "x" | "y"\na: "b"?', "start: leads back to itself"),  # hung the engine: llama.cpp misses it
    ('start: "a" start', "start: no finite text matches it"),
    ("start: " + "(" * 5000 + '"a"' + ")" * 5000, "line 1: groups nested deeper than 64"),  # was a 500: RecursionError
    ('start: "a" ~ 2001', "{2001}: repeated more than 2,000 times"),
])
def test_a_grammar_llama_cpp_cannot_take_is_a_400_before_the_engine_is_asked(model_server, lark, says):
    """Issue 43 on the real engine: a custom tool's grammar that llama.cpp's sampler refuses, cannot
    finish or loops on is a 400 naming the field, and the server answers the next request."""
    tool = {"type": "custom", "name": "f", "format": {"type": "grammar", "syntax": "lark", "definition": lark}}
    body = {"input": "Call f.", "tools": [tool], "tool_choice": {"type": "custom", "name": "f"},
            "max_output_tokens": 16, **GREEDY}
    reply = httpx.post(model_server.url + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tools" and error["message"].startswith(f"tools[0].format.definition: {says}")
    after = httpx.post(model_server.url + "/v1/responses", json={"input": "Hi.", "max_output_tokens": 4, **GREEDY},
                       timeout=60)
    assert after.status_code == 200 and after.json()["usage"]["output_tokens"] == 4
