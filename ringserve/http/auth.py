"""API keys and stream tokens: who may use the server, and who may read one stream.

API keys come from ``[auth] api_keys`` and from the environment variables
``RINGSERVE_API_KEYS`` (comma-separated) and ``RINGSERVE_API_KEY`` (one: the variable ringserve's
clients and ``launch`` send from, so that one exported key protects the server it starts too);
all are accepted. A client
presents one as ``Authorization: Bearer KEY`` (what the OpenAI SDK sends) or
``x-api-key: KEY`` (what the Anthropic SDK sends). Keys are kept only as
SHA-256 digests and compared with :func:`hmac.compare_digest` against every
configured key, so neither the time taken nor an early exit tells which key,
or how much of one, matched. With no keys configured, auth is off.

Stream tokens are for clients that cannot set headers (a browser
``EventSource``): ``<expires>.<mac>``, where ``expires`` is a Unix time in
whole seconds and ``mac`` is the unpadded base64url HMAC-SHA256 of the message
id and ``expires`` under a secret drawn at start-up. A token reads one
message's stream until it expires; it is not single-use, because an
``EventSource`` reconnects by itself to the very same URL (WHATWG HTML,
"Server-sent events": "reestablish the connection"), so a single-use token
would turn the first network blip into a permanent failure (a non-200 answer
makes ``EventSource`` give up). The short lifetime, the binding to one
message and the read-only scope bound what a leaked token gives away.
Tokens do not survive a restart (nor do the stream logs they read).

Nothing secret is ever logged: ``repr`` shows no key, digest or secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import attrs

from ringserve.config import AuthConfig

__all__ = ["ENV_KEY", "ENV_KEYS", "ENV_TOKEN_SECRET", "AuthSetupError", "Authenticator", "check_bind", "is_loopback",
           "with_environ"]

#: Environment variable with extra API keys, comma-separated.
ENV_KEYS = "RINGSERVE_API_KEYS"
#: Environment variable with one more API key (the one ringserve's clients send).
ENV_KEY = "RINGSERVE_API_KEY"
#: Environment variable with the stream-token secret (replaces ``[auth] stream_token_secret``).
ENV_TOKEN_SECRET = "RINGSERVE_STREAM_TOKEN_SECRET"

_MAX_KEY_LENGTH = 512
_MAX_TOKEN_LENGTH = 128


class AuthSetupError(ValueError):
    """Auth settings the server cannot start with: a malformed key, or an unsafe bind."""


def _digest(value: str | bytes) -> bytes:
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogateescape")
    return hashlib.sha256(value).digest()


def _check_key(key: str) -> str:
    if not key or len(key) > _MAX_KEY_LENGTH or not key.isascii() or not key.isprintable() or " " in key or "," in key:
        raise AuthSetupError(
            f"an API key must be 1-{_MAX_KEY_LENGTH} printable ASCII characters without spaces or commas"
        )
    return key


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


class HeaderLookup(Protocol):
    """Request headers, looked up by name (werkzeug's case-insensitive ``Headers``, or a mapping)."""

    def get(self, key: str) -> str | None: ...


def with_environ(config: AuthConfig, environ: Mapping[str, str] = os.environ) -> AuthConfig:
    """``config`` as the server applies it: with the keys of ``RINGSERVE_API_KEYS`` (comma-separated)
    and ``RINGSERVE_API_KEY`` after its own, and ``RINGSERVE_STREAM_TOKEN_SECRET`` as the stream-token
    secret when set. The keys are not checked here (:meth:`Authenticator.from_config` does)."""
    keys = [k.strip() for k in environ.get(ENV_KEYS, "").split(",") if k.strip()]
    keys += [environ[ENV_KEY]] if environ.get(ENV_KEY) else []
    secret = environ.get(ENV_TOKEN_SECRET, "") or config.stream_token_secret
    return attrs.evolve(config, api_keys=(*config.api_keys, *keys), stream_token_secret=secret)


@attrs.define(eq=False, repr=False)
class Authenticator:
    """Checks API keys and issues and verifies stream tokens.

    Build it with :meth:`from_config`. All methods are synchronous and pure
    apart from reading :attr:`clock`.

    Args:
        key_digests: SHA-256 digests of the accepted API keys (empty: auth off).
        token_ttl: stream-token lifetime, in seconds.
        secret: the HMAC key for stream tokens (32 random bytes by default).
        clock: wall-clock seconds (``time.time``).
    """

    key_digests: tuple[bytes, ...] = ()
    token_ttl: float = 60.0
    secret: bytes = attrs.field(factory=lambda: secrets.token_bytes(32))
    clock: Callable[[], float] = time.time

    def __repr__(self) -> str:
        return f"Authenticator(keys={len(self.key_digests)}, token_ttl={self.token_ttl})"

    @classmethod
    def from_config(cls, config: AuthConfig, environ: Mapping[str, str] = os.environ) -> Authenticator:
        """Keys from ``config.api_keys`` plus ``RINGSERVE_API_KEYS`` and ``RINGSERVE_API_KEY`` in ``environ``.

        The stream-token secret: ``RINGSERVE_STREAM_TOKEN_SECRET``, else
        ``config.stream_token_secret`` (its SHA-256 is the HMAC key, so every
        replica given the same one accepts the others' tokens); neither set:
        32 random bytes (tokens work on this process only).

        Raises:
            AuthSetupError: a key is empty, longer than 512 characters, or holds a
                space, a comma or a non-printable or non-ASCII character.
        """
        config = with_environ(config, environ)
        shared = config.stream_token_secret
        secret = _digest(shared) if shared else secrets.token_bytes(32)
        return cls(tuple(_digest(_check_key(k)) for k in config.api_keys), config.stream_token_ttl, secret)

    @property
    def enabled(self) -> bool:
        """Whether any API key is configured (else every route is open)."""
        return bool(self.key_digests)

    # -- API keys -----------------------------------------------------------------------

    def key_matches(self, presented: str | None) -> bool:
        """Whether ``presented`` is one of the keys, compared in constant time.

        Every configured key is compared (no early exit); digests have one
        length, so the length of a key is not leaked either.
        """
        if presented is None or not self.key_digests:
            return False
        candidate = _digest(presented)
        ok = False
        for digest in self.key_digests:
            ok |= hmac.compare_digest(candidate, digest)
        return ok

    def request_key_ok(self, headers: HeaderLookup) -> bool:
        """Whether a request's ``Authorization: Bearer`` or ``x-api-key`` holds a valid key.

        The scheme ``Bearer`` is case-insensitive (RFC 9110, section 11.1);
        either header may carry the key.
        """
        scheme, _, credentials = (headers.get("Authorization") or "").strip().partition(" ")
        bearer = credentials.strip() if scheme.lower() == "bearer" else None
        return self.key_matches(bearer) | self.key_matches(headers.get("x-api-key"))

    # -- stream tokens ------------------------------------------------------------------

    def _mac(self, message_id: str, expires: int) -> str:
        payload = f"stream:{message_id}:{expires}".encode("utf-8", "surrogateescape")
        return _b64(hmac.new(self.secret, payload, hashlib.sha256).digest())

    def issue(self, message_id: str, *, now: float | None = None) -> tuple[str, int]:
        """A stream token for ``message_id``, valid for :attr:`token_ttl` seconds.

        Args:
            message_id: the one message the token may read.
            now: issue time in Unix seconds (default: :attr:`clock`).

        Returns:
            ``(token, expires)``: the token (URL-safe, no quoting needed) and
            its expiry in whole Unix seconds.
        """
        now = self.clock() if now is None else now
        expires = int(now + self.token_ttl + 0.999999)
        return f"{expires}.{self._mac(message_id, expires)}", expires

    def token_ok(self, token: str | None, message_id: str) -> bool:
        """Whether ``token`` was issued here for ``message_id`` and has not expired.

        A token for another message, an expired one, a forged or malformed
        one, and ``None`` all give False. Each token has one spelling, the one
        :meth:`issue` wrote: the whole text is compared (in constant time) with
        the token issued for its expiry, so ``0<expires>.<mac>``, which names
        the same integer, is refused too.
        """
        if token is None or len(token) > _MAX_TOKEN_LENGTH:
            return False
        expires_text, dot, _ = token.partition(".")
        if not dot or not (expires_text.isascii() and expires_text.isdigit()) or len(expires_text) > 12:
            return False
        expires = int(expires_text)
        canonical = f"{expires}.{self._mac(message_id, expires)}"
        good = hmac.compare_digest(canonical.encode(), token.encode("utf-8", "surrogateescape"))
        return good and self.clock() < expires


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) is reachable only from this machine.

    ``localhost`` and any loopback IP (``127.0.0.0/8``, ``::1``) are; every
    other name or address, ``0.0.0.0`` and ``::`` included, is not.
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, auth: Authenticator, allow_remote_without_keys: bool) -> None:
    """Refuse to listen beyond loopback without API keys, unless told to.

    Raises:
        AuthSetupError: a one-line message naming the host and the two ways out.
    """
    if not (auth.enabled or allow_remote_without_keys or is_loopback(host)):
        raise AuthSetupError(
            f"refusing to listen on {host} with no API keys: set [auth] api_keys or {ENV_KEYS},"
            f" or [auth] allow_remote_without_keys = true"
        )
