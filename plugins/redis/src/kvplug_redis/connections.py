"""The client library's connections, as kvplug uses them: opened a few at a time, reused
before new ones are opened, and (with Sentinel) only to the master the sentinels name.

A burst of operations (an engine's 200 concurrent loads) would otherwise make the client
library open one connection per operation at once; over TLS on a busy machine those hundreds
of handshakes starve each other and every operation runs past its deadline.
:class:`ConnectionBudget` admits an operation only while a connection is idle or fewer than
``spare`` are being opened, so the rest wait for a warm connection;
:func:`tracked_connection_class` reports the connections to it. :class:`LoopClients` holds
the clients of one event loop; :func:`make_loop_clients` makes them for one URL form.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplug_redis.client_library import ClientLibrary
from kvplug_redis.options import RedisOptions
from kvplug_redis.sentinel import Address, MasterTracker
from kvplug_redis.urls import Mode, Target

logger = logging.getLogger("kvplug.redis")

CONNECTS_AT_ONCE = 8
"""Connections being opened at once, by the client library and by direct reads each: a burst
of tasks waits for these (and reuses them) instead of starting hundreds of TLS handshakes that
starve every request."""
CLOSE_TIMEOUT = 5.0
"""Seconds :meth:`LoopClients.aclose` waits for the client library to drop its connections."""


class Waiters:
    """Callers waiting for something to change (a connection released or opened), woken one at
    a time, longest-waiting first."""

    def __init__(self) -> None:
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()

    async def wait(self) -> None:
        """Wait until :meth:`wake_one` picks this caller."""
        waiter = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        try:
            await waiter
        except BaseException:
            if not waiter.cancelled():
                self.wake_one()  # woken, then cancelled: the next waiter looks instead
            raise

    def wake_one(self) -> None:
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class ConnectionBudget:
    """Admits operations on a pool of connections: at most as many as there are open
    connections plus ``spare`` (connections that may be opened meanwhile). Connections report
    :meth:`opened` and :meth:`closed`; operations :meth:`admit` and :meth:`done`."""

    def __init__(self, spare: int) -> None:
        self.spare = spare
        self.connected = 0
        """Connections open now."""
        self.busy = 0
        """Operations admitted and not done."""
        self._waiters = Waiters()

    async def admit(self) -> None:
        """Wait until an operation may run (the wait counts against the caller's deadline)."""
        while self.busy >= max(self.connected, 0) + self.spare:
            await self._waiters.wait()
        self.busy += 1

    def done(self) -> None:
        self.busy -= 1
        self._waiters.wake_one()

    def opened(self) -> None:
        self.connected += 1
        self._waiters.wake_one()

    def closed(self) -> None:
        self.connected -= 1


def tracked_connection_class(
    base: type[Any],
    *,
    budget: ConnectionBudget,
    tracker: MasterTracker | None,
    moved_error: type[Exception],
) -> type[Any]:
    """A subclass of the client library's connection class ``base`` that reports its
    connections to ``budget`` (which then admits only as many operations as can reuse them or
    open a spare), and, with a ``tracker``, never serves a command on a connection to a server
    that is not the master the tracker names: such a connection is closed before its next
    use, and a reply that arrived on it after the master moved is dropped and raised as
    ``moved_error`` (the library's ``ConnectionError``, which its one retry answers by sending
    the command again on a new connection, to the new master)."""

    class TrackedConnection(base):  # type: ignore[misc]
        def _deposed(self) -> bool:
            current = None if tracker is None else tracker.current
            return current is not None and (self.host, self.port) != current

        async def connect(self) -> None:
            if self.is_connected:
                if not self._deposed():
                    return
                await self.disconnect()
            try:
                await super().connect()
            except (ConnectionError, moved_error):
                if tracker is not None:
                    tracker.suspect()  # a dead or deposed master: ask again at once
                raise
            budget.opened()

        async def disconnect(self, *args: Any, **kwargs: Any) -> None:
            connected = self.is_connected
            try:
                await super().disconnect(*args, **kwargs)
            finally:
                if connected and not self.is_connected:
                    budget.closed()

        async def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
            # Why: redis-py 8 reconnects a dropped connection to the same address here, without
            # asking the sentinels; connect() asks the tracker.
            if not self.is_connected or self._deposed():
                await self.connect()
            await super().send_packed_command(*args, **kwargs)

        async def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:
                response = await super().read_response(*args, **kwargs)
            except (ConnectionError, moved_error):
                if tracker is not None:
                    tracker.suspect()
                raise
            if tracker is not None and self._deposed():
                await self.disconnect()
                raise moved_error(
                    f"the master of service {tracker.service!r} moved to "
                    f"{_where(tracker.current)} while this reply was read from "
                    f"{_where((self.host, self.port))}; the reply was dropped"
                )
            return response

    TrackedConnection.__name__ = TrackedConnection.__qualname__ = f"Tracked{base.__name__}"
    return TrackedConnection


@dataclass(eq=False)
class LoopClients:
    """The client library's clients of one event loop, and what waits on them.

    The library's connections (their streams), the tracker's watching tasks and asyncio's
    semaphores belong to the loop that first uses them; a backend used from another loop
    (another thread's ``asyncio.run``, a :class:`~kvplug.runtime.sync.SyncClient`) gets a set of its
    own (``RedisBackend._clients_here``). They are closed on their own loop, by the backend's
    ``close`` or, if that loop ends first, when it shuts down (:meth:`keep`).
    """

    writer: Any
    """The client of writes (and of reads unless they may go to replicas)."""
    reader: Any
    sentinel: Any | None
    """The library's ``Sentinel`` (its ``sentinels`` are clients too), or None."""
    tracker: MasterTracker | None
    budget: ConnectionBudget
    """Admits operations on the library's connections (not Cluster's, whose client keeps a
    pool per node)."""
    slots: asyncio.Semaphore
    """Operations in flight at most (redis-py's pools raise ``MaxConnectionsError`` instead of
    waiting when every connection is busy; an operation holds one connection per server)."""
    reading_bulk_limit: asyncio.Lock = field(default_factory=asyncio.Lock)
    loop: asyncio.AbstractEventLoop | None = None
    """The loop they belong to, from their first use on."""
    keeper: asyncio.Task[None] | None = None

    def keep(self, where: str, also: Callable[[], None] | None = None) -> None:
        """Belong to the running loop, and close when it shuts down before the backend
        closes them (calling ``also`` first): ``asyncio.run`` cancels every task left before
        it closes its loop, and the keeper, a task that waits for that, then closes them.
        Why: connections left open on a closed loop can only be collected, and some of the
        library's fail when they are (valkey-py's Sentinel connections raise in
        ``__del__``)."""
        self.loop = asyncio.get_running_loop()
        self.keeper = asyncio.ensure_future(self._close_at_shutdown(where, also))

    async def _close_at_shutdown(self, where: str, also: Callable[[], None] | None) -> None:
        try:
            await asyncio.get_running_loop().create_future()  # resolved by nothing: cancelled
        except asyncio.CancelledError:
            if self.keeper is asyncio.current_task():  # the loop ends, not aclose()
                self.keeper = None
                if also is not None:
                    also()
                await self.aclose(where)
            raise

    async def aclose(self, where: str) -> None:
        """Stop the tracker and close every client's connections, within
        :data:`CLOSE_TIMEOUT`, on the loop they belong to; ``where`` names the backend in log
        messages."""
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            keeper.cancel()
        if self.tracker is not None:
            await self.tracker.close()
        clients = {id(c): c for c in (self.writer, self.reader)}
        if self.sentinel is not None:
            clients.update((id(c), c) for c in self.sentinel.sentinels)
        closing = asyncio.gather(*(c.aclose() for c in clients.values()), return_exceptions=True)
        try:
            results = await asyncio.wait_for(closing, CLOSE_TIMEOUT)
        except TimeoutError:
            logger.warning("%s: connections not closed within %s s", where, CLOSE_TIMEOUT)
            return
        for result in results:
            if isinstance(result, Exception):
                logger.debug("%s: error while closing: %s", where, result)


def restore_startup_nodes(
    lib: ClientLibrary, client: Any, hosts: Sequence[tuple[str, int]]
) -> None:
    """Put the configured nodes back among a Cluster ``client``'s startup nodes, where it
    dropped them. Why: valkey-py's cluster client drops a node from its startup nodes on each
    connection error or timeout, and once it dropped every one (a reshard or a failover on a
    busy machine) it can never find the cluster again: every later operation fails with
    "Please provide at least one reachable node". Called after a failed operation."""
    startup = getattr(getattr(client, "nodes_manager", None), "startup_nodes", None)
    if not isinstance(startup, dict):
        return
    settings = getattr(client, "connection_kwargs", {})
    for host, port in hosts:
        name = f"{host}:{port}"
        if name not in startup:
            startup[name] = lib.cluster_node(host, port, **settings)


def quick_retry(lib: ClientLibrary) -> Any:
    """One retry of a broken connection, 10-100 ms later (see :func:`make_loop_clients`)."""
    return lib.retry(lib.backoff(cap=0.1, base=0.01), 1, (lib.exceptions.ConnectionError,))


def make_loop_clients(
    lib: ClientLibrary,
    mode: Mode,
    target: Target,
    options: RedisOptions,
    *,
    credentials: tuple[str | None, str | None],
    sentinel_password: str | None,
    tls: dict[str, Any] | None,
) -> LoopClients:
    """The clients of one event loop for ``target``: the writer, and the reader (the same one
    unless reads may go to replicas), with Sentinel the tracker that names the master. ``tls``
    is the ``ssl_*`` connection arguments of a TLS scheme, None for a plain one."""
    budget = ConnectionBudget(CONNECTS_AT_ONCE)
    slots = asyncio.Semaphore(options.max_connections)
    username, password = credentials
    common: dict[str, Any] = {
        "username": username,
        "password": password,
        "socket_timeout": options.timeout,
        "socket_connect_timeout": options.timeout,
        # One quick retry on a broken connection: after a server restart every pooled
        # connection is dead, and the retry reconnects instead of failing the operation.
        # Timeouts are not retried: the deadline is already spent. (redis-py's default backs
        # off for seconds, which also makes Sentinel discovery slow past a dead sentinel.)
        "retry": quick_retry(lib),
        # valkey-py retries a command only for the errors listed here (redis-py for the
        # retry's own): without it a broken connection fails the command at once.
        "retry_on_error": [lib.exceptions.ConnectionError],
        "client_name": "kvplug",
    }
    moved_error = lib.exceptions.ConnectionError
    if mode is Mode.CLUSTER:
        if options.read_from_replicas:
            common["read_from_replicas"] = True  # only when asked: deprecated in redis-py 5.3
        client = lib.cluster(
            startup_nodes=[lib.cluster_node(host, port) for host, port in target.hosts],
            max_connections=options.max_connections,
            **common,
        )
        return LoopClients(client, client, None, None, budget, slots)
    common["db"] = target.db
    if mode is Mode.SENTINEL:
        # ssl=True makes the sentinels' clients use SSLConnection and the master/replica pools
        # SentinelManagedSSLConnection; both get the same certificates.
        ssl_arguments: dict[str, Any] = {"ssl": True, **tls} if tls is not None else {}
        sentinel = lib.sentinel(
            list(target.hosts),
            sentinel_kwargs={
                "username": options.sentinel_username,
                "password": sentinel_password,
                "socket_timeout": options.timeout,
                "socket_connect_timeout": options.timeout,
                "max_connections": options.max_connections,
                "retry": quick_retry(lib),
                "client_name": "kvplug",
                **ssl_arguments,
            },
            **common,
            **ssl_arguments,
        )
        assert target.service is not None
        tracker = MasterTracker(
            sentinels=sentinel.sentinels,
            service=target.service,
            interval=options.master_check_interval,
            timeout=options.timeout,
            not_found=lib.master_not_found,
        )
        # Why: the client library asks the sentinels at every new connection and keeps
        # connections to a deposed master that still answers; the tracker decides instead.
        sentinel.discover_master = lambda _service: tracker.locate()
        base = lib.sentinel_ssl_connection if tls is not None else lib.sentinel_connection
        writer = sentinel.master_for(
            target.service,
            max_connections=options.max_connections,
            connection_class=tracked_connection_class(
                base, budget=budget, tracker=tracker, moved_error=moved_error
            ),
        )
        reader = writer
        if options.read_from_replicas:
            reader = sentinel.slave_for(
                target.service,
                max_connections=options.max_connections,
                connection_class=tracked_connection_class(
                    base, budget=budget, tracker=None, moved_error=moved_error
                ),
            )
        return LoopClients(writer, reader, sentinel, tracker, budget, slots)
    if mode is Mode.UNIX:
        base = lib.unix_connection
        common.update(path=target.socket_path)
    else:
        base = lib.ssl_connection if tls is not None else lib.connection
        (host, port) = target.hosts[0]
        common.update(host=host, port=port)
    if tls is not None:
        common.update(tls)
    common.update(
        connection_class=tracked_connection_class(
            base, budget=budget, tracker=None, moved_error=moved_error
        )
    )
    pool = lib.connection_pool(max_connections=options.max_connections, **common)
    client = lib.client.from_pool(pool)
    return LoopClients(client, client, None, None, budget, slots)


def _where(address: Address | None) -> str:
    return "an unknown server" if address is None else f"{address[0]}:{address[1]}"


__all__ = [
    "CLOSE_TIMEOUT",
    "CONNECTS_AT_ONCE",
    "ConnectionBudget",
    "LoopClients",
    "Waiters",
    "make_loop_clients",
    "quick_retry",
    "tracked_connection_class",
]
