"""A model's own chat template, rendered as llama-server renders it (sans-I/O).

A GGUF carries its prompt format as a Jinja template (``tokenizer.chat_template``) written
for Hugging Face's ``apply_chat_template``: it reads ``messages`` (roles ``system``,
``user``, ``assistant``, ``tool``; assistant ``tool_calls`` in the OpenAI shape, ``tool``
turns with ``tool_call_id`` and ``name``, ``reasoning_content``), ``tools`` (OpenAI function
tools), ``add_generation_prompt``, ``enable_thinking``, ``bos_token``/``eos_token`` and the
helpers ``raise_exception``, ``strftime_now`` and ``tojson``
(https://huggingface.co/docs/transformers/main/en/chat_templating_writing).

:class:`ChatTemplate` renders one with jinja2's sandbox and reproduces what llama-server
feeds the same template, which is the reference here (``common/chat.cpp``,
``common/jinja/caps.cpp`` and ``common/parsers/*.cpp`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors):

- the template's capabilities (:class:`TemplateCaps`) are probed once at load, as
  ``jinja::caps_get`` does, and decide how messages are shaped: contents as a list of typed
  parts for templates that only read those, a system turn folded into the next turn for
  templates without a system role, tool-call arguments as objects for templates that read
  their members;
- the extras llama-server gives every template: ``datetime``, ``date_string``,
  ``preserve_thinking``/``clear_thinking``/... from ``preserve_reasoning``,
  ``reasoning_effort``/``reasoning_strength``, and the request's ``chat_template_kwargs``;
- its per-family fixes: gpt-oss and LFM2 read past reasoning as ``thinking``, Ministral 3
  as a typed ``thinking`` part, DeepSeek V4 orders tool results by call, older Gemma 4
  templates take tool results inside the assistant turn, StepFun's contents are trimmed,
  and two source patches (gpt-oss, Mistral) that llama.cpp applies at load.

Message contents cannot forge a turn. The engine tokenizes the rendered prompt with the
template's own special tokens parsed as tokens; the text of a special token that came from
a request (a message, a tool, a kwarg) must stay text. :meth:`ChatTemplate.render` returns
the spans of such text (:class:`RenderedPrompt`), and :func:`prompt_fragments` cuts the
prompt into the pieces the engine tokenizes, each with or without special-token parsing.
"""

from __future__ import annotations

import bisect
import datetime as dt
import enum
import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, assert_never, cast

import attrs
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
from jinja2.utils import pass_context

from ringserve.core.events import ChatMessage, Role, ToolSpec

#: A JSON value as the template sees it.
Json = Any


class TemplateLoadError(Exception):
    """The chat template cannot be loaded: ``str(error)`` says why in one line (a Jinja
    syntax error and its line)."""


class TemplateRenderError(Exception):
    """The chat template cannot render this request: the caller's error (an HTTP 400).

    ``str(error)`` says why in one line; ``raised`` is the template's own message when it
    refused the request with ``raise_exception`` (for example "Conversation roles must
    alternate user/assistant/user/assistant/..."), else ``None``.
    """

    def __init__(self, message: str, raised: str | None = None) -> None:
        super().__init__(message)
        self.raised = raised


@attrs.frozen
class TemplateCaps:
    """What a template reads, probed at load as llama.cpp's ``jinja::caps_get`` does.

    The first four change how :meth:`ChatTemplate.render` shapes the messages; the others
    are reported (llama-server's ``/props`` ``chat_template_caps``).
    """

    supports_string_content: bool = True
    supports_typed_content: bool = False
    supports_system_role: bool = True
    supports_object_arguments: bool = False
    supports_tool_calls: bool = True
    supports_tools: bool = True
    supports_parallel_tool_calls: bool = True
    supports_preserve_reasoning: bool = False
    supports_reasoning_effort: bool = False


@attrs.frozen
class RenderedPrompt:
    """A rendered prompt.

    ``text`` is the prompt; ``literal_spans`` are the ``[start, end)`` offsets (characters
    of ``text``, sorted, disjoint) of special-token text that came from the request rather
    than from the template: the engine must tokenize it as plain text
    (:func:`prompt_fragments`).
    """

    text: str
    literal_spans: tuple[tuple[int, int], ...] = ()


@attrs.frozen
class SpecialToken:
    """A special token of the vocabulary, as llama.cpp's tokenizer splits the text at it.

    ``lstrip``/``rstrip``: the token swallows the whitespace before/after it (llama.cpp's
    ``LLAMA_TOKEN_ATTR_LSTRIP``/``RSTRIP``; Phi-3 vocabularies set ``rstrip``).
    """

    text: str = attrs.field(validator=attrs.validators.min_len(1))
    lstrip: bool = False
    rstrip: bool = False


class SpecialTokens:
    """A vocabulary's special tokens, indexed to be found in text fast (build once per model).

    Args:
        tokens: the tokens that only ``parse_special`` turns into tokens: llama.cpp's
            control and unknown tokens (``llama_vocab_get_attr``); user-defined tokens are
            split in both modes and may be left out. A text given twice counts once.
    """

    def __init__(self, tokens: Iterable[SpecialToken] = ()) -> None:
        by_text = {t.text: t for t in tokens}
        #: Longest first, as llama.cpp's ``cache_special_tokens`` is sorted.
        self.tokens = tuple(sorted(by_text.values(), key=lambda t: len(t.text), reverse=True))
        self._trie: dict[str, Any] = {}
        for text in by_text:
            node = self._trie
            for ch in text:
                node = node.setdefault(ch, {})
            node[""] = {}
        #: Matches the longest token at a position (empty vocabulary: nothing).
        self.pattern = re.compile(_trie_pattern(self._trie) if by_text else "(?!)")
        self._starts = re.compile(f"(?=(?:{self.pattern.pattern}))")

    def occurrences(self, text: str) -> dict[str, list[int]]:
        """Every occurrence (overlapping ones too) of every token: text -> offsets, ascending."""
        found: dict[str, list[int]] = {}
        for m in self._starts.finditer(text):
            at = m.start()
            node = self._trie
            for i in range(at, len(text)):
                child = node.get(text[i])
                if child is None:
                    break
                node = child
                if "" in node:
                    found.setdefault(text[at:i + 1], []).append(at)
        return found


def _trie_pattern(trie: dict[str, Any]) -> str:
    """A regular expression matching the longest string of ``trie`` at a position; chains
    of one child are written as one literal, so nesting grows with the branches only."""
    branches = []
    for ch, child in sorted(trie.items()):
        if not ch:
            continue
        run = ch
        while len(child) == 1 and "" not in child:
            (next_ch, child), = child.items()
            run += next_ch
        rest = _trie_pattern(child) if len(child) > 1 or "" not in child else ""
        branches.append(re.escape(run) + (f"(?:{rest})?" if rest and "" in child else rest))
    return branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"


#: What C's ``isspace`` takes for whitespace (llama.cpp strips with it).
_C_SPACE = frozenset(" \t\n\v\f\r")


def prompt_fragments(prompt: RenderedPrompt, special_tokens: SpecialTokens) -> list[tuple[str, bool]]:
    """Cut a rendered prompt into ``(text, parse_special)`` pieces for the tokenizer.

    The prompt is split at the occurrences of special tokens outside its literal spans, as
    llama.cpp's ``tokenizer_st_partition`` splits a text tokenized with ``parse_special``
    (``src/llama-vocab.cpp``): longest tokens first, each one's occurrences left to right
    in the text no longer token has taken, with the whitespace that ``lstrip``/``rstrip``
    tokens swallow dropped. Each token becomes ``(token_text, True)``, each run of text
    between them ``(run, False)``. Tokenizing each piece with its ``parse_special`` flag
    (``llama_tokenize``, no BOS) and concatenating the ids gives llama-server's ids for a
    prompt whose request carried no special-token text, and keeps the special-token text of
    the request plain text.

    Args:
        prompt: a rendering (:meth:`ChatTemplate.render`).
        special_tokens: the vocabulary's special tokens.

    Returns:
        The pieces in order; their texts joined give the prompt less swallowed whitespace.
    """
    text, spans = prompt.text, prompt.literal_spans
    found = special_tokens.occurrences(text)
    raw = [(0, len(text))] if text else []  # the text no token has taken: sorted ranges
    taken: list[tuple[int, SpecialToken]] = []
    for token in special_tokens.tokens:
        for at in found.get(token.text, ()):
            end = at + len(token.text)
            k = bisect.bisect_right(raw, (at, len(text) + 1)) - 1
            if k < 0 or end > raw[k][1] or any(s < end and at < e for s, e in spans):
                continue  # taken by a longer token, or text of the request
            start, stop = raw[k]
            left, right = at, end
            while token.lstrip and left > start and text[left - 1] in _C_SPACE:
                left -= 1
            while token.rstrip and right < stop and text[right] in _C_SPACE:
                right += 1
            raw[k:k + 1] = [r for r in ((start, left), (right, stop)) if r[0] < r[1]]
            taken.append((at, token))
    pieces = [(start, (text[start:stop], False)) for start, stop in raw]
    pieces += [(at, (token.text, True)) for at, token in taken]
    return [piece for _, piece in sorted(pieces)]


# --- The Jinja environment ------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face marks the assistant's tokens
    with it, https://github.com/huggingface/transformers/pull/30650): the body is rendered
    in place, as llama.cpp does."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _InputList(list[Json]):
    """A list of the request; the template may read it, not change it."""


class _InputDict(dict[str, Json]):
    """An object of the request; the template may read it, not change it."""


class _Environment(jinja2.sandbox.SandboxedEnvironment):
    """jinja2's sandbox as Hugging Face configures it (``trim_blocks``, ``lstrip_blocks``,
    loop controls, its ``tojson``, ``raise_exception``) and, where llama.cpp's own Jinja
    (``common/jinja/``, the reference) differs from jinja2, made to behave as llama.cpp's:

    - ``+`` of a string and ``none`` or an undefined value is the string (Command R+
      and FireFunction concatenate fields their requests may lack);
    - filters give lists, not generators (``tools | map(attribute='function') | tojson``);
    - ``safe`` is a no-op: no output is HTML-escaped (jinja2 escapes a string added to a
      ``safe`` one: Functionary's tool list);
    - the request's lists and objects are read-only, but the template's own are not:
      Kimi-K2's templates ``append`` to and ``pop`` from a list of their own, which
      jinja2's ``ImmutableSandboxedEnvironment`` refuses.
    """

    intercepted_binops = frozenset({"+"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
        )
        self.filters.update((name, _listing(f)) for name, f in self.filters.items())
        self.filters["tojson"] = _tojson
        self.filters["safe"] = str
        self.globals["raise_exception"] = _raise_exception

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if isinstance(left, str) and _is_null(right):
            return left
        if isinstance(right, str) and _is_null(left):
            return right
        return super().call_binop(context, operator, left, right)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if isinstance(obj, (_InputList, _InputDict)) and jinja2.sandbox.modifies_known_mutable(obj, attr):
            return False
        return bool(super().is_safe_attribute(obj, attr, value))


def _is_null(value: object) -> bool:
    return value is None or isinstance(value, jinja2.Undefined)


def _listing(f: Callable[..., Any]) -> Callable[..., Any]:
    """A jinja2 filter whose iterator results (``map``, ``select``...) come as lists."""

    @functools.wraps(f)
    def listing(*args: Any, **kwargs: Any) -> Any:
        result = f(*args, **kwargs)
        return list(result) if isinstance(result, Iterator) else result

    return listing


class _Raised(jinja2.TemplateError):
    """The template called ``raise_exception(message)``."""


def _raise_exception(message: object) -> None:
    raise _Raised(str(message))


#: The context variable holding a render's placeholder table (see :class:`_Literals`).
_LITERALS_VAR = "__ringserve_literals"


@pass_context
def _tojson(
    context: jinja2.runtime.Context,
    value: Json,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's ``tojson``: ``json.dumps`` with these defaults (not jinja2's own,
    which escapes HTML); an undefined value is ``null``, as llama.cpp writes it."""
    text = json.dumps(_plain(value), ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    literals = context.get(_LITERALS_VAR)
    return literals.fix_json(text, ensure_ascii) if isinstance(literals, _Literals) else text


def _plain(value: Json) -> Json:
    """``value`` in JSON's types, read whole (a use of every part, for the probes)."""
    _use(value)
    if isinstance(value, str) or value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, jinja2.Undefined):
        return None
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in list.__iter__(value)]
    if isinstance(value, (tuple, Iterator)):
        return [_plain(v) for v in value]
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# --- Special-token text of the request ------------------------------------------------------

#: Placeholders are characters of Unicode's Supplementary Private Use Area-B.
_PLACEHOLDER_BASE = 0x100000
_PLACEHOLDER_LAST = 0x10FFFD
_PLACEHOLDER_RE = re.compile("[\U00100000-\U0010fffd]")
_ESCAPED_PLACEHOLDER_RE = re.compile(r"\\udb(?:c[0-9a-f]|[d-f][0-9a-f])\\ud[c-f][0-9a-f]{2}")


class _Literals:
    """One render's placeholders for the special-token text found in the request.

    Before rendering, each occurrence of a special token's text in a request string (a
    message, a tool, a kwarg) is swapped for one private-use character, a placeholder the
    template copies, cuts or compares like any other character; so is each private-use
    character of that range the request itself holds. After rendering, the placeholders
    are swapped back and the spans of the tokens' text recorded (:class:`RenderedPrompt`).
    Index ``i`` of :attr:`originals` is the placeholder ``chr(_PLACEHOLDER_BASE + i)``.
    """

    def __init__(self, tokens: Sequence[str], pattern: re.Pattern[str]) -> None:
        """``pattern`` finds the texts of ``tokens`` and the characters of the range."""
        self.originals = list(tokens)
        self._n_tokens = len(tokens)
        self._index = {t: i for i, t in enumerate(tokens)}
        self._pattern = pattern

    def protect(self, text: str) -> str:
        return self._pattern.sub(lambda m: self._placeholder(m.group()), text)

    def _placeholder(self, original: str) -> str:
        i = self._index.get(original)
        if i is None:
            i = self._index[original] = len(self.originals)
            self.originals.append(original)
            if _PLACEHOLDER_BASE + i > _PLACEHOLDER_LAST:
                raise TemplateRenderError("the request holds too many distinct private-use characters")
        return chr(_PLACEHOLDER_BASE + i)

    def fix_json(self, text: str, ensure_ascii: bool) -> str:
        """``tojson`` output: a placeholder stays one while its text needs no JSON escape,
        else becomes its text escaped (then no token's text any more)."""

        def fix(placeholder: str) -> str:
            i = ord(placeholder) - _PLACEHOLDER_BASE
            if i >= len(self.originals):  # U+10FFFE or U+10FFFF, no placeholder
                return json.dumps(placeholder, ensure_ascii=ensure_ascii)[1:-1]
            original = self.originals[i]
            escaped = json.dumps(original, ensure_ascii=ensure_ascii)[1:-1]
            return placeholder if escaped == original else escaped

        if ensure_ascii:
            text = _ESCAPED_PLACEHOLDER_RE.sub(lambda m: fix(json.loads(f'"{m.group()}"')), text)
        return _PLACEHOLDER_RE.sub(lambda m: fix(m.group()), text)

    def restore(self, text: str) -> RenderedPrompt:
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        length = 0
        last = 0
        for m in _PLACEHOLDER_RE.finditer(text):
            out.append(text[last:m.start()])
            length += m.start() - last
            i = ord(m.group()) - _PLACEHOLDER_BASE
            original = self.originals[i] if i < len(self.originals) else m.group()  # the template's own
            out.append(original)
            if i < self._n_tokens:
                spans.append((length, length + len(original)))
            length += len(original)
            last = m.end()
        out.append(text[last:])
        return RenderedPrompt("".join(out), tuple(spans))

    def protect_json(self, value: Json) -> Json:
        """``value`` with every string (keys included) protected, as read-only containers."""
        if isinstance(value, str):
            return self.protect(value)
        if isinstance(value, list):
            return _InputList(self.protect_json(v) for v in value)
        if isinstance(value, dict):
            return _InputDict((self.protect(k), self.protect_json(v)) for k, v in value.items())
        return value


# --- Capability probes ----------------------------------------------------------------------
#
# llama.cpp renders a template on canned requests with every input value counting its uses
# (a lookup, a filter, a test, a loop over it: `value_t::stats_t`) and reads the template's
# capabilities off those counts (`jinja::caps_get`). The probe values below count the same
# uses under jinja2: lookups through the environment's getattr/getitem, filters and tests
# through wrappers, and the uses of a value held in a local variable through its own
# methods.


@attrs.define
class _Uses:
    """The uses of one probe value: ``used``, and llama.cpp's names of some operations."""

    used: bool = False
    ops: set[str] = attrs.Factory(set)


@attrs.define
class _ProbeRun:
    """Shared by one probe's values: inside a filter, a loop over a value is the filter's."""

    in_filter: int = 0


class _ProbeStr(str):
    uses: _Uses
    run: _ProbeRun

    def __new__(cls, value: str, run: _ProbeRun) -> _ProbeStr:
        self = super().__new__(cls, value)
        self.uses = _Uses()
        self.run = run
        return self

    def _use(self) -> str:
        self.uses.used = True
        return str.__str__(self)

    def __str__(self) -> str:
        return self._use()

    def __add__(self, other: str) -> str:
        return self._use() + other

    def __radd__(self, other: str) -> str:
        return other + self._use()

    def __eq__(self, other: object) -> bool:
        return self._use() == other

    def __ne__(self, other: object) -> bool:
        return self._use() != other

    __hash__ = str.__hash__

    def __len__(self) -> int:
        return len(self._use())

    def __contains__(self, item: object) -> bool:
        return item in self._use()  # type: ignore[operator]

    def __iter__(self) -> Iterator[str]:
        text = self._use()
        if not self.run.in_filter:  # a for loop over a string, which fails in llama.cpp
            self.uses.ops.add("array_access")
            raise TypeError("Expected iterable or object type in for loop: got String")
        return iter(text)

    def __getitem__(self, key: Any) -> str:
        return self._use()[key]


class _ProbeList(list[Any]):
    uses: _Uses
    run: _ProbeRun

    def __init__(self, items: Iterable[Any], run: _ProbeRun) -> None:
        super().__init__(items)
        self.uses = _Uses()
        self.run = run

    def __iter__(self) -> Iterator[Any]:
        self.uses.used = True
        if not self.run.in_filter:
            self.uses.ops.add("array_access")
        return super().__iter__()

    def __len__(self) -> int:
        self.uses.used = True
        return super().__len__()


class _ProbeDict(dict[str, Any]):
    uses: _Uses
    run: _ProbeRun

    def __init__(self, items: Mapping[str, Any], run: _ProbeRun) -> None:
        super().__init__(items)
        self.uses = _Uses()
        self.run = run

    def __iter__(self) -> Iterator[str]:
        self.uses.used = True
        return super().__iter__()

    def __len__(self) -> int:
        self.uses.used = True
        return super().__len__()


_Probe = _ProbeStr | _ProbeList | _ProbeDict


def _probe_value(value: Json, run: _ProbeRun) -> Json:
    if isinstance(value, str):
        return _ProbeStr(value, run)
    if isinstance(value, list):
        return _ProbeList((_probe_value(v, run) for v in value), run)
    if isinstance(value, dict):
        return _ProbeDict({k: _probe_value(v, run) for k, v in value.items()}, run)
    return value


def _use(value: object, op: str | None = None, deep: bool = False) -> None:
    if isinstance(value, _Probe):
        value.uses.used = True
        if op:
            value.uses.ops.add(op)
        if deep and isinstance(value, (_ProbeList, _ProbeDict)):
            for item in list.__iter__(value) if isinstance(value, list) else dict.values(value):
                _use(item, deep=True)


class _ProbeEnvironment(_Environment):
    """The environment with every lookup, filter and test counting its uses."""

    def __init__(self) -> None:
        super().__init__()
        for name, f in list(self.filters.items()):
            self.filters[name] = _counting(f, name, deep=name == "string")
        for name, test in list(self.tests.items()):
            self.tests[name] = _counting(cast(Callable[..., Any], test), f"test_is_{name}", deep=False)

    def getattr(self, obj: Any, attribute: str) -> Any:
        result = super().getattr(obj, attribute)
        _use(obj, "object_access")
        _use(result)
        return result

    def getitem(self, obj: Any, argument: Any) -> Any:
        result = super().getitem(obj, argument)
        _use(obj, "array_access" if isinstance(argument, int) else "object_access")
        _use(result)
        return result


def _counting(f: Callable[..., Any], op: str, deep: bool) -> Callable[..., Any]:
    """``f``, a filter or a test, counting a use of its value; a loop over the value inside
    ``f`` is no loop of the template's."""
    pass_arg = getattr(f, "jinja_pass_arg", None)  # jinja2's pass_context & co.

    def call(*args: Any, **kwargs: Any) -> Any:
        value = args[0 if pass_arg is None else 1]
        _use(value, op, deep)
        run = value.run if isinstance(value, _Probe) else None
        if run is not None:
            run.in_filter += 1
        try:
            return f(*args, **kwargs)
        finally:
            if run is not None:
                run.in_filter -= 1

    if pass_arg is not None:
        call.jinja_pass_arg = pass_arg  # type: ignore[attr-defined]
    return call


#: The canned requests of llama.cpp's ``jinja::caps_get``.
_CAPS_TOOLS: Json = [
    {
        "name": "tool",
        "type": "function",
        "function": {
            "name": "tool1",
            "description": "Tool description",
            "parameters": {
                "type": "object",
                "properties": {"arg": {"type": "string", "description": "Arg description"}},
                "required": ["arg"],
            },
        },
    }
]


def _caps_tool_turns(arguments: Json, calls: int) -> Json:
    return [
        {"role": "user", "content": "User message"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": f"call0000{i}", "type": "function", "function": {"name": "tool1", "arguments": arguments}}
                for i in range(1, calls + 1)
            ],
        },
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"},
    ]


_ProbeRender = Callable[..., tuple[bool, str, Json]]


def _probe_caps(source: str) -> TemplateCaps:
    """The template's capabilities, found as ``jinja::caps_get`` (``common/jinja/caps.cpp``)
    finds them: from what it reads of canned requests."""
    return _caps(_prober(source))


def _probe_system_anywhere(source: str) -> bool:
    """Whether the template renders a system turn between two user turns where it stands (not
    dropped, not refused): ringserve's own probe (llama.cpp passes such a turn to the template
    as it is), for the mid-conversation system turns Claude Code sends on every turn."""
    ok, text, _ = _prober(source)([{"role": "user", "content": "FIRST_USER_MARKER"},
                                   {"role": "system", "content": "MIDDLE_SYSTEM_MARKER"},
                                   {"role": "user", "content": "LAST_USER_MARKER"}])
    return ok and 0 <= text.find("FIRST_USER_MARKER") < text.find("MIDDLE_SYSTEM_MARKER") < text.find("LAST_USER_MARKER")


def _prober(source: str) -> _ProbeRender:
    """``run(messages, tools, **extra) -> (ok, text, context)``: the template rendered on
    probe values that record what it reads."""
    template = _ProbeEnvironment().from_string(source)

    def run(messages: Json, tools: Json = (), **extra: Json) -> tuple[bool, str, Json]:
        probe = _ProbeRun()
        context = {
            "messages": _probe_value(messages, probe),
            "tools": _probe_value(list(tools), probe),
            "bos_token": "",
            "eos_token": "",
            "add_generation_prompt": True,
            "strftime_now": _strftime_now(dt.datetime.now()),
        }
        context.update((k, _probe_value(v, probe)) for k, v in extra.items())
        if "reasoning_effort" in context:  # one value under both names, as llama.cpp binds it
            context["reasoning_strength"] = context["reasoning_effort"]
        try:
            return True, template.render(context), context
        except Exception:
            return False, "", context

    return run


def _caps(run: _ProbeRender) -> TemplateCaps:
    """:func:`_probe_caps`, with the template's probe ``run``."""

    def uses(value: Json) -> _Uses:
        return cast(_Probe, value).uses

    string_content = True
    typed_content = False
    marker = "STRING_MARKER"
    ok, text, context = run([{"role": "user", "content": marker}])
    content = uses(context["messages"][0]["content"])
    as_array = bool(content.ops & {"selectattr", "array_access"})
    typed_content = as_array
    if not ok or (as_array and marker not in text):
        string_content = False
    if "test_is_string" in content.ops:
        ok, text, context = run([{"role": "user", "content": []}])
        if ok and uses(context["messages"][0]["content"]).ops & {"selectattr", "array_access"}:
            typed_content = True

    _, _, context = run([{"role": "system", "content": "System message"}, {"role": "user", "content": "User message"}])
    system_role = uses(context["messages"][0]["content"]).used

    tools = tool_calls = True
    object_arguments = False
    ok, _, context = run(_caps_tool_turns({"arg": "value"}, 1), _CAPS_TOOLS)
    if ok:
        tools = uses(context["tools"][0]["function"]["name"]).used
        calls = context["messages"][1]["tool_calls"]
        tool_calls = uses(calls).used
        object_arguments = tool_calls and uses(calls[0]["function"]["arguments"]["arg"]).used
    if not object_arguments:
        ok, _, context = run(_caps_tool_turns('{"arg": "value"}', 1), _CAPS_TOOLS)
        if not ok:
            tools = tool_calls = False
        else:
            tools = tools and uses(context["tools"][0]["function"]["name"]).used
            tool_calls = tool_calls and uses(context["messages"][1]["tool_calls"]).used

    arguments: Json = {"arg": "value"} if object_arguments else '{"arg": "value"}'
    ok, _, context = run(_caps_tool_turns(arguments, 2), _CAPS_TOOLS)
    parallel = ok and uses(context["messages"][1]["tool_calls"][1]["function"]).used

    reasoning = "<REASONING_CONTENT_PLACEHOLDER>"
    _, text, _ = run(
        [
            {"role": "user", "content": "User message"},
            {"role": "assistant", "content": "Assistant message", "reasoning_content": reasoning},
            {"role": "user", "content": "User message"},
            {"role": "assistant", "content": "Assistant message", "reasoning_content": "Reasoning content"},
            {"role": "user", "content": "User message"},
        ],
        enable_thinking=True,
        **_preserve_reasoning_vars(True),
    )
    preserve_reasoning = reasoning in text

    _, _, context = run(
        [{"role": "user", "content": "User message"}],
        enable_thinking=True,
        reasoning_effort="low",
    )
    reasoning_effort = uses(context["reasoning_effort"]).used

    return TemplateCaps(
        supports_string_content=string_content,
        supports_typed_content=typed_content,
        supports_system_role=system_role,
        supports_tool_calls=tool_calls,
        supports_object_arguments=object_arguments,
        supports_tools=tools,
        supports_parallel_tool_calls=parallel,
        supports_preserve_reasoning=preserve_reasoning,
        supports_reasoning_effort=reasoning_effort,
    )


def _preserve_reasoning_vars(preserve: bool) -> dict[str, bool]:
    """llama.cpp's ``caps_apply_preserve_reasoning``: the names templates use for keeping
    past reasoning."""
    return {
        "preserve_thinking": preserve,
        "clear_thinking": not preserve,
        "truncate_history_thinking": not preserve,
        "drop_thinking": not preserve,
    }


def _strftime_now(now: dt.datetime) -> Callable[[str], str]:
    def strftime_now(format: str) -> str:
        return now.strftime(format)

    return strftime_now


# --- What llama-server does for some families -----------------------------------------------


class _Family(enum.Enum):
    """The families whose prompt llama-server shapes beyond the template (its
    ``common_chat_try_specialized_template`` picks them in this order)."""

    MINISTRAL_3 = "ministral-3"
    GPT_OSS = "gpt-oss"
    LFM2 = "lfm2"
    DEEPSEEK_V4 = "deepseek-v4"
    GEMMA_4 = "gemma-4"
    GEMMA_4_LEGACY = "gemma-4-legacy"
    OTHER = "other"


def _family(source: str) -> _Family:
    """The family by the substrings llama.cpp looks for (``common/chat.cpp``)."""
    if "[SYSTEM_PROMPT]" in source and "[TOOL_CALLS]" in source and "[ARGS]" in source and "[CALL_ID]" not in source:
        return _Family.MINISTRAL_3
    if "<|channel|>" in source:
        return _Family.GPT_OSS
    if "<|tool_list_start|>" in source:
        if "<|tool_list_end|>" in source:
            return _Family.LFM2
    elif "List of tools: [" in source:
        return _Family.LFM2  # LFM2.5
    if "dsml_token" in source and "DSML" in source and ("function_calls" in source or "tool_calls" in source):
        return _Family.OTHER if "function_calls" in source else _Family.DEEPSEEK_V4  # V3.2 or V4
    if "'<|tool_call>call:'" in source:
        return _Family.GEMMA_4 if "{#- OpenAI Chat Completions:" in source else _Family.GEMMA_4_LEGACY
    return _Family.OTHER


def _patched(source: str) -> str:
    """The two source patches llama.cpp applies at load (``common_chat_templates_init``):
    gpt-oss's check against channel markers in contents and Mistral's refusal of an empty
    turn are turned off."""
    if "<|channel|>" in source and "in message.content or" in source:
        source = source.replace(
            '{%- if "<|channel|>analysis<|message|>" in message.content or '
            '"<|channel|>final<|message|>" in message.content %}',
            "{%- if false %}",
        )
    if "[TOOL_CALLS]" in source and "if (message['content'] is none or" in source:
        source = source.replace(
            "{%- if (message['content'] is none or message['content'] == '' or "
            "message['content']|length == 0) and (message['tool_calls'] is not defined or "
            "message['tool_calls'] is none or message['tool_calls']|length == 0) %}",
            "{%- if false %}",
        )
    return source


#: Mistral's templates refuse a call id that is not 9 characters ("Tool call IDs should be
#: alphanumeric strings with length 9!"); ringserve's ids are longer, so they are mapped.
_NINE_CHAR_IDS = "|length != 9"


def _nine_chars(call_id: str) -> str:
    """A 9-character alphanumeric id for ``call_id`` (itself when it is one), the same for the
    same id, so a call and its result keep matching."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode("utf-8")).hexdigest()[:9]


#: StepFun's templates, whose message contents llama-server trims (llama.cpp issue 24181).
_TRIMMED_MARK = "You have access to the following functions in JSONSchema format"


def _thinking_field(messages: list[Json], drop_call_content: bool) -> list[Json]:
    """gpt-oss and LFM2 read past reasoning as ``thinking`` (gpt-oss: without the content
    of a turn with tool calls)."""
    out = []
    for m in messages:
        if isinstance(m.get("reasoning_content"), str):
            m = {**m, "thinking": m["reasoning_content"]}
            if drop_call_content and m.get("tool_calls"):
                del m["content"]
        out.append(m)
    return out


def _ministral_3(messages: list[Json]) -> list[Json]:
    """Ministral 3 reads a system or assistant turn as typed parts, its reasoning first as
    a ``thinking`` part (``common/parsers/ministral3.cpp``)."""
    out = []
    for m in messages:
        if m["role"] not in ("system", "assistant"):
            out.append(m)
            continue
        parts: list[Json] = []
        if isinstance(m.get("reasoning_content"), str):
            parts.append({"type": "thinking", "thinking": m["reasoning_content"]})
        content = m.get("content")
        if isinstance(content, str):
            parts.append({"type": "text", "text": content})
        elif isinstance(content, list):
            parts.extend(content)
        out.append({k: v for k, v in m.items() if k != "reasoning_content"} | {"content": parts})
    return out


def _deepseek_v4(messages: list[Json]) -> list[Json]:
    """DeepSeek V4 takes a run of tool results in the order of the calls they answer
    (``common/parsers/deepseek.cpp``)."""
    out = list(messages)
    order: dict[str, int] = {}
    i = 0
    while i < len(out):
        role = out[i]["role"]
        if role == "assistant" and out[i].get("tool_calls"):
            order = {c["id"]: n for n, c in enumerate(out[i]["tool_calls"]) if c.get("id")}
            i += 1
            continue
        if role not in ("user", "tool"):
            i += 1
            continue
        end = i
        while end < len(out) and out[end]["role"] in ("user", "tool"):
            end += 1
        results = [j for j in range(i, end) if out[j]["role"] == "tool"]
        if len(results) > 1 and order:
            ranked = sorted((out[j] for j in results), key=lambda m: order.get(m.get("tool_call_id", ""), 0))
            for j, m in zip(results, ranked, strict=True):
                out[j] = m
        i = end
    return out


def _gemma_4_legacy(messages: list[Json]) -> list[Json]:
    """Older Gemma 4 templates take tool results as the calling turn's ``tool_responses``
    and the next assistant text as its content (``common/parsers/gemma4.cpp``)."""
    out = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        calls = list(m["tool_calls"])
        responses: list[Json] = []
        i += 1
        while i < len(messages) and messages[i]["role"] == "tool":
            result = messages[i]
            response = result.get("content")
            if isinstance(response, str):
                try:
                    response = json.loads(response, parse_constant=_no_constant)
                except ValueError:
                    pass
            name = calls[len(responses)]["function"].get("name", "") if len(responses) < len(calls) else ""
            responses.append({"name": name or result.get("tool_call_id", ""), "response": response})
            i += 1
        turn: Json = {"role": "assistant", "tool_calls": calls}
        if responses:
            turn["tool_responses"] = responses
        if i < len(messages) and messages[i]["role"] == "assistant" and not messages[i].get("tool_calls"):
            if messages[i].get("content"):
                turn["content"] = messages[i]["content"]
                i += 1
        if isinstance(m.get("reasoning_content"), str):
            turn["reasoning_content"] = m["reasoning_content"]
        out.append(turn)
    return out


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


# --- The template ---------------------------------------------------------------------------

#: The kwargs llama-server gives every request unless told otherwise: past reasoning is
#: kept (its ``--reasoning-preserve`` default).
DEFAULT_KWARGS: Mapping[str, Json] = {"preserve_reasoning": True}

_C_WHITESPACE = " \t\n\v\f\r"


class ChatTemplate:
    """A chat template, loaded once per model, rendering requests as llama-server does.

    Args:
        source: the Jinja source (the GGUF's ``tokenizer.chat_template`` or a file).
        bos_token: the text of the vocabulary's BOS token (``bos_token`` in the template);
            ``""`` when it has none.
        eos_token: the text of its EOS token.
        special_tokens: the vocabulary's special tokens; their text in a request is
            reported by :meth:`render` as literal.
        strip_bos: the tokenizer adds BOS itself (``llama_vocab_get_add_bos``): a BOS the
            template wrote at the start is cut, as llama-server cuts it.
        strip_eos: the same for an EOS at the end (``llama_vocab_get_add_eos``).
        default_kwargs: ``chat_template_kwargs`` of every request, under the request's own.

    Raises:
        TemplateLoadError: the source is no template jinja2 can compile (the message gives
            the line), or it holds the private-use characters rendering reserves.
    """

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        special_tokens: SpecialTokens | None = None,
        strip_bos: bool = False,
        strip_eos: bool = False,
        default_kwargs: Mapping[str, Json] = DEFAULT_KWARGS,
    ) -> None:
        self.source = _patched(source)
        if _PLACEHOLDER_RE.search(self.source + bos_token + eos_token):
            raise TemplateLoadError("the chat template holds characters of U+100000..U+10FFFD, which ringserve reserves")
        try:
            self._template = _Environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateLoadError(f"the chat template does not compile: line {e.lineno}: {e.message}") from e
        self.caps = _probe_caps(self.source)
        #: Whether a system turn in the middle of a conversation renders where it stands; if not,
        #: :meth:`render` folds it into a turn (:func:`_fold_system_turns`).
        self.system_anywhere = _probe_system_anywhere(self.source)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.strip_bos = strip_bos
        self.strip_eos = strip_eos
        self.default_kwargs = dict(default_kwargs)
        self._family = _family(self.source)
        self._trim = _TRIMMED_MARK in self.source
        self._ids: Callable[[str], str] = _nine_chars if _NINE_CHAR_IDS in self.source else str
        self.special_tokens = special_tokens or SpecialTokens()
        self._token_texts = [t.text for t in self.special_tokens.tokens]
        self._protected = re.compile(f"{self.special_tokens.pattern.pattern}|{_PLACEHOLDER_RE.pattern}")

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        reasoning_effort: str | None = None,
        template_kwargs: Mapping[str, Json] | None = None,
        now: dt.datetime | None = None,
    ) -> RenderedPrompt:
        """Render a conversation into the model's prompt, as llama-server's
        ``common_chat_templates_apply`` renders the same OpenAI request.

        Args:
            messages: the conversation, oldest first. A ``tool`` turn gets the ``name`` of
                the call it answers (the latest earlier call with its ``tool_call_id``).
                Call ids go to Mistral's templates, which take only 9 alphanumerics, as
                such ids (the first 9 hex digits of the id's SHA-256 where it is not one).
            tools: the tools (rendered by the template, if it reads ``tools``).
            add_generation_prompt: open the assistant's turn at the end.
            enable_thinking: the template's thinking switch (``enable_thinking``), unless
                ``template_kwargs`` sets it.
            reasoning_effort: OpenAI's ``reasoning_effort``; given to the template as
                ``reasoning_effort`` (and ``reasoning_strength``); ``"none"`` turns
                thinking off instead.
            template_kwargs: the request's ``chat_template_kwargs`` (JSON values), over
                :attr:`default_kwargs`; each is a variable of the template.
            now: the time of ``strftime_now``, ``datetime`` and ``date_string`` (local
                time, naive); the current time by default.

        Returns:
            The prompt and the spans of the request's special-token text.

        Raises:
            TemplateRenderError: the template refused the request (``raise_exception``) or
                failed on it, a tool call's arguments are not JSON for a template that
                reads them as an object, or ``enable_thinking`` in ``template_kwargs`` is
                a string.
        """
        text, literals = self._apply(
            messages, tools, add_generation_prompt, enable_thinking, reasoning_effort, template_kwargs, now
        )
        match self._family:
            case _Family.GPT_OSS if not add_generation_prompt:
                at = text.rfind("<|return|>")  # llama.cpp issue 15417: a past reply ends with <|end|>
                if at != -1:
                    text = f"{text[:at]}<|end|>{text[at + len('<|return|>'):]}"
            case _Family.GEMMA_4 | _Family.GEMMA_4_LEGACY if add_generation_prompt and text.endswith("<turn|>\n"):
                text += "<|turn>model\n"  # a turn of text and calls left the model's turn closed
            case _:
                pass
        return literals.restore(text)

    def generation_prompt(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        enable_thinking: bool = True,
        reasoning_effort: str | None = None,
        template_kwargs: Mapping[str, Json] | None = None,
        now: dt.datetime | None = None,
    ) -> str:
        """What the generation prompt adds after ``messages``: ``<|im_start|>assistant\n``,
        or ``<|im_start|>assistant\n<think>\n`` where the template opens the thinking block
        itself (so the reply starts inside it).

        As llama.cpp's ``common_chat_template_generation_prompt_impl``: the rendering with
        the generation prompt, less the longest prefix it shares with the rendering without.
        Arguments and errors as :meth:`render`.
        """
        now = now or dt.datetime.now()
        with_prompt, literals = self._apply(messages, tools, True, enable_thinking, reasoning_effort, template_kwargs, now)
        without, _ = self._apply(messages, tools, False, enable_thinking, reasoning_effort, template_kwargs, now)
        common = len(os.path.commonprefix([with_prompt, without]))
        return literals.restore(with_prompt[common:]).text

    def _apply(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec],
        add_generation_prompt: bool,
        enable_thinking: bool,
        reasoning_effort: str | None,
        template_kwargs: Mapping[str, Json] | None,
        now: dt.datetime | None,
    ) -> tuple[str, _Literals]:
        """The template's output, with placeholders (llama.cpp's
        ``common_chat_template_direct_apply_impl``)."""
        kwargs = {**self.default_kwargs, **(template_kwargs or {})}
        switch = kwargs.get("enable_thinking")
        if isinstance(switch, bool):
            enable_thinking = switch
        elif isinstance(switch, str):
            raise TemplateRenderError('invalid type for "enable_thinking" (expected boolean, got string)')
        if reasoning_effort == "none":
            enable_thinking = False
            kwargs.pop("reasoning_effort", None)
        elif reasoning_effort:
            kwargs["reasoning_effort"] = reasoning_effort
        now = dt.datetime.now() if now is None else now

        shaped = self._shape(self._messages_json(messages))
        literals = _Literals(self._token_texts, self._protected)
        context: dict[str, Json] = {}
        if isinstance(kwargs.get("preserve_reasoning"), bool):
            context.update(_preserve_reasoning_vars(kwargs["preserve_reasoning"]))
        effort = kwargs.get("reasoning_effort")
        if isinstance(effort, str) and effort:
            context["reasoning_effort"] = context["reasoning_strength"] = literals.protect(effort)
        context.update(
            messages=literals.protect_json(shaped),
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            enable_thinking=enable_thinking,
        )
        if tools:
            context["tools"] = literals.protect_json([_tool_json(t) for t in tools])
        context.update(datetime=now.strftime("%b %d %Y"), date_string=now.strftime("%d %b %Y"))
        context.update((k, literals.protect_json(v)) for k, v in kwargs.items())
        if add_generation_prompt:
            context["add_generation_prompt"] = True
        context["strftime_now"] = _strftime_now(now)
        context[_LITERALS_VAR] = literals

        try:
            text = self._template.render(context)
        except _Raised as e:
            message = literals.restore(e.message or "").text
            raise TemplateRenderError(f"the model's chat template refused the request: {message}", message) from e
        except Exception as e:
            message = literals.restore(str(e)).text
            raise TemplateRenderError(f"the model's chat template failed on the request: {message}") from e
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.strip_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: len(text) - len(self.eos_token)]
        return text, literals


    def _messages_json(self, messages: Sequence[ChatMessage]) -> list[Json]:
        """The messages as llama-server passes an OpenAI request's messages to a template
        (``common_chat_msg::to_json_oaicompat``)."""
        names: dict[str, str] = {}
        out = []
        for m in messages:
            content, reasoning = m.content, m.reasoning
            if self._trim:
                content, reasoning = content.strip(_C_WHITESPACE), reasoning.strip(_C_WHITESPACE)
            item: Json = {"role": m.role.value, "content": content}
            if reasoning:
                item["reasoning_content"] = reasoning
            if m.role is Role.TOOL and names.get(m.tool_call_id):
                item["name"] = names[m.tool_call_id]
            if m.tool_call_id:
                item["tool_call_id"] = self._ids(m.tool_call_id)
            if m.tool_calls:
                item["tool_calls"] = [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    | ({"id": self._ids(c.call_id)} if c.call_id else {})
                    for c in m.tool_calls
                ]
                names.update((c.call_id, c.name) for c in m.tool_calls)
            out.append(item)
        return out

    def _shape(self, messages: list[Json]) -> list[Json]:
        """The messages as this template takes them: llama-server's caps-driven fixes
        (``common_chat_templates_apply_jinja``), then its family's."""
        caps = self.caps
        if not self.system_anywhere:
            messages = _fold_system_turns(messages)
        if caps.supports_typed_content and not caps.supports_string_content:
            messages = [m | {"content": [{"type": "text", "text": m["content"]}]} for m in messages]
        if not caps.supports_system_role and messages and messages[0]["role"] == "system":
            system, *messages = messages
            if messages:
                messages[0] = messages[0] | {"content": _joined(system["content"], messages[0]["content"])}
        if caps.supports_object_arguments:
            messages = [_object_arguments(m) if "tool_calls" in m else m for m in messages]
        match self._family:
            case _Family.MINISTRAL_3:
                return _ministral_3(messages)
            case _Family.GPT_OSS:
                return _thinking_field(messages, drop_call_content=True)
            case _Family.LFM2:
                return _thinking_field(messages, drop_call_content=False)
            case _Family.DEEPSEEK_V4:
                return _deepseek_v4(messages)
            case _Family.GEMMA_4_LEGACY:
                return _gemma_4_legacy(messages)
            case _Family.GEMMA_4 | _Family.OTHER:
                return messages
            case unreachable:
                assert_never(unreachable)


def _fold_system_turns(messages: list[Json]) -> list[Json]:
    """The system turns after the first message folded into the turn before them when that is a
    user or tool turn (its text, a blank line, theirs), else into the next user turn (theirs
    first), else made a user turn where they stand: for templates that cannot render a system
    turn in the middle. Folded into the turn before, as Claude Code's are (after its prompt and
    after tool results), a turn renders the same whatever follows it, so the prompt of one
    request stays a prefix of the next one's and the prefix cache hits."""
    out: list[Json] = []
    pending: list[Json] = []  # system turns after an assistant turn, for the next user turn
    for i, m in enumerate(messages):
        if m["role"] == "system" and i > 0:
            if out and out[-1]["role"] in ("user", "tool") and not pending:
                out[-1] = out[-1] | {"content": f"{_text(out[-1]['content'])}\n\n{_text(m['content'])}"}
            else:
                pending.append(m)
            continue
        if pending and m["role"] == "user":
            m = m | {"content": "\n\n".join([*(_text(p["content"]) for p in pending), _text(m["content"])])}
            pending = []
        elif pending:
            out += [{"role": "user", "content": _text(p["content"])} for p in pending]
            pending = []
        out.append(m)
    return out + [{"role": "user", "content": _text(p["content"])} for p in pending]


def _joined(system: Json, content: Json) -> Json:
    """A system turn folded into the next turn: its text, a newline, the turn's text (the
    first text part of typed contents, where llama-server fails)."""
    if isinstance(content, str):
        return f"{_text(system)}\n{content}"
    parts = list(content)
    first = next((i for i, p in enumerate(parts) if p.get("type") == "text"), None)
    if first is None:
        return [{"type": "text", "text": _text(system)}, *parts]
    parts[first] = parts[first] | {"text": f"{_text(system)}\n{parts[first]['text']}"}
    return parts


def _text(content: Json) -> str:
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content if p.get("type") == "text")


def _object_arguments(message: Json) -> Json:
    """An assistant turn with its calls' arguments parsed, for templates that read them as
    objects (llama.cpp's ``func_args_not_string``)."""
    calls = []
    for call in message["tool_calls"]:
        try:
            arguments = json.loads(call["function"]["arguments"], parse_constant=_no_constant)
        except ValueError as e:
            raise TemplateRenderError(f"the arguments of tool call {call['function']['name']!r} are not JSON: {e}") from e
        calls.append(call | {"function": call["function"] | {"arguments": arguments}})
    return message | {"tool_calls": calls}


def _tool_json(tool: ToolSpec) -> Json:
    """A tool as llama-server passes it (``common_chat_tools_to_json_oaicompat``)."""
    try:
        parameters = json.loads(tool.parameters, parse_constant=_no_constant)
    except ValueError as e:
        raise TemplateRenderError(f"the parameters of tool {tool.name!r} are not JSON: {e}") from e
    return {"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": parameters}}
