"""Errors that carry their HTTP hint, in the manner of h11's ``ProtocolError``.

Surfaces turn a :class:`RingserveError` into their own error JSON; the
``kind`` names below are surface-neutral and each surface has one table that
maps a kind to its type string (see ``surfaces/anthropic.py`` and
``surfaces/openai.py``).
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """Surface-neutral error kinds with their default HTTP status."""

    INVALID_REQUEST = 400
    AUTHENTICATION = 401
    PERMISSION = 403
    NOT_FOUND = 404
    CONFLICT = 409
    GONE = 410
    REQUEST_TOO_LARGE = 413
    UNPROCESSABLE = 422
    RATE_LIMIT = 429
    API_ERROR = 500
    OVERLOADED = 529
    UNAVAILABLE = 503

    @property
    def is_overload(self) -> bool:
        """The server is busy, not the request wrong: answered with ``Retry-After``."""
        return self in (ErrorKind.RATE_LIMIT, ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE)

    @property
    def label(self) -> str:
        """The name in lower case (``"api_error"``): the ``type`` label of metrics and the access log."""
        return self.name.lower()


#: Seconds suggested by an overload error that names no better value.
DEFAULT_RETRY_AFTER = 1.0

#: The ``param`` of an error about the whole conversation (it cannot be rendered, or does not fit
#: the context): the field that holds it on the chat surfaces; the Responses surface reports it
#: as its ``input``.
PROMPT_PARAM = "messages"


class RingserveError(Exception):
    """An error with the status and kind a surface needs to answer it.

    Args:
        kind: what went wrong, surface-neutral.
        message: a sentence for the client; never contains secrets.
        param: the offending request field, if any (OpenAI reports it).
        retry_after: seconds for the ``Retry-After`` and ``retry-after-ms``
            headers; an overload kind (``ErrorKind.is_overload``) without one
            gets :data:`DEFAULT_RETRY_AFTER`, so every 429, 503 and 529 tells
            the SDKs' retry loops how long to wait.
        retryable: whether the same request may succeed later.
    """

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after = DEFAULT_RETRY_AFTER if retry_after is None and kind.is_overload else retry_after
        self.retryable = retryable

    @property
    def status(self) -> int:
        return self.kind.value


def invalid(message: str, param: str | None = None) -> RingserveError:
    """Shorthand for a 400 ``INVALID_REQUEST`` error."""
    return RingserveError(ErrorKind.INVALID_REQUEST, message, param=param)


def key_refused(url: str, key_source: str | None) -> str:
    """The command line's one line for a 401 from the server at ``url``: ``key_source`` names where
    the refused key came from (``--api-key or $RINGSERVE_API_KEY``, ``the config's [auth] api_keys``),
    None when no key was sent."""
    if key_source is None:
        return f"{url} wants an API key: give --api-key or set RINGSERVE_API_KEY"
    return f"{url} refused the API key ({key_source}): give one of the server's keys"

