"""The lm server's storage: objects in one preallocated buffer, LRU eviction, optional spill.

Every stored object is one block of a :class:`~kvplug.memory.FreeListAllocator` laid out as a
self-describing *record*: a :data:`RECORD` header (magic, mode, key length, meta length,
payload length, checksum), the key, the metadata the object arrived with, then the payload.
The payload is received straight into its block; a GET sends a memoryview of it. Because the
record describes itself, spilling is the block itself written to the spill tier (no copy, no
extra memory) and a record read back is checked against its key and checksum before it is
believed.

Memory is bounded by the allocator: a new object's block is allocated before its payload is
received, evicting least recently used entries until it fits (evicting more when the free
space is fragmented). An evicted entry that is being sent stays alive until the send ends
(reference counting); one being spilled stays readable until its write ends.

All methods run on the server's event loop thread (the allocator itself is thread-safe,
which the spill tier's I/O threads rely on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xxhash

from kvplug.index import EvictableIndex
from kvplug.keys import CacheKey
from kvplug.memory import FreeListAllocator, MemoryFormat, MemoryObj
from kvplug_lm import wire

if TYPE_CHECKING:
    from kvplug.backend import Backend

logger = logging.getLogger(__name__)

RECORD = struct.Struct("<4sBBHIQQ")
"""magic, record version, mode (:data:`PLAIN` or :data:`EXTENDED`), key length, meta length,
payload length, xxh3-64 checksum of the payload: 28 bytes; then the key, the meta, the
payload."""
RECORD_MAGIC = b"KVLR"
RECORD_VERSION = 1

PLAIN = 0
"""Stored by a plain (LMCache) client: the meta is :data:`PLAIN_META`."""
EXTENDED = 1
"""Stored by an extended (kvplug) client: the meta is :func:`kvplug_lm.wire.pack_meta`'s."""

PLAIN_META = struct.Struct("<6i")
"""fmt, dtype code, shape[0..3], exactly as a plain PUT header carried them."""

SPILL_MODEL = "kvplug-lm"
"""The model name of the spill tier's keys (:func:`spill_key`)."""


def spill_key(key: bytes) -> CacheKey:
    """The spill tier's key of an lm key: its xxh3-128 digest (the full key is stored inside
    the record and compared on read, so a digest collision reads as a miss)."""
    return CacheKey(SPILL_MODEL, 1, 0, xxhash.xxh3_128_digest(key))


@dataclass(slots=True)
class Entry:
    """One stored object: its record block and where its parts lie."""

    key: bytes
    block: MemoryObj
    """The whole record (one allocator block, a flat uint8 object)."""
    mode: int
    meta: bytes
    payload_offset: int
    payload_len: int
    checksum: int

    @property
    def payload(self) -> memoryview:
        return self.block.memoryview()[self.payload_offset : self.payload_offset + self.payload_len]

    def plain_meta(self) -> tuple[int, int, tuple[int, int, int, int]] | None:
        """fmt, dtype code and four dims for a plain GET reply; None when the object cannot
        be described in a plain header (more than four dims, a dim or length beyond int32, a
        dtype LMCache has no code for)."""
        if self.mode == PLAIN:
            fmt, dtype, *dims = PLAIN_META.unpack(self.meta)
            return fmt, dtype, (dims[0], dims[1], dims[2], dims[3])
        meta = wire.unpack_meta(self.meta)
        if (
            len(meta.shape) > 4
            or any(d > wire.INT32_MAX for d in meta.shape)
            or meta.dtype not in wire.PLAIN_DTYPE_CODES
            or self.payload_len > wire.INT32_MAX
        ):
            return None
        return meta.fmt, meta.dtype, wire.pad_shape(meta.shape)

    def ext_meta(self) -> bytes:
        """The meta block of an extended GET reply (a plain object's shape loses its zero
        padding)."""
        if self.mode == EXTENDED:
            return self.meta
        fmt, dtype, *dims = PLAIN_META.unpack(self.meta)
        return wire.pack_meta(wire.Meta(fmt, dtype, wire.strip_shape(dims)))


def record_header_len(key: bytes, meta: bytes) -> int:
    return RECORD.size + len(key) + len(meta)


def parse_record(block: MemoryObj, expected_key: bytes | None = None) -> Entry | None:
    """The entry a record block holds, or None when it is not a whole, intact record (of
    ``expected_key``, when given)."""
    view = block.memoryview()
    if len(view) < RECORD.size:
        return None
    magic, version, mode, key_len, meta_len, payload_len, crc = RECORD.unpack_from(view)
    offset = RECORD.size + key_len + meta_len
    if (
        magic != RECORD_MAGIC
        or version != RECORD_VERSION
        or mode not in (PLAIN, EXTENDED)
        or offset + payload_len != len(view)
    ):
        return None
    key = bytes(view[RECORD.size : RECORD.size + key_len])
    if expected_key is not None and key != expected_key:
        return None
    meta = bytes(view[RECORD.size + key_len : offset])
    if wire.checksum(view[offset:]) != crc:
        return None
    return Entry(key, block, mode, meta, offset, payload_len, crc)


class MemStore:
    """Keys to records in one buffer of ``capacity`` bytes, least recently used out first,
    evicted records written to ``spill`` (a kvplug backend) when one is given."""

    def __init__(self, capacity: int, spill: Backend | None = None) -> None:
        self.allocator = FreeListAllocator(
            capacity, pin=False, sized_by="kvplug lm-server --max-memory"
        )
        self.capacity = self.allocator.capacity
        self.index: EvictableIndex[bytes, Entry] = EvictableIndex(1 << 62, "lru")
        self.spill = spill
        self.spilling: dict[bytes, Entry] = {}
        """Evicted entries whose spill write is in flight: still readable, still in memory."""
        self.spilled_sizes: dict[bytes, int] = {}
        """Record sizes of keys this process spilled (a read allocates exactly that)."""
        self._spill_tasks: set[asyncio.Task[None]] = set()
        self._spill_done = asyncio.Event()
        self.counters: Counter[str] = Counter()

    # -- reading ---------------------------------------------------------------------------

    def lookup(self, key: bytes) -> Entry | None:
        """The entry in memory (a use for LRU), or one being spilled; None otherwise."""
        entry = self.index.hit(key)
        if entry is None:
            entry = self.spilling.get(key)
        return entry

    def __contains__(self, key: bytes) -> bool:
        return key in self.index or key in self.spilling

    def keys(self) -> Iterator[bytes]:
        yield from list(self.index)
        yield from [k for k in self.spilling if k not in self.index]

    @property
    def objects(self) -> int:
        return len(self.index)

    @property
    def bytes_stored(self) -> int:
        return self.index.bytes_held

    async def spill_contains(self, key: bytes) -> bool:
        if self.spill is None:
            return False
        try:
            return await self.spill.contains(spill_key(key))
        except Exception as error:
            self._spill_failed("contains", key, error)
            return False

    async def load_spilled(self, key: bytes) -> Entry | None:
        """Bring ``key`` back from the spill tier into memory (verified); None for a miss."""
        if self.spill is None:
            return None
        ckey = spill_key(key)
        block: MemoryObj | None = None
        try:
            size = self.spilled_sizes.get(key)
            if size is not None:
                block = await self.allocate(size)
                if block is None:
                    return None
                if not await self.spill.get_into(ckey, block):
                    block.release()
                    self.spilled_sizes.pop(key, None)  # gone, or damaged and removed
                    return None
            else:
                block = await self.spill.get(ckey)
                if block is None:
                    return None
        except Exception as error:
            if block is not None:
                block.release()
            self._spill_failed("get", key, error)
            return None
        entry = parse_record(block, key)
        if entry is None:
            block.release()
            self.counters["spill_corrupt"] += 1
            self._forget_spilled(key)  # a damaged record is a miss, and it goes
            return None
        if key in self:  # stored anew while the read was in flight: the newer one wins
            block.release()
            return self.lookup(key)
        self.counters["spill_hits"] += 1
        self._insert(entry)
        return entry

    # -- writing ---------------------------------------------------------------------------

    async def allocate(self, nbytes: int) -> MemoryObj | None:
        """A block of ``nbytes`` bytes, evicting least recently used entries (and waiting for
        their spill writes) until it fits; None when nothing more can go."""
        if nbytes > self.capacity:
            return None
        while True:
            block = self.allocator.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY_BUFFER)
            if block is not None:
                return block
            if self.index.evict_one(self._evict):
                continue
            if not self._spill_tasks:
                return None
            self._spill_done.clear()
            await self._spill_done.wait()

    def new_record(
        self, key: bytes, mode: int, meta: bytes, payload_len: int, block: MemoryObj
    ) -> Entry:
        """Write the record header of a block :meth:`allocate` gave (checksum still 0)."""
        view = block.memoryview()
        RECORD.pack_into(
            view, 0, RECORD_MAGIC, RECORD_VERSION, mode, len(key), len(meta), payload_len, 0
        )
        offset = RECORD.size
        view[offset : offset + len(key)] = key
        offset += len(key)
        view[offset : offset + len(meta)] = meta
        offset += len(meta)
        return Entry(key, block, mode, meta, offset, payload_len, 0)

    def commit(self, entry: Entry, checksum: int) -> None:
        """Make a fully received entry visible, replacing any older object of its key."""
        entry.checksum = checksum
        struct.pack_into("<Q", entry.block.memoryview(), RECORD.size - 8, checksum)
        self._insert(entry)
        if self.spill is not None and entry.key in self.spilled_sizes:
            self._forget_spilled(entry.key)

    def _insert(self, entry: Entry) -> None:
        old = self.index.put(entry.key, entry, entry.block.phy_size)
        if old is not None:
            old.block.release()

    async def delete(self, key: bytes) -> bool:
        """Remove ``key`` from memory and the spill tier; whether it was stored anywhere."""
        found = False
        entry = self.index.remove(key)
        if entry is not None:
            entry.block.release()
            found = True
        if self.spilling.pop(key, None) is not None:
            found = True  # its spill task releases the block and removes what it wrote
        if self.spill is not None:
            self.spilled_sizes.pop(key, None)
            try:
                found = await self.spill.remove(spill_key(key)) or found
            except Exception as error:
                self._spill_failed("remove", key, error)
        return found

    # -- eviction and spill ----------------------------------------------------------------

    def _evict(self, key: bytes, entry: Entry) -> bool:
        self.counters["evictions"] += 1
        if self.spill is None:
            entry.block.release()
            return True
        previous = self.spilling.pop(key, None)
        if previous is not None:
            previous.block.release()
        self.spilling[key] = entry
        task = asyncio.get_running_loop().create_task(self._spill_one(entry))
        self._spill_tasks.add(task)
        task.add_done_callback(self._spill_tasks.discard)
        return True

    async def _spill_one(self, entry: Entry) -> None:
        assert self.spill is not None
        ckey = spill_key(entry.key)
        try:
            await self.spill.put(ckey, entry.block)
            if self.spilling.get(entry.key) is entry:
                self.counters["spilled"] += 1
                self.spilled_sizes[entry.key] = len(entry.block.memoryview())
            elif entry.key not in self.spilling:  # deleted meanwhile: what was written is stale
                await self.spill.remove(ckey)
        except Exception as error:
            self._spill_failed("put", entry.key, error)
        finally:
            if self.spilling.get(entry.key) is entry:
                del self.spilling[entry.key]
            entry.block.release()
            self._spill_done.set()

    def _forget_spilled(self, key: bytes) -> None:
        """The spilled copy of ``key`` is stale (a newer one is in memory) or damaged: drop it."""
        self.spilled_sizes.pop(key, None)
        spill = self.spill
        if spill is None:
            return

        async def remove() -> None:
            try:
                await spill.remove(spill_key(key))
            except Exception as error:
                self._spill_failed("remove", key, error)

        task = asyncio.get_running_loop().create_task(remove())
        self._spill_tasks.add(task)
        task.add_done_callback(self._spill_tasks.discard)

    def _spill_failed(self, operation: str, key: bytes, error: Exception) -> None:
        self.counters["spill_errors"] += 1
        logger.warning(
            "spill %s of key %r failed: %s: %s",
            operation,
            key[:80].decode(errors="replace"),
            type(error).__name__,
            error,
        )

    async def close(self) -> None:
        """Finish the spill writes in flight, close the spill tier, release every object."""
        if self._spill_tasks:
            await asyncio.gather(*list(self._spill_tasks), return_exceptions=True)
        for entry in self.index.clear():
            entry.block.release()
        if self.spill is not None:
            with contextlib.suppress(Exception):
                await self.spill.close()


__all__ = [
    "EXTENDED",
    "PLAIN",
    "PLAIN_META",
    "RECORD",
    "Entry",
    "MemStore",
    "parse_record",
    "spill_key",
]
