"""A counting semaphore for coroutines of any event loop and thread (internal)."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable


class Slots:
    """A counting semaphore for coroutines of any event loop and thread.

    asyncio's semaphore belongs to one loop, but one backend serves engine threads through
    SyncClient and tasks of other loops at once; waiters here are woken on their own loop.
    """

    def __init__(self, count: int) -> None:
        self._free = count
        self._lock = threading.Lock()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()
        self._closed: Callable[[], BaseException] | None = None

    async def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed is not None:
                raise self._closed()
            if self._free > 0 and not self._waiters:
                self._free -= 1
                return
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, waiter))
        try:
            await waiter
        except BaseException:
            with self._lock:
                try:
                    self._waiters.remove((loop, waiter))
                    queued = True
                except ValueError:
                    queued = False
            granted = waiter.done() and not waiter.cancelled() and waiter.exception() is None
            if not queued and granted:
                self.release()  # granted, but this caller gave up: pass the slot on
            raise

    def release(self) -> None:
        with self._lock:
            while self._waiters:
                loop, waiter = self._waiters.popleft()
                try:
                    loop.call_soon_threadsafe(self._grant, waiter)
                    return
                except RuntimeError:  # that loop is closed: nobody waits there any more
                    continue
            self._free += 1

    def _grant(self, waiter: asyncio.Future[None]) -> None:
        if waiter.done():  # cancelled after it was picked: pass the slot on
            self.release()
        else:
            waiter.set_result(None)

    def close(self, error: Callable[[], BaseException]) -> None:
        """Fail every waiter and every later :meth:`acquire` with ``error()``."""
        with self._lock:
            self._closed = error
            waiters = list(self._waiters)
            self._waiters.clear()
        for loop, waiter in waiters:
            try:
                loop.call_soon_threadsafe(_fail, waiter, error())
            except RuntimeError:
                continue


def _fail(waiter: asyncio.Future[None], error: BaseException) -> None:
    if not waiter.done():
        waiter.set_exception(error)


__all__ = ["Slots"]
