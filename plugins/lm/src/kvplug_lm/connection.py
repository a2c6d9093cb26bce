"""Connections of the ``lm://`` client and their pool.

A :class:`Connection` is one non-blocking TCP socket (``TCP_NODELAY``) driven by the event
loop's ``sock_sendall`` and ``sock_recv_into``: payloads are sent from the object's memory and
received straight into the memory the caller gets, without copies in between.

**Never a desynchronised stream.** Both protocols are request/reply streams without framing
that could be resynchronised: a reply read by the wrong request is silently wrong data.
A request interrupted anywhere between its first byte sent and its reply's last byte read
(a deadline, a cancellation, an error) therefore closes its connection; the pool hands out
only connections whose every request was completed (:meth:`Pool.lease`).

**Reconnects.** A connection that breaks sends the pool's idle connections after it (a server
restart breaks them all), and the operation is tried once more on a fresh connection when the
broken one was a reused one. A refused connect starts a back-off: until it ends, operations
fail at once with :class:`~kvplug.errors.BackendUnavailable` (so callers are not held while
the server is down), and the delay doubles up to its maximum, with jitter, until a connect
succeeds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from kvplug.errors import BackendUnavailable
from kvplug.tls import TLSChannel


class Hasher(Protocol):
    """A streaming checksum (``xxhash.xxh3_64()``)."""

    def update(self, data: memoryview) -> None: ...


T = TypeVar("T")

DRAIN_CHUNK = 1 << 20
"""Bytes of the scratch buffer a connection drains unwanted payloads into."""


class ConnectionLost(ConnectionError):
    """The server closed the connection, or it broke, before a reply was complete."""


class Connection:
    """One socket to the server, used by one request (or one pipelined batch) at a time."""

    def __init__(self, sock: socket.socket, address: str, tls: TLSChannel | None = None) -> None:
        self.sock = sock
        self.tls = tls
        """The connection's TLS (``lms://``); None: plain TCP."""
        self.address = address
        self.closed = False
        self.reused = False
        self._next_id = 0
        self._scratch: bytearray | None = None

    def next_request_id(self) -> int:
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        return self._next_id

    async def send(self, *parts: bytes | memoryview) -> None:
        tls = self.tls
        loop = asyncio.get_running_loop()
        for part in parts:
            if not len(part):
                continue
            if tls is None:
                await loop.sock_sendall(self.sock, part)
            else:
                await tls.sendall(part)

    async def recv_into(self, view: memoryview, hasher: Hasher | None = None) -> None:
        """Fill ``view`` exactly from the socket; ``hasher`` (an ``xxhash.xxh3_64()``) is fed
        each piece as it arrives, while the next is still on the wire."""
        loop = asyncio.get_running_loop()
        tls = self.tls
        received, size = 0, len(view)
        while received < size:
            if tls is None:
                count = await loop.sock_recv_into(self.sock, view[received:])
            else:
                count = await tls.recv_into(view[received:])
            if count == 0:
                raise ConnectionLost(f"the server at {self.address} closed the connection")
            if hasher is not None:
                hasher.update(view[received : received + count])
            received += count

    async def recv_exact(self, size: int) -> bytearray:
        data = bytearray(size)
        if size:
            await self.recv_into(memoryview(data))
        return data

    async def drain(self, size: int) -> None:
        """Read and drop ``size`` bytes (a payload nobody wants), keeping the stream in step."""
        if self._scratch is None:
            self._scratch = bytearray(DRAIN_CHUNK)
        view = memoryview(self._scratch)
        while size > 0:
            step = min(size, len(view))
            await self.recv_into(view[:step])
            size -= step

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()


class ReplyError(Exception):
    """A failure the server reported in a complete reply (a full server, an unknown key): the
    stream is in step, so the connection goes back to the pool, and :meth:`Pool.run` raises
    :attr:`error`, the error for the caller."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


Handshake = Callable[[Connection], Awaitable[None]]


class Pool:
    """At most ``size`` connections to ``host:port``, opened on demand and reused.

    ``handshake`` runs on every new connection before its first request (the hello and the
    authentication of the extended mode); a connection is pooled only after it succeeded.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        size: int,
        connect_timeout: float,
        initial_delay: float,
        max_delay: float,
        handshake: Handshake,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        """The TLS context of every connection (``lms://``); None: plain TCP."""
        self.port = port
        self.scheme = "lm" if tls is None else "lms"
        self.address = f"{self.scheme}://{host}:{port}"
        """The server's URL, without options: what messages name."""
        self.size = size
        self.connect_timeout = connect_timeout
        self.initial_delay = initial_delay
        self.max_delay = max_delay
        self.handshake = handshake
        self._idle: collections.deque[Connection] = collections.deque()
        self._permits: asyncio.Semaphore | None = None
        self._closed = False
        self._failures = 0
        self._retry_at = 0.0
        self._last_failure = ""

    def _semaphore(self) -> asyncio.Semaphore:
        if self._permits is None:
            self._permits = asyncio.Semaphore(self.size)
        return self._permits

    # -- connecting ------------------------------------------------------------------------

    async def connect(self) -> Connection:
        """A new, handshaken connection; :class:`BackendUnavailable` naming the address and
        what to check when the server cannot be reached (or during the back-off after that)."""
        now = time.monotonic()
        if now < self._retry_at:
            raise BackendUnavailable(
                f"{self.address} was unreachable {self._failures} time(s) in a "
                "row "
                f"({self._last_failure}); the next connect is tried in "
                f"{self._retry_at - now:.2f} s. Check that the server (kvplug lm-server or "
                "lmcache_server) runs and listens there."
            )
        loop = asyncio.get_running_loop()
        sock: socket.socket | None = None
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.timeout(self.connect_timeout):
                await loop.sock_connect(sock, address)
        except (OSError, TimeoutError) as error:
            if sock is not None:
                sock.close()
            raise self._unreachable(error) from None
        tls = None
        if self.tls is not None:
            tls = TLSChannel(sock, self.tls, server_hostname=self.host)
        connection = Connection(sock, self.address, tls)
        try:
            async with asyncio.timeout(self.connect_timeout):
                if tls is not None:
                    await tls.handshake()
                await self.handshake(connection)
        except TimeoutError:
            connection.close()
            raise self._unreachable(
                TimeoutError(f"no answer to the hello within {self.connect_timeout} s")
            ) from None
        except ssl.SSLError as error:
            connection.close()
            raise self._refused_tls(error) from None
        except OSError as error:
            connection.close()
            raise self._unreachable(error) from None
        except BaseException:
            connection.close()
            raise
        self._failures = 0
        self._retry_at = 0.0
        return connection

    def _refused_tls(self, error: ssl.SSLError) -> BackendUnavailable:
        """A TLS handshake that failed: the server's certificate was not trusted, or the server
        refused ours. Backed off like an unreachable server (the server may be fixed)."""
        what = error.reason or str(error)
        if isinstance(error, ssl.SSLCertVerificationError):
            what = f"the server's certificate failed the check: {error.verify_message}"
        self._back_off(f"TLS handshake failed: {what}")
        return BackendUnavailable(
            f"the TLS handshake with {self.address} failed ({what}). Check "
            "that ssl_ca_certs holds the CA that signed the server's certificate and that the "
            "certificate names the host connected to (ssl_check_hostname), and, when the "
            "server requires client certificates, give ssl_certfile and ssl_keyfile."
        )

    def _unreachable(self, error: BaseException) -> BackendUnavailable:
        what = str(error) or type(error).__name__
        if isinstance(error, ConnectionRefusedError):
            what = "connection refused"
        self._back_off(what)
        return BackendUnavailable(
            f"cannot reach {self.address}: {what}. Check that the server "
            "(kvplug lm-server or lmcache_server) runs, listens on that host and port, and that "
            "no firewall is in the way; kvplug reconnects on the next operation."
        )

    def _back_off(self, failure: str) -> None:
        """Refuse connects for a while after ``failure``, longer after each in a row."""
        self._failures += 1
        delay = min(self.max_delay, self.initial_delay * 2 ** (self._failures - 1))
        self._retry_at = time.monotonic() + delay * random.uniform(0.5, 1.0)
        self._last_failure = failure

    # -- leasing ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, *, wait: bool = True) -> AsyncIterator[Connection | None]:
        """A connection for one request or batch. It goes back to the pool only when the
        block finishes without an exception or with a :class:`ReplyError` (its reply was read
        whole); otherwise it is closed, since its stream may be in the middle of a frame.
        With ``wait=False``, yields None when no connection is free at once (a batch
        spreading over the pool never waits for a second one)."""
        permits = self._semaphore()
        if not wait and permits.locked():
            yield None
            return
        await permits.acquire()
        connection: Connection | None = None
        try:
            while self._idle:
                candidate = self._idle.pop()
                if not candidate.closed:
                    connection = candidate
                    connection.reused = True
                    break
            if connection is None:
                connection = await self.connect()
                connection.reused = False
            try:
                yield connection
            except ReplyError:
                self._give_back(connection)
                raise
            except BaseException as error:
                connection.close()
                if isinstance(error, OSError):
                    self.drop_idle()
                raise
            self._give_back(connection)
        finally:
            permits.release()

    def _give_back(self, connection: Connection) -> None:
        if self._closed:
            connection.close()
        else:
            self._idle.append(connection)

    async def run(self, request: Callable[[Connection], Awaitable[T]]) -> T:
        """``request`` on a leased connection; sent once more on a fresh connection when a
        reused one turns out broken (the server restarted since it was opened)."""
        reused = False
        for attempt in (1, 2):
            try:
                async with self.lease() as connection:
                    assert connection is not None
                    reused = connection.reused
                    return await request(connection)
            except ReplyError as refused:
                raise refused.error from None
            except OSError as error:
                if attempt == 2 or not reused:
                    raise self.lost(error) from None
        raise AssertionError("unreachable")

    def lost(self, error: BaseException) -> BackendUnavailable:
        """The error of a request whose connection broke."""
        if isinstance(error, BackendUnavailable):
            return error
        return BackendUnavailable(
            f"the connection to {self.address} broke during a request ({error}); the "
            "server stopped or restarted. kvplug reconnects on the next operation."
        )

    def drop_idle(self) -> None:
        """Close every idle connection (after one broke: the others likely did too)."""
        while self._idle:
            self._idle.pop().close()

    def close(self) -> None:
        """Close idle connections now, and those in use when their request ends."""
        self._closed = True
        self.drop_idle()


__all__ = ["DRAIN_CHUNK", "Connection", "ConnectionLost", "Handshake", "Pool", "ReplyError"]
