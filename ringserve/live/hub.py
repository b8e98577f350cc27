"""The registry of the messages generated on this replica, and the one door to any message.

Generations are decoupled from connections: one producer task per message
(``live/produce.py``), and every HTTP connection, the first one included, is a
reader of its log, so a dropped client costs a replay, not the answer. The hub
starts a generation (or finds the one an ``Idempotency-Key`` names:
``live/idempotency.py``), keeps its live handle until the store holds its end
(``live/persist.py``), applies the disconnect policy, cancels and drains, and
answers for any message, live or stored, here or on another replica, with its
view (``core/view.py``). Resumes go through ``live/resume.py``.

When the last reader of a message leaves, its disconnect policy decides:
``abort`` cancels the generation after ``grace_seconds`` (the runner frees its
slot and KV cells before the next decode step; a message of a client session waits at least
``idempotency.SESSION_GRACE_SECONDS`` for its client's retry); ``continue`` lets it finish.
A cancelled message is billed for the tokens really sampled.
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
import sqlite3
import time

import trio

from ringserve.config import Config
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.signing import ReasoningSigner, new_key
from ringserve.core.status import CancelReason, MessageStatus, Policy
from ringserve.core.view import MessageView
from ringserve.live.models import Lease, ModelPool
from ringserve.live.idempotency import SESSION_GRACE_SECONDS, Keys, SessionTurns, retry_answer, session_key, surface_key
from ringserve.live.message import Created, LiveMessage
from ringserve.live.persist import Persister
from ringserve.live.produce import Production
from ringserve.live.resume import Resume
from ringserve.live.safety import SafetyStage
from ringserve.logs.cluster import Cluster
from ringserve.logs.memory import LogStore
from ringserve.metrics import GenerationStatistics, Metrics
from ringserve.store.sqlite import MessageStore, RenderArgs, StoredMessage, render_json, store_failed
from ringserve.surfaces.base import ParsedRequest, Surface
from ringserve.surfaces.registry import SURFACES

log = logging.getLogger("ringserve.hub")

#: Seconds a cancel sent to another replica waits for that replica to end the message.
CANCEL_WAIT_SECONDS = 10.0
#: Seconds a request that continues another replica's message waits for that message's end to
#: reach the shared state (:meth:`Hub.shared_request`): a few flush intervals, with room for a
#: loaded host.
CONTINUE_WAIT_SECONDS = 1.0


class Hub:
    """Owns live messages, their producers and the disconnect policy.

    Args:
        config: the server config (stream and policy tables are used).
        models: the models this server serves (``live/models.py``), each with its runner.
        logs: the stream-log backend.
        cluster: what the replicas share (``logs/cluster.py``; one replica: ``LocalCluster``).
        store: the durable message store.
        nursery: the server-owned nursery producers run in.
        safety: the output safety stage (:meth:`SafetyStage.from_config`), None when off.
        metrics: where TTFT, gaps, TPOT and in-band errors are observed
            (default: a private :class:`Metrics` nobody scrapes).

    Attributes:
        keys: the ``Idempotency-Key`` claims (``live/idempotency.py``).
        sessions: the implicit keys of requests under a client session header (``live/idempotency.py``).
        persister: the store writes of live messages (``live/persist.py``).
        resume: where resumes find their log (``live/resume.py``).
        signer: signs the reasoning of the messages it renders (``core/signing.py``: the key of
            ``[server] signing_key``, which ``serve`` resolves; a key of this hub when it is "").
        draining: new generations are refused (:meth:`drain`).
    """

    def __init__(
        self,
        config: Config,
        models: ModelPool,
        logs: LogStore,
        cluster: Cluster,
        store: MessageStore,
        nursery: trio.Nursery,
        *,
        safety: SafetyStage | None,
        metrics: Metrics | None = None,
    ):
        self.config = config
        self.metrics = metrics if metrics is not None else Metrics()
        self.safety = safety
        self.models = models
        self.logs = logs
        self.cluster = cluster
        self.store = store
        self._nursery = nursery
        self._live: dict[str, LiveMessage] = {}
        self.keys = Keys(cluster, store, find=self.find)
        self.sessions = SessionTurns(logs)
        self.persister = Persister(store, nursery, written=self._forget)
        self._production = Production(config, logs, self.persister, self.metrics, self.safety,
                                      registered=self._live.__setitem__, on_idle=self._on_idle)
        self.signer = ReasoningSigner.from_text(config.server.signing_key or new_key())
        self.resume = Resume(config.server, logs, nursery, self.signer, stored=self.find_stored,
                             is_live=self._live.__contains__)
        self.draining = False

    # -- creating ------------------------------------------------------------------------

    async def create(
        self,
        surface: Surface,
        parsed: ParsedRequest,
        *,
        body_hash: str,
        request_json: str,
        policy: Policy,
        idempotency_key: str | None = None,
        turn: str | None = None,
    ) -> Created:
        """Start a generation, or find the one an ``Idempotency-Key`` (or, without one, the same
        ``turn``: the same body under the same client session) already started.

        The message is rendered by ``surface.restored(parsed.echo, signer)`` (a surface with state of its
        own renders with the request's); the store keeps that echo (without prompt text unless
        ``[store] keep_prompts``), to rebuild the stream and answer its objects once it ended.

        A retry with the key of a message that ended ``interrupted`` (a crash
        or a drain) or ``failed`` starts a new generation under a new id, and
        the key names the new message from then on (the old one stays readable
        under its id); one that is live, ``complete`` or ``cancelled`` is
        returned as it is. Retries that arrive while the key's first attempt
        is still starting wait for it, and get its error if it failed to start.
        A request with no key but a ``turn`` is found by its implicit key (``live/
        idempotency.py`` ``SessionTurns``: while its first attempt runs, or ended whole with its
        log held), on this replica only.

        Returns:
            The message's view, with its handle when it is live here (an idempotent retry's
            message may be live, or only stored here or on another replica).

        Raises:
            RingserveError: ``UNPROCESSABLE`` (key reused with another body),
            ``INVALID_REQUEST`` (a prompt that does not fit the context, or a malformed
            ``Idempotency-Key``),
            ``OVERLOADED`` (queue full), ``UNAVAILABLE`` (draining, or a store
            write failed less than ``persist.STORE_RETRY_SECONDS`` ago, or the model
            cannot be loaded), ``NOT_FOUND`` (no model of that name: ``live/models.py``);
            a retry that waited for the key's first attempt gets that attempt's error.
        """
        key = None if idempotency_key is None else surface_key(surface.name, idempotency_key)
        if self.draining:
            raise RingserveError(ErrorKind.UNAVAILABLE, "server is shutting down", retry_after=1, retryable=True)
        implicit = None if key is not None or turn is None else session_key(surface.name, turn)
        if implicit is not None and (attempt := await self.sessions.find(implicit)) is not None:
            return Created(attempt.view(), attempt)
        replaces = None
        if key is not None and (existing := await self.keys.existing(key)) is not None:
            if (answer := retry_answer(existing, body_hash)) is not None:
                return Created(answer, self.live(answer.id))
            replaces = existing.id
        self.persister.check_new()
        lease = await self.models.lease(parsed.model)
        msg = LiveMessage(
            id=f"{surface.id_prefix}{secrets.token_hex(12)}",
            surface=surface.restored(parsed.echo, self.signer),
            model=lease.name,
            created=int(time.time()),
            include_usage=parsed.include_usage,
            policy=policy,
            request_hash=body_hash,
            echo=parsed.echo,
            idempotency_key=key,
            session_key=implicit,
            replaces=replaces,
        )
        return await self._start(msg, parsed, request_json, lease)

    async def _start(self, msg: LiveMessage, parsed: ParsedRequest, request_json: str, lease: Lease) -> Created:
        """Prepare ``msg``'s prompt on ``lease``'s model, claim its key on every replica, and start its
        producer (which releases the lease when it ends)."""
        key = msg.idempotency_key
        claimed = False
        if key is not None:
            self.keys.pending[key] = msg
        if msg.session_key is not None:
            self.sessions.add(msg.session_key, msg)
        try:
            prepared = await lease.prompter.prepare(parsed.request)
            if key is not None:
                claimed = True  # from the claim's round trip on, the key may name msg
                elsewhere = await self.keys.claim(key, msg)
                if elsewhere is not None:
                    return Created(elsewhere, self.live(elsewhere.id))
            echo = parsed.echo if self.config.store.keep_prompts else parsed.echo_without_prompts
            if prepared.applied_edits:  # its objects say what its context edits cleared
                echo = msg.surface.edited(echo, prepared.applied_edits)
                msg.echo = msg.surface.edited(msg.echo, prepared.applied_edits)
                msg.surface = msg.surface.restored(msg.echo, self.signer)
            row = StoredMessage(
                id=msg.id, surface=msg.surface.name, model=msg.model, created=msg.created,
                status=MessageStatus.QUEUED, request=request_json, request_hash=msg.request_hash,
                idempotency_key=key, input_tokens=len(prepared.prompt_tokens),
                render=render_json(RenderArgs(parsed.include_usage, self.config.server.retry_ms, echo)),
            )
            view = await self._nursery.start(self._production.run, msg, prepared, row, lease)
        except BaseException as exc:
            lease.release()
            if isinstance(exc, RingserveError):
                msg.start_error = exc  # for the retries waiting on this attempt
            if msg.session_key is not None:
                self.sessions.drop(msg.session_key, msg)
            if claimed and key is not None:
                # Whatever stopped the start (a refusal, a store that failed, the client gone and
                # the request cancelled, even mid-claim), the key is let go at once if it names msg.
                await self.keys.release(key, msg)
            raise
        finally:
            if key is not None and msg.log is None:
                del self.keys.pending[key]
            msg.started.set()
        return Created(view, msg)

    def _forget(self, msg: LiveMessage) -> None:
        """An ended message leaves the hub: from now on the store answers for it."""
        del self._live[msg.id]
        if msg.idempotency_key is not None:
            del self.keys.pending[msg.idempotency_key]

    # -- policy and cancel ---------------------------------------------------------------

    def _on_idle(self, msg: LiveMessage) -> None:
        if msg.done.is_set() or msg.policy is not Policy.ABORT:
            return
        grace = self.config.policy.grace_seconds
        if msg.session_key is not None:  # its client's retry attaches to it (live/idempotency.py)
            grace = max(grace, SESSION_GRACE_SECONDS)
        if grace <= 0:
            msg.cancel(CancelReason.CLIENT_GONE)
        else:
            self._nursery.start_soon(self._abort_after_grace, msg, grace)

    async def _abort_after_grace(self, msg: LiveMessage, grace: float) -> None:
        await trio.sleep(grace)
        if msg.open_log.readers == 0:
            msg.cancel(CancelReason.CLIENT_GONE)

    def delete_when_done(self, msg: LiveMessage) -> None:
        """Delete ``msg``'s stored row (on a worker thread) once its generation has ended (a
        ``store: false`` response, also when its reader left before its end; its log stays for
        the readers that hold it, until its TTL). A delete the store fails is logged."""

        async def delete_at_end() -> None:
            await msg.done.wait()
            try:
                await self.store.off_loop(functools.partial(self.store.delete, msg.id))
            except sqlite3.Error as exc:
                log.warning("the message store failed to delete message %s (store: false): %s", msg.id, exc)

        self._nursery.start_soon(delete_at_end)

    def drain(self) -> None:
        """Refuse new generations from now on."""
        self.draining = True

    def cancel_all(self, reason: CancelReason) -> None:
        for msg in list(self._live.values()):
            msg.cancel(reason)

    async def wait_all_done(self) -> None:
        for msg in list(self._live.values()):
            await msg.done.wait()

    # -- finding -------------------------------------------------------------------------

    def statistics(self) -> GenerationStatistics:
        """Its generations now (for ``metrics.py``): those whose terminal event is not yet in their
        log, and ended ones whose final state the store failed to write (``live/persist.py``
        retries them)."""
        active = sum(1 for msg in self._live.values() if not msg.done.is_set())
        return GenerationStatistics(active_generations=active, unsaved_messages=self.persister.unsaved)

    def live(self, message_id: str) -> LiveMessage | None:
        """The message if its generation is still running, or it ended and the store failed to
        write its final state (which is then answered from memory)."""
        return self._live.get(message_id)

    def stored(self, message_id: str) -> StoredMessage:
        """The store's row of ``message_id``.

        Raises:
            RingserveError: ``NOT_FOUND`` when no such message exists, or it was deleted by the
            store's retention (``store/sqlite.py`` ``MessageStore.sweep``); ``UNAVAILABLE`` when
            the store fails to read.
        """
        try:
            stored = self.store.get(message_id)
        except sqlite3.DatabaseError as exc:
            raise store_failed(exc) from None
        if stored is None:
            raise RingserveError(
                ErrorKind.NOT_FOUND,
                f"no message {message_id[:80]!r}: the id is unknown, or the message was deleted after its"
                " retention time ([store] max_age_seconds, max_bytes)",
            )
        return stored

    async def find_stored(self, message_id: str) -> StoredMessage:
        """The store's row (:meth:`stored`), else the state another replica wrote of it
        (``Cluster.find_message``, its request left empty: it rebuilds the message's stream).

        Raises:
            RingserveError: ``NOT_FOUND`` when no replica has such a message; ``UNAVAILABLE``
            when the store fails to read or the shared store is unreachable.
        """
        try:
            return self.stored(message_id)
        except RingserveError as exc:
            if exc.kind is not ErrorKind.NOT_FOUND:
                raise
            shared = await self.cluster.find_message(message_id)
            if shared is None:
                raise
            return shared

    def stored_request(self, message_id: str) -> tuple[MessageView, str] | None:
        """A stored message's view and its request body as received ("" when prompts are not kept),
        None when no replica has such a message (``surfaces/base.py`` ``LoadStored``). It runs on a
        Trio worker thread (``trio.to_thread.run_sync``): it reads the store there, and a message
        the store lacks from the state other replicas share (:meth:`shared_request`) back on the
        event loop.

        Raises:
            RingserveError: ``UNAVAILABLE`` when the store fails to read or the shared store is
            unreachable.
        """
        try:
            stored = self.store.get(message_id)
        except sqlite3.DatabaseError as exc:
            raise store_failed(exc) from None
        if stored is not None:
            return stored.view(), stored.request
        return trio.from_thread.run(self.shared_request, message_id)

    async def shared_request(self, message_id: str) -> tuple[MessageView, str] | None:
        """A message another replica made, and its request body (the replicas share it for the
        surfaces whose messages a later request continues, ``Surfaces.continued``; else ""), once
        it has ended; None when no replica has it. Its end reaches the shared state up to a flush
        interval after its own client had it (``[stream] flush_ms``), so one that is not there
        yet, or not ended there, is waited for as a reader of its log, at most
        :data:`CONTINUE_WAIT_SECONDS`; then it is as it is (a client may continue only an ended one).

        Raises:
            RingserveError: ``UNAVAILABLE``: the shared store is unreachable.
        """
        shared = await self.cluster.find_message(message_id, request=True)
        if shared is None or not shared.status.final:
            await self._log_ended(message_id, CONTINUE_WAIT_SECONDS)
            shared = await self.cluster.find_message(message_id, request=True)
        return None if shared is None else (shared.view(), shared.request)

    def delete(self, message_id: str) -> bool:
        """Delete a message this replica holds (``DELETE /v1/responses/{id}``, here or relayed by
        another replica): its stored row and its log, at once if its generation has ended, else
        once it has (cancelled). Whether this replica held it.

        Raises:
            RingserveError: ``UNAVAILABLE`` when the store fails to write.
        """
        live = self.live(message_id)
        if live is not None and not live.done.is_set():
            live.cancel(CancelReason.REQUESTED)
            self.delete_when_done(live)
            return True
        try:
            held = self.store.delete(message_id)
        except sqlite3.DatabaseError as exc:
            raise store_failed(exc) from None
        self.logs.forget(message_id)
        return held

    async def delete_anywhere(self, message: MessageView) -> None:
        """Delete ``message`` once it has ended (cancelled if it still runs: :meth:`ended`), here
        if this replica holds it, else on the replica that does, and return once every replica
        has lost it (``Cluster.delete_message``).

        Raises:
            RingserveError: ``UNAVAILABLE``: it was not deleted (a store failed, the shared store
            is unreachable, or the replica that holds it did not delete it in time).
        """
        await self.ended(message)
        await self.cluster.delete_message(message.id, here=self.delete(message.id))

    def surface_of(self, view: MessageView) -> Surface:
        """The surface that spells ``view``'s objects: its own, restored with its echo and the
        hub's reasoning signer (``Surface.restored``)."""
        return SURFACES.by_name(view.surface).restored(view.echo, self.signer)

    def lookup(self, message_id: str) -> MessageView:
        """The message's view: live, else stored.

        Raises:
            RingserveError: as :meth:`stored`.
        """
        msg = self.live(message_id)
        return msg.view() if msg is not None else self.stored(message_id).view()

    async def find(self, message_id: str) -> MessageView:
        """:meth:`lookup`, else the state another replica wrote (``Cluster.find_message``).

        Raises:
            RingserveError: ``NOT_FOUND`` when no replica has such a message;
            ``UNAVAILABLE`` when the shared store is unreachable.
        """
        msg = self.live(message_id)
        return msg.view() if msg is not None else (await self.find_stored(message_id)).view()

    async def ended(self, message: MessageView) -> MessageView:
        """``message`` once it has ended: cancelled (``REQUESTED``) if it still runs, here or on
        another replica (then the state that replica wrote once its log ended, waiting at most
        :data:`CANCEL_WAIT_SECONDS`).

        Raises:
            RingserveError: ``UNAVAILABLE``: the shared store is unreachable.
        """
        live = self.live(message.id)
        if live is not None:
            live.cancel(CancelReason.REQUESTED)
            await live.done.wait()
            return live.view()
        if message.status.final:
            return message
        await self.cluster.request_cancel(message.id)  # another replica generates it
        return await self.settled(message, CANCEL_WAIT_SECONDS)

    async def settled(self, message: MessageView, seconds: float = math.inf) -> MessageView:
        """``message`` as it ended: at once if its status is final, else once its log (generated by
        another replica) has ended, waiting at most ``seconds`` as a reader of it (so the abort
        policy counts the wait); the state its owner then wrote (``message`` if none).

        Raises:
            RingserveError: ``UNAVAILABLE``: the shared store is unreachable.
        """
        if message.status.final:
            return message
        await self._log_ended(message.id, seconds)
        shared = await self.cluster.find_message(message.id)
        return message if shared is None else shared.view()

    async def _log_ended(self, message_id: str, seconds: float) -> None:
        """Wait until the log of ``message_id`` (here, or a copy of another replica's) has ended, at
        most ``seconds``, as a reader of it (so the abort policy counts the wait); at once if there
        is no log."""
        log_ = await self.logs.find(message_id)
        if log_ is not None:
            with log_.reader(), trio.move_on_after(seconds):
                while not log_.closed:
                    await log_.wait_for_entries(log_.next_seq - 1 if log_.next_seq else None)
