"""How ``kvplug lm-server`` reads from a client: a connection's read-ahead buffer over a
non-blocking socket, with payloads paced (``frame_timeout``, ``min_rate``) so that a slow or
stalled client holds its buffer only so long."""

from __future__ import annotations

import asyncio
import functools
import socket
from collections import Counter
from collections.abc import Awaitable, Callable

import xxhash

from kvplug.tls import TLSChannel
from kvplug_lm.server_options import ServerOptions

READ_AHEAD = 64 * 1024
"""Bytes of each connection's read-ahead buffer (headers, keys and small payloads)."""


class PeerGone(Exception):
    """The peer closed the connection (or reset it)."""


class CloseConnection(Exception):
    """End this connection (a protocol error was answered, or plain clients are denied)."""


class Reader:
    """A connection's read-ahead buffer over a non-blocking socket."""

    __slots__ = (
        "buf",
        "counters",
        "end",
        "loop",
        "options",
        "receive",
        "sock",
        "start",
        "tls",
        "view",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        options: ServerOptions,
        counters: Counter[str],
        tls: TLSChannel | None = None,
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.tls = tls
        # Bound once: plain reads call the loop directly, with no coroutine of ours between.
        self.receive: Callable[[memoryview], Awaitable[int]] = (
            functools.partial(loop.sock_recv_into, sock) if tls is None else tls.recv_into
        )
        self.options = options
        self.counters = counters
        self.buf = bytearray(READ_AHEAD)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0

    @property
    def buffered(self) -> int:
        return self.end - self.start

    async def _recv(self, need: int) -> None:
        """Receive until ``need`` bytes are buffered."""
        if self.start + need > len(self.buf):
            length = self.end - self.start
            self.buf[:length] = self.view[self.start : self.end]
            self.start, self.end = 0, length
        while self.end - self.start < need:
            count = await self.receive(self.view[self.end :])
            if count == 0:
                raise PeerGone
            self.end += count
            self.counters["bytes_received"] += count

    async def wait_readable(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
            await self._recv(1)

    def peek(self, n: int) -> bytes:
        return bytes(self.view[self.start : self.start + n])

    async def read(self, n: int, timeout: float) -> bytes:
        """``n`` bytes (at most :data:`READ_AHEAD`), within ``timeout`` seconds."""
        if self.end - self.start < n:
            async with asyncio.timeout(timeout):
                await self._recv(n)
        data = bytes(self.view[self.start : self.start + n])
        self.start += n
        return data

    def _pace(self) -> tuple[float, float, float]:
        options = self.options
        return self.loop.time(), options.frame_timeout, float(options.min_rate)

    async def read_into(self, dest: memoryview) -> int:
        """Fill ``dest`` and return its xxh3-64: what the read-ahead holds is copied, the rest
        received into it. Each piece is hashed as it arrives, while the next is still on the
        wire, so the checksum costs no time of its own on a large payload.

        Paced: it raises TimeoutError when no byte arrives for ``frame_timeout`` seconds, or
        when, past the first ``frame_timeout`` seconds, the bytes so far arrived slower than
        ``min_rate`` on average (a slow-loris payload keeps its buffer that long at most)."""
        hasher = xxhash.xxh3_64()
        take = min(self.end - self.start, len(dest))
        if take:
            dest[:take] = self.view[self.start : self.start + take]
            self.start += take
            hasher.update(dest[:take])
        if take == len(dest):
            return hasher.intdigest()
        counters = self.counters
        start, frame_timeout, min_rate = self._pace()
        async with asyncio.timeout_at(start + frame_timeout) as budget:
            position = take
            while position < len(dest):
                count = await self.receive(dest[position:])
                if count == 0:
                    raise PeerGone
                hasher.update(dest[position : position + count])
                position += count
                counters["bytes_received"] += count
                budget.reschedule(
                    min(
                        self.loop.time() + frame_timeout,
                        start + frame_timeout + position / min_rate,
                    )
                )
        return hasher.intdigest()

    async def consume(self, n: int, sink: Callable[[memoryview], object] | None = None) -> None:
        """Read the next ``n`` bytes through the read-ahead buffer, handing each piece to
        ``sink`` (dropping them without one), paced like :meth:`read_into`."""
        start, frame_timeout, min_rate = self._pace()
        done = 0
        async with asyncio.timeout_at(start + frame_timeout) as budget:
            while done < n:
                if self.start == self.end:
                    self.start = self.end = 0
                    await self._recv(1)
                take = min(n - done, self.end - self.start)
                if sink is not None:
                    sink(self.view[self.start : self.start + take])
                self.start += take
                done += take
                budget.reschedule(
                    min(self.loop.time() + frame_timeout, start + frame_timeout + done / min_rate)
                )

    async def discard(self, n: int) -> None:
        """Read and drop ``n`` bytes."""
        await self.consume(n)

    async def read_all(self, n: int) -> bytearray:
        """``n`` bytes, grown as they arrive (a declared length reserves nothing)."""
        data = bytearray()
        await self.consume(n, data.extend)
        return data


class ClientConnection:
    __slots__ = ("authenticated", "idle", "nonce", "peer", "reader", "sock", "task", "tls")

    def __init__(self, sock: socket.socket, reader: Reader, peer: str) -> None:
        self.sock = sock
        self.tls = reader.tls
        self.reader = reader
        self.peer = peer
        self.idle = True
        self.nonce: bytes | None = None
        self.authenticated = False
        self.task: asyncio.Task[None] | None = None


__all__ = ["READ_AHEAD", "ClientConnection", "CloseConnection", "PeerGone", "Reader"]
