"""Reads of one large payload in pieces (internal): the later pieces in flight at once on the
reader threads while the I/O thread hashes the pieces already in, so that the checksum is
computed while the rest is still being read."""

from __future__ import annotations

import concurrent.futures

import xxhash

from kvplug_disk.fileio.base import FileIO, Payload
from kvplug_disk.fileio.posix import PosixFileIO
from kvplug_disk.fileops import Access, read_all
from kvplug_disk.layout import BLOCK, padded
from kvplug_disk.workers import READ_HELPERS

READ_PIECE = 4 << 20
"""Bytes of one read request when a payload is read in pieces, all in flight at once on the
reader threads, and hashed as they arrive (a multiple of the block size, so every piece keeps
O_DIRECT's alignment); pieces are larger when a payload would need more than one per reader
thread. Payloads up to this size are read in one call and hashed after."""


def reads_in_pieces(payload: Payload, io: FileIO) -> bool:
    """Whether :func:`read_hashing` reads ``payload``: with O_DIRECT, into host memory in one
    buffer whose start is the checksummed bytes, longer than a piece, moved by plain
    ``preadv`` (the :class:`~kvplug_disk.fileio.PosixFileIO` way, which that function does
    piece by piece). A buffered read is a copy out of the page cache, work for the CPU like
    the hash: splitting it gains nothing on a busy host."""
    return (
        payload.o_direct
        and payload.host is not None
        and payload.host.nbytes > READ_PIECE
        and len(payload.buffers) == 1
        and type(io).read_object is PosixFileIO.read_object
    )


def read_hashing(
    fd: int, head: memoryview, payload: Payload, readers: concurrent.futures.Executor
) -> tuple[int, int | None]:
    """Read the header block into ``head`` and the payload into its one buffer, in pieces of
    :data:`READ_PIECE` bytes or more, and hash the payload as the pieces arrive.

    The later pieces are read on ``readers``, all at once, while this thread reads the header
    block and the first piece and then hashes each piece, in file order, as soon as it is in:
    the checksum is computed while the rest is still being read, and the disk sees as many
    requests in flight as one large read gives it (one piece after another would wait a round
    trip per piece). Returns the count of bytes read and the payload's checksum, the same
    xxh3-64 as :func:`kvplug.frame.payload_checksum`; None for the checksum when the file came
    up short. Returns or raises only once no other thread touches the payload's memory."""
    (buffer,) = payload.buffers
    host = payload.host
    assert host is not None
    nbytes = host.nbytes  # the read plans put the checksummed bytes first in the buffer
    length = buffer.nbytes
    # At most one piece per reader thread and this one: more would wait for a thread.
    piece = max(READ_PIECE, padded(-(-length // (READ_HELPERS + 1))))
    access = payload.access
    later: list[tuple[int, int, concurrent.futures.Future[int] | None]] = []
    try:
        for start in range(piece, length, piece):
            end = min(start + piece, length)
            later.append((start, end, _read_piece(readers, fd, buffer[start:end], start, access)))
        first = min(piece, length)
        total = read_all(fd, [head, buffer[:first]], 0, access)
        short = total != BLOCK + first
        hasher = xxhash.xxh3_64()
        if not short:
            with access():
                hasher.update(host[: min(first, nbytes)])
        for start, end, future in later:
            count = (
                future.result()
                if future is not None
                else read_all(fd, [buffer[start:end]], BLOCK + start, access)
            )
            total += count
            short = short or count != end - start
            if not short and start < nbytes:
                with access():
                    hasher.update(host[start : min(end, nbytes)])
        return total, None if short else hasher.intdigest()
    finally:
        pending = [future for _, _, future in later if future is not None]
        for future in pending:
            future.cancel()
        concurrent.futures.wait(pending)  # never release memory a reader still fills


def _read_piece(
    readers: concurrent.futures.Executor, fd: int, view: memoryview, start: int, access: Access
) -> concurrent.futures.Future[int] | None:
    """Read ``view`` from payload offset ``start`` on a reader thread; None when the readers
    are shut down (by close): the caller reads it itself."""
    try:
        return readers.submit(read_all, fd, [view], BLOCK + start, access)
    except RuntimeError:
        return None


__all__ = ["READ_PIECE", "read_hashing", "reads_in_pieces"]
