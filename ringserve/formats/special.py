"""Families whose replies are not "thinking, then text with marked calls": each has its own reader.

* gpt-oss (:class:`HarmonyFormat`): the Harmony format, a reply of messages on channels
  (``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...``);
  ``analysis`` is reasoning, ``final`` and ``commentary`` without a recipient (preambles) are
  text, a message ``to=functions.NAME`` is a call whose body is the arguments' JSON. After
  llama.cpp's ``common/parsers/gpt-oss.cpp`` and OpenAI's Harmony guide
  (https://cookbook.openai.com/articles/openai-harmony): messages to other recipients (the
  built-in ``browser``/``python``/``container`` tools, which ringserve does not run) are
  dropped, as llama.cpp drops them.
* Functionary v3.2 (:class:`RecipientFormat`): ``>>>RECIPIENT\\nBODY`` segments, ``all`` is
  text, any other recipient a call (``common/parsers/functionary-v3-2.cpp``).
* Llama 3.1-3.3 (:class:`LlamaCalls`): a JSON call ``{"name": ..., "parameters": ...}`` as the
  whole reply, or after ``<|python_tag|>`` (which also takes built-in tools' ``NAME.call(k=v)``
  and raw Python code for a ``python``/``ipython`` tool), per Meta's prompt format
  (https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/).
* Calls that are not JSON, read whole (:class:`WholeCalls`): LFM2's Python
  ``[f(a=1), g(b="x")]`` and Gemma 4's ``<|tool_call>call:f{k:<|"|>v<|"|>}<tool_call|>``.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import attrs

from ringserve.core.events import ToolSpec
from ringserve.core.toolcalls import ToolCallError
from ringserve.formats.base import CallGrammar, ReasoningMarkers, ToolRules, thinking_rules
from ringserve.formats.gbnf import alternatives, literal
from ringserve.formats.markup import InText, JsonCalls, _json_args
from ringserve.formats.stream import CoroutineParser, Out, Stream, accept, peek, skip_ws, take_until, until
from ringserve.formats.tools import Tools

__all__ = ["GEMMA_4", "PYTHONIC", "HarmonyFormat", "LlamaCalls", "RecipientFormat", "WholeCalls"]

Read = Generator[None, None, None]

_HEADER_LIMIT = 512
"""Characters a Harmony message header (channel, recipient, constraint) or a Functionary
recipient may take."""


# --- pythonic calls --------------------------------------------------------------------------


_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}
"""Python's and JSON's constants, which models mix in Python calls (LFM2)."""


def _literal(node: ast.expr) -> object:
    """The value of a Python literal, with JSON's ``true``/``false``/``null`` too.

    Raises:
        ValueError: not a literal.
    """
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
    return ast.literal_eval(node)


def _pythonic(source: str, tools: Tools, out: Out) -> None:
    """Put out the calls of ``source``: a call ``f(k=v, ...)`` or a list of them, whose
    arguments are Python literals.

    Raises:
        ToolCallError: not that.
    """
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        raise ToolCallError(f"tool calls that are not Python calls: {source[:80]!r}") from None
    calls = tree.elts if isinstance(tree, ast.List) else [tree]
    for call in calls:
        if not isinstance(call, ast.Call) or call.args:
            raise ToolCallError(f"not a Python call with keyword arguments: {ast.unparse(call)[:80]!r}")
        name = ast.unparse(call.func)
        if name.endswith(".call"):
            name = name[: -len(".call")]
        try:
            args = {kw.arg: _literal(kw.value) for kw in call.keywords}
        except ValueError:
            raise ToolCallError(f"arguments that are not literals: {ast.unparse(call)[:80]!r}") from None
        out.call_start(tools.check(name))
        out.args(json.dumps(args, ensure_ascii=False))
        out.call_end()


# --- Gemma 4 ---------------------------------------------------------------------------------


_GEMMA_QUOTE = '<|"|>'


def _gemma_json(text: str) -> str:
    """Gemma 4's argument syntax as JSON: ``{key:<|"|>text<|"|>,n:1,list:[...]}`` has bare
    keys and strings between ``<|"|>`` marks (``common/parsers/gemma4.cpp``, ``gemma4_to_json``).

    Raises:
        ToolCallError: a string that is not closed.
    """
    out: list[str] = []
    stack: list[str] = []
    expect_key = False
    i = 0
    while i < len(text):
        if text.startswith(_GEMMA_QUOTE, i):
            end = text.find(_GEMMA_QUOTE, i + len(_GEMMA_QUOTE))
            if end < 0:
                raise ToolCallError(f"a string that is not closed in a tool call: {text[i:i + 40]!r}")
            out.append(json.dumps(text[i + len(_GEMMA_QUOTE) : end], ensure_ascii=False))
            i = end + len(_GEMMA_QUOTE)
            continue
        c = text[i]
        if c in "{[":
            stack.append(c)
            expect_key = c == "{"
            out.append(c)
            i += 1
        elif c in "}]":
            if stack:
                stack.pop()
            expect_key = False
            out.append(c)
            i += 1
        elif c == ",":
            expect_key = bool(stack) and stack[-1] == "{"
            out.append(c)
            i += 1
        elif c.isspace():
            i += 1
        elif expect_key:
            end = text.find(":", i)
            if end < 0:
                raise ToolCallError(f"a key without a value in a tool call: {text[i:i + 40]!r}")
            out.append(json.dumps(text[i:end].strip(), ensure_ascii=False) + ":")
            expect_key = False
            i = end + 1
        else:
            m = re.compile(r"[^,}\]]*").match(text, i)
            assert m is not None
            out.append(m.group().strip())
            i = m.end()
    return "".join(out)


def _gemma_call(source: str, tools: Tools, out: Out) -> None:
    """Put out the call ``call:NAME{ARGS}`` (Gemma 4's, between its markers).

    Raises:
        ToolCallError: not that.
    """
    head, brace, args = source.partition("{")
    if not head.startswith("call:") or not brace:
        raise ToolCallError(f"a tool call that is not call:NAME{{...}}: {source[:80]!r}")
    out.call_start(tools.check(head[len("call:") :].strip()))
    out.args(_gemma_json(brace + args))
    out.call_end()


# --- calls read whole --------------------------------------------------------------------------


@attrs.frozen
class WholeCalls(InText):
    """Calls whose syntax is not JSON, read whole between ``opener`` and ``close`` and then
    turned into calls by ``convert`` (their arguments come out at the closing marker):
    :func:`_pythonic` (LFM2's ``[f(a=1), g(b="x")]``), :func:`_gemma_call` (Gemma 4's
    ``call:f{k:<|"|>v<|"|>}``)."""

    opener: str
    close: str
    convert: Callable[[str, Tools, Out], None]

    def openers(self, tools: Tools) -> tuple[str, ...]:
        return (self.opener,)

    def read(self, s: Stream, out: Out, tools: Tools, opener: str) -> Read:
        out.in_call = True
        source, _ = yield from take_until(s, (self.close,), 1 << 20, "tool calls")
        self.convert(source, tools, out)

    def grammar(self, tools: Sequence[ToolRules], parallel: bool) -> CallGrammar:
        raise NotImplementedError("calls that are not JSON are not forced by a grammar here")

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        raise NotImplementedError("calls that are not JSON are not forced by a grammar here")


PYTHONIC = WholeCalls("<|tool_call_start|>", "<|tool_call_end|>", _pythonic)
"""LFM2's calls."""
GEMMA_4 = WholeCalls("<|tool_call>", "<tool_call|>", _gemma_call)
"""Gemma 4's calls."""


# --- Llama 3.x -------------------------------------------------------------------------------


_CODE_TOOLS = ("python", "ipython")


@attrs.frozen
class LlamaCalls:
    """Llama 3.x calls (see the module docstring)."""

    tag: str = "<|python_tag|>"
    starts: tuple[str, ...] = ('{"name"', '{"type"', '{ "name"', '{ "type"', '{"function"')
    """How a reply that is a JSON call starts (a reply starting otherwise is text)."""

    def openers(self, tools: Tools) -> tuple[str, ...]:
        return (self.tag,)

    def leading(self, tools: Tools) -> tuple[str, ...]:
        return self.starts

    def read(self, s: Stream, out: Out, tools: Tools, opener: str) -> Read:
        out.in_call = True
        yield from skip_ws(s)
        if opener != self.tag or (yield from peek(s, ("{",))):
            yield from _JSON_CALL.read(s, out, tools, opener)
            return
        rest: list[str] = []
        yield from until(s, (), rest.append)
        source = "".join(rest).strip()
        if re.match(r"^[\w.]+\.call\(", source):
            _pythonic(source, tools, out)
            return
        code_tool = next((t for t in _CODE_TOOLS if t in tools.names), None)
        if code_tool is None:
            raise ToolCallError(f"code after {self.tag} and no python tool: {source[:80]!r}")
        out.call_start(code_tool)
        out.args(json.dumps({"code": source}, ensure_ascii=False))
        out.call_end()

    def grammar(self, tools: Sequence[ToolRules], parallel: bool) -> CallGrammar:
        """``{"name": "f", "parameters": {...}}``, the whole reply (one call: Llama 3.x's
        templates take one call per turn)."""
        alts = [f"{literal(json.dumps(t.name) + ', ' + json.dumps('parameters') + ': ')} {t.arguments}" for t in tools]
        return CallGrammar((("fmt-call", f"( {alternatives(alts)} ) {literal('}')}"),), '{"name": ', "", "fmt-call")

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": {json.dumps(arguments, ensure_ascii=False)}}}'


_JSON_CALL = JsonCalls("", args_keys=("parameters", "arguments"))


# --- Functionary v3.2 ------------------------------------------------------------------------


@attrs.frozen
class RecipientFormat:
    """Functionary v3.2 (see the module docstring). The generation prompt ends with ``>>>``,
    so the reply starts with a recipient (a leading ``>>>`` is taken too)."""

    name: str = "functionary-v3.2"
    reasoning: ReasoningMarkers | None = None

    def parser(self, tools: Sequence[ToolSpec] | None, *, reasoning_open: bool = False) -> CoroutineParser:
        table = None if tools is None else Tools.of(tools)

        def read(s: Stream, out: Out) -> Read:
            yield from accept(s, ">>>")
            while True:
                parts: list[str] = []
                if (yield from until(s, ("\n",), parts.append)) is None:
                    return  # cut inside a recipient
                recipient = "".join(parts)
                if len(recipient) > _HEADER_LIMIT:
                    raise ToolCallError(f"a recipient longer than {_HEADER_LIMIT} characters")
                if table is None or recipient.strip() == "all":
                    marker = yield from until(s, (">>>",) if table is not None else (), out.text)
                else:
                    yield from self._call(s, out, table, recipient.strip())
                    yield from skip_ws(s)
                    marker = ">>>" if (yield from accept(s, ">>>")) else None
                if marker is None:
                    return
                out.end_block()
                if s.ended and s.pos >= len(s.text):
                    return

        return CoroutineParser(read)

    def _call(self, s: Stream, out: Out, tools: Tools, name: str) -> Read:
        out.in_call = True
        yield from skip_ws(s)
        if name in _CODE_TOOLS and not (yield from peek(s, ("{",))):
            code: list[str] = []
            yield from until(s, (">>>",), code.append, consume=False)
            out.call_start(tools.check(name))
            out.args(json.dumps({"code": "".join(code).strip()}, ensure_ascii=False))
        else:
            out.call_start(tools.check(name))
            yield from _json_args(s, out)
        out.call_end()

    def triggers(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        return tuple(f">>>{t.name}" for t in tools)

    def call_grammar(self, tools: Sequence[ToolRules], parallel: bool) -> CallGrammar:
        """``NAME\\n{arguments}``, units joined by ``>>>`` (the generation prompt ends with
        the first ``>>>``, so the trigger is empty: a lazy grammar cannot start from it)."""
        alts = [f"{literal(t.name + chr(10))} {t.arguments}" for t in tools]
        return CallGrammar((("fmt-call", alternatives(alts)),), "", "", "fmt-call", separator=">>>", repeat=parallel)

    def write_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return f"{name}\n{json.dumps(arguments, ensure_ascii=False)}"


# --- gpt-oss ---------------------------------------------------------------------------------


_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")


def _header(text: str) -> tuple[str, str]:
    """A Harmony message header's channel and recipient (``""`` when none)."""
    channels = re.findall(r"<\|channel\|>\s*(\w+)", text)
    recipients = [r for r in re.findall(r"\bto=([\w.\-:]+)", text) if r != "assistant"]
    return (channels[-1] if channels else ""), (recipients[-1] if recipients else "")


@attrs.frozen
class HarmonyFormat:
    """gpt-oss (see the module docstring). The generation prompt ends with
    ``<|start|>assistant``, so the reply starts with a message's header."""

    name: str = "gpt-oss"
    reasoning: ReasoningMarkers | None = ReasoningMarkers(
        "<|channel|>analysis<|message|>", "<|end|>", close="<|end|><|start|>assistant<|channel|>final<|message|>"
    )

    def parser(self, tools: Sequence[ToolSpec] | None, *, reasoning_open: bool = False) -> CoroutineParser:
        table = Tools.of(tools or ())

        def read(s: Stream, out: Out) -> Read:
            opened = reasoning_open
            while True:
                yield from skip_ws(s)
                if s.ended and s.pos >= len(s.text):
                    return
                if opened:  # the generation prompt opened an analysis message
                    channel, recipient, opened = "analysis", "", False
                else:
                    parts: list[str] = []
                    if (yield from until(s, ("<|message|>",), parts.append)) is None:
                        return  # cut inside a header: nothing of it is shown
                    if len("".join(parts)) > _HEADER_LIMIT:
                        raise ToolCallError(f"a message header longer than {_HEADER_LIMIT} characters")
                    channel, recipient = _header("".join(parts))
                if recipient.startswith("functions.") and tools is not None:
                    yield from self._call(s, out, table, recipient[len("functions.") :])
                    marker = yield from until(s, _ENDS, lambda _text: None)
                elif recipient:
                    marker = yield from until(s, _ENDS, lambda _text: None)
                elif channel == "analysis":
                    out.in_reasoning = True
                    marker = yield from until(s, _ENDS, out.reasoning)
                    out.in_reasoning = False
                else:
                    marker = yield from until(s, _ENDS, out.text)
                out.end_block()
                if marker is None:
                    return
                if marker != "<|start|>":
                    yield from skip_ws(s)
                    yield from accept(s, "<|start|>")
                yield from accept(s, "assistant")

        return CoroutineParser(read)

    def _call(self, s: Stream, out: Out, tools: Tools, name: str) -> Read:
        out.in_call = True
        out.call_start(tools.check(name))
        yield from _json_args(s, out)
        out.call_end()

    def triggers(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        return (" to=functions.",)

    def call_grammar(self, tools: Sequence[ToolRules], parallel: bool) -> CallGrammar:
        """``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}``
        after any ``analysis`` messages: `` to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{...}``
        (the recipient in the role header, after the generation prompt's ``<|start|>assistant``;
        a lazy grammar's trigger `` to=functions.`` is also in the channel-header form, where the
        channel comes first). One call: gpt-oss ends its turn at ``<|call|>``."""
        alts = [f"{literal(t.name)} ( {literal('<|channel|>commentary')} )? ( {literal(' <|constrain|>json')} )? "
                f"{literal('<|message|>')} {t.arguments}" for t in tools]
        rules, thinking = thinking_rules(self.reasoning, then="<|start|>assistant")
        return CallGrammar((("fmt-call", alternatives(alts)), *rules), " to=functions.", "", "fmt-call",
                           thinking=thinking)

    def write_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        return f" to=functions.{name}<|channel|>commentary <|constrain|>json<|message|>{args}"
