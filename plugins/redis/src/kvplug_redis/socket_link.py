"""Plain connections (TCP, unix socket) of kvplug's own Redis connections, driven by hand on
the event loop: what arrives is received into the buffers a
:class:`~kvplug_redis.reply_reader.ReplyReader` names, and what is sent goes to the socket with
``sendmsg`` straight from the caller's memory."""

from __future__ import annotations

import asyncio
import collections
import itertools
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from kvplug.backend import Buffer
from kvplug_redis.reply_reader import ConnectionLost, ReplyReader

IOV_MAX = 1024
"""Buffers one ``sendmsg`` takes at most (Linux's ``IOV_MAX``)."""


@dataclass(frozen=True)
class Endpoint:
    """Where to connect: a TCP host and port, or a unix socket path."""

    host: str = ""
    port: int = 0
    path: str | None = None


class SocketLink:
    """A plain connection driven by hand on the event loop: what arrives is received into the
    buffers :class:`~kvplug_redis.reply_reader.ReplyReader` names, as an asyncio transport
    would, and :meth:`send` writes the caller's buffers with ``sendmsg``, straight from their
    memory.

    Why not a transport: before Python 3.12 an asyncio transport joins the buffers it is given
    and keeps what the socket did not take in a buffer of its own, deleting each sent part from
    its front; for a 32 MiB value those copies cost more than the network (a profile showed 80%
    of a batched put there). A transport also owns its socket, so the loop refuses to watch
    that socket for anyone else.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, reader: ReplyReader
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._reader = reader
        self._closing = False
        self._writable: asyncio.Future[None] | None = None
        loop.add_reader(self._fd, self._on_readable)
        reader.connection_made(self)

    def _on_readable(self) -> None:
        try:
            nbytes = self._sock.recv_into(self._reader.get_buffer(-1))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._close(error)
            return
        if not nbytes:
            self._close(None)
            return
        self._reader.buffer_updated(nbytes)

    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Write ``buffers`` in order; returns once the kernel has taken every byte (the
        caller may then reuse them). Raises :class:`ConnectionLost` if the connection breaks
        or is aborted meanwhile."""
        pending = collections.deque(
            view for view in (memoryview(b).cast("B") for b in buffers) if view.nbytes
        )
        while pending:
            if self._closing:
                raise ConnectionLost("the connection was closed while sending")
            try:
                sent = self._sock.sendmsg(list(itertools.islice(pending, IOV_MAX)))
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as error:
                self._close(error)
                raise ConnectionLost(f"the connection broke while sending: {error}") from error
            while sent:
                head = pending[0]
                if head.nbytes <= sent:
                    sent -= head.nbytes
                    pending.popleft()
                else:
                    pending[0] = head[sent:]
                    sent = 0
            if pending:
                await self._wait_writable()

    async def _wait_writable(self) -> None:
        waiter = self._loop.create_future()
        self._writable = waiter

        def ready() -> None:
            if not waiter.done():
                waiter.set_result(None)

        self._loop.add_writer(self._fd, ready)
        try:
            await waiter
        finally:
            self._writable = None
            if not self._closing:
                self._loop.remove_writer(self._fd)

    def abort(self) -> None:
        """Close at once; what was not sent is dropped, a sender waiting raises."""
        self._close(None)

    def is_closing(self) -> bool:
        return self._closing

    def _close(self, error: Exception | None) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        self._sock.close()
        waiter = self._writable
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionLost("the connection was closed while sending"))
        # As a transport does: the protocol hears of it from the loop, not from inside a call.
        self._loop.call_soon(self._reader.connection_lost, error)


async def open_socket(loop: asyncio.AbstractEventLoop, endpoint: Endpoint) -> socket.socket:
    """A connected non-blocking socket to ``endpoint`` (each of the host's addresses is tried
    in turn)."""
    if endpoint.path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, endpoint.path)
        except BaseException:
            sock.close()
            raise
        return sock
    try:  # an IP address needs no lookup, and no thread of the loop's executor
        addresses = socket.getaddrinfo(
            endpoint.host, endpoint.port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST
        )
    except socket.gaierror:
        addresses = await loop.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
    failure: OSError | None = None
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
        except OSError as error:
            sock.close()
            failure = error
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise failure or OSError(f"no address found for {endpoint.host}:{endpoint.port}")


__all__ = ["IOV_MAX", "Endpoint", "SocketLink", "open_socket"]
