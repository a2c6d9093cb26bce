"""Direct reads: ``GET`` replies received straight into the memory the caller gets.

redis-py (and valkey-py) hand a value over as a ``bytes`` object after copying it several
times (socket, stream buffer, parser buffer, the final object); a frame decoded from it is
copied once more into the :class:`~kvplug.memory.MemoryObj` returned. For a 32 MiB chunk those
copies cost as much as the network. A client library cannot read into a caller's buffer, so
for ``GET`` kvplug keeps connections of its own and reads the RESP2 reply itself with an
:class:`asyncio.BufferedProtocol` that drives one :class:`~kvplug.frame.FrameReceiver` per
value (:meth:`kvplug.backend.BytesBackend.receive_frames`):

1. the bulk-string length line and the frame header arrive in a small buffer of the
   connection; the receiver is started with the value's length and given the header;
2. the receiver answers with the memory the payload goes to (the caller's buffer for
   ``get_into``, the object ``get`` returns, or a scratch buffer for another serde), and from
   then on the protocol hands the transport views of *that memory*, so the kernel (or the TLS
   layer, decrypting) writes the payload there, with no copy in between; a value the receiver
   does not want (damaged, not the caller's size, a full allocator) is drained;
3. the trailing CRLF is read; the receiver verifies the payload afterwards.

**Memory safety.** While a reply is arriving, the transport may write into a receiver's memory
at any read. An operation that ends early (cancelled, past its deadline, or the connection
broke) therefore aborts the transport, which stops all reads at once, and detaches the
protocol from the memory *before* :meth:`DirectReads.fetch` returns or raises, so before the
receivers are abandoned; such a connection is never pooled again, since its stream is at an
unknown point.

The pool (:class:`DirectReads`) keeps idle connections for reuse, opens a bounded number at
once (a burst of tasks waits for, and then reuses, the connections being opened rather than
starting one TLS handshake each), logs in on each new one (``AUTH``, ``SELECT``, ``CLIENT
SETNAME``), retries once on a fresh connection when one breaks (after a server restart every
pooled connection is dead) and asks its ``locate`` callable where the server is, again after
a broken connection, a ``READONLY`` reply or :meth:`DirectReads.forget` (a Sentinel failover
moved the master). Replies read on a connection opened before the last :meth:`~DirectReads.forget`
are dropped and the ``GET`` s sent again: they may come from a deposed master.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

from kvplug.errors import BackendError
from kvplug.frame import FrameReceiver
from kvplug_redis.connections import Waiters

HEAD_SIZE = 64 << 10
"""Bytes of a connection's buffer for reply lines and frame headers (and drained values)."""
MAX_LINE = HEAD_SIZE // 2
"""A reply line (an error message) longer than this is not Redis speaking."""
MOVED_RETRIES = 3
"""Times a fetch is sent again because the master moved while it ran, before it fails."""
RETRY_DELAY = (0.01, 0.1)
"""Seconds before the one retry on a fresh connection, drawn at random in this range so that
many operations broken by one restart do not reconnect at the same instant."""


class ConnectionLost(ConnectionError):
    """The connection broke, or was aborted, before the reply was complete."""


class MasterMoved(ConnectionLost):
    """The master moved while a fetch ran: its replies may come from the old one."""


@dataclass(frozen=True)
class Endpoint:
    """Where to connect: a TCP host and port, or a unix socket path."""

    host: str = ""
    port: int = 0
    path: str | None = None


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


class _Reply:
    """One expected reply: a value for ``receiver``, or a ``+OK`` (set-up commands) when there
    is none; ``error`` is the error reply that came instead."""

    __slots__ = ("error", "receiver")

    def __init__(self, receiver: FrameReceiver | None = None) -> None:
        self.receiver = receiver
        self.error: str | None = None


class _Phase:
    """Where :class:`_ReplyReader` is in the stream: at a reply line, in a value's frame header,
    in the rest of the value (received or drained), before its CRLF; or detached."""

    LINE = 0
    HEADER = 1
    VALUE = 2
    CRLF = 3
    DEAD = 4


class _ReplyReader(asyncio.BufferedProtocol):
    """Receives the replies of one connection, in order, as they are expected (:meth:`expect`).

    Reply lines and frame headers go into ``_head``; the rest of a value goes into the memory
    its receiver named (its sink) or, drained, into ``_head`` again and again. After
    :meth:`detach` nothing is written anywhere but ``_head``.
    """

    def __init__(self) -> None:
        self._head = bytearray(HEAD_SIZE)
        self._start = 0
        self._end = 0
        self._phase = _Phase.LINE
        self._replies: collections.deque[_Reply] = collections.deque()
        self._done: asyncio.Future[None] | None = None
        self._left = 0
        self._sink: memoryview | None = None
        self._sink_pos = 0
        self._into_head = True
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None

    # -- what the connection asks ----------------------------------------------------------

    def expect(self, replies: Sequence[_Reply]) -> asyncio.Future[None]:
        """A future that is done when all ``replies`` have arrived, or failed when the
        connection breaks first."""
        self._done = asyncio.get_running_loop().create_future()
        if self.lost is not None:
            self._done.set_exception(self._lost_error())
        elif not replies:
            self._done.set_result(None)
        else:
            self._replies.extend(replies)
        return self._done

    def detach(self) -> None:
        """Never write into a receiver's memory again (the connection is being aborted)."""
        self._sink = None
        self._phase = _Phase.DEAD
        self._replies.clear()

    # -- asyncio's side ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = exc or ConnectionLost("the server closed the connection")
        self.detach()
        self._fail(self._lost_error())

    def eof_received(self) -> bool:
        return False

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._phase == _Phase.DEAD:
            self._start = self._end = 0  # whatever still arrives is dropped
        if self._start == self._end:
            self._start = self._end = 0
            if self._phase == _Phase.VALUE:
                self._into_head = False
                if self._sink is not None:
                    return self._sink[self._sink_pos : self._sink_pos + self._left]
                return memoryview(self._head)[: min(self._left, HEAD_SIZE)]
        elif self._end == HEAD_SIZE:
            held = self._end - self._start
            self._head[:held] = self._head[self._start : self._end]
            self._start, self._end = 0, held
        self._into_head = True
        return memoryview(self._head)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._into_head:
                self._end += nbytes
                self._advance()
                return
            self._left -= nbytes
            if self._sink is not None:
                self._sink_pos += nbytes
            if not self._left:
                self._sink = None
                self._phase = _Phase.CRLF
        except Exception as error:  # a bug must not leave the caller waiting forever
            self._broken(f"{type(error).__name__}: {error}")

    # -- parsing -------------------------------------------------------------------------------

    def _advance(self) -> None:
        head = self._head
        while True:
            held = self._end - self._start
            phase = self._phase
            if phase == _Phase.LINE:
                if not held:
                    return
                if not self._replies:
                    self._broken("data arrived that no command asked for")
                    return
                cr = head.find(b"\r\n", self._start, self._end)
                if cr < 0:
                    if held > MAX_LINE:
                        self._broken(f"a reply line longer than {MAX_LINE} bytes")
                    return
                line = bytes(head[self._start : cr])
                self._start = cr + 2
                self._on_line(line)
            elif phase == _Phase.HEADER:
                receiver = self._replies[0].receiver
                assert receiver is not None
                available = memoryview(head)[self._start : self._end]
                wanted = receiver.header_len(available)
                if held < wanted:
                    return
                sink = receiver.take_header(available[:wanted])
                self._start += wanted
                self._take_value(receiver.remaining, sink)
            elif phase == _Phase.VALUE:
                if not held:
                    return
                take = min(held, self._left)
                if self._sink is not None:
                    end = self._sink_pos + take
                    self._sink[self._sink_pos : end] = memoryview(head)[
                        self._start : self._start + take
                    ]
                    self._sink_pos = end
                self._start += take
                self._left -= take
                if not self._left:
                    self._sink = None
                    self._phase = _Phase.CRLF
            elif phase == _Phase.CRLF:
                if held < 2:
                    return
                if head[self._start : self._start + 2] != b"\r\n":
                    self._broken("a bulk string without its CRLF")
                    return
                self._start += 2
                self._complete()
            else:
                return

    def _on_line(self, line: bytes) -> None:
        reply = self._replies[0]
        kind, rest = line[:1], line[1:]
        receiver = reply.receiver
        if kind == b"-":
            reply.error = rest.decode("utf-8", "replace")
            self._complete()
        elif kind == b"+" and receiver is None:
            self._complete()
        elif kind == b"$" and receiver is not None and rest.lstrip(b"-").isdigit():
            length = int(rest)
            if length < 0:
                self._complete()  # $-1: no such key, the receiver stays a miss
                return
            receiver.start(length)
            self._phase = _Phase.HEADER
        else:
            self._broken(f"an unexpected reply {line[:40]!r}")

    def _take_value(self, length: int, sink: memoryview | None) -> None:
        """Receive the next ``length`` bytes into ``sink``, or drain them."""
        self._left = length
        self._sink = sink if length else None
        self._sink_pos = 0
        self._phase = _Phase.VALUE if length else _Phase.CRLF

    def _complete(self) -> None:
        self._replies.popleft()
        self._phase = _Phase.LINE
        if not self._replies and self._done is not None and not self._done.done():
            self._done.set_result(None)

    # -- failures -------------------------------------------------------------------------------

    def _lost_error(self) -> BaseException:
        error = ConnectionLost(f"the connection broke: {self.lost}")
        error.__cause__ = self.lost
        return error

    def _fail(self, error: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)

    def _broken(self, what: str) -> None:
        """The stream cannot be trusted any more: stop reading and fail the request."""
        self.detach()
        if self.transport is not None:
            self.transport.abort()
        self.lost = BackendError(
            f"the server sent {what}; it does not speak the Redis protocol as kvplug expects, "
            "or the stream was damaged. The connection was dropped."
        )
        self._fail(self.lost)


class _Connection:
    """One of the pool's connections; used by one operation at a time."""

    def __init__(self, transport: asyncio.Transport, reader: _ReplyReader, generation: int) -> None:
        self.transport = transport
        self.reader = reader
        self.generation = generation
        self.loop = asyncio.get_running_loop()

    @property
    def usable(self) -> bool:
        return self.reader.lost is None and not self.transport.is_closing()

    async def request(self, data: bytes, replies: Sequence[_Reply]) -> None:
        """Send ``data`` and wait for ``replies``. Anything that ends this early (the deadline,
        a cancellation, a broken connection) aborts the connection before it raises, so no
        receiver's memory is written afterwards."""
        try:
            done = self.reader.expect(replies)
            self.transport.write(data)
            await done
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        self.reader.detach()
        self.transport.abort()


class DirectReads:
    """A pool of connections that serve ``GET`` s through :class:`_ReplyReader`.

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

    async def fetch(self, names: Sequence[str], receivers: Sequence[FrameReceiver]) -> None:
        """``GET`` each of ``names``, pipelined on one connection, each value fed to the
        receiver at its position (see :class:`~kvplug.frame.FrameReceiver`; a missing key
        leaves it untouched). A broken connection is retried once, on a new one; error
        replies raise the first of them (as the library's exception) once every reply is
        read. Replies that may come from a deposed master (:meth:`forget` ran meanwhile) are
        dropped and the ``GET`` s sent again. When this returns or raises, nothing writes into
        the receivers' memory any more."""
        data = b"".join(pack(b"GET", name.encode()) for name in names)
        broken = moved = 0
        while True:
            try:
                await self._fetch_once(data, receivers)
                return
            except MasterMoved:
                moved += 1
                if moved > MOVED_RETRIES:
                    raise
                restart(receivers)
                continue
            except OSError:
                self.forget()
                if self._suspect is not None:
                    self._suspect()
                broken += 1
                if self._closed or broken > 1:
                    raise
                restart(receivers)
            await asyncio.sleep(random.uniform(*RETRY_DELAY))

    async def _fetch_once(self, data: bytes, receivers: Sequence[FrameReceiver]) -> None:
        conn = await self._acquire()
        replies = [_Reply(receiver) for receiver in receivers]
        try:
            await conn.request(data, replies)
        except BaseException:
            self._drop(conn)
            raise
        if conn.generation != self._generation:
            self._drop(conn)
            raise MasterMoved("the master moved while the replies were read; they were dropped")
        self._release(conn)
        self.gets += len(replies)
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
        reader = _ReplyReader()
        if endpoint.path is not None:
            transport, _ = await loop.create_unix_connection(lambda: reader, endpoint.path)
        else:
            transport, _ = await loop.create_connection(
                lambda: reader,
                endpoint.host,
                endpoint.port,
                ssl=self._ssl,
                server_hostname=endpoint.host if self._ssl is not None else None,
            )
        conn = _Connection(transport, reader, generation)
        self._live.add(conn)
        self.connects += 1
        if self._closed:
            self._drop(conn)
            raise ConnectionLost("the backend was closed while connecting")
        if self._setup_count:
            replies = [_Reply() for _ in range(self._setup_count)]
            try:
                await conn.request(self._setup, replies)
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
    "DirectReads",
    "Endpoint",
    "pack",
    "reply_error",
    "restart",
]
