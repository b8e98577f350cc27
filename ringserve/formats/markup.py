"""Families whose reply is text with marked-up thinking and tool calls (most of them).

A :class:`MarkupFormat` is a thinking block's markers (:class:`~ringserve.formats.base.ReasoningMarkers`)
and one call syntax, of three kinds, after llama.cpp's classification (``docs/autoparser.md``:
JSON_NATIVE, TAG_WITH_JSON, TAG_WITH_TAGGED):

* :class:`JsonCalls`: each call is a JSON object holding the name and the arguments,
  ``{"name": "f", "arguments": {...}}`` (Hermes' ``<tool_call>``, Mistral Nemo's
  ``[TOOL_CALLS][...]``, Llama 3.x, Granite, Command R...);
* :class:`NamedCalls`: the name is markup, the arguments a JSON object
  (``[TOOL_CALLS]f[ARGS]{...}``, ``<function=f>{...}</function>``, Kimi-K2's and DeepSeek's
  special tokens);
* :class:`TaggedCalls`: the name and each parameter are markup, the values raw text
  (Qwen3-Coder's ``<function=f><parameter=k>v</parameter>``, GLM's ``<arg_key>``/``<arg_value>``,
  DeepSeek's DSML, MiniMax's ``<invoke>``); the values become the arguments' JSON as they come,
  typed by the tool's schema (:func:`~ringserve.formats.tools.raw_value`).

The reply is read as llama.cpp's parsers read it: an optional thinking block first (only
there; a start marker later on is text), then text in which a call marker opens a call (or a
section of calls). Unlike llama.cpp, text may follow the calls (it becomes a text block).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator, Sequence
from typing import Protocol

import attrs

from ringserve.core.events import ToolSpec
from ringserve.core.toolcalls import ToolCallError
from ringserve.formats.base import CallGrammar, ReasoningMarkers, ToolRules
from ringserve.formats.gbnf import alternatives, literal, raw_text
from ringserve.formats.stream import (
    CoroutineParser,
    Out,
    Stream,
    accept,
    closing,
    expect,
    json_string,
    json_value,
    peek,
    skip_ws,
    take_until,
    until,
)
from ringserve.formats.tools import Tools, raw_value

__all__ = ["CallSyntax", "JsonCalls", "MarkupFormat", "NamedCalls", "TaggedCalls"]

_NAME_LIMIT = 256
"""Characters a tool's name (or a call id) may take before its end marker."""
_KEY_LIMIT = 256
"""Characters a parameter's name may take."""

Read = Generator[None, None, None]


class CallSyntax(Protocol):
    """How one family writes tool calls."""

    def openers(self, tools: Tools) -> tuple[str, ...]:
        """The markers that open a unit (a call, or a section of calls) in text."""

    def leading(self, tools: Tools) -> tuple[str, ...]:
        """Texts that open a unit only at the start of the answer (after the thinking block),
        kept for the reader (Llama 3's bare JSON call)."""

    def read(self, s: Stream, out: Out, tools: Tools, opener: str) -> Read:
        """Read one unit after its opener (consumed), putting its calls out."""

    def grammar(self, tools: Sequence[ToolRules]) -> CallGrammar:
        """The GBNF of a unit (see :class:`~ringserve.formats.base.CallGrammar`)."""


def _call(out: Out, tools: Tools, name: str) -> None:
    out.call_start(tools.check(name))


# --- JSON objects ---------------------------------------------------------------------------


@attrs.frozen
class JsonCalls:
    """Calls as JSON objects after ``opener``: a JSON array of them (``array``: always), or
    objects one after another up to ``close`` (one object when there is no ``close``).

    The object holds the name under one of ``name_keys`` and the arguments (an object, or a
    string holding one) under one of ``args_keys``, in any order, maybe nested under
    ``"function"``; other keys (``id``, ``type``) are skipped. With ``name_is_key`` the object
    is ``{"NAME": {arguments}}`` instead (Apertus). ``head`` is text that follows the opener
    (Command R+'s calls stand in a Markdown code block: ``Action:`` then ````json``, and
    ````` closes them).
    """

    opener: str
    close: str = ""
    array: bool = False
    name_keys: tuple[str, ...] = ("name",)
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    name_is_key: bool = False
    head: str = ""

    def openers(self, tools: Tools) -> tuple[str, ...]:
        return (self.opener,)

    def leading(self, tools: Tools) -> tuple[str, ...]:
        return ()

    def read(self, s: Stream, out: Out, tools: Tools, opener: str) -> Read:
        out.in_call = True
        if self.head:
            yield from skip_ws(s)
            yield from expect(s, self.head, "a tool call")
        yield from skip_ws(s)
        if self.array or (yield from peek(s, ("[",))):
            yield from expect(s, "[", "a list of tool calls")
            while True:
                yield from skip_ws(s)
                if (yield from accept(s, "]")):
                    break
                out.in_call = True
                yield from self._object(s, out, tools)
                yield from skip_ws(s)
                if not (yield from accept(s, ",")):
                    yield from expect(s, "]", "a list of tool calls")
                    break
        else:
            while True:
                yield from self._object(s, out, tools)
                yield from skip_ws(s)
                if not self.close or not (yield from peek(s, ("{",))):
                    break
                out.in_call = True
        if self.close:
            yield from closing(s, self.close, "a tool call")

    def _object(self, s: Stream, out: Out, tools: Tools) -> Read:
        yield from skip_ws(s)
        yield from expect(s, "{", "a tool call")
        if self.name_is_key:
            name = yield from json_string(s, "a tool call's name")
            _call(out, tools, name)
            yield from skip_ws(s)
            yield from expect(s, ":", "a tool call")
            yield from _json_args(s, out)
        elif not (yield from self._fields(s, out, tools, nested=True)):
            raise ToolCallError("a tool call has no name")
        yield from skip_ws(s)
        yield from expect(s, "}", "a tool call")
        out.call_end()

    def _fields(self, s: Stream, out: Out, tools: Tools, nested: bool) -> Generator[None, None, bool]:
        """The object's fields up to its ``}`` (not consumed); whether it named the tool."""
        named = False
        held: list[str] | None = None  # arguments that came before the name
        while True:
            yield from skip_ws(s)
            if (yield from peek(s, ("}",))):
                break
            key = yield from json_string(s, "a key of a tool call")
            yield from skip_ws(s)
            yield from expect(s, ":", "a tool call")
            if key in self.name_keys and not named:
                name = yield from json_string(s, "a tool call's name")
                _call(out, tools, name)
                named = True
                if held is not None:
                    out.args("".join(held))
            elif key in self.args_keys and not named:
                held = []
                yield from json_value(s, held.append, "a tool call's arguments")
            elif key in self.args_keys:
                yield from _json_args(s, out)
            elif key == "function" and nested and (yield from _starts_object(s)):
                yield from expect(s, "{", "a tool call")
                named = (yield from self._fields(s, out, tools, nested=False)) or named
                yield from expect(s, "}", "a tool call")
            else:
                yield from json_value(s, lambda _text: None, f"a tool call's {key!r}")
            yield from skip_ws(s)
            if not (yield from accept(s, ",")):
                break
        if named and not out.has_args():
            out.args("{}")
        return named

    def grammar(self, tools: Sequence[ToolRules]) -> CallGrammar:
        key = json.dumps(self.name_keys[0])
        args = json.dumps(self.args_keys[0])
        if self.name_is_key:
            alts = [f"{literal(json.dumps(t.name) + ': ')} {t.arguments}" for t in tools]
            one = f"{literal('{')} ( {alternatives(alts)} ) {literal('}')}"
        else:
            alts = [f"{literal(json.dumps(t.name) + ', ' + args + ': ')} {t.arguments}" for t in tools]
            one = f"{literal('{' + key + ': ')} ( {alternatives(alts)} ) {literal('}')}"
        rules = (("call-object", one),)
        body = "call-object"
        head = self.head
        if self.array:
            head = self.head + "["
            body = f'call-object ( ", " call-object )* {literal("]")}'
        if self.close:
            body = f"{body} {literal(self.close)}"
        return CallGrammar(rules, self.opener, head, body)


def _starts_object(s: Stream) -> Generator[None, None, bool]:
    yield from skip_ws(s)
    return (yield from peek(s, ("{",))) is not None


def _json_args(s: Stream, out: Out) -> Read:
    """The arguments: a JSON object streamed as it comes, or a JSON string holding one."""
    yield from skip_ws(s)
    if (yield from peek(s, ('"',))):
        text = yield from json_string(s, "a tool call's arguments")
        out.args(text)
        return
    if not (yield from peek(s, ("{",))):
        raise ToolCallError(f"a tool call's arguments are not a JSON object: {s.rest()[:40]!r}")
    yield from json_value(s, out.args, "a tool call's arguments")


# --- a name in markup, JSON arguments -------------------------------------------------------


@attrs.frozen
class NamedCalls:
    """Calls ``call_open [name_prefix] NAME name_end [args_open] {arguments} [close...]``,
    alone in text or, when ``section`` is set, any number of them between the section's
    markers (a ``call_open`` alone in text also opens a call).

    Attributes:
        call_open: the marker before each call (it ends the previous call when its
            ``close`` is missing).
        name_end: the markers that end the name; ``id_marker``, one of them, is followed by
            a call id up to ``args_open`` (Mistral's ``[CALL_ID]``).
        id_suffix: the name ends with this separator and an index, dropped (Kimi's
            ``functions.f:0``).
        close: markers after the arguments, each optional.
        typed: ``(type, name_end, close)``: when the text before the name's end is ``type``,
            the name comes after it, up to this ``name_end``, and the arguments are followed by
            this ``close`` (DeepSeek R1's ``function<｜tool▁sep｜>NAME\n```json\n{...}\n```
            ``, where V3.1 writes ``NAME<｜tool▁sep｜>{...}``).
    """

    call_open: str
    name_end: tuple[str, ...]
    section: tuple[str, str] | None = None
    name_prefix: str = ""
    id_marker: str = ""
    args_open: str = ""
    id_suffix: str = ""
    close: tuple[str, ...] = ()
    typed: tuple[str, str, tuple[str, ...]] | None = None

    def openers(self, tools: Tools) -> tuple[str, ...]:
        return (self.call_open,) if self.section is None else (self.section[0], self.call_open)

    def leading(self, tools: Tools) -> tuple[str, ...]:
        return ()

    def read(self, s: Stream, out: Out, tools: Tools, opener: str) -> Read:
        if self.section is None or opener == self.call_open:
            yield from self._call(s, out, tools)
            return
        start, end = self.section
        out.in_call = True
        while True:
            yield from skip_ws(s)
            m = yield from peek(s, (self.call_open, end))
            if m == self.call_open:
                s.pos += len(m)
                yield from self._call(s, out, tools)
            elif m == end:
                s.pos += len(m)
                out.in_call = False
                return
            elif s.pos >= len(s.text) and s.ended:
                out.in_call = False
                return
            else:
                raise ToolCallError(f"a section of tool calls goes on with {s.rest()[:40]!r}")

    def _call(self, s: Stream, out: Out, tools: Tools) -> Read:
        out.in_call = True
        if self.name_prefix:
            yield from skip_ws(s)
            yield from expect(s, self.name_prefix, "a tool call")
        name, marker = yield from take_until(s, self.name_end, _NAME_LIMIT, "a tool call's name")
        name = name.strip()
        if self.id_suffix:
            name = re.sub(re.escape(self.id_suffix) + r"\d+$", "", name)
        close = self.close
        if self.typed is not None and name == self.typed[0]:
            name, _ = yield from take_until(s, (self.typed[1],), _NAME_LIMIT, "a tool call's name")
            name, close = name.strip(), self.typed[2]
        if marker == self.id_marker:
            yield from take_until(s, (self.args_open,), _NAME_LIMIT, "a tool call's id")
        elif self.args_open and marker != self.args_open:
            yield from skip_ws(s)
            yield from expect(s, self.args_open, "a tool call")
        _call(out, tools, name)
        yield from _json_args(s, out)
        out.call_end()
        for marker in close:
            yield from skip_ws(s)
            yield from accept(s, marker)

    def grammar(self, tools: Sequence[ToolRules]) -> CallGrammar:
        end = self.name_end[0] if self.name_end[0] != self.id_marker else self.name_end[-1]
        alts = [f"{literal(t.name + end + (self.args_open if end != self.args_open else ''))} {t.arguments}"
                for t in tools]
        one = f"( {alternatives(alts)} )"
        if self.close:
            one += " " + literal("".join(self.close))
        if self.section is None:
            return CallGrammar((), self.call_open, self.name_prefix, one, separator="")
        start, stop = self.section
        call = f"{literal(self.call_open + self.name_prefix)} {one}"
        return CallGrammar((("call", call),), start, "", f"call ( call )* {literal(stop)}", separator="")


# --- a name and each parameter in markup ----------------------------------------------------


@attrs.frozen
class TaggedCalls:
    """Calls whose name and parameters are markup:
    ``call_open [func_open] NAME name_end ( param_open KEY key_end [value_open] VALUE value_close )* func_close close``
    (whitespace allowed between the parts), alone in text or between ``section`` markers.

    Attributes:
        bare_open: a call may also start at ``bare_open`` + a tool's name + ``name_end``,
            without ``call_open`` (Qwen3-Coder's models sometimes leave out ``<tool_call>``).
        type_attr: the key is followed by ``string="true|false"`` (DSML): it says whether the
            value is a string, instead of the schema.
        trim: a value loses one leading and one trailing newline (``>\\nVALUE\\n</parameter>``).
    """

    call_open: str
    name_end: tuple[str, ...]
    param_open: str
    key_end: str
    value_close: str
    func_open: str = ""
    value_open: str = ""
    func_close: str = ""
    close: str = ""
    section: tuple[str, str] | None = None
    bare_open: str = ""
    type_attr: bool = False
    trim: bool = False

    def openers(self, tools: Tools) -> tuple[str, ...]:
        opens = (self.call_open,) if self.section is None else (self.section[0],)
        if self.bare_open:
            opens += tuple(f"{self.bare_open}{name}{self.name_end[0]}" for name in sorted(tools.names))
        return opens

    def leading(self, tools: Tools) -> tuple[str, ...]:
        return ()

    def read(self, s: Stream, out: Out, tools: Tools, opener: str) -> Read:
        if self.section is not None and opener == self.section[0]:
            out.in_call = True
            while True:
                yield from skip_ws(s)
                m = yield from peek(s, (self.call_open, self.section[1]))
                if m == self.call_open:
                    s.pos += len(m)
                    yield from self._call(s, out, tools, None)
                elif m is not None:
                    s.pos += len(m)
                    out.in_call = False
                    return
                elif s.pos >= len(s.text) and s.ended:
                    out.in_call = False
                    return
                else:
                    raise ToolCallError(f"a section of tool calls goes on with {s.rest()[:40]!r}")
        bare = None if opener == self.call_open else opener[len(self.bare_open) : -len(self.name_end[0])]
        yield from self._call(s, out, tools, bare)

    def _call(self, s: Stream, out: Out, tools: Tools, bare: str | None) -> Read:
        """One call after its opener; ``bare``: the name, when the opener held it."""
        out.in_call = True
        if bare is not None:
            name, marker = bare, self.name_end[0]
        else:
            if self.func_open:
                yield from skip_ws(s)
                yield from expect(s, self.func_open, "a tool call")
            name, marker = yield from take_until(s, self.name_end, _NAME_LIMIT, "a tool call's name")
        name = name.strip()
        _call(out, tools, name)
        closers = tuple(m for m in (self.func_close, self.close) if m)
        if marker != self.name_end[0]:  # the name's end is what follows it: a parameter or the close
            s.pos -= len(marker)
        out.args("{")
        first = True
        while True:
            yield from skip_ws(s)
            m = yield from peek(s, (self.param_open, *closers))
            if m != self.param_open:
                break
            s.pos += len(m)
            key, _ = yield from take_until(s, (self.key_end,), _KEY_LIMIT, "a parameter's name")
            types = tools.param_types(name, key)
            if self.type_attr:
                flag, _ = yield from take_until(s, ('">',), 16, "a parameter's type")
                types = frozenset({"string"}) if flag == "true" else frozenset({"object", "array", "number",
                                                                                 "boolean", "null"})
            if self.value_open:
                yield from skip_ws(s)
                yield from expect(s, self.value_open, "a parameter")
            out.args(("" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
            first = False
            yield from self._value(s, out, types)
        out.args("}")
        out.call_end()
        for marker in closers:
            yield from closing(s, marker, "a tool call")

    def _value(self, s: Stream, out: Out, types: frozenset[str]) -> Read:
        if types == frozenset({"string"}):
            yield from self._string_value(s, out)
            return
        parts: list[str] = []
        yield from self._raw(s, parts.append)
        text = "".join(parts)
        if self.trim:
            text = _trim(text)
        out.args(raw_value(text, types))

    def _string_value(self, s: Stream, out: Out) -> Read:
        """A string value streamed as JSON string text (a trailing newline is held back while
        it may be the one ``trim`` drops)."""
        out.args('"')
        state = {"start": True, "held": ""}

        def emit(text: str) -> None:
            if self.trim and state["start"]:
                if text.startswith("\n"):
                    text = text[1:]
                if not text:
                    return
                state["start"] = False
            text = state["held"] + text
            state["held"] = ""
            if self.trim and text.endswith("\n"):
                text, state["held"] = text[:-1], "\n"
            if text:
                out.args(json.dumps(text, ensure_ascii=False)[1:-1])

        yield from self._raw(s, emit)
        out.args('"')

    def _raw(self, s: Stream, emit: Callable[[str], None]) -> Read:
        marker = yield from until(s, (self.value_close,), emit)
        if marker is None:
            raise ToolCallError("the reply ended inside a parameter's value")

    def grammar(self, tools: Sequence[ToolRules]) -> CallGrammar:
        nl = "\n" if self.trim else ""
        rules: list[tuple[str, str]] = []
        alts = []
        for i, tool in enumerate(tools):
            params = []
            for p in tool.params:
                value = raw_text(f"{nl}{self.value_close}") if p.raw else p.value
                if self.type_attr:
                    key = literal(f'{p.name}{self.key_end}{"true" if p.raw else "false"}">')
                else:
                    key = literal(p.name + self.key_end)
                sep = literal(self.value_open) + " " if self.value_open else ""
                params.append(f"{literal(self.param_open)} {key} {sep}{literal(nl)} {value} "
                              f"{literal(nl + self.value_close + chr(10))}")
            name = f"tool{i}-params"
            rules.append((name, f"( {alternatives(params)} )*" if params else '""'))
            alts.append(f"{literal(self.func_open + tool.name + self.name_end[0] + chr(10))} {name}")
        end = "".join(m + "\n" for m in (self.func_close, self.close) if m)
        one = f"( {alternatives(alts)} ) {literal(end)}"
        if self.section is None:
            return CallGrammar(tuple(rules), self.call_open, "\n", one)
        rules.append(("call", f"{literal(self.call_open)} {one}"))
        return CallGrammar(tuple(rules), self.section[0], "\n", f"call ( call )* {literal(self.section[1])}")


def _trim(text: str) -> str:
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    return text


# --- the format -----------------------------------------------------------------------------


@attrs.frozen
class MarkupFormat:
    """A family whose reply is an optional thinking block, then text and calls (see the
    module docstring).

    Attributes:
        calls: the call syntax; None for a family without tool calls in its output.
        calls_end_reasoning: a call's opener inside the thinking block ends it (the model
            went on to call without closing it: Qwen3.5, Kimi-K2, DeepSeek V4, Ling).
        dropped: markers that wrap the answer's text, dropped from it (Command R's
            ``<|START_RESPONSE|>``, Granite's ``<response>``).
    """

    name: str
    reasoning: ReasoningMarkers | None = None
    calls: CallSyntax | None = None
    calls_end_reasoning: bool = False
    dropped: tuple[str, ...] = ()

    def parser(self, tools: Sequence[ToolSpec] | None, *, reasoning_open: bool = False) -> CoroutineParser:
        table = None if tools is None or self.calls is None else Tools.of(tools)

        def read(s: Stream, out: Out) -> Read:
            openers = () if table is None or self.calls is None else self.calls.openers(table)
            if self.reasoning is not None:
                yield from _reasoning(s, out, self.reasoning, reasoning_open,
                                      openers if self.calls_end_reasoning else ())
            lead = () if table is None or self.calls is None else self.calls.leading(table)
            if lead:
                yield from skip_ws(s)
                opener = yield from peek(s, lead)
                if opener is not None:
                    assert table is not None and self.calls is not None
                    yield from self.calls.read(s, out, table, opener)
            while True:
                opener = yield from until(s, openers + self.dropped, out.text)
                if opener is None:
                    return
                if opener in self.dropped:
                    continue
                assert table is not None and self.calls is not None
                out.end_block()
                yield from self.calls.read(s, out, table, opener)

        return CoroutineParser(read)

    def triggers(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        if self.calls is None:
            return ()
        return self.calls.openers(Tools.of(tools))

    def call_grammar(self, tools: Sequence[ToolRules]) -> CallGrammar:
        if self.calls is None:
            raise NotImplementedError(f"{self.name} writes no tool calls")
        return self.calls.grammar(tools)


def _reasoning(s: Stream, out: Out, markers: ReasoningMarkers, opened: bool, openers: tuple[str, ...]) -> Read:
    """The thinking block at the start of the reply (if any), put out as reasoning. A reply
    that starts with the end marker closed a block the prompt opened (the marker is dropped)."""
    if not opened:
        yield from skip_ws(s)
        first = yield from peek(s, (markers.start, markers.end) if markers.start else (markers.end,))
        if first is not None:
            s.pos += len(first)
        opened = first == markers.start and bool(first)
    if not opened:
        return
    out.in_reasoning = True
    end = yield from until(s, (markers.end, *openers), out.reasoning, consume=False)
    if end == markers.end:
        s.pos += len(end)
    out.end_block()
    out.in_reasoning = False
