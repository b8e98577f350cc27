"""The OpenAI Responses API (issue 15) on the fake engine, judged by the official ``openai`` SDK.

Every stream is decoded by the SDK's own SSE decoder and by ringserve's parser
(they must agree), and every event is validated in pydantic strict mode
against ``openai.types.responses.ResponseStreamEvent``; every object against
``Response``, every error against ``ErrorObject``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio
from openai import _streaming as openai_streaming
from openai.types import ErrorObject
from openai.types.responses import Response, ResponseCreateParams, ResponseStreamEvent
from pydantic import TypeAdapter

from ringserve.core.sse import SSEParser
from ringserve.surfaces import responses as responses_surface
from tests.support.conformance import stream_bytes
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until

EVENT = TypeAdapter(ResponseStreamEvent)
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
#: A reply of 400 words, one token per byte on the fake engine.
LONG_ECHO = "echo:" + " ".join(f"w{i}" for i in range(400))


@attrs.define
class Seen:
    """What one validated Responses stream said."""

    seqs: list[int] = attrs.Factory(list)
    types: list[str] = attrs.Factory(list)
    text: str = ""
    reasoning: str = ""  # the reasoning deltas (its text or its summary) joined
    thoughts: dict[str, str] = attrs.Factory(dict)  # a reasoning item's id -> its deltas joined
    final: dict[str, Any] | None = None  # the terminal event's response
    done_items: list[dict[str, Any]] = attrs.Factory(list)  # the items of response.output_item.done
    arguments: dict[str, str] = attrs.Factory(dict)  # a function call's item id -> its argument deltas joined
    argument_deltas: int = 0

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The function_call items of response.output_item.done."""
        return [item for item in self.done_items if item["type"] == "function_call"]


def check_stream(raw: bytes, *, first: int = 0, complete: bool = True) -> Seen:
    """Validate one connection's SSE body as Responses events starting at seq ``first``."""
    sdk = list(openai_streaming.SSEDecoder().iter_bytes(iter([raw])))
    ours = SSEParser().feed(raw)
    assert [(e.event, e.data) for e in sdk] == [(e.event, e.data) for e in ours]
    seen = Seen()
    for i, event in enumerate(ours):
        assert seen.final is None, "an event after the terminal one"
        data = json.loads(event.data)
        EVENT.validate_python(data, strict=True)
        assert data["type"] == event.event
        response_id, seq = event.id.rsplit(":", 1)
        assert data["sequence_number"] == int(seq) == first + i
        assert (data["type"] == "response.created") == (first + i == 0)
        seen.seqs.append(data["sequence_number"])
        seen.types.append(data["type"])
        if data["type"] == "response.output_text.delta":
            seen.text += data["delta"]
        if data["type"] in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            seen.reasoning += data["delta"]
            seen.thoughts[data["item_id"]] = seen.thoughts.get(data["item_id"], "") + data["delta"]
        if data["type"] in ("response.reasoning_text.done", "response.reasoning_summary_text.done") and first == 0:
            assert data["text"] == seen.thoughts.get(data["item_id"], ""), data
        if data["type"] == "response.output_item.added" and data["item"]["type"] == "function_call":
            assert data["item"]["arguments"] == "" and data["item"]["status"] == "in_progress"
            seen.arguments[data["item"]["id"]] = ""
        if data["type"] == "response.function_call_arguments.delta":
            assert data["delta"]
            seen.arguments[data["item_id"]] = seen.arguments.get(data["item_id"], "") + data["delta"]
            seen.argument_deltas += 1
        if data["type"] == "response.function_call_arguments.done" and first == 0:
            assert data["arguments"] == seen.arguments[data["item_id"]]
        if data["type"] == "response.output_item.done":
            seen.done_items.append(data["item"])
            if data["item"]["type"] == "function_call" and first == 0:
                assert data["item"]["arguments"] == seen.arguments[data["item"]["id"]]
            if data["item"]["type"] == "reasoning" and first == 0:
                parts = data["item"]["summary"] or data["item"].get("content") or []
                assert "".join(p["text"] for p in parts) == seen.thoughts.get(data["item"]["id"], ""), data
        if data["type"] in TERMINAL:
            if first == 0 and data["type"] == "response.failed":
                # the item a failure interrupted has no done events; the output holds it incomplete
                output = data["response"]["output"]
                assert output[:len(seen.done_items)] == seen.done_items and len(output) - len(seen.done_items) <= 1
                assert all(item["status"] == "incomplete" for item in output[len(seen.done_items):])
            elif first == 0:
                assert data["response"]["output"] == seen.done_items
            else:
                done = data["response"]["output"][len(data["response"]["output"]) - len(seen.done_items):]
                assert [item["status"] for item in done] == [i["status"] for i in seen.done_items]
            Response.model_validate(data["response"], strict=True)
            assert data["response"]["id"] == response_id
            seen.final = data["response"]
    assert (seen.final is not None) == complete, raw[-400:]
    return seen


def check_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """An error answer in OpenAI's shape with ``status`` (and ``param``)."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    ErrorObject.model_validate(body["error"], strict=True)
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def check_object(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    Response.model_validate(body, strict=True)
    return body


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def read_to_seq_10(client: openai.OpenAI, **create: Any) -> tuple[str, str]:
    """Create a background response with ``stream``, read it to ``sequence_number`` 10 and close:
    (its id, the text read)."""
    stream = client.responses.create(background=True, stream=True, **create)
    text, response_id = "", ""
    for event in stream:
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.sequence_number == 10:
            stream.close()
            return response_id, text
    raise AssertionError("the stream ended before seq 10")


@pytest.fixture
async def slow_server(tmp_path: Path):
    """A server whose fake engine takes 5 ms a step and flushes every token: long streams, many events."""
    config = fake_config(tmp_path, stream={"flush_tokens": 1, "flush_ms": 0})
    async with running_server(config, step_seconds=0.005) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            yield state, client


# -- the field table ----------------------------------------------------------------------------


def test_every_sdk_request_field_is_decided():
    table = responses_surface.REQUEST_FIELDS
    decided = table.supported | table.ignored | set(table.refused)
    assert not table.supported & table.ignored
    assert not (table.supported | table.ignored) & set(table.refused)
    for td in ResponseCreateParams.__args__:
        assert td.__required_keys__ | td.__optional_keys__ <= decided, td.__name__


def test_count_fields_are_the_sdks():
    from openai.types.responses import InputTokenCountParams

    assert responses_surface.COUNT_FIELDS == InputTokenCountParams.__required_keys__ | InputTokenCountParams.__optional_keys__


# -- the four modes -----------------------------------------------------------------------------


async def test_stream_and_plain_give_the_same_text_and_usage(fake_server):
    state, client = fake_server
    request = {"model": "any", "input": "hello", "temperature": 0, "instructions": "be brief"}
    plain = await trio.to_thread.run_sync(lambda: sdk(state.urls[0]).responses.create(**request))
    events = await trio.to_thread.run_sync(lambda: list(sdk(state.urls[0]).responses.create(stream=True, **request)))
    final = events[-1]
    assert final.type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert plain.status == "completed" and plain.output_text == text == final.response.output_text != ""
    # equal but for cached_tokens: the second request reuses the first one's prompt cells
    usage, streamed = plain.usage, final.response.usage
    assert (usage.input_tokens, usage.output_tokens) == (streamed.input_tokens, streamed.output_tokens)
    assert usage.input_tokens > 0 and streamed.input_tokens_details.cached_tokens > 0
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens
    assert plain.instructions == "be brief" and plain.temperature == 0
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.completed"]
    # the raw bytes of the same stream, judged by the decoder and the strict types
    _resp, raw = await stream_bytes(client, "POST", "/v1/responses", json={**request, "stream": True})
    seen = check_stream(raw)
    assert seen.text == text and seen.final["usage"]["output_tokens"] == usage.output_tokens


async def test_background_answers_at_once_and_retrieve_follows_it(slow_server):
    state, client = slow_server
    created = check_object(await client.post("/v1/responses", json={"model": "any", "input": LONG_ECHO,
                                                                    "background": True, "metadata": {"k": "v"}}))
    assert created["status"] in ("queued", "in_progress") and created["background"] is True
    assert created["usage"] is None and created["metadata"] == {"k": "v"}
    _resp, raw = await stream_bytes(client, "GET", f"/v1/responses/{created['id']}", params={"stream": "true"})
    seen = check_stream(raw)
    assert seen.types[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert seen.final["status"] == "completed" and seen.text == LONG_ECHO.removeprefix("echo:")
    done = check_object(await client.get(f"/v1/responses/{created['id']}"))
    assert done["output"][0]["content"][0]["text"] == seen.text and done["usage"]["output_tokens"] > 0


async def test_background_stream_read_to_10_then_resume_after_10(slow_server):
    """The issue's test: read to sequence_number 10, close, resume with ``starting_after=10`` (raw,
    the SDK's ``retrieve(stream=True)``, and its ``responses.stream(response_id=...)`` helper)."""
    state, client = slow_server
    client_sdk = sdk(state.urls[0])

    response_id, head = await trio.to_thread.run_sync(lambda: read_to_seq_10(client_sdk, model="any", input=LONG_ECHO))
    assert head

    def rest() -> tuple[list[int], str]:
        seqs, text = [], ""
        for event in client_sdk.responses.retrieve(response_id, stream=True, starting_after=10):
            seqs.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                text += event.delta
        return seqs, text

    seqs, tail = await trio.to_thread.run_sync(rest)
    assert seqs == list(range(11, 11 + len(seqs))), "a gap or a duplicate"
    final = await trio.to_thread.run_sync(lambda: client_sdk.responses.retrieve(response_id))
    assert final.status == "completed" and head + tail == final.output_text == LONG_ECHO.removeprefix("echo:")

    def helper() -> tuple[int, str]:
        with client_sdk.responses.stream(response_id=response_id, starting_after=10) as stream:
            firsts = [event.sequence_number for event in stream]
            return firsts[0], stream.get_final_response().output_text

    first_seq, text = await trio.to_thread.run_sync(helper)
    assert first_seq == 11 and text == final.output_text
    # the same resume, raw, with the event id instead of starting_after
    _resp, raw = await stream_bytes(client, "GET", f"/v1/responses/{response_id}", params={"stream": "true"},
                            headers={"Last-Event-ID": f"{response_id}:10"})
    assert check_stream(raw, first=11).text == tail


async def test_a_responses_resume_counts_in_the_resume_metric(fake_server):
    """``GET /v1/responses/{id}?stream=true`` is a resume, counted in ``ringserve_resumes_total`` by its
    result as ``GET /v1/messages/{id}/stream`` is: ok, ended (204) and rejected (an event never sent)."""
    _state, client = fake_server
    rid = check_object(await client.post("/v1/responses", json={"model": "any", "input": "hello"}))["id"]
    _resp, raw = await stream_bytes(client, "GET", f"/v1/responses/{rid}", params={"stream": "true"})
    last = SSEParser().feed(raw)[-1].id
    ended = await client.get(f"/v1/responses/{rid}", params={"stream": "true"}, headers={"Last-Event-ID": last})
    assert ended.status_code == 204
    check_error(await client.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "9999"}), 400,
                "starting_after")
    metrics = (await client.get("/metrics")).text
    counted = {result: float(re.search(rf'^ringserve_resumes_total{{result="{result}"}} (\S+)$', metrics, re.M)[1])
               for result in ("ok", "ended", "rejected")}
    assert counted == {"ok": 1, "ended": 1, "rejected": 1}


async def test_curl_follows_a_background_response(slow_server):
    state, client = slow_server
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl")
    created = check_object(await client.post("/v1/responses", json={"model": "any", "input": LONG_ECHO,
                                                                    "background": True}))
    result = await trio.run_process([curl, "-sN", f"{state.urls[0]}/v1/responses/{created['id']}?stream=true"],
                                    capture_stdout=True)
    seen = check_stream(result.stdout)
    assert seen.final["status"] == "completed" and seen.text == LONG_ECHO.removeprefix("echo:")
    assert b"[DONE]" not in result.stdout


# -- endings ------------------------------------------------------------------------------------


async def test_max_output_tokens_is_incomplete(fake_server):
    state, client = fake_server
    _resp, raw = await stream_bytes(client, "POST", "/v1/responses",
                            json={"model": "any", "input": "hello", "max_output_tokens": 3, "stream": True})
    seen = check_stream(raw)
    assert seen.types[-1] == "response.incomplete"
    assert seen.final["status"] == "incomplete" and seen.final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert seen.final["output"][0]["status"] == seen.done_items[0]["status"] == "incomplete"
    assert seen.final["usage"]["output_tokens"] == 3
    stored = check_object(await client.get(f"/v1/responses/{seen.final['id']}"))
    assert stored["status"] == "incomplete" and stored["output"] == seen.final["output"]


async def test_a_failed_generation_ends_with_response_failed(tmp_path):
    async with running_server(fake_config(tmp_path), fail_after_tokens=4) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            _resp, raw = await stream_bytes(client, "POST", "/v1/responses",
                                    json={"model": "any", "input": "hello", "stream": True})
            seen = check_stream(raw)
            assert seen.types[-1] == "response.failed" and seen.final["status"] == "failed"
            assert seen.final["error"]["code"] == "server_error"
            assert check_object(await client.get(f"/v1/responses/{seen.final['id']}"))["status"] == "failed"


async def test_cancel_ends_every_reader_frees_the_slot_and_is_idempotent(slow_server):
    state, client = slow_server
    runner = state.hub.runner
    created = check_object(await client.post("/v1/responses", json={"model": "any", "input": LONG_ECHO,
                                                                    "background": True}))
    rid = created["id"]
    raws: list[bytes] = []

    async def reader() -> None:
        raws.append((await stream_bytes(client, "GET", f"/v1/responses/{rid}", params={"stream": "true"}))[1])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        nursery.start_soon(reader)
        await wait_until(lambda: (live := state.hub.live(rid)) is not None and len(live.snapshot().content) == 1
                         and len(live.snapshot().content[0].text) > 10
                         and live.open_log.readers >= 2)
        first = check_object(await client.post(f"/v1/responses/{rid}/cancel"))
    assert first["status"] == "cancelled" and first["output"][0]["status"] == "incomplete"
    text = first["output"][0]["content"][0]["text"]
    assert text and LONG_ECHO.removeprefix("echo:").startswith(text)
    for raw in raws:  # both readers ended, on an event the SDK's types accept
        seen = check_stream(raw)
        assert seen.types[-1] == "response.incomplete" and seen.final["status"] == "cancelled"
        assert seen.text == text
    await wait_until(lambda: runner.statistics().slots_busy == 0)
    assert runner.statistics().kv_cells_used == 0
    metrics = (await client.get("/metrics")).text
    assert "\nringserve_kv_cells_used 0" in metrics
    second = check_object(await client.post(f"/v1/responses/{rid}/cancel"))
    assert second == first
    assert (await trio.to_thread.run_sync(lambda: sdk(state.urls[0]).responses.cancel(rid))).status == "cancelled"


async def test_restart_during_a_background_generation_keeps_the_text_so_far(tmp_path):
    config = fake_config(tmp_path, stream={"persist_seconds": 0.01}, server={"drain_timeout": 0})
    async with running_server(config, step_seconds=0.005) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            rid = check_object(await client.post("/v1/responses", json={"model": "any", "input": LONG_ECHO,
                                                                        "background": True}))["id"]
            await wait_until(lambda: len(state.hub.store.get(rid).text) > 20)
    async with running_server(config) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            after = check_object(await client.get(f"/v1/responses/{rid}"))
    assert after["status"] == "failed" and after["error"]["code"] == "server_error"
    text = after["output"][0]["content"][0]["text"]
    assert len(text) > 20 and LONG_ECHO.removeprefix("echo:").startswith(text)
    assert after["output"][0]["status"] == "incomplete"


# -- conversation, delete, input_tokens ---------------------------------------------------------


async def test_previous_response_id_continues_the_conversation(fake_server):
    state, client = fake_server
    first = check_object(await client.post("/v1/responses", json={"model": "any", "input": "hello",
                                                                  "instructions": "only here"}))
    answer = first["output"][0]["content"][0]["text"]

    async def count(body: dict[str, Any]) -> int:
        resp = await client.post("/v1/responses/input_tokens", json={"model": "any", **body})
        assert resp.status_code == 200 and resp.json()["object"] == "response.input_tokens", resp.text
        return resp.json()["input_tokens"]

    explicit = [
        {"role": "user", "content": "hello"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer, "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "echo:again"}]},
    ]
    continued = await count({"input": "echo:again", "previous_response_id": first["id"]})
    assert continued == await count({"input": explicit}) > await count({"input": "echo:again"})
    second = check_object(await client.post("/v1/responses", json={"model": "any", "input": "echo:again",
                                                                   "previous_response_id": first["id"]}))
    assert second["previous_response_id"] == first["id"] and second["instructions"] is None
    assert second["usage"]["input_tokens"] == continued
    assert second["output"][0]["content"][0]["text"] == "again"
    third = check_object(await client.post("/v1/responses", json={"model": "any", "input": "echo:more",
                                                                  "previous_response_id": second["id"]}))
    assert third["usage"]["input_tokens"] == await count({"input": [*explicit, {"role": "assistant", "content": "again"},
                                                                     {"role": "user", "content": "echo:more"}]})
    check_error(await client.post("/v1/responses", json={"model": "any", "input": "x",
                                                         "previous_response_id": "resp_nope"}), 404,
                "previous_response_id")


async def test_delete_then_get_is_404(fake_server):
    state, client = fake_server
    rid = check_object(await client.post("/v1/responses", json={"model": "any", "input": "hello"}))["id"]
    await trio.to_thread.run_sync(lambda: sdk(state.urls[0]).responses.delete(rid))
    check_error(await client.get(f"/v1/responses/{rid}"), 404)
    check_error(await client.get(f"/v1/responses/{rid}", params={"stream": "true"}), 404)
    check_error(await client.delete(f"/v1/responses/{rid}"), 404)
    with pytest.raises(openai.NotFoundError):
        await trio.to_thread.run_sync(lambda: sdk(state.urls[0]).responses.retrieve(rid))


async def test_delete_of_a_running_response_cancels_it(slow_server):
    state, client = slow_server
    rid = check_object(await client.post("/v1/responses", json={"model": "any", "input": LONG_ECHO,
                                                                "background": True}))["id"]
    await wait_until(lambda: (live := state.hub.live(rid)) is not None and live.snapshot().content)
    resp = await client.delete(f"/v1/responses/{rid}")
    assert resp.status_code == 200 and resp.json() == {"id": rid, "object": "response.deleted", "deleted": True}
    assert state.hub.live(rid) is None and state.hub.store.get(rid) is None
    check_error(await client.get(f"/v1/responses/{rid}"), 404)


async def test_a_store_false_stream_whose_reader_left_is_deleted_at_its_end(tmp_path):
    """Not by retention later: the row goes when the generation ends (here cancelled by the abort
    policy once the only reader left)."""
    config = fake_config(tmp_path, policy={"grace_seconds": 0.05})
    async with running_server(config, step_seconds=0.005) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            async with client.stream("POST", "/v1/responses", json={"model": "any", "input": LONG_ECHO,
                                                                    "stream": True, "store": False}) as resp:
                rid = resp.headers["x-message-id"]
                async for line in resp.aiter_lines():
                    if line.startswith("event: response.output_text.delta"):
                        break
            await wait_until(lambda: state.hub.live(rid) is None)  # ended (cancelled: no reader left)
            await wait_until(lambda: state.hub.store.get(rid) is None, timeout=5)


async def test_store_false_leaves_no_row(fake_server):
    state, client = fake_server
    rid = check_object(await client.post("/v1/responses", json={"model": "any", "input": "hello", "store": False}))["id"]
    await wait_until(lambda: state.hub.store.get(rid) is None)
    check_error(await client.get(f"/v1/responses/{rid}"), 404)


async def test_stream_token_lets_an_eventsource_follow_a_response(tmp_path):
    async with running_server(fake_config(tmp_path, auth={"api_keys": ["k-123456789012345678901234"]})) as state:
        auth = {"Authorization": "Bearer k-123456789012345678901234"}
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            rid = check_object(await client.post("/v1/responses", json={"model": "any", "input": "hello",
                                                                        "background": True}, headers=auth))["id"]
            check_error(await client.get(f"/v1/responses/{rid}", params={"stream": "true"}), 401)
            token = (await client.post(f"/v1/messages/{rid}/stream_token", headers=auth)).json()["stream_token"]
            _resp, raw = await stream_bytes(client, "GET", f"/v1/responses/{rid}",
                                    params={"stream": "true", "stream_token": token})
            assert check_stream(raw).final["status"] == "completed"


async def test_a_stream_token_opens_only_the_stream_it_was_made_for(tmp_path):
    """Issue 36 item 6: the token opens ``GET /v1/responses/{id}?stream=true``, not the whole Response
    object at ``GET /v1/responses/{id}`` (a 401, as on every route but the streams)."""
    async with running_server(fake_config(tmp_path, auth={"api_keys": ["k-123456789012345678901234"]})) as state:
        auth = {"Authorization": "Bearer k-123456789012345678901234"}
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            rid = check_object(await client.post("/v1/responses", json={"model": "any", "input": "hello"},
                                                 headers=auth))["id"]
            token = (await client.post(f"/v1/messages/{rid}/stream_token", headers=auth)).json()["stream_token"]
            for params in ({}, {"stream": "false"}):
                check_error(await client.get(f"/v1/responses/{rid}", params={**params, "stream_token": token}), 401)
            for route in (f"/v1/responses/{rid}/cancel", f"/v1/messages/{rid}/cancel"):
                check_error(await client.post(route, params={"stream_token": token}), 401)
            check_error(await client.get(f"/v1/messages/{rid}", params={"stream_token": token}), 401)
            resp = await client.get(f"/v1/responses/{rid}", params={"stream": "true", "stream_token": token})
            assert resp.status_code == 200 and check_stream(resp.content).final["status"] == "completed"


# -- bad input ----------------------------------------------------------------------------------

BAD_CREATE = [
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"input": [{"type": "bogus"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({}, "input"),
    ({"input": [{"type": {}, "role": "user", "content": "hi"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": [], "text": "hi"}]}]}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "object", "properties": {"a": {"type": {}}}}}}}, None),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CREATE)
async def test_bad_create_is_a_400_naming_the_field(fake_server, body, param):
    _state, client = fake_server
    check_error(await client.post("/v1/responses", json={"model": "any", **body}), 400, param)


async def test_a_prompt_past_the_context_is_a_400_naming_input_and_its_count_is_answered(tmp_path):
    async with running_server(fake_config(tmp_path, engine={"ctx_per_slot": 64})) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            body = {"model": "any", "input": "x" * 200}
            error = check_error(await client.post("/v1/responses", json=body), 400, "input")
            count = await client.post("/v1/responses/input_tokens", json=body)
    assert "but the context is 64 tokens" in error["message"]
    assert count.status_code == 200 and count.json()["input_tokens"] > 200


@pytest.mark.parametrize("route", ["/v1/responses", "/v1/responses/input_tokens"])
async def test_a_lone_surrogate_anywhere_is_a_400_and_a_pair_is_text(fake_server, route):
    _state, client = fake_server

    async def post(body: dict[str, Any]) -> httpx.Response:  # JSON escapes, as httpx's json= cannot send a lone one
        return await client.post(route, content=json.dumps({"model": "any", "input": "hi", **body}),
                                 headers={"content-type": "application/json"})

    bodies = [{"instructions": "\ud800"}, {"input": "x\udfff"}, {"text": {"format": {"type": "text"}, "\ud800": 1}}]
    if route == "/v1/responses":  # fields that only a create echoes and stores
        bodies += [{"metadata": {"k": "\ud800"}}, {"user": "x\udfff"}, {"metadata": {"\ud800": "v"}}]
    for body in bodies:
        error = check_error(await post(body), 400)
        assert "lone surrogate" in error["message"]
    resp = await post({"input": "hi \ud83d\ude00", "instructions": "\ud83d\ude00"})
    assert resp.status_code == 200, resp.text


async def test_neutral_values_of_refused_fields_are_accepted(fake_server):
    _state, client = fake_server
    body = {"model": "any", "input": "hi", "tools": [], "tool_choice": "auto", "text": {"format": {"type": "text"}},
            "truncation": "disabled", "include": [], "user": "u", "parallel_tool_calls": True}
    assert check_object(await client.post("/v1/responses", json=body))["status"] == "completed"
    # and unknown fields, and those that cannot change the answer (issue 33: accepted, not refused)
    body |= {"no_such_field": 1, "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"},
             "text": {"format": {"type": "text"}, "verbosity": "low"}}
    assert check_object(await client.post("/v1/responses", json=body))["status"] == "completed"


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "99999"])
async def test_bad_starting_after_is_a_400(fake_server, value):
    _state, client = fake_server
    rid = check_object(await client.post("/v1/responses", json={"model": "any", "input": "hello"}))["id"]
    check_error(await client.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": value}), 400,
                "starting_after")


async def test_unknown_ids_and_wrong_cancels(fake_server):
    _state, client = fake_server
    for method, path in [("GET", "/v1/responses/resp_0123"), ("POST", "/v1/responses/resp_0123/cancel"),
                         ("DELETE", "/v1/responses/resp_0123"), ("GET", "/v1/responses/nothing"),
                         ("GET", "/v1/responses/resp_0123?stream=true")]:
        error = check_error(await client.request(method, path), 404)
        assert error["message"].startswith("Response with id 'resp_0123' not found" if "0123" in path
                                           else "Response with id 'nothing' not found"), error
    chat = await client.post("/v1/chat/completions", json={"model": "any", "messages": [{"role": "user", "content": "x"}]})
    check_error(await client.get(f"/v1/responses/{chat.json()['id']}"), 404)
    foreground = check_object(await client.post("/v1/responses", json={"model": "any", "input": "hello"}))
    assert "background" in check_error(await client.post(f"/v1/responses/{foreground['id']}/cancel"), 400)["message"]
    finished = check_object(await client.post("/v1/responses", json={"model": "any", "input": "hello",
                                                                     "background": True}))
    await wait_until_final(client, finished["id"])
    assert "completed" in check_error(await client.post(f"/v1/responses/{finished['id']}/cancel"), 400)["message"]
    # after the terminal event there is nothing to read: 204, on which an EventSource stops
    final_seq = _state.hub.store.get(finished["id"]).final_seq
    resp = await client.get(f"/v1/responses/{finished['id']}", params={"stream": "true", "starting_after": final_seq})
    assert resp.status_code == 204


async def wait_until_final(client: httpx.AsyncClient, response_id: str) -> dict[str, Any]:
    with trio.fail_after(20):
        while (body := (await client.get(f"/v1/responses/{response_id}")).json())["status"] in ("queued", "in_progress"):
            await trio.sleep(0.01)
    return body


# -- the renderer on plain values -----------------------------------------------------------------


def _render(events: list[Any], options: responses_surface.ResponseOptions | None = None) -> list[dict[str, Any]]:
    from ringserve.core.events import Usage
    from ringserve.core.render import render

    renderer = responses_surface.ResponsesRenderer("resp_ab", "m", 1, options or responses_surface.ResponseOptions(),
                                                   responses_surface.ReasoningItems(None))
    wire = renderer.start(Usage(3, 0))
    for event in events:
        wire += render(renderer, event)
    out = []
    for seq, w in enumerate(wire):
        data = json.loads(w.text(seq))
        EVENT.validate_python(data, strict=True)
        assert data["sequence_number"] == seq and data["type"] == w.event
        out.append(data)
    return out


def test_renderer_items_per_block_and_the_last_items_status():
    from ringserve.core.errors import ErrorKind
    from ringserve.core.events import BlockDelta, BlockKind, BlockStart, BlockStop, Failure, Finish, StopReason, Usage

    two = [BlockStart(0, BlockKind.TEXT), BlockDelta(0, "a"), BlockStop(0),
           BlockStart(1, BlockKind.TEXT), BlockDelta(1, "b"), BlockStop(1)]
    cut = _render([*two, Finish(StopReason.MAX_TOKENS, Usage(3, 2))])
    done = [e for e in cut if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]["status"]) for e in done] == [(0, "completed"), (1, "incomplete")]
    final = cut[-1]["response"]
    assert [i["id"] for i in final["output"]] == ["msg_ab", "msg_ab_1"]
    assert [i["status"] for i in final["output"]] == ["completed", "incomplete"]
    # a failure closes nothing (issue 43, item 12): response.failed right after the last delta,
    # its output the item as far as it got, incomplete; the blocks done before it stay done
    failure = Failure(ErrorKind.OVERLOADED, "x", Usage(3, 1))
    failed = _render([BlockStart(0, BlockKind.TEXT), BlockDelta(0, "a"), failure])
    assert [e["type"] for e in failed[-2:]] == ["response.output_text.delta", "response.failed"]
    assert failed[-1]["response"]["error"] == {"code": "rate_limit_exceeded", "message": "x"}
    assert [(i["status"], i["content"][0]["text"]) for i in failed[-1]["response"]["output"]] == [("incomplete", "a")]
    for events in ([*two[:3], BlockStart(1, BlockKind.TEXT), BlockDelta(1, "b"), failure], [*two, failure]):
        failed = _render(events)
        done = [e["item"] for e in failed if e["type"] == "response.output_item.done"]
        assert [(i["id"], i["status"]) for i in done] == [("msg_ab", "completed")]
        assert [i["status"] for i in failed[-1]["response"]["output"]] == ["completed", "incomplete"]
        assert failed[-2]["type"] == "response.output_text.delta"
    # a background response is queued first; an empty answer still has its (empty) item
    empty = _render([BlockStart(0, BlockKind.TEXT), BlockStop(0), Finish(StopReason.END, Usage(3, 1))],
                    responses_surface.ResponseOptions(background=True))
    assert [e["type"] for e in empty[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert empty[0]["response"]["status"] == "queued" and empty[-1]["response"]["output"][0]["content"][0]["text"] == ""


async def test_keepalives_while_queued_are_events_the_sdk_takes_in_its_stride(tmp_path):
    """A stream queued behind another generation for longer than the heartbeat interval (issue 12):
    ``response.in_progress`` again each interval (the keepalive Codex counts; issue 33), which the
    SDK's stream reads through."""
    config = fake_config(tmp_path, engine={"slots": 1}, server={"heartbeat_interval": 1.0})
    ahead = "echo:" + "x" * 150  # 150 steps of 20 ms: 3 s ahead in the only slot
    async with running_server(config, step_seconds=0.02, piece_bytes=1) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            check_object(await client.post("/v1/responses", json={"model": "any", "input": ahead, "background": True}))
            _resp, raw = await stream_bytes(client, "POST", "/v1/responses",
                                            json={"model": "any", "input": "echo:after", "stream": True})
            seen = check_stream(raw)
            assert seen.text == "after" and seen.types.count("response.in_progress") >= 2
            check_object(await client.post("/v1/responses", json={"model": "any", "input": ahead, "background": True}))
            events = await trio.to_thread.run_sync(lambda: list(sdk(state.urls[0]).responses.create(
                model="any", input="echo:again", stream=True, background=True)))
            assert events[-1].type == "response.completed" and events[-1].response.output_text == "again"


async def test_without_kept_prompts_objects_answer_and_previous_response_id_is_a_400(tmp_path):
    """keep_prompts = false keeps no prompt text (input, instructions), but what the object echoes
    that is not the prompt (metadata, sampling, tools) is kept."""
    async with running_server(fake_config(tmp_path, store={"keep_prompts": False}), step_seconds=0.005) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            first = check_object(await client.post("/v1/responses", json={
                "model": "any", "input": "hello", "metadata": {"k": "v"}, "instructions": "be brief",
                "temperature": 0.5}))
            assert first["metadata"] == {"k": "v"} and first["instructions"] == "be brief"  # live: the request
            stored = check_object(await client.get(f"/v1/responses/{first['id']}"))
            assert stored["metadata"] == {"k": "v"} and stored["temperature"] == 0.5
            assert stored["instructions"] is None and stored["output"] == first["output"]  # prompt text: not kept
            row = state.hub.store.get(first["id"])
            assert "hello" not in row.render and "be brief" not in row.render and row.request == ""
            check_error(await client.post("/v1/responses", json={"model": "any", "input": "x",
                                                                 "previous_response_id": first["id"]}), 400,
                        "previous_response_id")
            rid = check_object(await client.post("/v1/responses", json={"model": "any", "input": LONG_ECHO,
                                                                        "background": True}))["id"]
            assert check_object(await client.post(f"/v1/responses/{rid}/cancel"))["status"] == "cancelled"
            assert check_object(await client.post(f"/v1/responses/{rid}/cancel"))["status"] == "cancelled"


async def test_a_previous_response_id_chain_is_read_off_the_event_loop_and_bounded_like_a_body(tmp_path, monkeypatch):
    """Issue 36 item 5: the stored responses a chain continues are read on a worker thread (a probe
    records the thread of every read: none on the event loop's), so a long chain stalls no
    stream; and their stored bodies and outputs are bounded by ``server.max_body_bytes`` in all."""
    import threading

    from ringserve.live.hub import Hub

    read_on: list[threading.Thread] = []
    stored_request = Hub.stored_request

    def probe(hub: Hub, message_id: str) -> Any:
        read_on.append(threading.current_thread())
        return stored_request(hub, message_id)

    monkeypatch.setattr(Hub, "stored_request", probe)
    word = "echo:" + "x" * 600  # a body of about 650 bytes, an output of 600 characters
    async with running_server(fake_config(tmp_path, server={"max_body_bytes": 2000})) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            first = check_object(await client.post("/v1/responses", json={"model": "any", "input": word}))["id"]
            second = check_object(await client.post("/v1/responses", json={
                "model": "any", "input": word, "previous_response_id": first}))["id"]
            count = await client.post("/v1/responses/input_tokens",
                                      json={"model": "any", "input": "x", "previous_response_id": first})
            assert count.status_code == 200
            assert len(read_on) == 2 and threading.main_thread() not in read_on
            # on the second: the two stored bodies and outputs are over 2000 bytes in all
            error = check_error(await client.post("/v1/responses", json={
                "model": "any", "input": "x", "previous_response_id": second}), 400, "previous_response_id")
            assert "server.max_body_bytes (2000 bytes)" in error["message"]
            assert len(read_on) == 4 and threading.main_thread() not in read_on
