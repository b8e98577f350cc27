"""A final assistant turn continued, as llama-server continues it (sans-I/O).

llama-server's ``prefill_assistant`` (``tools/server/server-common.cpp``) continues a request's
final assistant turn (``continue_final_message``, ``common/chat.cpp``): the conversation before
it is rendered without the generation prompt, then the turn is written after it: the generation
prompt up to where it would open the model's thinking block, the block's opening, the turn's
reasoning, and, unless the turn is reasoning only, the block's closing and the turn's text
(``common/chat-auto-parser-generator.cpp``, and each dedicated parser of ``common/parsers/``).
A turn of reasoning only leaves the block open, so the reply goes on inside it; a turn with
text leaves it closed, empty when the turn has no reasoning. A template with no thinking block
(llama.cpp finds none in it) gets the generation prompt and the turn's text; the turn's
reasoning is not written.

How a template spells its block around a turn's reasoning (:class:`Spelling`) is found as
llama.cpp's differential analysis finds it (``common/chat-diff-analyzer.cpp``): from how the
template writes a past turn's reasoning; where it writes none but its generation prompt writes
the block (opened, or empty when thinking is off), the family's bare markers. The families whose
block llama.cpp spells itself are spelled as it does (:data:`DEDICATED`, :data:`MINISTRAL_3`,
:data:`THINKING_TEMPLATES`).
"""

from __future__ import annotations

import datetime as dt
import functools
import os
from collections.abc import Mapping, Sequence

import attrs

from ringserve.core.events import ChatMessage, Role, ToolSpec
from ringserve.formats.base import ChatFormat, ReasoningMarkers
from ringserve.formats.template import ChatTemplate, RenderedPrompt, TemplateRenderError
from ringserve.formats.template.base import Json
from ringserve.formats.template.shaping import Family
from ringserve.formats.template.shaping import family as template_family

__all__ = ["DEDICATED", "Spelling", "continued", "spelling"]


@attrs.frozen
class Spelling:
    """A template's thinking block around a continued turn's reasoning.

    Attributes:
        cut: the generation prompt is cut before its first ``cut`` (where it opens the block
            itself: ``<think>``); "": it is kept whole.
        opening: written before the turn's reasoning (``<think>\\n``).
        closing: written between the reasoning and the text (``\\n</think>\\n\\n``).
        empty: written for a turn with text and no reasoning instead of ``opening + closing``
            (DeepSeek V4: its closing alone); None: ``opening + closing``.
    """

    cut: str
    opening: str
    closing: str
    empty: str | None = None


DEDICATED: Mapping[str, Spelling] = {
    "gemma-4": Spelling("<|channel>thought", "<|channel>thought\n", "<channel|>"),  # gemma4.cpp
    "deepseek-v4": Spelling("<think>", "<think>", "</think>", empty="</think>"),  # deepseek.cpp
    "kimi-k2": Spelling("<think>", "<think>", "</think>"),  # kimi-k2.cpp
    "lfm2": Spelling("<think>", "<think>", "</think>"),  # lfm2.cpp
    # chat-diff-analyzer.cpp's workarounds for Nemotron Nano v2 and Granite 3.3
    "nemotron-nano-v2": Spelling("<think>", "<think>\n", "</think>"),
    "granite-3": Spelling("<think>", "<think>", "</think>"),
}
"""The families whose block llama.cpp spells whatever the template writes (a dedicated parser, or
a workaround of its analysis), where the template does not show it; llama.cpp's other dedicated
parsers spell it as their templates write it, which :func:`spelling` finds."""

MINISTRAL_3 = Spelling("[THINK]", "[THINK]", "[/THINK]")
"""The block of the Mistral templates llama.cpp reads as Ministral 3's (``ministral3.cpp``: those
without ``[CALL_ID]``, :class:`~ringserve.formats.template.shaping.Family`)."""

THINKING_TEMPLATES: Mapping[str, Spelling] = {
    "qwen3-coder": Spelling("<think>", "<think>\n", "\n</think>\n\n"),  # qwen3-coder.cpp
}
"""The families whose block llama.cpp's dedicated parser spells, for the templates that have one
(Qwen3.5, Nemotron 3, StepFun 3.5; Qwen3-Coder has none)."""

TEXT_HEADS: Mapping[str, str] = {"functionary-v3.2": "all\n"}
"""What llama.cpp writes before a continued turn's text, after the generation prompt: Functionary
v3.2's recipient line (``>>>all``, ``functionary-v3-2.cpp``)."""

#: The source of the templates whose block llama.cpp trims of whitespace (the Laguna workaround
#: of ``chat-diff-analyzer.cpp``: their ``<think>\n`` is formatting the model does not write).
_TRIMMED = "laguna_glm_thinking"

_USER = (ChatMessage(Role.USER, "U_PROBE_USER"),)
_REASONING = "R_PROBE_REASONING"
_TEXT = "X_PROBE_TEXT"
_PAST = (*_USER, ChatMessage(Role.ASSISTANT, _TEXT, reasoning=_REASONING))
_PROBE_NOW = dt.datetime(2025, 1, 1)


def continued(
    template: ChatTemplate,
    fmt: ChatFormat,
    history: Sequence[ChatMessage],
    turn: ChatMessage,
    *,
    tools: Sequence[ToolSpec],
    enable_thinking: bool,
    reasoning_effort: str | None,
    template_kwargs: Mapping[str, Json] | None,
    now: dt.datetime | None,
) -> tuple[RenderedPrompt, bool]:
    """The prompt that continues ``turn`` (an assistant turn without tool calls) after
    ``history``, and whether it leaves the thinking block open (``turn`` is reasoning only, in a
    template with a block). The turn's reasoning and text are the request's: their spans are
    literal (:class:`RenderedPrompt`).

    The other arguments are :meth:`ChatTemplate.render`'s.

    Raises:
        TemplateRenderError: as :meth:`ChatTemplate.render`.
    """
    rendered, at = template.split_generation_prompt(
        history, tools=tools, enable_thinking=enable_thinking, reasoning_effort=reasoning_effort,
        template_kwargs=template_kwargs, now=now,
    )
    spelled = spelling(template, fmt.name, fmt.reasoning)
    text = rendered.text
    if spelled is None:
        return _joined(rendered, len(text), TEXT_HEADS.get(fmt.name, ""), turn.content), False
    cut = text.find(spelled.cut, at) if spelled.cut else -1
    end = cut if cut >= 0 else len(text)
    if turn.reasoning and not turn.content:
        return _joined(rendered, end, spelled.opening, turn.reasoning), True
    if not turn.reasoning and spelled.empty is not None:
        return _joined(rendered, end, spelled.empty, turn.content), False
    return _joined(rendered, end, spelled.opening, turn.reasoning, spelled.closing, turn.content), False


def _joined(rendered: RenderedPrompt, end: int, *pieces: str) -> RenderedPrompt:
    """``rendered`` up to ``end``, then ``pieces``: the template's text and the request's in turn
    (the request's, every second piece, are literal)."""
    text = rendered.text[:end]
    spans = [(start, min(stop, end)) for start, stop in rendered.literal_spans if start < end]
    for i, piece in enumerate(pieces):
        if i % 2 and piece:
            spans.append((len(text), len(text) + len(piece)))
        text += piece
    return RenderedPrompt(text, tuple(spans))


@functools.lru_cache(maxsize=16)
def spelling(template: ChatTemplate, family: str, markers: ReasoningMarkers | None) -> Spelling | None:
    """How ``template`` (of the family ``family``, whose thinking block has ``markers``) spells
    its block around a continued turn's reasoning; None where it has none (a family without
    markers, or a template that neither writes a past turn's reasoning nor writes the block when
    thinking is on or off). Found once per template (four renderings), then cached."""
    if markers is None:
        return None
    if family in DEDICATED:
        return DEDICATED[family]
    if template_family(template.source) is Family.MINISTRAL_3:
        return MINISTRAL_3
    # (turns, add_generation_prompt, enable_thinking)
    renderings = ((_USER, False, True), (_USER, True, True), (_USER, True, False), (_PAST, False, True))
    try:
        before, on, off, past = (
            template.render(turns, add_generation_prompt=add, enable_thinking=thinking, now=_PROBE_NOW).text
            for turns, add, thinking in renderings
        )
    except TemplateRenderError:
        return None
    generation = on[len(os.path.commonprefix([on, before])):]
    thinking_off = off[len(os.path.commonprefix([on, off])):]  # what thinking off changes
    turn = past[len(before):] if past.startswith(before) else ""
    head = os.path.commonprefix([generation, turn])
    if markers.start and markers.start in head:
        head = head[: head.find(markers.start)]
    reasoning, text = turn.find(_REASONING, len(head)), turn.find(_TEXT, len(head))
    if 0 <= reasoning < text:  # the template writes a past turn's reasoning
        cut = markers.start or generation[len(head):]
        opening, closing = turn[len(head) : reasoning].lstrip(), turn[reasoning + len(_REASONING) : text]
        found = Spelling(cut, opening, closing)
    elif markers.start and markers.start in generation + thinking_off:  # it writes one, open or empty
        found = Spelling(markers.start, markers.start, markers.end)
    else:
        return None
    found = THINKING_TEMPLATES.get(family, found)
    if _TRIMMED in template.source:
        found = attrs.evolve(found, opening=found.opening.strip(), closing=found.closing.strip())
    return found
