"""What every part of the chat-template package shares: the JSON value a template reads, and its
two errors."""

from __future__ import annotations

from typing import Any

#: A JSON value as the template sees it.
Json = Any


class TemplateLoadError(Exception):
    """The chat template cannot be loaded: ``str(error)`` says why in one line (a Jinja
    syntax error and its line)."""


class TemplateRenderError(Exception):
    """The chat template cannot render this request: the caller's error (an HTTP 400).

    ``str(error)`` says why in one line; ``raised`` is the template's own message when it
    refused the request with ``raise_exception`` (for example "Conversation roles must
    alternate user/assistant/user/assistant/..."), else ``None``.
    """

    def __init__(self, message: str, raised: str | None = None) -> None:
        super().__init__(message)
        self.raised = raised
