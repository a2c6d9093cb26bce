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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from kvplug.errors import ConfigError, CorruptObject, UnreadableObject
from kvplug.keys import CacheKey
from kvplug.memory import (
    DTYPES_BY_CODE,
    Allocator,
    MemoryFormat,
    MemoryObj,
    dtype_code,
    nbytes_of,
)
from kvplug.serde import Serde, get_serde

MAGIC = b"KVPF"
VERSION = 1
MAX_NDIM = 8
_FIXED = struct.Struct("<4sBBBBB3xIQQ")
_HEADER_CHECKSUM = struct.Struct("<I")
HEADER_ALIGNMENT = 64
MIN_HEADER_LEN = HEADER_ALIGNMENT
HASH_STEP = 1 << 20
""":meth:`FrameReceiver.received` hashes in steps of at least this many bytes: few enough calls
to cost nothing, and the bytes still in the CPU's caches."""


def _header_len(ndim: int, serde_len: int) -> int:
    unpadded = _FIXED.size + 8 * ndim + serde_len + _HEADER_CHECKSUM.size
    return -(-unpadded // HEADER_ALIGNMENT) * HEADER_ALIGNMENT


def header_len(ndim: int, serde: str = "naive") -> int:
    """Bytes the header of a frame of an ``ndim``-dimensional object takes: a store that keeps
    the header apart from the payload (in a buffer of its own) sizes that buffer with it."""
    return _header_len(ndim, len(serde.encode("ascii")))


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


def encode_frame(
    obj: MemoryObj, serde: Serde | None = None, key: CacheKey | None = None
) -> tuple[bytes, Buffer]:
    """``(header, payload)`` for ``obj`` stored under ``key``; write them back to back. The
    payload may be a zero-copy view of ``obj``'s memory, valid while the caller holds ``obj``."""
    serde = serde or get_serde("naive")
    payload = serde.encode(obj, key)
    return encode_header(obj.shape, obj.dtype, obj.fmt, serde.name, payload), payload


def reading_serde(written_with: str, configured: Serde | None) -> Serde:
    """The serde that decodes a frame written with the serde named ``written_with``, for a
    reader configured with ``configured``: that instance (with its options and keys) when the
    names match, else the shared one of that name.

    Raises :class:`CorruptObject` for a frame of another serde when ``configured`` is
    authenticated (its store holds only what it sealed), and
    :class:`~kvplug.errors.UnreadableObject` when the serde is not installed here or needs
    options this reader lacks."""
    if configured is not None and written_with == configured.name:
        return configured
    if configured is not None and configured.authenticated:
        raise CorruptObject(
            f"frame written with serde {written_with!r}, but this store is sealed with "
            f"{configured.name!r}, which reads only frames it wrote: a value that is not "
            "sealed was not written by this configuration and is not served."
        )
    try:
        return get_serde(written_with)
    except ConfigError as error:
        raise UnreadableObject(
            f"frame written with serde {written_with!r}, which this reader cannot decode: {error}"
        ) from None


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


def verify_payload(
    header: FrameHeader, payload: Buffer, digest: Callable[[Buffer], int] | None = None
) -> None:
    """Raise :class:`CorruptObject` unless ``payload`` is exactly the header's payload.
    ``digest`` computes :func:`payload_checksum` another way (a store that hashes in pieces)."""
    length = memoryview(payload).nbytes
    if length != header.payload_len:
        raise CorruptObject(
            f"frame payload has {length} bytes, its header says {header.payload_len} "
            "(truncated or torn)."
        )
    if (digest or payload_checksum)(payload) != header.payload_checksum:
        raise CorruptObject("frame payload checksum mismatch: the stored bytes were altered.")


def decode_frame(
    data: Buffer,
    allocator: Allocator,
    *,
    serde: Serde | None = None,
    key: CacheKey | None = None,
) -> MemoryObj | None:
    """A new object decoded from a whole frame stored under ``key``, or ``None`` when
    ``allocator`` is full. ``serde`` is the reader's configured serde (:func:`reading_serde`).

    Raises :class:`CorruptObject` when the frame is damaged in any way; the one copy made is the
    payload into allocator memory.
    """
    view = memoryview(data).cast("B")
    header = decode_header(view)
    if view.nbytes != header.frame_len:
        raise CorruptObject(
            f"frame is {view.nbytes} bytes, its header says {header.frame_len} (truncated or torn)."
        )
    return decode_payload(header, view[header.header_len :], allocator, serde=serde, key=key)


def decode_payload(
    header: FrameHeader,
    payload: Buffer,
    allocator: Allocator,
    *,
    serde: Serde | None = None,
    key: CacheKey | None = None,
) -> MemoryObj | None:
    """A new object from the payload that ``header`` describes, stored under ``key``, verified
    first; ``None`` when ``allocator`` is full. Raises :class:`CorruptObject` when the payload
    does not match. ``serde`` is the reader's configured serde (:func:`reading_serde`)."""
    view = memoryview(payload).cast("B")
    verify_payload(header, view)
    decoder = reading_serde(header.serde, serde)
    obj = allocator.allocate(header.shape, header.dtype, header.fmt)
    if obj is None:
        return None
    try:
        decoder.decode(view, obj, key)
    except BaseException:
        obj.release()
        raise
    return obj


MAX_HEADER_LEN = 4096
"""More header bytes than any frame has (the largest is 384); a longer claim is damage."""
_HEADER_LEN_FIELD = struct.Struct("<I")
_HEADER_LEN_OFFSET = 12


class FrameReceiver:
    """One stored frame, received piece by piece straight into the memory it ends up in: the
    zero-copy read of a byte store (:meth:`kvplug.backend.BytesBackend.receive_frames`).

    A transport that learns a value's length before its bytes (a RESP bulk string, a file's
    size, an RPC's length field) drives it in four steps:

    1. :meth:`start` with the value's length (never called for a missing key: a miss);
    2. :meth:`header_len` of the value's first bytes (at least ``MIN_HEADER_LEN`` of them, or
       the whole value when shorter) says how many bytes the header takes;
    3. :meth:`take_header` with those bytes returns the memory the next :attr:`remaining`
       bytes go to, or ``None`` when they are to be read and dropped (the value is damaged, is
       not the caller's size (:attr:`mismatch`), or the allocator is full);
    4. :meth:`finish` verifies the payload's checksum and returns the object.

    Between 3 and 4 the transport may call :meth:`received` as the payload arrives: the checksum
    is then computed piece by piece while the bytes are still in the CPU's caches, overlapping
    the transfer, and :meth:`finish` only compares it.

    With ``into`` (a caller's :class:`~kvplug.memory.MemoryObj` in host memory), a ``naive``
    payload of exactly its size is received into the caller's memory: no copy at all. ``serde``
    is the reader's configured serde and ``key`` the key the value is stored under: another
    serde's payload is decoded with them (:func:`reading_serde`).
    Whoever drives a receiver that may be written into later (a socket's buffer) stops those
    writes before calling :meth:`abandon` or letting go of the result.

    Example (what :meth:`receive` does with a whole value)::

        >>> import torch
        >>> from kvplug.frame import FrameReceiver, encode_frame
        >>> from kvplug.memory import FreeListAllocator, MemoryObj
        >>> value = b"".join(encode_frame(MemoryObj.from_tensor(torch.arange(4.0))))
        >>> receiver = FrameReceiver(FreeListAllocator(1 << 16))
        >>> receiver.start(len(value))
        >>> size = receiver.header_len(value)
        >>> sink = receiver.take_header(value[:size])
        >>> sink[:] = value[size:]
        >>> receiver.finish().tensor.tolist()
        [0.0, 1.0, 2.0, 3.0]
    """

    __slots__ = (
        "_allocator",
        "_hashed",
        "_hasher",
        "_obj",
        "_scratch",
        "_serde",
        "_sink",
        "damage",
        "header",
        "into",
        "key",
        "length",
        "mismatch",
        "remaining",
    )

    def __init__(
        self,
        allocator: Allocator,
        into: MemoryObj | None = None,
        *,
        serde: Serde | None = None,
        key: CacheKey | None = None,
    ) -> None:
        self._allocator = allocator
        self._serde = serde
        self.key = key
        self.into = into
        self.length: int | None = None
        """The stored value's length, once :meth:`start` ran; ``None`` is a miss."""
        self.header: FrameHeader | None = None
        self.damage: CorruptObject | None = None
        self.mismatch: FrameHeader | None = None
        """The header of a sound value of another size than ``into``: its bytes are dropped,
        and the reader raises :class:`~kvplug.errors.LayoutMismatch`."""
        self.remaining = 0
        """Bytes of the value after the header, to be written into the sink (or dropped)."""
        self._obj: MemoryObj | None = None
        self._scratch: bytearray | None = None
        self._sink: memoryview | None = None
        self._hasher: xxhash.xxh3_64 | None = None
        self._hashed = 0

    def start(self, length: int) -> None:
        """The key is stored, as a value of ``length`` bytes."""
        self.length = length

    def header_len(self, prefix: Buffer) -> int:
        """How many leading bytes of the value the header takes, given at least its first
        ``min(length, MIN_HEADER_LEN)`` bytes; never more than the value."""
        length = self._length()
        view = memoryview(prefix).cast("B")
        if length < MIN_HEADER_LEN or view.nbytes < MIN_HEADER_LEN:
            return min(length, MIN_HEADER_LEN)
        (claimed,) = _HEADER_LEN_FIELD.unpack_from(view, _HEADER_LEN_OFFSET)
        return min(length, max(MIN_HEADER_LEN, min(int(claimed), MAX_HEADER_LEN)))

    def take_header(self, data: Buffer) -> memoryview | None:
        """Parse the header (the :meth:`header_len` first bytes of the value) and return where
        the next :attr:`remaining` bytes go, or ``None`` to read and drop them."""
        length = self._length()
        view = memoryview(data).cast("B")
        try:
            header = decode_header(view)
            if header.frame_len != length:
                raise CorruptObject(
                    f"frame is {length} bytes, its header says {header.frame_len} (truncated "
                    "or torn)."
                )
            reading_serde(header.serde, self._serde)
            if header.serde == "naive" and header.payload_len != nbytes_of(
                header.shape, header.dtype
            ):
                raise CorruptObject(
                    f"naive payload has {header.payload_len} bytes but shape {header.shape} "
                    f"{header.dtype} needs {nbytes_of(header.shape, header.dtype)}."
                )
        except CorruptObject as error:
            self.damage = error
            self.remaining = length - view.nbytes
            return None
        self.header = header
        self.remaining = header.payload_len
        if header.serde == "naive":
            into = self.into
            if into is not None and into.device.type == "cpu":
                if into.nbytes != header.payload_len:
                    self.mismatch = header
                    return None
                self._obj = into.retain()
                return self._hash_as_received(into.memoryview())
            obj = self._allocator.allocate(header.shape, header.dtype, header.fmt)
            if obj is None:
                return None  # the allocator is full: a miss
            if obj.device.type == "cpu":
                self._obj = obj
                return self._hash_as_received(obj.memoryview())
            obj.release()  # memory a transport cannot write: decoded from a scratch copy
        self._scratch = bytearray(header.payload_len)
        return memoryview(self._scratch)

    def _hash_as_received(self, sink: memoryview) -> memoryview:
        self._sink, self._hasher, self._hashed = sink, xxhash.xxh3_64(), 0
        return sink

    def received(self, end: int) -> None:
        """The first ``end`` bytes of the sink that :meth:`take_header` returned hold their
        final values and will not be written again: hash those not hashed yet (at least
        ``HASH_STEP`` of them, or the last). Optional; without it :meth:`finish` hashes the
        whole payload. Called with every ``end`` the sink's writes reach, in order::

            >>> import torch
            >>> from kvplug.frame import FrameReceiver, encode_frame
            >>> from kvplug.memory import FreeListAllocator, MemoryObj
            >>> value = b"".join(encode_frame(MemoryObj.from_tensor(torch.ones(1 << 20))))
            >>> receiver = FrameReceiver(FreeListAllocator(8 << 20))
            >>> receiver.start(len(value))
            >>> size = receiver.header_len(value)
            >>> sink = receiver.take_header(value[:size])
            >>> for end in range(1 << 16, receiver.remaining + 1, 1 << 16):
            ...     sink[end - (1 << 16) : end] = value[size + end - (1 << 16) : size + end]
            ...     receiver.received(end)
            >>> receiver.finish().tensor.sum().item()
            1048576.0
        """
        hasher, sink = self._hasher, self._sink
        if hasher is None or sink is None:
            return  # dropped bytes, or a payload decoded from a scratch copy
        if not self._hashed <= end <= self.remaining:
            raise ValueError(
                f"received({end}) after {self._hashed} of {self.remaining} bytes: the end must "
                "grow and stay within the payload."
            )
        if end - self._hashed >= HASH_STEP or end == self.remaining:
            hasher.update(sink[self._hashed : end])
            self._hashed = end

    def receive(self, value: Buffer) -> None:
        """All of a value at once: :meth:`start`, the header, and the payload copied in."""
        view = memoryview(value).cast("B")
        self.start(view.nbytes)
        size = self.header_len(view)
        sink = self.take_header(view[:size])
        if sink is not None:
            sink[:] = view[size : size + self.remaining]

    def finish(self) -> MemoryObj | None:
        """The object received (one reference, the caller's; ``into`` itself when the payload
        went there), or ``None`` for a miss. Raises :class:`CorruptObject` for damage, after
        which the stored value should be counted and deleted."""
        if self.damage is not None:
            raise self.damage
        header = self.header
        if header is None:
            return None
        obj, self._obj = self._obj, None
        hasher, self._hasher, self._sink = self._hasher, None, None
        if obj is not None:
            digest = None
            if hasher is not None and self._hashed == header.payload_len:
                streamed = hasher.intdigest()
                digest = lambda _payload: streamed  # noqa: E731
            try:
                verify_payload(header, obj.memoryview()[: header.payload_len], digest)
            except BaseException:
                obj.release()
                raise
            return obj
        scratch, self._scratch = self._scratch, None
        if scratch is None:
            return None
        return decode_payload(header, scratch, self._allocator, serde=self._serde, key=self.key)

    def abandon(self) -> None:
        """Let go of what was received and start afresh, as if nothing had arrived: the read
        failed, was cancelled, or is about to be sent again."""
        obj, self._obj, self._scratch = self._obj, None, None
        self._sink = self._hasher = None
        self._hashed = 0
        self.length = self.header = self.damage = None
        self.remaining = 0
        if obj is not None:
            obj.release()

    def _length(self) -> int:
        if self.length is None:
            raise RuntimeError("FrameReceiver.start(length) must be called first.")
        return self.length


__all__ = [
    "MAGIC",
    "MAX_HEADER_LEN",
    "MIN_HEADER_LEN",
    "VERSION",
    "FrameHeader",
    "FrameReceiver",
    "decode_frame",
    "decode_header",
    "decode_payload",
    "encode_frame",
    "encode_header",
    "header_len",
    "payload_checksum",
    "reading_serde",
    "verify_payload",
]
