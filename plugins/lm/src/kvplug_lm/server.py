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

Its parts, one job each: :mod:`kvplug_lm.server_options` (what it is told, every default),
:mod:`kvplug_lm.command` (the command line, generated from those options),
:mod:`kvplug_lm.server_reader` (paced reads from a client), :mod:`kvplug_lm.server_extended`
(the extended mode's handler per op), :mod:`kvplug_lm.memstore` (the memory and the spill
tier) and this module (accepting, the plain mode, metrics, shutdown).

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
import secrets
import signal
import socket
import ssl
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvplug.tls import TLSChannel, server_context
from kvplug.units import format_size
from kvplug_lm import wire
from kvplug_lm.memstore import (
    PLAIN,
    PLAIN_META,
    RECORD,
    Entry,
    MemStore,
    record_header_len,
)
from kvplug_lm.server_extended import MAX_META, MAX_SMALL_PAYLOAD, serve_extended
from kvplug_lm.server_options import ServerOptions
from kvplug_lm.server_reader import ClientConnection, CloseConnection, PeerGone, Reader

if TYPE_CHECKING:
    import click

    command: click.Command
    """The ``kvplug lm-server`` click command (built on first use: click is optional)."""

logger = logging.getLogger("kvplug_lm.server")

INLINE_SEND = 64 * 1024
"""Payloads up to this size go out in the same send as their header."""

_COMMAND_NAMES = {c.value: c.name for c in wire.Command}
_REPLYING_COMMANDS = frozenset(
    {wire.Command.GET, wire.Command.EXIST, wire.Command.LIST, wire.Command.HEALTH}
)


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
        self._connections: set[ClientConnection] = set()
        self._stopping = False
        self._stopped: asyncio.Event | None = None
        self._metrics_server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tls: ssl.SSLContext | None = None

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
        if options.tls_cert_file is not None and options.tls_key_file is not None:
            self._tls = server_context(
                options.tls_cert_file, options.tls_key_file, options.tls_ca_cert_file
            )
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
            "auth %s, TLS %s, loop %s)",
            options.host,
            self.port,
            format_size(self.store.capacity),
            _masked(options.spill) if options.spill else "off",
            "allowed" if options.plain_allowed else "denied",
            "required" if options.secret else "off",
            ("on, client certificates required" if options.tls_ca_cert_file else "on")
            if options.tls
            else "off",
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
            tls = None if self._tls is None else TLSChannel(sock, self._tls, server_side=True)
            connection = ClientConnection(
                sock, Reader(loop, sock, self.options, self.counters, tls), peer
            )
            self._connections.add(connection)
            connection.task = loop.create_task(self._serve(connection))

    async def _serve(self, connection: ClientConnection) -> None:
        reader = connection.reader
        options = self.options
        try:
            if connection.tls is not None:
                async with asyncio.timeout(options.frame_timeout):
                    await connection.tls.handshake()
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
                    await serve_extended(self, connection)
                else:
                    await self._plain(connection)
                if self._stopping and reader.buffered == 0:
                    break
        except (PeerGone, ConnectionError):
            pass
        except ssl.SSLError as error:  # a client the certificates refused, a damaged record
            self.protocol_error("tls", connection, str(error))
        except CloseConnection:
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

    async def send(self, connection: ClientConnection, *parts: bytes | memoryview) -> None:
        loop = self._loop
        assert loop is not None
        total = sum(len(p) for p in parts)
        sock, tls = connection.sock, connection.tls
        async with asyncio.timeout(self._payload_timeout(total)):
            if len(parts) > 1 and total <= INLINE_SEND:
                parts = (b"".join(parts),)
            for part in parts:
                if not len(part):
                    continue
                if tls is None:
                    await loop.sock_sendall(sock, part)
                else:
                    await tls.sendall(part)
        self.counters["bytes_sent"] += total

    def protocol_error(self, kind: str, connection: ClientConnection, reason: str) -> None:
        self.protocol_errors[kind] += 1
        logger.debug("protocol error (%s) from %s: %s", kind, connection.peer, reason)

    # -- plain mode --------------------------------------------------------------------------

    async def _plain(self, connection: ClientConnection) -> None:
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
            self.protocol_error(error.kind, connection, str(error))
            self.requests["plain", name, "400"] += 1
            if command in _REPLYING_COMMANDS:
                with contextlib.suppress(Exception):
                    await self.send(connection, wire.pack_plain_reply(wire.Code.FAIL))
            raise CloseConnection from None
        if command == wire.Command.HEALTH:
            if request.key == wire.HELLO_KEY.encode():
                connection.nonce = secrets.token_bytes(wire.NONCE_BYTES)
                hello = wire.Hello(
                    connection.nonce,
                    options.max_key_bytes,
                    self.object_limit,
                    options.secret is not None,
                )
                reply = wire.pack_hello_reply(hello)
            else:
                reply = wire.pack_plain_reply(wire.Code.SUCCESS)
            # Each request is counted before its reply goes: a client that has the reply finds
            # the request in the metrics.
            self.requests["plain", name, "200"] += 1
            await self.send(connection, reply)
            return
        if not options.plain_allowed:
            self.protocol_error("plain_denied", connection, "plain clients are denied")
            self.requests["plain", name, "denied"] += 1
            raise CloseConnection
        key = request.key
        if command == wire.Command.PUT:
            status = await self._plain_put(connection, request)
            self.requests["plain", name, status] += 1
        elif command == wire.Command.GET:
            entry = store.lookup(key) or await store.load_spilled(key)
            described = entry.plain_meta() if entry is not None else None
            if entry is None or described is None:
                self.requests["plain", name, "400"] += 1
                await self.send(connection, wire.pack_plain_reply(wire.Code.FAIL))
                return
            fmt, dtype, shape = described
            reply = wire.pack_plain_reply(
                wire.Code.SUCCESS, length=entry.payload_len, fmt=fmt, dtype=dtype, shape=shape
            )
            self.requests["plain", name, "200"] += 1
            await self._send_entry(connection, reply, entry)
        elif command == wire.Command.EXIST:
            found = key in store or await store.spill_contains(key)
            code = wire.Code.SUCCESS if found else wire.Code.FAIL
            self.requests["plain", name, str(int(code))] += 1
            await self.send(connection, wire.pack_plain_reply(code))
        else:  # LIST: LMCache leaves it unimplemented; a reply keeps its client from hanging
            self.requests["plain", name, "400"] += 1
            await self.send(connection, wire.pack_plain_reply(wire.Code.FAIL))

    async def _plain_put(self, connection: ClientConnection, request: wire.PlainRequest) -> str:
        store = self.store
        assert store is not None
        length = request.length
        reader = connection.reader
        if length > self.object_limit:
            self.protocol_error("too_large", connection, f"plain PUT of {length} bytes")
            await reader.discard(length)
            return "too_large"
        meta = PLAIN_META.pack(request.fmt, request.dtype, *request.shape)
        received = await self.receive(connection, request.key, PLAIN, meta, length)
        if received is None:
            self.protocol_error("no_space", connection, f"plain PUT of {length} bytes")
            return "no_space"
        store.commit(*received)
        return "stored"

    async def receive(
        self,
        connection: ClientConnection,
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

    async def _send_entry(self, connection: ClientConnection, header: bytes, entry: Entry) -> None:
        block = entry.block.retain()  # alive while sent, even if evicted or replaced meanwhile
        try:
            await self.send(connection, header, entry.payload)
        finally:
            block.release()


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


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
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
    from kvplug.runtime.sync import close_io_loop

    server = LMServer(options)
    loop = loop_factory(options.loop)()
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


async def run_until_signal(server: LMServer) -> None:
    await server.start()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: loop.create_task(server.stop()))
    await server.serve_forever()


def __getattr__(name: str) -> Any:
    if name == "command":
        from kvplug_lm.command import build_command

        value = build_command()
        globals()["command"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Run ``kvplug lm-server`` with the process' arguments."""
    from kvplug_lm.command import main as run_command

    run_command()


if __name__ == "__main__":
    main()


__all__ = [
    "MAX_SMALL_PAYLOAD",
    "LMServer",
    "ServerOptions",
    "command",
    "main",
    "run_in_thread",
]
