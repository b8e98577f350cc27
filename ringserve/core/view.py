"""A message as its readers see it, live or stored: one frozen value.

The hub builds it from a live message's producer (``live/message.py``
``LiveMessage.view``), from the store's row (``store/sqlite.py``
``StoredMessage.view``) or from what another replica shared; the HTTP
decisions (``http/decide.py``) and every JSON body of a message
(``Surface.message_json``, ``surfaces/ringserve.py``) read only this. What
needs Trio (waiting for the end, cancelling) takes the live handle instead
(``Hub.live``).
"""

from __future__ import annotations

import enum

import attrs

from ringserve.core.events import BlockKind, ContentBlock, StopReason, Usage
from ringserve.core.status import MessageStatus


class WaitReason(enum.Enum):
    """Why a queued message has no token yet."""

    MODEL_LOADING = "model_loading"
    """Its model is loading (``live/models.py``)."""
    QUEUED = "queued"
    """In its model's admission queue, for a slot and room in the KV pool (``core/scheduler.py``)."""
    PREFILL = "prefill"
    """Admitted: its prompt is being read."""


@attrs.frozen
class Waiting:
    """What a queued message waits for.

    Attributes:
        reason: see :class:`WaitReason`.
        ahead: requests admission takes before it (``QUEUED``).
        progress: the share of its model's weights loaded, 0 to 1 (``MODEL_LOADING``).
    """

    reason: WaitReason
    ahead: int | None = None
    progress: float | None = None


@attrs.frozen
class MessageView:
    """One message now.

    Attributes:
        id: its id (``<surface id prefix><hex>``).
        surface: the name of the surface that made it (``surfaces/registry.py``).
        model: the served model's id.
        created: Unix seconds.
        status: where it is in ``core/status.py``'s ``TRANSITIONS``.
        content: its content blocks released so far (all of them once it ended).
        stop_reason: surface-neutral; the surface spells it.
        stop_sequence: the stop string that ended it, if one did.
        usage: its token counts so far.
        error: the message of the failure that ended it (``failed``, ``interrupted``).
        echo: the surface's own state its objects echo (``Surface.restored``; "" for a
            surface with none).
        request_hash: its request body's fingerprint (``Idempotency-Key`` checks).
        live: its generation runs on this replica (or ended here and the store has not
            written its final state yet): ``Hub.live`` has its handle.
        waiting: what it waits for while it is queued here (None otherwise).
    """

    id: str
    surface: str
    model: str
    created: int
    status: MessageStatus
    content: tuple[ContentBlock, ...] = ()
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage = Usage(0, 0)
    error: str | None = None
    echo: str = ""
    request_hash: str = ""
    live: bool = False
    waiting: Waiting | None = None

    @property
    def text(self) -> str:
        """The text of its text blocks, joined."""
        return "".join(b.text for b in self.content if b.kind is BlockKind.TEXT)

    @property
    def cancelled(self) -> bool:
        """It was ended by a cancel (its stop reason is spelled as the surface's plain end of turn)."""
        return self.status is MessageStatus.CANCELLED
