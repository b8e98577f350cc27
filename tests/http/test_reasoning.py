"""Reasoning through the whole server (issue 34 item 3, "Through the whole server"), on the scripted
fake engine: a handful of model families play their canonical replies (thinking, text, a call:
bench/format_parsers.py's) on the three surfaces. Every event validates under the official SDKs'
strict types (tests/support/conformance.py; tests/http/test_responses.py for Responses), the
non-stream answer says what the stream added up to, a resume in the middle of the thinking or of the
call reads the same bytes as the first read, from the live log and rebuilt from the store once the
log is gone, and GET, an idempotent retry and the Python client carry the reasoning. Every family's
reply through every renderer is tests/surfaces/test_reasoning.py's, on plain values.

The render routes (issue 34 item 4) show what the prompt holds: the reasoning handed back in history
(a signed Anthropic thinking block, a Chat ``reasoning_content``) and the reasoning controls.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from bench.format_parsers import TOOLS
from bench.format_parsers import reply as bench_reply
from ringserve.client import AsyncClient as RingserveClient
from ringserve.core.signing import ReasoningSigner
from ringserve.core.sse import SSEParser
from ringserve.formats.families import FAMILIES
from tests.http.test_responses import check_object
from tests.http.test_responses import check_stream as check_responses
from tests.support.conformance import check_answer, check_stream, stream_bytes
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until

SURFACES = ("anthropic", "openai", "responses")
PATHS = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions", "responses": "/v1/responses"}
WORDS = "the weather in Paris depends on the season"  # bench_reply's 8 words

#: A template that keeps past reasoning (``reasoning_content``, as Hugging Face's templates read
#: it), opens the thinking block when thinking is on, and refuses a turn that says "refuse"; user
#: turns as the fake engine reads them.
TEMPLATE = (
    "{%- for m in messages -%}"
    "{% if m.content == 'refuse' %}{{ raise_exception('no refusals here') }}{% endif %}"
    "<|{{ m.role }}|>"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}\n"
    "{% endfor -%}<|assistant|>{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}"
)


def body(surface: str, text: str = "weather?", **fields: Any) -> dict[str, Any]:
    """A request of ``surface`` offering bench/format_parsers.py's tools."""
    schemas = [(t.name, json.loads(t.parameters)) for t in TOOLS]
    match surface:
        case "anthropic":
            tools = [{"name": name, "input_schema": schema} for name, schema in schemas]
            return {"model": "m", "max_tokens": 500, "messages": [{"role": "user", "content": text}],
                    "tools": tools, **fields}
        case "openai":
            tools = [{"type": "function", "function": {"name": name, "parameters": schema}}
                     for name, schema in schemas]
            return {"model": "m", "messages": [{"role": "user", "content": text}], "tools": tools, **fields}
        case _:
            tools = [{"type": "function", "name": name, "parameters": schema} for name, schema in schemas]
            return {"model": "m", "input": text, "tools": tools, **fields}


def said_by_stream(surface: str, raw: bytes, *, first: int = 0) -> tuple[str, str, list[tuple[str, Any]]]:
    """(text, reasoning, calls) of a stream, every event validated (``first``: the seq it starts
    at; a stream resumed inside a call has the rest of its arguments, as text)."""
    if surface == "responses":
        seen = check_responses(raw, first=first)
        calls = [(item["name"], item["arguments"]) for item in seen.calls]
        text, reasoning = seen.text, seen.reasoning
    else:
        checked = check_stream(surface, raw, resumed=first > 0)
        calls = [(c.name, c.arguments) for c in checked.tool_calls]
        text, reasoning = checked.text, checked.reasoning
    return text, reasoning, calls if first else [(name, json.loads(arguments)) for name, arguments in calls]


def said_by_answer(surface: str, resp: httpx.Response) -> tuple[str, str, list[tuple[str, Any]]]:
    """(text, reasoning, calls) of a non-stream answer, validated."""
    if surface == "responses":
        answer = check_object(resp)
        items = answer["output"]
        text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
        reasoning = "".join(p["text"] for i in items if i["type"] == "reasoning"
                            for p in i["summary"] or i.get("content") or ())
        calls = [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"]
        return text, reasoning, calls
    checked = check_answer(surface, resp)
    return checked.text, checked.reasoning, [(c.name, json.loads(c.arguments)) for c in checked.tool_calls]


@pytest.fixture
async def family_server(request, tmp_path) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """A server whose model is of the family ``request.param`` (hermes: its prompt opens the thinking
    block), replying bench/format_parsers.py's reply; every token its own delta (``flush_ms`` 0), so
    that a resume can start inside the thinking and inside the call."""
    family = request.param
    fmt = FAMILIES[family]
    reply = bench_reply(family, fmt, 8)
    opened = "<think>\n" if family == "hermes" else ""
    config = fake_config(tmp_path, stream={"flush_ms": 0})
    async with running_server(config, chat_format=family, reply=reply.removeprefix(opened.strip()),
                              generation_prompt=opened, piece_bytes=3) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            yield state, client


FAMILY_PARAMS = pytest.mark.parametrize("family_server", ["hermes", "gpt-oss", "qwen3-coder", "deepseek-r1"],
                                        indirect=True)


def _cuts(surface: str, raw: bytes) -> list[int]:
    """The seqs of a stream after which a resume starts inside the thinking (after its first delta)
    and inside the call (after its first argument fragment)."""
    events = SSEParser().feed(raw)
    thinking = {"anthropic": '"thinking_delta"', "openai": '"reasoning_content"',
                "responses": "reasoning_text.delta"}
    calling = {"anthropic": '"input_json_delta"', "openai": '"arguments":"{', "responses": "arguments.delta"}
    cuts = [next(i for i, e in enumerate(events) if marker[surface] in e.data)
            for marker in (thinking, calling)]
    return [cut for cut in cuts if cut + 1 < len(events)]


async def _resumed(client: httpx.AsyncClient, surface: str, message_id: str, after: int) -> bytes:
    if surface == "responses":
        _, raw = await stream_bytes(client, "GET", f"/v1/responses/{message_id}",
                                    params={"stream": "true", "starting_after": str(after)})
    else:
        _, raw = await stream_bytes(client, "GET", f"/v1/messages/{message_id}/stream",
                                    headers={"Last-Event-ID": f"{message_id}:{after}"})
    return raw


def _after(raw: bytes, seq: int) -> bytes:
    """The SSE blocks of ``raw`` after the one with ``seq`` (the first carries the retry hint)."""
    blocks = [b + b"\n\n" for b in raw.split(b"\n\n") if b and not b.startswith(b":")]
    return b"".join(blocks[seq + 1:])


@FAMILY_PARAMS
async def test_every_surface_streams_the_reasoning_and_resumes_inside_it_byte_for_byte(family_server):
    state, client = family_server
    for surface in SURFACES:
        resp, raw = await stream_bytes(client, "POST", PATHS[surface], json=body(surface, stream=True))
        assert resp.status_code == 200, raw
        text, reasoning, calls = said_by_stream(surface, raw)
        assert (reasoning.strip(), text.strip()) == (WORDS, WORDS), (surface, raw)
        assert calls == [("get_weather", {"city": "Paris", "days": 3})], (surface, raw)
        message_id = resp.headers["x-message-id"]
        cuts = _cuts(surface, raw)
        assert len(cuts) == 2, (surface, cuts)
        for cut in cuts:  # the live log
            resumed = await _resumed(client, surface, message_id, cut)
            assert resumed == _after(raw, cut), (surface, cut)
            said_by_stream(surface, resumed, first=cut + 1)
        state.hub.logs.forget(message_id)  # the log is gone: rebuilt from the store, the same bytes
        for cut in cuts:
            assert await _resumed(client, surface, message_id, cut) == _after(raw, cut), (surface, cut)
        # the non-stream answer and GET say what the stream added up to
        whole = await client.post(PATHS[surface], json=body(surface))
        assert said_by_answer(surface, whole) == (text, reasoning, calls)
        got = (await client.get(f"/v1/messages/{message_id}")).json()
        assert got["usage"]["reasoning_tokens"] > 0 and got["text"] == text


@pytest.mark.parametrize("family_server", ["hermes"], indirect=True)
async def test_get_an_idempotent_retry_and_the_client_carry_the_reasoning(family_server):
    state, client = family_server
    for surface in SURFACES:
        headers = {"Idempotency-Key": f"k-{surface}"}
        first = await client.post(PATHS[surface], json=body(surface), headers=headers)
        again = await client.post(PATHS[surface], json=body(surface), headers=headers)
        assert first.json() == again.json() and said_by_answer(surface, again)[1].strip() == WORDS
        _, raw = await stream_bytes(client, "POST", PATHS[surface], json=body(surface, stream=True),
                                    headers={"Idempotency-Key": f"s-{surface}"})
        _, replayed = await stream_bytes(client, "POST", PATHS[surface], json=body(surface, stream=True),
                                         headers={"Idempotency-Key": f"s-{surface}"})
        assert replayed == raw
    stored = check_object(await client.get(f"/v1/responses/{first.headers['x-message-id']}"))
    assert [i["type"] for i in stored["output"]] == ["reasoning", "message", "function_call"]
    async with RingserveClient(state.urls[0]) as ringserve:
        for surface in SURFACES:
            async with ringserve.stream("weather?", surface=surface, max_tokens=500,
                                        tools=body(surface)["tools"]) as stream:
                final = await stream.final_message()
            assert final.reasoning.strip() == WORDS and final.tool_calls[0].name == "get_weather"


async def test_a_reply_cut_inside_its_thinking_ends_cleanly_on_every_surface(tmp_path):
    reply = "<think>" + "mull " * 40
    async with running_server(fake_config(tmp_path), chat_format="hermes", reply=reply) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            for surface in SURFACES:
                budget = {"anthropic": "max_tokens", "openai": "max_completion_tokens"}.get(
                    surface, "max_output_tokens")
                resp, raw = await stream_bytes(client, "POST", PATHS[surface],
                                               json=body(surface, "hi", stream=True, **{budget: 6}))
                text, reasoning, _ = said_by_stream(surface, raw)
                assert text == "" and reasoning.startswith("mull"), (surface, raw)
                whole = await client.post(PATHS[surface], json=body(surface, "hi", **{budget: 6}))
                assert said_by_answer(surface, whole)[:2] == (text, reasoning)


# -- what the prompt holds: the render routes ----------------------------------------------------


@pytest.fixture
async def template_server(tmp_path) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    config = fake_config(tmp_path)
    async with running_server(config, chat_template=TEMPLATE, chat_format="hermes",
                              reply="Plan it.</think>Answer.") as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            yield state, client


async def _render(client: httpx.AsyncClient, surface: str, request: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(f"{PATHS[surface]}/render", json=request)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_the_render_routes_show_the_prompt_each_surface_gives(template_server):
    _state, client = template_server
    for surface in SURFACES:
        request = {**body(surface, "hi"), "tools": []}
        rendered = await _render(client, surface, request)
        prompt = "<|user|>hi\n<|assistant|><think>\n"
        assert rendered == {"object": "ringserve.prompt", "prompt": prompt,
                            "input_tokens": len(prompt.encode()), "reasoning_open": True}
        # the generation's prompt is that one
        answer = await client.post(PATHS[surface], json=request)
        usage = answer.json()["usage"]
        read = usage.get("input_tokens", usage.get("prompt_tokens"))
        assert read + usage.get("cache_read_input_tokens", 0) == rendered["input_tokens"]
    off = await _render(client, "openai", {**body("openai", "hi"), "tools": [], "reasoning_effort": "none"})
    assert off["prompt"] == "<|user|>hi\n<|assistant|>" and not off["reasoning_open"]
    off = await _render(client, "responses", {**body("responses", "hi"), "reasoning": {"effort": "none"}})
    assert not off["reasoning_open"]
    off = await _render(client, "anthropic", {**body("anthropic", "hi"), "thinking": {"type": "disabled"}})
    assert not off["reasoning_open"]


async def test_a_template_that_cannot_render_the_request_is_the_surfaces_400(template_server):
    _state, client = template_server
    for surface in SURFACES:
        # the render route answers as the generation's
        for path in (f"{PATHS[surface]}/render", PATHS[surface]):
            resp = await client.post(path, json=body(surface, "refuse"))
            assert resp.status_code == 400, resp.text
            assert "no refusals here" in resp.json()["error"]["message"]


async def test_the_render_routes_are_behind_the_api_keys(tmp_path):
    async with running_server(fake_config(tmp_path, auth={"api_keys": ["sk-1234567890abcdef"]})) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            for surface in SURFACES:
                refused = await client.post(f"{PATHS[surface]}/render", json=body(surface))
                assert refused.status_code == 401
                allowed = await client.post(f"{PATHS[surface]}/render", json=body(surface),
                                            headers={"Authorization": "Bearer sk-1234567890abcdef"})
                assert allowed.status_code == 200, allowed.text


async def test_reasoning_handed_back_reaches_the_prompt(template_server):
    """A thinking block ringserve signed (and one whose display was omitted: its sealed signature
    carries the text), a Chat ``reasoning_content``: the template keeps them."""
    state, client = template_server
    answer = (await client.post("/v1/messages", json={**body("anthropic", "hi"), "tools": []})).json()
    thinking = answer["content"][0]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "Plan it."
    adaptive = {"type": "adaptive", "display": "omitted"}
    omitted = (await client.post("/v1/messages", json={**body("anthropic", "hi"), "tools": [],
                                                       "thinking": adaptive})).json()
    hidden = omitted["content"][0]
    assert hidden["thinking"] == "" and hidden["signature"] != thinking["signature"]
    for block in (thinking, hidden):
        history = [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [block, answer["content"][1]]},
                   {"role": "user", "content": "and?"}]
        rendered = await _render(client, "anthropic", {"model": "m", "max_tokens": 9, "messages": history})
        assert "<|assistant|><think>Plan it.</think>Answer.\n" in rendered["prompt"]
    forged = {**thinking, "thinking": "Plan B."}
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [forged, answer["content"][1]]},
               {"role": "user", "content": "and?"}]
    resp = await client.post("/v1/messages/render", json={"model": "m", "max_tokens": 9, "messages": history})
    assert "Plan" not in resp.json()["prompt"]
    assert "messages[1].content[0]" in resp.headers["ringserve-ignored-fields"]
    chat = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Answer.", "reasoning_content": "Plan it."},
            {"role": "user", "content": "and?"}]
    rendered = await _render(client, "openai", {"model": "m", "messages": chat})
    assert "<|assistant|><think>Plan it.</think>Answer.\n" in rendered["prompt"]
    signer = ReasoningSigner.from_text(state.config.server.signing_key)
    assert signer.restore("Plan it.", thinking["signature"])


async def test_encrypted_content_round_trips_statelessly_under_store_false(template_server):
    """Codex's loop: ``store: false`` with ``include: ["reasoning.encrypted_content"]``; the reasoning
    item comes back without its text (a summary and the encrypted content, as codex-rs serializes
    it), the response it came from is gone, and the prompt still holds the reasoning."""
    state, client = template_server
    request = {"model": "m", "input": "hi", "store": False, "reasoning": {"summary": "auto"},
               "include": ["reasoning.encrypted_content"]}
    resp, raw = await stream_bytes(client, "POST", "/v1/responses", json={**request, "stream": True})
    done = check_responses(raw).done_items
    item, answer = done
    assert item["type"] == "reasoning" and item["summary"] == [{"type": "summary_text", "text": "Plan it."}]
    rid = resp.headers["x-message-id"]
    await wait_until(lambda: state.hub.store.get(rid) is None)
    assert (await client.get(f"/v1/responses/{rid}")).status_code == 404  # not stored
    sent_back = {k: item[k] for k in ("type", "id", "summary", "encrypted_content")}
    follow_up = {**request, "input": [{"role": "user", "content": "hi"}, sent_back, answer,
                                      {"role": "user", "content": "and?"}]}
    rendered = await _render(client, "responses", follow_up)
    assert "<|assistant|><think>Plan it.</think>Answer.\n" in rendered["prompt"]
    tampered = {**sent_back, "encrypted_content": sent_back["encrypted_content"][:-2] + "AA"}
    resp = await client.post("/v1/responses/render", json={**follow_up, "input": [
        {"role": "user", "content": "hi"}, tampered, answer, {"role": "user", "content": "and?"}]})
    assert "Plan it." not in resp.json()["prompt"] and "input[1]" in resp.headers["ringserve-ignored-fields"]


async def test_a_model_that_does_not_reason_takes_the_controls_and_answers_without_reasoning(tmp_path):
    async with running_server(fake_config(tmp_path)) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            controls = {"anthropic": {"thinking": {"type": "enabled", "budget_tokens": 2000}},
                        "openai": {"reasoning_effort": "high"},
                        "responses": {"reasoning": {"effort": "high", "summary": "auto"},
                                      "include": ["reasoning.encrypted_content"]}}
            for surface in SURFACES:
                request = {**body(surface, "echo:plain"), **controls[surface]}
                resp = await client.post(PATHS[surface], json=request)
                text, reasoning, calls = said_by_answer(surface, resp)
                assert (text, reasoning, calls) == ("plain", "", [])
                _, raw = await stream_bytes(client, "POST", PATHS[surface], json={**request, "stream": True})
                assert said_by_stream(surface, raw) == ("plain", "", [])
