"""The registry of model families: each family's markers and call syntax, spelled once.

The syntaxes are those of llama.cpp's parsers (``common/chat.cpp``,
``common/parsers/*.cpp``, ``common/chat-diff-analyzer.cpp``) and of the models' own chat
templates (``models/templates/*.jinja`` in llama.cpp); :mod:`ringserve.formats.detect` picks
one from a template's text.
"""

from __future__ import annotations

from ringserve.formats.base import ChatFormat, ReasoningMarkers
from ringserve.formats.generic import GENERIC
from ringserve.formats.markup import JsonCalls, MarkupFormat, NamedCalls, TaggedCalls
from ringserve.formats.special import GEMMA_4, PYTHONIC, HarmonyFormat, LlamaCalls, RecipientFormat

__all__ = ["FAMILIES", "THINK"]

THINK = ReasoningMarkers("<think>", "</think>")
"""The common thinking block (Qwen3, DeepSeek R1, GLM, Kimi, MiniMax, SmolLM3...)."""

_HERMES_CALLS = JsonCalls("<tool_call>", "</tool_call>")
_QWEN3_CODER_CALLS = TaggedCalls(
    call_open="<tool_call>", func_open="<function=", name_end=(">",), param_open="<parameter=", key_end=">",
    value_close="</parameter>", func_close="</function>", close="</tool_call>", bare_open="<function=", trim=True,
)
_GLM_CALLS = TaggedCalls(
    call_open="<tool_call>", name_end=("\n", "<arg_key>", "</tool_call>"), param_open="<arg_key>",
    key_end="</arg_key>", value_open="<arg_value>", value_close="</arg_value>", close="</tool_call>",
)
_DSML = "｜DSML｜"
_DEEPSEEK_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
_COMMAND_R_ACTIONS = dict(name_keys=("tool_name",), args_keys=("parameters",), array=True)


def _dsml(section: str) -> TaggedCalls:
    return TaggedCalls(
        section=(f"<{_DSML}{section}>", f"</{_DSML}{section}>"), call_open=f'<{_DSML}invoke name="',
        name_end=('">',), param_open=f'<{_DSML}parameter name="', key_end='" string="', type_attr=True,
        value_close=f"</{_DSML}parameter>", func_close=f"</{_DSML}invoke>",
    )


_FORMATS: tuple[ChatFormat, ...] = (
    GENERIC,
    MarkupFormat("generic-think", THINK, _HERMES_CALLS),
    MarkupFormat("hermes", THINK, _HERMES_CALLS),
    MarkupFormat("qwen3-coder", THINK, _QWEN3_CODER_CALLS, calls_end_reasoning=True),
    MarkupFormat("seed-oss", ReasoningMarkers("<seed:think>", "</seed:think>"), TaggedCalls(
        call_open="<seed:tool_call>", func_open="<function=", name_end=(">",), param_open="<parameter=",
        key_end=">", value_close="</parameter>", func_close="</function>", close="</seed:tool_call>",
    )),
    MarkupFormat("glm-4.5", THINK, _GLM_CALLS, calls_end_reasoning=True),
    MarkupFormat("ling", THINK, _GLM_CALLS, calls_end_reasoning=True, dropped=("<|role_end|>",)),
    MarkupFormat("minimax-m2", THINK, TaggedCalls(
        section=("<minimax:tool_call>", "</minimax:tool_call>"), call_open='<invoke name="', name_end=('">',),
        param_open='<parameter name="', key_end='">', value_close="</parameter>", func_close="</invoke>",
    )),
    MarkupFormat("deepseek-r1", THINK, NamedCalls(
        section=_DEEPSEEK_SECTION, call_open="<｜tool▁call▁begin｜>", name_end=("<｜tool▁sep｜>",),
        close=("<｜tool▁call▁end｜>",), typed=("function", "```json", ("```", "<｜tool▁call▁end｜>")),
    )),
    MarkupFormat("deepseek-v3.1", THINK, NamedCalls(
        section=_DEEPSEEK_SECTION, call_open="<｜tool▁call▁begin｜>", name_end=("<｜tool▁sep｜>",),
        close=("<｜tool▁call▁end｜>",),
    )),
    MarkupFormat("deepseek-v3.2", THINK, _dsml("function_calls"), calls_end_reasoning=True),
    MarkupFormat("deepseek-v4", THINK, _dsml("tool_calls"), calls_end_reasoning=True),
    MarkupFormat("kimi-k2", THINK, NamedCalls(
        section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"), call_open="<|tool_call_begin|>",
        name_prefix="functions.", name_end=("<|tool_call_argument_begin|>",), id_suffix=":",
        close=("<|tool_call_end|>",),
    ), calls_end_reasoning=True),
    MarkupFormat("mistral-nemo", None, JsonCalls("[TOOL_CALLS]", array=True)),
    MarkupFormat("mistral", ReasoningMarkers("[THINK]", "[/THINK]"), NamedCalls(
        call_open="[TOOL_CALLS]", name_end=("[ARGS]", "[CALL_ID]"), id_marker="[CALL_ID]", args_open="[ARGS]",
    )),
    MarkupFormat("functionary-v3.1", None, NamedCalls(call_open="<function=", name_end=(">",), close=("</function>",))),
    MarkupFormat("firefunction-v2", None, JsonCalls("functools", array=True)),
    MarkupFormat("granite-3", THINK, JsonCalls("<|tool_call|>", array=True), dropped=("<response>", "</response>")),
    MarkupFormat("command-r7b", ReasoningMarkers("<|START_THINKING|>", "<|END_THINKING|>"),
                 JsonCalls("<|START_ACTION|>", "<|END_ACTION|>", **_COMMAND_R_ACTIONS),  # type: ignore[arg-type]
                 dropped=("<|START_RESPONSE|>", "<|END_RESPONSE|>")),
    MarkupFormat("cohere2-moe", ReasoningMarkers("<|START_THINKING|>", "<|END_THINKING|>"),
                 JsonCalls("<|START_ACTION|>", "<|END_ACTION|>", **_COMMAND_R_ACTIONS),  # type: ignore[arg-type]
                 dropped=("<|START_TEXT|>", "<|END_TEXT|>")),
    MarkupFormat("command-r-plus", None,
                 JsonCalls("Action:", head="```json", close="```", **_COMMAND_R_ACTIONS),  # type: ignore[arg-type]
                 dropped=("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>")),
    MarkupFormat("nemotron-nano-v2", THINK, JsonCalls("<TOOLCALL>", "</TOOLCALL>", array=True)),
    MarkupFormat("apriel", ReasoningMarkers("", "[BEGIN FINAL RESPONSE]"),
                 JsonCalls("<tool_calls>", "</tool_calls>", array=True), dropped=("[END FINAL RESPONSE]",)),
    MarkupFormat("minimax-m1", None, JsonCalls("<tool_calls>", "</tool_calls>")),
    HarmonyFormat(),
    RecipientFormat(),
    MarkupFormat("llama-3", None, LlamaCalls()),
    MarkupFormat("lfm2", THINK, PYTHONIC),
    MarkupFormat("minicpm5", THINK, TaggedCalls(
        call_open='<function name="', name_end=('">',), param_open='<param name="', key_end='">',
        value_close="</param>", func_close="</function>", nl="",
    )),
    MarkupFormat("gigachat-3", None, JsonCalls("<|message_sep|>", head="function call<|role_sep|>")),
    MarkupFormat("gigachat-3.1", None, JsonCalls("<|function_call|>")),
    MarkupFormat("minimax-m3", ReasoningMarkers("<mm:think>", "</mm:think>")),
    MarkupFormat("kimi-k3", ReasoningMarkers("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
                 dropped=("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>")),
    MarkupFormat("gemma-4", ReasoningMarkers("<|channel>thought", "<channel|>"), GEMMA_4,
                 dropped=("<|channel>thought", "<|channel>", "<channel|>")),
    MarkupFormat("apertus", ReasoningMarkers("<|inner_prefix|>", "<|inner_suffix|>"),
                 JsonCalls("<|tools_prefix|>", "<|tools_suffix|>", array=True, name_is_key=True)),
)

FAMILIES: dict[str, ChatFormat] = {f.name: f for f in _FORMATS}
"""Every family by name."""
