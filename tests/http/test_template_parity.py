"""The render routes give llama-server's prompt (issue 43 item 9), on the bundled model with a corpus
template (``[model] chat_template_file``), against ``tests/data/templates/parity.json`` (llama-server's
``/apply-template`` on the same model and template, recorded by ``parity.py`` there): Apertus thinks
only when asked, a call's arguments reach the template as the client wrote them, OpenAI's
``reasoning_effort`` reaches the templates that read it (Hy3, Solar, Muse) and Anthropic's effort
gives the same prompt, a prefilled turn of reasoning only is continued inside its thinking block
(``reasoning_open``), and the continuation comes back as reasoning. Every corpus template is checked
on plain values in tests/formats/test_template_parity.py.
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ringserve.server import load_llama_engine
from tests.formats.test_template_parity import PARITY
from tests.support.llama_sdist import CorpusUnavailable, llama_cpp_templates
from tests.support.server import fake_config, running_server

MINISTRAL = "mistralai-Ministral-3-14B-Reasoning-2512.jinja"
RECORDED = dt.datetime.fromisoformat(PARITY["now"]).date()


def _template_path(name: str) -> Path:
    try:
        return llama_cpp_templates() / name
    except CorpusUnavailable as e:
        pytest.skip(f"llama.cpp's template corpus is not available: {e}")


@asynccontextmanager
async def _client(tmp_path: Path, name: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ringserve serving the bundled model with the corpus template ``name``."""
    config = fake_config(tmp_path, model={"chat_template_file": str(_template_path(name)), "ctx_size": 4096})
    async with running_server(config, engine_factory=load_llama_engine) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client:
            yield client


async def _render(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The render route's answer, its date (Solar's and Muse's templates print today's) written as
    the reference's: the day the route was asked, before or after it."""
    days = [dt.date.today()]
    resp = await client.post(f"{path}/render", json={"model": "m", **body})
    assert resp.status_code == 200, resp.text
    rendered: dict[str, Any] = resp.json()
    days.append(dt.date.today())
    for day in days:
        rendered["prompt"] = rendered["prompt"].replace(day.isoformat(), RECORDED.isoformat())
    return rendered


def _expected(name: str, request: str) -> str:
    return str(PARITY["templates"][name][request]["prompt"])


def _chat(request: str) -> dict[str, Any]:
    return copy.deepcopy(PARITY["requests"][request])


@pytest.mark.model
@pytest.mark.parametrize(("name", "request_name"), [
    ("Apertus-8B-Instruct.jinja", "default"),  # thinking off unless asked
    ("meetkai-functionary-medium-v3.2.jinja", "tool_unnamed"),  # {"city": "Paris"}, spaces kept
    ("upstage-Solar-Open-100B.jinja", "effort_low"),  # reasoning_effort reaches the generic templates
    ("muse-glimmer.jinja", "effort_low"),
    ("tencent-Hy3.jinja", "effort_low"),
    ("tencent-Hy3.jinja", "effort_high"),
    (MINISTRAL, "prefill_reasoning_content"),
])
async def test_the_chat_render_route_gives_llama_servers_prompt(tmp_path, name, request_name):
    async with _client(tmp_path, name) as client:
        rendered = await _render(client, "/v1/chat/completions", _chat(request_name))
        assert rendered["prompt"] == _expected(name, request_name)
        assert not rendered["reasoning_open"]


@pytest.mark.model
@pytest.mark.parametrize("name", [MINISTRAL, "Qwen-Qwen3-0.6B.jinja"])
async def test_a_turn_of_reasoning_only_is_continued_inside_its_thinking_block(tmp_path, name):
    async with _client(tmp_path, name) as client:
        rendered = await _render(client, "/v1/chat/completions", _chat("prefill_reasoning"))
        assert rendered["prompt"] == _expected(name, "prefill_reasoning")
        assert rendered["prompt"].endswith("Let me multiply.") and rendered["reasoning_open"]


@pytest.mark.model
async def test_anthropic_and_responses_efforts_give_chats_prompt_on_hy3(tmp_path):
    """The same effort on every surface is the same prompt: OpenAI's ``reasoning_effort``,
    Anthropic's ``output_config.effort`` (with or without thinking on), Responses'
    ``reasoning.effort``; one the template refuses is a 400 with its message."""
    async with _client(tmp_path, "tencent-Hy3.jinja") as client:
        for effort in ("low", "high"):
            expected = _expected("tencent-Hy3.jinja", f"effort_{effort}")
            question = _chat(f"effort_{effort}")["messages"]
            for thinking in ({}, {"thinking": {"type": "enabled", "budget_tokens": 1024}}):
                body = {"max_tokens": 64, "messages": question, "output_config": {"effort": effort},
                        **thinking}
                assert (await _render(client, "/v1/messages", body))["prompt"] == expected
            body = {"input": question[0]["content"], "reasoning": {"effort": effort}}
            assert (await _render(client, "/v1/responses", body))["prompt"] == expected
        # an effort Hy3 does not take is its refusal, a 400, as llama-server's
        resp = await client.post("/v1/chat/completions/render", json={"model": "m", **_chat("effort_low"),
                                                                      "reasoning_effort": "medium"})
        assert resp.status_code == 400
        refusal = "reasoning_effort error : medium, should be no_think/low/high"
        assert refusal in resp.json()["error"]["message"]


@pytest.mark.model
async def test_responses_arguments_reach_the_template_as_the_client_wrote_them(tmp_path):
    """A Responses ``function_call`` item's arguments, as llama-server passes them: with their spaces."""
    name = "meetkai-functionary-medium-v3.2.jinja"
    chat = _chat("tool_unnamed")
    user, assistant, result = chat["messages"]
    call = assistant["tool_calls"][0]
    items = [user, {"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"]},
             {"type": "function_call_output", "call_id": call["id"], "output": result["content"]}]
    tools = [{"type": "function", **chat["tools"][0]["function"]}]
    async with _client(tmp_path, name) as client:
        rendered = await _render(client, "/v1/responses", {"input": items, "tools": tools})
        assert rendered["prompt"] == _expected(name, "tool_unnamed")
        assert '>>>get_weather\n{"city": "Paris"}<|eot_id|>' in rendered["prompt"]


@pytest.mark.model
async def test_kimi_k2_names_a_tool_result_by_its_call_on_every_surface(tmp_path):
    """The documented difference: a Kimi-K2 tool result is headed by the tool's name, as Moonshot's
    guide sends it, where llama-server writes ``tool`` for a client that sends no name (and for
    Anthropic's, which cannot)."""
    name = "Kimi-K2-Instruct.jinja"
    chat = _chat("tool_unnamed")
    user, assistant, result = chat["messages"]
    call = assistant["tool_calls"][0]
    tool_use = {"type": "tool_use", "id": call["id"], "name": "get_weather", "input": {"city": "Paris"}}
    tool_result = {"type": "tool_result", "tool_use_id": call["id"], "content": result["content"]}
    schema = chat["tools"][0]["function"]["parameters"]
    anthropic = {"max_tokens": 64, "tools": [{"name": "get_weather", "input_schema": schema}],
                 "messages": [user, {"role": "assistant", "content": [tool_use]},
                              {"role": "user", "content": [tool_result]}]}
    async with _client(tmp_path, name) as client:
        for path, body in (("/v1/chat/completions", chat), ("/v1/messages", anthropic)):
            prompt = (await _render(client, path, body))["prompt"]
            assert "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0" in prompt
        assert "<|im_system|>tool<|im_middle|>## Return of" in _expected(name, "tool_unnamed")


async def test_the_continuation_of_a_turn_of_reasoning_comes_back_as_reasoning(tmp_path):
    """On Ministral 3 (the scripted fake engine), the model goes on thinking after the turn's reasoning,
    closes the block and answers: Chat gives the continuation as reasoning and the answer as text,
    no ``[/THINK]`` in either."""
    source = _template_path(MINISTRAL).read_text()
    reply = "17 * 20 = 340.[/THINK]391"
    async with running_server(fake_config(tmp_path), chat_template=source, reply=reply) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            body = {"model": "m", **_chat("prefill_reasoning")}
            resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("17 * 20 = 340.", "391")
