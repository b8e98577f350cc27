"""Context edits: a conversation's history trimmed before it is rendered (sans-I/O).

The edits of Anthropic's ``context_management`` (beta ``context-management-2025-06-27``;
https://platform.claude.com/docs/en/build-with-claude/context-editing), surface-neutral values
of ``core/events.py`` (``GenerationRequest.context_edits``) that only ever remove history:

* :class:`ClearThinking` (``clear_thinking_20251015``): the reasoning of all but the most
  recent ``keep_turns`` assistant turns that have some is dropped (``keep: "all"``: none is).
* :class:`ClearToolUses` (``clear_tool_uses_20250919``): once the prompt exceeds its trigger
  (input tokens, or tool uses in the conversation), the results of the oldest tool calls are
  replaced by :data:`CLEARED_RESULT`, all but the most recent ``keep``; the tools named in
  ``exclude`` are never cleared; with ``clear_inputs`` the calls' arguments go too (all of
  them, or those of the named tools); an edit that would clear fewer than ``clear_at_least``
  tokens is not applied.

:func:`edit_prompt` applies a request's edits in order with the engine's tokenizer, and says
which were applied and how many tokens each cleared (Anthropic reports them as the response's
``context_management.applied_edits``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, assert_never

import attrs

from ringserve.core.events import (
    AppliedEdit,
    ChatMessage,
    ClearThinking,
    ClearToolUses,
    ContextEdit,
    GenerationRequest,
    Role,
    Trigger,
)

__all__ = ["CLEARED_INPUT", "CLEARED_RESULT", "Prompt", "edit_messages", "edit_prompt"]

#: The text a cleared tool result is replaced with (the model sees that there was one).
CLEARED_RESULT = "[tool result cleared to save context]"
#: The arguments of a call whose input was cleared (the arguments stay a JSON object).
CLEARED_INPUT = "{}"


def _clear_thinking(messages: Sequence[ChatMessage], edit: ClearThinking) -> tuple[tuple[ChatMessage, ...], int]:
    thinking = [i for i, m in enumerate(messages) if m.role is Role.ASSISTANT and m.reasoning]
    keep = len(thinking) if edit.keep_turns is None else edit.keep_turns
    cleared = thinking[: max(0, len(thinking) - keep)]
    out = list(messages)
    for i in cleared:
        out[i] = attrs.evolve(out[i], reasoning="")
    return tuple(out), len(cleared)


def _tool_uses(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    """``(call_id, name)`` of every tool call of the conversation, oldest first."""
    return [(call.call_id, call.name) for m in messages if m.role is Role.ASSISTANT for call in m.tool_calls]


def _clear_tool_uses(messages: Sequence[ChatMessage], edit: ClearToolUses) -> tuple[tuple[ChatMessage, ...], int]:
    uses = [(call_id, name) for call_id, name in _tool_uses(messages) if name not in edit.exclude]
    cleared = dict(uses[: max(0, len(uses) - edit.keep)])  # call_id -> name
    if not cleared:
        return tuple(messages), 0

    def inputs_cleared(name: str) -> bool:
        return edit.clear_inputs is True or (isinstance(edit.clear_inputs, frozenset) and name in edit.clear_inputs)

    out = []
    for m in messages:
        if m.role is Role.TOOL and m.tool_call_id in cleared:
            m = attrs.evolve(m, content=CLEARED_RESULT)
        elif m.role is Role.ASSISTANT and any(c.call_id in cleared and inputs_cleared(c.name) for c in m.tool_calls):
            m = attrs.evolve(m, tool_calls=tuple(
                attrs.evolve(c, arguments=CLEARED_INPUT) if c.call_id in cleared and inputs_cleared(c.name) else c
                for c in m.tool_calls))
        out.append(m)
    return tuple(out), len(cleared)


def edit_messages(messages: Sequence[ChatMessage], edit: ContextEdit) -> tuple[tuple[ChatMessage, ...], int]:
    """The messages with ``edit``'s clearing done, whatever its trigger, and how many thinking
    turns or tool uses it cleared (0: the messages as they were)."""
    match edit:
        case ClearThinking():
            return _clear_thinking(messages, edit)
        case ClearToolUses():
            return _clear_tool_uses(messages, edit)
        case _:
            assert_never(edit)


class Prompt(Protocol):
    """A tokenized prompt (the engine's ``ChatPrompt``): what :func:`edit_prompt` measures."""

    @property
    def tokens(self) -> Sequence[int]: ...


P = TypeVar("P", bound=Prompt)


def cleared_input_tokens(applied: Sequence[AppliedEdit]) -> int:
    """The prompt tokens the ``applied`` edits cleared: what the prompt had before them, less what it has."""
    return sum(edit.cleared_input_tokens for edit in applied)


def edit_prompt(
    request: GenerationRequest, edits: Sequence[ContextEdit], tokenize: Callable[[GenerationRequest], P]
) -> tuple[GenerationRequest, P, tuple[AppliedEdit, ...]]:
    """``request`` with ``edits`` applied in order, its prompt, and the edits applied.

    ``tokenize`` gives a request's prompt (the engine's chat template and tokenizer); it is
    called once, and once more for each edit that clears something and is triggered. A
    :class:`ClearToolUses` is triggered when the prompt so far has more tokens (or the
    conversation more tool uses) than its trigger, and applied only if it clears at least its
    ``clear_at_least`` tokens.
    """
    prompt = tokenize(request)
    applied: list[AppliedEdit] = []
    for edit in edits:
        messages, cleared = edit_messages(request.messages, edit)
        if not cleared:
            continue
        if isinstance(edit, ClearToolUses):
            count = len(prompt.tokens) if edit.trigger_kind is Trigger.INPUT_TOKENS else len(_tool_uses(request.messages))
            if count <= edit.trigger:
                continue
        edited = attrs.evolve(request, messages=messages)
        edited_prompt = tokenize(edited)
        saved = len(prompt.tokens) - len(edited_prompt.tokens)
        if isinstance(edit, ClearToolUses) and saved < edit.clear_at_least:
            continue
        request, prompt = edited, edited_prompt
        applied.append(AppliedEdit(edit, cleared, saved))
    return request, prompt, tuple(applied)
