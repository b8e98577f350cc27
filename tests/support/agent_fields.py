"""What Claude Code and Codex CLI send, field by field, and what ringserve should do with each (a proposal).

The field paths come from the captures in ``tests/data/agents/`` (:func:`captured_fields`); the
policy of each is :data:`FIELDS` (``docs/agents.md`` explains it). A path names a body field the way
:func:`field_paths` spells it: dots between keys, ``[type=X]`` or ``[role=X]`` for the members of
a list told apart by that key, ``[]`` for other list members; a tool's JSON Schema
(``input_schema``, ``parameters``) and a tool call's arguments count as one field each.
"""

from __future__ import annotations

import enum
import functools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data" / "agents"

#: Fields below the top level whose value is free-form (a schema, a tool call's input): their insides are not fields.
OPAQUE = ("input_schema", "parameters", "input", "arguments")


class Policy(enum.Enum):
    """What ringserve does with a field a real client sends (issue 33: it must never fail the request)."""

    HONOUR = "honour"  # implemented: it changes what ringserve does
    ACCEPT = "accept"  # it cannot change the answer's substance: accepted, named in the ignored-fields header
    REFUSE = "refuse"  # a correct answer needs it and ringserve cannot give it: 400 (none of the captured fields)


_H, _A = Policy.HONOUR, Policy.ACCEPT

#: (route, path) -> (policy, why). Values seen are in docs/agents.md.
FIELDS: dict[tuple[str, str], tuple[Policy, str]] = {
    # -- Anthropic Messages (Claude Code) --
    ("/v1/messages", "model"): (_H, "any name; the served model answers (Claude Code sends its own model names)"),
    ("/v1/messages", "max_tokens"): (_H, "32000-128000: clamped to the context left, not refused"),
    ("/v1/messages", "stream"): (_H, "true; false in the non-streaming fallback after a broken stream"),
    ("/v1/messages", "metadata.user_id"): (_A, "client bookkeeping (a JSON string of device and session ids)"),
    ("/v1/messages", "thinking.type"): (_H, "adaptive / enabled / absent: reasoning on or off; no thinking block from a model that does not reason"),
    ("/v1/messages", "thinking.display"): (_H, "omitted: thinking text not shown, the block still sent with its signature"),
    ("/v1/messages", "thinking.budget_tokens"): (_H, "31999 with 4.5 model names: the reasoning budget"),
    ("/v1/messages", "context_management.edits[type=clear_thinking_20251015].type"): (_H, "trims past thinking blocks"),
    ("/v1/messages", "context_management.edits[type=clear_thinking_20251015].keep"): (_H, "'all': nothing cleared"),
    ("/v1/messages", "output_config.effort"): (_H, "low/medium/high: the reasoning effort; accepted unchanged when the model does not reason"),
    ("/v1/messages", "system[type=text].type"): (_H, "three text blocks"),
    ("/v1/messages", "system[type=text].text"): (_H, "the first holds a per-request billing stamp that must not defeat the prefix cache"),
    ("/v1/messages", "system[type=text].cache_control.type"): (_A, "ephemeral: the prefix cache works without it"),
    ("/v1/messages", "messages[role=user].role"): (_H, ""),
    ("/v1/messages", "messages[role=user].content"): (_H, "a string (--bare: the first turn, from the second request on)"),
    ("/v1/messages", "messages[role=user].content[type=text].type"): (_H, ""),
    ("/v1/messages", "messages[role=user].content[type=text].text"): (_H, ""),
    ("/v1/messages", "messages[role=user].content[type=text].cache_control.type"): (_A, "ephemeral"),
    ("/v1/messages", "messages[role=user].content[type=tool_result].type"): (_H, ""),
    ("/v1/messages", "messages[role=user].content[type=tool_result].tool_use_id"): (_H, ""),
    ("/v1/messages", "messages[role=user].content[type=tool_result].content"): (_H, "a string"),
    ("/v1/messages", "messages[role=user].content[type=tool_result].content[type=text].type"): (_H, "or a list of blocks"),
    ("/v1/messages", "messages[role=user].content[type=tool_result].content[type=text].text"): (_H, ""),
    ("/v1/messages", "messages[role=user].content[type=tool_result].content[type=tool_reference].type"): (_H, "tool search: the named deferred tool joins the prompt"),
    ("/v1/messages", "messages[role=user].content[type=tool_result].content[type=tool_reference].tool_name"): (_H, ""),
    ("/v1/messages", "messages[role=user].content[type=tool_result].is_error"): (_H, "rendered with the result"),
    ("/v1/messages", "messages[role=user].content[type=tool_result].cache_control.type"): (_A, "ephemeral"),
    ("/v1/messages", "messages[role=system].role"): (_H, "a system message after the first user turn: folded in where it stands"),
    ("/v1/messages", "messages[role=system].content"): (_H, "a string"),
    ("/v1/messages", "messages[role=system].content[type=text].type"): (_H, "or text blocks"),
    ("/v1/messages", "messages[role=system].content[type=text].text"): (_H, ""),
    ("/v1/messages", "messages[role=system].content[type=text].cache_control.type"): (_A, "ephemeral"),
    ("/v1/messages", "messages[role=system].output_config.effort"): (_H, "per-turn effort (beta per-turn-control): as output_config.effort; under --bare on a message whose content is [] (a control message: nothing rendered)"),
    ("/v1/messages", "messages[role=assistant].role"): (_H, ""),
    ("/v1/messages", "messages[role=assistant].content[type=tool_use].type"): (_H, ""),
    ("/v1/messages", "messages[role=assistant].content[type=tool_use].id"): (_H, ""),
    ("/v1/messages", "messages[role=assistant].content[type=tool_use].name"): (_H, ""),
    ("/v1/messages", "messages[role=assistant].content[type=tool_use].input"): (_H, ""),
    ("/v1/messages", "tools[].name"): (_H, "12-13 tools"),
    ("/v1/messages", "tools[].description"): (_H, ""),
    ("/v1/messages", "tools[].input_schema"): (_H, "not strict: a schema the grammar cannot enforce is not a reason to refuse"),
    ("/v1/messages", "tools[].defer_loading"): (_H, "true: the tool stays out of the prompt until a tool_reference names it"),
    # -- OpenAI Responses (Codex CLI) --
    ("/v1/responses", "model"): (_H, "any name"),
    ("/v1/responses", "stream"): (_H, "always true"),
    ("/v1/responses", "store"): (_H, "false: nothing kept; the whole conversation comes back in input"),
    ("/v1/responses", "include[]"): (_H, "reasoning.encrypted_content: reasoning handed back restorable without state (none without reasoning)"),
    ("/v1/responses", "tool_choice"): (_H, "auto"),
    ("/v1/responses", "parallel_tool_calls"): (_H, "true"),
    ("/v1/responses", "reasoning.effort"): (_H, "the reasoning effort; accepted unchanged when the model does not reason"),
    ("/v1/responses", "reasoning.summary"): (_H, "auto / detailed: summaries of the reasoning, none when there is none"),
    ("/v1/responses", "text.verbosity"): (_A, "low: a style hint to the model"),
    ("/v1/responses", "prompt_cache_key"): (_H, "the session id: a hint for the prefix cache's slot choice"),
    ("/v1/responses", "client_metadata.x-codex-installation-id"): (_A, "client bookkeeping"),
    ("/v1/responses", "client_metadata.x-codex-window-id"): (_A, "client bookkeeping"),
    ("/v1/responses", "client_metadata.x-codex-turn-metadata"): (_A, "client bookkeeping (a JSON string)"),
    ("/v1/responses", "client_metadata.root_turn_id"): (_A, "client bookkeeping"),
    ("/v1/responses", "client_metadata.session_id"): (_A, "client bookkeeping"),
    ("/v1/responses", "client_metadata.thread_id"): (_A, "client bookkeeping"),
    ("/v1/responses", "client_metadata.turn_id"): (_A, "client bookkeeping"),
    ("/v1/responses", "input[type=message].type"): (_H, ""),
    ("/v1/responses", "input[type=message].id"): (_H, "client ids (msg_<uuid>): accepted, never looked up"),
    ("/v1/responses", "input[type=message].role"): (_H, "developer (twice, first) and user; developer messages anywhere"),
    ("/v1/responses", "input[type=message].content[type=input_text].type"): (_H, ""),
    ("/v1/responses", "input[type=message].content[type=input_text].text"): (_H, ""),
    ("/v1/responses", "input[type=function_call].type"): (_H, "replayed from output_item.done"),
    ("/v1/responses", "input[type=function_call].id"): (_H, "ringserve's own item id, handed back"),
    ("/v1/responses", "input[type=function_call].call_id"): (_H, ""),
    ("/v1/responses", "input[type=function_call].name"): (_H, ""),
    ("/v1/responses", "input[type=function_call].arguments"): (_H, ""),
    ("/v1/responses", "input[type=function_call].status"): (_H, "completed"),
    ("/v1/responses", "input[type=function_call_output].type"): (_H, ""),
    ("/v1/responses", "input[type=function_call_output].id"): (_H, "a client id (fco_<uuid>)"),
    ("/v1/responses", "input[type=function_call_output].call_id"): (_H, ""),
    ("/v1/responses", "input[type=function_call_output].output"): (_H, "a string"),
    ("/v1/responses", "input[type=custom_tool_call].type"): (_H, "replayed from output_item.done"),
    ("/v1/responses", "input[type=custom_tool_call].id"): (_H, ""),
    ("/v1/responses", "input[type=custom_tool_call].call_id"): (_H, ""),
    ("/v1/responses", "input[type=custom_tool_call].name"): (_H, ""),
    ("/v1/responses", "input[type=custom_tool_call].input"): (_H, "the raw patch text"),
    ("/v1/responses", "input[type=custom_tool_call].status"): (_H, "completed"),
    ("/v1/responses", "input[type=custom_tool_call_output].type"): (_H, ""),
    ("/v1/responses", "input[type=custom_tool_call_output].id"): (_H, "a client id (ctco_<uuid>)"),
    ("/v1/responses", "input[type=custom_tool_call_output].call_id"): (_H, ""),
    ("/v1/responses", "input[type=custom_tool_call_output].output"): (_H, "a string"),
    ("/v1/responses", "tools[type=function].type"): (_H, ""),
    ("/v1/responses", "tools[type=function].name"): (_H, ""),
    ("/v1/responses", "tools[type=function].description"): (_H, ""),
    ("/v1/responses", "tools[type=function].parameters"): (_H, ""),
    ("/v1/responses", "tools[type=function].strict"): (_H, "false"),
    ("/v1/responses", "tools[type=namespace].type"): (_H, "a group of tools (multi_agent_v1): flattened into functions"),
    ("/v1/responses", "tools[type=namespace].name"): (_H, ""),
    ("/v1/responses", "tools[type=namespace].description"): (_H, ""),
    ("/v1/responses", "tools[type=namespace].tools[type=function].type"): (_H, ""),
    ("/v1/responses", "tools[type=namespace].tools[type=function].name"): (_H, ""),
    ("/v1/responses", "tools[type=namespace].tools[type=function].description"): (_H, ""),
    ("/v1/responses", "tools[type=namespace].tools[type=function].parameters"): (_H, ""),
    ("/v1/responses", "tools[type=namespace].tools[type=function].strict"): (_H, ""),
    ("/v1/responses", "tools[type=custom].type"): (_H, "apply_patch, freeform: decoded under its grammar"),
    ("/v1/responses", "tools[type=custom].name"): (_H, ""),
    ("/v1/responses", "tools[type=custom].description"): (_H, ""),
    ("/v1/responses", "tools[type=custom].format.type"): (_H, "grammar"),
    ("/v1/responses", "tools[type=custom].format.syntax"): (_H, "lark: ringserve.core.lark"),
    ("/v1/responses", "tools[type=custom].format.definition"): (_H, "the Lark grammar"),
    ("/v1/responses", "tools[type=web_search].type"): (_A, "a hosted tool the model cannot call here: reported as ignored"),
    ("/v1/responses", "tools[type=web_search].external_web_access"): (_A, ""),
    ("/v1/responses", "tools[type=web_search].search_content_types[]"): (_A, ""),
    ("/v1/responses", "tools[type=tool_search].type"): (_A, "execution client: Codex runs it; until ringserve emits tool_search_call items, reported as ignored"),
    ("/v1/responses", "tools[type=tool_search].execution"): (_A, ""),
    ("/v1/responses", "tools[type=tool_search].description"): (_A, ""),
    ("/v1/responses", "tools[type=tool_search].parameters"): (_A, ""),
}


def field_paths(value: Any, path: str = "") -> set[str]:
    """The leaf paths of one request body, spelled as :data:`FIELDS` spells them."""
    out: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else key
            if key in OPAQUE and path:
                out.add(inner)
            else:
                out |= field_paths(item, inner)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and isinstance(item.get("type"), str):
                out |= field_paths(item, f"{path}[type={item['type']}]")
            elif isinstance(item, dict) and isinstance(item.get("role"), str):
                out |= field_paths(item, f"{path}[role={item['role']}]")
            else:
                out |= field_paths(item, f"{path}[]")
    elif path:
        out.add(path)
    return out


@functools.cache
def captured_fields(directory: Path = DATA) -> dict[tuple[str, str], set[str]]:
    """(route, path) -> the runs whose requests send it, over every capture in ``directory``."""
    seen: dict[tuple[str, str], set[str]] = defaultdict(set)
    for capture in sorted(directory.glob("*.jsonl")):
        for line in capture.read_text().splitlines():
            request = json.loads(line)
            if isinstance(request["body"], dict):
                for path in field_paths(request["body"]):
                    seen[(request["path"], path)].add(capture.stem)
    return dict(seen)
