"""core/context.py: context edits trim the history (Anthropic's context_management), measured in
the tokens of the prompt they change."""

from __future__ import annotations

import json

import attrs

from ringserve.core.context import CLEARED_INPUT, CLEARED_RESULT, edit_messages, edit_prompt
from ringserve.core.events import (
    AppliedEdit,
    ChatMessage,
    ClearThinking,
    ClearToolUses,
    GenerationRequest,
    ToolCall,
    Trigger,
)


def history(n_calls: int, *, name: str = "Bash", result: str = "x" * 100) -> tuple[ChatMessage, ...]:
    """A user turn, then ``n_calls`` rounds of an assistant turn (reasoning, one call) and its result."""
    messages = [ChatMessage("user", "go")]
    for i in range(n_calls):
        messages.append(ChatMessage("assistant", "", tool_calls=(ToolCall(f"c{i}", name, json.dumps({"i": i})),),
                                    reasoning=f"thought {i}"))
        messages.append(ChatMessage("tool", f"{result}{i}", tool_call_id=f"c{i}"))
    return tuple(messages)


@attrs.frozen
class Tokens:
    tokens: tuple[int, ...]


def tokens(request: GenerationRequest) -> Tokens:
    """A byte per token of the messages' text, as the fake engine counts."""
    text = "".join(m.content + m.reasoning + "".join(c.arguments for c in m.tool_calls) for m in request.messages)
    return Tokens(tuple(text.encode()))


def test_clear_thinking_keeps_the_latest_turns():
    messages = history(4)
    edited, cleared = edit_messages(messages, ClearThinking(keep_turns=1))
    assert cleared == 3
    assert [m.reasoning for m in edited if m.role == "assistant"] == ["", "", "", "thought 3"]
    assert edit_messages(messages, ClearThinking(keep_turns=None)) == (messages, 0)  # keep: "all"
    assert edit_messages(messages, ClearThinking(keep_turns=9)) == (messages, 0)
    assert edit_messages(messages, ClearThinking(keep_turns=0))[1] == 4


def test_clear_tool_uses_keeps_the_latest_and_the_excluded():
    messages = history(5)
    edited, cleared = edit_messages(messages, ClearToolUses(keep=2))
    assert cleared == 3
    assert [m.content for m in edited if m.role == "tool"] == [CLEARED_RESULT] * 3 + ["x" * 100 + "3", "x" * 100 + "4"]
    assert [c.arguments for m in edited for c in m.tool_calls] == [json.dumps({"i": i}) for i in range(5)]
    # calls c0 Read, c1 Bash, c2 Read, c3 Bash: Read is never cleared, nor counted among those kept
    mixed = tuple(attrs.evolve(m, tool_calls=(attrs.evolve(m.tool_calls[0], name=("Read", "Bash")[i // 2 % 2]),))
                  if m.tool_calls else m for i, m in enumerate(history(4)[1:]))
    edited, cleared = edit_messages(mixed, ClearToolUses(keep=1, exclude=frozenset({"Read"})))
    assert cleared == 1
    assert [m.content == CLEARED_RESULT for m in edited if m.role == "tool"] == [False, True, False, False]


def test_clear_tool_inputs_all_or_by_name():
    messages = history(3)
    edited, cleared = edit_messages(messages, ClearToolUses(keep=1, clear_inputs=True))
    assert cleared == 2
    assert [c.arguments for m in edited for c in m.tool_calls] == [CLEARED_INPUT, CLEARED_INPUT, json.dumps({"i": 2})]
    edited, _ = edit_messages(messages, ClearToolUses(keep=1, clear_inputs=frozenset({"Write"})))
    assert [c.arguments for m in edited for c in m.tool_calls] == [json.dumps({"i": i}) for i in range(3)]


def test_edit_prompt_applies_what_its_triggers_and_minimums_allow():
    request = GenerationRequest(messages=history(5), max_tokens=None)
    n = len(tokens(request).tokens)
    calls: list[int] = []

    def counting(r: GenerationRequest) -> Tokens:
        calls.append(1)
        return tokens(r)

    # below the trigger: nothing, one tokenization
    same, prompt, applied = edit_prompt(request, (ClearToolUses(trigger=n),), counting)
    assert (same, len(prompt.tokens), applied, len(calls)) == (request, n, (), 1)
    # over it: the results of all but 3 calls go
    edit = ClearToolUses(trigger=n - 1)
    edited, prompt, applied = edit_prompt(request, (edit,), tokens)
    saved = 2 * (101 - len(CLEARED_RESULT))
    assert applied == (AppliedEdit(edit, 2, saved),) and len(prompt.tokens) == n - saved
    # clear_at_least: not applied unless it saves that much
    assert edit_prompt(request, (ClearToolUses(trigger=0, clear_at_least=saved + 1),), tokens)[2] == ()
    # a trigger in tool uses
    assert edit_prompt(request, (ClearToolUses(trigger=5, trigger_kind=Trigger.TOOL_USES),), tokens)[2] == ()
    assert edit_prompt(request, (ClearToolUses(trigger=4, trigger_kind=Trigger.TOOL_USES),), tokens)[2] != ()
    # in order: thinking, then tool uses; keep "all" changes nothing and costs no tokenization
    calls.clear()
    edits = (ClearThinking(keep_turns=None), ClearThinking(keep_turns=2), ClearToolUses(trigger=0, keep=4))
    edited, prompt, applied = edit_prompt(request, edits, counting)
    assert [(a.edit, a.cleared) for a in applied] == [(edits[1], 3), (edits[2], 1)]
    assert len(prompt.tokens) + sum(a.cleared_input_tokens for a in applied) == n and len(calls) == 3
