"""How llama-server shapes a request's messages beyond the template: the fixes its capabilities
call for (a system turn folded where the template cannot render one, tool-call arguments as
objects) and those of the families it knows (``common/chat.cpp``, ``common/parsers/*.cpp``), and
the two source patches it applies at load."""

from __future__ import annotations

import enum
import hashlib
import json

from ringserve.formats.template.base import Json, TemplateRenderError


class Family(enum.Enum):
    """The families whose prompt llama-server shapes beyond the template (its
    ``common_chat_try_specialized_template`` picks them in this order)."""

    MINISTRAL_3 = "ministral-3"
    GPT_OSS = "gpt-oss"
    LFM2 = "lfm2"
    DEEPSEEK_V4 = "deepseek-v4"
    GEMMA_4 = "gemma-4"
    GEMMA_4_LEGACY = "gemma-4-legacy"
    OTHER = "other"


def family(source: str) -> Family:
    """The family by the substrings llama.cpp looks for (``common/chat.cpp``)."""
    mistral = "[SYSTEM_PROMPT]" in source and "[TOOL_CALLS]" in source and "[ARGS]" in source
    if mistral and "[CALL_ID]" not in source:
        return Family.MINISTRAL_3
    if "<|channel|>" in source:
        return Family.GPT_OSS
    if "<|tool_list_start|>" in source:
        if "<|tool_list_end|>" in source:
            return Family.LFM2
    elif "List of tools: [" in source:
        return Family.LFM2  # LFM2.5
    if "dsml_token" in source and "DSML" in source and ("function_calls" in source or "tool_calls" in source):
        return Family.OTHER if "function_calls" in source else Family.DEEPSEEK_V4  # V3.2 or V4
    if "'<|tool_call>call:'" in source:
        return Family.GEMMA_4 if "{#- OpenAI Chat Completions:" in source else Family.GEMMA_4_LEGACY
    return Family.OTHER


def patched(source: str) -> str:
    """The two source patches llama.cpp applies at load (``common_chat_templates_init``):
    gpt-oss's check against channel markers in contents and Mistral's refusal of an empty
    turn are turned off."""
    if "<|channel|>" in source and "in message.content or" in source:
        source = source.replace(
            '{%- if "<|channel|>analysis<|message|>" in message.content or '
            '"<|channel|>final<|message|>" in message.content %}',
            "{%- if false %}",
        )
    if "[TOOL_CALLS]" in source and "if (message['content'] is none or" in source:
        source = source.replace(
            "{%- if (message['content'] is none or message['content'] == '' or "
            "message['content']|length == 0) and (message['tool_calls'] is not defined or "
            "message['tool_calls'] is none or message['tool_calls']|length == 0) %}",
            "{%- if false %}",
        )
    return source


#: Mistral's templates refuse a call id that is not 9 characters ("Tool call IDs should be
#: alphanumeric strings with length 9!"); ringserve's ids are longer, so they are mapped.
NINE_CHAR_IDS = "|length != 9"


def nine_chars(call_id: str) -> str:
    """A 9-character alphanumeric id for ``call_id`` (itself when it is one), the same for the
    same id, so a call and its result keep matching."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode("utf-8")).hexdigest()[:9]


#: StepFun's templates, whose message contents llama-server trims (llama.cpp issue 24181).
TRIMMED_MARK = "You have access to the following functions in JSONSchema format"


def thinking_field(messages: list[Json], drop_call_content: bool) -> list[Json]:
    """gpt-oss and LFM2 read past reasoning as ``thinking`` (gpt-oss: without the content
    of a turn with tool calls)."""
    out = []
    for m in messages:
        if isinstance(m.get("reasoning_content"), str):
            m = {**m, "thinking": m["reasoning_content"]}
            if drop_call_content and m.get("tool_calls"):
                del m["content"]
        out.append(m)
    return out


def ministral_3(messages: list[Json]) -> list[Json]:
    """Ministral 3 reads a system or assistant turn as typed parts, its reasoning first as
    a ``thinking`` part (``common/parsers/ministral3.cpp``)."""
    out = []
    for m in messages:
        if m["role"] not in ("system", "assistant"):
            out.append(m)
            continue
        parts: list[Json] = []
        if isinstance(m.get("reasoning_content"), str):
            parts.append({"type": "thinking", "thinking": m["reasoning_content"]})
        content = m.get("content")
        if isinstance(content, str):
            parts.append({"type": "text", "text": content})
        elif isinstance(content, list):
            parts.extend(content)
        out.append({k: v for k, v in m.items() if k != "reasoning_content"} | {"content": parts})
    return out


def deepseek_v4(messages: list[Json]) -> list[Json]:
    """DeepSeek V4 takes a run of tool results in the order of the calls they answer
    (``common/parsers/deepseek.cpp``)."""
    out = list(messages)
    order: dict[str, int] = {}
    i = 0
    while i < len(out):
        role = out[i]["role"]
        if role == "assistant" and out[i].get("tool_calls"):
            order = {c["id"]: n for n, c in enumerate(out[i]["tool_calls"]) if c.get("id")}
            i += 1
            continue
        if role not in ("user", "tool"):
            i += 1
            continue
        end = i
        while end < len(out) and out[end]["role"] in ("user", "tool"):
            end += 1
        results = [j for j in range(i, end) if out[j]["role"] == "tool"]
        if len(results) > 1 and order:
            ranked = sorted((out[j] for j in results), key=lambda m: order.get(m.get("tool_call_id", ""), 0))
            for j, m in zip(results, ranked, strict=True):
                out[j] = m
        i = end
    return out


def gemma_4_legacy(messages: list[Json]) -> list[Json]:
    """Older Gemma 4 templates take tool results as the calling turn's ``tool_responses``
    and the next assistant text as its content (``common/parsers/gemma4.cpp``)."""
    out = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        calls = list(m["tool_calls"])
        responses: list[Json] = []
        i += 1
        while i < len(messages) and messages[i]["role"] == "tool":
            result = messages[i]
            response = result.get("content")
            if isinstance(response, str):
                try:
                    response = json.loads(response, parse_constant=no_constant)
                except ValueError:
                    pass
            name = calls[len(responses)]["function"].get("name", "") if len(responses) < len(calls) else ""
            responses.append({"name": name or result.get("tool_call_id", ""), "response": response})
            i += 1
        turn: Json = {"role": "assistant", "tool_calls": calls}
        if responses:
            turn["tool_responses"] = responses
        if i < len(messages) and messages[i]["role"] == "assistant" and not messages[i].get("tool_calls"):
            if messages[i].get("content"):
                turn["content"] = messages[i]["content"]
                i += 1
        if isinstance(m.get("reasoning_content"), str):
            turn["reasoning_content"] = m["reasoning_content"]
        out.append(turn)
    return out


def no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def fold_system_turns(messages: list[Json]) -> list[Json]:
    """The system turns after the first message folded into the turn before them when that is a
    user or tool turn (its text, a blank line, theirs), else into the next user turn (theirs
    first), else made a user turn where they stand: for templates that cannot render a system
    turn in the middle. Folded into the turn before, as Claude Code's are (after its prompt and
    after tool results), a turn renders the same whatever follows it, so the prompt of one
    request stays a prefix of the next one's and the prefix cache hits."""
    out: list[Json] = []
    pending: list[Json] = []  # system turns after an assistant turn, for the next user turn
    for i, m in enumerate(messages):
        if m["role"] == "system" and i > 0:
            if out and out[-1]["role"] in ("user", "tool") and not pending:
                joined_text = f"{content_text(out[-1]['content'])}\n\n{content_text(m['content'])}"
                out[-1] = out[-1] | {"content": joined_text}
            else:
                pending.append(m)
            continue
        if pending and m["role"] == "user":
            texts = [*(content_text(p["content"]) for p in pending), content_text(m["content"])]
            m = m | {"content": "\n\n".join(texts)}
            pending = []
        elif pending:
            out += [{"role": "user", "content": content_text(p["content"])} for p in pending]
            pending = []
        out.append(m)
    return out + [{"role": "user", "content": content_text(p["content"])} for p in pending]


def joined(system: Json, content: Json) -> Json:
    """A system turn folded into the next turn: its text, a newline, the turn's text (the
    first text part of typed contents, where llama-server fails)."""
    if isinstance(content, str):
        return f"{content_text(system)}\n{content}"
    parts = list(content)
    first = next((i for i, p in enumerate(parts) if p.get("type") == "text"), None)
    if first is None:
        return [{"type": "text", "text": content_text(system)}, *parts]
    parts[first] = parts[first] | {"text": f"{content_text(system)}\n{parts[first]['text']}"}
    return parts


def content_text(content: Json) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p.get("type") == "text")


def object_arguments(message: Json) -> Json:
    """An assistant turn with its calls' arguments parsed, for templates that read them as
    objects (llama.cpp's ``func_args_not_string``)."""
    calls = []
    for call in message["tool_calls"]:
        try:
            arguments = json.loads(call["function"]["arguments"], parse_constant=no_constant)
        except ValueError as e:
            name = call["function"]["name"]
            raise TemplateRenderError(f"the arguments of tool call {name!r} are not JSON: {e}") from e
        calls.append(call | {"function": call["function"] | {"arguments": arguments}})
    return message | {"tool_calls": calls}
