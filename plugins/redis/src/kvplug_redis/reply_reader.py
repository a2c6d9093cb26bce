"""The replies of one of kvplug's own Redis connections, received as they arrive: reply lines
and frame headers into a small buffer of the connection, the rest of each ``GET`` value straight
into the memory its :class:`~kvplug.frame.FrameReceiver` names (or drained).

:class:`ReplyReader` is the connection's buffered protocol (of an asyncio transport, or of a
:class:`~kvplug_redis.socket_link.SocketLink`); :class:`Reply` is one reply it expects.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Protocol, cast

from kvplug.errors import BackendError
from kvplug.frame import FrameReceiver

HEAD_SIZE = 64 << 10
"""Bytes of a connection's buffer for reply lines and frame headers (and drained values)."""
MAX_LINE = HEAD_SIZE // 2
"""A reply line (an error message) longer than this is not Redis speaking."""


class ConnectionLost(ConnectionError):
    """The connection broke, or was aborted, before the reply was complete."""


class Link(Protocol):
    """What a connection and its :class:`ReplyReader` need of the link under them: an asyncio
    transport (TLS) or a :class:`~kvplug_redis.socket_link.SocketLink` (plain TCP, unix
    socket)."""

    def abort(self) -> None: ...

    def is_closing(self) -> bool: ...


class Reply:
    """One expected reply: a value for ``receiver``, else a status (``+OK``: set-up commands,
    ``SET``) or, with ``integer``, an integer (``EXISTS``), kept in :attr:`number`; ``error``
    is the error reply that came instead."""

    __slots__ = ("error", "kind", "number", "receiver")

    def __init__(self, receiver: FrameReceiver | None = None, *, integer: bool = False) -> None:
        self.receiver = receiver
        self.kind = b"$" if receiver is not None else b":" if integer else b"+"
        self.number = 0
        self.error: str | None = None


class Phase:
    """Where :class:`ReplyReader` is in the stream: at a reply line, in a value's frame header,
    in the rest of the value (received or drained), before its CRLF; or detached."""

    LINE = 0
    HEADER = 1
    VALUE = 2
    CRLF = 3
    DEAD = 4


class ReplyReader(asyncio.BufferedProtocol):
    """Receives the replies of one connection, in order, as they are expected (:meth:`expect`).

    Reply lines and frame headers go into ``_head``; the rest of a value goes into the memory
    its receiver named (its sink) or, drained, into ``_head`` again and again. After
    :meth:`detach` nothing is written anywhere but ``_head``.
    """

    def __init__(self) -> None:
        self._head = bytearray(HEAD_SIZE)
        self._start = 0
        self._end = 0
        self._phase = Phase.LINE
        self._replies: collections.deque[Reply] = collections.deque()
        self._done: asyncio.Future[None] | None = None
        self._left = 0
        self._sink: memoryview | None = None
        self._sink_pos = 0
        self._into_head = True
        self.transport: Link | None = None
        self.lost: BaseException | None = None

    # -- what the connection asks ----------------------------------------------------------

    def expect(self, replies: Sequence[Reply]) -> asyncio.Future[None]:
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
        self._phase = Phase.DEAD
        self._replies.clear()

    # -- asyncio's side ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport | Link) -> None:
        # Not an isinstance check: uvloop's TLS transport is no asyncio.Transport subclass.
        self.transport = cast("Link", transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = exc or ConnectionLost("the server closed the connection")
        self.detach()
        self._fail(self._lost_error())

    def eof_received(self) -> bool:
        return False

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._phase == Phase.DEAD:
            self._start = self._end = 0  # whatever still arrives is dropped
        if self._start == self._end:
            self._start = self._end = 0
            if self._phase == Phase.VALUE:
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
                self._sink_received()
            if not self._left:
                self._sink = None
                self._phase = Phase.CRLF
        except Exception as error:  # a bug must not leave the caller waiting forever
            self._broken(f"{type(error).__name__}: {error}")

    # -- parsing -------------------------------------------------------------------------------

    def _advance(self) -> None:
        head = self._head
        while True:
            held = self._end - self._start
            phase = self._phase
            if phase == Phase.LINE:
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
            elif phase == Phase.HEADER:
                receiver = self._replies[0].receiver
                assert receiver is not None
                available = memoryview(head)[self._start : self._end]
                wanted = receiver.header_len(available)
                if held < wanted:
                    return
                sink = receiver.take_header(available[:wanted])
                self._start += wanted
                self._take_value(receiver.remaining, sink)
            elif phase == Phase.VALUE:
                if not held:
                    return
                take = min(held, self._left)
                if self._sink is not None:
                    end = self._sink_pos + take
                    self._sink[self._sink_pos : end] = memoryview(head)[
                        self._start : self._start + take
                    ]
                    self._sink_pos = end
                    self._sink_received()
                self._start += take
                self._left -= take
                if not self._left:
                    self._sink = None
                    self._phase = Phase.CRLF
            elif phase == Phase.CRLF:
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
        elif kind != reply.kind:
            self._broken(f"an unexpected reply {line[:40]!r}")
        elif kind == b"+":
            self._complete()
        elif kind == b":" and rest.lstrip(b"-").isdigit():
            reply.number = int(rest)
            self._complete()
        elif kind == b"$" and receiver is not None and rest.lstrip(b"-").isdigit():
            length = int(rest)
            if length < 0:
                self._complete()  # $-1: no such key, the receiver stays a miss
                return
            receiver.start(length)
            self._phase = Phase.HEADER
        else:
            self._broken(f"an unexpected reply {line[:40]!r}")

    def _take_value(self, length: int, sink: memoryview | None) -> None:
        """Receive the next ``length`` bytes into ``sink``, or drain them."""
        self._left = length
        self._sink = sink if length else None
        self._sink_pos = 0
        self._phase = Phase.VALUE if length else Phase.CRLF

    def _sink_received(self) -> None:
        """Tell the value's receiver how far its sink is written (it hashes as bytes land)."""
        receiver = self._replies[0].receiver
        assert receiver is not None  # a sink is only ever a receiver's
        receiver.received(self._sink_pos)

    def _complete(self) -> None:
        self._replies.popleft()
        self._phase = Phase.LINE
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


__all__ = ["HEAD_SIZE", "MAX_LINE", "ConnectionLost", "Link", "Phase", "Reply", "ReplyReader"]
