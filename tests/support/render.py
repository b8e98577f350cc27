"""What a chat template appends for the assistant's turn (its generation prompt), with jinja2.

A small renderer for tests, after Hugging Face's chat-template conventions (``messages``,
``tools``, ``add_generation_prompt``, ``enable_thinking``, ``raise_exception``,
``strftime_now``, ``tojson``) and llama.cpp's ``common_chat_template_generation_prompt_impl``
(``common/chat.cpp``): the template is rendered without and with the generation prompt, and
the generation prompt is what the second adds after the common prefix.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys,
                      default=list)  # a filter's generator (``map``) is a list


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face's marker of the assistant's
    tokens) renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def generation_prompt(source: str, tools: list[dict[str, Any]], enable_thinking: bool) -> str:
    """The generation prompt of ``source`` after one user turn.

    Raises:
        jinja2.TemplateError: the template does not render.
    """
    template = _environment().from_string(source)
    context: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Hey there!"}],
        "bos_token": "", "eos_token": "", "enable_thinking": enable_thinking,
    }
    if tools:
        context["tools"] = tools
    without = template.render(context, add_generation_prompt=False)
    with_prompt = template.render(context, add_generation_prompt=True)
    n = 0
    while n < min(len(without), len(with_prompt)) and without[n] == with_prompt[n]:
        n += 1
    return with_prompt[n:]
