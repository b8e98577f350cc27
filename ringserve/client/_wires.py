"""The read side of each surface the client speaks, looked up by surface name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ringserve.client._models import Usage
from ringserve.surfaces.base import CANCELLED_KEY
from ringserve.surfaces.openai import OpenAISurface

@attrs.define(eq=False)
class Reading:
    """What a stream's events have said so far."""

    model: str = ""
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage | None = None
    terminal: bool = False
    error: tuple[str, str] | None = None
    cancelled: bool = False


class AnthropicWire:
    """Anthropic Messages streaming, read side (Anthropic docs: "Streaming Messages")."""

    path = "/v1/messages"

    def body(self, messages: list[dict[str, Any]], *, model: str, max_tokens: int, system: str | None,
             params: Mapping[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": messages, "stream": True}
        if system is not None:
            body["system"] = system
        return {**body, **params}

    def read(self, event: str, data: Any, into: Reading) -> str:
        """Apply one event to ``into``; return the text it adds."""
        if event == "content_block_delta":
            delta = data.get("delta") or {}
            return delta.get("text") or "" if delta.get("type") == "text_delta" else ""
        if event == "message_start":
            message = data.get("message") or {}
            into.model = message.get("model") or into.model
        elif event == "message_delta":
            delta = data.get("delta") or {}
            into.stop_reason = delta.get("stop_reason")
            into.stop_sequence = delta.get("stop_sequence")
            into.cancelled = delta.get(CANCELLED_KEY) is True
            usage = data.get("usage") or {}
            # Anthropic's input_tokens is the uncached part; cache_read_input_tokens the rest
            prompt = usage.get("input_tokens", 0) + (usage.get("cache_read_input_tokens") or 0)
            into.usage = Usage(prompt, usage.get("output_tokens", 0))
        elif event == "message_stop":
            into.terminal = True
        elif event == "error":
            error = data.get("error") or {}
            into.error = (error.get("type") or "error", error.get("message") or "")
            into.terminal = True
        return ""


class OpenAIWire:
    """OpenAI Chat Completions streaming, read side (OpenAI API reference: "Streaming")."""

    path = "/v1/chat/completions"
    done = "[DONE]"

    def body(self, messages: list[dict[str, Any]], *, model: str, max_tokens: int, system: str | None,
             params: Mapping[str, Any]) -> dict[str, Any]:
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        body = {"model": model, "max_tokens": max_tokens, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}}
        return {**body, **params}

    def read(self, event: str, data: Any, into: Reading) -> str:
        """Apply one event to ``into``; return the text it adds."""
        if data == self.done:
            into.terminal = True
            return ""
        if "error" in data:
            error = data["error"] or {}
            into.error = (error.get("type") or "error", error.get("message") or "")
            into.terminal = True
            return ""
        into.model = data.get("model") or into.model
        usage = data.get("usage")
        if usage:
            into.usage = Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        text = ""
        for choice in data.get("choices") or ():
            text += (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason") is not None:
                into.stop_reason = choice["finish_reason"]
                into.cancelled = choice.get(CANCELLED_KEY) is True
        return text


Wire = AnthropicWire | OpenAIWire

WIRES: dict[str, Wire] = {"anthropic": AnthropicWire(), "openai": OpenAIWire()}


def wire(surface: str) -> Wire:
    """The read side of ``surface``.

    Raises:
        ValueError: not ``"anthropic"`` or ``"openai"``.
    """
    if surface not in WIRES:
        raise ValueError(f"surface must be one of {sorted(WIRES)}, got {surface!r}")
    return WIRES[surface]


def wire_of(message_id: str) -> Wire:
    return WIRES["openai"] if message_id.startswith(OpenAISurface.id_prefix) else WIRES["anthropic"]




def user_messages(prompt: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A prompt string as one user turn; a list of ``{"role", "content"}`` turns as is."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]

