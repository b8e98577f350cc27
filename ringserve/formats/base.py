"""What every model family's format gives: an output parser, its reasoning markers, its call grammar.

A :class:`ChatFormat` is chosen once per model (from its chat template,
:func:`ringserve.formats.detect.detect`) and asked per request for an :class:`OutputParser`:
fed the reply's decoded text as it comes, the parser gives :data:`Piece` values in order:
:class:`Text`, :class:`Reasoning` (the text of a thinking block), and the tool calls as
:class:`CallStart` (the tool's name), :class:`CallArgs` (fragments of the arguments' JSON
text; their concatenation is one JSON object) and :class:`CallEnd`. No marker ever reaches a
piece: text that may be the start of one is held back until it is decided, as
``core/stop.py`` holds back stop strings; :meth:`OutputParser.flush` releases what is held at
the end of the reply. A call the parser cannot read raises
:class:`~ringserve.core.toolcalls.ToolCallError`.

The grammar side (:meth:`ChatFormat.call_grammar`) spells a forced call in the family's own
syntax as GBNF; the JSON-schema-to-GBNF conversion of the arguments stays in
``engine/gbnf.py``, which passes the rules it made as :class:`ToolRules`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from ringserve.core.events import ToolSpec
from ringserve.core.toolcalls import CallArgs, CallEnd, CallStart, OutputParser, Piece, Reasoning, Text, ToolCallError
from ringserve.formats.gbnf import literal, raw_text

__all__ = [
    "AnswerStart",
    "CallArgs",
    "CallEnd",
    "CallGrammar",
    "CallStart",
    "ChatFormat",
    "OutputParser",
    "ParamRule",
    "Piece",
    "Reasoning",
    "ReasoningMarkers",
    "Text",
    "TOOLS_PROMPT_FAMILIES",
    "Thinking",
    "ToolCallError",
    "ToolRules",
    "answer_start",
    "thinking_rules",
]


@attrs.frozen
class ReasoningMarkers:
    """A thinking block's markers as the model writes them (``<think>``, ``</think>``).

    ``start`` is ``""`` for a family whose thinking block has no opening marker in the output
    (the generation prompt always opens it). ``close`` is what a reasoning budget forces the
    model to write to end the block and go on with its answer (``""``: ``end``; gpt-oss: the
    end of the ``analysis`` message and the header of the ``final`` one), :attr:`closing`.
    """

    start: str
    end: str
    close: str = ""

    @property
    def closing(self) -> str:
        """The text that ends the block when the budget is spent: ``close``, else ``end``."""
        return self.close or self.end

    def opened_by(self, generation_prompt: str) -> bool:
        """Whether a reply that follows ``generation_prompt`` (what the template appends for
        the assistant's turn) starts inside the thinking block: the prompt opens the block
        and does not close it (``<think>\\n``, not ``<think>\\n\\n</think>\\n\\n``), or the
        block has no opening marker and the prompt does not close it."""
        tail = generation_prompt.rstrip()
        if not self.start:
            return not tail.endswith(self.end)
        at = tail.rfind(self.start)
        return at >= 0 and self.end not in tail[at:] and not tail[at + len(self.start) :].strip()


@attrs.frozen
class ParamRule:
    """One property of a tool's arguments, for syntaxes that write each parameter apart
    (XML-style parameters): its name, the GBNF rule of its JSON value, whether the value is
    written raw (a string-typed property: the text itself, not a JSON string) and whether it is
    required; ``raw_rule`` is the rule of its raw text when it has one of its own (a freeform
    tool's input under its grammar), "" for the syntax's any-text rule."""

    name: str
    value: str
    raw: bool
    required: bool
    raw_rule: str = ""


@attrs.frozen
class ToolRules:
    """A tool as the call grammar needs it: its name, the GBNF rule of its arguments object,
    and one :class:`ParamRule` per property (in the schema's order)."""

    name: str
    arguments: str
    params: tuple[ParamRule, ...] = ()


@attrs.frozen
class Thinking:
    """A thinking block as a grammar lets it stand before forced calls: ``start``, any text
    without ``end``, ``end``, then ``then`` (Harmony's ``<|start|>assistant``) and whitespace."""

    start: str
    end: str
    then: str = ""


@attrs.frozen
class CallGrammar:
    """Calls in a family's syntax, as GBNF (``engine/gbnf.py`` adds these rules to its
    converter, whose rules they refer to: those of :class:`ToolRules`).

    A unit is ``trigger head one``: one call, or a section holding the calls (the syntax
    then puts the parallel calls inside ``one``); with :attr:`repeat`, more units may follow,
    each after :attr:`separator`. A forced reply (:meth:`forced`) is the thinking block
    (optional, or required when the prompt opened it), then units; a lazy grammar goes on after
    :attr:`trigger` in free text and constrains the rest of its unit (:meth:`after`).

    Attributes:
        rules: ``(name, body)`` pairs the expressions refer to (names start with ``fmt-``).
        trigger: the text that starts a unit (a lazy grammar's trigger word).
        head: the literal text the family writes right after ``trigger``.
        one: the GBNF expression of the rest of a unit.
        separator: the literal between units.
        repeat: units may repeat (parallel calls of a syntax with a unit per call).
        thinking: the family's thinking block, which may come first (its rules are in
            :attr:`rules`); None for a family without one.
    """

    rules: tuple[tuple[str, str], ...]
    trigger: str
    head: str
    one: str
    separator: str = "\n"
    repeat: bool = False
    thinking: Thinking | None = None

    def forced(self, max_units: int, reasoning_open: bool = False) -> str:
        """The root expression of a reply that is only calls (after the thinking block):
        one unit, or with :attr:`repeat` 1..``max_units``."""
        unit = f"{literal(self.trigger + self.head)} {self.one}"
        root = unit
        if self.repeat and max_units > 1:
            root = f"{unit} ( {literal(self.separator + self.trigger + self.head)} {self.one} ){{0,{max_units - 1}}}"
        if self.thinking is None:
            return root
        t = self.thinking
        block = f"{THINK_RULE}-0 {literal(t.end + t.then)} [ \\t\\n]*"
        if reasoning_open or not t.start:
            return f"{block} {root}"
        return f"( {literal(t.start)} {block} )? {root}"

    def forced_prefix(self, reasoning_open: bool = False) -> str:
        """The shortest text :meth:`forced` takes before the first unit: the thinking block's
        end where the block is required (the prompt opened it, or it has no opening marker),
        else nothing."""
        t = self.thinking
        if t is None or (t.start and not reasoning_open):
            return ""
        return t.end + t.then

    def after(self, text: str) -> str | None:
        """The root expression of the rest of a unit whose trigger was just decoded, with
        ``text`` after it in the same token; None when ``text`` goes beyond :attr:`head`
        (the unit is then not constrained).

        Where :attr:`head` starts with whitespace, the model may write other whitespace
        there: ``text``'s own is skipped, and a ``text`` of whitespace only lets up to
        :data:`LEAD_WS` more come before the rest of the head."""
        rest = self.rest(text)
        if rest is None:
            return None
        body = self.head.lstrip(_WS)
        lead = f"[ \\t\\n]{{0,{LEAD_WS}}} " if body != self.head and not text.lstrip(_WS) else ""
        return f"{lead}{literal(rest)} {self.one}" if rest else f"{lead}{self.one}"

    def rest(self, text: str) -> str | None:
        """The part of :attr:`head` that is still to come after ``text`` (:meth:`after`); None
        when ``text`` goes beyond it."""
        body = self.head.lstrip(_WS)
        if body != self.head:
            text = text.lstrip(_WS)
            return body[len(text) :] if body.startswith(text) else None
        return self.head[len(text) :] if self.head.startswith(text) else None


_WS = " \t\n"
LEAD_WS = 2
"""Whitespace characters a lazy grammar lets a model write where its call's head starts with
whitespace (after ``<tool_call>``: ``\\n`` or nothing, usually)."""


THINK_RULE = "fmt-think"
"""The rules of a thinking block's text (``fmt-think-0`` ...)."""


def thinking_rules(markers: ReasoningMarkers | None, then: str = "") -> tuple[tuple[tuple[str, str], ...], Thinking | None]:
    """The rules and :class:`Thinking` of a family's thinking block (none without markers)."""
    if markers is None:
        return (), None
    return raw_text(markers.end, THINK_RULE), Thinking(markers.start, markers.end, then)


@attrs.frozen
class AnswerStart:
    """What a grammar-constrained answer (a JSON output) lets stand before it: ``rules``
    (``(name, body)``), the GBNF ``expression`` to put before the answer's (``""``: none),
    and ``shortest``, the shortest text it takes."""

    rules: tuple[tuple[str, str], ...] = ()
    expression: str = ""
    shortest: str = ""


def answer_start(markers: ReasoningMarkers | None, reasoning_open: bool = False) -> AnswerStart:
    """The thinking block before a constrained answer: any text, then the block's
    :attr:`~ReasoningMarkers.closing` and whitespace. Optional, after its opening marker;
    required when the prompt opened the block, when the block has no opening marker, or when
    its closing text opens the answer (gpt-oss: its ``final`` channel, where the answer must
    stand)."""
    if markers is None:
        return AnswerStart()
    rules = raw_text(markers.end, THINK_RULE)
    block = f"{THINK_RULE}-0 {literal(markers.closing)} [ \\t\\n]*"
    if reasoning_open or not markers.start:
        return AnswerStart(rules, block, markers.closing)
    opened = f"{literal(markers.start)} {block}"
    if markers.close:
        return AnswerStart(rules, opened, markers.start + markers.closing)
    return AnswerStart(rules, f"( {opened} )?", "")


TOOLS_PROMPT_FAMILIES = frozenset({"generic", "generic-think"})
"""The families whose tools are rendered by ringserve's generic tools prompt, not the template
(``formats/prompt.py``): a template with no tool-call syntax of its own."""


class ChatFormat(Protocol):
    """One model family's output format (see the module docstring)."""

    @property
    def name(self) -> str:
        """The family's name (``hermes``, ``qwen3-coder``, ``gpt-oss``...)."""

    @property
    def reasoning(self) -> ReasoningMarkers | None:
        """The thinking block's markers; None for a family without one. A reasoning budget
        ends the block by forcing :attr:`ReasoningMarkers.closing`."""

    def parser(self, tools: Sequence[ToolSpec] | None, *, reasoning_open: bool = False) -> OutputParser:
        """A parser for one reply.

        Args:
            tools: the tools the model may call; None: calls are not parsed (no tools, or tool
                choice ``NONE``): their markers are text.
            reasoning_open: the generation prompt opened the thinking block, so the reply
                starts inside it (:meth:`ReasoningMarkers.opened_by`).
        """

    def triggers(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        """The texts that open a call in free text (lazy grammars' trigger words; the parser
        accepts these, and maybe looser variants)."""

    def call_grammar(self, tools: Sequence[ToolRules], parallel: bool) -> CallGrammar:
        """The grammar of calls of ``tools`` in the family's syntax (``parallel``: a reply may
        hold more than one call).

        Raises:
            NotImplementedError: a family whose calls cannot be forced by a grammar here.
        """

    def write_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call of tool ``name`` with ``arguments`` (a JSON object's value) as the family's
        call grammar writes it: a whole unit, its trigger first (the fake engine's replies to
        a grammar, and tests). A string value of a syntax that writes parameters apart is
        written as raw text, another as its JSON.

        Raises:
            NotImplementedError: as :meth:`call_grammar`.
        """


def unknown_tool(name: str) -> ToolCallError:
    """The error of a call whose tool is not among the request's tools."""
    return ToolCallError(f"the model called {name!r}, which is not one of the request's tools")
