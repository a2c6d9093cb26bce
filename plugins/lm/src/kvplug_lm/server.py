"""``kvplug lm-server``: a cache server that speaks LMCache 0.5.6's ``lm://`` protocol (plain
mode, for LMCache's own ``lm://`` connector) and kvplug's extended mode (for kvplug's client),
with a memory cap, LRU eviction, optional spill to any kvplug tier, limits against hostile
clients, Prometheus metrics and a graceful shutdown.

Run it::

    kvplug lm-server --max-memory 16GiB              # or: python -m kvplug_lm.server ...
    kvplug lm-server --spill file:///var/cache/kvplug-lm --metrics-port 9464

or in-process (tests, benchmarks)::

    >>> from kvplug_lm.server import ServerOptions, run_in_thread
    >>> with run_in_thread(ServerOptions(port=0, max_memory=1 << 20)) as server:
    ...     server.port > 0
    True

How each request is answered is in :mod:`kvplug_lm.wire`. What this server chooses where
LMCache's protocol leaves it open:

* A plain PUT has no reply. One the server cannot store (larger than ``--max-object-bytes`` or
  ``--max-memory``, or no room because everything left is being sent) has its payload read
  and discarded, so the connection stays usable; it is counted (``protocol_errors`` ``too_large``
  / ``no_space``) and a later GET misses. Discarding is paced like receiving: a payload that
  stalls for ``--frame-timeout`` or arrives slower than ``--min-rate`` closes the connection.
* ``--max-object-bytes`` is 2 GiB - 1 by default (what a plain header can carry); extended
  clients may be allowed more by raising it. The hello tells a kvplug client the effective
  limit: the smaller of it and what ``--max-memory`` holds beside a record header.
* A plain LIST gets 400 (LMCache's server sends nothing, which leaves its client waiting).
* A plain HEALTH is answered even with ``--plain deny`` (it reads nothing; the hello is one).
* A protocol error (an unknown command, a negative length, an unknown format or dtype code, a
  malformed key) gets 400 when its command expects a reply (BAD_REQUEST with the reason in
  the extended mode), then the connection is closed.
* An extended object whose key or size is over the limit gets TOO_LARGE after its bytes were
  read and discarded; only a key longer than :data:`HARD_KEY_LIMIT` closes the connection.
* An object stored in one mode is readable in the other: a plain GET of an extended object
  that a plain header cannot describe (more than 4 dims, a kvplug-only dtype, over 2 GiB)
  misses with 400.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import xxhash

from kvplug.errors import KvplugError
from kvplug.memory import DTYPES_BY_CODE
from kvplug.units import GiB, format_size, parse_size
from kvplug_lm import wire
from kvplug_lm.memstore import (
    EXTENDED,
    PLAIN,
    PLAIN_META,
    RECORD,
    Entry,
    MemStore,
    record_header_len,
)

if TYPE_CHECKING:
    import click

    command: click.Command
    """The ``kvplug lm-server`` click command (built on first use: click is optional)."""

logger = logging.getLogger("kvplug_lm.server")

DEFAULT_PORT = 65432
READ_AHEAD = 64 * 1024
"""Bytes of each connection's read-ahead buffer (headers, keys and small payloads)."""
HARD_KEY_LIMIT = 32 * 1024
"""Extended keys longer than this close the connection (they are not even read)."""
MAX_SMALL_PAYLOAD = 4 << 20
"""The largest EXISTS_MANY payload (a list of keys; about 70 000 LMCache keys)."""
MAX_META = wire.META.size + wire.MAX_RANK * wire.DIM.size
INLINE_SEND = 64 * 1024
"""Payloads up to this size go out in the same send as their header."""

_EXT_DTYPES = frozenset({0, *DTYPES_BY_CODE})
_OP_NAMES = {op.value: op.name for op in wire.Op}
_COMMAND_NAMES = {c.value: c.name for c in wire.Command}
_REPLYING_COMMANDS = frozenset(
    {wire.Command.GET, wire.Command.EXIST, wire.Command.LIST, wire.Command.HEALTH}
)


@dataclass(frozen=True)
class ServerOptions:
    """Everything ``kvplug lm-server`` is told (each field is the option of the same name)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    """0: any free port (:attr:`LMServer.port` is the one bound)."""
    max_memory: int = 4 * GiB
    """Bytes of the one buffer every object lives in; least recently used objects go first."""
    spill: str | None = None
    """A kvplug tier URL evicted objects are written to (and read back from)."""
    max_key_bytes: int = 1024
    """Longest extended key; plain keys are at most 150 bytes whatever this says."""
    max_object_bytes: int = wire.INT32_MAX
    """Largest object; plain objects are at most 2 GiB - 1 bytes whatever this says."""
    idle_timeout: float = 300.0
    """Seconds a connection may wait between requests."""
    frame_timeout: float = 10.0
    """Seconds a started request header may take to arrive."""
    min_rate: int = 1 << 20
    """Bytes per second a payload must at least arrive (or leave) at."""
    max_connections: int = 1024
    secret: bytes | None = field(default=None, repr=False)
    """The shared secret of the extended mode's AUTH (never printed)."""
    plain: Literal["allow", "deny"] | None = None
    """Plain LMCache clients: allowed without a secret, denied with one, unless set."""
    metrics_port: int | None = None
    shutdown_grace: float = 30.0
    loop: Literal["auto", "asyncio", "uvloop"] = "auto"

    @property
    def plain_allowed(self) -> bool:
        if self.plain is None:
            return self.secret is None
        return self.plain == "allow"

    def __post_init__(self) -> None:
        if not 1 <= self.max_key_bytes <= HARD_KEY_LIMIT:
            raise ValueError(
                f"max_key_bytes is {self.max_key_bytes}; it must be 1 to {HARD_KEY_LIMIT}."
            )
        for name in ("idle_timeout", "frame_timeout", "shutdown_grace"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive number of seconds.")
        if self.min_rate <= 0 or self.max_connections <= 0 or self.max_object_bytes <= 0:
            raise ValueError("min_rate, max_connections and max_object_bytes must be positive.")


class _PeerGone(Exception):
    """The peer closed the connection (or reset it)."""


class _Close(Exception):
    """End this connection (a protocol error was answered, or plain clients are denied)."""


class _Reader:
    """A connection's read-ahead buffer over a non-blocking socket."""

    __slots__ = ("buf", "end", "loop", "server", "sock", "start", "view")

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, server: LMServer):
        self.loop = loop
        self.sock = sock
        self.server = server
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
            count = await self.loop.sock_recv_into(self.sock, self.view[self.end :])
            if count == 0:
                raise _PeerGone
            self.end += count
            self.server.counters["bytes_received"] += count

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
        options = self.server.options
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
        counters = self.server.counters
        start, frame_timeout, min_rate = self._pace()
        async with asyncio.timeout_at(start + frame_timeout) as budget:
            position = take
            while position < len(dest):
                count = await self.loop.sock_recv_into(self.sock, dest[position:])
                if count == 0:
                    raise _PeerGone
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


class _Connection:
    __slots__ = ("authenticated", "idle", "nonce", "peer", "reader", "sock", "task")

    def __init__(self, sock: socket.socket, reader: _Reader, peer: str) -> None:
        self.sock = sock
        self.reader = reader
        self.peer = peer
        self.idle = True
        self.nonce: bytes | None = None
        self.authenticated = False
        self.task: asyncio.Task[None] | None = None


class LMServer:
    """The server: :meth:`start` binds, :meth:`serve_forever` runs until :meth:`stop`.

    Use it from one event loop (the one :meth:`start` runs on); :func:`run_in_thread` gives
    it a loop of its own in a daemon thread.
    """

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.counters: Counter[str] = Counter()
        self.requests: Counter[tuple[str, str, str]] = Counter()
        self.protocol_errors: Counter[str] = Counter()
        self.store: MemStore | None = None
        self.port = 0
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._connections: set[_Connection] = set()
        self._stopping = False
        self._stopped: asyncio.Event | None = None
        self._metrics_server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- life cycle --------------------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the server runs on (once :meth:`start` ran); its store is touched
        only there."""
        if self._loop is None:
            raise RuntimeError("the server has not started; await start() first")
        return self._loop

    async def start(self) -> None:
        """Open the spill tier, allocate the buffer, bind and listen (SO_REUSEADDR)."""
        options = self.options
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        if options.spill:
            import kvplug

            self.store = MemStore(options.max_memory)
            self.store.spill = await kvplug.open_backend(
                options.spill, allocator=self.store.allocator
            )
        else:
            self.store = MemStore(options.max_memory)
        try:
            self._listener = self._bind()
        except BaseException:
            await self.store.close()
            raise
        self.port = self._listener.getsockname()[1]
        if options.metrics_port is not None:
            self._start_metrics()
        self._accept_task = self._loop.create_task(self._accept_loop())
        logger.info(
            "kvplug lm-server listening on %s:%d (max memory %s, spill %s, plain clients %s, "
            "auth %s, loop %s)",
            options.host,
            self.port,
            format_size(self.store.capacity),
            _masked(options.spill) if options.spill else "off",
            "allowed" if options.plain_allowed else "denied",
            "required" if options.secret else "off",
            type(self._loop).__module__.split(".")[0],
        )

    def _bind(self) -> socket.socket:
        options = self.options
        infos = socket.getaddrinfo(
            options.host, options.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, address = infos[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(min(socket.SOMAXCONN, 4096))
            listener.setblocking(False)
        except OSError as error:
            listener.close()
            raise OSError(
                error.errno,
                f"kvplug lm-server cannot listen on {options.host}:{options.port}: "
                f"{error.strerror}. Choose another --port (0 picks a free one) or stop what "
                "holds this one.",
            ) from None
        return listener

    async def serve_forever(self) -> None:
        """Return once :meth:`stop` has finished."""
        assert self._stopped is not None, "call start() first"
        await self._stopped.wait()

    async def stop(self) -> None:
        """Stop accepting, let requests whose header arrived finish (at most
        ``shutdown_grace`` seconds), close idle connections and the spill tier."""
        if self._stopped is None:
            return
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
        if self._listener is not None:
            self._listener.close()
        for connection in list(self._connections):
            if connection.idle and connection.task is not None:
                connection.task.cancel()
        tasks = [c.task for c in self._connections if c.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.options.shutdown_grace)
            for task in pending:
                task.cancel()
            if pending:
                logger.warning(
                    "%d connection(s) still busy after the %s s shutdown grace were cut off",
                    len(pending),
                    self.options.shutdown_grace,
                )
                await asyncio.wait(pending, timeout=5)
        if self.store is not None:
            await self.store.close()
        if self._metrics_server is not None:
            server, thread = self._metrics_server
            server.shutdown()
            server.server_close()
            thread.join(5)
        logger.info("kvplug lm-server on %s:%d stopped", self.options.host, self.port)
        self._stopped.set()

    @property
    def object_limit(self) -> int:
        """The largest payload this server stores: ``max_object_bytes``, or what
        ``max_memory`` holds beside the record header of the longest key."""
        capacity = self.store.capacity if self.store is not None else 0
        overhead = RECORD.size + self.options.max_key_bytes + MAX_META
        return max(0, min(self.options.max_object_bytes, capacity - overhead))

    # -- numbers -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The server's counters now (what ``--metrics-port`` exports, under these names).

        Safe from other threads: a snapshot taken while the loop changes a counter is taken
        again."""
        for _ in range(100):
            try:
                return self._stats()
            except RuntimeError:  # a dict changed size while it was copied
                continue
        return self._stats()

    def _stats(self) -> dict[str, Any]:
        store = self.store
        store_counters: Counter[str] = store.counters if store is not None else Counter()
        allocator = store.allocator.stats() if store is not None else None
        return {
            "objects": store.objects if store is not None else 0,
            "bytes_stored": store.bytes_stored if store is not None else 0,
            "capacity": store.capacity if store is not None else 0,
            "allocator_used": allocator.used if allocator is not None else 0,
            "allocator_objects": allocator.object_count if allocator is not None else 0,
            "evictions": store_counters["evictions"],
            "spilling": len(store.spilling) if store is not None else 0,
            "spilled": store_counters["spilled"],
            "spill_hits": store_counters["spill_hits"],
            "spill_errors": store_counters["spill_errors"],
            "spill_corrupt": store_counters["spill_corrupt"],
            "connections": self.counters["connections"],
            "connections_open": len(self._connections),
            "requests_in_flight": sum(not c.idle for c in list(self._connections)),
            "connections_refused": self.counters["connections_refused"],
            "idle_timeouts": self.counters["idle_timeouts"],
            "bytes_received": self.counters["bytes_received"],
            "bytes_sent": self.counters["bytes_sent"],
            "auth_failures": self.counters["auth_failures"],
            "protocol_errors": dict(self.protocol_errors),
            "requests": dict(self.requests),
        }

    def _start_metrics(self) -> None:
        try:
            import prometheus_client
        except ModuleNotFoundError:
            logger.warning(
                "--metrics-port needs prometheus_client, which is not installed: "
                "pip install 'kvplug-lm[server]'; running without metrics"
            )
            return
        registry = prometheus_client.CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        port = self.options.metrics_port
        assert port is not None
        self._metrics_server = prometheus_client.start_http_server(
            port, addr="127.0.0.1", registry=registry
        )

    @property
    def metrics_port(self) -> int | None:
        """The port Prometheus metrics are served on (None when off)."""
        if self._metrics_server is None:
            return None
        return int(self._metrics_server[0].server_port)

    # -- connections -------------------------------------------------------------------------

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        listener = self._listener
        assert listener is not None
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except OSError as error:  # EMFILE and the like: wait, don't spin or die
                logger.warning("accept failed: %s; retrying", error)
                await asyncio.sleep(0.1)
                continue
            if len(self._connections) >= self.options.max_connections:
                self.counters["connections_refused"] += 1
                sock.close()
                continue
            self.counters["connections"] += 1
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
            connection = _Connection(sock, _Reader(loop, sock, self), peer)
            self._connections.add(connection)
            connection.task = loop.create_task(self._serve(connection))

    async def _serve(self, connection: _Connection) -> None:
        reader = connection.reader
        options = self.options
        try:
            while True:
                if reader.buffered == 0:
                    if self._stopping:
                        break
                    connection.idle = True
                    try:
                        async with asyncio.timeout(options.idle_timeout):
                            await reader.wait_readable()
                    except TimeoutError:
                        self.counters["idle_timeouts"] += 1
                        break
                    finally:
                        connection.idle = False
                connection.idle = False
                if reader.buffered < 4:
                    async with asyncio.timeout(options.frame_timeout):
                        await reader._recv(4)
                if reader.peek(4) == wire.EXT_REQUEST_MAGIC:
                    await self._extended(connection)
                else:
                    await self._plain(connection)
                if self._stopping and reader.buffered == 0:
                    break
        except (_PeerGone, ConnectionError):
            pass
        except _Close:
            pass
        except TimeoutError:
            self.protocol_errors["timeout"] += 1
        except asyncio.CancelledError:
            if not self._stopping:
                raise
        except Exception:
            logger.exception("connection from %s failed; closed", connection.peer)
            self.protocol_errors["internal"] += 1
        finally:
            self._connections.discard(connection)
            connection.sock.close()

    def _payload_timeout(self, nbytes: int) -> float:
        return self.options.frame_timeout + nbytes / self.options.min_rate

    async def _send(self, connection: _Connection, *parts: bytes | memoryview) -> None:
        loop = self._loop
        assert loop is not None
        total = sum(len(p) for p in parts)
        sock = connection.sock
        async with asyncio.timeout(self._payload_timeout(total)):
            if len(parts) > 1 and total <= INLINE_SEND:
                await loop.sock_sendall(sock, b"".join(parts))
            else:
                for part in parts:
                    if len(part):
                        await loop.sock_sendall(sock, part)
        self.counters["bytes_sent"] += total

    def _protocol_error(self, kind: str, connection: _Connection, reason: str) -> None:
        self.protocol_errors[kind] += 1
        logger.debug("protocol error (%s) from %s: %s", kind, connection.peer, reason)

    # -- plain mode --------------------------------------------------------------------------

    async def _plain(self, connection: _Connection) -> None:
        store = self.store
        assert store is not None
        options = self.options
        header = await connection.reader.read(wire.PLAIN_REQUEST.size, options.frame_timeout)
        request = wire.unpack_plain_request(header)
        command = request.command
        name = _COMMAND_NAMES.get(command, str(command))
        try:
            wire.check_plain_request(request)
        except wire.WireError as error:
            self._protocol_error(error.kind, connection, str(error))
            self.requests["plain", name, "400"] += 1
            if command in _REPLYING_COMMANDS:
                with contextlib.suppress(Exception):
                    await self._send(connection, wire.pack_plain_reply(wire.Code.FAIL))
            raise _Close from None
        if command == wire.Command.HEALTH:
            if request.key == wire.HELLO_KEY.encode():
                connection.nonce = secrets.token_bytes(wire.NONCE_BYTES)
                hello = wire.Hello(
                    connection.nonce,
                    options.max_key_bytes,
                    self.object_limit,
                    options.secret is not None,
                )
                await self._send(connection, wire.pack_hello_reply(hello))
            else:
                await self._send(connection, wire.pack_plain_reply(wire.Code.SUCCESS))
            self.requests["plain", name, "200"] += 1
            return
        if not options.plain_allowed:
            self._protocol_error("plain_denied", connection, "plain clients are denied")
            self.requests["plain", name, "denied"] += 1
            raise _Close
        key = request.key
        if command == wire.Command.PUT:
            status = await self._plain_put(connection, request)
            self.requests["plain", name, status] += 1
        elif command == wire.Command.GET:
            entry = store.lookup(key) or await store.load_spilled(key)
            described = entry.plain_meta() if entry is not None else None
            if entry is None or described is None:
                await self._send(connection, wire.pack_plain_reply(wire.Code.FAIL))
                self.requests["plain", name, "400"] += 1
                return
            fmt, dtype, shape = described
            reply = wire.pack_plain_reply(
                wire.Code.SUCCESS, length=entry.payload_len, fmt=fmt, dtype=dtype, shape=shape
            )
            await self._send_entry(connection, reply, entry)
            self.requests["plain", name, "200"] += 1
        elif command == wire.Command.EXIST:
            found = key in store or await store.spill_contains(key)
            code = wire.Code.SUCCESS if found else wire.Code.FAIL
            await self._send(connection, wire.pack_plain_reply(code))
            self.requests["plain", name, str(int(code))] += 1
        else:  # LIST: LMCache leaves it unimplemented; a reply keeps its client from hanging
            await self._send(connection, wire.pack_plain_reply(wire.Code.FAIL))
            self.requests["plain", name, "400"] += 1

    async def _plain_put(self, connection: _Connection, request: wire.PlainRequest) -> str:
        store = self.store
        assert store is not None
        length = request.length
        reader = connection.reader
        if length > self.object_limit:
            self._protocol_error("too_large", connection, f"plain PUT of {length} bytes")
            await reader.discard(length)
            return "too_large"
        meta = PLAIN_META.pack(request.fmt, request.dtype, *request.shape)
        received = await self._receive(connection, request.key, PLAIN, meta, length)
        if received is None:
            self._protocol_error("no_space", connection, f"plain PUT of {length} bytes")
            return "no_space"
        store.commit(*received)
        return "stored"

    async def _receive(
        self,
        connection: _Connection,
        key: bytes,
        mode: int,
        meta: bytes,
        length: int,
    ) -> tuple[Entry, int] | None:
        """Allocate a record and receive the payload into it: the record (not yet visible)
        and the payload's xxh3-64; None (payload discarded) when there is no room."""
        store = self.store
        assert store is not None
        block = await store.allocate(record_header_len(key, meta) + length)
        if block is None:
            await connection.reader.discard(length)
            return None
        try:
            entry = store.new_record(key, mode, meta, length, block)
            digest = await connection.reader.read_into(entry.payload)
        except BaseException:
            block.release()
            raise
        return entry, digest

    async def _send_entry(self, connection: _Connection, header: bytes, entry: Entry) -> None:
        block = entry.block.retain()  # alive while sent, even if evicted or replaced meanwhile
        try:
            await self._send(connection, header, entry.payload)
        finally:
            block.release()

    # -- extended mode -----------------------------------------------------------------------

    async def _extended(self, connection: _Connection) -> None:
        options = self.options
        store = self.store
        assert store is not None
        reader = connection.reader
        header = await reader.read(wire.EXT_REQUEST.size, options.frame_timeout)
        request = wire.unpack_ext_request(header)
        op = request.op
        name = _OP_NAMES.get(op, str(op))
        request_id = request.request_id

        async def reply(
            status: wire.Status,
            meta: bytes = b"",
            payload: bytes | memoryview = b"",
            checksum: int | None = None,
        ) -> None:
            head = wire.pack_ext_reply(
                status,
                request_id=request_id,
                meta=meta,
                payload_len=len(payload),
                checksum=checksum,
            )
            await self._send(connection, head, payload)
            self.requests["extended", name, status.name] += 1

        async def refuse(kind: str, reason: str) -> None:
            self._protocol_error(kind, connection, reason)
            with contextlib.suppress(Exception):
                await reply(wire.Status.BAD_REQUEST, payload=reason.encode())
            raise _Close

        if op not in _OP_NAMES:
            await refuse("unknown_command", f"unknown extended op {op} (1 to {max(_OP_NAMES)})")
        if request.key_len > HARD_KEY_LIMIT:
            await refuse("bad_key", f"key length {request.key_len} over {HARD_KEY_LIMIT} bytes")
        if request.meta_len > MAX_META:
            await refuse("bad_meta", f"meta length {request.meta_len} over {MAX_META} bytes")
        keyed = op in (wire.Op.PUT, wire.Op.GET, wire.Op.EXISTS, wire.Op.DELETE)
        if not keyed and request.key_len:
            await refuse("bad_key", f"{name} carries a key")
        if op != wire.Op.PUT and request.meta_len:
            await refuse("bad_meta", f"{name} carries meta")
        if op not in (wire.Op.PUT, wire.Op.EXISTS_MANY, wire.Op.AUTH) and request.payload_len:
            await refuse("bad_length", f"{name} carries a payload of {request.payload_len}")
        if op == wire.Op.EXISTS_MANY and request.payload_len > MAX_SMALL_PAYLOAD:
            await refuse("bad_length", f"EXISTS_MANY payload of {request.payload_len} bytes")
        if op == wire.Op.AUTH and request.payload_len > 1024:
            await refuse("bad_length", f"AUTH payload of {request.payload_len} bytes")
        body = await reader.read(request.key_len + request.meta_len, options.frame_timeout)
        key, meta = body[: request.key_len], body[request.key_len :]

        if options.secret is not None and not connection.authenticated and op != wire.Op.AUTH:
            await reader.discard(request.payload_len)
            self.counters["auth_failures"] += 1
            await reply(wire.Status.AUTH_REQUIRED)
            return
        if keyed and request.key_len > options.max_key_bytes:
            await reader.discard(request.payload_len)
            self._protocol_error("too_large", connection, f"key of {request.key_len} bytes")
            await reply(wire.Status.TOO_LARGE, payload=b"key too long")
            return
        if keyed:
            try:
                wire.check_key(key, options.max_key_bytes)
            except wire.WireError as error:
                await refuse("bad_key", str(error))

        if op == wire.Op.PUT:
            try:
                parsed = wire.unpack_meta(meta)
            except wire.WireError as error:
                await refuse(error.kind, str(error))
            if parsed.dtype not in _EXT_DTYPES:
                await refuse("bad_dtype", f"unknown dtype code {parsed.dtype}")
            length = request.payload_len
            if length > self.object_limit:
                await reader.discard(length)
                self._protocol_error("too_large", connection, f"PUT of {length} bytes")
                await reply(wire.Status.TOO_LARGE, payload=b"object too large")
                return
            received = await self._receive(connection, key, EXTENDED, meta, length)
            if received is None:
                self._protocol_error("no_space", connection, f"PUT of {length} bytes")
                await reply(wire.Status.NO_SPACE)
                return
            entry, digest = received
            if request.flags & wire.FLAG_CHECKSUM and digest != request.checksum:
                entry.block.release()
                self.protocol_errors["bad_checksum"] += 1
                await reply(wire.Status.BAD_CHECKSUM)
                return
            store.commit(entry, digest)
            await reply(wire.Status.OK)
        elif op == wire.Op.GET:
            found = store.lookup(key) or await store.load_spilled(key)
            if found is None:
                await reply(wire.Status.NOT_FOUND)
                return
            block = found.block.retain()
            try:
                await reply(wire.Status.OK, found.ext_meta(), found.payload, found.checksum)
            finally:
                block.release()
        elif op == wire.Op.EXISTS:
            present = key in store or await store.spill_contains(key)
            await reply(wire.Status.OK if present else wire.Status.NOT_FOUND)
        elif op == wire.Op.DELETE:
            removed = await store.delete(key)
            await reply(wire.Status.OK if removed else wire.Status.NOT_FOUND)
        elif op == wire.Op.EXISTS_MANY:
            data = await reader.read_all(request.payload_len)
            try:
                keys = wire.unpack_keys(data, options.max_key_bytes)
            except wire.WireError as error:
                await refuse(error.kind, str(error))
            answer = bytearray(len(keys))
            for index, one in enumerate(keys):
                if one in store or await store.spill_contains(one):
                    answer[index] = 1
            await reply(wire.Status.OK, payload=bytes(answer))
        elif op == wire.Op.LIST:
            await reply(wire.Status.OK, payload=b"\n".join(store.keys()))
        elif op == wire.Op.PING:
            await reply(wire.Status.OK)
        elif op == wire.Op.AUTH:
            proof = await reader.read(request.payload_len, options.frame_timeout)
            if options.secret is None or (
                connection.nonce is not None
                and wire.proof_matches(options.secret, connection.nonce, proof)
            ):
                connection.authenticated = True
                await reply(wire.Status.OK)
            else:
                self.counters["auth_failures"] += 1
                await reply(wire.Status.AUTH_FAILED)


def _masked(url: str) -> str:
    from kvplug.url import BackendURL

    try:
        return str(BackendURL.parse(url))
    except Exception:
        return "(an unparsable URL)"


class _Collector:
    """Prometheus metrics read from :meth:`LMServer.stats` at each scrape."""

    def __init__(self, server: LMServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.server.stats()
        prefix = "kvplug_lm_"
        for name, help_text in (
            ("objects", "Objects stored in memory"),
            ("bytes_stored", "Bytes of the objects stored in memory (allocator blocks)"),
            ("capacity", "Bytes of the memory buffer (--max-memory)"),
            ("connections_open", "Connections open now"),
            ("spilling", "Evicted objects whose spill write is in flight"),
        ):
            yield GaugeMetricFamily(prefix + name, help_text, value=stats[name])
        for name, help_text in (
            ("evictions", "Objects evicted from memory"),
            ("spilled", "Objects written to the spill tier"),
            ("spill_hits", "Objects read back from the spill tier"),
            ("spill_errors", "Failed spill operations"),
            ("connections", "Connections accepted"),
            ("connections_refused", "Connections closed at once (over --max-connections)"),
            ("bytes_received", "Bytes received from clients"),
            ("bytes_sent", "Bytes sent to clients"),
            ("auth_failures", "Extended requests refused for want of authentication"),
        ):
            yield CounterMetricFamily(prefix + name, help_text, value=stats[name])
        errors = CounterMetricFamily(
            prefix + "protocol_errors", "Requests refused, by kind", labels=["kind"]
        )
        for kind, count in stats["protocol_errors"].items():
            errors.add_metric([kind], count)
        yield errors
        requests = CounterMetricFamily(
            prefix + "requests", "Requests by mode, op and status", labels=["mode", "op", "status"]
        )
        for (mode, op, status), count in stats["requests"].items():
            requests.add_metric([mode, op, status], count)
        yield requests


# -- running it -----------------------------------------------------------------------------


def _loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ModuleNotFoundError:
            if choice == "uvloop":
                raise SystemExit(
                    "--loop uvloop: uvloop is not installed; pip install uvloop, or use "
                    "--loop asyncio"
                ) from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


@contextlib.contextmanager
def run_in_thread(options: ServerOptions) -> Iterator[LMServer]:
    """Run a server on its own event loop in a daemon thread; yields it started (its
    :attr:`~LMServer.port` bound) and stops it gracefully on exit."""
    from kvplug.sync import close_io_loop

    server = LMServer(options)
    loop = _loop_factory(options.loop)()
    executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="kvplug-lm-executor")
    loop.set_default_executor(executor)
    started = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            try:
                await server.start()
            except BaseException as error:
                failure.append(error)
                started.set()
                return
            started.set()
            await server.serve_forever()

        try:
            loop.run_until_complete(main())
        finally:
            close_io_loop(loop, executor)

    thread = threading.Thread(target=run, name=f"kvplug-lm-server:{options.port}", daemon=True)
    thread.start()
    started.wait()
    if failure:
        thread.join()
        raise failure[0]
    try:
        yield server
    finally:
        future = asyncio.run_coroutine_threadsafe(server.stop(), loop)
        future.result(timeout=options.shutdown_grace + 30)
        thread.join(timeout=30)


async def _run_until_signal(server: LMServer) -> None:
    await server.start()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: loop.create_task(server.stop()))
    await server.serve_forever()


def _build_command() -> click.Command:
    import click

    def env(name: str) -> str:
        return f"KVPLUG_LM_{name}"

    def size(what: str) -> Callable[[click.Context, click.Parameter, Any], int | None]:
        def parse(_ctx: click.Context, _param: click.Parameter, value: Any) -> int | None:
            if value is None:
                return None
            try:
                return parse_size(value, what=what)
            except ValueError as error:
                raise click.BadParameter(str(error)) from None

        return parse

    @click.command(
        "lm-server",
        help="Serve LMCache's lm:// protocol (and kvplug's extended mode) from memory, "
        "bounded by --max-memory, optionally spilling to a kvplug tier.",
    )
    @click.option("--host", default="127.0.0.1", show_default=True, envvar=env("HOST"))
    @click.option(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        show_default=True,
        envvar=env("PORT"),
        help="0 picks a free port (printed).",
    )
    @click.option(
        "--max-memory",
        default="4GiB",
        show_default=True,
        envvar=env("MAX_MEMORY"),
        callback=size("--max-memory"),
        help="Bytes of objects kept in memory; least recently used ones go first.",
    )
    @click.option(
        "--spill",
        default=None,
        envvar=env("SPILL"),
        help="kvplug tier URL evicted objects go to, e.g. file:///var/cache/kvplug-lm.",
    )
    @click.option(
        "--max-key-bytes",
        type=int,
        default=1024,
        show_default=True,
        envvar=env("MAX_KEY_BYTES"),
        help=f"Longest extended key, at most {HARD_KEY_LIMIT} (plain keys: 150).",
    )
    @click.option(
        "--max-object-bytes",
        default=str(wire.INT32_MAX),
        show_default=True,
        envvar=env("MAX_OBJECT_BYTES"),
        callback=size("--max-object-bytes"),
        help="Largest object (plain clients: at most 2GiB - 1 whatever this says).",
    )
    @click.option(
        "--idle-timeout",
        type=float,
        default=300.0,
        show_default=True,
        envvar=env("IDLE_TIMEOUT"),
        help="Seconds a connection may wait between requests.",
    )
    @click.option(
        "--frame-timeout",
        type=float,
        default=10.0,
        show_default=True,
        envvar=env("FRAME_TIMEOUT"),
        help="Seconds a started request header may take to arrive.",
    )
    @click.option(
        "--min-rate",
        default="1MiB",
        show_default=True,
        envvar=env("MIN_RATE"),
        callback=size("--min-rate"),
        help="Bytes per second a payload must at least move at.",
    )
    @click.option(
        "--max-connections",
        type=int,
        default=1024,
        show_default=True,
        envvar=env("MAX_CONNECTIONS"),
        help="Connections over this are accepted and closed at once.",
    )
    @click.option(
        "--secret-file",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        envvar=env("SECRET_FILE"),
        help="File holding the extended mode's shared secret (or set KVPLUG_LM_SECRET).",
    )
    @click.option(
        "--plain",
        type=click.Choice(["allow", "deny"]),
        default=None,
        envvar=env("PLAIN"),
        help="Plain LMCache clients (default: allow without a secret, deny with one).",
    )
    @click.option(
        "--metrics-port",
        type=int,
        default=None,
        envvar=env("METRICS_PORT"),
        help="Serve Prometheus metrics on 127.0.0.1 at this port (default: off).",
    )
    @click.option(
        "--shutdown-grace",
        type=float,
        default=30.0,
        show_default=True,
        envvar=env("SHUTDOWN_GRACE"),
        help="Seconds requests in flight may take to finish on SIGTERM.",
    )
    @click.option(
        "--loop",
        type=click.Choice(["auto", "asyncio", "uvloop"]),
        default="auto",
        show_default=True,
        envvar=env("LOOP"),
        help="auto: uvloop when installed.",
    )
    @click.option("--log-level", default="INFO", envvar=env("LOG_LEVEL"), show_default=True)
    def lm_server(secret_file: str | None, log_level: str, **values: Any) -> None:
        logging.basicConfig(
            level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        secret: bytes | None = None
        if secret_file is not None:
            secret = Path(secret_file).read_bytes().strip()
        elif os.environ.get(env("SECRET")):
            secret = os.environ[env("SECRET")].encode()
        if secret is not None and not secret:
            raise click.BadParameter("the shared secret is empty", param_hint="--secret-file")
        try:
            options = ServerOptions(secret=secret, **values)
        except ValueError as error:
            raise click.UsageError(str(error)) from None
        server = LMServer(options)
        with asyncio.Runner(loop_factory=_loop_factory(options.loop)) as runner:
            try:
                runner.run(_run_until_signal(server))
            except (OSError, KvplugError) as error:
                raise click.ClickException(str(error)) from None
        sys.exit(0)

    return lm_server


def __getattr__(name: str) -> Any:
    if name == "command":
        value = _build_command()
        globals()["command"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Run ``kvplug lm-server`` with the process' arguments."""
    _build_command()(auto_envvar_prefix="KVPLUG_LM")


if __name__ == "__main__":
    main()


__all__ = ["LMServer", "ServerOptions", "command", "main", "run_in_thread"]
