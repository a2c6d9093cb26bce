"""The file I/O threads of one disk backend (internal): a thread pool behind a queue of bounded
depth, serving coroutines of any event loop and thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from kvplug.memory import MemoryObj
from kvplug_disk.slots import Slots

if TYPE_CHECKING:
    from kvplug_disk.backend import DiskBackend
    from kvplug_disk.catalog import Catalog
    from kvplug_disk.payloads import PayloadPlanner

T = TypeVar("T")

READ_HELPERS = 8
"""Threads per I/O thread that read the later pieces of a payload while the I/O thread reads
the first one and hashes them (see :func:`kvplug_disk.piecewise.read_hashing`); started when
first needed."""


def _hand_back(abandoned: Callable[[T], None], future: concurrent.futures.Future[T]) -> None:
    if not future.cancelled() and future.exception() is None:
        abandoned(future.result())


def release_read(obj: MemoryObj | None) -> None:
    """Release the object a read returned, if any (a read whose caller went away)."""
    if obj is not None:
        obj.release()


class Workers:
    """``workers`` threads doing file I/O with at most ``queue_depth`` operations in flight;
    further callers wait their turn. A second pool of the same size hashes payloads while
    the I/O threads write them; a third, of :data:`READ_HELPERS` threads per I/O thread, reads
    pieces of payloads while the I/O threads hash the pieces already read.

    ``closed_error`` makes the error for calls after :meth:`close`; ``on_idle`` is called
    whenever the last operation in flight ends.
    """

    def __init__(
        self,
        workers: int,
        queue_depth: int,
        closed_error: Callable[[], BaseException],
        on_idle: Callable[[], None],
    ) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="kvplug-disk"
        )
        # The payload checksum is computed here while the worker's write (which releases the
        # GIL) is in the kernel, so hashing costs no time on the write path.
        self.hashers = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="kvplug-disk-hash"
        )
        # Its threads only ever wait on the disk, never on another pool, so no read, write or
        # hash can wait on them in a cycle.
        self.readers = concurrent.futures.ThreadPoolExecutor(
            max_workers=READ_HELPERS * workers, thread_name_prefix="kvplug-disk-read"
        )
        self._slots = Slots(queue_depth)
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self._inflight_lock = threading.Lock()
        self._closed_error = closed_error
        self._on_idle = on_idle

    @property
    def busy(self) -> bool:
        """Whether file I/O is in flight."""
        with self._inflight_lock:
            return bool(self._inflight)

    def _finished(self, future: concurrent.futures.Future[Any]) -> None:
        with self._inflight_lock:
            self._inflight.discard(future)
            idle = not self._inflight
        self._slots.release()
        if idle:
            self._on_idle()

    async def submit(
        self,
        work: Callable[[], T],
        not_run: Callable[[], None] | None,
        abandoned: Callable[[T], None] | None,
        ensure_open: Callable[[], None],
    ) -> T:
        """``work`` on the pool within a queue slot. ``ensure_open`` runs once a slot is
        taken (the wait may have outlasted the backend); ``not_run`` is called when ``work``
        never runs, ``abandoned`` gets the result of a ``work`` whose caller stopped waiting
        (see :meth:`kvplug_disk.backend.DiskBackend._run`)."""
        submitted: list[concurrent.futures.Future[T]] = []
        try:
            await self._slots.acquire()
            try:
                ensure_open()
                future = self.pool.submit(work)
            except RuntimeError:  # the pool was shut down by close()
                self._slots.release()
                raise self._closed_error() from None
            except BaseException:
                self._slots.release()
                raise
            submitted.append(future)
            with self._inflight_lock:
                self._inflight.add(future)
            future.add_done_callback(self._finished)
            if not_run is not None:
                future.add_done_callback(lambda f: not_run() if f.cancelled() else None)
            return await asyncio.wrap_future(future)
        except BaseException:
            if not submitted:
                if not_run is not None:
                    not_run()
            elif abandoned is not None:
                submitted[0].add_done_callback(partial(_hand_back, abandoned))
            raise

    def close(self) -> None:
        """Fail every waiter and every later :meth:`submit` with ``closed_error()``."""
        self._slots.close(self._closed_error)

    def shutdown(self) -> None:
        """Stop the threads (work in flight finishes on its own)."""
        self.pool.shutdown(wait=False)
        self.hashers.shutdown(wait=False)
        self.readers.shutdown(wait=False)


@dataclass(frozen=True)
class FileWork:
    """What the read and write paths of one backend work with on its file I/O threads: the
    backend (its URL, options, directories, FileIO, allocator and scheme), its catalog, its
    payload planner, these threads, and its writer id, which names its temporary files."""

    backend: DiskBackend
    catalog: Catalog
    planner: PayloadPlanner
    workers: Workers
    writer: str


__all__ = ["READ_HELPERS", "FileWork", "Workers", "release_read"]
