"""``surfaces.base.json_template``: a delta event filled in is the event dumped whole, byte for byte."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.core.events import BlockDelta, BlockKind, BlockStart, Usage
from ringserve.surfaces.anthropic import AnthropicRenderer, ThinkingDisplay
from ringserve.surfaces.base import _SLOT, dumps, json_template
from ringserve.surfaces.openai import OpenAIRenderer

SETTINGS = settings(max_examples=300, deadline=None)
TEXT = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(["", '"', "\\", "\x00", _SLOT, "é😀\u2028"])


def chunk(text: str) -> dict[str, Any]:
    return {"id": "x", "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None}], "usage": None}


@SETTINGS
@given(TEXT)
def test_a_filled_template_is_the_document_dumped(text: str) -> None:
    assert json_template(chunk)(text) == dumps(chunk(text))


def test_a_template_must_hold_its_slot() -> None:
    with pytest.raises(ValueError):
        json_template(lambda text: {"a": "fixed"})


@SETTINGS
@given(TEXT)
def test_a_slot_held_twice_takes_the_text_twice(text: str) -> None:
    def both(value: str) -> dict[str, Any]:
        return {"a": value, "b": [value, 1]}

    assert json_template(both)(text) == dumps(both(text))


@SETTINGS
@given(st.booleans(), st.lists(TEXT, min_size=1, max_size=4))
def test_openai_text_deltas_are_the_chunks_dumped(include_usage: bool, texts: list[str]) -> None:
    renderer = OpenAIRenderer("chatcmpl-1", "m", 7, include_usage)
    renderer.start(Usage(3, 0))
    for text in texts:
        [event] = renderer.delta(BlockDelta(0, text))
        assert event.data == dumps(renderer._chunk_object({"content": text}, None))


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 3), TEXT), min_size=1, max_size=6))
def test_anthropic_text_deltas_are_the_events_dumped(deltas: list[tuple[int, str]]) -> None:
    renderer = AnthropicRenderer("msg_1", "m", ThinkingDisplay(None))
    renderer.start(Usage(3, 0))
    for index, text in deltas:
        renderer.block_start(BlockStart(index, BlockKind.TEXT))
        [event] = renderer.delta(BlockDelta(index, text))
        expected = {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}
        assert (event.event, event.data) == ("content_block_delta", dumps(expected))
