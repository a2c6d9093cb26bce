"""A TCP fault proxy on 127.0.0.1, for checking clause 10 against servers nobody can stop.

:class:`FaultProxy` forwards every connection it accepts to one ``host:port`` upstream and
injects faults on demand: a paused server, a killed one, latency, a black hole, reset
connections. It runs its own event loop on a daemon thread, so tests drive it with plain
synchronous calls, and it implements the suite's
:class:`~kvplug_contracts.suite.lifecycle.ServerControl` (``pause``, ``resume``, ``stop``,
``start``): a ``server_control`` fixture can return it as it is. ``pytest --pyargs
kvplug_contracts --kvplug-url redis://cache:6379 --kvplug-proxy`` does that for you.

Example::

    >>> from kvplug_contracts.faultproxy import FaultProxy
    >>> with FaultProxy("cache.internal:6379") as proxy:
    ...     url = proxy.url_for("redis://app:s3cret@cache.internal:6379/0?timeout=2")
    ...     url == f"redis://app:s3cret@127.0.0.1:{proxy.port}/0?timeout=2"
    True

And in a vendor's test module, for a managed service the tests cannot stop::

    @pytest.fixture(scope="module")
    def proxy():
        with FaultProxy("cache.example.net:6379") as proxy:
            yield proxy

    class TestManagedCache(BackendContract):
        @pytest.fixture
        def kvplug_url(self, proxy):
            return proxy.url_for("rediss://app:token@cache.example.net:6379")

        @pytest.fixture
        def server_control(self, proxy):
            yield proxy
            proxy.heal()  # a test that failed mid-outage leaves no fault behind

The proxy is transparent at the TCP level, so TLS passes through; the client sees the host
``127.0.0.1``, so certificate host-name checks must accept that name (or be turned off for the
test). Memory stays bounded: a direction reads no more from one side while the other side's
send buffer is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from kvplug.url import BackendURL, split_chain

HOST = "127.0.0.1"
"""The proxy listens here only."""
CHUNK = 256 * 1024
"""Bytes forwarded at a time; also each reader's buffer limit."""
CONTROL_TIMEOUT = 10.0
"""Seconds a control call (``pause``, ``stop``, ...) may take before it raises."""

T = TypeVar("T")
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, not FIN


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close ``writer``'s connection with a TCP reset, as a killed process's kernel would."""
    if writer is None:
        return
    transport = writer.transport
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
    transport.abort()


def upstream_of(url: str) -> tuple[str, int]:
    """The ``(host, port)`` a backend URL connects to (the innermost URL of a ``::`` chain);
    raises ValueError when the URL does not name exactly one host with a port.

    >>> upstream_of("audit::redis://app:pw@cache:6380/0")
    ('cache', 6380)
    """
    parsed = BackendURL.parse(split_chain(url)[-1])
    if len(parsed.hosts) == 1:
        host, port = parsed.hosts[0]
        if port is not None:
            return host, port
        raise ValueError(
            f"a fault proxy needs the port of the server, and {parsed} names none (the client "
            "library's default port is not known here). Write it, e.g. redis://cache:6379"
        )
    hosts = f"{len(parsed.hosts)} hosts" if parsed.hosts else "no host"
    raise ValueError(
        f"a fault proxy stands in front of one host:port, and {parsed} names {hosts}. "
        "For URLs with several servers (sentinel, cluster) or none "
        "(unix sockets, files, store://), override the server_control fixture instead"
    )


@dataclasses.dataclass(eq=False)
class _Link:
    """One accepted client connection and, once made, its connection upstream."""

    client: asyncio.StreamWriter
    task: asyncio.Task[None] | None
    upstream: asyncio.StreamWriter | None = None
    lost_bytes: bool = False
    """Set once a black hole swallowed some of its bytes: it never forwards again, so that no
    one ever receives a stream with a gap in it."""

    def reset(self) -> None:
        _reset(self.client)
        _reset(self.upstream)
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:port`` to ``upstream`` (``"host:port"`` or a tuple), with
    faults to switch on and off. It listens from construction until :meth:`close`; a context
    manager closes it. Every control method returns once the change has happened.

    * :meth:`pause` / :meth:`resume`: like ``SIGSTOP``/``SIGCONT`` of the server: nothing is
      forwarded in either direction, connections stay open and new ones are accepted and hang;
      :meth:`resume` delivers what was held back.
    * :meth:`stop` (alias :meth:`drop`) / :meth:`start`: like killing and restarting the
      server: every connection is reset, new ones are refused until :meth:`start` listens
      again on the same port. A stop also ends a pause, as it would for a killed process.
    * :meth:`delay`: every forwarded chunk waits this many seconds first.
    * :meth:`blackhole`: bytes are read and discarded, in both directions, and nothing is ever
      answered. A connection that lost bytes stays a black hole until it is closed (it would
      carry a stream with a gap otherwise); connections made after :meth:`heal` work.
    * :meth:`reset_connections`: reset every current connection, keep listening.
    * :meth:`damage_reply`: flip one bit of one byte the server sends (a damaged network
      path), to check that a client detects what a checksum must catch.
    * :meth:`heal` (alias :meth:`clear`): no fault at all: resumed, listening, no delay, no
      black hole.

    ``connect_timeout`` bounds the connection to the upstream; a client whose upstream
    connection fails is reset, as it would be by the server itself. Control methods are
    synchronous: call them from any thread but the proxy's own.
    """

    def __init__(self, upstream: str | tuple[str, int], *, connect_timeout: float = 10.0) -> None:
        if isinstance(upstream, str):
            host, sep, port_text = upstream.rpartition(":")
            if not sep or not host or not port_text.isdigit():
                raise ValueError(
                    f"upstream {upstream!r} is not host:port; write it as e.g. 'cache:6379'"
                )
            upstream = (host.strip("[]"), int(port_text))
        self.upstream: tuple[str, int] = upstream
        self.connect_timeout = connect_timeout
        self._port = 0
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._blackholed = False
        self._delay = 0.0
        self._damage_at: int | None = None
        self._from_server = 0
        self._damaged = threading.Event()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"FaultProxy to {self._upstream_text}", daemon=True
        )
        self._thread.start()
        try:
            self._call(self._listen)
        except BaseException:
            self.close()
            raise

    # -- where it is -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the proxy listens on (the same after :meth:`stop` and :meth:`start`)."""
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        """``("127.0.0.1", port)``."""
        return HOST, self._port

    @property
    def listening(self) -> bool:
        """Whether new connections are accepted (False after :meth:`stop`)."""
        return self._server is not None

    @property
    def paused(self) -> bool:
        """Whether forwarding is held back by :meth:`pause`."""
        return not self._resumed.is_set()

    @property
    def connections(self) -> int:
        """How many client connections are open now."""
        return len(self._links)

    def url_for(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's, keeping the user name,
        password, path and query (in a ``::`` chain, the innermost URL's). Raises ValueError
        when ``url`` does not point at this proxy's upstream."""
        parts = split_chain(url)
        inner = BackendURL.parse(parts[-1])
        if upstream_of(parts[-1]) != self.upstream:
            raise ValueError(
                f"{inner} does not point at this proxy's upstream {self._upstream_text}; "
                "make a FaultProxy for that host and port"
            )
        proxied = dataclasses.replace(inner, hosts=((HOST, self._port),))
        return "::".join([*parts[:-1], proxied.secret_url()])

    def __repr__(self) -> str:
        faults = [
            name
            for name, on in (
                ("stopped", not self.listening),
                ("paused", self.paused),
                ("black hole", self._blackholed),
                (f"delay {self._delay:g} s", self._delay > 0),
                ("closed", self._closed),
            )
            if on
        ]
        state = f" ({', '.join(faults)})" if faults else ""
        return f"<FaultProxy {HOST}:{self._port} -> {self._upstream_text}{state}>"

    @property
    def _upstream_text(self) -> str:
        host, port = self.upstream
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    # -- faults --------------------------------------------------------------------------------

    def pause(self) -> None:
        """Forward nothing, in either direction, until :meth:`resume`; keep connections open
        and accept new ones (they hang)."""
        self._apply(self._resumed.clear)

    def resume(self) -> None:
        """Undo :meth:`pause`: what was held back is delivered."""
        self._apply(self._resumed.set)

    def stop(self) -> None:
        """Stop listening (new connections are refused) and reset every connection."""
        self._call(self._stop)

    drop = stop

    def start(self) -> None:
        """Listen again on the same port; returns once connections are accepted."""
        self._call(self._listen)

    def delay(self, seconds: float) -> None:
        """Hold each forwarded chunk ``seconds`` before passing it on (0: no delay)."""
        if not seconds >= 0:
            raise ValueError(f"a delay is seconds >= 0, got {seconds!r}")
        self._apply(lambda: setattr(self, "_delay", float(seconds)))

    def blackhole(self) -> None:
        """Swallow every byte in both directions and never answer; new connections too."""
        self._apply(lambda: setattr(self, "_blackholed", True))

    def damage_reply(self, offset: int) -> threading.Event:
        """Flip one bit of the byte ``offset`` bytes into what the server sends from now on
        (over all connections); the event is set once it happened."""
        if offset < 0:
            raise ValueError(f"an offset is >= 0, got {offset!r}")

        def arm() -> None:
            self._damage_at, self._from_server = offset, 0
            self._damaged.clear()

        self._apply(arm)
        return self._damaged

    def reset_connections(self) -> None:
        """Reset every current connection (TCP RST); keep listening."""
        self._apply(self._reset_all)

    def heal(self) -> None:
        """Remove every fault: listen, forward, no delay, no black hole."""

        async def heal() -> None:
            self._delay = 0.0
            self._blackholed = False
            self._damage_at = None
            self._resumed.set()
            await self._listen()

        self._call(heal)

    clear = heal

    def close(self) -> None:
        """Reset every connection, free the port and end the proxy's thread; idempotent."""
        if self._closed:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("FaultProxy.close() was called from the proxy's own thread")
        if self._thread.is_alive():
            with contextlib.suppress(TimeoutError, RuntimeError):
                self._call(self._shut_down)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CONTROL_TIMEOUT)
        self._closed = True
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- on the proxy's loop -------------------------------------------------------------------

    def _call(self, function: Callable[[], Coroutine[Any, Any, T]]) -> T:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; make a new FaultProxy")
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                "FaultProxy's methods wait for its loop; call them from another thread"
            )
        future = asyncio.run_coroutine_threadsafe(function(), self._loop)
        return future.result(CONTROL_TIMEOUT)

    def _apply(self, function: Callable[[], object]) -> None:
        async def call() -> None:
            function()

        self._call(call)

    async def _listen(self) -> None:
        if self._server is not None:
            return
        try:
            self._server = await asyncio.start_server(
                self._serve, HOST, self._port, limit=CHUNK, backlog=1024
            )
        except OSError as error:
            raise OSError(
                error.errno,
                f"the fault proxy cannot listen on {HOST}:{self._port}: {error.strerror}; "
                "another process took the port after stop(). Make a new FaultProxy",
            ) from None
        self._port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()  # closes the listening socket now: connects are refused
        self._reset_all()
        self._resumed.set()

    def _reset_all(self) -> None:
        for link in list(self._links):
            link.reset()

    async def _shut_down(self) -> None:
        await self._stop()
        tasks = asyncio.all_tasks() - {asyncio.current_task()}  # every one is the proxy's
        if tasks:
            await asyncio.wait(tasks, timeout=CONTROL_TIMEOUT / 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A reset cancels this inner task, never the handler itself: Python 3.11's streams
        # log a cancelled handler as an error.
        forwarding = asyncio.create_task(self._forward(reader, writer))
        await asyncio.wait([forwarding])

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(writer, asyncio.current_task())
        if self._server is None:  # accepted just before a stop()
            link.reset()
            return
        self._links.add(link)
        try:
            await self._resumed.wait()
            if self._blackholed:
                link.lost_bytes = True
                while await reader.read(CHUNK):
                    pass
                return
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream, limit=CHUNK), self.connect_timeout
            )
            link.upstream = up_writer
            async with asyncio.TaskGroup() as pumps:
                pumps.create_task(self._pump(link, reader, up_writer))
                pumps.create_task(self._pump(link, up_reader, writer))
        except* OSError:  # TimeoutError too
            # An unreachable upstream or a reset on one side: reset the other side too.
            link.reset()
        finally:
            self._links.discard(link)
            for side in (link.client, link.upstream):
                if side is not None:
                    side.close()

    async def _pump(
        self, link: _Link, source: asyncio.StreamReader, target: asyncio.StreamWriter
    ) -> None:
        """Forward ``source`` to ``target`` until end of stream, chunk by chunk, each chunk
        passing the current faults; the next chunk is read only once ``target`` drained."""
        while True:
            data = await source.read(CHUNK)
            await self._resumed.wait()
            if self._delay:
                await asyncio.sleep(self._delay)
                await self._resumed.wait()
            if self._blackholed or link.lost_bytes:
                link.lost_bytes = True
                if not data:
                    link.reset()  # swallowing an end of stream would keep this link forever
                    return
                continue
            if not data:
                if target.can_write_eof() and not target.transport.is_closing():
                    target.write_eof()
                return
            if target is link.client and self._damage_at is not None:
                data = self._damaged_copy(data)
            target.write(data)
            await target.drain()

    def _damaged_copy(self, data: bytes) -> bytes:
        """``data`` from the server, with the armed damage applied if it falls in it."""
        assert self._damage_at is not None
        position = self._damage_at - self._from_server
        self._from_server += len(data)
        if not 0 <= position < len(data):
            return data
        damaged = bytearray(data)
        damaged[position] ^= 0x10
        self._damage_at = None
        self._damaged.set()
        return bytes(damaged)


__all__ = ["CHUNK", "HOST", "FaultProxy", "upstream_of"]
