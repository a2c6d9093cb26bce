"""The layout of one stored value: a header region of fixed length, then the payload::

    0               kvplug frame header (kvplug.frame.encode_header), H bytes: shape, dtype,
                    format, serde "naive", payload length, xxh3-64 of the payload, and its
                    own xxh32 (H is 64 for objects of up to 3 dimensions, 128 for up to 8)
    H               zero padding
    HEADER_REGION   the payload (HEADER_REGION = 128, the longest naive frame header)

Every value's header region has the same length, so a ``get_into`` reads header and payload
in one call, into a header slot and the caller's memory, with both sizes known beforehand;
the payload starts at a multiple of 64, so a ``get`` that reads a whole value into one
allocator block returns the payload in place. For objects of 4 to 8 dimensions (KV chunks)
these are the bytes kvplug-mooncake wrote before the region had a fixed length; a value of
1 to 3 dimensions written then (a 64-byte header) fails the length check and reads as a
damaged value (a miss, counted and removed).

Also here: the suspects of one read (:class:`Damage`) and the sizes values were seen with
(:class:`SizeHints`), which let a ``get`` read a value in one call without asking its size.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

from kvplug.errors import CorruptObject
from kvplug.frame import (
    MAX_NDIM,
    Buffer,
    FrameHeader,
    decode_header,
    encode_header,
    header_len,
    verify_payload,
)
from kvplug.keys import CacheKey
from kvplug.memory import Allocator, MemoryObj
from kvplug_mooncake.overlap import checksum

SERDE = "naive"
HEADER_REGION = header_len(MAX_NDIM, SERDE)
"""Bytes before the payload of every value: room for the longest naive frame header."""
_PADDING = bytes(HEADER_REGION)


def write_header_region(region: memoryview, obj: MemoryObj) -> None:
    """Write the header region of ``obj``'s value (its frame header, checksums included,
    then zeros) into ``region``, :data:`HEADER_REGION` bytes."""
    payload = obj.memoryview()
    header = encode_header(obj.shape, obj.dtype, obj.fmt, SERDE, payload, checksum(payload))
    region[: len(header)] = header
    region[len(header) : HEADER_REGION] = _PADDING[len(header) :]


def read_header_region(region: Buffer, name: str, stored_len: int) -> FrameHeader:
    """The frame header in the header region of the value of ``name``, checked against the
    value's stored length (``stored_len`` bytes); :class:`~kvplug.errors.CorruptObject`
    naming what is wrong otherwise."""
    view = memoryview(region).cast("B")[:HEADER_REGION]
    header = decode_header(view)
    if header.serde != SERDE:
        raise CorruptObject(
            f"the value of {name!r} holds a {header.serde!r} frame; mooncakestore:// writes "
            f"{SERDE!r} frames only."
        )
    if HEADER_REGION + header.payload_len != stored_len:
        raise CorruptObject(
            f"the frame header of {name!r} says {header.payload_len} payload bytes after a "
            f"{HEADER_REGION}-byte header region; {stored_len} bytes were stored (torn, or "
            "written by an earlier kvplug-mooncake, whose header took 64 bytes for objects of "
            "up to 3 dimensions)."
        )
    if view[header.header_len :] != _PADDING[header.header_len :]:
        raise CorruptObject(f"the padding of the header region of {name!r} is not zero.")
    return header


def object_of_value(
    name: str, block: MemoryObj, stored_len: int, allocator: Allocator
) -> MemoryObj | None:
    """The object whose value (its first ``stored_len`` bytes) ``block`` holds, checked
    (:class:`~kvplug.errors.CorruptObject`, ``block`` released, when it fails). The payload
    stays in place when ``block`` is memory of ``allocator`` that the value fills at least
    half of; otherwise it is copied into a new object of ``allocator`` (None when it is full)
    and ``block`` released, so that a small value read into a block sized for a larger one
    does not keep the whole block."""
    view = block.memoryview()
    try:
        header = read_header_region(view, name, stored_len)
        verify_payload(header, view[HEADER_REGION:stored_len], checksum)
    except CorruptObject:
        block.release()
        raise
    if block.allocator is allocator and 2 * stored_len >= block.nbytes:
        return block.reinterpret(HEADER_REGION, header.shape, header.dtype, header.fmt)
    try:
        obj = allocator.allocate(header.shape, header.dtype, header.fmt)
        if obj is not None:
            obj.raw.copy_(block.raw[HEADER_REGION:stored_len])
        return obj
    finally:
        block.release()


class Damage:
    """Frames that failed their checks in one read. A first failure is read again: Mooncake
    overwrites a value of the same size in place, so a read racing an overwrite can receive a
    mix of two values, which the checksum catches; only a frame that fails twice is damage."""

    def __init__(self) -> None:
        self._suspects: set[str] = set()
        self.found: dict[str, CorruptObject] = {}
        """The damaged values: name -> the second failure."""

    def confirmed(self, name: str, error: CorruptObject) -> bool:
        """Note a failed frame of ``name``: True the second time (damage), False the first."""
        if name in self._suspects:
            self.found[name] = error
            return True
        self._suspects.add(name)
        return False


class SizeHints:
    """The largest value seen (put or read) in each family of keys (the same model, worker,
    dtype and tags: keys whose chunks have one shape, but for a shorter last chunk).

    A ``get`` reads a value of a known family into a block of the family's size in one call:
    Mooncake writes a smaller value into it and reports its length, and refuses a larger one
    (-600), which is then read at its size, asked of the master. Without a hint a ``get``
    asks the size first: two calls. At most :attr:`LIMIT` families are kept, the oldest
    dropped first."""

    LIMIT = 1024

    def __init__(self) -> None:
        self._sizes: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def family(key: CacheKey) -> Hashable:
        return (key.namespace, key.dtype, key.tags)

    def size(self, family: Hashable) -> int | None:
        return self._sizes.get(family)

    def saw(self, family: Hashable, stored_len: int) -> None:
        with self._lock:
            known = self._sizes.get(family)
            if known is not None and known >= stored_len:
                return
            if known is None and len(self._sizes) >= self.LIMIT:
                del self._sizes[next(iter(self._sizes))]
            self._sizes[family] = stored_len


__all__ = [
    "HEADER_REGION",
    "Damage",
    "SizeHints",
    "object_of_value",
    "read_header_region",
    "write_header_region",
]
