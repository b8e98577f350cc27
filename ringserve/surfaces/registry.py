"""Every surface the server speaks, and the lookups that pick one per request.

A surface is chosen by lookup, never by an ``if`` on its name, in the manner
of h11's ``READERS``/``WRITERS`` tables: a generation route maps to its
surface (:attr:`Surfaces.routes`); a message id maps to the surface that made
it by its prefix (:meth:`Surfaces.for_message`); any other request (a 404, a
401, ``/v1/models``) is answered in the error shape that
:meth:`Surfaces.for_request` finds by path prefix, then by a header only one
SDK sends. A new surface is one more entry in :data:`SURFACES`; its ``[policy]``
key is its name (:meth:`Surfaces.policy`).
"""

from __future__ import annotations

from collections.abc import Mapping, Set

import attrs

from ringserve.config import PolicyConfig
from ringserve.core.status import Policy
from ringserve.surfaces.anthropic import AnthropicSurface
from ringserve.surfaces.base import Counting, Surface
from ringserve.surfaces.openai import OpenAISurface
from ringserve.surfaces.responses import RESPONSES


def _check_prefixes(instance: Surfaces, attribute: attrs.Attribute[tuple[Surface, ...]], value: tuple[Surface, ...]) -> None:
    """No two surfaces share a name, and no id prefix starts another (else an id names two surfaces)."""
    names = [s.name for s in value]
    if len(set(names)) != len(names):
        raise ValueError(f"surface names repeat: {names}")
    for a in value:
        for b in value:
            if a is not b and b.id_prefix.startswith(a.id_prefix):
                raise ValueError(f"id prefix {a.id_prefix!r} ({a.name}) starts {b.id_prefix!r} ({b.name})")


@attrs.frozen
class Surfaces:
    """The registered surfaces and the tables that choose one.

    Attributes:
        surfaces: every surface, each with a distinct ``name`` and an
            ``id_prefix`` that starts no other's.
        routes: ``POST`` path → the surface that route generates in.
        paths: path prefix → the surface whose error shape answers a request
            under it that names no message (or one with an unknown prefix);
            the longest matching prefix wins.
        headers: a request header (lower-cased) that only one SDK sends → that surface
            (``anthropic-version``: ``/v1/models`` is read by both SDKs).
        default: the surface of every other request (also outside ``/v1``).
        counts: ``POST`` path → the surface whose prompt tokens that route counts.
        renders: ``POST`` path → the surface whose request's prompt that route renders (the
            rendered text and its tokens, for people debugging a model's prompt).
        policy_like: a surface name → the surface whose ``[policy]`` setting it takes when it
            has none of its own (:meth:`policy`).
        continued: the names of the surfaces whose stored messages a later request continues by
            id (the Responses API's ``previous_response_id``): with the Redis backend the replicas
            share their request bodies, so that any replica reads the conversation.
    """

    surfaces: tuple[Surface, ...] = attrs.field(validator=_check_prefixes)
    routes: Mapping[str, Surface]
    paths: Mapping[str, Surface]
    headers: Mapping[str, Surface]
    default: Surface
    counts: Mapping[str, Counting] = attrs.Factory(dict)
    renders: Mapping[str, Surface] = attrs.Factory(dict)
    policy_like: Mapping[str, str] = attrs.Factory(dict)
    continued: frozenset[str] = frozenset()

    def policy(self, policies: PolicyConfig, surface: Surface) -> Policy:
        """The disconnect policy of ``surface``'s messages: its ``[policy]`` key, else that of the
        surface :attr:`policy_like` names for it, else ``abort``."""
        name: str | None = surface.name
        while name is not None:
            if name in policies.surfaces:
                return policies.surfaces[name]
            name = self.policy_like.get(name)
        return Policy.ABORT

    def check_policies(self, policies: PolicyConfig) -> None:
        """Refuse a ``[policy]`` key that names no surface (a typo would else be ignored).

        Raises:
            ValueError: one line naming the unknown keys.
        """
        unknown = sorted(set(policies.surfaces) - {s.name for s in self.surfaces})
        if unknown:
            raise ValueError(f"unknown key(s) in [policy]: {', '.join(unknown)}")

    def by_name(self, name: str) -> Surface:
        """The surface called ``name`` (the store keeps a message's surface by name).

        Raises:
            KeyError: no surface is called ``name``.
        """
        for surface in self.surfaces:
            if surface.name == name:
                return surface
        raise KeyError(name)

    def for_message(self, message_id: str) -> Surface | None:
        """The surface whose ids start like ``message_id``, or None for an id no surface makes."""
        for surface in self.surfaces:
            if message_id.startswith(surface.id_prefix):
                return surface
        return None

    def for_request(self, path: str, headers: Set[str], message_id: str | None = None) -> Surface:
        """The surface whose error shape answers a request: by the message id it names, else by
        path prefix, else by an SDK's header, else :attr:`default`.

        Args:
            path: the request's path.
            headers: the names of its headers, lower-cased.
            message_id: the ``<message_id>`` of the matched route, if any.
        """
        if message_id is not None and (surface := self.for_message(message_id)) is not None:
            return surface
        matches = [prefix for prefix in self.paths if path.startswith(prefix)]
        if matches:
            return self.paths[max(matches, key=len)]
        for header, surface in self.headers.items():
            if header in headers:
                return surface
        return self.default


ANTHROPIC = AnthropicSurface()
OPENAI = OpenAISurface()

#: The surfaces this server speaks.
SURFACES = Surfaces(
    surfaces=(ANTHROPIC, OPENAI, RESPONSES),
    routes={"/v1/messages": ANTHROPIC, "/v1/chat/completions": OPENAI, "/v1/responses": RESPONSES},
    paths={"/v1/messages": ANTHROPIC, "/v1/responses": RESPONSES},
    headers={"anthropic-version": ANTHROPIC},
    default=OPENAI,
    counts={"/v1/messages/count_tokens": ANTHROPIC, "/v1/responses/input_tokens": RESPONSES},
    renders={"/v1/messages/render": ANTHROPIC, "/v1/chat/completions/render": OPENAI, "/v1/responses/render": RESPONSES},
    policy_like={"responses": "openai"},  # a foreground response follows [policy] openai unless [policy] responses
    continued=frozenset({RESPONSES.name}),
)
