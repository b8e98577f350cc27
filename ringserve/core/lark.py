"""Lark grammars to llama.cpp GBNF: the input grammar of a Responses ``custom`` tool.

A Responses ``custom`` tool may constrain its input with ``format: {"type": "grammar", "syntax":
"lark", "definition": ...}``; Codex CLI's freeform ``apply_patch`` tool does (its grammar is in
``tests/data/agents/codex_gpt55.jsonl``). :func:`lark_to_gbnf` turns such a definition into
GBNF text whose start rule is ``root``, for ``llama_sampler_init_grammar``.

Lark's grammar language: https://lark-parser.readthedocs.io/en/latest/grammar.html. GBNF:
``grammars/README.md`` of llama.cpp (https://github.com/ggml-org/llama.cpp). What is translated:

* rules (``name: ...``) and terminals (``NAME: ...``), with the modifiers ``?`` / ``!`` and
  priorities (``name.2:``), which shape Lark's tree or lexer, not the language: dropped;
* alternatives ``|`` (across lines too), sequences, groups ``( )``, optional ``[ ]`` and ``?``,
  ``*``, ``+``, ``~ n`` and ``~ n..m``; aliases ``-> name`` (tree shape only): dropped;
* literals ``"..."`` (with ``i``: case-insensitive), ranges ``"a".."z"`` of one character each;
* regular expressions ``/.../``, the subset: literal characters and escapes, ``.`` (any character
  but a newline; any at all with the ``s`` flag), classes ``[...]`` / ``[^...]`` with ranges and
  ``\\d \\w \\s`` (ASCII only; and their negations outside a class), groups ``( )`` and ``(?: )``, ``|``, and
  the quantifiers ``* + ? {n} {n,} {n,m}`` (lazy ones too: laziness does not change the language);
* ``%import common.NAME`` (and ``%import common (A, B)``) for the terminals of Lark's
  ``common.lark`` listed in :data:`COMMON`.

Everything else is refused with a :class:`LarkGrammarError` that names the construct and where it
is (groups nested deeper than :data:`MAX_DEPTH` too): ``%ignore`` (it lets ignored text appear between any two tokens, which a grammar over
characters cannot say rule by rule), ``%declare`` / ``%override`` / ``%extend``, imports from
other modules, templates, regex anchors, lookarounds, backreferences, flags other than ``i``
on literals and ``s`` on expressions, and any name used but not defined.

:func:`check` is what a request's grammar must pass before the engine is asked (a Responses
``custom`` tool's, on a worker thread: the translation's time grows with the grammar): at most
:data:`MAX_CHARS` characters, translated, and taken by llama.cpp's grammar sampler as ringserve
writes it, as text and inside a JSON string (``core/llama_grammar.py``: no left recursion, a
finite text for every rule, repetitions within llama.cpp's limits).

The result accepts the strings Lark's grammar derives. Lark's own parser tokenizes first (the
longest match of each terminal), so on grammars whose terminals overlap it can refuse a string
the grammar derives; a decoder under the GBNF can then write a string Lark would not parse. For
``apply_patch`` the two agree: its regexes never cross a line end and every line is led by a
literal.

:func:`json_string` turns such GBNF (any GBNF of literals and classes) into the grammar of the same
texts written inside a JSON string, for a model family that writes a freeform tool's input as a
JSON string argument.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import attrs

from ringserve.core import llama_grammar

__all__ = ["COMMON", "MAX_CHARS", "MAX_DEPTH", "LarkGrammarError", "check", "json_string", "lark_rules",
           "lark_to_gbnf"]

#: The longest grammar :func:`check` takes, in characters (Codex's ``apply_patch`` grammar is about 2,000).
MAX_CHARS = 65_536
#: The deepest groups may nest (``( )`` and ``[ ]`` of a rule, ``( )`` of a regular expression, each counted).
MAX_DEPTH = 64


class LarkGrammarError(ValueError):
    """A Lark grammar that cannot be translated: the message names the construct and its line."""


#: Terminals of Lark's ``common.lark`` (https://github.com/lark-parser/lark, ``lark/grammars/common.lark``)
#: that ``%import common.NAME`` brings in, as GBNF bodies.
COMMON: dict[str, str] = {
    "LF": r'"\n"',
    "CR": r'"\r"',
    "NEWLINE": r'("\r"? "\n")+',
    "WS_INLINE": r'[ \t]+',
    "WS": r'[ \t\x0C\r\n]+',
    "DIGIT": "[0-9]",
    "HEXDIGIT": "[a-fA-F0-9]",
    "INT": "[0-9]+",
    "SIGNED_INT": '[+-]? [0-9]+',
    "LCASE_LETTER": "[a-z]",
    "UCASE_LETTER": "[A-Z]",
    "LETTER": "[a-zA-Z]",
    "WORD": "[a-zA-Z]+",
    "CNAME": "[_a-zA-Z] [_a-zA-Z0-9]*",
}

_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\f\r]+|\\\n)
  | (?P<comment>//[^\n]*)
  | (?P<nl>\n)
  | (?P<directive>%[a-z]+)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<arrow>->)
  | (?P<dots>\.\.)
  | (?P<number>[0-9]+)
  | (?P<name>[_a-zA-Z][_a-zA-Z0-9]*)
  | (?P<op>[:|()\[\]?*+~.,{}])
    """,
    re.VERBOSE,
)


@attrs.frozen
class _Token:
    kind: str
    text: str
    line: int


def _tokens(text: str) -> list[_Token]:
    """The grammar's tokens; a newline token ends a definition unless brackets are open."""
    out: list[_Token] = []
    line, pos, depth = 1, 0, 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise LarkGrammarError(f"line {line}: unexpected character {text[pos]!r}")
        kind = match.lastgroup or ""
        value = match.group()
        pos = match.end()
        if kind in ("ws", "comment"):
            line += value.count("\n")
            continue
        if kind == "nl":
            line += 1
            if depth == 0:
                out.append(_Token("nl", value, line - 1))
            continue
        if value in ("(", "["):
            depth += 1
        elif value in (")", "]"):
            depth -= 1
        out.append(_Token(kind, value, line))
    out.append(_Token("nl", "\n", line))
    return out


def _definitions(tokens: list[_Token]) -> Iterator[list[_Token]]:
    """Split the tokens into definitions and directives; a line that starts with ``|`` continues the one before."""
    current: list[_Token] = []
    continued = False  # the next token but newlines is a "|" (the tokens are read from the end)
    continues = [False] * len(tokens)
    for i in range(len(tokens) - 1, -1, -1):
        continues[i] = continued
        if tokens[i].kind != "nl":
            continued = tokens[i].text == "|"
    for i, token in enumerate(tokens):
        if token.kind == "nl":
            if continues[i]:
                continue
            if current:
                yield current
            current = []
        else:
            current.append(token)


def _gbnf_name(name: str, prefix: str = "") -> str:
    """A Lark name as a GBNF rule name (llama.cpp allows ``[a-zA-Z0-9-]``; ``root`` is taken),
    after ``prefix``."""
    out = prefix + name.replace("_", "-")
    return "lark-root" if out == "root" else out


def _char(code: int, *, in_class: bool) -> str:
    r"""One character as GBNF writes it inside a string literal or a class (llama.cpp's ``parse_char``
    knows the escapes ``\\ \" \[ \]``, ``\t \r \n`` and ``\xNN \uNNNN``; in a class ``-`` and ``^``
    are written as hex so that they are never a range or a negation)."""
    c = chr(code)
    if c in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c]
    if c in ('\\[]"' if in_class else '\\"'):
        return "\\" + c
    if (in_class and c in "-^") or code < 0x20 or code == 0x7F:
        return f"\\x{code:02X}"
    return c


def _single(body: str) -> bool:
    """Whether GBNF ``body`` is one item (no space or ``|`` outside quotes, classes and parentheses)."""
    depth, quote, klass, escaped = 0, False, False, False
    for c in body:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif quote:
            quote = c != '"'
        elif klass:
            klass = c != "]"
        elif c == '"':
            quote = True
        elif c == "[":
            klass = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif depth == 0 and c in " |":
            return False
    return True


def _group(body: str) -> str:
    """``body`` as one item: as it is when it is one already, in parentheses otherwise."""
    return body if _single(body) else "(" + body + ")"


def _literal(text: str, *, ignore_case: bool) -> str:
    if not text:
        return '""'
    if not ignore_case:
        return '"' + "".join(_char(ord(c), in_class=False) for c in text) + '"'
    parts = []
    for c in text:
        if c.lower() != c.upper():
            parts.append("[" + _char(ord(c.lower()), in_class=True) + _char(ord(c.upper()), in_class=True) + "]")
        else:
            parts.append('"' + _char(ord(c), in_class=False) + '"')
    return "(" + " ".join(parts) + ")"


_STRING_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0", "\\": "\\", '"': '"', "'": "'", "/": "/"}


def _unquote(token: _Token) -> tuple[str, bool]:
    """A Lark string literal's text, and whether it is case-insensitive."""
    body = token.text
    ignore_case = body.endswith("i")
    body = body[1:-2] if ignore_case else body[1:-1]
    out = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = body[i + 1]
        if e in _STRING_ESCAPES:
            out.append(_STRING_ESCAPES[e])
            i += 2
        elif e in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[e]
            digits = body[i + 2 : i + 2 + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise LarkGrammarError(f"line {token.line}: bad escape \\{e}{digits} in {token.text}")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        else:
            raise LarkGrammarError(f"line {token.line}: unsupported escape \\{e} in {token.text}")
    return "".join(out), ignore_case


# -- regular expressions ------------------------------------------------------------------------

#: ``\d \w \s`` in their ASCII sense (Python's ``re.ASCII``): Lark's Unicode classes are wider, and a
#: narrower class only keeps a decoder from writing a few characters the grammar allows.
_CLASS_SHORTHANDS = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r\\x0C\\x0B"}
_REGEX_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}


@attrs.define
class _Regex:
    """A recursive-descent reader of one Lark regular expression (Python ``re`` syntax, a subset)."""

    pattern: str
    dotall: bool
    where: str
    pos: int = 0
    depth: int = 0

    def fail(self, what: str) -> LarkGrammarError:
        return LarkGrammarError(f"{self.where}: {what} is not supported in a regular expression (at {self.pos} of /{self.pattern}/)")

    def peek(self) -> str:
        return self.pattern[self.pos] if self.pos < len(self.pattern) else ""

    def take(self) -> str:
        c = self.peek()
        self.pos += 1
        return c

    def parse(self) -> str:
        out = self.alternation()
        if self.pos != len(self.pattern):
            raise self.fail(f"an unbalanced {self.peek()!r}")
        return out

    def alternation(self) -> str:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.take()
            branches.append(self.sequence())
        return " | ".join(branches)

    def sequence(self) -> str:
        items: list[str] = []
        while self.peek() not in ("", "|", ")"):
            atom = self.atom()
            quantifier = self.quantifier()
            if quantifier and atom[-1] in "*+?}":
                atom = "(" + atom + ")"
            items.append(atom + quantifier)
        return " ".join(items) if items else '""'

    def quantifier(self) -> str:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.take()
            out = c
        elif c == "{":
            match = re.compile(r"\{(\d+)(,(\d*))?\}").match(self.pattern, self.pos)
            if match is None:
                raise self.fail("a '{' that is not a repetition")
            self.pos = match.end()
            low, comma, high = match.group(1), match.group(2), match.group(3)
            out = "{" + low + ("," + high if comma else "") + "}"
        else:
            return ""
        if self.peek() == "?":  # lazy: the same language
            self.take()
        if self.peek() in ("*", "+", "?", "{"):
            raise self.fail("a quantifier on a quantifier")
        return out

    def atom(self) -> str:
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                if self.pattern.startswith("?:", self.pos):
                    self.pos += 2
                else:
                    raise self.fail("a group of the form (?...) other than (?:...)")
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise LarkGrammarError(f"{self.where}: groups nested deeper than {MAX_DEPTH} in /{self.pattern[:40]}.../")
            inner = self.alternation()
            self.depth -= 1
            if self.take() != ")":
                raise self.fail("an unclosed group")
            return _group(inner)
        if c == "[":
            return self.char_class()
        if c == ".":
            return "[\\x00-\\U0010FFFF]" if self.dotall else "[^\\n]"
        if c == "\\":
            return self.escape(in_class=False)
        if c in ("^", "$"):
            raise self.fail(f"the anchor {c!r}")
        if c in ("*", "+", "?", "{"):
            raise self.fail(f"a quantifier {c!r} with nothing before it")
        return '"' + _char(ord(c), in_class=False) + '"'

    def escape(self, *, in_class: bool) -> str:
        e = self.take()
        if e == "":
            raise self.fail("a trailing backslash")
        if e in _CLASS_SHORTHANDS:
            return _CLASS_SHORTHANDS[e] if in_class else "[" + _CLASS_SHORTHANDS[e] + "]"
        if e in "DWS":
            if in_class:
                raise self.fail(f"\\{e} inside a class")
            return "[^" + _CLASS_SHORTHANDS[e.lower()] + "]"
        if e in _REGEX_ESCAPES:
            code = ord(_REGEX_ESCAPES[e])
        elif e in "xu":
            width = 2 if e == "x" else 4
            digits = self.pattern[self.pos : self.pos + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"the escape \\{e}{digits}")
            self.pos += width
            code = int(digits, 16)
        elif e.isalnum():
            raise self.fail(f"the escape \\{e}")
        else:
            code = ord(e)
        return _char(code, in_class=in_class) if in_class else '"' + _char(code, in_class=False) + '"'

    def char_class(self) -> str:
        negate = self.peek() == "^"
        if negate:
            self.take()
        parts: list[str] = []
        first = True
        while True:
            c = self.take()
            if c == "":
                raise self.fail("an unclosed class")
            if c == "]" and not first:
                break
            first = False
            if c == "\\":
                parts.append(self.escape(in_class=True))
                continue
            if c == "[" and self.peek() == ":":
                raise self.fail("a POSIX class")
            low = ord(c)
            if self.peek() == "-" and self.pattern[self.pos + 1 : self.pos + 2] not in ("]", ""):
                self.take()
                high_c = self.take()
                if high_c == "\\":
                    raise self.fail("an escape as the end of a range")
                parts.append(_char(low, in_class=True) + "-" + _char(ord(high_c), in_class=True))
            else:
                parts.append(_char(low, in_class=True))
        return "[" + ("^" if negate else "") + "".join(parts) + "]"


def _regex(token: _Token) -> str:
    end = token.text.rindex("/")
    pattern, flags = token.text[1:end], token.text[end + 1 :]
    for flag in flags:
        if flag != "s":
            raise LarkGrammarError(f"line {token.line}: the regex flag {flag!r} is not supported in {token.text}")
    return _group(_Regex(pattern, "s" in flags, f"line {token.line}").parse())


# -- the grammar ---------------------------------------------------------------------------------


@attrs.define
class _Expansions:
    """A recursive-descent reader of one definition's body (Lark's ``expansions``)."""

    tokens: list[_Token]
    used: set[str]
    prefix: str = ""
    pos: int = 0
    depth: int = 0

    def peek(self) -> _Token | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> _Token:
        token = self.peek()
        if token is None:
            last = self.tokens[-1].line if self.tokens else 0
            raise LarkGrammarError(f"line {last}: the definition ends too soon")
        self.pos += 1
        return token

    def expect(self, text: str) -> None:
        token = self.take()
        if token.text != text:
            raise LarkGrammarError(f"line {token.line}: expected {text!r}, found {token.text!r}")

    def parse(self) -> str:
        out = self.expansions()
        token = self.peek()
        if token is not None:
            raise LarkGrammarError(f"line {token.line}: unexpected {token.text!r}")
        return out

    def expansions(self) -> str:
        alternatives = [self.alias()]
        while (token := self.peek()) is not None and token.text == "|":
            self.take()
            alternatives.append(self.alias())
        return alternatives[0] if len(alternatives) == 1 else " | ".join(alternatives)

    def alias(self) -> str:
        out = self.expansion()
        token = self.peek()
        if token is not None and token.kind == "arrow":
            self.take()
            if self.take().kind != "name":
                raise LarkGrammarError(f"line {token.line}: '->' needs a rule name")
        return out

    def expansion(self) -> str:
        items: list[str] = []
        while (token := self.peek()) is not None and token.text not in ("|", ")", "]") and token.kind != "arrow":
            items.append(self.expr())
        return " ".join(items) if items else '""'

    def expr(self) -> str:
        atom = self.atom()
        token = self.peek()
        if token is None or token.text not in ("?", "*", "+", "~"):
            return atom
        if atom[-1] in "*+?}":
            atom = "(" + atom + ")"
        self.take()
        if token.text != "~":
            return atom + token.text
        low = self.take()
        if low.kind != "number":
            raise LarkGrammarError(f"line {low.line}: '~' needs a count")
        nxt = self.peek()
        if nxt is None or nxt.kind != "dots":
            return f"{atom}{{{low.text}}}"
        self.take()
        high = self.take()
        if high.kind != "number":
            raise LarkGrammarError(f"line {high.line}: '..' needs a count")
        return f"{atom}{{{low.text},{high.text}}}"

    def atom(self) -> str:
        token = self.take()
        if token.text in ("(", "["):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise LarkGrammarError(f"line {token.line}: groups nested deeper than {MAX_DEPTH}")
            inner = self.expansions()
            self.depth -= 1
            self.expect(")" if token.text == "(" else "]")
            return "(" + inner + (")" if token.text == "(" else ")?")
        if token.kind == "string":
            nxt = self.peek()
            if nxt is not None and nxt.kind == "dots":
                self.take()
                return self._range(token, self.take())
            text, ignore_case = _unquote(token)
            return _literal(text, ignore_case=ignore_case)
        if token.kind == "regex":
            return _regex(token)
        if token.kind == "name":
            nxt = self.peek()
            if nxt is not None and nxt.text == "{":
                raise LarkGrammarError(f"line {token.line}: templates ({token.text}{{...}}) are not supported")
            self.used.add(token.text)
            return _gbnf_name(token.text, self.prefix)
        raise LarkGrammarError(f"line {token.line}: unexpected {token.text!r}")

    @staticmethod
    def _range(low: _Token, high: _Token) -> str:
        if high.kind != "string":
            raise LarkGrammarError(f"line {high.line}: a range needs two strings")
        a, b = _unquote(low)[0], _unquote(high)[0]
        if len(a) != 1 or len(b) != 1:
            raise LarkGrammarError(f"line {low.line}: a range needs one character on each side ({low.text}..{high.text})")
        return "[" + _char(ord(a), in_class=True) + "-" + _char(ord(b), in_class=True) + "]"


def _imports(definition: list[_Token]) -> list[str]:
    """The names a ``%import common...`` line brings in."""
    texts = [t.text for t in definition[1:]]
    line = definition[0].line
    if len(texts) == 3 and texts[:2] == ["common", "."]:
        names = [texts[2]]
    elif texts[:2] == ["common", "("] and texts[-1] == ")":
        names = [t for t in texts[2:-1] if t != ","]
    else:
        raise LarkGrammarError(f"line {line}: only '%import common.NAME' and '%import common (A, B)' are supported")
    for name in names:
        if name not in COMMON:
            raise LarkGrammarError(f"line {line}: common.{name} is not one of the supported imports ({', '.join(COMMON)})")
    return names


def lark_to_gbnf(text: str, start: str = "start") -> str:
    """Translate a Lark grammar into GBNF whose ``root`` rule derives Lark's ``start`` rule.

    Args:
        text: the Lark grammar (a custom tool's ``format.definition``).
        start: the Lark rule the input must match (Lark's default is ``start``).

    Returns:
        GBNF text, one rule a line, ``root ::= <start>`` first; for ``llama_sampler_init_grammar``.

    Raises:
        LarkGrammarError: a construct outside the supported subset (see the module doc), a name used
            but not defined, a name defined twice, or ``start`` not defined; the message says which
            and on what line.
    """
    first, rules = lark_rules(text, start)
    return "\n".join([f"root ::= {first}", *(f"{name} ::= {body}" for name, body in rules)]) + "\n"


def check(text: str, start: str = "start") -> None:
    """Whether ``text`` is a grammar the model can be decoded under (see the module docstring):
    at most :data:`MAX_CHARS` characters, translated by :func:`lark_rules`, and taken by
    llama.cpp's grammar sampler (:func:`~ringserve.core.llama_grammar.check`) both as text and
    inside a JSON string (:func:`json_string`), the two ways ``engine/gbnf.py`` writes a freeform
    tool's input. Its time grows with the grammar's size: the shell runs it on a worker thread.

    Raises:
        LarkGrammarError: too long, a construct outside the subset (as :func:`lark_to_gbnf`), or
            a grammar llama.cpp refuses or cannot finish: the message names the Lark rule (left
            recursion, a rule no finite text matches, a repetition past llama.cpp's limits).
    """
    if len(text) > MAX_CHARS:
        raise LarkGrammarError(f"longer than {MAX_CHARS:,} characters")
    first, rules = lark_rules(text, start)
    names = {_gbnf_name(name): name for name in _names(text)} | {"root": start}
    for form, inside in ((str, ""), (json_string, " (written inside a JSON string)")):
        gbnf = "".join([f"root ::= {first}\n", *(f"{name} ::= {form(body)}\n" for name, body in rules)])
        try:
            llama_grammar.check(gbnf)
        except llama_grammar.GrammarError as exc:
            rule = names.get(exc.rule.split("_")[0], exc.rule) if exc.rule else ""
            raise LarkGrammarError(f"{rule}: {exc.reason}{inside}" if rule else f"{exc.reason}{inside}") from None


def _names(text: str) -> Iterator[str]:
    """The names a grammar defines (rules, terminals, imported terminals), as :func:`lark_rules` reads them."""
    for definition in _definitions(_tokens(text)):
        head = definition[0]
        if head.kind == "directive":
            yield from _imports(definition)
        else:
            yield definition[1 if head.text in ("?", "!") else 0].text


def lark_rules(text: str, start: str = "start", prefix: str = "") -> tuple[str, tuple[tuple[str, str], ...]]:
    """A Lark grammar's GBNF rules, each named ``prefix`` and its name (for a grammar that holds
    them among its own rules): the name of ``start``'s rule, and every ``(name, body)``.

    Raises:
        LarkGrammarError: as :func:`lark_to_gbnf`.
    """
    rules: dict[str, str] = {}
    used: set[str] = set()
    for definition in _definitions(_tokens(text)):
        head = definition[0]
        if head.kind == "directive":
            if head.text != "%import":
                raise LarkGrammarError(f"line {head.line}: {head.text} is not supported")
            for imported in _imports(definition):
                rules.setdefault(imported, COMMON[imported])
            continue
        name_at = 1 if head.text in ("?", "!") else 0
        name = definition[name_at] if len(definition) > name_at else head
        if name.kind != "name":
            raise LarkGrammarError(f"line {head.line}: expected a rule or terminal name, found {name.text!r}")
        body_at = name_at + 1
        if body_at + 1 < len(definition) and definition[body_at].text == "." and definition[body_at + 1].kind == "number":
            body_at += 2  # a priority
        if body_at >= len(definition) or definition[body_at].text != ":":
            found = definition[body_at].text if body_at < len(definition) else "the line's end"
            raise LarkGrammarError(f"line {name.line}: expected ':' after {name.text}, found {found!r}")
        if name.text in rules:
            raise LarkGrammarError(f"line {name.line}: {name.text} is defined twice")
        rules[name.text] = _Expansions(definition[body_at + 1 :], used, prefix).parse()
    missing = sorted(used - rules.keys())
    if missing:
        raise LarkGrammarError(f"used but not defined: {', '.join(missing)}")
    if start not in rules:
        raise LarkGrammarError(f"the start rule {start!r} is not defined")
    return _gbnf_name(start, prefix), tuple((_gbnf_name(name, prefix), body) for name, body in rules.items())


# -- the same language inside a JSON string ------------------------------------------------------

#: What ``parse_char`` of llama.cpp's grammar parser reads after a backslash (besides ``x u U``).
_GBNF_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]"}
#: The characters a JSON string must escape (RFC 8259, section 7), as code point ranges.
_JSON_SPECIAL = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_MAX = 0x10FFFF


def _gbnf_char(text: str, i: int) -> tuple[int, int]:
    """The code point of the (maybe escaped) character at ``text[i]`` of a GBNF literal or class,
    and where the next one starts."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    e = text[i + 1]
    if e in "xuU":
        width = {"x": 2, "u": 4, "U": 8}[e]
        return int(text[i + 2 : i + 2 + width], 16), i + 2 + width
    if e not in _GBNF_ESCAPES:
        raise LarkGrammarError(f"the GBNF escape \\{e} is not supported")
    return ord(_GBNF_ESCAPES[e]), i + 2


def _subtract(ranges: list[tuple[int, int]], cut: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """``ranges`` (code point ranges, inclusive) without the code points of ``cut``."""
    for a, b in cut:
        kept = []
        for lo, hi in ranges:
            if b < lo or a > hi:
                kept.append((lo, hi))
                continue
            if lo < a:
                kept.append((lo, a - 1))
            if b < hi:
                kept.append((b + 1, hi))
        ranges = kept
    return ranges


def _json_escape(code: int) -> str:
    """A special character as a JSON string writes it (a short escape, else ``\\u00XX``), as a GBNF literal."""
    escaped = json.dumps(chr(code))[1:-1]
    return '"' + "".join(_char(ord(c), in_class=False) for c in escaped) + '"'


def _json_class(body: str) -> str:
    """A GBNF class (``[...]`` or ``[^...]``, its text between the brackets) over characters, as
    the GBNF of those characters written in a JSON string: the class without the characters JSON
    escapes, or the escapes of those among them."""
    negate = body.startswith("^")
    i, ranges = (1 if negate else 0), []
    while i < len(body):
        lo, i = _gbnf_char(body, i)
        hi = lo
        if i < len(body) - 1 and body[i] == "-":
            hi, i = _gbnf_char(body, i + 1)
        ranges.append((lo, hi))
    if negate:  # kept negated: what it leaves out, and the special characters
        raw = "[^" + body[1:] + '\\x00-\\x1F\\"\\\\]'
        ranges = _subtract([(0, _MAX)], tuple(ranges))
    else:
        kept = _subtract(ranges, _JSON_SPECIAL)
        raw = "[" + "".join(_char(lo, in_class=True) + ("" if lo == hi else "-" + _char(hi, in_class=True))
                            for lo, hi in kept) + "]" if kept else ""
    specials = [c for a, b in _JSON_SPECIAL for c in range(a, b + 1) if any(lo <= c <= hi for lo, hi in ranges)]
    parts = [raw] if raw else []
    parts += [_json_escape(c) for c in specials if len(json.dumps(chr(c))) == 4]  # "\\n", "\\"", ...
    for high in (0, 1):  # the others are \\u00XX, the last two digits 0X or 1X: one class per X's row
        digits = "".join(f"{c & 15:x}" for c in specials if c >> 4 == high and len(json.dumps(chr(c))) > 4)
        if digits:
            parts.append(f'"\\\\u00{high}" [{digits}]')
    if not parts:
        return "[^\\x00-\\U0010FFFF]"  # the empty class: nothing
    return parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")"


def _json_literal(body: str) -> str:
    """A GBNF string literal (its text between the quotes) as the literal of its text in a JSON string."""
    i, text = 0, []
    while i < len(body):
        code, i = _gbnf_char(body, i)
        text.append(chr(code))
    escaped = json.dumps("".join(text), ensure_ascii=False)[1:-1]
    return '"' + "".join(_char(ord(c), in_class=False) for c in escaped) + '"'


def json_string(gbnf: str) -> str:
    """GBNF for the same strings written inside a JSON string: each string the grammar derives,
    as its JSON encoding between the quotes (``"``, ``\\`` and control characters escaped, the
    short escapes where JSON has one, else ``\\u00XX``; every other character as it is).

    The escaping is a homomorphism (one fixed text per character), so the rules stay and only
    their terminals change: each literal becomes the literal of its escaped text, each class the
    choice of its characters that need no escape and the escapes of those that do. A model
    that writes a freeform tool's input as a JSON string argument is decoded under it.

    Raises:
        LarkGrammarError: an escape llama.cpp's grammar parser does not read.
    """
    out, i = [], 0
    while i < len(gbnf):
        c = gbnf[i]
        if c not in '"[':
            out.append(c)
            i += 1
            continue
        close = '"' if c == '"' else "]"
        j = i + 1
        while gbnf[j] != close:
            j += 2 if gbnf[j] == "\\" else 1
        body = gbnf[i + 1 : j]
        out.append(_json_literal(body) if c == '"' else _json_class(body))
        i = j + 1
    return "".join(out)
