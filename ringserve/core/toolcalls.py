"""Tool calls as the model writes them: the call syntax, the prompt that teaches it, the parser.

The bundled model's chat template (and llama.cpp's ``llama_chat_apply_template``)
has no tools, so tools are rendered in one generic format, after the Hermes /
Qwen ``<tool_call>`` format of llama.cpp's ``common/chat.cpp``. One call is::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several calls are such blocks one after another, separated by a newline.

Prompt (:func:`plain_messages`): the tool definitions, one JSON line each
(``name``, ``description``, ``parameters``: the schema), and how to call them
(:data:`TOOLS_PROMPT`) are appended to the system prompt (a system turn is
added when there is none); an assistant turn's ``tool_calls`` follow its text
in the call syntax above; a ``tool`` turn (consecutive ones together) becomes a
user turn of ``<tool_response>`` blocks, each a JSON object with the
``call_id``, the tool's ``name`` (from the call it answers), ``is_error`` when
set, and the ``content``. With ``ToolChoice NONE`` the tools are not rendered
at all: the prompt is the one without tools, and the reply is not parsed.

Parser (:class:`ToolCallParser`): fed the detokenized text, it gives
:class:`Text`, :class:`CallStart`, :class:`CallArgs` and :class:`CallEnd`
pieces. Text that may be the start of ``<tool_call>`` is held back, as
``core/stop.py`` holds back stop strings, so the markers and the JSON wrapper
never reach the text. A call's ``arguments`` object is released as it is
decoded (each feed gives the arguments' new characters), checked with
``json.loads`` when its closing brace arrives. Whitespace after a call is
dropped. A call the parser cannot read (no ``{"name": ..., "arguments": {``
head, a name that is not one of the tools, arguments that are not a JSON
object, no ``</tool_call>`` after them) raises :class:`ToolCallError`: the
runner ends the message with a failure, as the arguments streamed so far
cannot be taken back. Under a grammar (a forced tool) this cannot happen; with
``auto`` the model writes freely and it can.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Protocol

import attrs

from ringserve.core.events import ChatMessage, Role, ToolChoice, ToolChoiceMode, ToolSpec

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "CallArgs",
    "CallEnd",
    "CallStart",
    "JsonScan",
    "OPEN_MARK",
    "OutputParser",
    "Piece",
    "PlainText",
    "Reasoning",
    "Text",
    "ToolCallError",
    "ToolCallParser",
    "format_call",
    "plain_messages",
]

OPEN_MARK = "<tool_call>"
CLOSE_MARK = "</tool_call>"
CALL_OPEN = OPEN_MARK + "\n"
"""What a call starts with (the grammar's literal; the parser accepts any whitespace after the marker)."""
CALL_CLOSE = "\n" + CLOSE_MARK
"""What a call ends with, after its JSON object."""

TOOLS_PROMPT = """You can call tools. Each tool is one JSON line below: its name, its description and the JSON schema of its arguments.
{tools}

To call a tool, write exactly
<tool_call>
{{"name": "<tool name>", "arguments": <the arguments, a JSON object>}}
</tool_call>
{how}The results come back in a user turn, one block per call:
<tool_response>
{{"call_id": "<id>", "name": "<tool name>", "content": "<the result>"}}
</tool_response>"""
"""The tools part of the system prompt (``{tools}``: the definitions; ``{how}``: per tool choice)."""

_HOW = {
    ToolChoiceMode.AUTO: "Call a tool only when it helps to answer; otherwise answer in plain text.",
    ToolChoiceMode.REQUIRED: "Answer now with tool calls only.",
    ToolChoiceMode.NAMED: "Answer now with a call of the tool {name} only.",
}


def format_call(name: str, arguments: str) -> str:
    """One call in the call syntax; ``arguments`` is the JSON text of an object."""
    return f"{CALL_OPEN}{{{json.dumps('name')}: {json.dumps(name)}, {json.dumps('arguments')}: {arguments}}}{CALL_CLOSE}"


def _tools_prompt(tools: Sequence[ToolSpec], choice: ToolChoice) -> str:
    lines = [
        json.dumps({"name": t.name, "description": t.description, "parameters": json.loads(t.parameters)})
        for t in tools
    ]
    how = _HOW[choice.mode].format(name=choice.name)
    if not choice.parallel:
        how += " Make at most one call."
    return TOOLS_PROMPT.format(tools="\n".join(lines), how=how + "\n")


def plain_messages(
    messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = (), choice: ToolChoice = ToolChoice()
) -> tuple[ChatMessage, ...]:
    """The conversation with tools rendered as text: only ``system``, ``user`` and
    ``assistant`` turns with ``content``, and an assistant turn's ``reasoning`` (the module
    docstring gives the format).

    Raises:
        ValueError: an assistant call's ``arguments`` or a tool's schema is not
            JSON (the runner answers it with a 400 naming ``messages``).
    """
    names = {c.call_id: c.name for m in messages for c in m.tool_calls}
    out: list[ChatMessage] = []
    for m in messages:
        match m.role:
            case Role.TOOL:
                result: dict[str, object] = {"call_id": m.tool_call_id, "name": names.get(m.tool_call_id, "")}
                if m.is_error:
                    result["is_error"] = True
                result["content"] = m.content
                block = f"<tool_response>\n{json.dumps(result)}\n</tool_response>"
                if out and out[-1].role is Role.USER and out[-1].content.endswith("</tool_response>"):
                    out[-1] = ChatMessage(Role.USER, f"{out[-1].content}\n{block}")
                else:
                    out.append(ChatMessage(Role.USER, block))
            case Role.ASSISTANT if m.tool_calls:
                calls = []
                for c in m.tool_calls:
                    try:
                        arguments = json.dumps(json.loads(c.arguments))
                    except ValueError:
                        raise ValueError(f"the arguments of tool call {c.call_id!r} are not JSON") from None
                    calls.append(format_call(c.name, arguments))
                text = "\n".join(calls)
                out.append(ChatMessage(Role.ASSISTANT, f"{m.content}\n{text}" if m.content else text,
                                       reasoning=m.reasoning))
            case _:
                out.append(ChatMessage(m.role, m.content, reasoning=m.reasoning))
    if tools and choice.mode is not ToolChoiceMode.NONE:
        prompt = _tools_prompt(tools, choice)
        if out and out[0].role is Role.SYSTEM:
            out[0] = ChatMessage(Role.SYSTEM, f"{out[0].content}\n\n{prompt}" if out[0].content else prompt)
        else:
            out.insert(0, ChatMessage(Role.SYSTEM, prompt))
    return tuple(out)


@attrs.frozen
class Text:
    """Text of the reply outside any call."""

    text: str


@attrs.frozen
class CallStart:
    """A call of tool ``name`` begins."""

    name: str


@attrs.frozen
class CallArgs:
    """More of the open call's arguments (JSON text; the fragments join to one object)."""

    text: str


@attrs.frozen
class CallEnd:
    """The open call is complete: its arguments parsed as a JSON object."""


@attrs.frozen
class Reasoning:
    """Text of the reply's thinking block (its markers removed)."""

    text: str


Piece = Text | Reasoning | CallStart | CallArgs | CallEnd
"""What an output parser gives: text, reasoning, and the tool calls as a start (the tool's
name), fragments of the arguments' JSON text (their concatenation is one JSON object) and an
end."""


class OutputParser(Protocol):
    """Splits one reply's streamed text into :data:`Piece` values, in order (a model family's
    parser: ``ringserve/formats``; :class:`ToolCallParser` is the generic format's). No marker
    ever reaches a piece: text that may be the start of one is held back until it is decided."""

    @property
    def in_call(self) -> bool:
        """A call's opening marker was seen and the call is not complete."""

    @property
    def in_reasoning(self) -> bool:
        """The reply is inside its thinking block (its end marker not seen yet)."""

    def feed(self, text: str) -> list[Piece]:
        """Add decoded text; return the pieces it completes, in order.

        Raises:
            ToolCallError: a call that cannot be read.
        """

    def flush(self) -> list[Piece]:
        """End of the reply: release held text (a call that is not complete stays so:
        :attr:`in_call` tells; a closing marker cut after a complete call is dropped). No
        more feeds.

        Raises:
            ToolCallError: text outside any call that breaks the syntax (a section of calls
                that goes on with other text).
        """


@attrs.define
class JsonScan:
    """Where the text of a JSON object, array or string stands as it streams in: the bracket
    depth, inside a string, after a backslash (the parsers of ``ringserve/formats`` share it)."""

    depth: int = 0
    in_string: bool = False
    escape: bool = False

    def end(self, text: str) -> int | None:
        """Scan ``text``, the value's next part; the index just after the value's last
        character when it ends in ``text``, else None (the state then covers ``text``)."""
        depth, in_string, escape = self.depth, self.in_string, self.escape
        end = None
        for i, c in enumerate(text):
            if in_string:
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                elif c == '"':
                    in_string = False
                    if depth == 0:
                        end = i + 1
                        break
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    end = i + 1
                    break
        self.depth, self.in_string, self.escape = depth, in_string, escape
        return end


@attrs.define(eq=False)
class PlainText:
    """The :class:`OutputParser` of a reply that is text as it comes (the generic format
    without tools: no markers to read)."""

    @property
    def in_call(self) -> bool:
        return False

    @property
    def in_reasoning(self) -> bool:
        return False

    def feed(self, text: str) -> list[Piece]:
        return [Text(text)] if text else []

    def flush(self) -> list[Piece]:
        return []


class ToolCallError(Exception):
    """The model wrote a tool call the parser cannot read (the message says how)."""


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*" + re.escape(CLOSE_MARK))
_HEAD_LIMIT = 64
"""Characters a call's head may take beyond the longest tool name's JSON (whitespace, keys)."""


class _State:
    TEXT = 0
    HEAD = 1
    ARGS = 2
    TAIL = 3


@attrs.define(eq=False)
class ToolCallParser:
    """Splits streamed model text into text and tool calls (see the module docstring).

    Args:
        names: the tools the model may call.

    Cost per :meth:`feed`: linear in the new text plus the held text (the
    held text is shorter than ``<tool_call>`` or than a call's head).
    """

    names: frozenset[str]
    _state: int = attrs.field(init=False, default=_State.TEXT)
    _buf: str = attrs.field(init=False, default="")
    _args: list[str] = attrs.field(init=False, factory=list)
    _scan: JsonScan = attrs.field(init=False, factory=lambda: JsonScan())
    _after_call: bool = attrs.field(init=False, default=False)
    _head_limit: int = attrs.field(init=False, default=0)
    calls: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._head_limit = max((len(json.dumps(n)) for n in self.names), default=0) + _HEAD_LIMIT

    @property
    def in_call(self) -> bool:
        """A call has begun (its marker was seen) and is not complete."""
        return self._state != _State.TEXT

    @property
    def in_reasoning(self) -> bool:
        """Never: the generic format has no thinking block."""
        return False

    @property
    def in_arguments(self) -> bool:
        """A :class:`CallStart` was given and its :class:`CallEnd` not yet."""
        return self._state in (_State.ARGS, _State.TAIL)

    def feed(self, text: str) -> list[Piece]:
        """Add decoded text; return the pieces it completes, in order.

        Raises:
            ToolCallError: a call that cannot be read.
        """
        out: list[Piece] = []
        self._buf += text
        while self._buf:
            before = (self._state, len(self._buf))
            match self._state:
                case _State.TEXT:
                    self._text(out)
                case _State.HEAD:
                    self._head(out)
                case _State.ARGS:
                    self._arguments(out)
                case _State.TAIL:
                    self._tail(out)
            if (self._state, len(self._buf)) == before:
                break  # waiting for more text
        return out

    def flush(self) -> list[Piece]:
        """End of the reply: release held text. Pieces of a call that is not complete are
        not completed (:attr:`in_call` tells); no more feeds."""
        if self._state == _State.TEXT and self._buf:
            held, self._buf = self._buf, ""
            return [Text(held)]
        return []

    def _text(self, out: list[Piece]) -> None:
        buf = self._buf
        if self._after_call:
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return
            self._after_call = False
        i = buf.find(OPEN_MARK)
        if i >= 0:
            if i:
                out.append(Text(buf[:i]))
            self._buf = buf[i + len(OPEN_MARK) :]
            self._state = _State.HEAD
            return
        keep = 0
        for k in range(min(len(buf), len(OPEN_MARK) - 1), 0, -1):
            if OPEN_MARK.startswith(buf[-k:]):
                keep = k
                break
        if len(buf) > keep:
            out.append(Text(buf[: len(buf) - keep]))
        self._buf = buf[len(buf) - keep :]

    def _head(self, out: list[Piece]) -> None:
        m = _HEAD.match(self._buf)
        if m is None or m.end() == len(self._buf):
            # No head yet, or its trailing whitespace may go on: wait, within bounds.
            if len(self._buf) > self._head_limit or CLOSE_MARK in self._buf:
                raise ToolCallError(f"a tool call does not start with a name and arguments: {self._buf[:80]!r}")
            return
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            raise ToolCallError(f"a tool call's name is not a JSON string: {m.group(1)!r}") from None
        if name not in self.names:
            raise ToolCallError(f"the model called {name!r}, which is not one of the request's tools")
        if self._buf[m.end()] != "{":
            raise ToolCallError(f"the arguments of a call of {name!r} are not a JSON object")
        self._buf = self._buf[m.end() :]
        self._state = _State.ARGS
        self._args = []
        self._scan = JsonScan()
        out.append(CallStart(name))

    def _arguments(self, out: list[Piece]) -> None:
        buf = self._buf
        end = self._scan.end(buf)
        piece = buf if end is None else buf[:end]
        self._args.append(piece)
        if piece:
            out.append(CallArgs(piece))
        self._buf = "" if end is None else buf[end:]
        if end is not None:
            try:
                value = json.loads("".join(self._args))
            except ValueError as exc:
                raise ToolCallError(f"a tool call's arguments are not JSON ({exc})") from None
            if not isinstance(value, dict):  # pragma: no cover - it starts with "{" and ends at its "}"
                raise ToolCallError("a tool call's arguments are not a JSON object")
            self._state = _State.TAIL

    def _tail(self, out: list[Piece]) -> None:
        m = _TAIL.match(self._buf)
        if m is None:
            stripped = self._buf.lstrip()
            rest = stripped[1:].lstrip() if stripped.startswith("}") else stripped
            if not (stripped == "" or (stripped.startswith("}") and CLOSE_MARK.startswith(rest))):
                raise ToolCallError(f"a tool call does not end with '}}{CLOSE_MARK}': {self._buf[:80]!r}")
            return
        self._buf = self._buf[m.end() :]
        self._state = _State.TEXT
        self._after_call = True
        self.calls += 1
        out.append(CallEnd())
