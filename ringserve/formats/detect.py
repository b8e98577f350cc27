"""Which family a chat template belongs to, from the template's text.

As llama.cpp picks its dedicated parsers (``common_chat_try_specialized_template`` in
``common/chat.cpp``, and the workarounds of ``common/chat-diff-analyzer.cpp``): each family
is recognised by strings only its templates contain, in a fixed order (the first rule that
matches wins, so the more specific ones come first). llama.cpp derives the other formats by
rendering the template with probe conversations (its "autoparser", ``docs/autoparser.md``);
the families here cover what that derivation finds in the corpus of
``models/templates``, spelled by hand.

A template with no call syntax of its own gets ringserve's generic format (its tools prompt
and ``<tool_call>`` parser), with the common ``<think>`` block when the template mentions it.
"""

from __future__ import annotations

from collections.abc import Callable

from ringserve.formats.base import ChatFormat
from ringserve.formats.families import FAMILIES

__all__ = ["RULES", "detect"]


def _all(*needles: str) -> Callable[[str], bool]:
    return lambda src: all(n in src for n in needles)


RULES: tuple[tuple[Callable[[str], bool], str], ...] = (
    (_all("<|channel|>"), "gpt-oss"),
    (_all("]<]minimax[>["), "minimax-m3"),
    (_all("<|open|>", "<|close|>", "<|end_of_msg|>"), "kimi-k3"),
    (_all(">>>all"), "functionary-v3.2"),
    (_all("[TOOL_CALLS]", "[ARGS]"), "mistral"),
    (_all("[TOOL_CALLS]"), "mistral-nemo"),
    (_all("<|tool_calls_section_begin|>", "<|tool_call_begin|>"), "kimi-k2"),
    (_all("dsml_token", "function_calls"), "deepseek-v3.2"),
    (_all("dsml_token", "tool_calls"), "deepseek-v4"),
    (_all("tool▁calls▁begin", "['type'] + '<｜tool▁sep｜>'"), "deepseek-r1"),
    (_all("tool▁calls▁begin"), "deepseek-v3.1"),
    (_all("<seed:tool_call>"), "seed-oss"),
    (_all("<minimax:tool_call>"), "minimax-m2"),
    (_all("<tool_call>", "<function=", "<parameter="), "qwen3-coder"),
    (_all("<role>ASSISTANT</role>", "<arg_key>"), "ling"),
    (_all("<tool_call>", "<arg_key>"), "glm-4.5"),
    (_all("<|START_ACTION|>", "<|START_TEXT|>"), "cohere2-moe"),
    (_all("<|START_ACTION|>"), "command-r7b"),
    (_all("Action:", "```json", "tool_name"), "command-r-plus"),
    (_all('<function name="', '<param name="'), "minicpm5"),
    (_all("<function="), "functionary-v3.1"),
    (_all("<|function_call|>"), "gigachat-3.1"),
    (_all("<|role_sep|>", "<|message_sep|>"), "gigachat-3"),
    (_all("functools["), "firefunction-v2"),
    (_all("<|tool_call|>"), "granite-3"),
    (_all("<TOOLCALL>"), "nemotron-nano-v2"),
    (_all("<tool_calls>", "[BEGIN FINAL RESPONSE]"), "apriel"),
    (_all("<tool_calls>"), "minimax-m1"),
    (_all("'<|tool_call>call:'"), "gemma-4"),
    (_all("<|tools_prefix|>"), "apertus"),
    (_all("<|tool_list_start|>", "<|tool_list_end|>"), "lfm2"),
    (_all("List of tools: ["), "lfm2"),
    (_all("<tool_call>"), "hermes"),
    (_all("<|python_tag|>"), "llama-3"),
    (_all("<|start_header_id|>", '"parameters": '), "llama-3"),
    (_all("<think>"), "generic-think"),
)
"""``(test on the template's text, family name)`` in the order they are tried."""


def format_for(family: str | None, template: str | None) -> ChatFormat | None:
    """The format a model is served with: the family named ``family`` when one is configured
    (None: it names no family), else the one :func:`detect` finds in ``template`` (the chat
    template's Jinja source), else the generic format (no template)."""
    if family:
        return FAMILIES.get(family)
    return detect(template) if template else FAMILIES["generic"]


def detect(template: str) -> ChatFormat:
    """The family of the chat template ``template`` (its Jinja source); the generic format
    when no rule matches."""
    for test, name in RULES:
        if test(template):
            return FAMILIES[name]
    return FAMILIES["generic"]
