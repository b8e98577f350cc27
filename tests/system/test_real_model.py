"""The bundled model behind a real server process, driven by curl and the official SDKs (issue 2).

Kept short: greedy decoding, few tokens. One server for the whole module.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import anthropic
import openai
import pytest

from ringserve.core.sse import SSEParser

pytestmark = pytest.mark.model

PROMPT = "Name three colours."
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def sdk_clients(model_server):
    a = anthropic.Anthropic(base_url=model_server.url, api_key="unused", max_retries=0)
    o = openai.OpenAI(base_url=model_server.url + "/v1", api_key="unused", max_retries=0)
    return a, o


def test_anthropic_sdk_stream_equals_non_stream(sdk_clients):
    a, _ = sdk_clients
    # Current SDKs no longer have a temperature argument; the server still takes the field.
    kwargs = dict(model="anything", max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": PROMPT}])
    full = a.messages.create(**kwargs)
    assert full.type == "message" and full.role == "assistant"
    assert full.content[0].type == "text" and full.content[0].text
    with a.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == full.content[0].text
    assert final.usage.output_tokens == full.usage.output_tokens
    # input_tokens plus cache_read_input_tokens is the whole prompt (tests/engine/test_prefix_cache.py tests the split)
    prompt = full.usage.input_tokens + (full.usage.cache_read_input_tokens or 0)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt > 0
    assert final.usage.cache_read_input_tokens == 0  # the shared model server runs without the prefix cache
    assert final.stop_reason == full.stop_reason
    assert full.stop_reason in ("end_turn", "max_tokens")
    if full.stop_reason == "max_tokens":
        assert full.usage.output_tokens == 24


def test_openai_sdk_stream_equals_non_stream(sdk_clients):
    _, o = sdk_clients
    kwargs = dict(model="anything", max_tokens=24, temperature=0, messages=[{"role": "user", "content": PROMPT}])
    full = o.chat.completions.create(**kwargs)
    text = full.choices[0].message.content
    assert text
    chunks = list(o.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    # without include_usage there is no usage chunk
    chunks = list(o.chat.completions.create(stream=True, **kwargs))
    assert all(c.choices for c in chunks)


def test_openai_sdk_stop_sequence_split_across_tokens_does_not_leak(sdk_clients):
    """C7 on the real model: stop on a string that spans a token boundary of the greedy reply."""
    _, o = sdk_clients
    kwargs = dict(model="m", max_tokens=32, temperature=0, messages=[{"role": "user", "content": PROMPT}])
    text = o.chat.completions.create(**kwargs).choices[0].message.content
    words = text.split(" ")
    assert len(words) >= 4, text
    # two whole words from the middle: the match necessarily spans at least one token boundary
    stop = " ".join(words[2:4])
    expected = text[: text.index(stop)]
    chunks = list(o.chat.completions.create(stream=True, stop=[stop], **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_anthropic_stop_sequence_is_reported(sdk_clients):
    a, _ = sdk_clients
    kwargs = dict(model="m", max_tokens=32, extra_body=GREEDY, messages=[{"role": "user", "content": PROMPT}])
    text = a.messages.create(**kwargs).content[0].text
    words = text.split(" ")
    stop = " ".join(words[1:3])
    msg = a.messages.create(stop_sequences=[stop], **kwargs)
    assert msg.content[0].text == text[: text.index(stop)]
    assert msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == stop


def test_unicode_round_trip_has_no_replacement_characters(sdk_clients):
    """C6 on the real model: emoji, flags, CJK, Cyrillic; stream equals non-stream, no U+FFFD."""
    a, _ = sdk_clients
    kwargs = dict(
        model="m", max_tokens=40, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Repeat exactly: 👍🏽 你好 🇯🇵 Привет ½"}],
    )
    full = a.messages.create(**kwargs).content[0].text
    with a.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
    assert "\ufffd" not in streamed
    assert streamed == full
    assert any(ord(ch) > 0x2000 for ch in streamed), streamed  # the model really produced multi-byte text


def test_sdk_errors_are_raised_for_bad_requests(sdk_clients):
    a, o = sdk_clients
    with pytest.raises(anthropic.BadRequestError) as info:
        a.messages.create(model="m", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        o.chat.completions.create(model="m", max_tokens=2_000_000, messages=[{"role": "user", "content": "x"}])


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_both_surfaces(model_server):
    body = json.dumps({"model": "m", "max_tokens": 8, "stream": True, "temperature": 0,
                       "messages": [{"role": "user", "content": PROMPT}]})
    for path, last in (("/v1/messages", "message_stop"), ("/v1/chat/completions", "[DONE]")):
        out = subprocess.run(
            ["curl", "-sSN", "--max-time", "60", model_server.url + path, "-H", "content-type: application/json", "-d", body],
            capture_output=True, check=True, timeout=90,
        ).stdout
        events = SSEParser().feed(out)
        assert events, out
        assert last in (events[-1].event, events[-1].data)


def test_anthropic_assistant_prefill_is_continued(sdk_clients):
    a, _ = sdk_clients
    msg = a.messages.create(
        model="m", max_tokens=12, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."},
                  {"role": "assistant", "content": "1, 2, 3, 4,"}],
    )
    # the reply continues the prefill (and, as Anthropic's API does, does not repeat it)
    assert msg.content[0].text.lstrip().startswith("5"), msg.content[0].text


def test_seeded_sampling_is_reproducible(sdk_clients):
    _, o = sdk_clients
    kwargs = dict(model="m", max_tokens=16, temperature=0.9, seed=1234, messages=[{"role": "user", "content": PROMPT}])
    first = o.chat.completions.create(**kwargs).choices[0].message.content
    assert first == o.chat.completions.create(**kwargs).choices[0].message.content


def _check_logprobs(logprobs, text: str, n_top: int) -> None:
    """Greedy: each token is its position's most likely, with the same value; the alternatives
    sum to at most 1, most likely first; the tokens' bytes are the text's."""
    assert logprobs and b"".join(bytes(lp.bytes) for lp in logprobs) == text.encode()
    for lp in logprobs:
        values = [t.logprob for t in lp.top_logprobs]
        assert len(values) == n_top and values == sorted(values, reverse=True)
        assert lp.logprob <= 0 and sum(math.exp(v) for v in values) <= 1.0
        assert (lp.top_logprobs[0].token, lp.top_logprobs[0].logprob) == (lp.token, lp.logprob)


def test_openai_sdk_chat_logprobs_stream_and_not(sdk_clients):
    """Issue 40: ``logprobs`` + ``top_logprobs`` on the real model, through the SDK's types."""
    _, o = sdk_clients
    kwargs = dict(model="m", max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                  messages=[{"role": "user", "content": PROMPT}])
    full = o.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    _check_logprobs(content, full.choices[0].message.content, 3)
    chunks = list(o.chat.completions.create(stream=True, **kwargs))
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert [(lp.token, lp.bytes) for lp in streamed] == [(lp.token, lp.bytes) for lp in content]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in content], abs=1e-4)
    plain = o.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == full.choices[0].message.content


def test_openai_sdk_responses_logprobs_stream_and_not(sdk_clients):
    _, o = sdk_clients
    kwargs = dict(model="m", input=PROMPT, max_output_tokens=8, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"])
    plain = o.responses.create(**kwargs)
    part = plain.output[0].content[0]
    _check_logprobs(part.logprobs, part.text, 2)
    assert plain.top_logprobs == 2
    events = list(o.responses.create(stream=True, **kwargs))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in deltas] == [lp.token for lp in done.logprobs] == [lp.token for lp in part.logprobs]
    assert [lp.logprob for lp in deltas] == pytest.approx([lp.logprob for lp in part.logprobs], abs=1e-4)
    assert [lp.token for lp in events[-1].response.output[0].content[0].logprobs] == [lp.token for lp in deltas]
