"""The byte layout of one stored object, for stores that keep bytes.

A frame is a self-describing header followed by the payload. Every header field is covered by a
header checksum and the payload by its own xxh3-64 checksum, so a torn, truncated or altered
frame is detected and raises :class:`~kvplug.errors.CorruptObject` instead of being served.

Layout (little-endian)::

    0   magic            4s   b"KVPF"
    4   version          u8   1
    5   format           u8   MemoryFormat
    6   dtype code       u8   kvplug.memory.DTYPE_CODES
    7   ndim             u8   <= 8
    8   serde name len   u8
    9   reserved         3    zero
    12  header length    u32  bytes before the payload
    16  payload length   u64
    24  payload checksum u64  xxh3-64 of the payload
    32  shape            ndim x u64
    ..  serde name       ascii
    ..  zero padding          so that the header length is a multiple of 64
    ..  header checksum  u32  xxh32 of every header byte before it (the header's last 4 bytes)

The padding puts the payload at a 64-byte boundary after the header, so a store that reads a
whole frame into allocator memory can use the payload in place.

Example::

    >>> import torch
    >>> from kvplug.frame import decode_frame, encode_frame
    >>> from kvplug.memory import FreeListAllocator, MemoryObj
    >>> obj = MemoryObj.from_tensor(torch.arange(8, dtype=torch.float32))
    >>> data = b"".join(encode_frame(obj))
    >>> copy = decode_frame(data, FreeListAllocator(1 << 16))
    >>> torch.equal(copy.tensor, obj.tensor)
    True
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import xxhash

from kvplug.errors import CorruptObject
from kvplug.memory import DTYPES_BY_CODE, Allocator, MemoryFormat, MemoryObj, dtype_code
from kvplug.serde import Serde, get_serde

MAGIC = b"KVPF"
VERSION = 1
MAX_NDIM = 8
_FIXED = struct.Struct("<4sBBBBB3xIQQ")
_HEADER_CHECKSUM = struct.Struct("<I")
HEADER_ALIGNMENT = 64
MIN_HEADER_LEN = HEADER_ALIGNMENT


def _header_len(ndim: int, serde_len: int) -> int:
    unpadded = _FIXED.size + 8 * ndim + serde_len + _HEADER_CHECKSUM.size
    return -(-unpadded // HEADER_ALIGNMENT) * HEADER_ALIGNMENT


Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class FrameHeader:
    """What a frame says about its payload."""

    fmt: MemoryFormat
    dtype: torch.dtype
    shape: tuple[int, ...]
    serde: str
    payload_len: int
    payload_checksum: int
    header_len: int

    @property
    def frame_len(self) -> int:
        return self.header_len + self.payload_len

    @property
    def nbytes(self) -> int:
        """Logical size of the decoded object."""
        return math.prod(self.shape) * self.dtype.itemsize


def payload_checksum(payload: Buffer) -> int:
    return int(xxhash.xxh3_64_intdigest(payload))


def encode_header(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    fmt: MemoryFormat,
    serde: str,
    payload: Buffer,
    checksum: int | None = None,
) -> bytes:
    """The header for ``payload``, checksums included. ``checksum`` is the payload's
    :func:`payload_checksum` when the caller computed it already (for instance while the
    payload was being written)."""
    if len(shape) > MAX_NDIM:
        raise CorruptObject(f"a frame holds at most {MAX_NDIM} dimensions, got shape {shape}.")
    serde_name = serde.encode("ascii")
    header_len = _header_len(len(shape), len(serde_name))
    body = (
        _FIXED.pack(
            MAGIC,
            VERSION,
            int(fmt),
            dtype_code(dtype),
            len(shape),
            len(serde_name),
            header_len,
            memoryview(payload).nbytes,
            payload_checksum(payload) if checksum is None else checksum,
        )
        + struct.pack(f"<{len(shape)}Q", *shape)
        + serde_name
    )
    body += bytes(header_len - _HEADER_CHECKSUM.size - len(body))
    return body + _HEADER_CHECKSUM.pack(xxhash.xxh32_intdigest(body))


def encode_frame(obj: MemoryObj, serde: Serde | None = None) -> tuple[bytes, Buffer]:
    """``(header, payload)`` for ``obj``; write them back to back. The payload may be a
    zero-copy view of ``obj``'s memory, valid while the caller holds ``obj``."""
    serde = serde or get_serde("naive")
    payload = serde.encode(obj)
    return encode_header(obj.shape, obj.dtype, obj.fmt, serde.name, payload), payload


def decode_header(data: Buffer) -> FrameHeader:
    """Parse and verify the header at the start of ``data`` (the payload is not checked)."""
    view = memoryview(data).cast("B")
    if view.nbytes < MIN_HEADER_LEN:
        raise CorruptObject(f"frame truncated: {view.nbytes} bytes, a header needs more.")
    magic, version, fmt, code, ndim, serde_len, header_len, payload_len, checksum = (
        _FIXED.unpack_from(view)
    )
    if magic != MAGIC:
        raise CorruptObject(f"not a kvplug frame: magic {bytes(magic)!r}, expected {MAGIC!r}.")
    expected_len = _header_len(ndim, serde_len)
    if ndim > MAX_NDIM or header_len != expected_len or view.nbytes < header_len:
        raise CorruptObject(
            f"frame header is inconsistent or truncated (ndim {ndim}, header length "
            f"{header_len}, {view.nbytes} bytes available)."
        )
    (stored_header_checksum,) = _HEADER_CHECKSUM.unpack_from(view, header_len - 4)
    if xxhash.xxh32_intdigest(view[: header_len - 4]) != stored_header_checksum:
        raise CorruptObject("frame header checksum mismatch: the header was altered or torn.")
    if version != VERSION:
        raise CorruptObject(
            f"frame version {version} is not readable by this kvplug (reads version {VERSION}); "
            "upgrade kvplug or clear the store."
        )
    if code not in DTYPES_BY_CODE:
        raise CorruptObject(f"frame has unknown dtype code {code}.")
    try:
        memory_format = MemoryFormat(fmt)
    except ValueError:
        raise CorruptObject(f"frame has unknown memory format {fmt}.") from None
    shape = struct.unpack_from(f"<{ndim}Q", view, _FIXED.size)
    serde_start = _FIXED.size + 8 * ndim
    try:
        serde = bytes(view[serde_start : serde_start + serde_len]).decode("ascii")
    except UnicodeDecodeError:
        raise CorruptObject("frame serde name is not ASCII.") from None
    return FrameHeader(
        memory_format, DTYPES_BY_CODE[code], shape, serde, payload_len, checksum, header_len
    )


def verify_payload(header: FrameHeader, payload: Buffer) -> None:
    """Raise :class:`CorruptObject` unless ``payload`` is exactly the header's payload."""
    length = memoryview(payload).nbytes
    if length != header.payload_len:
        raise CorruptObject(
            f"frame payload has {length} bytes, its header says {header.payload_len} "
            "(truncated or torn)."
        )
    if payload_checksum(payload) != header.payload_checksum:
        raise CorruptObject("frame payload checksum mismatch: the stored bytes were altered.")


def decode_frame(data: Buffer, allocator: Allocator) -> MemoryObj | None:
    """A new object decoded from a whole frame, or ``None`` when ``allocator`` is full.

    Raises :class:`CorruptObject` when the frame is damaged in any way; the one copy made is the
    payload into allocator memory.
    """
    view = memoryview(data).cast("B")
    header = decode_header(view)
    if view.nbytes != header.frame_len:
        raise CorruptObject(
            f"frame is {view.nbytes} bytes, its header says {header.frame_len} (truncated or torn)."
        )
    return decode_payload(header, view[header.header_len :], allocator)


def decode_payload(header: FrameHeader, payload: Buffer, allocator: Allocator) -> MemoryObj | None:
    """A new object from the payload that ``header`` describes, verified first; ``None`` when
    ``allocator`` is full. Raises :class:`CorruptObject` when the payload does not match."""
    view = memoryview(payload).cast("B")
    verify_payload(header, view)
    serde = get_serde(header.serde)
    obj = allocator.allocate(header.shape, header.dtype, header.fmt)
    if obj is None:
        return None
    try:
        serde.decode(view, obj)
    except BaseException:
        obj.release()
        raise
    return obj


__all__ = [
    "MAGIC",
    "MIN_HEADER_LEN",
    "VERSION",
    "FrameHeader",
    "decode_frame",
    "decode_header",
    "decode_payload",
    "encode_frame",
    "encode_header",
    "payload_checksum",
    "verify_payload",
]
