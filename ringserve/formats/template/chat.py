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

import datetime as dt
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import assert_never

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.sandbox

from ringserve.core.events import ChatMessage, Role, ToolSpec
from ringserve.formats.template.base import Json, TemplateLoadError, TemplateRenderError
from ringserve.formats.template.bounds import RenderBoundError, RenderBounds, bounded
from ringserve.formats.template.caps import probe_caps, probe_system_anywhere, prober
from ringserve.formats.template.environment import Environment, Raised, preserve_reasoning_vars, strftime_now
from ringserve.formats.template.fragments import RenderedPrompt, SpecialTokens
from ringserve.formats.template.literals import LITERALS_VAR, PLACEHOLDER_RE, Literals
from ringserve.formats.template.shaping import (
    NINE_CHAR_IDS,
    TRIMMED_MARK,
    Family,
    deepseek_v4,
    family,
    fold_system_turns,
    gemma_4_legacy,
    joined,
    ministral_3,
    nine_chars,
    no_constant,
    object_arguments,
    patched,
    thinking_field,
)

#: The kwargs llama-server gives every request unless told otherwise: past reasoning is
#: kept (its ``--reasoning-preserve`` default).
DEFAULT_KWARGS: Mapping[str, Json] = {"preserve_reasoning": True}

_C_WHITESPACE = " \t\n\v\f\r"
_TURN_END = "<turn|>\n"  # Gemma 4's end of a turn


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
            the line), it holds the private-use characters rendering reserves, or it went
            past the bounds of a render (``bounds.py``) on llama.cpp's capability probes.
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
        self.source = patched(source)
        if PLACEHOLDER_RE.search(self.source + bos_token + eos_token):
            raise TemplateLoadError(
                "the chat template holds characters of U+100000..U+10FFFD, which ringserve reserves"
            )
        try:
            self._template = Environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateLoadError(
                f"the chat template does not compile: line {e.lineno}: {e.message}"
            ) from e
        probe = prober(self.source)
        try:
            self.caps = probe_caps(probe)
            #: Whether a system turn in the middle of a conversation renders where it stands; if not,
            #: :meth:`render` folds it into a turn (:func:`fold_system_turns`).
            self.system_anywhere = probe_system_anywhere(probe)
        except RenderBoundError as e:
            raise TemplateLoadError(f"the chat template {e} on llama.cpp's capability probes") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.strip_bos = strip_bos
        self.strip_eos = strip_eos
        self.default_kwargs = dict(default_kwargs)
        self._family = family(self.source)
        self._trim = TRIMMED_MARK in self.source
        self._ids: Callable[[str], str] = nine_chars if NINE_CHAR_IDS in self.source else str
        self.special_tokens = special_tokens or SpecialTokens()
        self._token_texts = [t.text for t in self.special_tokens.tokens]
        self._protected = re.compile(f"{self.special_tokens.pattern.pattern}|{PLACEHOLDER_RE.pattern}")

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
                failed on it, went past the bounds of a render on it (``bounds.py``: steps
                and memory, which grow with the request), a tool call's arguments are not
                JSON for a template that reads them as an object, or ``enable_thinking`` in
                ``template_kwargs`` is a string.
        """
        text, literals = self._apply(
            messages, tools, add_generation_prompt, enable_thinking, reasoning_effort, template_kwargs, now
        )
        match self._family:
            case Family.GPT_OSS if not add_generation_prompt:
                at = text.rfind("<|return|>")  # llama.cpp issue 15417: a past reply ends with <|end|>
                if at != -1:
                    text = f"{text[:at]}<|end|>{text[at + len('<|return|>'):]}"
            case Family.GEMMA_4 | Family.GEMMA_4_LEGACY if add_generation_prompt and text.endswith(_TURN_END):
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
        itself (so the reply starts inside it). Arguments and errors as :meth:`render`."""
        rendered, at = self.split_generation_prompt(
            messages, tools=tools, enable_thinking=enable_thinking, reasoning_effort=reasoning_effort,
            template_kwargs=template_kwargs, now=now,
        )
        return rendered.text[at:]

    def split_generation_prompt(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        enable_thinking: bool = True,
        reasoning_effort: str | None = None,
        template_kwargs: Mapping[str, Json] | None = None,
        now: dt.datetime | None = None,
    ) -> tuple[RenderedPrompt, int]:
        """The rendering of ``messages`` with the generation prompt, and the offset (characters)
        where its generation prompt starts: the rendering with the generation prompt less the
        longest prefix it shares with the rendering without, as llama.cpp's
        ``common_chat_template_generation_prompt_impl`` finds it. Arguments and errors as
        :meth:`render`."""
        now = now or dt.datetime.now()
        with_prompt, without = (
            self.render(messages, tools=tools, add_generation_prompt=add, enable_thinking=enable_thinking,
                        reasoning_effort=reasoning_effort, template_kwargs=template_kwargs, now=now)
            for add in (True, False)
        )
        return with_prompt, len(os.path.commonprefix([with_prompt.text, without.text]))

    def _apply(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec],
        add_generation_prompt: bool,
        enable_thinking: bool,
        reasoning_effort: str | None,
        template_kwargs: Mapping[str, Json] | None,
        now: dt.datetime | None,
    ) -> tuple[str, Literals]:
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
        literals = Literals(self._token_texts, self._protected)
        now = dt.datetime.now() if now is None else now
        context = self._context(messages, tools, kwargs, literals, enable_thinking, now)
        if add_generation_prompt:
            context["add_generation_prompt"] = True
        values = [context["messages"], context.get("tools", ()), *kwargs.values()]
        try:
            with bounded(RenderBounds.of(values, len(messages) + len(tools))):
                text = self._template.render(context)
        except RenderBoundError as e:
            raise TemplateRenderError(f"the model's chat template {e} on this request") from None
        except Raised as e:
            message = literals.restore(e.message or "").text
            raise TemplateRenderError(
                f"the model's chat template refused the request: {message}", message
            ) from e
        except Exception as e:
            message = literals.restore(str(e)).text
            raise TemplateRenderError(f"the model's chat template failed on the request: {message}") from e
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.strip_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: len(text) - len(self.eos_token)]
        return text, literals

    def _context(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec],
        kwargs: Mapping[str, Json],
        literals: Literals,
        enable_thinking: bool,
        now: dt.datetime,
    ) -> dict[str, Json]:
        """The template's variables: the request's (shaped, its strings protected by
        ``literals``) and the extras llama-server gives every template."""
        context: dict[str, Json] = {}
        if isinstance(kwargs.get("preserve_reasoning"), bool):
            context.update(preserve_reasoning_vars(kwargs["preserve_reasoning"]))
        effort = kwargs.get("reasoning_effort")
        if isinstance(effort, str) and effort:
            context["reasoning_effort"] = context["reasoning_strength"] = literals.protect(effort)
        context.update(
            messages=literals.protect_json(self._shape(self._messages_json(messages))),
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            enable_thinking=enable_thinking,
        )
        if tools:
            context["tools"] = literals.protect_json([_tool_json(t) for t in tools])
        context.update(datetime=now.strftime("%b %d %Y"), date_string=now.strftime("%d %b %Y"))
        context.update((k, literals.protect_json(v)) for k, v in kwargs.items())
        context["strftime_now"] = strftime_now(now)
        context[LITERALS_VAR] = literals
        return context

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
            messages = fold_system_turns(messages)
        if caps.supports_typed_content and not caps.supports_string_content:
            messages = [m | {"content": [{"type": "text", "text": m["content"]}]} for m in messages]
        if not caps.supports_system_role and messages and messages[0]["role"] == "system":
            system, *messages = messages
            if messages:
                messages[0] = messages[0] | {"content": joined(system["content"], messages[0]["content"])}
        if caps.supports_object_arguments:
            messages = [object_arguments(m) if "tool_calls" in m else m for m in messages]
        match self._family:
            case Family.MINISTRAL_3:
                return ministral_3(messages)
            case Family.GPT_OSS:
                return thinking_field(messages, drop_call_content=True)
            case Family.LFM2:
                return thinking_field(messages, drop_call_content=False)
            case Family.DEEPSEEK_V4:
                return deepseek_v4(messages)
            case Family.GEMMA_4_LEGACY:
                return gemma_4_legacy(messages)
            case Family.GEMMA_4 | Family.OTHER:
                return messages
            case unreachable:
                assert_never(unreachable)


def _tool_json(tool: ToolSpec) -> Json:
    """A tool as llama-server passes it (``common_chat_tools_to_json_oaicompat``)."""
    try:
        parameters = json.loads(tool.parameters, parse_constant=no_constant)
    except ValueError as e:
        raise TemplateRenderError(f"the parameters of tool {tool.name!r} are not JSON: {e}") from e
    function = {"name": tool.name, "description": tool.description, "parameters": parameters}
    return {"type": "function", "function": function}
