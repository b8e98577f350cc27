"""The client's errors: one hierarchy under :class:`ClientError`."""

from __future__ import annotations

from typing import Any


class ClientError(Exception):
    """Base of the client's errors.

    Attributes:
        message_id: the message, if known.
        text: the reply text delivered before the error.
    """

    def __init__(self, message: str, *, message_id: str | None = None, text: str = "") -> None:
        super().__init__(message)
        self.message_id = message_id
        self.text = text


class APIError(ClientError):
    """An HTTP error answer that a retry cannot fix (4xx, 500), or retryable ones past ``max_retries``.

    Attributes:
        status: the HTTP status.
        type: the error ``type`` from the surface's error JSON (e.g.
            ``invalid_request_error``), or "" if the body had none.
    """

    def __init__(self, status: int, type_: str, message: str, **kwargs: Any) -> None:
        super().__init__(f"HTTP {status} {type_}: {message}" if type_ else f"HTTP {status}: {message}", **kwargs)
        self.status = status
        self.type = type_


class StreamError(ClientError):
    """The stream ended with an in-band error event, or the stored message failed.

    Attributes:
        type: the error type (Anthropic ``api_error``/``overloaded_error``...,
            OpenAI Chat ``server_error``..., the Responses error ``code``
            ``server_error``/``rate_limit_exceeded``...; ``interrupted`` for a
            message a server restart cut short).
    """

    def __init__(self, type_: str, message: str, **kwargs: Any) -> None:
        super().__init__(f"{type_}: {message}", **kwargs)
        self.type = type_


class ConnectionLost(ClientError):
    """More than ``max_retries`` consecutive attempts failed without a new event."""


class NoServer(ClientError):
    """The connection was refused, and this client has had no answer from its server yet: nothing
    listens at its URL (the server is not running, or runs elsewhere). Raised at once, without
    retrying; once the client has had an answer, a refused connection (a server restarting) is a
    drop like any other."""


class RequestTimeout(ClientError, TimeoutError):
    """The stream did not finish within the client's ``timeout``."""

