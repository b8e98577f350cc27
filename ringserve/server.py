"""``serve()``: the root nursery that owns the listener, the runner, the logs and every generation."""

from __future__ import annotations

import functools
import gc
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import assert_never

import attrs
import hypercorn.trio
from hypercorn.typing import ASGIFramework
import trio

from ringserve.http.app import create_app
from ringserve.http.context import ServerState
from ringserve.http.auth import Authenticator, check_bind
from ringserve.config import Config, LogBackend, ModelSettings
from ringserve.http.transport import BindError, HypercornConfig, isolate_connection_faults
from ringserve.engine.modelfile import ModelFileError, check_model_file
from ringserve.engine.protocol import Engine, EngineError
from ringserve.engine.catalog import Catalog, discover
from ringserve.engine.loader import FactoryLoader, ModelLoader
from ringserve.live.models import ModelPool
from ringserve.core.errors import RingserveError
from ringserve.core.router import ModelStatus
from ringserve.core.signals import ECHO_SECONDS, EchoFilter
from ringserve.core.signing import ReasoningSigner, new_key
from ringserve.store.sqlite import MessageStore, StoreError, StoredMessage, run_retention
from ringserve.core.status import CancelReason
from ringserve.live.safety import SafetyStage
from ringserve.surfaces.registry import SURFACES
from ringserve.live.hub import Hub
from ringserve.live.resume import owner_lost_entries
from ringserve.logs.cluster import Cluster, LocalCluster
from ringserve.logs.memory import LogStore, MemoryLogStore

log = logging.getLogger("ringserve")


@attrs.frozen
class Backend:
    """The stream logs, what the replicas share, and the message store of one ``[stream] backend``."""

    logs: LogStore
    cluster: Cluster
    store: MessageStore


def make_backend(config: Config, cancel: Callable[[str], None], delete: Callable[[str], None],
                 owner_lost: Callable[[StoredMessage, int], list[bytes]]) -> Backend:
    """The ``[stream] backend``: in-process memory (one replica), or Redis (``logs/redis.py``:
    replicas that share their logs, their messages' state and their keys; ``cancel`` is called with
    the id of a message of this replica that another one asks to cancel, ``delete`` with the id of
    a message another one asks to delete, ``owner_lost`` renders the end of a stream whose replica
    died: ``live/resume.py`` ``owner_lost_entries``). The request bodies of the surfaces whose
    messages a later request continues (``Surfaces.continued``) are shared with the state.

    Raises:
        SystemExit: backend ``redis`` without coredis installed (one-line message).
        ValueError: a ``RINGSERVE_REDIS_URL`` with an unknown scheme.
        StoreError: the message store cannot be opened or written (one line naming the path).
    """
    match config.stream.backend:
        case LogBackend.MEMORY:
            return Backend(MemoryLogStore(config.stream), LocalCluster(), MessageStore.from_config(config.store))
        case LogBackend.REDIS:
            try:
                from ringserve.logs.redis import MirroredMessageStore, RedisCluster, RedisLogStore
            except ImportError as exc:
                raise SystemExit(f"[stream] backend = \"redis\" needs coredis: pip install 'ringserve[redis]' ({exc})") from None
            logs = RedisLogStore(config.stream, config.stream.redis_url_from(os.environ), on_cancel=cancel,
                                 on_delete=delete, on_owner_lost=owner_lost)
            store = MirroredMessageStore.from_config(config.store).mirror_to(logs, SURFACES.continued)
            return Backend(logs, RedisCluster(logs), store)
        case _:
            assert_never(config.stream.backend)


def _owner_lost(state: ServerState, stored: StoredMessage, seq: int) -> list[bytes]:
    """The end of a stream whose replica died (``live/resume.py`` ``owner_lost_entries``), its
    reasoning signed with the server's key (resolved before the first request)."""
    return owner_lost_entries(stored, seq, ReasoningSigner.from_text(state.config.server.signing_key))


def _cancel_live(state: ServerState, message_id: str) -> None:
    """Cancel ``message_id`` if it is live here (a cancel another replica relays)."""
    msg = None if state.hub is None else state.hub.live(message_id)
    if msg is not None:
        msg.cancel(CancelReason.REQUESTED)


def _delete_held(state: ServerState, message_id: str) -> None:
    """Delete ``message_id`` if this replica holds it (a delete another replica relays; that replica
    answers its client once the message's shared state is gone, so a store that fails to delete
    here is only logged: the client is told it was not deleted)."""
    if state.hub is None:
        return
    try:
        state.hub.delete(message_id)
    except RingserveError as exc:
        log.warning("a delete of %s relayed by another replica failed: %s", message_id, exc.message)


#: Seconds the drain gives readers to write their terminal events once every generation
#: has ended (hypercorn's graceful timeout); the connections still open are then reset, and
#: the server waits half as long again for them to end. A reader that keeps up gets its last
#: events in milliseconds; one that stopped reading cannot get them however long it is given.
DRAIN_FLUSH_SECONDS = 0.3


def hypercorn_config(config: Config) -> HypercornConfig:
    """hypercorn's settings for ``config``: bind, TLS, keep-alive, TCP timeouts.

    With ``certfile``/``keyfile`` the listener speaks TLS and offers HTTP/2 by
    ALPN; without, HTTP/1.1 and HTTP/2 with prior knowledge (h2c). HTTP/3
    (``quic_bind``) stays off: on this stack a reset HTTP/3 stream is never
    reported to the app, so a cancelled stream would keep its reader and, with
    it, its generation.
    """
    server = config.server
    hc = HypercornConfig()
    hc.bind = [f"{server.host}:{server.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.keep_alive_timeout = server.keep_alive_timeout
    # The kernel's backstop, for writes the watchdog does not see; twice the watchdog's time, so
    # that the watchdog, which logs and counts, normally acts first.
    hc.tcp_user_timeout = 2 * server.slow_reader_timeout
    # hypercorn is stopped only once every stream holds its terminal event (see serve()).
    hc.graceful_timeout = DRAIN_FLUSH_SECONDS
    if server.certfile:
        hc.certfile, hc.keyfile = server.certfile, server.keyfile
    return hc


#: The file of the key that signs reasoning, beside the message store (``[server] signing_key``).
SIGNING_KEY_FILE = "signing.key"


def signing_key(configured: str, store_path: str) -> str:
    """The key that signs reasoning (``core/signing.py``): ``configured`` when set; else the one
    in :data:`SIGNING_KEY_FILE` beside the store at ``store_path``, made (random, mode 0600) on
    first use; for a store in memory, a new key of this process.

    A new key is written to a file of its own and linked into place (``link`` fails when the name
    exists), so processes that start together on one store agree on one key, and none reads a
    file half written.

    Raises:
        StoreError: the file cannot be made or read, or holds no key.
    """
    if configured:
        return configured
    if store_path == ":memory:":
        return new_key()
    path = Path(store_path).parent / SIGNING_KEY_FILE
    try:
        if not path.exists():
            fresh = path.with_name(f".{SIGNING_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
            with open(os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(new_key() + "\n")
            try:
                os.link(fresh, path)
            except FileExistsError:
                pass  # another process made it first: its key holds
            finally:
                fresh.unlink()
        key = path.read_text().strip()
        ReasoningSigner.from_text(key)
    except (OSError, ValueError) as exc:
        raise StoreError(f"the signing key {path}: {exc}") from None
    return key


# Long for its docstring (the drain's order and its bounds, which operators and tests rely on);
# the work is in _open_store, _load and _drain.
async def serve(
    config: Config,
    loader: ModelLoader | Callable[[ModelSettings], Engine] | None = None,
    *,
    catalog: Catalog | None = None,
    handle_signals: bool = True,
    shutdown_trigger: trio.Event | None = None,
    task_status: trio.TaskStatus[ServerState] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Run ringserve until a signal (or ``shutdown_trigger``) asks it to stop.

    The listener starts first (``/ready`` answers 503 while the model loads);
    ``task_status.started(state)`` is called once the model is loaded and the
    decode loop runs, with ``state.urls`` set, and systemd is told ``READY=1``
    (:func:`notify_systemd`). On SIGINT/SIGTERM (systemd is told ``STOPPING=1``):
    refuse new generations, let running ones finish for up to ``drain_timeout``
    seconds, end the rest with a retryable in-band error, persist, log a last
    line (``stopped (exit status N)``) and return. A second signal stops at once.

    The drain, in order (hypercorn tells the app nothing before its lifespan
    shutdown, which runs last, so ringserve drains itself first): the hub
    refuses new generations (503 with ``Retry-After``; ``/ready`` 503)
    while the listener still answers; running generations get up to
    ``drain_timeout`` seconds, then the rest end with a retryable in-band
    error; only then is hypercorn stopped, which closes the listener and idle
    keep-alive connections and lets readers write their terminal events for
    :data:`DRAIN_FLUSH_SECONDS`; every connection still open after that (a
    client that stopped reading) is reset. So the process exits within
    ``drain_timeout`` plus about one second (:data:`DRAIN_FLUSH_SECONDS` and
    a half, plus the cancellation), whatever the clients do; a second signal
    resets every connection at once (in the one-file executable, one that comes
    more than a second after the first: :mod:`ringserve.core.signals`).

    Returns:
        The exit status: 0 after a drain, 1 when a second signal cut it short.

    Raises:
        AuthSetupError: ``server.host`` is not loopback, no API key is
            configured and ``auth.allow_remote_without_keys`` is false; or
            an API key is malformed (checked before anything starts).
        SafetySetupError: the ``[safety]`` checker cannot be loaded (checked before anything starts).
        StoreError: the message store cannot be opened or written (one line naming the path).
        ValueError: a ``[policy]`` key names no surface.
    """
    SURFACES.check_policies(config.policy)
    auth = Authenticator.from_config(config.auth)
    check_bind(config.server.host, auth, config.auth.allow_remote_without_keys)
    catalog = catalog or discover(config)
    safety = SafetyStage.from_config(config.safety, max_threads=config.engine.slots)
    isolate_connection_faults()
    state = ServerState(config, auth=auth)
    backend = make_backend(config, lambda message_id: _cancel_live(state, message_id),
                           lambda message_id: _delete_held(state, message_id),
                           lambda stored, seq: _owner_lost(state, stored, seq))
    store = backend.store
    config = state.config = _open_store(config, store)
    app = create_app(state)
    stop = trio.Event() if shutdown_trigger is None else shutdown_trigger
    hc = hypercorn_config(config)
    status = 0
    try:
        async with trio.open_nursery() as nursery:

            def stop_now() -> None:
                nonlocal status
                status = 1
                log.warning("second signal: stopping now")
                if state.hub is not None:
                    state.hub.cancel_all(CancelReason.DRAIN)
                hc.reset_connections()
                nursery.cancel_scope.cancel()

            await nursery.start(backend.logs.run)
            await nursery.start(run_retention, store, config.store)
            await nursery.start(state.watchdog.run)
            if handle_signals:
                nursery.start_soon(_watch_signals, stop, stop_now)
            http = _Http(hc)
            state.urls = await nursery.start(_serve_http, app, http)
            starting_models = [e.name for e in catalog.entries if e.settings.model.load_on_startup]
            log.info("listening on %s%s", ", ".join(state.urls),
                     f" (loading {', '.join(starting_models)})" if starting_models else "")
            with trio.CancelScope() as starting:  # a signal before the models are loaded stops here
                nursery.start_soon(_cancel_when_set, stop, starting)
                hub = await _start_models(config, catalog, _loader(loader, config), backend, safety, state, nursery)
            if not starting.cancelled_caught:
                task_status.started(state)
                loaded = ", ".join(m.name for m in hub.models.models() if m.runner is not None) or "no model yet"
                notify_systemd(f"READY=1\nSTATUS=serving {loaded} at {', '.join(state.urls)}")
                await stop.wait()
                notify_systemd("STOPPING=1\nSTATUS=draining")
                await _drain(hub, http, config.server.drain_timeout)
            nursery.cancel_scope.cancel()
    finally:
        store.close()
    log.info("stopped (exit status %d)", status)
    return status


#: The environment variable that names systemd's notification socket (``sd_notify(3)``).
NOTIFY_SOCKET = "NOTIFY_SOCKET"


def notify_systemd(state: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Tell systemd ``state``: newline-separated assignments such as ``READY=1`` (the model is
    loaded: ``systemctl start`` of a ``Type=notify`` unit returns), ``STOPPING=1`` (the drain has
    begun) and ``STATUS=...`` (what ``systemctl status`` shows).

    The protocol of ``sd_notify(3)``, without libsystemd: one datagram to the ``AF_UNIX`` socket
    that ``$NOTIFY_SOCKET`` names, a path or, after ``@``, a name in the abstract namespace. Without
    that variable (not started by systemd, or not ``Type=notify``) nothing is sent. A send that
    fails is logged as a warning; the server goes on.

    Returns:
        Whether the datagram was sent.
    """
    address = environ.get(NOTIFY_SOCKET, "")
    if not address.startswith(("/", "@")):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(state.encode(), "\0" + address[1:] if address.startswith("@") else address)
    except OSError as exc:
        log.warning("could not notify systemd at %s: %s", address, exc)
        return False
    return True


def _open_store(config: Config, store: MessageStore) -> Config:
    """Take over the message store: say where it is and what it keeps, mark the messages a
    previous run left generating as interrupted unless another running server uses the store
    (:meth:`MessageStore.claim`); ``config`` with its signing key resolved
    (:func:`signing_key`, kept beside the store).

    Raises:
        StoreError: the store or the key file cannot be written (one line naming the path).
    """
    log.info(
        "message store: %s (finished messages kept %s, up to %s%s)",
        store.path, _limit(config.store.max_age_seconds, "s"), _limit(config.store.max_bytes, " bytes"),
        "" if config.store.keep_prompts else "; prompts not kept",
    )
    interrupted = store.claim()
    if interrupted is None:
        log.info("another running server uses this message store: its unfinished messages are left as they are")
    elif interrupted:
        log.info("marked %d message(s) left generating by a previous run as interrupted", interrupted)
    return config.replace("server", signing_key=signing_key(config.server.signing_key, store.path))


def _loader(loader: ModelLoader | Callable[[ModelSettings], Engine] | None, config: Config) -> ModelLoader:
    """``loader``; a :class:`FactoryLoader` of an engine factory (a function of a model's settings);
    None: the GGUF files' (``engine/llama.py`` ``LlamaLoader``, keeping ``[router] memory_margin`` free)."""
    if loader is None:
        from ringserve.engine.llama import LlamaLoader

        return LlamaLoader(config.router.memory_margin)
    return FactoryLoader(loader) if callable(loader) else loader


async def _start_models(config: Config, catalog: Catalog, loader: ModelLoader, backend: Backend,
                        safety: SafetyStage | None, state: ServerState, nursery: trio.Nursery) -> Hub:
    """The model pool over the catalog (``live/models.py``), and the hub; the models loaded at start
    (``load_on_startup``: the ``[model]`` table's, by default) are loaded before it returns, with
    ``state`` then ready.

    Raises:
        EngineError: a model loaded at start could not be loaded (one line saying why).
    """
    pool = ModelPool(catalog, loader, nursery, max_loaded=config.router.max_loaded, free_memory=loader.free_memory,
                     on_cancel_freed=state.metrics.cancel_freed)
    await nursery.start(pool.expire)
    hub = Hub(config, pool, backend.logs, backend.cluster, backend.store, nursery, safety=safety,
              metrics=state.metrics)
    state.metrics.watch(pool, backend.logs, backend.store, hub, state.watchdog)
    for entry in catalog.entries:
        if entry.settings.model.load_on_startup:
            try:
                await pool.load(entry.name)
            except RingserveError as exc:
                raise EngineError(exc.message) from None
        else:  # loaded on demand: a file that cannot be is said now, not at its first request only
            try:
                check_model_file(entry.model_file())
            except ModelFileError as exc:
                pool.cannot_load(entry.name, exc)
    state.hub = hub
    loaded = [pool.summary(m) for m in pool.models() if m.runner is not None]
    waiting = [m.name for m in pool.models() if m.runner is None and m.status is not ModelStatus.FAILED]
    failed = [m.name for m in pool.models() if m.status is ModelStatus.FAILED]
    log.info("ready: %s%s%s, at %s", "; ".join(loaded) or "no model loaded yet",
             f"; {len(waiting)} more loaded on demand ({', '.join(waiting)})" if waiting else "",
             f"; {len(failed)} that cannot be loaded ({', '.join(failed)})" if failed else "",
             ", ".join(state.urls))
    return hub


async def _drain(hub: Hub, http: _Http, drain_timeout: float) -> None:
    """The drain (``serve``'s docstring): refuse new generations, give the running ones
    ``drain_timeout`` seconds, end the rest, persist; then stop hypercorn and let readers write
    their terminal events for :data:`DRAIN_FLUSH_SECONDS`, and reset the connections still open."""
    log.info("draining: refusing new generations, waiting up to %.0f s", drain_timeout)
    hub.drain()
    with trio.move_on_after(drain_timeout):
        await hub.wait_all_done()
    hub.cancel_all(CancelReason.DRAIN)
    await hub.wait_all_done()
    if unsaved := await hub.persister.save_unsaved():
        log.warning("the message store failed to write the final state of %d message(s); they stay"
                    " 'generating' in it, and the next start marks them interrupted", unsaved)
    # Every log now ends in a terminal event; stop hypercorn and let readers write them.
    http.stop.set()
    with trio.move_on_after(DRAIN_FLUSH_SECONDS):
        await http.done.wait()
    if not http.done.is_set():
        reset = http.config.reset_connections()
        log.warning("reset %d connection(s) whose client stopped reading", reset)
        with trio.move_on_after(DRAIN_FLUSH_SECONDS / 2):
            await http.done.wait()


def _limit(value: float, unit: str) -> str:
    """A configured limit for the startup log: ``1073741824 bytes``, ``0.5s``; 0 is ``without limit``."""
    if not value:
        return "without limit"
    return f"{int(value) if float(value).is_integer() else value}{unit}"


#: The interpreter's switch interval in a server process (``sys.setswitchinterval``; Python's
#: default is 5 ms): how long a thread that wants the GIL waits before the holder must let it go.
#: The engine thread needs it for a moment after each decode and before the next one starts,
#: while the Trio thread renders and writes the last step; with 5 ms, 64 streams of 10 ms steps
#: waited 0.6-1.3 ms (p50) from handing a step to the engine thread to its start, with 0.2 ms
#: about 0.3 ms (bench/gpu_proxy.py, docs/benchmarks.md).
SWITCH_INTERVAL_SECONDS = 0.0002


def run_process(config: Config, loader: ModelLoader | Callable[[ModelSettings], Engine] | None = None,
                catalog: Catalog | None = None) -> int:
    """:func:`serve` as a process's main loop (``ringserve serve``): its exit status; ``catalog``:
    the models of ``config``, already discovered (scanning the Hugging Face cache once).

    Sets the interpreter's switch interval to :data:`SWITCH_INTERVAL_SECONDS` first.
    Once it returns the process is about to exit, so every object left is
    frozen (``gc.freeze``): the interpreter's final garbage collection then
    skips them, which took 0.3-0.7 s of the drain's bound on a loaded 2-core
    machine. (The store is closed and the logs are flushed already.)

    Raises:
        EngineError, ModelFileError: the model could not be loaded, or a
            context of ``[engine] slots`` x ``ctx_per_slot`` not created;
        BindError: the listener could not be bound (unwrapped from the
            nursery's exception group, like the two above), besides what
            :func:`serve` raises.
    """
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    try:
        return trio.run(functools.partial(serve, config, loader, catalog=catalog))
    except BaseExceptionGroup as group:
        # The listener binds and the model loads inside serve's nursery, which wraps their
        # failures in a group; raise it bare so the command line prints its one line (and exits 2).
        failed, rest = group.split((EngineError, ModelFileError, BindError))
        if failed is None or rest is not None:
            raise
        leaf: BaseException = failed
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        raise leaf from None
    finally:
        gc.freeze()


@attrs.frozen
class _Http:
    """hypercorn's config, and the events that stop it and say it has stopped."""

    config: HypercornConfig
    stop: trio.Event = attrs.Factory(trio.Event)
    done: trio.Event = attrs.Factory(trio.Event)


async def _serve_http(app: ASGIFramework, http: _Http, *, task_status: trio.TaskStatus[list[str]]) -> None:
    try:
        await hypercorn.trio.serve(app, http.config, shutdown_trigger=http.stop.wait, task_status=task_status)
    finally:
        http.done.set()


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once ``event`` is set (nothing if ``scope`` has ended by then)."""
    await event.wait()
    scope.cancel()


async def _watch_signals(stop: trio.Event, stop_now: Callable[[], None]) -> None:
    # Receiving until cancelled: a later signal must not get the default action (death by signal).
    echoes = EchoFilter(ECHO_SECONDS)  # the one-file executable's bootloader passes on what it gets too
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            if echoes.is_echo(trio.current_time()):
                continue
            if stop.is_set():
                stop_now()  # second signal
            else:
                stop.set()
