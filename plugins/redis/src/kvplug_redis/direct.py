"""kvplug's own Redis connections: ``GET`` replies received straight into the memory the
caller gets, and ``SET`` values sent straight from the memory they live in.

**Reads.** redis-py (and valkey-py) hand a value over as a ``bytes`` object after copying it
several times (socket, stream buffer, parser buffer, the final object); a frame decoded from it
is copied once more into the :class:`~kvplug.memory.MemoryObj` returned. For a 32 MiB chunk
those copies cost as much as the network. A client library cannot read into a caller's buffer,
so for ``GET`` kvplug reads the RESP2 reply itself with a buffered protocol
(:class:`~kvplug_redis.reply_reader.ReplyReader`) that drives one
:class:`~kvplug.frame.FrameReceiver` per value (:meth:`kvplug.backend.BytesBackend.receive_frames`):

1. the bulk-string length line and the frame header arrive in a small buffer of the
   connection; the receiver is started with the value's length and given the header;
2. the receiver answers with the memory the payload goes to (the caller's buffer for
   ``get_into``, the object ``get`` returns, or a scratch buffer for another serde), and from
   then on the protocol hands the socket views of *that memory*, so the kernel (or the TLS
   layer, decrypting) writes the payload there, with no copy in between; a value the receiver
   does not want (damaged, not the caller's size, a full allocator) is drained;
3. the trailing CRLF is read; the receiver verifies the payload afterwards.

**Writes.** :meth:`DirectConnections.store` sends pipelined ``SET`` s whose values are the
frame's own buffers (header, then the payload in allocator memory) with ``sendmsg``, on plain
TCP and unix-socket connections (:class:`~kvplug_redis.socket_link.SocketLink`), so a put copies
nothing in user space. Over TLS the buffers go through an asyncio transport (encryption copies
anyway).

**Memory safety.** While a reply is arriving, the socket may write into a receiver's memory at
any read, and while a put is being sent, the socket reads the caller's memory. An operation
that ends early (cancelled, past its deadline, or the connection broke) therefore aborts the
connection, which stops all reads and sends at once, and detaches the protocol from the memory
*before* :meth:`DirectConnections.fetch` or :meth:`~DirectConnections.store` returns or raises;
such a connection is never pooled again, since its stream is at an unknown point.

The pool (:class:`DirectConnections`) keeps idle connections for reuse, opens a bounded number
at once (a burst of tasks waits for, and then reuses, the connections being opened rather than
starting one TLS handshake each), logs in on each new one (``AUTH``, ``SELECT``, ``CLIENT
SETNAME``), retries once on a fresh connection when one breaks (after a server restart every
pooled connection is dead) and asks its ``locate`` callable where the server is, again after a
broken connection, a ``READONLY`` reply or :meth:`DirectConnections.forget` (a Sentinel
failover moved the master). Replies read on a connection opened before the last
:meth:`~DirectConnections.forget` are dropped and the commands sent again: reads may come from
a deposed master, and writes may have gone to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType

from kvplug.backend import Buffer
from kvplug.frame import FrameReceiver
from kvplug_redis.connections import Waiters
from kvplug_redis.reply_reader import ConnectionLost, Reply, ReplyReader
from kvplug_redis.socket_link import Endpoint, SocketLink, open_socket

MOVED_RETRIES = 3
"""Times a fetch is sent again because the master moved while it ran, before it fails."""
RETRY_DELAY = (0.01, 0.1)
"""Seconds before the one retry on a fresh connection, drawn at random in this range so that
many operations broken by one restart do not reconnect at the same instant."""


class MasterMoved(ConnectionLost):
    """The master moved while a fetch ran: its replies may come from the old one."""


def pack(*args: bytes) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


def reply_error(errors: ModuleType, line: str, *, auth: bool = False) -> Exception:
    """An error reply (``WRONGTYPE ...``) as the client library's exception for it, so that
    the backend translates it exactly as it translates the library's own."""
    code = line.split(" ", 1)[0]
    names = {
        "NOAUTH": "AuthenticationError",
        "WRONGPASS": "AuthenticationError",
        "NOPERM": "NoPermissionError",
        "LOADING": "BusyLoadingError",
        "READONLY": "ReadOnlyError",
        "MASTERDOWN": "MasterDownError",
        "OOM": "OutOfMemoryError",
    }
    if line.startswith("ERR max number of clients reached"):
        name = "ConnectionError"  # refused at connect: unavailable, not a credentials problem
    elif auth:
        name = "AuthenticationError"
    else:
        name = names.get(code, "ResponseError")
    error_class: type[Exception] = getattr(errors, name, None) or errors.ResponseError
    return error_class(line)


def restart(receivers: Sequence[FrameReceiver]) -> None:
    """Make ``receivers`` fresh again, letting go of what they received, for a fetch sent
    again. Only once the connection that fed them was aborted or has read its last reply."""
    for receiver in receivers:
        receiver.abandon()


class _Connection:
    """One of the pool's connections; used by one operation at a time."""

    def __init__(
        self, transport: asyncio.Transport | SocketLink, reader: ReplyReader, generation: int
    ) -> None:
        self.transport = transport
        self.reader = reader
        self.generation = generation
        self.loop = asyncio.get_running_loop()

    @property
    def usable(self) -> bool:
        return self.reader.lost is None and not self.transport.is_closing()

    async def request(self, data: Sequence[Buffer], replies: Sequence[Reply]) -> None:
        """Send ``data`` (commands, as buffers in order) and wait for ``replies``. Anything
        that ends this early (the deadline, a cancellation, a broken connection) aborts the
        connection before it raises, so no receiver's memory is written afterwards and no
        buffer of ``data`` is read."""
        done = self.reader.expect(replies)
        try:
            if isinstance(self.transport, SocketLink):
                await self.transport.send(data)
            else:
                for piece in data:
                    self.transport.write(piece)
            await done
        except BaseException:
            self.abort()
            if not done.done():
                done.cancel()  # nobody waits for the replies now (the send ended this)
            elif not done.cancelled():
                done.exception()  # the send's error is the one raised
            raise

    def abort(self) -> None:
        self.reader.detach()
        self.transport.abort()


class DirectConnections:
    """A pool of connections that serve ``GET`` s through
    :class:`~kvplug_redis.reply_reader.ReplyReader` and ``SET`` s
    sent from the caller's memory.

    ``locate`` says where the server is (asked again after a broken connection or a
    ``READONLY`` reply, which is also reported to ``suspect``); ``setup`` are the commands
    each new connection sends first (the first is ``AUTH`` when ``auth_first``); ``errors``
    is the client library's exceptions module, whose classes error replies become. At most
    ``max_idle`` connections wait for reuse and ``max_connecting`` are opened at once; the
    caller bounds how many operations run at once.
    """

    def __init__(
        self,
        *,
        locate: Callable[[], Awaitable[Endpoint]],
        errors: ModuleType,
        setup: Sequence[bytes] = (),
        auth_first: bool = False,
        ssl_context: ssl.SSLContext | None = None,
        max_idle: int = 16,
        max_connecting: int = 8,
        suspect: Callable[[], None] | None = None,
    ) -> None:
        self._locate = locate
        self._errors = errors
        self._setup = b"".join(setup)
        self._setup_count = len(setup)
        self._auth_first = auth_first
        self._ssl = ssl_context
        self._max_idle = max_idle
        self._max_connecting = max_connecting
        self._suspect = suspect
        self._connecting = 0
        self._waiters = Waiters()
        self._endpoint: Endpoint | None = None
        self._locating: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._generation = 0
        self._idle: list[_Connection] = []
        self._live: set[_Connection] = set()
        self._closed = False
        self.connects = 0
        """Connections opened so far."""
        self.gets = 0
        """``GET`` replies read so far."""
        self.sets = 0
        """``SET`` replies (of :meth:`store`) read so far."""

    async def fetch(self, names: Sequence[str], receivers: Sequence[FrameReceiver]) -> None:
        """``GET`` each of ``names``, pipelined on one connection, each value fed to the
        receiver at its position (see :class:`~kvplug.frame.FrameReceiver`; a missing key
        leaves it untouched). A broken connection is retried once, on a new one; error
        replies raise the first of them (as the library's exception) once every reply is
        read. Replies that may come from a deposed master (:meth:`forget` ran meanwhile) are
        dropped and the ``GET`` s sent again. When this returns or raises, nothing writes into
        the receivers' memory any more."""
        data = b"".join(pack(b"GET", name.encode()) for name in names)
        await self._exchange(
            [data], lambda: [Reply(receiver) for receiver in receivers], lambda: restart(receivers)
        )
        self.gets += len(names)

    async def store(self, commands: Sequence[Buffer], count: int) -> None:
        """Send ``count`` commands answered by ``+OK`` (``SET`` s packed by
        :func:`~kvplug_redis.pipeline.set_command`: ``commands`` are their pieces, in order)
        pipelined on one connection; on a plain connection each buffer goes to the socket
        from its own memory (:class:`~kvplug_redis.socket_link.SocketLink`). Retried like
        :meth:`fetch`, also when the master moved meanwhile (the values may have gone to the
        deposed one); the first error reply is raised once every reply is read. When this
        returns or raises, no buffer of ``commands`` is read any more."""
        await self._exchange(commands, lambda: [Reply() for _ in range(count)], lambda: None)
        self.sets += count

    async def exists(self, names: Sequence[str]) -> list[bool]:
        """Whether each of ``names`` exists: ``EXISTS`` of each, pipelined on one connection,
        retried like :meth:`fetch`."""
        data = b"".join(pack(b"EXISTS", name.encode()) for name in names)
        replies: list[Reply] = []

        def expected() -> list[Reply]:
            replies[:] = [Reply(integer=True) for _ in names]
            return replies

        await self._exchange([data], expected, lambda: None)
        return [reply.number > 0 for reply in replies]

    @property
    def sends_from_memory(self) -> bool:
        """Whether :meth:`store` sends buffers without copying them (not with TLS, whose
        encryption copies anyway and whose transport buffers what the socket did not take)."""
        return self._ssl is None

    async def _exchange(
        self,
        data: Sequence[Buffer],
        expected: Callable[[], list[Reply]],
        start_over: Callable[[], None],
    ) -> None:
        broken = moved = 0
        while True:
            try:
                await self._exchange_once(data, expected())
                return
            except MasterMoved:
                moved += 1
                if moved > MOVED_RETRIES:
                    raise
                start_over()
                continue
            except OSError:
                self.forget()
                if self._suspect is not None:
                    self._suspect()
                broken += 1
                if self._closed or broken > 1:
                    raise
                start_over()
            await asyncio.sleep(random.uniform(*RETRY_DELAY))

    async def _exchange_once(self, data: Sequence[Buffer], replies: list[Reply]) -> None:
        conn = await self._acquire()
        try:
            await conn.request(data, replies)
        except BaseException:
            self._drop(conn)
            raise
        if conn.generation != self._generation:
            self._drop(conn)
            raise MasterMoved("the master moved while the replies were read; they were dropped")
        self._release(conn)
        refused = next((reply.error for reply in replies if reply.error is not None), None)
        if refused is not None:
            error = reply_error(self._errors, refused)
            if isinstance(error, self._errors.ReadOnlyError):
                self.forget()  # a replica now: the master moved
                if self._suspect is not None:
                    self._suspect()
            raise error

    # -- the pool ----------------------------------------------------------------------------

    async def _acquire(self) -> _Connection:
        if self._closed:
            raise ConnectionLost("the backend is closed")
        loop = asyncio.get_running_loop()
        while True:
            while self._idle:
                conn = self._idle.pop()
                if conn.usable and conn.loop is loop and conn.generation == self._generation:
                    return conn
                self._drop(conn)
            if self._connecting < self._max_connecting:
                break
            await self._waiters.wait()  # a connection released or opened, or a slot freed
        self._connecting += 1
        try:
            generation = self._generation
            async with self._locating_lock(loop):  # one question to the sentinels, not one each
                if self._endpoint is None:
                    endpoint = await self._locate()
                    if generation == self._generation:
                        self._endpoint = endpoint
                else:
                    endpoint = self._endpoint
            return await self._connect(endpoint, generation)
        finally:
            self._connecting -= 1
            self._waiters.wake_one()

    def _locating_lock(self, loop: asyncio.AbstractEventLoop) -> asyncio.Lock:
        """The lock of ``loop`` around asking ``locate``: an asyncio lock belongs to the loop
        that first waits on it, and a backend may be used from another loop later."""
        if self._locating is None or self._locating[0] is not loop:
            self._locating = (loop, asyncio.Lock())
        return self._locating[1]

    async def _connect(self, endpoint: Endpoint, generation: int) -> _Connection:
        loop = asyncio.get_running_loop()
        reader = ReplyReader()
        link: asyncio.Transport | SocketLink
        if self._ssl is None or endpoint.path is not None:
            link = SocketLink(loop, await open_socket(loop, endpoint), reader)
        else:
            link, _ = await loop.create_connection(
                lambda: reader,
                endpoint.host,
                endpoint.port,
                ssl=self._ssl,
                server_hostname=endpoint.host,
            )
        conn = _Connection(link, reader, generation)
        self._live.add(conn)
        self.connects += 1
        if self._closed:
            self._drop(conn)
            raise ConnectionLost("the backend was closed while connecting")
        if self._setup_count:
            replies = [Reply() for _ in range(self._setup_count)]
            try:
                await conn.request([self._setup], replies)
            except BaseException:
                self._drop(conn)
                raise
            refused = next((r for r in replies if r.error is not None), None)
            if refused is not None:
                self._drop(conn)
                auth = self._auth_first and refused is replies[0]
                raise reply_error(self._errors, refused.error or "", auth=auth)
        return conn

    def _release(self, conn: _Connection) -> None:
        if (
            self._closed
            or not conn.usable
            or conn.generation != self._generation
            or len(self._idle) >= self._max_idle
        ):
            self._drop(conn)
        else:
            self._idle.append(conn)
            self._waiters.wake_one()

    def _drop(self, conn: _Connection) -> None:
        self._live.discard(conn)
        if conn.loop.is_closed():
            return  # its socket is closed when collected
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if conn.loop is here:
            conn.abort()
        else:  # an idle connection of a loop used before (in another thread): aborted there
            with contextlib.suppress(RuntimeError):  # that loop closed meanwhile
                conn.loop.call_soon_threadsafe(conn.abort)

    def drop_connections_here(self) -> None:
        """Abort the connections of the running loop, idle or in use (it is shutting down)."""
        loop = asyncio.get_running_loop()
        self._idle = [conn for conn in self._idle if conn.loop is not loop]
        for conn in [conn for conn in self._live if conn.loop is loop]:
            self._drop(conn)

    def forget(self) -> None:
        """Ask ``locate`` again on the next connect, let no older connection be reused and
        drop the replies still arriving on them: after a restart they are dead, after a
        failover they lead to a replica or to a deposed master."""
        self._endpoint = None
        self._generation += 1
        idle, self._idle = self._idle, []
        for conn in idle:
            self._drop(conn)

    def close(self) -> None:
        """Abort every connection, idle or in use (an operation on one ends with
        :class:`ConnectionLost`); later fetches raise it too. Idempotent."""
        self._closed = True
        self._idle = []
        for conn in list(self._live):
            self._drop(conn)

    @property
    def open_connections(self) -> int:
        """Connections open now, idle or in use."""
        return len(self._live)


__all__ = [
    "ConnectionLost",
    "DirectConnections",
    "Endpoint",
    "pack",
    "reply_error",
    "restart",
]
