"""Replies cut by max_tokens on the real model never end in U+FFFD (issue 12).

Greedy decoding of an emoji and CJK prompt for max_tokens 1..24, on both
surfaces, streamed and not: the SDKs' texts agree, none has U+FFFD, and the
answer for N tokens is a prefix of the answer for N + 1. The bundled model
spells an emoji in several byte tokens, so many of these N cut a character.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

pytestmark = pytest.mark.model

PROMPT = "Repeat exactly: 👍🏽 你好 🇯🇵 Привет 😀"
SWEEP = range(1, 25)


def _answers(model_server, n: int) -> dict[str, tuple[str, str, int]]:
    """(text, stop reason, output tokens) per surface and mode for max_tokens ``n``."""
    a = anthropic.Anthropic(base_url=model_server.url, api_key="unused", max_retries=0)
    o = openai.OpenAI(base_url=model_server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    out = {}
    full = a.messages.create(model="m", max_tokens=n, messages=messages, extra_body={"temperature": 0})
    out["anthropic"] = (full.content[0].text, full.stop_reason, full.usage.output_tokens)
    with a.messages.stream(model="m", max_tokens=n, messages=messages, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    out["anthropic stream"] = (text, final.stop_reason, final.usage.output_tokens)
    kwargs = dict(model="m", max_tokens=n, temperature=0, messages=messages)
    done = o.chat.completions.create(**kwargs)
    out["openai"] = (done.choices[0].message.content, done.choices[0].finish_reason, done.usage.completion_tokens)
    chunks = list(o.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    out["openai stream"] = (text, finish, chunks[-1].usage.completion_tokens)
    return out


def test_max_tokens_sweep_never_cuts_a_character(model_server):
    previous = ""
    cut = 0
    for n in SWEEP:
        answers = _answers(model_server, n)
        texts = {text for text, _, _ in answers.values()}
        assert len(texts) == 1, (n, answers)
        text = texts.pop()
        assert "\ufffd" not in text, (n, text)
        assert text.startswith(previous), (n, previous, text)
        ended = {(reason, tokens) for _, reason, tokens in answers.values()}
        if ended <= {("max_tokens", n), ("length", n)}:
            cut += text == previous  # a token that only began a character added no text
        else:  # the reply ended by itself before n tokens
            assert {reason for reason, _ in ended} <= {"end_turn", "stop"}, (n, answers)
            break
        previous = text
    assert cut > 0, "no max_tokens in the sweep cut a character: the test proves nothing"
