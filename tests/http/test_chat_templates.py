"""The model's chat template through the server, on the fake engine given a template: the
request's ``chat_template_kwargs`` (OpenAI Chat and Responses) reach it, and a template that
refuses a request is a 400 in the surface's shape that says why."""

from __future__ import annotations

import httpx
import pytest

from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY
from tests.support.server import fake_config, running_server

#: Writes the kwarg ``extra`` before the turns, and refuses two user turns in a row, as Gemma 2's
#: template does.
TEMPLATE = (
    "{{ extra | default('') }}{% for m in messages %}"
    "{% if loop.index0 and m.role == messages[loop.index0 - 1].role %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
)
RESPONSES_BODY = {"model": "any", "input": "hello", "max_output_tokens": 16}


@pytest.fixture
async def client(tmp_path):
    async with running_server(fake_config(tmp_path), chat_template=TEMPLATE, reply="ok") as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            yield client


async def test_chat_template_kwargs_reach_the_template(client):
    plain = (await client.post("/v1/chat/completions", json=OPENAI_BODY)).json()["usage"]["prompt_tokens"]
    body = {**OPENAI_BODY, "chat_template_kwargs": {"extra": "four"}}
    reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == plain + 4  # a token per byte
    plain = (await client.post("/v1/responses", json=RESPONSES_BODY)).json()["usage"]["input_tokens"]
    reply = await client.post("/v1/responses", json={**RESPONSES_BODY, "chat_template_kwargs": {"extra": "four"}})
    assert reply.status_code == 200 and reply.json()["usage"]["input_tokens"] == plain + 4


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_chat_template_kwargs_must_be_an_object(client, path):
    body = OPENAI_BODY if path == "/v1/chat/completions" else RESPONSES_BODY
    reply = await client.post(path, json={**body, "chat_template_kwargs": ["extra"]})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "chat_template_kwargs"


async def test_a_request_the_template_refuses_is_a_400_that_says_why(client):
    body = {**OPENAI_BODY, "messages": [{"role": "user", "content": "time?"}, {"role": "user", "content": "now"}]}
    reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert "Conversation roles must alternate user/assistant" in error["message"]


#: Writes 300 MB for a last user message ``boom`` only (issue 43): any client could take the
#: server's memory.
BOOM_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    "{% if messages[-1].content == 'boom' %}{% for i in range(100000) %}{{ 'y' * 3000 }}{% endfor %}{% endif %}"
)


async def test_a_request_that_takes_the_template_past_its_bounds_is_a_400_and_the_server_goes_on(tmp_path):
    async with running_server(fake_config(tmp_path), chat_template=BOOM_TEMPLATE, reply="ok") as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            boom = {"role": "user", "content": "boom"}
            reply = await client.post("/v1/chat/completions", json={**OPENAI_BODY, "messages": [boom]})
            assert reply.status_code == 400
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == "messages"
            assert "chat template would hold more than its" in error["message"] and "memory" in error["message"]
            reply = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "messages": [boom]})
            assert reply.status_code == 400 and reply.json()["type"] == "error"
            assert reply.json()["error"]["type"] == "invalid_request_error"
            reply = await client.post("/v1/chat/completions", json=OPENAI_BODY)
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "ok"
