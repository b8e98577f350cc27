"""The canned model outputs of llama.cpp's ``tests/test-chat.cpp``, read from its C++ source.

Each ``tst.test(INPUT)...run()`` chain of that file is one case: a model output, the template
it was written for (``peg_tester(PATH)``), the request's settings (tools, thinking, reasoning
format, parallel calls, continuation...) and the expected message (content, reasoning, tool
calls). This module reads them with a small evaluator of the C++ subset the file uses (string
literals, raw strings, brace lists, the file's named tools and messages and its
``simple_assist_msg``-style helpers). A chain it cannot evaluate is kept with the reason, so the
test counts it instead of losing it. Nothing of the file is copied: it is read from the sdist
(:mod:`tests.support.llama_sdist`) at test time.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs


@attrs.frozen
class Tool:
    name: str
    parameters: str
    """The JSON text of the arguments' schema."""


@attrs.frozen
class Call:
    name: str
    arguments: str
    call_id: str = ""


@attrs.frozen
class Message:
    content: str = ""
    reasoning: str = ""
    calls: tuple[Call, ...] = ()


@attrs.frozen
class Case:
    template: str
    """The template's file stem (``models/templates/STEM.jinja``)."""
    line: int
    """The line of ``tests/test-chat.cpp`` where the chain starts."""
    input: str = ""
    tools: tuple[Tool, ...] = ()
    reasoning_format: str = "NONE"
    enable_thinking: bool = True
    parallel: bool = False
    partial: bool = False
    continuation: bool = False
    json_schema: bool = False
    tool_choice: str = "AUTO"
    expect: Message = Message()
    error: str = ""
    """Why the chain could not be evaluated ("" when it was)."""


_TOKEN = re.compile(
    r"""(?P<ws>\s+)|(?P<comment>//[^\n]*|/\*.*?\*/)
    |(?P<raw>(?:u8|L|u|U)?R"(?P<delim>[^(\s]*)\((?P<body>.*?)\)(?P=delim)")
    |(?P<str>(?:u8|L|u|U)?"(?:[^"\\\n]|\\.)*")
    |(?P<char>'(?:[^'\\\n]|\\.)+')
    |(?P<num>\d[\w.]*)
    |(?P<ident>[A-Za-z_]\w*(?:::\w+)*)
    |(?P<punct>->|::|&&|\|\||==|!=|<=|>=|\+\+|--|[-+*/%<>=!&|^~?:;,.(){}\[\]\#])""",
    re.S | re.X,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0", "a": "\a", "b": "\b",
            "f": "\f", "v": "\v", "?": "?"}


def _unescape(body: str) -> str:
    out: list[str] = []
    data = body.encode("utf-8")
    i = 0
    raw = bytearray()
    while i < len(data):
        c = data[i : i + 1]
        if c != b"\\":
            raw += c
            i += 1
            continue
        e = chr(data[i + 1])
        if e == "x":
            m = re.match(rb"[0-9a-fA-F]+", data[i + 2 :])
            assert m is not None
            raw.append(int(m.group(), 16) & 0xFF)
            i += 2 + len(m.group())
        elif e in "uU":
            n = 4 if e == "u" else 8
            raw += chr(int(data[i + 2 : i + 2 + n], 16)).encode("utf-8")
            i += 2 + n
        else:
            raw += _ESCAPES[e].encode("utf-8")
            i += 2
    out.append(raw.decode("utf-8"))
    return "".join(out)


@attrs.frozen
class _Tok:
    kind: str
    text: str
    value: Any
    line: int


def _tokens(source: str) -> list[_Tok]:
    toks = []
    pos = 0
    line = 1
    while pos < len(source):
        m = _TOKEN.match(source, pos)
        if m is None:
            raise ValueError(f"line {line}: cannot tokenize {source[pos:pos + 20]!r}")
        kind = m.lastgroup if m.lastgroup != "delim" and m.lastgroup != "body" else "raw"
        if m.group("raw") is not None:
            kind = "str"
            value: Any = m.group("body")
        elif m.group("str") is not None:
            kind = "str"
            value = _unescape(m.group("str").split('"', 1)[1][:-1])
        else:
            value = m.group()
        if kind not in ("ws", "comment"):
            toks.append(_Tok(kind or "", m.group(), value, line))
        line += m.group().count("\n")
        pos = m.end()
    return toks


class _Unknown(Exception):
    """An expression the evaluator does not know (the chain is kept with this reason)."""


def _msg(content: str = "", reasoning: str = "", name: str = "", arguments: str = "", call_id: str = "") -> Message:
    calls = (Call(name, arguments, call_id),) if name or call_id else ()
    return Message(content, reasoning, calls)


_HELPERS: dict[str, Any] = {
    "simple_assist_msg": _msg,
    "message_with_tool_calls": lambda name, args: _msg("", "", name, args),
    "message_with_tool_calls_and_reasoning": lambda name, args, reasoning: _msg("", reasoning, name, args),
    "message_with_reasoning_content_and_multiple_tool_calls": lambda reasoning, content, calls: Message(
        content, reasoning, tuple(Call(n, a) for n, a in calls)),
    "message_with_content_and_tool_call": lambda content, name, args: _msg(content, "", name, args),
    "message_with_reasoning_and_tool_call": lambda reasoning, name, args: _msg("", reasoning, name, args),
    "std::string": lambda s="": s,
}


class _Reader:
    def __init__(self, toks: list[_Tok]) -> None:
        self.toks = toks
        self.i = 0
        self.names: dict[str, Any] = {"true": True, "false": False}

    def peek(self, k: int = 0) -> _Tok:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def take(self, text: str | None = None) -> _Tok:
        tok = self.toks[self.i]
        if text is not None and tok.text != text:
            raise _Unknown(f"line {tok.line}: expected {text!r}, got {tok.text!r}")
        self.i += 1
        return tok

    def skip_balanced(self) -> None:
        """Skip one token, or a bracketed group when it opens one."""
        pairs = {"(": ")", "{": "}", "[": "]"}
        tok = self.take()
        if tok.text not in pairs:
            return
        depth = 1
        while depth:
            t = self.take().text
            if t in pairs:
                depth += 1
            elif t in pairs.values():
                depth -= 1

    def expr(self) -> Any:
        """One expression: evaluated, or :class:`_Unknown` (the tokens are consumed either way)."""
        start = self.i
        try:
            value = self._primary()
            while self.peek().text == "+":
                self.take()
                value = value + self._primary()
            if self.peek().text not in (",", ")", "}", ";"):
                raise _Unknown(f"line {self.peek().line}: unexpected {self.peek().text!r}")
            return value
        except _Unknown:
            self.i = start
            depth = 0
            while True:
                t = self.peek().text
                if depth == 0 and t in (",", ")", "}", ";"):
                    break
                if t in "({[":
                    depth += 1
                elif t in ")}]":
                    depth -= 1
                self.take()
            raise

    def _primary(self) -> Any:
        tok = self.peek()
        if tok.kind == "str":
            text = ""
            while self.peek().kind == "str":
                text += self.take().value
            return text
        if tok.text == "{":
            self.take()
            items = []
            while self.peek().text != "}":
                items.append(self.expr())
                if self.peek().text == ",":
                    self.take()
            self.take("}")
            return items
        if tok.kind == "num":
            self.take()
            return int(tok.text) if tok.text.isdigit() else tok.text
        if tok.kind == "ident":
            self.take()
            if tok.text in self.names:
                value = self.names[tok.text]
                while self.peek().text == ".":
                    self.take()
                    attr = self.take().text
                    value = getattr(value, attr)
                return value
            if tok.text.startswith(("COMMON_REASONING_FORMAT_", "COMMON_CHAT_TOOL_CHOICE_", "COMMON_CHAT_CONTINUATION_")):
                return tok.text.rsplit("_", 1)[-1] if "CONTINUATION" not in tok.text else tok.text
            if tok.text in _HELPERS and self.peek().text == "(":
                self.take("(")
                args = []
                while self.peek().text != ")":
                    args.append(self.expr())
                    if self.peek().text == ",":
                        self.take()
                self.take(")")
                return _HELPERS[tok.text](*args)
            raise _Unknown(f"line {tok.line}: unknown name {tok.text!r}")
        raise _Unknown(f"line {tok.line}: unexpected {tok.text!r}")


_UNREAD = ("messages", "json_schema")
"""Methods whose arguments are not read: the history (used to render the prompt only) and a
response format's schema (the case is marked ``json_schema``)."""
_METHODS_BOOL = {"enable_thinking": "enable_thinking", "parallel_tool_calls": "parallel", "is_partial": "partial"}


def _tool(value: Any) -> Tool:
    if isinstance(value, Tool):
        return value
    if isinstance(value, list) and len(value) == 3 and all(isinstance(v, str) for v in value):
        return Tool(value[0], value[2])
    raise _Unknown(f"not a tool: {value!r}")


def _call(value: Any) -> Call:
    name, args, call_id = (list(value) + ["", "", ""])[:3]
    return Call(name, args, call_id if isinstance(call_id, str) else "")


def cases(path: Path) -> list[Case]:
    """Every ``.test(...)...run()`` chain of ``tests/test-chat.cpp`` at ``path``, in file order."""
    r = _Reader(_tokens(path.read_text(encoding="utf-8")))
    testers: dict[str, list[str]] = {}
    loops = _loops(r)
    loops["template_path"] = [
        p for k in range(len(r.toks) - 2) if r.toks[k].text == "test_lfm2_parser" and r.toks[k + 1].text == "("
        for p in ([r.toks[k + 2].value] if r.toks[k + 2].kind == "str" else loops.get(r.toks[k + 2].text, []))
    ]
    out: list[Case] = []
    while r.i < len(r.toks) - 1:
        tok = r.peek()
        # static common_chat_tool NAME{ "name", "description", "parameters" };
        if tok.text == "common_chat_tool" and r.peek(1).kind == "ident" and r.peek(2).text == "{":
            name = r.peek(1).text
            r.i += 2
            try:
                value = r.expr()
                r.names[name] = Tool(value[0], value[2])
            except (_Unknown, IndexError, TypeError):
                pass
            continue
        # [const|static] common_chat_msg NAME = EXPR;  /  auto NAME = EXPR;  /  std::string NAME = EXPR;
        if tok.text in ("common_chat_msg", "auto", "std::string") and r.peek(1).kind == "ident" and r.peek(2).text == "=":
            name = r.peek(1).text
            r.i += 3
            if r.peek().text == "peg_tester":
                r.take()
                r.take("(")
                arg = r.take()
                paths = [arg.value] if arg.kind == "str" else loops.get(arg.text, [])
                testers[name] = [Path(p).stem for p in paths]
                continue
            try:
                r.names[name] = r.expr()
            except _Unknown:
                r.names.pop(name, None)
            continue
        if tok.kind == "ident" and tok.text in testers and r.peek(1).text == "." and r.peek(2).text == "test":
            r.i += 3
            out += _chain(r, testers[tok.text], tok.line)
            continue
        r.i += 1
    return out


def _loops(r: _Reader) -> dict[str, list[str]]:
    """The lists of strings that ``for (const ... NAME : { "a", "b" })`` loops bind, by name."""
    found: dict[str, list[str]] = {}
    for k in range(len(r.toks) - 8):
        if r.toks[k].text != "for" or r.toks[k + 1].text != "(":
            continue
        colon = next((j for j in range(k + 2, k + 8) if r.toks[j].text == ":"), None)
        if colon is None or r.toks[colon + 1].text != "{":
            continue
        values = []
        j = colon + 2
        while r.toks[j].kind == "str" or r.toks[j].text == ",":
            if r.toks[j].kind == "str":
                values.append(r.toks[j].value)
            j += 1
        if values and r.toks[j].text == "}":
            found[r.toks[colon - 1].text] = values
    return found


def _chain(r: _Reader, templates: list[str], line: int) -> list[Case]:
    fields: dict[str, Any] = {}
    expect = Message()
    error = ""
    r.take("(")
    try:
        fields["input"] = r.expr()
    except _Unknown as exc:
        error = str(exc)
    r.take(")")
    while r.peek().text == ".":
        r.take()
        method = r.take().text
        r.take("(")
        args = []
        if method in _UNREAD:
            r.i -= 1
            r.skip_balanced()
            if method != "messages":
                fields[method] = True
            continue
        while r.peek().text != ")":
            try:
                args.append(r.expr())
            except _Unknown as exc:
                error = error or f"{method}: {exc}"
                args.append(None)
            if r.peek().text == ",":
                r.take()
        r.take(")")
        if method == "run":
            break
        if error:
            continue
        try:
            match method:
                case "reasoning_format":
                    fields["reasoning_format"] = args[0]
                case "tools":
                    fields["tools"] = tuple(_tool(t) for t in args[0])
                case "enable_thinking" | "parallel_tool_calls" | "is_partial":
                    fields[_METHODS_BOOL[method]] = bool(args[0])
                case "tool_choice":
                    fields["tool_choice"] = args[0]
                case "continue_final_message":
                    fields["continuation"] = args[0] != "COMMON_CHAT_CONTINUATION_NONE"
                case "add_generation_prompt":
                    fields["continuation"] = fields.get("continuation", False) or not args[0]
                case "expect_reconstruction":
                    pass
                case "expect":
                    if not isinstance(args[0], Message):
                        raise _Unknown(f"not a message: {args[0]!r}")
                    expect = args[0]
                case "expect_content":
                    expect = attrs.evolve(expect, content=args[0])
                case "expect_reasoning":
                    expect = attrs.evolve(expect, reasoning=args[0])
                case "expect_tool_calls":
                    expect = attrs.evolve(expect, calls=tuple(_call(c) for c in args[0]))
                case _:
                    raise _Unknown(f"unknown method {method!r}")
        except (_Unknown, TypeError, IndexError) as exc:
            error = f"{method}: {exc}"
    return [Case(template=t, line=line, expect=expect, error=error, **fields) for t in templates]

