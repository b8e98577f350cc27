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
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Protocol

import attrs

from ringserve.core.events import ToolSpec
from ringserve.core.toolcalls import ToolCallError
from ringserve.formats.base import CallGrammar, ReasoningMarkers, ToolRules, thinking_rules
from ringserve.formats.gbnf import alternatives, literal, raw_text
from ringserve.formats.stream import (
    CoroutineParser,
    Out,
    Stream,
    accept,
    closing,
    cut,
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

    def grammar(self, tools: Sequence[ToolRules], parallel: bool) -> CallGrammar:
        """The GBNF of a unit (see :class:`~ringserve.formats.base.CallGrammar`)."""

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as a unit its :meth:`grammar` takes (:meth:`ChatFormat.write_call
        <ringserve.formats.base.ChatFormat.write_call>`)."""


class InText:
    """A call syntax whose units open only at markers in text (:meth:`CallSyntax.leading`: none)."""

    def leading(self, tools: Tools) -> tuple[str, ...]:
        return ()


def _call(out: Out, tools: Tools, name: str) -> None:
    out.call_start(tools.check(name))


# --- JSON objects ---------------------------------------------------------------------------


@attrs.frozen
class JsonCalls(InText):
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
                    yield from closing(s, "]", "a list of tool calls")
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

    def grammar(self, tools: Sequence[ToolRules], parallel: bool) -> CallGrammar:
        """``{"name": "f", "arguments": {...}}`` (the first of the keys), after ``\\n`` when
        a ``close`` follows (Hermes), in ``[...]`` for an array."""
        if self.name_is_key:
            start = "{"
            alts = [f"{literal(json.dumps(t.name) + ': ')} {t.arguments}" for t in tools]
        else:
            start = "{" + json.dumps(self.name_keys[0]) + ": "
            args = json.dumps(self.args_keys[0])
            alts = [f"{literal(json.dumps(t.name) + ', ' + args + ': ')} {t.arguments}" for t in tools]
        rules = (("fmt-call", f"( {alternatives(alts)} ) {literal('}')}"),)
        if self.array:
            more = f" ( {literal(', ' + start)} fmt-call )*" if parallel else ""
            return CallGrammar(rules, self.opener, f"{self.head}[{start}", f"fmt-call{more} {literal(']' + self.close)}")
        if self.close:
            return CallGrammar(rules, self.opener, f"{self.head}\n{start}", f"fmt-call {literal(chr(10) + self.close)}",
                               repeat=parallel)
        return CallGrammar(rules, self.opener, self.head + start, "fmt-call", separator="", repeat=parallel)

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        if self.name_is_key:
            call = f"{{{json.dumps(name)}: {args}}}"
        else:
            call = f"{{{json.dumps(self.name_keys[0])}: {json.dumps(name)}, {json.dumps(self.args_keys[0])}: {args}}}"
        if self.array:
            return f"{self.opener}{self.head}[{call}]{self.close}"
        if self.close:
            return f"{self.opener}{self.head}\n{call}\n{self.close}"
        return f"{self.opener}{self.head}{call}"


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
class NamedCalls(InText):
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
            elif cut(s, (self.call_open, end)):
                s.pos = len(s.text)
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
            if not (yield from accept(s, marker)) and cut(s, (marker,)):
                s.pos = len(s.text)
                return

    def grammar(self, tools: Sequence[ToolRules], parallel: bool) -> CallGrammar:
        """``call_open [name_prefix] NAME name_end {arguments} close`` (Kimi's index as digits;
        DeepSeek's typed form when ``typed`` is set), in the section when there is one."""
        end = self.name_end[0]
        index = f' {literal(self.id_suffix)} [0-9]+' if self.id_suffix else ""
        alts = []
        for t in tools:
            if self.typed is not None:
                kind, typed_end, typed_close = self.typed
                head = literal(f"{kind}{end}{t.name}\n{typed_end}\n")
                alts.append(f"{head} {t.arguments} {literal(chr(10) + ''.join(typed_close))}")
            else:
                args_open = self.args_open if end != self.args_open else ""
                alts.append(f"{literal(t.name)}{index} {literal(end + args_open)} {t.arguments} "
                            f"{literal(''.join(self.close))}")
        rules = (("fmt-call", alternatives(alts)),)
        if self.section is None:
            return CallGrammar(rules, self.call_open, self.name_prefix, "fmt-call", separator="", repeat=parallel)
        start, stop = self.section
        call = f"{literal(self.call_open + self.name_prefix)} fmt-call"
        more = f" ( {call} )*" if parallel else ""
        return CallGrammar(rules, start, "", f"{call}{more} {literal(stop)}")

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        end = self.name_end[0]
        args = json.dumps(arguments, ensure_ascii=False)
        if self.typed is not None:
            kind, typed_end, typed_close = self.typed
            call = f"{kind}{end}{name}\n{typed_end}\n{args}\n{''.join(typed_close)}"
        else:
            index = f"{self.id_suffix}0" if self.id_suffix else ""
            args_open = self.args_open if end != self.args_open else ""
            call = f"{name}{index}{end}{args_open}{args}{''.join(self.close)}"
        call = self.call_open + self.name_prefix + call
        return call if self.section is None else self.section[0] + call + self.section[1]


# --- a name and each parameter in markup ----------------------------------------------------


@attrs.frozen
class TaggedCalls(InText):
    """Calls whose name and parameters are markup:
    ``call_open [func_open] NAME name_end ( param_open KEY key_end [value_open] VALUE value_close )* func_close close``
    (whitespace allowed between the parts), alone in text or between ``section`` markers.

    Attributes:
        bare_open: a call may also start at ``bare_open`` + a tool's name + ``name_end``,
            without ``call_open`` (Qwen3-Coder's models sometimes leave out ``<tool_call>``).
        type_attr: the key is followed by ``string="true|false"`` (DSML): it says whether the
            value is a string, instead of the schema.
        trim: a value loses one leading and one trailing newline (``>\\nVALUE\\n</parameter>``).
        nl: what the grammar writes between the parts (the parser takes any whitespace).
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
    nl: str = "\n"

    def openers(self, tools: Tools) -> tuple[str, ...]:
        opens: tuple[str, ...] = (self.call_open,) if self.section is None else (self.section[0],)
        if self.bare_open:
            opens += tuple(f"{self.bare_open}{name}{self.name_end[0]}" for name in sorted(tools.names))
        return opens

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
                elif cut(s, (self.call_open, self.section[1])):
                    s.pos = len(s.text)
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
                if cut(s, (self.param_open,)) and s.rest() and not cut(s, closers):
                    raise ToolCallError("the reply ended inside a tool call")  # a parameter's cut marker
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
        """A string value streamed as JSON string text (with ``trim``, its first newline is
        dropped and a trailing newline held back while it may be the one dropped at its end)."""
        out.args('"')
        held = _Held(self.trim)
        yield from self._raw(s, lambda text: out.args(held.take(text)))
        out.args('"')

    def _raw(self, s: Stream, emit: Callable[[str], None]) -> Read:
        marker = yield from until(s, (self.value_close,), emit)
        if marker is None:
            raise ToolCallError("the reply ended inside a parameter's value")

    def grammar(self, tools: Sequence[ToolRules], parallel: bool) -> CallGrammar:
        """Each call on its own lines (``nl``): the name, then the parameters in the schema's
        order (the optional ones may be left out), a string-typed one as raw text that does
        not hold the value's closing marker, another as its JSON value."""
        nl = self.nl
        trim = "\n" if self.trim else ""
        raw = raw_text(trim + self.value_close, "fmt-raw")
        rules: list[tuple[str, str]] = list(raw)
        alts = []
        for i, tool in enumerate(tools):
            params = []
            for p in tool.params:
                if self.type_attr:
                    key = f'{p.name}{self.key_end}{"true" if p.raw else "false"}">'
                else:
                    key = p.name + self.key_end
                value_open = f"{nl}{self.value_open}" if self.value_open else ""
                value = (p.raw_rule or "fmt-raw-0") if p.raw else p.value
                param = f"{literal(self.param_open + key + value_open + trim)} {value} {literal(trim + self.value_close + nl)}"
                params.append(param if p.required else f"( {param} )?")
            rules.append((f"fmt-params{i}", " ".join(params) if params else '""'))
            name = literal(self.func_open + tool.name + self.name_end[0] + (nl if self.name_end[0] != nl else ""))
            alts.append(f"{name} fmt-params{i}")
        end = "".join(m + nl for m in (self.func_close, self.close) if m)
        rules.append(("fmt-call", f"( {alternatives(alts)} ) {literal(end.rstrip(chr(10)) if not self.section else end)}"))
        if self.section is None:
            head = nl if self.func_open else ""
            return CallGrammar(tuple(rules), self.call_open, head, "fmt-call", separator=nl, repeat=parallel)
        start, stop = self.section
        call = f"{literal(self.call_open)} fmt-call"
        more = f" ( {call} )*" if parallel else ""
        return CallGrammar(tuple(rules), start, nl, f"{call}{more} {literal(stop)}")

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        nl = self.nl
        trim = "\n" if self.trim else ""
        parts = [self.func_open + name + self.name_end[0] + (nl if self.name_end[0] != nl else "")]
        for key, value in arguments.items():
            raw = isinstance(value, str)
            text = value if raw else json.dumps(value, ensure_ascii=False)
            tag = f'{key}{self.key_end}{"true" if raw else "false"}">' if self.type_attr else key + self.key_end
            value_open = f"{nl}{self.value_open}" if self.value_open else ""
            parts.append(f"{self.param_open}{tag}{value_open}{trim}{text}{trim}{self.value_close}{nl}")
        end = "".join(m + nl for m in (self.func_close, self.close) if m)
        call = "".join(parts) + (end if self.section else end.rstrip("\n"))
        if self.section is None:
            return self.call_open + (nl if self.func_open else "") + call
        return self.section[0] + nl + self.call_open + call + self.section[1]


@attrs.define
class _Held:
    """The trimming of a streamed string value (see :meth:`TaggedCalls._string_value`)."""

    trim: bool
    start: bool = True
    newline: str = ""

    def take(self, text: str) -> str:
        """The JSON string text to put out for ``text`` ("" while nothing is decided)."""
        if self.trim and self.start:
            self.start = False
            text = text.removeprefix("\n")
            if not text:
                return ""
        text = self.newline + text
        self.newline = ""
        if self.trim and text.endswith("\n"):
            text, self.newline = text[:-1], "\n"
        return json.dumps(text, ensure_ascii=False)[1:-1]


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

    def call_grammar(self, tools: Sequence[ToolRules], parallel: bool) -> CallGrammar:
        if self.calls is None:
            raise NotImplementedError(f"{self.name}: its tool calls are not served")
        grammar = self.calls.grammar(tools, parallel)
        rules, thinking = thinking_rules(self.reasoning)
        return attrs.evolve(grammar, rules=grammar.rules + rules, thinking=thinking)

    def write_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        if self.calls is None:
            raise NotImplementedError(f"{self.name}: its tool calls are not served")
        return self.calls.write(name, arguments)


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
