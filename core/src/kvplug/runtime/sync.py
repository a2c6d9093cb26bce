"""Calling a backend from engine worker threads.

:class:`SyncClient` runs the async world on one IO-loop thread of its own and hands back
``concurrent.futures.Future`` s, so an engine thread can start a store, keep computing, and
collect the result later. Vendors write only async code; this is the one bridge.

An operation of a backend that declares :attr:`~kvplug.backend.Backend.runs_inline`
(``cpu://``) skips the IO thread: it runs to its end on the calling thread
(:func:`kvplug.inline.run_inline`), and the future returned is already done. That it waited
after all is known by kvplug's own means, not by the text of an error: the thread's running
loop is kvplug's stand-in while the operation is stepped, which raises
:class:`~kvplug.inline.NeededALoop` at any request, and a step that suspends is caught as
such. The operation is then abandoned and its future holds a
:class:`~kvplug.errors.KvplugError` naming the backend.

A client ends its IO thread cleanly: :meth:`SyncClient.close` lets every task on the loop end
(those started while it closes too) before the loop is closed, and a client still open when
the interpreter exits is closed then (after the program's own threads have ended), so no task
is left pending on a loop that goes away (which asyncio reports as "Task was destroyed but it
is pending" and, for a task whose clean-up awaits, "coroutine ignored GeneratorExit").

Example::

    >>> import torch
    >>> from kvplug import CacheKey, MemoryObj
    >>> from kvplug.runtime.sync import SyncClient
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
import atexit
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

from kvplug.backend import Backend
from kvplug.errors import BackendClosed, BackendTimeout, KvplugError
from kvplug.inline import NeededALoop, run_inline
from kvplug.keys import CacheKey
from kvplug.memory import Allocator, MemoryObj
from kvplug.registry import open_backend
from kvplug.runtime.config import Config
from kvplug.runtime.store import Store, open_store
from kvplug.secrets import mask_url
from kvplug.url import BackendURL

_FINISHED = concurrent.futures._base.FINISHED

T = TypeVar("T")
logger = logging.getLogger("kvplug.sync")


class Finished(concurrent.futures.Future[T]):
    """A ``concurrent.futures.Future`` born done: what an inline operation returns.

    A plain future builds a ``threading.Condition`` of its own, about a third of an inline
    ``cpu://`` get; a finished future never changes state again, so all of them share one
    condition (``wait``, ``as_completed`` and callbacks still take it, and find it done).

    >>> Finished(3).result()
    3
    >>> Finished(exception=KeyError("k")).exception()
    KeyError('k')
    """

    _shared_condition = threading.Condition()

    def __init__(self, result: T | None = None, exception: BaseException | None = None) -> None:
        # The attributes concurrent.futures.Future.__init__ sets, in their finished state.
        self._condition = self._shared_condition
        self._state = _FINISHED
        self._result = result
        self._exception = exception
        self._waiters = []
        self._done_callbacks: list[Callable[[concurrent.futures.Future[T]], object]] = []

    def result(self, timeout: float | None = None) -> T:
        """The result, or the exception raised; at once, without the condition."""
        exception = self._exception
        if exception is None:
            return cast(T, self._result)
        del self  # the traceback would hold this frame, and it this future: a reference cycle
        raise exception


class SyncClient:
    """A backend (a tiered :class:`~kvplug.runtime.store.Store` is one too) driven from any thread
    through one private event-loop thread.

    Pass an opened :class:`~kvplug.backend.Backend`, a URL (opened on the client's loop), or a
    :class:`~kvplug.runtime.config.Config` (its tiers are opened as a
    :class:`~kvplug.runtime.store.Store`
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
        self._forks_before = _forks
        self._closed = False
        self._stopping = False
        """Set (under :attr:`_lock`) once the loop was told to stop: nothing is submitted
        after that, so no coroutine is left unrun on a closed loop."""
        self._lock = threading.Lock()
        self._loop, executor = new_io_loop()
        self._thread = threading.Thread(
            target=_serve, args=(self._loop, executor), name="kvplug-io", daemon=True
        )
        self._thread.start()
        with _running_lock:
            _running.add(self)
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
        if _forks != self._forks_before:  # not os.getpid(): a system call on every operation
            raise KvplugError(
                f"this SyncClient was created in process {self._pid} and is used in forked "
                f"process {os.getpid()}; its IO thread does not exist here. Create a new "
                "SyncClient in the child process."
            )
        if self._closed:
            raise BackendClosed("this SyncClient is closed; create a new one.")

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._stopping:  # a call that raced with close(): its loop is going away
                coroutine.close()
                raise BackendClosed("this SyncClient is closed; create a new one.")
            return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _operate(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a backend operation: on the caller's thread when the backend
        :attr:`~kvplug.backend.Backend.runs_inline` (the future is done on return), else on the
        IO thread."""
        if not self.backend.runs_inline:
            return self._submit(coroutine)
        try:
            return Finished(run_inline(coroutine))
        except NeededALoop as waited:
            return Finished(exception=self._waited(waited))
        except Exception as error:
            return Finished(exception=error)

    def _waited(self, waited: NeededALoop) -> KvplugError:
        name = type(self.backend).__qualname__
        error = KvplugError(
            f"{name} declares runs_inline, but one of its operations waited ({waited}); an "
            "inline backend's operations must finish without waiting. The operation was "
            f"abandoned. Remove runs_inline from {name} (SyncClient then runs its operations "
            "on its IO thread)."
        )
        error.__cause__ = waited
        return error

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

    def batched_exists(self, keys: Sequence[CacheKey]) -> concurrent.futures.Future[list[bool]]:
        return self._call(self.backend.batched_exists(list(keys)))

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
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            with _running_lock:
                _running.discard(self)
        else:
            logger.warning(
                "the IO thread of the SyncClient for %s did not stop within %s s: an operation "
                "blocks it; it finishes what is left and ends by itself once it is free",
                mask_url(str(self.backend.url)),
                timeout,
            )

    def _end_at_exit(self) -> None:
        """Close this client (or, where a close is under way in another thread, wait for its
        IO thread) within :data:`EXIT_SECONDS`."""
        if os.getpid() != self._pid:
            return  # a forked child: the IO thread is the parent's
        with self._lock:
            closing = self._closed
        try:
            if closing:
                self._thread.join(EXIT_SECONDS)
            else:
                self.close(EXIT_SECONDS)
        except Exception as error:
            logger.warning(
                "closing the SyncClient for %s at interpreter exit failed: %s",
                mask_url(str(getattr(getattr(self, "backend", None), "url", "a backend"))),
                error,
            )

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


FINISH_SECONDS = 5.0
"""Seconds a stopped IO loop gives the tasks still on it (a close submitted while an operation
blocked the loop) before it cancels them, and then the cancelled ones to end."""
EXIT_SECONDS = 10.0
"""Seconds each client still open at interpreter exit may take to close."""

_forks = 0
"""How many times this process is a forked child of the one before it: a client made before
the last fork belongs to the parent."""


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)

_running: set[SyncClient] = set()
"""Clients whose IO thread may still run: closed at interpreter exit. Held strongly: a client
dropped unclosed leaves its thread running anyway, and exit closes it then."""
_running_lock = threading.Lock()


@atexit.register
def _end_running_clients() -> None:
    """Close the clients still open at interpreter exit. ``atexit`` runs this once the
    program's own (non-daemon) threads have ended, so no caller uses them any more; without
    it the IO threads (daemons) are frozen mid-loop, and the tasks left on their loops are
    destroyed pending."""
    with _running_lock:
        clients = list(_running)
    for client in clients:
        client._end_at_exit()


def _serve(
    loop: asyncio.AbstractEventLoop, executor: concurrent.futures.ThreadPoolExecutor
) -> None:
    """The IO thread: run ``loop`` until it is stopped, then let every task on it end
    (:func:`_finish_tasks`) and close it (:func:`close_io_loop`), so nothing is left pending
    or running."""
    try:
        loop.run_forever()
    finally:
        try:
            loop.run_until_complete(_finish_tasks())
        finally:
            close_io_loop(loop, executor)


def new_io_loop() -> tuple[asyncio.AbstractEventLoop, concurrent.futures.ThreadPoolExecutor]:
    """A new event loop and the default executor it was given (``asyncio.to_thread``,
    ``run_in_executor(None, ...)`` and ``loop.getaddrinfo`` run there); close both with
    :func:`close_io_loop`."""
    loop = asyncio.new_event_loop()
    executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="kvplug-io-executor")
    loop.set_default_executor(executor)
    return loop, executor


def close_io_loop(
    loop: asyncio.AbstractEventLoop, executor: concurrent.futures.ThreadPoolExecutor
) -> None:
    """Finalize ``loop``'s async generators, wait up to :data:`FINISH_SECONDS` for the
    threads of its executor to end, and close it. ``loop.close()`` alone only asks those
    threads to end, so they would outlive the loop; one still busy after the wait (a blocking
    call run with ``asyncio.to_thread``) is named in a warning and ends by itself."""
    try:
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
        executor.shutdown(wait=False, cancel_futures=True)
        waiter = threading.Thread(
            target=executor.shutdown, name="kvplug-io-executor-end", daemon=True
        )
        waiter.start()
        waiter.join(FINISH_SECONDS)
        if waiter.is_alive():
            logger.warning(
                "a thread of an IO loop's executor was still running %s s after the loop "
                "stopped (a blocking call run with asyncio.to_thread); it ends by itself",
                FINISH_SECONDS,
            )


async def _finish_tasks() -> None:
    """Wait for the loop's other tasks, including those they start meanwhile and those
    submitted just before the loop stopped, for :data:`FINISH_SECONDS`; then cancel the rest
    and give them as long again. A task that outlives both is named in a warning (it ignores
    cancellation) and is destroyed with the loop."""
    loop = asyncio.get_running_loop()
    this = asyncio.current_task()
    cancelled: set[asyncio.Task[Any]] = set()
    for cancelling in (False, True):
        deadline = loop.time() + FINISH_SECONDS
        while others := asyncio.all_tasks() - {this}:
            if cancelling:
                for task in others - cancelled:
                    task.cancel()
                cancelled |= others
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            await asyncio.wait(others, timeout=remaining)
    left = asyncio.all_tasks() - {this}
    if left:
        logger.warning(
            "%d task(s) of a SyncClient's IO loop did not end when cancelled and are dropped: %s",
            len(left),
            ", ".join(sorted(task.get_name() for task in left)),
        )


__all__ = ["SyncClient"]
