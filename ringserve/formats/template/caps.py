"""A template's capabilities (:class:`TemplateCaps`), probed once at load as llama.cpp's
``jinja::caps_get`` probes them (``common/jinja/caps.cpp``): the template is rendered on canned
requests whose values count how it reads them (:mod:`~ringserve.formats.template.probe`)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any, cast

import attrs

from ringserve.formats.template.base import Json
from ringserve.formats.template.bounds import RenderBoundError, RenderBounds, bounded
from ringserve.formats.template.environment import Environment, preserve_reasoning_vars, strftime_now
from ringserve.formats.template.probe import (
    Probe,
    ProbeRun,
    Uses,
    probe_value,
    use,
)


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


class _ProbeEnvironment(Environment):
    """The environment with every lookup, filter and test counting its uses."""

    def __init__(self) -> None:
        super().__init__()
        for name, f in list(self.filters.items()):
            self.filters[name] = _counting(f, name, deep=name == "string")
        for name, test in list(self.tests.items()):
            self.tests[name] = _counting(cast(Callable[..., Any], test), f"test_is_{name}", deep=False)

    def getattr(self, obj: Any, attribute: str) -> Any:
        result = super().getattr(obj, attribute)
        use(obj, "object_access")
        use(result)
        return result

    def getitem(self, obj: Any, argument: Any) -> Any:
        result = super().getitem(obj, argument)
        use(obj, "array_access" if isinstance(argument, int) else "object_access")
        use(result)
        return result


def _counting(f: Callable[..., Any], op: str, deep: bool) -> Callable[..., Any]:
    """``f``, a filter or a test, counting a use of its value; a loop over the value inside
    ``f`` is no loop of the template's."""
    pass_arg = getattr(f, "jinja_pass_arg", None)  # jinja2's pass_context & co.

    def call(*args: Any, **kwargs: Any) -> Any:
        value = args[0 if pass_arg is None else 1]
        use(value, op, deep)
        run = value.run if isinstance(value, Probe) else None
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
                {"id": f"call0000{i}", "type": "function",
                 "function": {"name": "tool1", "arguments": arguments}}
                for i in range(1, calls + 1)
            ],
        },
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"},
    ]


ProbeRender = Callable[..., tuple[bool, str, Json]]


def probe_system_anywhere(run: ProbeRender) -> bool:
    """Whether the template behind ``run`` (:func:`prober`) renders a system turn between two
    user turns where it stands (not dropped, not refused): ringserve's own probe (llama.cpp
    passes such a turn to the template as it is), for the mid-conversation system turns Claude
    Code sends on every turn."""
    ok, text, _ = run([{"role": "user", "content": "FIRST_USER_MARKER"},
                       {"role": "system", "content": "MIDDLE_SYSTEM_MARKER"},
                       {"role": "user", "content": "LAST_USER_MARKER"}])
    markers = ("FIRST_USER_MARKER", "MIDDLE_SYSTEM_MARKER", "LAST_USER_MARKER")
    first, middle, last = (text.find(marker) for marker in markers)
    return ok and 0 <= first < middle < last


def prober(source: str) -> ProbeRender:
    """``run(messages, tools, **extra) -> (ok, text, context)``: the template rendered on
    probe values that record what it reads (compiled once for every probe of a template),
    each render bounded as a request of the same values would be (``bounds.py``).

    ``run`` raises :class:`~ringserve.formats.template.bounds.RenderBoundError` when the
    template goes past a bound; any other failure is ``ok`` false."""
    template = _ProbeEnvironment().from_string(source)

    def run(messages: Json, tools: Json = (), **extra: Json) -> tuple[bool, str, Json]:
        probe = ProbeRun()
        context = {
            "messages": probe_value(messages, probe),
            "tools": probe_value(list(tools), probe),
            "bos_token": "",
            "eos_token": "",
            "add_generation_prompt": True,
            "strftime_now": strftime_now(dt.datetime.now()),
        }
        context.update((k, probe_value(v, probe)) for k, v in extra.items())
        if "reasoning_effort" in context:  # one value under both names, as llama.cpp binds it
            context["reasoning_strength"] = context["reasoning_effort"]
        try:
            bounds = RenderBounds.of([messages, list(tools), *extra.values()], len(messages) + len(tools))
            with bounded(bounds):
                return True, template.render(context), context
        except RenderBoundError:
            raise
        except Exception:
            return False, "", context

    return run


def probe_caps(run: ProbeRender) -> TemplateCaps:
    """The capabilities of the template behind ``run`` (:func:`prober`), found as
    ``jinja::caps_get`` (``common/jinja/caps.cpp``) finds them: from what it reads of canned
    requests, llama.cpp's probes in its order."""
    string_content, typed_content = _content_caps(run)
    _, _, context = run([_SYSTEM_TURN, _USER_TURN])
    system_role = _uses(context["messages"][0]["content"]).used
    tools, tool_calls, object_arguments = _tool_caps(run)
    arguments: Json = {"arg": "value"} if object_arguments else '{"arg": "value"}'
    ok, _, context = run(_caps_tool_turns(arguments, 2), _CAPS_TOOLS)
    parallel = ok and _uses(context["messages"][1]["tool_calls"][1]["function"]).used
    preserve_reasoning, reasoning_effort = _reasoning_caps(run)
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


_USER_TURN: Json = {"role": "user", "content": "User message"}
_SYSTEM_TURN: Json = {"role": "system", "content": "System message"}


def _uses(value: Json) -> Uses:
    return cast(Probe, value).uses


def _content_caps(run: ProbeRender) -> tuple[bool, bool]:
    """Whether the template renders a string content, and whether it reads a content as typed parts."""
    string_content = True
    marker = "STRING_MARKER"
    ok, text, context = run([{"role": "user", "content": marker}])
    content = _uses(context["messages"][0]["content"])
    typed_content = as_array = bool(content.ops & {"selectattr", "array_access"})
    if not ok or (as_array and marker not in text):
        string_content = False
    if "test_is_string" in content.ops:
        ok, text, context = run([{"role": "user", "content": []}])
        if ok and _uses(context["messages"][0]["content"]).ops & {"selectattr", "array_access"}:
            typed_content = True
    return string_content, typed_content


def _tool_caps(run: ProbeRender) -> tuple[bool, bool, bool]:
    """Whether the template reads the tools, the tool calls, and a call's arguments as an object."""
    tools = tool_calls = True
    object_arguments = False
    ok, _, context = run(_caps_tool_turns({"arg": "value"}, 1), _CAPS_TOOLS)
    if ok:
        tools = _uses(context["tools"][0]["function"]["name"]).used
        calls = context["messages"][1]["tool_calls"]
        tool_calls = _uses(calls).used
        object_arguments = tool_calls and _uses(calls[0]["function"]["arguments"]["arg"]).used
    if not object_arguments:
        ok, _, context = run(_caps_tool_turns('{"arg": "value"}', 1), _CAPS_TOOLS)
        if not ok:
            tools = tool_calls = False
        else:
            tools = tools and _uses(context["tools"][0]["function"]["name"]).used
            tool_calls = tool_calls and _uses(context["messages"][1]["tool_calls"]).used
    return tools, tool_calls, object_arguments


def _reasoning_caps(run: ProbeRender) -> tuple[bool, bool]:
    """Whether the template keeps past reasoning when told to, and whether it reads ``reasoning_effort``."""
    reasoning = "<REASONING_CONTENT_PLACEHOLDER>"
    _, text, _ = run(
        [
            _USER_TURN,
            {"role": "assistant", "content": "Assistant message", "reasoning_content": reasoning},
            _USER_TURN,
            {"role": "assistant", "content": "Assistant message", "reasoning_content": "Reasoning content"},
            _USER_TURN,
        ],
        enable_thinking=True,
        **preserve_reasoning_vars(True),
    )
    _, _, context = run([_USER_TURN], enable_thinking=True, reasoning_effort="low")
    return reasoning in text, _uses(context["reasoning_effort"]).used
