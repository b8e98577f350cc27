"""core/toolcalls.py and core/reply.py: the call syntax, the prompt, the parser and the block stage."""

from __future__ import annotations

import itertools
import json

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ChatMessage,
    StopReason,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from ringserve.core.reply import End, ReplyStage
from ringserve.core.toolcalls import (
    TOOLS_PROMPT,
    CallArgs,
    CallEnd,
    CallStart,
    Piece,
    Reasoning,
    Text,
    ToolCallError,
    ToolCallParser,
    format_call,
    plain_messages,
)
from ringserve.engine.fake import FakeEngine
from tests.support.helpers import prompt_tokens

NAMES = frozenset({"get_weather", "get_time"})
CALL = format_call("get_weather", '{"city": "Pa\\"ris }", "n": [1, {"x": "]"}]}')
TEXT = "Sure <tool? <tool_cal not a call. "
REPLY = TEXT + CALL + "\n" + format_call("get_time", "{}") + "\n  after"


def parse(chunks: list[str]) -> list[object]:
    parser = ToolCallParser(NAMES)
    out: list[object] = []
    for chunk in chunks:
        out += parser.feed(chunk)
    out += parser.flush()
    return out


def merged(pieces: list[object]) -> list[object]:
    """Adjacent Text and CallArgs pieces joined: what any split of the same text must give."""
    out: list[object] = []
    for p in pieces:
        if out and type(p) is type(out[-1]) and isinstance(p, Text | CallArgs):
            out[-1] = type(p)(out[-1].text + p.text)
        else:
            out.append(p)
    return out


EXPECTED = [
    Text(TEXT),
    CallStart("get_weather"),
    CallArgs('{"city": "Pa\\"ris }", "n": [1, {"x": "]"}]}'),
    CallEnd(),
    CallStart("get_time"),
    CallArgs("{}"),
    CallEnd(),
    Text("after"),
]


def test_whole() -> None:
    assert merged(parse([REPLY])) == EXPECTED


@pytest.mark.parametrize("cut", range(1, len(REPLY)))
def test_split_at_every_position(cut: int) -> None:
    assert merged(parse([REPLY[:cut], REPLY[cut:]])) == EXPECTED


def test_one_character_at_a_time_streams_the_arguments() -> None:
    pieces = parse(list(REPLY))
    assert merged(pieces) == EXPECTED
    assert sum(isinstance(p, CallArgs) for p in pieces) > 10


def test_markers_never_leak_while_held() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed("Hi <tool_c") == [Text("Hi ")]
    assert parser.feed("all>") == []
    assert parser.in_call and not parser.in_arguments
    assert parser.feed('\n{"name": "get_time", "arguments": {"a"') == [CallStart("get_time"), CallArgs('{"a"')]
    assert parser.in_arguments


def test_a_held_prefix_is_text_at_the_end() -> None:
    assert parse(["x <tool_ca"]) == [Text("x "), Text("<tool_ca")]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(REPLY)), max_size=12))
def test_any_split_gives_the_same_pieces(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    chunks = [REPLY[a:b] for a, b in itertools.pairwise([0, *points, len(REPLY)]) if b > a]
    assert merged(parse(chunks)) == EXPECTED


@settings(max_examples=100, deadline=None)
@given(
    st.text(alphabet=st.sampled_from("ab <>/_toolcal\n{}\""), max_size=40),
    st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=6), st.booleans()), max_size=3),
    st.integers(min_value=1, max_value=7),
)
def test_random_text_and_arguments(text: str, arguments: dict[str, object], step: int) -> None:
    if "<tool_call>" in text:
        return
    args = json.dumps(arguments)
    reply = text + format_call("get_time", args)
    chunks = [reply[i : i + step] for i in range(0, len(reply), step)]
    pieces = merged(parse(chunks))
    expected: list[object] = [CallStart("get_time"), CallArgs(args), CallEnd()]
    assert pieces == ([Text(text)] if text else []) + expected


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ('<tool_call>\n{"name": "nope", "arguments": {}}', "not one of the request's tools"),
        ('<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>', "does not start with a name"),
        ('<tool_call>\n{"name": "get_time", "arguments": [1]}', "are not a JSON object"),
        ('<tool_call>\n{"name": "get_time", "arguments": {"a": tru}}', "arguments are not JSON"),
        ('<tool_call>\n{"name": "get_time", "arguments": {}} trailing', "does not end with"),
        ("<tool_call>" + "x" * 200, "does not start with a name"),
    ],
)
def test_malformed_calls_raise(reply: str, message: str) -> None:
    with pytest.raises(ToolCallError, match=message):
        parse([reply])


def stage_run(stage: ReplyStage, chunks: list[str], reason: StopReason = StopReason.END) -> tuple[list[object], End]:
    events: list[object] = []
    for chunk in chunks:
        stage.sampled()
        out, end = stage.feed(chunk)
        events += out
        if end is not None:
            return events, end
    out, end = stage.finish(reason)
    return events + out, end


def ids() -> ReplyStage:
    counter = itertools.count()
    return ReplyStage((), ToolCallParser(NAMES), new_id=lambda: f"id{next(counter)}")


def test_stage_numbers_blocks_and_ends_with_tool_use() -> None:
    events, end = stage_run(ids(), [REPLY])
    assert end == End(StopReason.TOOL_USE)
    assert [e for e in events if not isinstance(e, BlockDelta)] == [
        BlockStart(0, BlockKind.TEXT),
        BlockStop(0),
        BlockStart(1, BlockKind.TOOL_CALL, "get_weather", "id0"),
        BlockStop(1),
        BlockStart(2, BlockKind.TOOL_CALL, "get_time", "id1"),
        BlockStop(2),
        BlockStart(3, BlockKind.TEXT),
        BlockStop(3),
    ]


def test_stage_without_tools_is_text_and_stop_strings() -> None:
    events, end = stage_run(ReplyStage(("STOP",)), ["ab", "cS", "TO", "Pnever"])
    assert events == [BlockStart(0, BlockKind.TEXT), BlockDelta(0, "ab", 1), BlockDelta(0, "c", 1), BlockStop(0)]
    assert end == End(StopReason.STOP_SEQUENCE, "STOP")


def test_stop_strings_do_not_apply_inside_arguments() -> None:
    stage = ReplyStage(("Paris",), ToolCallParser(NAMES))
    events, end = stage_run(stage, ["Go ", format_call("get_time", '{"city": "Paris"}')])
    assert end == End(StopReason.TOOL_USE)
    assert "".join(e.text for e in events if isinstance(e, BlockDelta) and e.index == 1) == '{"city": "Paris"}'


def test_held_stop_prefix_before_a_call_is_text() -> None:
    stage = ReplyStage(("ok!",), ToolCallParser(NAMES))
    events, _ = stage_run(stage, ["so ok", format_call("get_time", "{}")])
    assert [e for e in events if isinstance(e, BlockDelta) and e.index == 0] == [
        BlockDelta(0, "so ", 1),
        BlockDelta(0, "ok", 1),
    ]


def test_empty_reply_is_one_empty_text_block() -> None:
    assert stage_run(ReplyStage(), []) == ([BlockStart(0, BlockKind.TEXT), BlockStop(0)], End(StopReason.END))


def test_budget_inside_a_call_stops_the_block() -> None:
    events, end = stage_run(ids(), ['<tool_call>{"name": "get_time", "arguments": {"a"'], StopReason.MAX_TOKENS)
    assert end == End(StopReason.MAX_TOKENS)
    assert events[-1] == BlockStop(0)


def test_budget_inside_a_call_head_emits_nothing() -> None:
    events, end = stage_run(ids(), ['<tool_call>{"name": "get_t'], StopReason.MAX_TOKENS)
    assert events == [BlockStart(0, BlockKind.TEXT), BlockStop(0)] and end == End(StopReason.MAX_TOKENS)


def test_budget_inside_the_marker_of_a_forced_call_emits_no_marker_text() -> None:
    forced = ReplyStage((), ToolCallParser(NAMES), forced=True)
    events, end = stage_run(forced, ["<tool_c"], StopReason.MAX_TOKENS)
    assert events == [BlockStart(0, BlockKind.TEXT), BlockStop(0)] and end == End(StopReason.MAX_TOKENS)
    # Free (auto) text that happens to end like the marker is text.
    events, _ = stage_run(ReplyStage((), ToolCallParser(NAMES)), ["<tool_c"], StopReason.MAX_TOKENS)
    assert BlockDelta(0, "<tool_c", 1) in events


def test_not_parallel_ends_after_the_first_call() -> None:
    stage = ReplyStage((), ToolCallParser(NAMES), parallel=False)
    events, end = stage_run(stage, [REPLY])
    assert end == End(StopReason.TOOL_USE)
    assert events[-1] == BlockStop(1) and sum(isinstance(e, BlockStart) for e in events) == 2


@attrs.define
class Scripted:
    """An output parser that gives each feed's pieces from a script (inside the thinking block
    until its first non-reasoning piece), and ``flushed`` at the end."""

    script: list[list[Piece]]
    flushed: list[Piece] = attrs.Factory(list)
    in_reasoning: bool = True
    in_call: bool = False

    def feed(self, text: str) -> list[Piece]:
        pieces = self.script.pop(0)
        if any(not isinstance(p, Reasoning) for p in pieces):
            self.in_reasoning = False
        return pieces

    def flush(self) -> list[Piece]:
        return self.flushed


def test_reasoning_pieces_are_a_reasoning_block_and_their_tokens_count() -> None:
    stage = ReplyStage(("STOP",), Scripted([[Reasoning("Think ")], [Reasoning("STOP")], [Text("Yes.")]]))
    events: list = []
    for _ in range(3):
        stage.sampled()
        out, end = stage.feed("x")
        events += out
        assert end is None  # no stop string inside the reasoning
    out, end = stage.finish(StopReason.END)
    assert events + out == [
        BlockStart(0, BlockKind.REASONING), BlockDelta(0, "Think ", 1), BlockDelta(0, "STOP", 1), BlockStop(0),
        BlockStart(1, BlockKind.TEXT), BlockDelta(1, "Yes.", 1), BlockStop(1),
    ]
    # All three were sampled inside the block: the third's text is what ends it (its closing marker).
    assert stage.reasoning_tokens == 3 and end == End(StopReason.END)


def test_text_held_as_a_stop_prefix_is_released_before_reasoning() -> None:
    stage = ReplyStage(("STOP",), Scripted([[Text("a ST")], [Reasoning("more")]], in_reasoning=False))
    events = stage.feed("x")[0] + stage.feed("y")[0]
    assert events == [BlockStart(0, BlockKind.TEXT), BlockDelta(0, "a ", 0), BlockDelta(0, "ST", 0), BlockStop(0),
                      BlockStart(1, BlockKind.REASONING), BlockDelta(1, "more", 0)]


def test_a_reply_cut_inside_reasoning_stops_its_block_with_what_the_parser_held() -> None:
    stage = ReplyStage((), Scripted([[Reasoning("Half")]], flushed=[Reasoning(" a thought")]))
    events, _ = stage.feed("x")
    out, end = stage.finish(StopReason.MAX_TOKENS)
    assert events + out == [BlockStart(0, BlockKind.REASONING), BlockDelta(0, "Half", 0),
                            BlockDelta(0, " a thought", 0), BlockStop(0)]
    assert end == End(StopReason.MAX_TOKENS)


# -- the prompt ---------------------------------------------------------------------------

WEATHER = ToolSpec("get_weather", "Weather in a city.", '{"type": "object", "properties": {"city": {"type": "string"}}}')


def test_plain_messages_renders_tools_calls_and_results() -> None:
    history = (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather in Paris and Rome?"),
        ChatMessage(
            "assistant",
            "Checking.",
            tool_calls=(
                ToolCall("toolu_1", "get_weather", '{"city":"Paris"}'),
                ToolCall("toolu_2", "get_weather", '{"city": "Rome"}'),
            ),
        ),
        ChatMessage("tool", "18 C", tool_call_id="toolu_1"),
        ChatMessage("tool", "no data", tool_call_id="toolu_2", is_error=True),
    )
    out = plain_messages(history, (WEATHER,))
    assert [m.role for m in out] == ["system", "user", "assistant", "user"]
    assert all(not m.tool_calls for m in out)
    assert out[0].content.startswith("Be brief.\n\nYou can call tools.")
    assert json.dumps({"name": "get_weather", "description": "Weather in a city.", "parameters": json.loads(WEATHER.parameters)}) in out[0].content
    assert "Call a tool only when it helps" in out[0].content
    assert out[2].content == "Checking.\n" + format_call("get_weather", '{"city": "Paris"}') + "\n" + format_call(
        "get_weather", '{"city": "Rome"}'
    )
    assert out[3].content == (
        '<tool_response>\n{"call_id": "toolu_1", "name": "get_weather", "content": "18 C"}\n</tool_response>\n'
        '<tool_response>\n{"call_id": "toolu_2", "name": "get_weather", "is_error": true, "content": "no data"}\n'
        "</tool_response>"
    )


def test_plain_messages_choice_lines_and_none() -> None:
    user = (ChatMessage("user", "hi"),)
    named = plain_messages(user, (WEATHER,), ToolChoice(ToolChoiceMode.NAMED, "get_weather", parallel=False))
    assert named[0].role == "system" and "Answer now with a call of the tool get_weather only. Make at most one call." in named[0].content
    assert "Answer now with tool calls only." in plain_messages(user, (WEATHER,), ToolChoice(ToolChoiceMode.REQUIRED))[0].content
    assert plain_messages(user, (WEATHER,), ToolChoice(ToolChoiceMode.NONE)) == user
    assert plain_messages(user) == user


def test_plain_messages_refuses_non_json_arguments() -> None:
    bad = (ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "get_weather", "{oops"),)),)
    with pytest.raises(ValueError, match="tool call 'c1' are not JSON"):
        plain_messages(bad)


def test_the_prompt_shows_the_call_syntax_it_parses() -> None:
    example = TOOLS_PROMPT.format(tools="", how="")
    shown = example[example.index("<tool_call>") : example.index("</tool_call>") + len("</tool_call>")]
    assert merged(parse([shown.replace("<tool name>", "get_time").replace("<the arguments, a JSON object>", "{}")])) == [
        CallStart("get_time"),
        CallArgs("{}"),
        CallEnd(),
    ]


def test_fake_engine_renders_tool_turns() -> None:
    history = (
        ChatMessage("user", "hi"),
        ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "get_weather", "{}"),)),
        ChatMessage("tool", "sunny", tool_call_id="c1"),
    )
    text = bytes(prompt_tokens(FakeEngine(), history, (WEATHER,))).decode()
    assert text.startswith("<|system|>You can call tools.")
    assert "<|assistant|>" + format_call("get_weather", "{}").split("\n")[0] in text
    assert '<|user|><tool_response>\n{"call_id": "c1", "name": "get_weather", "content": "sunny"}' in text


def test_a_turn_end_text_ends_the_reply_as_its_end_token_does() -> None:
    """The prompt's format ends a turn with text the vocabulary has no token for (ChatML on
    gemma): END, not a stop string; the same text as the request's stop string stays a stop."""
    events, end = stage_run(ReplyStage(turn_ends=("<|im_end|>",)), ["Hi!<|im", "_end|>\n<|im_start|>user"])
    assert events == [BlockStart(0, BlockKind.TEXT), BlockDelta(0, "Hi!", 1), BlockStop(0)]
    assert end == End(StopReason.END)
    _, end = stage_run(ReplyStage(("<|im_end|>",), turn_ends=("<|im_end|>",)), ["Hi!<|im_end|>"])
    assert end == End(StopReason.STOP_SEQUENCE, "<|im_end|>")
