"""Damaged values (contract clause 6): one policy for every backend.

A stored value that fails its checks when it is read (a checksum that does not match, a frame
that is torn, truncated or does not parse) is never served. The read reports a miss, the
backend counts the value in ``corrupt_objects`` and logs it, and removes it, so that the key
reads as a plain miss afterwards and the next put starts clean. When the removal fails (the
store is down, or cannot delete), that is logged too, and the value reads as a miss, counted
again, until it is overwritten.

A value that is sound but not readable here (:class:`~kvplug.errors.UnreadableObject`: sealed
with a cipher key this reader does not hold) is counted and logged the same way but kept: other
readers may hold its key.

:class:`DamagedValues` is that policy. :class:`~kvplug.backend.BytesBackend` applies it to
every frame it reads; a backend that reads values in its own way (zero-copy into registered
memory, from files on a worker thread) keeps one ledger and reports to it what it found.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, TypeVar

from kvplug.errors import UnreadableObject

logger = logging.getLogger(__name__)

Name = TypeVar("Name")
"""How a backend names a stored value: the store's key string, bytes on some wires, or a
:class:`~kvplug.keys.CacheKey` for a wrapper over another backend."""


class DamagedValues(Generic[Name]):
    """The damage ledger of one backend: counts, logs and removes the damaged values it read.

    ``owner`` names the backend in the log (its URL; secrets are masked by the log filter).
    ``remove`` deletes one stored value by name; leave it out for a store that cannot delete,
    and damaged values are only counted. ``level`` is the level of the line logged for each
    damaged value (a wrapper that audits another store may log its findings as errors).

    Safe to call from any thread: :meth:`found` is what a worker thread reports with.

    Example, in a backend that reads values zero-copy and checks them itself:

        >>> import asyncio
        >>> from kvplug.damage import DamagedValues
        >>> stored = {"a": b"frame", "b": b"torn"}
        >>> async def remove(name: str) -> bool:
        ...     return stored.pop(name, None) is not None
        >>> damaged = DamagedValues("memstore://", remove=remove)
        >>> asyncio.run(damaged.drop({"b": "its checksum does not match"}))
        >>> damaged.count, sorted(stored)
        (1, ['a'])

    The backend then answers ``corrupt_objects`` from :attr:`count`
    (:class:`~kvplug.backend.CountsCorruptObjects`).
    """

    def __init__(
        self,
        owner: object,
        *,
        remove: Callable[[Name], Awaitable[object]] | None = None,
        level: int = logging.WARNING,
    ) -> None:
        self._owner = owner
        self._remove: Callable[[Name], Awaitable[object]] | None = remove
        self._level = level
        self._lock = threading.Lock()
        self._count = 0

    @property
    def count(self) -> int:
        """Damaged values read as misses so far (each read that found one counts it)."""
        return self._count

    def found(self, name: object, why: object) -> None:
        """Count and log one damaged value ``name`` that the caller removes itself (a file a
        worker thread unlinks, say). ``why`` says what check it failed."""
        self._count_and_log(name, why, "it reads as a miss and is removed")

    def _count_and_log(self, name: object, why: object, outcome: str) -> None:
        with self._lock:
            self._count += 1
        logger.log(
            self._level,
            "%s: the stored value %s is damaged (%s); %s",
            self._owner,
            _text(name),
            why,
            outcome,
        )

    def tally(self, count: int) -> None:
        """Count ``count`` damaged values found, logged and removed elsewhere (a scan of a
        directory at open that reports its own findings)."""
        with self._lock:
            self._count += count

    async def drop(self, damaged: Mapping[Name, object]) -> None:
        """Count and log each damaged value (name -> what check it failed), then remove them
        all concurrently. A removal that fails is logged, not raised: the read that found the
        damage still answers a miss. Cancellation is raised once every removal has ended."""
        what_next = (
            "it reads as a miss and is removed"
            if self._remove is not None
            else "it reads as a miss; this store cannot delete it, so it stays until overwritten"
        )
        for name, why in damaged.items():
            unreadable = isinstance(why, UnreadableObject)
            self._count_and_log(name, why, _KEPT if unreadable else what_next)
        names = [name for name, why in damaged.items() if not isinstance(why, UnreadableObject)]
        if self._remove is None or not names:
            return
        remove = self._remove
        outcomes = await asyncio.gather(*(remove(name) for name in names), return_exceptions=True)
        for name, result in zip(names, outcomes, strict=True):
            if isinstance(result, Exception):
                logger.warning(
                    "%s: could not remove the damaged value %s (%s: %s); it reads as a miss "
                    "until it is overwritten",
                    self._owner,
                    _text(name),
                    type(result).__name__,
                    result,
                )
        for result in outcomes:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result


_KEPT = "it reads as a miss and stays stored, for the readers that can read it"


def _text(name: object) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


__all__ = ["DamagedValues"]
