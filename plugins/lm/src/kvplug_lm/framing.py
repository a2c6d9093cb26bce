"""Objects a serde transforms, on the ``lm://`` wire: what a put sends for an object, and how a
value holding a kvplug frame is read back.

With the serde ``naive`` an object travels as its own bytes, described by its own format, dtype
and shape (what LMCache's clients write and read). With any other serde it travels as a kvplug
frame (:func:`kvplug.frame.encode_frame`: a header naming the serde and the object's layout,
then the checksummed payload), described as LMCache's opaque bytes: format
:attr:`~kvplug.memory.MemoryFormat.BINARY`, dtype uint8, shape ``[frame_len]``.

A value described as ``BINARY`` that starts with the frame magic is read as a frame, whatever
serde the reader is configured with: the frame names its writer's serde. Any other ``BINARY``
value (an LMCache engine's, or an object of that format a ``naive`` client put) is read as its
own bytes by a ``naive`` reader, as before; a reader configured with another serde writes only
frames, so to it such a value is damage (a frame whose first bytes were overwritten looks the
same): a counted miss, deleted. A reader configured with an authenticated serde (``aesgcm``)
serves only what it sealed: to it every value that is not such a frame, whatever its format,
is damage.

Example, the value a ``zstd`` client puts for one object::

    >>> import torch
    >>> from kvplug.keys import CacheKey
    >>> from kvplug.memory import MemoryObj
    >>> from kvplug.serde import open_serde
    >>> obj = MemoryObj.from_tensor(torch.zeros(4096, dtype=torch.float16))
    >>> value = outgoing(obj, open_serde("zstd"), CacheKey("llama", 1, 0, 0x2A, "half"))
    >>> value.fmt.name, value.dtype, value.shape == (value.nbytes,), value.nbytes < obj.nbytes
    ('BINARY', torch.uint8, True, True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import xxhash

from kvplug.errors import CorruptObject, LayoutMismatch
from kvplug.frame import MAGIC, MIN_HEADER_LEN, FrameReceiver, encode_frame
from kvplug.memory import MemoryFormat
from kvplug.serde import NaiveSerde

if TYPE_CHECKING:
    from kvplug.keys import CacheKey
    from kvplug.memory import MemoryObj
    from kvplug.serde import Serde
    from kvplug_lm.connection import Connection, Hasher

Buffer = bytes | bytearray | memoryview

FRAMED_FORMAT = MemoryFormat.BINARY
"""The format a frame is described with on the wire: LMCache's opaque bytes of a serde."""
FRAMED_DTYPE = torch.uint8
NOT_A_FRAME = (
    "the value is not a kvplug frame (it lacks the frame magic): this client, configured with "
    "a serde other than naive, stores only frames, so the value was damaged, or another writer "
    "(an LMCache engine, a naive client) put it under the key"
)


class Outgoing(NamedTuple):
    """What a put sends for one object: the value's LMCache metadata and its bytes, in parts
    sent back to back (a view of the object's memory, valid while the caller holds it)."""

    fmt: MemoryFormat
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: tuple[bytes | memoryview, ...]
    nbytes: int

    def checksum(self) -> int:
        """xxh3-64 of the whole value (the extended mode's payload checksum)."""
        hasher = xxhash.xxh3_64()
        for part in self.parts:
            hasher.update(part)
        return hasher.intdigest()


def writes_frames(serde: Serde) -> bool:
    """Whether a client configured with ``serde`` puts frames: with any serde but naive."""
    return serde.name != NaiveSerde.name


def outgoing(obj: MemoryObj, serde: Serde, key: CacheKey) -> Outgoing:
    """The value stored for ``obj`` under ``key`` by a client configured with ``serde``: the
    object's own bytes with ``naive``, else its frame described as ``BINARY``. Raises what
    the serde raises for an object it refuses (``k16v8`` and a format that is not KV)."""
    if not writes_frames(serde):
        return Outgoing(obj.fmt, obj.dtype, obj.shape, (obj.memoryview(),), obj.nbytes)
    header, payload = encode_frame(obj, serde, key)
    body = memoryview(payload).cast("B")
    length = len(header) + body.nbytes
    return Outgoing(FRAMED_FORMAT, FRAMED_DTYPE, (length,), (header, body), length)


async def receive_frame(
    connection: Connection,
    length: int,
    receiver: FrameReceiver,
    hasher: Hasher | None,
    *,
    frames_only: bool,
) -> bytearray | None:
    """Read the start of a value of ``length`` bytes that may be a frame (``BINARY``), and
    the whole value when it is one: then ``receiver`` has taken it (header parsed, payload
    received into the memory it chose, or drained when it is damaged, unreadable here or has
    no room) and None is returned; :meth:`FrameReceiver.finish` gives the object or raises the
    damage. A value that is not a frame returns the bytes read so far, the rest of it still
    on the wire; with ``frames_only`` (a reader with a serde other than naive) it is drained
    and raises :class:`~kvplug.errors.CorruptObject`. ``hasher`` is fed every byte read but
    those drained (a miss needs no checksum)."""
    prefix = bytearray(min(length, MIN_HEADER_LEN))
    await connection.recv_into(memoryview(prefix), hasher)
    if not prefix.startswith(MAGIC):
        if frames_only:
            await connection.drain(length - len(prefix))
            raise CorruptObject(NOT_A_FRAME)
        return prefix
    try:
        receiver.start(length)
        header = prefix
        size = receiver.header_len(prefix)
        if size > len(prefix):
            rest = bytearray(size - len(prefix))
            await connection.recv_into(memoryview(rest), hasher)
            header = prefix + rest
        sink = receiver.take_header(header)
        if sink is None:
            await connection.drain(receiver.remaining)
        else:
            await connection.recv_into(sink, hasher)
    except BaseException:
        receiver.abandon()
        raise
    return None


async def receive_rest(
    connection: Connection, view: memoryview, prefix: Buffer, hasher: Hasher | None
) -> None:
    """Fill ``view`` with a value that is not a frame: the ``prefix`` :func:`receive_frame`
    read already, then the rest from the wire (fed to ``hasher``)."""
    start = memoryview(prefix).nbytes
    view[:start] = prefix
    await connection.recv_into(view[start:], hasher)


def finish_frame(receiver: FrameReceiver, dest: MemoryObj | None, name: str) -> MemoryObj | None:
    """The object of a frame :func:`receive_frame` received: a new one, or ``dest`` filled
    whole (``get_into``), or None for a miss (no room in the allocator). Raises
    :class:`~kvplug.errors.CorruptObject` (damage) or its
    :class:`~kvplug.errors.UnreadableObject` (a serde not installed here), and
    :class:`~kvplug.errors.LayoutMismatch` naming ``name`` when the object is not ``dest``'s
    size; ``dest`` is never left half-filled by a frame that does not decode."""
    mismatch = receiver.mismatch
    got = receiver.finish()
    if dest is not None and mismatch is not None:
        raise LayoutMismatch.between(
            name,
            (mismatch.shape, mismatch.dtype, mismatch.payload_len),
            (dest.shape, dest.dtype, dest.nbytes),
        )
    if got is None or dest is None:
        return got
    try:
        if got is not dest:
            if got.nbytes != dest.nbytes:
                raise LayoutMismatch.between(
                    name,
                    (got.shape, got.dtype, got.nbytes),
                    (dest.shape, dest.dtype, dest.nbytes),
                )
            dest.raw.copy_(got.raw)
    finally:
        got.release()  # the receiver's reference, also when it received into dest itself
    return dest


__all__ = [
    "FRAMED_DTYPE",
    "FRAMED_FORMAT",
    "NOT_A_FRAME",
    "Outgoing",
    "finish_frame",
    "outgoing",
    "receive_frame",
    "receive_rest",
    "writes_frames",
]
