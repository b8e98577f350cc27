"""Replies cut by max_tokens on the real model never end in U+FFFD (issue 12).

Greedy decoding of an emoji and CJK prompt for max_tokens 1..12, on both
surfaces, streamed and not: the SDKs' texts agree, none has U+FFFD, and the
answer for N tokens is a prefix of the answer for N + 1. The bundled model
spells an emoji in several byte tokens, so many of these N cut a character:
its reply opens with 👍🏽 in six tokens (N = 1, 2, 4 and 5 cut it), then
plain words, so 12 reaches six tokens past the last character that can be cut.

The 48 requests go four at a time, so the shared server's four slots decode
them in one batch (greedy output does not depend on the batch on this build:
tests/engine/test_runner_llama.py and tests/engine/test_engine_llama.py check it).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

pytestmark = pytest.mark.model

PROMPT = "Repeat exactly: 👍🏽 你好 🇯🇵 Привет 😀"
MESSAGES = [{"role": "user", "content": PROMPT}]
SWEEP = range(1, 13)
MODES = ("anthropic", "anthropic stream", "openai", "openai stream")


def _answer(a: anthropic.Anthropic, o: openai.OpenAI, mode: str, n: int) -> tuple[str, str, int]:
    """(text, stop reason, output tokens) of one surface and mode for max_tokens ``n``."""
    match mode:
        case "anthropic":
            full = a.messages.create(model="m", max_tokens=n, messages=MESSAGES, extra_body={"temperature": 0})
            return full.content[0].text, full.stop_reason, full.usage.output_tokens
        case "anthropic stream":
            with a.messages.stream(model="m", max_tokens=n, messages=MESSAGES, extra_body={"temperature": 0}) as stream:
                text = "".join(stream.text_stream)
                final = stream.get_final_message()
            return text, final.stop_reason, final.usage.output_tokens
        case "openai":
            done = o.chat.completions.create(model="m", max_tokens=n, temperature=0, messages=MESSAGES)
            return done.choices[0].message.content, done.choices[0].finish_reason, done.usage.completion_tokens
        case "openai stream":
            chunks = list(o.chat.completions.create(model="m", max_tokens=n, temperature=0, messages=MESSAGES,
                                                    stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
            return text, finish, chunks[-1].usage.completion_tokens
    raise AssertionError(mode)


def test_max_tokens_sweep_never_cuts_a_character(model_server):
    a = anthropic.Anthropic(base_url=model_server.url, api_key="unused", max_retries=0)
    o = openai.OpenAI(base_url=model_server.url + "/v1", api_key="unused", max_retries=0)
    with ThreadPoolExecutor(4) as pool:  # the shared server's 4 slots
        futures = {(n, mode): pool.submit(_answer, a, o, mode, n) for n in SWEEP for mode in MODES}
        results = {key: future.result() for key, future in futures.items()}
    previous = ""
    cut = 0
    for n in SWEEP:
        answers = {mode: results[n, mode] for mode in MODES}
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
