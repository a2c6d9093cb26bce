"""Stalling a worker thread of a backend for engine-boundary tests: a disk worker that stops
before, or while, it touches an engine's buffer, and is let go once the engine has moved on.

Example (in a test, with pytest's ``monkeypatch``)::

    stall = stall_disk(monkeypatch, disk_backend, "load", "while")
    job = engine.submit_load(...)            # reported failed at its deadline
    assert stall.reached.wait(5)
    ...                                      # the engine rewrites its buffer
    stall.release()                          # the worker goes on: it must not touch it
"""

from __future__ import annotations

import threading
from typing import Any, Literal

STALL_LIMIT = 30.0
"""Seconds a stalled call waits at most for :meth:`Stall.release` (a test that forgets to
release it still ends)."""


class Stall:
    """Holds the first call of ``owner.<hold>`` on its (worker) thread until :meth:`release`,
    and tells when that thread has left ``span_owner.<span>``, the worker function around it
    (its whole use of the buffer; it may be ``<hold>`` itself). ``patch`` is pytest's
    ``monkeypatch`` (anything with ``setattr(owner, name, value)`` that undoes it later)."""

    def __init__(self, patch: Any, owner: object, hold: str, span_owner: object, span: str) -> None:
        self.reached = threading.Event()
        """Set once the held call was reached."""
        self.finished = threading.Event()
        """Set once the worker function around it returned on that thread."""
        self._go = threading.Event()
        self._lock = threading.Lock()
        self._thread: int | None = None
        held = getattr(owner, hold)

        def holding(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                first = self._thread is None
                if first:
                    self._thread = threading.get_ident()
            if first:
                self.reached.set()
                self._go.wait(STALL_LIMIT)
            return held(*args, **kwargs)

        patch.setattr(owner, hold, holding)
        spanned = getattr(span_owner, span)  # ``holding`` itself when it is the same function

        def spanning(*args: Any, **kwargs: Any) -> Any:
            try:
                return spanned(*args, **kwargs)
            finally:
                if threading.get_ident() == self._thread:
                    self.finished.set()

        patch.setattr(span_owner, span, spanning)

    def release(self) -> None:
        """Let the held call go on; wait until its worker function has returned."""
        self._go.set()
        if self.reached.is_set():
            assert self.finished.wait(STALL_LIMIT), "the stalled worker never finished"


def stall_disk(
    patch: Any,
    disk: Any,
    job: Literal["store", "load"],
    where: Literal["before", "while"],
) -> Stall:
    """Stall the first worker of a ``job`` of ``disk`` (a kvplug-disk backend) on its file I/O
    thread: ``before`` it touches the buffer (on entering the worker function), or ``while``
    it does (at its file I/O, once the payload is planned: a store's buffer is being read, a
    load's destination is written once the read returns)."""
    worker = "_write" if job == "store" else "_read_key_into"
    if where == "before":
        return Stall(patch, disk, worker, disk, worker)
    io = "write_object" if job == "store" else "read_object"
    return Stall(patch, disk.io, io, disk, worker)


__all__ = ["STALL_LIMIT", "Stall", "stall_disk"]
