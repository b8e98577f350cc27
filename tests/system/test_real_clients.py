"""Real clients on the real model with their own large max_tokens defaults (issue 22).

One server process for the module with a small context per slot (``CTX``
tokens), so a reply runs out of context after about a hundred tokens: the
Anthropic SDK with ``max_tokens=16384`` ends with
``model_context_window_exceeded`` and the OpenAI SDK with ``length``, with
exact usage; pydantic-ai agents (which send ``max_tokens=16384`` to
Anthropic by default) run and stream on both surfaces, and so does an OpenAI
Agents SDK agent on the Chat Completions surface.

The frameworks run on asyncio (``run_sync``, ``asyncio.run``), so these tests
are plain functions, not Trio tests.
"""

from __future__ import annotations

import asyncio

import agents
import anthropic
import openai
import pytest
from pydantic_ai import Agent
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider

from bench.common import ServerProcess
from tests.support.server import MODEL_TOML, SERVE

pytestmark = pytest.mark.model

CTX = 64
LONG = "Write a very long story about a dragon who learns to cook. Use many chapters."
GREEDY = {"temperature": 0}


def _server(tmp_path_factory: pytest.TempPathFactory, name: str, slots: int, ctx: int):
    """A real-model server process with ``slots`` slots of ``ctx`` tokens, until the module ends."""
    cfg = tmp_path_factory.mktemp(name) / "config.toml"
    cfg.write_text(f'[engine]\nslots = {slots}\nctx_per_slot = {ctx}\n[store]\npath = "{cfg.parent / "s.sqlite3"}"\n{MODEL_TOML}')
    server = ServerProcess([*SERVE, "--config", str(cfg)])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def small_ctx_server(tmp_path_factory: pytest.TempPathFactory):
    yield from _server(tmp_path_factory, "small_ctx", 2, CTX)


def test_anthropic_sdk_16384_max_tokens_ends_model_context_window_exceeded(small_ctx_server):
    a = anthropic.Anthropic(base_url=small_ctx_server.url, api_key="unused", max_retries=0)
    kwargs = dict(model="m", max_tokens=16384, extra_body=GREEDY, messages=[{"role": "user", "content": LONG}])
    full = a.messages.create(**kwargs)
    assert full.stop_reason == "model_context_window_exceeded", full
    prompt = full.usage.input_tokens + (full.usage.cache_read_input_tokens or 0)  # input_tokens: uncached part
    assert prompt + full.usage.output_tokens == CTX
    with a.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "model_context_window_exceeded"
    # the streamed repeat found all but the last prompt token in the prefix cache
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (1, prompt - 1)
    assert final.usage.output_tokens == full.usage.output_tokens
    assert streamed == full.content[0].text and "\ufffd" not in streamed


def test_openai_sdk_max_tokens_over_the_context_ends_with_length(small_ctx_server):
    o = openai.OpenAI(base_url=small_ctx_server.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="m", temperature=0, messages=[{"role": "user", "content": LONG}])
    full = o.chat.completions.create(max_completion_tokens=16384, **kwargs)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.total_tokens == CTX
    chunks = list(o.chat.completions.create(max_tokens=32000, stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content


# -- pydantic-ai agents -------------------------------------------------------------------------

PROMPT = "Name three colours."


def _agent_model(surface: str, url: str):
    if surface == "anthropic":
        # anthropic>=2 sends anthropic-version 2026-10-21, with which pydantic-ai drops temperature (that
        # version of Anthropic's API rejects it); the version before keeps it, so GREEDY is greedy.
        client = anthropic.AsyncAnthropic(base_url=url, api_key="unused",
                                          default_headers={"anthropic-version": "2023-06-01"})
        return AnthropicModel("claude-sonnet-4-5", provider=AnthropicProvider(anthropic_client=client))
    return OpenAIChatModel("gpt-4o", provider=OpenAIProvider(base_url=url + "/v1", api_key="unused"))


@pytest.fixture(params=["anthropic", "openai"])
def agent_model(request, small_ctx_server):
    return _agent_model(request.param, small_ctx_server.url)


def test_pydantic_ai_agent_run(agent_model):
    agent = Agent(agent_model)
    result = agent.run_sync(PROMPT, model_settings=GREEDY)
    assert isinstance(result.output, str) and result.output.strip()
    assert "\ufffd" not in result.output
    usage = result.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.input_tokens + usage.output_tokens <= CTX


def test_pydantic_ai_agent_run_stream_text_deltas_equal_run(agent_model):
    agent = Agent(agent_model)

    async def stream() -> tuple[list[str], str]:
        async with agent.run_stream(PROMPT, model_settings=GREEDY) as result:
            deltas = [d async for d in result.stream_text(delta=True, debounce_by=None)]
            return deltas, await result.get_output()

    deltas, output = asyncio.run(stream())
    assert len(deltas) > 1  # it really streamed
    assert "".join(deltas) == output
    assert output == agent.run_sync(PROMPT, model_settings=GREEDY).output


#: Tool definitions and their instructions take a few hundred tokens of the prompt.
TOOLS_CTX = 2048

@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory):
    yield from _server(tmp_path_factory, "tools", 1, TOOLS_CTX)


@pytest.fixture(params=["anthropic", "openai"])
def tool_agent_model(request, tools_server):
    return _agent_model(request.param, tools_server.url)


@pytest.mark.skip(reason="the bundled model does not call a tool by itself: with tool_choice auto it answered"
                  " in prose on both surfaces (measured once each, temperature 0)")
def test_pydantic_ai_agent_calls_a_tool(tool_agent_model):
    agent = Agent(tool_agent_model)
    calls = []

    @agent.tool_plain
    def colour_of_the_sky() -> str:
        """The colour of the sky today."""
        calls.append(1)
        return "green"

    result = agent.run_sync("What colour is the sky today? Use the tool.", model_settings=GREEDY)
    assert calls and "green" in result.output.lower()


def test_pydantic_ai_agent_structured_output(tool_agent_model):
    from pydantic import BaseModel

    class Colours(BaseModel):
        names: list[str]

    agent = Agent(tool_agent_model, output_type=Colours)
    result = agent.run_sync(PROMPT, model_settings=GREEDY)
    # The agent forces its output tool (Anthropic tool_choice any, OpenAI required), so the
    # arguments are decoded under the schema's grammar: always a Colours. What the names are is
    # the bundled model's (measured: ['final_result'], not three colours).
    assert isinstance(result.output, Colours) and all(isinstance(n, str) for n in result.output.names)


# -- the OpenAI Agents SDK (Chat Completions model; tracing off, so nothing leaves the machine) --

def _agents_agent(url: str):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model="gpt-4o", openai_client=client)
    return agents.Agent(name="colours", instructions="Answer briefly.", model=model,
                        model_settings=agents.ModelSettings(temperature=0))


def test_openai_agents_sdk_run_and_run_streamed(small_ctx_server):
    from openai.types.responses import ResponseTextDeltaEvent

    agents.set_tracing_disabled(True)

    async def run() -> str:
        result = await agents.Runner.run(_agents_agent(small_ctx_server.url), PROMPT)
        return result.final_output

    async def streamed() -> tuple[list[str], str]:
        result = agents.Runner.run_streamed(_agents_agent(small_ctx_server.url), PROMPT)
        deltas = [e.data.delta async for e in result.stream_events()
                  if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)]
        return deltas, result.final_output

    output = asyncio.run(run())
    assert isinstance(output, str) and output.strip() and "\ufffd" not in output
    deltas, final = asyncio.run(streamed())
    assert len(deltas) > 1
    assert "".join(deltas) == final == output
