"""Payload planning (internal): where an object's payload sits in memory while its
:class:`~kvplug_disk.fileio.FileIO` moves it, as a :class:`~kvplug_disk.fileio.Payload`.

An object in 4096-aligned memory the FileIO takes moves as it is (its allocator block, padding
included); any other goes through aligned staging memory its scheme lends
(:meth:`kvplug_disk.scheme.DiskScheme.staging_block`), or, buffered, through host views.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from kvplug.memory import FreeListAllocator, MemoryFormat, MemoryObj
from kvplug_disk.fileio.base import FileIO, Payload
from kvplug_disk.fileops import Access, byte_view
from kvplug_disk.layout import BLOCK

if TYPE_CHECKING:
    from kvplug_disk.scheme import DiskScheme

BOUNCE_POOL_SIZE = 64 << 20
"""Aligned staging memory for objects that do not live in 4096-aligned host memory."""
_ZEROS = bytes(BLOCK)


def aligned_block(obj: MemoryObj, length: int, *, own_memory: bool) -> torch.Tensor | None:
    """The first ``length`` bytes of ``obj``'s allocator block, when that block is 4096-aligned
    memory of a :class:`FreeListAllocator` and at least that long; or, with ``own_memory``,
    ``obj``'s own bytes when they are 4096-aligned host memory of exactly ``length`` bytes (an
    engine's buffer, whatever owns it); else None.

    Such a block can go to and from the file with O_DIRECT as it is: the bytes after the
    object's end up to ``length`` are the block's own padding.
    """
    if (
        own_memory
        and obj.device.type == "cpu"
        and obj.nbytes == length
        and obj.data_ptr() % BLOCK == 0
    ):
        return obj.raw
    allocator = obj.allocator
    if not isinstance(allocator, FreeListAllocator) or allocator.alignment % BLOCK:
        return None
    buffer = allocator.buffer
    if obj.phy_size < length:
        return None
    start = buffer.data_ptr() + obj.offset
    if start % BLOCK or (obj.nbytes and start != obj.data_ptr()):
        return None
    return buffer[obj.offset : obj.offset + length]


def whole(buffer: torch.Tensor, nbytes: int, o_direct: bool) -> Payload:
    """A payload that is the one flat buffer ``buffer`` (its first ``nbytes`` the object's)."""
    if buffer.device.type != "cpu":
        return Payload([], o_direct, None, buffer)
    view = byte_view(buffer)
    return Payload([view], o_direct, view[:nbytes], buffer)


class BouncePool:
    """``file://``'s staging memory: :data:`BOUNCE_POOL_SIZE` bytes of 4096-aligned host
    memory, made on first use (:attr:`pool` is None until then)."""

    def __init__(self) -> None:
        self.pool: FreeListAllocator | None = None
        self._lock = threading.Lock()

    def block(self, length: int) -> MemoryObj | None:
        """``length`` bytes of the pool; None when it has no room (then buffered I/O)."""
        with self._lock:
            if self.pool is None:
                self.pool = FreeListAllocator(BOUNCE_POOL_SIZE, alignment=BLOCK, pin=False)
            pool = self.pool
        return pool.allocate((length,), torch.uint8, MemoryFormat.BINARY_BUFFER)


class PayloadPlanner:
    """Plans payloads for the FileIO ``io()`` returns, with the memory ``scheme`` lends."""

    def __init__(self, io: Callable[[], FileIO], scheme: DiskScheme) -> None:
        self._io = io
        self._scheme = scheme

    def plan(
        self,
        obj: MemoryObj,
        length: int,
        o_direct: bool,
        writing: bool,
        access: Access = nullcontext,
    ) -> Payload:
        """How ``obj``'s payload (``length`` bytes on disk, block-padded) moves. ``access``
        wraps each step that touches ``obj``'s memory (the copies here, and the payload's
        :attr:`~kvplug_disk.fileio.Payload.access` when it moves that memory itself)."""
        nbytes = obj.nbytes
        io = self._io()
        if not length:
            return Payload([], o_direct, memoryview(b""))
        if o_direct or not io.moves_host_views:
            block = aligned_block(obj, length, own_memory=io.moves_host_views)
            if block is not None and io.accepts(block):  # the fast path: no copy at all
                self._scheme.using_block(obj)
                if writing and length > nbytes:
                    with access():
                        block[nbytes:].zero_()  # the block's padding: never leak stale memory
                payload = whole(block, nbytes, o_direct)
                payload.access = access
                return payload
            bounce = self._scheme.staging_block(length)
            if bounce is None and not io.moves_host_views:  # it takes no host views: a copy
                bounce = FreeListAllocator(length, alignment=BLOCK, pin=False).allocate(
                    (length,), torch.uint8, MemoryFormat.BINARY_BUFFER
                )
            if bounce is not None:
                raw = bounce.raw
                if writing:
                    try:
                        with access():
                            raw[:nbytes].copy_(obj.raw.reshape(-1))
                    except BaseException:
                        bounce.release()
                        raise
                    raw[nbytes:].zero_()
                payload = whole(raw, nbytes, o_direct)
                payload.bounce = bounce
                if not writing:
                    payload.staging = raw[:nbytes]
                return payload
        # Buffered I/O takes any host memory; device memory goes through a host copy.
        staging: torch.Tensor | None = None
        moves: Access = nullcontext
        if obj.device.type == "cpu":
            view = byte_view(obj.raw)
            moves = access
        elif writing:
            with access():
                view = byte_view(obj.raw.cpu())
        else:
            staging = torch.empty(nbytes, dtype=torch.uint8)
            view = byte_view(staging)
        buffers = [view]
        if writing and length > nbytes:
            buffers.append(memoryview(_ZEROS)[: length - nbytes])
        return Payload(buffers, False, view, staging=staging, access=moves)


__all__ = ["BOUNCE_POOL_SIZE", "BouncePool", "PayloadPlanner", "aligned_block", "whole"]
