"""How an object is stored as one InfiniStore value, and how a value read is told intact.

Each object is **one** InfiniStore value: the kvplug frame (header and checksummed payload,
:mod:`kvplug.frame`) followed by a 16-byte end marker holding the frame's length. An RDMA read
tells the client neither whether the whole value arrived nor how long it was (the server writes
the stored bytes into a larger region and answers "done"), so the end marker is how a cut value
is told from an intact one: it must stand exactly where the header says the frame ends, and the
client wipes it from its staging memory after every transfer (:func:`wipe_end`), so a stale copy
can never stand in for it. A damaged value is handed to its receiver as damage (:func:`feed`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from kvplug.backend import Buffer
from kvplug.errors import CorruptObject
from kvplug.frame import MAX_HEADER_LEN, FrameReceiver, decode_header

END_MARKER = struct.Struct("<8sQ")
"""What follows the frame in every stored value: a magic and the frame's length."""
END_MAGIC = b"KVPFEND1"
_NO_END = bytes(END_MARKER.size)


def end_marker(frame_len: int) -> bytes:
    """The 16 bytes stored after a frame of ``frame_len`` bytes."""
    return END_MARKER.pack(END_MAGIC, frame_len)


def joined(parts: Sequence[Buffer], size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    value = np.empty(size, dtype=np.uint8)
    fill(memoryview(cast(Any, value)).cast("B"), parts)
    return value


def fill(into: memoryview, parts: Sequence[Buffer]) -> None:
    offset = 0
    for part in parts:
        view = memoryview(part).cast("B")
        into[offset : offset + view.nbytes] = view
        offset += view.nbytes


def _frame_end(view: memoryview) -> int | None:
    """Where the frame at the start of ``view`` says it ends, or None for no valid header."""
    try:
        return decode_header(view).frame_len
    except CorruptObject:
        return None


def wipe_end(view: memoryview, room: int) -> None:
    """Clear the end marker a value left in staging, so that a later, shorter value read into
    the same memory can never be completed by it."""
    end = _frame_end(view[: min(room, MAX_HEADER_LEN)])
    if end is not None and end + END_MARKER.size <= min(room, view.nbytes):
        view[end : end + END_MARKER.size] = _NO_END


def value_bytes(view: memoryview) -> bytes:
    """The stored value at the start of an RDMA read's ``view``, as far as it can be told: the
    frame and its end marker, or the header's claim, or the first header's worth of bytes."""
    end = _frame_end(view)
    if end is None:
        return bytes(view[:MAX_HEADER_LEN])
    return bytes(view[: min(end + END_MARKER.size, view.nbytes)])


def feed(receiver: FrameReceiver, view: memoryview, *, exact: bool) -> None:
    """Hand the stored value at the start of ``view`` to ``receiver``, or report it damaged.

    ``exact``: ``view`` is the whole value (TCP). Otherwise (RDMA) ``view`` is the region the
    value was read into, longer than the value, and the value's end is where its header says,
    confirmed by the end marker there."""
    try:
        header = decode_header(view)
    except CorruptObject as error:
        _damaged(receiver, view.nbytes if exact else 1, error)
        return
    end = header.frame_len
    total = end + END_MARKER.size
    if (exact and view.nbytes != total) or (not exact and view.nbytes < total):
        _damaged(
            receiver,
            view.nbytes,
            CorruptObject(
                f"stored value has {view.nbytes if exact else 'fewer than ' + str(total)} "
                f"bytes, its frame says {total} with the end marker (truncated or torn)."
            ),
        )
        return
    magic, length = END_MARKER.unpack_from(view, end)
    if magic != END_MAGIC or length != end:
        _damaged(
            receiver,
            total,
            CorruptObject(
                "stored value has no end marker where its frame ends: it was cut short or "
                "overwritten by something other than kvplug."
            ),
        )
        return
    receiver.receive(view[:end])


def _damaged(receiver: FrameReceiver, length: int, error: CorruptObject) -> None:
    receiver.start(max(length, 1))
    receiver.damage = error


__all__ = [
    "END_MAGIC",
    "END_MARKER",
    "end_marker",
    "feed",
    "fill",
    "joined",
    "value_bytes",
    "wipe_end",
]
