"""A request rendered with the model's chat template, as llama-server renders the same request.

:func:`render_request` is what the engine calls before it tokenizes
(:func:`~ringserve.formats.template.prompt_fragments`): it decides where the tools go, maps
the request's reasoning controls to the template's switches, leaves a final assistant turn
open, and says whether the prompt opened the model's thinking block.

* **Tools.** A family with a call syntax of its own gets the tools, the assistant turns'
  calls and the ``tool`` turns as the template renders them (with tool choice ``none`` too,
  as llama-server does). The generic families (:data:`TOOLS_PROMPT_FAMILIES`: templates that
  spell no calls) get ringserve's generic tools prompt and turns instead
  (:func:`~ringserve.core.toolcalls.plain_messages`), which teach the ``<tool_call>`` syntax
  their parser reads.
* **Reasoning.** :class:`~ringserve.core.events.ReasoningConfig` ``enabled`` is the
  template's ``enable_thinking``: by default on where the format has a thinking block, as
  llama-server turns it on where its parser finds thinking, but for the families whose
  template llama-server finds none in (:data:`THINKING_OFF_FAMILIES`); ``effort`` is its
  ``reasoning_effort`` whether thinking is on or not, as llama-server passes OpenAI's
  ``reasoning_effort`` (``none`` is thinking off); the request's ``template_kwargs`` go over
  both (``{"enable_thinking": false}``), as llama-server's ``chat_template_kwargs`` do.
* **Prefill.** A final assistant turn is continued, as llama-server's
  ``prefill_assistant`` continues it (:func:`~ringserve.formats.continuation.continued`): the
  conversation before it, then the turn in the template's thinking block (left open when the
  turn is reasoning only: the reply goes on inside it) and its text (plain text, never
  special tokens). A turn with tool calls cannot be continued.
"""

from __future__ import annotations

import datetime as dt
import json

import attrs

from ringserve.core.events import GenerationRequest, Role
from ringserve.core.toolcalls import plain_messages
from ringserve.formats.base import ChatFormat
from ringserve.formats.continuation import continued
from ringserve.formats.template import ChatTemplate, RenderedPrompt, TemplateRenderError

__all__ = ["THINKING_OFF_FAMILIES", "TOOLS_PROMPT_FAMILIES", "Rendered", "render_request"]

TOOLS_PROMPT_FAMILIES = frozenset({"generic", "generic-think"})
"""The families whose tools are rendered by ringserve's generic tools prompt, not the template."""

THINKING_OFF_FAMILIES = frozenset({"apertus"})
"""The families with a thinking block whose thinking is off unless the request turns it on:
llama-server's differential analysis finds no thinking in Apertus' template (its
``<|inner_prefix|>`` block is written as a list of parts), so it renders ``Deliberation:
disabled`` unless asked, as the template does when ``enable_thinking`` is undefined."""


@attrs.frozen
class Rendered:
    """A rendered request: the prompt (with the spans of the request's special-token text)
    and whether it leaves the thinking block open (the reply starts inside it)."""

    prompt: RenderedPrompt
    reasoning_open: bool


def render_request(
    template: ChatTemplate, fmt: ChatFormat, request: GenerationRequest, *, now: dt.datetime | None = None
) -> Rendered:
    """Render ``request`` with ``template`` for a model of format ``fmt`` (see the module
    docstring).

    Args:
        template: the model's chat template.
        fmt: the model's format.
        request: the request.
        now: the time the template sees (``strftime_now``); the current time by default.

    Raises:
        TemplateRenderError: the template refused the request or failed on it, or the final
            assistant turn holds tool calls.
        ValueError: as :func:`~ringserve.core.toolcalls.plain_messages` (a call's arguments
            or a tool's schema that is not JSON, for the generic families).
    """
    messages, tools = request.messages, request.tools
    if fmt.name in TOOLS_PROMPT_FAMILIES:
        messages, tools = plain_messages(messages, tools, request.tool_choice), ()
    reasoning = request.reasoning
    enabled = reasoning.enabled
    if enabled is None:
        enabled = fmt.reasoning is not None and fmt.name not in THINKING_OFF_FAMILIES
    effort = reasoning.effort.value if reasoning.effort is not None else None
    kwargs = json.loads(request.template_kwargs) if request.template_kwargs else None
    if messages and messages[-1].role is Role.ASSISTANT:
        if messages[-1].tool_calls:
            raise TemplateRenderError("an assistant turn that holds tool calls cannot be continued")
        prompt, opened = continued(template, fmt, messages[:-1], messages[-1], tools=tools, enable_thinking=enabled,
                                   reasoning_effort=effort, template_kwargs=kwargs, now=now)
        return Rendered(prompt, opened)
    rendered = template.render(messages, tools=tools, enable_thinking=enabled, reasoning_effort=effort,
                               template_kwargs=kwargs, now=now)
    # The whole prompt decides as its generation prompt does: the last opening marker is
    # the generation prompt's when it opens the block (what follows it is then whitespace).
    return Rendered(rendered, fmt.reasoning is not None and fmt.reasoning.opened_by(rendered.text))
