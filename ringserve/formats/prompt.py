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
  template's ``enable_thinking`` (by default on where the format has a thinking block, as
  llama-server turns it on where its parser finds thinking); ``effort`` its
  ``reasoning_effort``; the request's ``template_kwargs`` go over both
  (``{"enable_thinking": false}``), as llama-server's ``chat_template_kwargs`` do.
* **Prefill.** A final assistant turn is continued, as llama-server's
  ``prefill_assistant`` does (``tools/server/server-common.cpp``): the conversation before it
  is rendered with the generation prompt, then its text follows (plain text, never special
  tokens). Thinking is off for it unless the request turns it on; a turn with tool calls
  cannot be continued.
"""

from __future__ import annotations

import datetime as dt
import json

import attrs

from ringserve.core.events import GenerationRequest, Role
from ringserve.core.toolcalls import plain_messages
from ringserve.formats.base import ChatFormat
from ringserve.formats.template import ChatTemplate, RenderedPrompt, TemplateRenderError

__all__ = ["TOOLS_PROMPT_FAMILIES", "Rendered", "render_request"]

TOOLS_PROMPT_FAMILIES = frozenset({"generic", "generic-think"})
"""The families whose tools are rendered by ringserve's generic tools prompt, not the template."""


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
    prefill = messages[-1] if messages and messages[-1].role is Role.ASSISTANT else None
    if prefill is not None:
        if prefill.tool_calls:
            raise TemplateRenderError("an assistant turn that holds tool calls cannot be continued")
        messages = messages[:-1]
    reasoning = request.reasoning
    enabled = reasoning.enabled
    if enabled is None:
        enabled = fmt.reasoning is not None and prefill is None
    rendered = template.render(
        messages,
        tools=tools,
        enable_thinking=enabled,
        reasoning_effort=reasoning.effort.value if reasoning.effort is not None and enabled else None,
        template_kwargs=json.loads(request.template_kwargs) if request.template_kwargs else None,
        now=now,
    )
    # The whole prompt decides as its generation prompt does: the last opening marker is
    # the generation prompt's when it opens the block (what follows it is then whitespace).
    opened = fmt.reasoning is not None and fmt.reasoning.opened_by(rendered.text)
    if prefill is not None and prefill.content:
        text = rendered.text
        rendered = RenderedPrompt(text + prefill.content, (*rendered.literal_spans, (len(text), len(text) + len(prefill.content))))
    return Rendered(rendered, opened)
