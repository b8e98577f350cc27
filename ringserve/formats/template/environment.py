"""The Jinja environment of a chat template: jinja2's sandbox configured as Hugging Face's
``apply_chat_template`` configures it (https://huggingface.co/docs/transformers/main/en/chat_templating_writing),
made to behave as llama.cpp's own Jinja where the two differ, and the variables llama-server gives
every template beyond the request's."""

from __future__ import annotations

import datetime as dt
import functools
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.sandbox
from jinja2.utils import pass_context

from ringserve.formats.template.base import Json
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


class Environment(jinja2.sandbox.SandboxedEnvironment):
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
        if isinstance(obj, (InputList, InputDict)) and jinja2.sandbox.modifies_known_mutable(obj, attr):
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
        return now.strftime(format)

    return format_now
