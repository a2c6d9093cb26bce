"""How values travel in pipelines: ``SET`` commands packed around the frame's own buffers, put
batches grouped by size, sends sliced, and batched direct reads spread over connections.

The backend decides what to send (:mod:`kvplug_redis.backend`); this module decides how the
bytes go on the wire. A ``SET`` is packed as a RESP header, the frame's parts as memoryviews,
and a tail, without a copy; kvplug's own connections send those pieces as they are. Through the
client library (TLS, ``direct_writes=false``) each slice of a few MiB is copied once before the
library gets it, since a transport may keep what it is given past the end of the put. Either
way it is one command, so a reader never sees a header without its payload.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from kvplug.backend import Buffer, gather_all
from kvplug.frame import FrameReceiver
from kvplug_redis.client_library import ClientLibrary
from kvplug_redis.direct import DirectConnections

SEND_SLICE_BYTES = 1 << 20
"""A put hands the socket at most this many bytes at a time (see :func:`send_sets`)."""
PIPELINE_BYTES = 64 << 20
"""A batched put sends its values in pipelines of about this many bytes, so a large batch is
not joined into memory all at once."""
FETCH_SPREAD = 4
"""A batch of direct reads into the caller's buffers (``batched_get_into``, an engine's load)
is spread over at most this many connections at once."""


def slices(pieces: Sequence[bytes | memoryview], limit: int) -> Iterator[list[memoryview]]:
    """``pieces`` regrouped into lists of views of at most ``limit`` bytes, in order."""
    group: list[memoryview] = []
    size = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while view.nbytes:
            take = view[: limit - size]
            group.append(take)
            size += take.nbytes
            view = view[take.nbytes :]
            if size == limit:
                yield group
                group, size = [], 0
    if group:
        yield group


def group_by_size(
    keys: Sequence[str], values: Sequence[Sequence[Buffer]], limit: int = PIPELINE_BYTES
) -> list[list[tuple[str, Sequence[Buffer]]]]:
    """``keys`` with their ``values`` (a frame's parts each), in order, in groups that each
    reach ``limit`` bytes (the last one may hold less): one pipeline per group."""
    groups: list[list[tuple[str, Sequence[Buffer]]]] = []
    group: list[tuple[str, Sequence[Buffer]]] = []
    size = 0
    for key, parts in zip(keys, values, strict=True):
        group.append((key, parts))
        size += sum(memoryview(part).nbytes for part in parts)
        if size >= limit:
            groups.append(group)
            group, size = [], 0
    if group:
        groups.append(group)
    return groups


def set_command(
    name: bytes, views: Sequence[memoryview], size: int, ttl_ms: int | None
) -> list[bytes | memoryview]:
    """``SET name <value> [PX ttl_ms]`` as RESP pieces, the value (``views``, ``size`` bytes in
    all) sent as it is. Why: joining a 32 MiB payload behind its 128-byte header costs a copy
    per put."""
    count = 3 if ttl_ms is None else 5
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (count, len(name), name, size)
    tail = b"\r\n"
    if ttl_ms is not None:
        ms = b"%d" % ttl_ms
        tail += b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
    return [head, *views, tail]


async def send_sets(
    client: Any, pieces: list[bytes | memoryview], lib: ClientLibrary, count: int = 1
) -> None:
    """``count`` packed ``SET`` s (``pieces``, one pipeline) on a connection of ``client``'s
    pool, retried like the client's own commands (one quick retry of a broken connection); the
    first error reply is raised once all replies are read. The connection gets copies of
    ``pieces``, a slice at a time, so nothing reads them after this returns or raises."""
    pool = client.connection_pool
    # redis-py >= 5.3 warns when get_connection gets a command name; valkey-py needs one.
    conn = await (pool.get_connection("SET") if lib.name == "valkey-py" else pool.get_connection())
    try:
        await conn.retry.call_with_retry(
            lambda: _send_on(conn, pieces, count, lib.exceptions.ResponseError),
            lambda error: conn.disconnect(),
        )
    finally:
        await pool.release(conn)


async def _send_on(
    conn: Any, pieces: list[bytes | memoryview], count: int, response_error: type[Exception]
) -> None:
    answered = False
    refused: Exception | None = None
    try:
        # Why slices: asyncio (before Python 3.12) keeps what the socket did not take in one
        # bytearray and deletes each sent part from its front, so handing it a 32 MiB value at
        # once costs a memmove of the rest per send (0.3 GB/s); slices of a few MiB, each
        # drained, keep that buffer small. Why each slice is joined into bytes of its own: a
        # transport may keep the buffers it is given until the socket takes them (Python 3.12
        # and later, uvloop), also after a cancellation, when the client library closes the
        # connection (which goes on sending) before anything here can abort it; the caller's
        # memory must not be read once the put has ended (releases_on_cancel).
        for index, group in enumerate(slices(pieces, SEND_SLICE_BYTES)):
            await conn.send_packed_command([b"".join(group)], check_health=index == 0)
        for _ in range(count):
            try:
                await conn.read_response()
            except response_error as error:
                refused = refused or error  # an error reply (OOM ...): read on
        answered = True
    finally:
        if not answered:
            # Why abort: drain() returns with up to the high-water mark still buffered; a plain
            # close would go on sending it, and the server could then store the value of a put
            # that failed.
            writer = getattr(conn, "_writer", None)
            if writer is not None:
                writer.transport.abort()
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)
    if refused is not None:
        raise refused


async def fetch_spread(
    direct: DirectConnections, names: Sequence[str], receivers: Sequence[FrameReceiver]
) -> None:
    """``direct.fetch`` of ``names`` into ``receivers``, in up to :data:`FETCH_SPREAD`
    pipelines on their own connections at once (the server sends on one while this reads
    another); the first error once every pipeline has ended, so none still writes."""
    parts = min(FETCH_SPREAD, len(names))
    bounds = [len(names) * i // parts for i in range(parts + 1)]
    await gather_all(
        direct.fetch(names[lo:hi], receivers[lo:hi]) for lo, hi in itertools.pairwise(bounds)
    )


__all__ = [
    "FETCH_SPREAD",
    "PIPELINE_BYTES",
    "SEND_SLICE_BYTES",
    "fetch_spread",
    "group_by_size",
    "send_sets",
    "set_command",
    "slices",
]
