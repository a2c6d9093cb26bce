"""Calling a backend from engine worker threads.

:class:`SyncClient` runs the async world on one IO-loop thread of its own and hands back
``concurrent.futures.Future`` s, so an engine thread can start a store, keep computing, and
collect the result later. Vendors write only async code; this is the one bridge.

Example::

    >>> import torch
    >>> from kvplug import CacheKey, MemoryObj
    >>> from kvplug.sync import SyncClient
    >>> with SyncClient("cpu://?max_size=64MiB") as client:
    ...     key = CacheKey("demo-model", 1, 0, 42)
    ...     client.put(key, MemoryObj.from_tensor(torch.ones(4, 8))).result()
    ...     obj = client.get(key).result()
    ...     total = obj.tensor.sum().item()
    ...     obj.release()
    >>> total
    32.0
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from kvplug.backend import Backend
from kvplug.config import Config
from kvplug.errors import BackendClosed, BackendTimeout, KvplugError
from kvplug.keys import CacheKey
from kvplug.memory import Allocator, MemoryObj
from kvplug.registry import open_backend
from kvplug.secrets import mask_url
from kvplug.store import Store, open_store
from kvplug.url import BackendURL

T = TypeVar("T")
logger = logging.getLogger("kvplug.sync")


class SyncClient:
    """A backend (a tiered :class:`~kvplug.store.Store` is one too) driven from any thread
    through one private event-loop thread.

    Pass an opened :class:`~kvplug.backend.Backend`, a URL (opened on the client's loop), or a
    :class:`~kvplug.config.Config` (its tiers are opened as a :class:`~kvplug.store.Store`
    on the client's loop). Every method returns a ``concurrent.futures.Future``; errors
    surface from ``.result()``. Operations of a backend that
    :attr:`~kvplug.backend.Backend.runs_inline` (``cpu://``) run on the calling thread and
    return a future that is already done. A client belongs to the process that made it: after
    ``fork`` make a new one.
    """

    backend: Backend

    def __init__(
        self,
        backend: Backend | str | BackendURL | Config,
        *,
        allocator: Allocator | None = None,
        open_timeout: float = 60.0,
        **options: Any,
    ) -> None:
        self._pid = os.getpid()
        self._closed = False
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=_serve, args=(self._loop,), name="kvplug-io", daemon=True
        )
        self._thread.start()
        if isinstance(backend, Backend):
            self.backend = backend
            return
        target = mask_url(str(backend)) if not isinstance(backend, Config) else "the tiers"
        opening: Coroutine[Any, Any, Backend] = (
            open_store(backend, allocator=allocator, **options)
            if isinstance(backend, Config)
            else open_backend(backend, allocator=allocator, **options)
        )

        async def open_within_deadline() -> Backend:
            # wait_for cancels an open that runs late and waits for it to unwind, and an open
            # that unwinds closes what it had opened, so nothing is left behind on this loop.
            try:
                return await asyncio.wait_for(opening, open_timeout)
            except TimeoutError:
                raise BackendTimeout(
                    f"opening {target} took longer than open_timeout={open_timeout} s; the "
                    "open was cancelled and what it had opened was closed. Check that the "
                    "store is reachable, or raise open_timeout."
                ) from None

        try:
            self.backend = self._submit(open_within_deadline()).result()
        except BaseException:
            self._stop_loop()
            raise

    def _check(self) -> None:
        if os.getpid() != self._pid:
            raise KvplugError(
                f"this SyncClient was created in process {self._pid} and is used in forked "
                f"process {os.getpid()}; its IO thread does not exist here. Create a new "
                "SyncClient in the child process."
            )
        if self._closed:
            raise BackendClosed("this SyncClient is closed; create a new one.")

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _operate(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a backend operation: on the caller's thread when the backend
        :attr:`~kvplug.backend.Backend.runs_inline` (the future is done on return), else on the
        IO thread."""
        if not self.backend.runs_inline:
            return self._submit(coroutine)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            coroutine.send(None)
        except StopIteration as done:
            future.set_result(done.value)
            return future
        except RuntimeError as error:
            # What an operation that needs a loop meets on a thread without one.
            future.set_exception(self._waited() if "no running event loop" in str(error) else error)
            return future
        except Exception as error:
            future.set_exception(error)
            return future
        coroutine.close()
        future.set_exception(self._waited())
        return future

    def _waited(self) -> KvplugError:
        name = type(self.backend).__qualname__
        return KvplugError(
            f"{name} declares runs_inline, but one of its operations waited; an inline "
            "backend's operations must finish without waiting. The operation was abandoned. "
            f"Remove runs_inline from {name} (SyncClient then runs its operations on its IO "
            "thread)."
        )

    def _checked(self, coroutine: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        """``coroutine``, once this client is known usable here; else it is closed unrun."""
        try:
            self._check()
        except BaseException:
            coroutine.close()
            raise
        return coroutine

    def run(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run any coroutine on the client's loop (for example a backend-specific method)."""
        return self._submit(self._checked(coroutine))

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return self._operate(self._checked(coroutine))

    def get(self, key: CacheKey) -> concurrent.futures.Future[MemoryObj | None]:
        """The stored object (the caller releases it) or ``None``."""
        return self._call(self.backend.get(key))

    def put(self, key: CacheKey, obj: MemoryObj) -> concurrent.futures.Future[None]:
        """Store ``obj``. The caller may release its own reference as soon as this returns."""
        self._check()
        obj.retain()  # taken here so the object outlives a caller that releases right away

        async def put_and_release() -> None:
            try:
                await self.backend.put(key, obj)
            finally:
                obj.release()

        return self._operate(put_and_release())

    def contains(self, key: CacheKey) -> concurrent.futures.Future[bool]:
        return self._call(self.backend.contains(key))

    def remove(self, key: CacheKey) -> concurrent.futures.Future[bool]:
        """Whether ``key`` was stored (in any tier of a Store) and is now removed."""
        return self._call(self.backend.remove(key))

    def pin(self, key: CacheKey) -> concurrent.futures.Future[bool]:
        return self._call(self.backend.pin(key))

    def unpin(self, key: CacheKey) -> concurrent.futures.Future[bool]:
        return self._call(self.backend.unpin(key))

    def lookup(self, keys: Sequence[CacheKey]) -> concurrent.futures.Future[int]:
        """How many leading ``keys`` are stored (in any tier of a Store)."""
        return self._call(self.backend.batched_contains(list(keys)))

    def prefetch(self, keys: Sequence[CacheKey]) -> concurrent.futures.Future[int]:
        """Load the leading present ``keys`` into a Store's first tier (see Store.prefetch)."""
        if not isinstance(self.backend, Store):
            return self.lookup(keys)
        return self._call(self.backend.prefetch(list(keys)))

    def batched_get(
        self, keys: Sequence[CacheKey]
    ) -> concurrent.futures.Future[list[MemoryObj | None]]:
        return self._call(self.backend.batched_get(list(keys)))

    def batched_put(
        self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]
    ) -> concurrent.futures.Future[None]:
        self._check()
        held = [obj.retain() for obj in objs]

        async def put_and_release() -> None:
            try:
                await self.backend.batched_put(list(keys), held)
            finally:
                for obj in held:
                    obj.release()

        return self._operate(put_and_release())

    def batched_contains(self, keys: Sequence[CacheKey]) -> concurrent.futures.Future[int]:
        return self._call(self.backend.batched_contains(list(keys)))

    def close(self, timeout: float = 30.0) -> None:
        """Close the backend and stop the IO thread, each within ``timeout`` seconds.
        Idempotent. An IO thread that does not stop in time (a backend blocks it) is left to
        end by itself, with a warning."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._pid:
            return
        try:
            self._submit(self.backend.close()).result(timeout)
        finally:
            self._stop_loop(timeout)

    def _stop_loop(self, timeout: float | None = None) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning(
                "the IO thread of the SyncClient for %s did not stop within %s s: an operation "
                "blocks it; it finishes what is left and ends by itself once it is free",
                mask_url(str(self.backend.url)),
                timeout,
            )

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


FINISH_SECONDS = 5.0
"""Seconds a stopped IO loop gives the tasks still on it (a close submitted while an operation
blocked the loop) before it cancels them."""


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The IO thread: run ``loop`` until it is stopped, then let the tasks still there finish
    (cancelled after :data:`FINISH_SECONDS`) and close it, so nothing is left pending."""
    try:
        loop.run_forever()
    finally:
        pending = asyncio.all_tasks(loop)
        if pending:
            _, late = loop.run_until_complete(asyncio.wait(pending, timeout=FINISH_SECONDS))
            for task in late:
                task.cancel()
            if late:
                loop.run_until_complete(asyncio.wait(late, timeout=FINISH_SECONDS))
        loop.close()


__all__ = ["SyncClient"]
