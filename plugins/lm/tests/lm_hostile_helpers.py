"""Raw-socket tools for the hostile-input tests and the fuzz run of ``kvplug lm-server``.

* :func:`exchange`: send bytes on a fresh connection, half-close, and read until the server
  closes (what a malformed frame gets back, and whether the server hung up).
* :class:`Bystander`: an honest client on its own thread that puts and gets random objects
  and checks every byte, pausable so that allocator usage can be read at a quiet moment.
* :func:`inflight_bytes`, :func:`protocol_errors`: what :meth:`LMServer.stats` says about
  memory held outside stored objects (receive buffers) and rejected frames.
* :class:`ErrorLog`: collects ERROR records of the server's loggers (and asyncio's), so an
  exception the server swallowed still fails the test.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvplug_lm import wire
from kvplug_lm.wire import Code, Command
from kvplug_testing.lm import health
from kvplug_testing.ports import HOST

VALID_KEY = "test-model@1@0@{:x}@half"


def lm_key(index: int) -> bytes:
    """A key in LMCache 0.5.x's form."""
    return VALID_KEY.format(index).encode()


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, step: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step)


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes, or ConnectionError when the server closes first."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError(f"server closed after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


@dataclass
class Exchange:
    """What a raw connection got back: the bytes, and whether the server closed it."""

    reply: bytes
    closed: bool
    reset: bool = False


def read_until_closed(sock: socket.socket, timeout: float = 20.0, limit: int = 1 << 22) -> Exchange:
    """Read until EOF, a reset or ``timeout``; bytes beyond ``limit`` are dropped."""
    deadline = time.monotonic() + timeout
    reply = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return Exchange(bytes(reply), closed=False)
        ready, _, _ = select.select([sock], [], [], min(left, 0.5))
        if not ready:
            continue
        try:
            chunk = sock.recv(1 << 16)
        except (ConnectionResetError, BrokenPipeError):
            return Exchange(bytes(reply), closed=True, reset=True)
        if not chunk:
            return Exchange(bytes(reply), closed=True)
        if len(reply) < limit:
            reply += chunk


def exchange(port: int, data: bytes, *, half_close: bool = True, timeout: float = 20.0) -> Exchange:
    """Send ``data`` on a fresh connection, half-close it (EOF after the frame), and read
    until the server closes. A server that stops reading mid-way may reset: that counts as
    closed."""
    with connect(port, timeout) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (ConnectionResetError, BrokenPipeError):
            return Exchange(b"", closed=True, reset=True)
        return read_until_closed(sock, timeout)


def hang_up_without_fin(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): a client that vanishes."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def plain_replies(data: bytes) -> list[wire.PlainReply]:
    """The plain reply headers at the start of ``data`` (payloads skipped)."""
    replies = []
    offset = 0
    while offset + wire.PLAIN_REPLY.size <= len(data):
        reply = wire.unpack_plain_reply(data[offset : offset + wire.PLAIN_REPLY.size])
        replies.append(reply)
        offset += wire.PLAIN_REPLY.size + max(reply.length, 0)
    return replies


def plain_put(sock: socket.socket, key: bytes, payload: bytes) -> None:
    sock.sendall(
        wire.pack_plain_request(
            Command.PUT, key, length=len(payload), fmt=0, dtype=6, shape=(len(payload),)
        )
    )
    sock.sendall(payload)


def plain_get(sock: socket.socket, key: bytes) -> bytes | None:
    sock.sendall(wire.pack_plain_request(Command.GET, key))
    reply = wire.unpack_plain_reply(recv_exact(sock, wire.PLAIN_REPLY.size))
    if reply.code != Code.SUCCESS:
        return None
    return recv_exact(sock, reply.length)


def plain_exists(port: int, key: bytes) -> bool:
    with connect(port) as sock:
        sock.sendall(wire.pack_plain_request(Command.EXIST, key))
        reply = wire.unpack_plain_reply(recv_exact(sock, wire.PLAIN_REPLY.size))
    return reply.code == Code.SUCCESS


def hello(sock: socket.socket) -> wire.Hello:
    """Open the extended mode on ``sock`` (the kvplug hello); the server's limits."""
    sock.sendall(wire.pack_plain_request(Command.HEALTH, wire.HELLO_KEY))
    reply = wire.unpack_plain_reply(recv_exact(sock, wire.PLAIN_REPLY.size))
    assert wire.is_kvplug_hello(reply), f"not a kvplug hello reply: {reply}"
    return wire.unpack_hello_body(recv_exact(sock, reply.length))


HELLO_REQUEST = wire.pack_plain_request(Command.HEALTH, wire.HELLO_KEY)
HELLO_REPLY_BYTES = wire.PLAIN_REPLY.size + wire.HELLO_BODY.size


def alive(port: int) -> bool:
    """A fresh connection's plain HEALTH answers 200 (generous timeout: busy machines)."""
    return wait_until(lambda: health(port, timeout=5.0), timeout=20.0, step=0.1)


# -- the server's own accounting ------------------------------------------------------------


def inflight_bytes(stats: Mapping[str, Any]) -> int:
    """Allocator bytes not held by a stored object: receive buffers of requests in flight
    (and objects being sent after an eviction). Zero on a quiet server; anything left after
    the clients are gone is a leak."""
    return int(stats["allocator_used"]) - int(stats["bytes_stored"])


def protocol_errors(stats: Mapping[str, Any]) -> int:
    """Frames the server rejected, all kinds together."""
    value = stats.get("protocol_errors", 0)
    if isinstance(value, Mapping):
        return sum(int(v) for v in value.values())
    return int(value)


# -- an honest client beside the hostile ones ------------------------------------------------


@dataclass
class Bystander:
    """A plain LMCache-style client on its own thread: PUT then GET of random objects on one
    connection, every byte compared. ``failures`` lists what went wrong; :meth:`quiet` holds
    it between two operations."""

    port: int
    keys: int = 8
    max_size: int = 64 << 10
    failures: list[str] = field(default_factory=list)
    operations: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Bystander:
        self._thread = threading.Thread(target=self._run, name="lm-bystander", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        rng = random.Random(os.getpid())
        sock: socket.socket | None = None
        try:
            sock = connect(self.port, timeout=30.0)
            while not self._stop.is_set():
                with self._lock:
                    key = f"bystander@1@0@{rng.randrange(self.keys):x}@half".encode()
                    payload = rng.randbytes(rng.randrange(1, self.max_size))
                    plain_put(sock, key, payload)
                    got = plain_get(sock, key)
                    self.operations += 1
                    if got != payload:
                        self.failures.append(
                            f"GET {key!r} after PUT of {len(payload)} bytes returned "
                            f"{'a miss' if got is None else f'{len(got)} different bytes'}"
                        )
                        return
                time.sleep(0.001)
        except Exception as error:  # any failure of an honest client is the finding
            self.failures.append(f"{type(error).__name__}: {error}")
        finally:
            if sock is not None:
                sock.close()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """No request of this client is in flight inside the block."""
        with self._lock:
            yield

    def check(self) -> None:
        """Fail when the client saw a wrong byte or an error, or stopped."""
        assert not self.failures, f"the honest client was affected: {self.failures}"
        assert self._thread is not None and self._thread.is_alive(), "bystander stopped"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


# -- errors the server logged ------------------------------------------------------------------


class ErrorLog(logging.Handler):
    """ERROR records of ``kvplug_lm`` and ``asyncio`` (unhandled task exceptions land there)."""

    LOGGERS = ("kvplug_lm", "asyncio", "kvplug")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> ErrorLog:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)

    def take(self) -> list[str]:
        """The records so far, formatted (with tracebacks), and forget them."""
        formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
        taken = [formatter.format(record) for record in self.records]
        self.records.clear()
        return taken


__all__ = [
    "HELLO_REPLY_BYTES",
    "HELLO_REQUEST",
    "Bystander",
    "ErrorLog",
    "Exchange",
    "alive",
    "connect",
    "exchange",
    "hang_up_without_fin",
    "hello",
    "inflight_bytes",
    "lm_key",
    "plain_exists",
    "plain_get",
    "plain_put",
    "plain_replies",
    "protocol_errors",
    "read_until_closed",
    "recv_exact",
    "wait_until",
]
