"""The Jinja environment of a chat template: jinja2's sandbox configured as Hugging Face's
``apply_chat_template`` configures it (https://huggingface.co/docs/transformers/main/en/chat_templating_writing),
made to behave as llama.cpp's own Jinja where the two differ, and the variables llama-server gives
every template beyond the request's."""

from __future__ import annotations

import datetime as dt
import functools
import json
import operator
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.sandbox
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.utils import pass_context

from ringserve.formats.template import bounds
from ringserve.formats.template.base import Json
from ringserve.formats.template.bounds import Steps, current
from ringserve.formats.template.literals import LITERALS_VAR, InputDict, InputList, Literals
from ringserve.formats.template.probe import use


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face marks the assistant's tokens
    with it, https://github.com/huggingface/transformers/pull/30650): the body is rendered
    in place, as llama.cpp does."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_STEPS = jinja2.nodes.EnvironmentAttribute("steps")


class _BoundedCode(CodeGenerator):
    """jinja2's code generator with the hooks of a bounded render (``bounds.py``) where the
    sandbox has none: a loop goes over :class:`~ringserve.formats.template.bounds.Steps`; ``~``,
    comparisons and list, tuple and dict literals call the environment; a block's output goes
    to a counted buffer; and an output is written as :meth:`Environment.finalize` returns it."""

    def visit_For(self, node: jinja2.nodes.For, frame: Frame) -> None:
        node.iter = jinja2.nodes.Call(_STEPS, [node.iter], [], None, None, lineno=node.iter.lineno)
        super().visit_For(node, frame)

    def visit_Call(self, node: jinja2.nodes.Call, frame: Frame, forward_caller: bool = False) -> None:
        if node.node is _STEPS:  # what a loop goes over (no template can name an environment attribute)
            self.write("environment.steps(")
            self.visit(node.args[0], frame)
            self.write(")")
        else:
            super().visit_Call(node, frame, forward_caller=forward_caller)

    @optimizeconst
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.joined((")
        for item in node.nodes:
            self.visit(item, frame)
            self.write(", ")
        self.write("))")

    @optimizeconst
    def visit_Compare(self, node: jinja2.nodes.Compare, frame: Frame) -> None:
        """``a < b < c`` as ``compare('lt', a, (t := b)) and compare('lt', t, c)``: each operand
        once, in order."""
        self.write("(")
        left: jinja2.nodes.Expr | str = node.expr
        for i, operand in enumerate(node.ops):
            if i:
                self.write(" and ")
            self.write(f"environment.compare({operand.op!r}, ")
            if isinstance(left, str):
                self.write(left)
            else:
                self.visit(left, frame)
            self.write(", ")
            if i + 1 < len(node.ops):
                left = self.temporary_identifier()
                self.write(f"({left} := ")
                self.visit(operand.expr, frame)
                self.write(")")
            else:
                self.visit(operand.expr, frame)
            self.write(")")
        self.write(")")

    def visit_List(self, node: jinja2.nodes.List, frame: Frame) -> None:
        self.write("environment.literal(")
        super().visit_List(node, frame)
        self.write(")")

    def visit_Dict(self, node: jinja2.nodes.Dict, frame: Frame) -> None:
        self.write("environment.literal(")
        super().visit_Dict(node, frame)
        self.write(")")

    def visit_Tuple(self, node: jinja2.nodes.Tuple, frame: Frame) -> None:
        if node.ctx == "store":
            super().visit_Tuple(node, frame)
            return
        self.write("environment.literal(")
        super().visit_Tuple(node, frame)
        self.write(")")

    def buffer(self, frame: Frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.buffer()")

    def _output_child_pre(self, node: jinja2.nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write("environment.finalize(")

    def _output_child_post(self, node: jinja2.nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write(")")


_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq, "ne": operator.ne, "gt": operator.gt, "gteq": operator.ge, "lt": operator.lt,
    "lteq": operator.le, "in": lambda a, b: a in b, "notin": lambda a, b: a not in b,
}
_SCALARS = frozenset({str, int, float, bool, type(None)})
#: Types that are no iterators, as most values are.
_PLAIN = frozenset({str, int, float, bool, type(None), list, dict, tuple, InputList, InputDict})
_SEARCHING = frozenset({"in", "notin"})
#: The keyword arguments jinja2 passes every call, for its context.
_SCOPES = frozenset({"_loop_vars", "_block_vars"})
#: The methods of a list (or tuple) that compare each member with their argument.
_SEARCHES = frozenset({"index", "count", "remove"})
#: The methods of a list, dict or loop that compare or hash their arguments.
_COMPARES = frozenset({"index", "count", "remove", "get", "pop", "setdefault", "update", "fromkeys",
                       "changed"})
#: The methods of a list or dict that add members.
_GROWS = frozenset({"append", "extend", "insert", "update", "setdefault"})


def _iterator(value: Any) -> bool:
    """Whether ``value`` is an iterator (a generator, ``map``...), which can be read only once."""
    return hasattr(type(value), "__next__")


def _given(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a call less those jinja2 adds for its context."""
    if "_loop_vars" not in kwargs and "_block_vars" not in kwargs:
        return kwargs
    return {k: v for k, v in kwargs.items() if k not in _SCOPES}


def _added(method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Iterator[Any]:
    """The members (keys and values) that ``method`` of a list or dict (:data:`_GROWS`) added
    with ``args``."""
    match method:
        case "append":
            yield from args[:1]
        case "insert" | "setdefault":
            yield from args[:2]
        case "extend":
            yield from args[0] if args else ()
        case _:  # update
            for source in (*args, kwargs):
                pairs = source.items() if isinstance(source, Mapping) else source
                for pair in pairs:
                    yield from pair


class Environment(jinja2.sandbox.SandboxedEnvironment):
    """jinja2's sandbox as Hugging Face configures it (``trim_blocks``, ``lstrip_blocks``,
    loop controls, its ``tojson``, ``raise_exception``), each render bounded in steps and
    memory (``bounds.py``: a render runs inside :func:`~ringserve.formats.template.bounds.bounded`;
    ``lipsum``, jinja2's text generator, is not given), and, where llama.cpp's own Jinja
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

    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})
    code_generator_class = _BoundedCode

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag],
            finalize=self._finalize,
        )
        self.filters["tojson"] = _tojson
        self.filters["safe"] = _safe
        self.filters.update((name, _bounded_filter(name, f)) for name, f in self.filters.items())
        self.tests.update((name, _comparing_test(cast(Callable[..., Any], self.tests[name])))
                          for name in bounds.COMPARING_TESTS)
        self.globals["raise_exception"] = _raise_exception
        del self.globals["lipsum"]

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        budget = current()
        budget.steps -= 1
        if budget.steps < 0:
            budget.step(0)
        if operator == "+" and isinstance(left, str):
            if isinstance(right, str):
                budget.reserve(str.__len__(left) + str.__len__(right))
                return budget.made(left + right)
            if _is_null(right):
                return left
        if operator == "+" and isinstance(right, str) and _is_null(left):
            return right
        budget.reserve(bounds.binop_size(budget, operator, left, right))
        return budget.made(super().call_binop(context, operator, left, right))

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = current()
        budget.steps -= 1
        if budget.steps < 0:
            budget.step(0)
        if type(__obj) is jinja2.runtime.Macro:
            return budget.made(super().call(__context, __obj, *args, **kwargs))
        owner = getattr(__obj, "__self__", None)
        if owner is None or owner is __self:  # a macro, a global (namespace, dict...), the environment's own
            if type(__obj) is jinja2.runtime.LoopContext and args:  # a recursive loop's next level
                args = (Steps(args[0], budget), *args[1:])
        elif isinstance(owner, (str, bytes, int)) and not isinstance(owner, bool):  # a text's methods
            size = bounds.METHOD_SIZES.get(__obj.__name__)
            if size is not None:
                if __obj.__name__ == "join" and args:  # read twice
                    args = (list(args[0]), *args[1:])
                budget.reserve(size(budget, owner, *args, **_given(kwargs)))
            budget.step(bounds.weight(owner))
        elif isinstance(owner, (list, dict, tuple, jinja2.runtime.LoopContext)):
            name = __obj.__name__
            if name in _SEARCHES:
                budget.weigh(owner)
            if name in _GROWS:
                args = tuple(list(a) if _iterator(a) else a for a in args)  # read twice
                # its references, before it runs: l.extend(l) doubles l
                budget.reserve(sum(8 * len(a) for a in args if isinstance(a, (list, tuple, dict))))
            if name in _COMPARES:
                for value in (*args, *_given(kwargs).values()):
                    budget.weigh(value)
            if name in _GROWS and isinstance(owner, (bounds.MadeList, bounds.MadeDict)):
                before = sys.getsizeof(owner)
                result = super().call(__context, __obj, *args, **kwargs)
                budget.grew(owner, _added(name, args, _given(kwargs)), before)
                return result
        return budget.made(super().call(__context, __obj, *args, **kwargs))

    def getitem(self, obj: Any, argument: Any) -> Any:
        if type(argument) is str or type(argument) is int:
            return super().getitem(obj, argument)
        budget = current()
        budget.weigh(argument)  # hashed
        result = super().getitem(obj, argument)
        return budget.made(result) if isinstance(argument, slice) else result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """The sandbox's ``str.format`` and ``format_map``, refused before they run when they
        would not fit (:func:`~ringserve.formats.template.bounds.format_size`)."""
        formatting = super().wrap_str_format(value)
        if formatting is None:
            return None
        text, by_map = value.__self__, value.__name__ == "format_map"

        @functools.wraps(formatting)
        def bounded(*args: Any, **kwargs: Any) -> str:
            budget = current()
            fields = args[0] if by_map and args and isinstance(args[0], Mapping) else kwargs
            budget.reserve(bounds.format_size(budget, text, () if by_map else args, fields))
            return str(budget.made(formatting(*args, **kwargs)))

        return bounded

    def steps(self, items: Any) -> Steps:
        """What a ``for`` loop goes over: ``items``, a step each."""
        return Steps(items, current())

    def joined(self, parts: tuple[Any, ...]) -> str:
        """``a ~ b ~ c``, refused before it is made when it would not fit."""
        budget = current()
        budget.reserve(sum(budget.text_size(part) for part in parts))
        return budget.made("".join([str(part) for part in parts]))  # type: ignore[no-any-return]

    def compare(self, op: str, left: Any, right: Any) -> Any:
        """``left <op> right`` (``op`` as jinja2 names comparisons), its steps taken first: a
        container's members when it is compared (with ``==``, ``<``... as far as the left
        operand goes) or searched for (``in``); a text's or a list's searched (a dict's keys
        are hashed: only the left operand counts)."""
        if op in _SEARCHING:
            budget = current()
            if type(left) not in _SCALARS:
                budget.weigh(left)
            if not isinstance(right, dict):
                budget.weigh(right)
        elif type(left) not in _SCALARS and type(right) not in _SCALARS:
            current().weigh(left)
        return _COMPARE[op](left, right)

    def literal(self, value: Any) -> Any:
        """A list, tuple or dict written in the template, counted while it lives."""
        return current().made(value)

    def buffer(self) -> list[Any]:
        return current().buffer()

    def concat(self, pieces: Iterable[str]) -> str:
        """A block's output joined (a list: the result is counted while it lives), or the
        template's, as it is written (a generator: stopped as soon as it would not fit)."""
        budget = current()
        if isinstance(pieces, list):  # each piece counted as it came
            budget.reserve(sum(map(len, pieces)))
            return budget.made("".join(pieces))  # type: ignore[no-any-return]
        out: list[str] = []
        size = 0
        room = budget.memory - budget.live
        for piece in pieces:
            out.append(piece)
            size += len(piece) + 8
            if size > room:
                room = budget.memory - budget.live
                budget.check(size)
        budget.reserve(size)
        return "".join(out)

    @staticmethod
    def _finalize(value: Any) -> Any:
        """What an output (``{{ ... }}``) writes: a string as it is, anything else as text,
        refused before it is made when it would not fit."""
        if type(value) is str or isinstance(value, bounds.MadeStr):
            return value
        budget = current()
        budget.reserve(budget.text_size(value))
        return budget.made(str(value))

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if isinstance(obj, (InputList, InputDict)) and jinja2.sandbox.modifies_known_mutable(obj, attr):
            return False
        return bool(super().is_safe_attribute(obj, attr, value))


def _safe(value: Any) -> str:
    """``safe``: the value as text, escaped no more than any other (llama.cpp's)."""
    return str(value)


def _is_null(value: object) -> bool:
    return value is None or isinstance(value, jinja2.Undefined)


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """A jinja2 filter in a bounded render: a step, and a step per :data:`~bounds.BYTES_PER_STEP`
    of a text operand or :data:`~bounds.MEMBERS_PER_STEP` members of a container; refused before
    it runs when it would make more than fits (:data:`~bounds.FILTER_SIZES`); the members of
    its operand weighed when it compares them; its result counted while it lives, an iterator's
    (``map``, ``select``...) as a list."""
    first = 0 if getattr(f, "jinja_pass_arg", None) is None else 1  # after a context jinja2 passes
    size = bounds.FILTER_SIZES.get(name)
    comparing = bounds.COMPARING_FILTERS.get(name)

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = current()
        value: Any = args[first] if len(args) > first else None
        if type(value) not in _PLAIN and _iterator(value):  # read twice: by the size, then by the filter
            value = list(value)
            args = (*args[:first], value, *args[first + 1:])
        budget.steps -= 1 + bounds.weight(value)
        if budget.steps < 0:
            budget.step(0)
        if comparing is not None:
            comparing(budget, *args[first:], **kwargs)
        if size is not None:
            budget.reserve(size(budget, *args[first:], **kwargs))
        result = f(*args, **kwargs)
        return budget.made(list(result) if type(result) not in _PLAIN and _iterator(result) else result)

    return bounded


def _comparing_test(f: Callable[..., Any]) -> Callable[..., Any]:
    """A jinja2 test that compares its operands (``==``, ``in``...), their members weighed first."""

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = current()
        for value in args:
            budget.weigh(value)
        return f(*args, **kwargs)

    return bounded


class Raised(jinja2.TemplateError):
    """The template called ``raise_exception(message)``."""


def _raise_exception(message: object) -> None:
    raise Raised(str(message))


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
    text = json.dumps(
        _plain(value), ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    literals = context.get(LITERALS_VAR)
    return literals.fix_json(text, ensure_ascii) if isinstance(literals, Literals) else text


def _plain(value: Json) -> Json:
    """``value`` in JSON's types, read whole (a use of every part, for the probes)."""
    use(value)
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


def preserve_reasoning_vars(preserve: bool) -> dict[str, bool]:
    """llama.cpp's ``caps_apply_preserve_reasoning``: the names templates use for keeping
    past reasoning."""
    return {
        "preserve_thinking": preserve,
        "clear_thinking": not preserve,
        "truncate_history_thinking": not preserve,
        "drop_thinking": not preserve,
    }


def strftime_now(now: dt.datetime) -> Callable[[str], str]:
    def format_now(format: str) -> str:
        current().reserve(32 * len(format))  # %c: 24 characters for two
        return now.strftime(format)

    return format_now
