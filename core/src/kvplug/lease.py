"""Lending a caller's memory to work on other threads, revocably.

A backend that moves bytes on threads of its own (file I/O, a client library's transfer
thread) cannot stop a thread when the operation that started it is cancelled. To declare the
``releases_on_cancel`` capability anyway (so engines lend it their buffers without a copy), it
hands its threads a :class:`Lease` on the caller's object instead of the object: every read or
write of the caller's memory happens inside :meth:`Lease.use`, and the operation's cancellation
awaits :meth:`Lease.revoke`, which waits only for the accesses in progress (one system call or
copy each) and then returns the caller's memory for good: a thread that gets to its next access
later finds the lease revoked (:class:`Revoked`) and abandons the work.

Example (a worker thread that fills the caller's buffer in pieces, cancelled half-way)::

    >>> import asyncio, threading, torch
    >>> from kvplug.memory import MemoryObj
    >>> async def demo() -> tuple[int, int, int]:
    ...     buffer = torch.zeros(8, dtype=torch.uint8)
    ...     lease = Lease(MemoryObj.from_tensor(buffer))
    ...     halfway, go_on = threading.Event(), threading.Event()
    ...     def worker() -> None:
    ...         try:
    ...             for piece in range(8):
    ...                 if piece == 4:
    ...                     halfway.set()
    ...                     go_on.wait()
    ...                 with lease.use() as obj:
    ...                     obj.raw[piece] = 1
    ...         except Revoked:
    ...             pass
    ...         finally:
    ...             lease.end()
    ...     thread = threading.Thread(target=worker)
    ...     thread.start()
    ...     await asyncio.to_thread(halfway.wait)
    ...     await lease.revoke()  # the caller may reuse its buffer from here on
    ...     held = lease.obj.ref_count
    ...     go_on.set()
    ...     thread.join()
    ...     return int(buffer.sum()), held, lease.obj.ref_count
    >>> asyncio.run(demo())
    (4, 1, 1)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvplug.memory import MemoryObj

REVOKE_POLL_SECONDS = 0.0005
"""How often :meth:`Lease.revoke` looks whether the accesses in progress have ended."""


class Revoked(Exception):
    """The lease was revoked: the operation was cancelled and the memory is the caller's
    again. Raised by :meth:`Lease.use` in the thread doing the work, which then abandons it."""


class Lease:
    """A caller's :class:`~kvplug.memory.MemoryObj` lent to work on other threads; see the
    module documentation.

    The lease holds one reference to the object from its creation. That reference is given
    back exactly once: by :meth:`end` when the work finishes (the normal case), or by
    :meth:`revoke` when the operation is cancelled first, as soon as no access is in progress.
    Thread-safe.
    """

    def __init__(self, obj: MemoryObj) -> None:
        self.obj = obj.retain()
        self._lock = threading.Lock()
        self._using = 0
        self._revoked = False
        self._returned = False

    @property
    def revoked(self) -> bool:
        """Whether the operation was cancelled (work may stop early)."""
        return self._revoked

    @contextmanager
    def use(self) -> Iterator[MemoryObj]:
        """Access the caller's object for one step of the work (a system call, a copy, a
        hash); raises :class:`Revoked` instead once the lease was revoked or returned. Keep
        each step short: :meth:`revoke` waits for the steps in progress."""
        with self._lock:
            if self._revoked or self._returned:
                raise Revoked("the operation was cancelled; the caller's memory is its own again")
            self._using += 1
        try:
            yield self.obj
        finally:
            with self._lock:
                self._using -= 1

    def end(self) -> None:
        """The work is over (done, failed or abandoned): give the reference back unless
        :meth:`revoke` did. Call it exactly once from the work, in a ``finally``."""
        with self._lock:
            if self._returned:
                return
            self._returned = True
        self.obj.release()

    async def revoke(self) -> None:
        """Take the memory back: no access starts from now on, and this returns once the
        accesses in progress have ended, with the lease's reference given back (unless the
        work had ended first). Idempotent. A cancellation of the awaiting task meanwhile (a
        deadline on top of a caller's cancellation) does not cut the wait short: it is raised
        once the memory is back."""
        with self._lock:
            self._revoked = True
        interrupted: asyncio.CancelledError | None = None
        while True:
            with self._lock:
                if not self._using:
                    returned, self._returned = self._returned, True
                    break
            try:
                await asyncio.sleep(REVOKE_POLL_SECONDS)
            except asyncio.CancelledError as error:
                interrupted = error
        if not returned:
            self.obj.release()
        if interrupted is not None:
            raise interrupted


__all__ = ["Lease", "Revoked"]
