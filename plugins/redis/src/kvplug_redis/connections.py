"""The client library's connections, as kvplug uses them: opened a few at a time, reused
before new ones are opened, and (with Sentinel) only to the master the sentinels name.

A burst of operations (an engine's 200 concurrent loads) would otherwise make the client
library open one connection per operation at once; over TLS on a busy machine those hundreds
of handshakes starve each other and every operation runs past its deadline.
:class:`ConnectionBudget` admits an operation only while a connection is idle or fewer than
``spare`` are being opened, so the rest wait for a warm connection;
:func:`tracked_connection_class` reports the connections to it.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from kvplug_redis.sentinel import Address, MasterTracker


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


def _where(address: Address | None) -> str:
    return "an unknown server" if address is None else f"{address[0]}:{address[1]}"


__all__ = ["ConnectionBudget", "Waiters", "tracked_connection_class"]
