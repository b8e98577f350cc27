"""The access log: one structured line per HTTP request, with no secret in it.

The ASGI connection (``app.ClosingHTTPConnection``) opens an
:class:`AccessRecord` when a request arrives, keeps it in the ASGI scope
under :data:`SCOPE_KEY` so handlers can add what only they know (the message
id, whether it is a resume, the error type), counts the response bytes it
sends, and logs the record once the response has ended, streams included.

The line is a JSON object on the ``ringserve.access`` logger at INFO, also
passed as ``extra={"access": {...}}`` for formatters that want the fields:
``request_id``, ``method``, ``route`` (the URL rule, e.g.
``/v1/messages/<message_id>/stream``), ``path``, ``query``, ``status``,
``duration_s``, ``bytes`` (response body bytes sent), ``resume``,
``message_id``, ``error_type``, ``client``.

Secrets: request headers are never logged (so ``Authorization`` and
``x-api-key`` cannot leak), and the value of every query parameter whose name
holds ``token``, ``key``, ``secret``, ``password`` or ``auth`` is replaced by
``[redacted]`` (``?stream_token=...`` in particular).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from urllib.parse import parse_qsl, urlencode

import attrs

from ringserve.core.errors import ErrorKind
from ringserve.surfaces.base import ignored_fields_header

__all__ = ["SCOPE_KEY", "AccessRecord", "redact_query", "request_id_from"]

log = logging.getLogger("ringserve.access")

#: Where the record lives in the ASGI scope.
SCOPE_KEY = "ringserve.access"

REDACTED = "[redacted]"
_SECRET_NAME = re.compile(r"token|key|secret|password|auth", re.IGNORECASE)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def redact_query(raw: bytes) -> str:
    """A query string with the values of secret-looking parameters replaced.

    Args:
        raw: the raw query string from the ASGI scope (no leading ``?``).

    Returns:
        The query re-encoded (``application/x-www-form-urlencoded``), with
        ``[redacted]`` for the value of every parameter whose name matches
        ``token|key|secret|password|auth`` (case-insensitive), for such a
        name itself unless it is a plain identifier, and for any value that
        holds one of those words. Undecodable
        bytes are kept as U+FFFD, never raised on.
    """
    if not raw:
        return ""
    pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True, encoding="utf-8", errors="replace")
    return urlencode([_redact_pair(k, v) for k, v in pairs], safe="[]")


def _redact_pair(name: str, value: str) -> tuple[str, str]:
    """Hide a value under a secret-looking name, and any name or value that smuggles one in
    (``stream_token%3D...`` decodes to a name holding the token; ``a=1;stream_token=...`` to a value)."""
    if _SECRET_NAME.search(name):
        return (name if _PLAIN_NAME.fullmatch(name) else REDACTED), REDACTED
    return name, REDACTED if _SECRET_NAME.search(value) else value


def request_id_from(value: str | None) -> str:
    """The client's ``X-Request-Id`` if it is 1-64 safe characters, else a fresh random id."""
    if value is not None and _REQUEST_ID.fullmatch(value):
        return value
    return secrets.token_hex(8)


@attrs.define(eq=False)
class AccessRecord:
    """What is known about one request; handlers fill in their part.

    Attributes:
        request_id: echoed to the client as ``X-Request-Id``.
        route: the matched URL rule, or None (no route matched).
        status: the HTTP status sent (0 until the response starts).
        bytes: response body bytes sent so far.
        message_id: the message the request created or read, if any.
        resume: whether the request read a stream through the resume route.
        error_kind: the error kind answered (logged as ``error_type``, ``ErrorKind.label``).
        ignored_fields: the request fields accepted and ignored, as the
            ``Ringserve-Ignored-Fields`` header says them ("" for none: no header).
    """

    request_id: str
    method: str
    path: str
    query: str
    client: str | None
    started: float = attrs.Factory(time.perf_counter)
    route: str | None = None
    status: int = 0
    bytes: int = 0
    message_id: str | None = None
    resume: bool = False
    error_kind: ErrorKind | None = None
    ignored_fields: str = ""

    def note_ignored(self, paths: tuple[str, ...]) -> None:
        """Name ``paths``, the request fields accepted and ignored, in the response's
        ``Ringserve-Ignored-Fields`` header, and log them (``ringserve``, DEBUG)."""
        if paths:
            self.ignored_fields = ignored_fields_header(paths)
            logging.getLogger("ringserve").debug("request %s: fields ignored: %s", self.request_id, ", ".join(paths))

    @classmethod
    def from_scope(cls, scope: dict) -> AccessRecord:
        """A record for an ASGI HTTP scope (query redacted at once)."""
        given = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"), None)
        client = scope.get("client")
        return cls(
            request_id=request_id_from(given),
            method=scope.get("method", ""),
            path=scope.get("path", ""),
            query=redact_query(scope.get("query_string", b"")),
            client=client[0] if client else None,
        )

    def fields(self) -> dict:
        """The logged fields (see the module docstring), duration measured now."""
        return {
            "request_id": self.request_id,
            "method": self.method,
            "route": self.route,
            "path": self.path,
            "query": self.query,
            "status": self.status,
            "duration_s": round(time.perf_counter() - self.started, 6),
            "bytes": self.bytes,
            "resume": self.resume,
            "message_id": self.message_id,
            "error_type": None if self.error_kind is None else self.error_kind.label,
            "client": self.client,
        }

    def emit(self) -> None:
        """Log the record: one JSON line on ``ringserve.access`` at INFO."""
        if log.isEnabledFor(logging.INFO):
            fields = self.fields()
            log.info("%s", json.dumps(fields, ensure_ascii=True, separators=(",", ":")), extra={"access": fields})
