"""How a batch's transfers, checksums and retries are paced on a worker thread: transfers of
one group of objects while the checksums of the next (or the last) run on a checksum thread
(:func:`overlapped`), the checksum fed in pieces so that the two share the GIL
(:func:`checksum`), and reads of values being written retried for a while
(:func:`while_being_written`)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import xxhash

from kvplug.frame import Buffer, payload_checksum
from kvplug.memory import MemoryObj

K = TypeVar("K")

GROUP_BYTES = 4 << 20
"""Bytes a batch moves per Mooncake call at least, when it moves several: one call per
KV chunk of a few MiB, whose checksum overlaps the transfer of the next."""

PIECE = 2 << 20
"""Bytes :func:`checksum` hashes between two chances for other threads to take the GIL."""

WRITE_WAIT = 2.0
"""Seconds a read waits for a value being written before it reads as a miss (a writer that
died mid-put leaves it hidden until the master discards the put, 30 s later)."""

_hashing = threading.local()


def sharing_the_gil(work: Callable[..., None], *args: Any) -> None:
    """Run ``work`` with :func:`checksum` letting go of the GIL between pieces."""
    _hashing.share = True
    try:
        work(*args)
    finally:
        _hashing.share = False


def checksum(payload: Buffer) -> int:
    """:func:`kvplug.frame.payload_checksum` (xxh3-64) of ``payload``. On the checksum thread
    (:func:`sharing_the_gil`) it is fed in pieces of :data:`PIECE` bytes with the GIL let go
    between them: xxhash holds the GIL for as long as one call hashes, and over a whole KV
    chunk (milliseconds on data not in cache) that would keep the worker thread from starting
    its next Mooncake transfer, undoing the overlap. Elsewhere it is one call."""
    view = memoryview(payload).cast("B")
    if view.nbytes <= PIECE or not getattr(_hashing, "share", False):
        return payload_checksum(view)
    state = xxhash.xxh3_64()
    for start in range(0, view.nbytes, PIECE):
        state.update(view[start : start + PIECE])
        time.sleep(0)  # lets a waiting thread take the GIL
    return int(state.intdigest())


def groups_of(indices: list[int], objs: Sequence[MemoryObj]) -> list[list[int]]:
    """``indices`` in order, cut into groups of at least :data:`GROUP_BYTES` each (the last
    may be smaller): the steps in which a batch's transfers and checksums overlap."""
    groups: list[list[int]] = []
    size = GROUP_BYTES
    for i in indices:
        if size >= GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += objs[i].nbytes
    return groups


def overlapped(
    checker: concurrent.futures.Executor,
    groups: list[list[int]],
    *,
    transfer: Callable[[list[int]], Any],
    before: Callable[[list[int]], None] | None = None,
    after: Callable[[list[int], Any], None] | None = None,
) -> None:
    """Transfer each group on this thread, and hash on ``checker``: ``before`` of the next
    group (frame headers) or ``after`` of the one just moved (verification) while Mooncake
    moves this one. Mooncake's calls release the GIL, and the checksum thread lets go of it
    between pieces (:func:`checksum`), so the two overlap. The first ``before`` and the last
    ``after`` have nothing to overlap with and run here, so a batch of one group (a single
    chunk) runs as if there were no checksum thread."""
    if before is not None and groups:
        before(groups[0])
    running: list[concurrent.futures.Future[None]] = []  # at most one hashing job
    try:
        for index, group in enumerate(groups):
            last = index + 1 == len(groups)
            if before is not None and not last:
                running.append(checker.submit(sharing_the_gil, before, groups[index + 1]))
            result = transfer(group)
            while running:
                running.pop().result()
            if after is not None and last:
                after(group, result)
            elif after is not None:
                running.append(checker.submit(sharing_the_gil, after, group, result))
    finally:
        concurrent.futures.wait(running)  # a transfer failed: the hashing of memory ends first


def while_being_written(attempt: Callable[[list[K]], list[K]], pending: list[K]) -> list[K]:
    """Call ``attempt`` with the items still pending until none is, waiting a little more
    each time, for at most :data:`WRITE_WAIT` seconds; the items still pending then.

    Mooncake hides a value while a put or an overwrite of it runs (its replica is not ready,
    -703): a read then waits for the write to finish rather than miss a key that has a value
    (read-your-writes while another writer overwrites it)."""
    deadline = time.monotonic() + WRITE_WAIT
    pause = 0.001
    while pending:
        pending = attempt(pending)
        if not pending or time.monotonic() + pause > deadline:
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return pending


__all__ = [
    "GROUP_BYTES",
    "checksum",
    "groups_of",
    "overlapped",
    "sharing_the_gil",
    "while_being_written",
]
