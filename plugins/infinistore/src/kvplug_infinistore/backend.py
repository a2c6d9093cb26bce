"""``infinistore://host:port``: kvplug objects in an InfiniStore server, through InfiniStore's
own client (``infinistore.InfinityConnection``).

URL and options (query parameters or keyword options, keywords win; see
:class:`InfiniStoreOptions`)::

    infinistore://cache-host:12345?device=mlx5_0&link_type=Ethernet
    infinistore://cache-host:12345?connection_type=tcp&timeout=5

How objects are stored. Each object is **one** InfiniStore value: the kvplug frame (header and
checksummed payload, :mod:`kvplug.frame`) followed by a 16-byte end marker holding the frame's
length. An RDMA read tells the client neither whether the whole value arrived nor how long it
was (the server writes the stored bytes into a larger region and answers "done"), so the end
marker is how a cut value is told from an intact one: it must stand exactly where the header
says the frame ends, and the client wipes it from its staging memory after every transfer, so a
stale copy can never stand in for it. A damaged value reads as a miss, is counted in
``corrupt_objects`` and is deleted (clause 6). A put replaces the old value in one step on the
server (clause 3).

How bytes move.

* ``connection_type=rdma`` (the default, as in LMCache): values travel between the server's
  memory and a staging area of this backend (``staging_size`` bytes, registered once per
  connection with ``register_mr``). A put copies the frame into staging and writes it with
  ``rdma_write_cache_async``; the values of a batch that have one size go in one request. A
  read reserves room for the largest value it accepts (``max_value_size``; for ``get_into`` the
  caller's size) and reads with ``rdma_read_cache_async``, many keys in one request.
* ``connection_type=tcp``: ``tcp_write_cache`` / ``tcp_read_cache``, one key per request.

Both share one server and one value layout, so a TCP client reads what an RDMA client wrote.

Deadlines and failures. InfiniStore's client blocks: its blocking calls run in a small thread
pool of each connection (``workers`` threads), one at a time per connection, and the backend's
deadline (``timeout``) bounds every wait. A call that times out or fails on the connection
closes that connection; the next operation connects again (after ``reconnect_delay``, doubling
up to ``reconnect_max_delay`` while the server stays away), so the backend recovers without
being reopened (clause 10). Before connecting, the server's port is probed with a plain TCP
connect bounded by ``connect_timeout``, so a host that is down fails fast with
:class:`~kvplug.errors.BackendUnavailable` instead of hanging in the client. Staging memory
handed to a transfer stays reserved until InfiniStore reports that transfer finished, even
after a deadline gave up waiting on it.

A test seam: ``InfiniStoreBackend(url, connection_factory=...)`` (also through
``kvplug.open_backend(url, connection_factory=...)``) builds the connection object from the
``infinistore.ClientConfig`` instead of ``infinistore.InfinityConnection``; the package's
tests use it to run the contract suite against a recording stand-in of the client.

Its modules, one job each: this one (the operations), :mod:`kvplug_infinistore.options`,
:mod:`kvplug_infinistore.session` (one connection through InfiniStore's client) and
:mod:`kvplug_infinistore.layout` (the stored value and its end marker).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kvplug.backend import Buffer, BytesBackend, Capabilities
from kvplug.errors import (
    BackendError,
    BackendUnavailable,
    CapacityExceeded,
    InvalidBackendURL,
    KvplugError,
)
from kvplug.frame import MAX_HEADER_LEN, FrameReceiver, encode_frame
from kvplug.units import format_size
from kvplug.url import BackendURL
from kvplug_infinistore.layout import (
    END_MAGIC,
    END_MARKER,
    end_marker,
    feed,
    fill,
    joined,
    value_bytes,
    wipe_end,
)
from kvplug_infinistore.options import InfiniStoreOptions
from kvplug_infinistore.session import (
    CODE_INVALID_REQUEST,
    CODE_OUT_OF_MEMORY,
    ConnectionFactory,
    ConnectionLost,
    Session,
    client_config,
    default_connection_factory,
    error_code,
    open_session,
    server_name,
)

if TYPE_CHECKING:
    from kvplug.keys import CacheKey
    from kvplug.memory import Allocator, MemoryObj

T = TypeVar("T")

MAX_TCP_VALUE = (1 << 32) - 1
"""InfiniStore's TCP read reply carries the value's size in 32 bits."""


class InfiniStoreBackend(BytesBackend):
    """``infinistore://host:port``: see the module for how objects are stored and moved and
    :class:`InfiniStoreOptions` for the options."""

    # releases_on_cancel over RDMA and TCP alike: InfiniStore's client (its threads, the RDMA
    # transfers) only ever sees staging memory or a copy of this backend's own; the caller's
    # memory is copied in or out on the event loop, while the operation is still running.
    capabilities = Capabilities(
        remove=True,
        native_batching=True,
        shared_across_processes=True,
        persistent=False,
        releases_on_cancel=True,
    )
    loop_bound: ClassVar[bool] = True  # InfiniStore's RDMA calls belong to one event loop
    Options = InfiniStoreOptions
    options: InfiniStoreOptions

    def __init__(
        self,
        url: BackendURL | str,
        *,
        allocator: Allocator | None = None,
        connection_factory: ConnectionFactory | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url, allocator=allocator, **options)
        host, port = self.url.host, self.url.port
        if not host or port is None:
            raise InvalidBackendURL(
                f"{self.url} names no server; write infinistore://HOST:PORT with the "
                "server's --service-port, e.g. infinistore://cache-host:12345."
            )
        if len(self.url.hosts) > 1:
            raise InvalidBackendURL(
                f"{self.url} names {len(self.url.hosts)} servers; an infinistore:// tier talks "
                "to one. Give one HOST:PORT per tier."
            )
        self.host, self.port = host, port
        self.rdma = self.options.connection_type == "rdma"
        if not self.rdma:
            # InfiniStore has no batched TCP calls: batches are loops of single-key requests.
            self.capabilities = Capabilities(
                remove=True, shared_across_processes=True, releases_on_cancel=True
            )
        self._factory = connection_factory or default_connection_factory
        self._session: Session | None = None
        self._connecting: asyncio.Lock | None = None
        self._retry_at = 0.0
        self._delay = self.options.reconnect_delay
        self._last_failure: KvplugError | None = None

    def describe(self) -> dict[str, str]:
        described: dict[str, str] = {"connection": self.options.connection_type}
        if self.rdma:
            described.update(
                device=self.options.device,
                ib_port=str(self.options.ib_port),
                link_type=self.options.effective_link_type,
                staging=format_size(self.options.staging_size),
            )
        return described

    # -- connection ---------------------------------------------------------------------------

    async def _open(self) -> None:
        await self._live_session()

    async def _close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.drop()

    def _where(self) -> str:
        return server_name(self.host, self.port)

    async def _live_session(self) -> Session:
        """The connection to use now, connecting first when there is none (at most one
        connect at a time; while the back-off runs, fail at once)."""
        session = self._session
        if session is not None:
            return session
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            session = self._session
            if session is not None:
                return session
            wait = self._retry_at - time.monotonic()
            if wait > 0 and self._last_failure is not None:
                raise BackendUnavailable(
                    f"{self._where()} was unreachable moments ago ({self._last_failure}); the "
                    f"next attempt is in {wait:.2f} s. Operations fail fast until then."
                )
            try:
                session = await self._connect()
            except KvplugError as error:
                self._last_failure = error
                self._retry_at = time.monotonic() + self._delay
                self._delay = min(self._delay * 2, self.options.reconnect_max_delay)
                raise
            self._delay = self.options.reconnect_delay
            self._last_failure = None
            self._session = session
            return session

    async def _connect(self) -> Session:
        return await open_session(self._factory, self.options, self.host, self.port, self.url)

    def _lost(self, session: Session, error: BaseException, doing: str) -> ConnectionLost:
        """Drop ``session`` after ``error`` and say so."""
        if self._session is session:
            self._session = None
        session.drop()
        return ConnectionLost(
            f"{doing} on {self._where()} failed: {error}. The connection was closed and the "
            "next operation connects again; if this repeats, check the server's log."
        )

    async def _on(self, session: Session, doing: str, function: Callable[..., T], *args: Any) -> T:
        try:
            return await session.call(function, *args)
        except asyncio.CancelledError:
            # The deadline (or close) gave up on a call that may still be stuck in the client.
            if self._session is session:
                self._session = None
            session.drop()
            raise
        except KvplugError:
            raise
        except Exception as error:
            raise self._server_error(session, error, doing) from None

    def _server_error(self, session: Session, error: BaseException, doing: str) -> KvplugError:
        """A client error as kvplug's: the server's answer where it gave one (the connection
        stays), else a lost connection."""
        code = error_code(error)
        if code == CODE_OUT_OF_MEMORY:
            return CapacityExceeded(
                f"{doing}: {self._where()} is out of memory (code {code}: {error}). Start it "
                "with a larger --prealloc-size or --auto-increase, or store less."
            )
        if code == CODE_INVALID_REQUEST:
            return BackendError(
                f"{doing}: {self._where()} refused the request as invalid (code {code}: "
                f"{error}). A read whose value is larger than the room it reserved gets this "
                "answer; raise max_value_size if values of that size are expected."
            )
        return self._lost(session, error, doing)

    # -- staging (RDMA) -----------------------------------------------------------------------

    async def _reserve(self, session: Session, size: int, doing: str) -> MemoryObj:
        """A staging block of ``size`` bytes; waits (within the deadline) while staging is
        full."""
        staging = session.staging
        assert staging is not None
        if size > staging.capacity:
            raise CapacityExceeded(
                f"{doing}: {format_size(size)} does not fit in the staging memory "
                f"({format_size(staging.capacity)}); raise staging_size."
            )
        pause = 0.0005
        while True:
            block = staging.allocate((size,), _uint8())
            if block is not None:
                return block
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.01)

    async def _transfer(
        self,
        session: Session,
        write: bool,
        names: Sequence[str],
        blocks: Sequence[MemoryObj],
        block_size: int,
    ) -> None:
        """One RDMA request moving ``blocks`` (staging memory, one per key). Each block stays
        reserved until InfiniStore reports the request finished, even if the caller stops
        waiting (a deadline): its memory may still be written or read until then."""
        conn = session.conn
        pairs = [
            (name, block.data_ptr() - session.base)
            for name, block in zip(names, blocks, strict=True)
        ]
        for block in blocks:
            block.retain()
        held = list(blocks)
        abandoned = False
        if write:
            request = conn.rdma_write_cache_async(pairs, block_size, session.base)
        else:
            request = conn.rdma_read_cache_async(pairs, block_size, session.base)
        task = asyncio.ensure_future(request)

        def finished(done: asyncio.Future[Any]) -> None:
            for block in held:
                if write or abandoned:
                    wipe_end(block.memoryview(), block_size)
                block.release()
            if not done.cancelled():
                done.exception()  # retrieved: an abandoned request's error is not logged

        task.add_done_callback(finished)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            abandoned = True
            if not task.done():
                # Abandoned while the server holds it: this connection's answers can no longer
                # be trusted to arrive; connect afresh for the next operation.
                if self._session is session:
                    self._session = None
                session.drop()
            raise

    # -- byte hooks ---------------------------------------------------------------------------

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        await self.batched_put_bytes([key], [parts])

    async def batched_put_bytes(
        self, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        sizes = [sum(memoryview(part).nbytes for part in parts) for parts in values]
        limit = self.options.max_value_size if self.rdma else MAX_TCP_VALUE
        for key, size in zip(keys, sizes, strict=True):
            if size > limit:
                raise CapacityExceeded(
                    f"put of {key}: the stored value would be {format_size(size)}, more than "
                    f"{'max_value_size' if self.rdma else 'InfiniStore TCP reads carry'} "
                    f"({format_size(limit)}), so it could not be read back. "
                    + ("Raise max_value_size (and staging_size)." if self.rdma else "")
                )
        if not self.rdma:
            for key, parts, size in zip(keys, values, sizes, strict=True):
                await self._tcp_put(key, parts, size)
            return
        session = await self._live_session()
        by_size: dict[int, list[int]] = {}
        for index, size in enumerate(sizes):
            by_size.setdefault(size, []).append(index)
        for size, indexes in by_size.items():
            await self._rdma_put(
                session, size, [keys[i] for i in indexes], [values[i] for i in indexes]
            )

    async def _tcp_put(self, key: str, parts: Sequence[Buffer], size: int) -> None:
        value = joined(parts, size)
        session = await self._live_session()
        conn = session.conn

        def write() -> None:
            # The job holds the buffer, so it outlives a deadline that stops waiting for it.
            conn.tcp_write_cache(key, int(value.ctypes.data), size)

        await self._on(session, f"put of {key}", write)

    async def _rdma_put(
        self, session: Session, size: int, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        """Write values of one ``size``: as many per request as staging holds at once."""
        doing = f"put of {keys[0]}" + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")
        start = 0
        while start < len(keys):
            blocks = [await self._reserve(session, size, doing)]
            staging = session.staging
            assert staging is not None
            while start + len(blocks) < len(keys):
                more = staging.allocate((size,), _uint8())
                if more is None:
                    break
                blocks.append(more)
            batch = range(start, start + len(blocks))
            try:
                for block, index in zip(blocks, batch, strict=True):
                    fill(block.memoryview(), values[index])
                try:
                    await self._transfer(session, True, [keys[i] for i in batch], blocks, size)
                except asyncio.CancelledError:
                    raise
                except KvplugError:
                    raise
                except Exception as error:
                    raise self._server_error(session, error, doing) from None
            finally:
                for block in blocks:
                    block.release()  # the request's own hold wipes and releases it when done
            start += len(blocks)

    async def get_bytes(self, key: str) -> Buffer | None:
        if not self.rdma:
            value = await self._tcp_read(key)
            return None if value is None else bytes(value)
        session = await self._live_session()
        found: list[bytes | None] = [None]

        def keep(index: int, view: memoryview) -> None:
            found[index] = value_bytes(view)

        await self._rdma_read(session, [key], [self.options.max_value_size], keep)
        return found[0]

    async def receive_frames(self, keys: Sequence[str], receivers: Sequence[FrameReceiver]) -> None:
        if not self.rdma:
            for key, receiver in zip(keys, receivers, strict=True):
                value = await self._tcp_read(key)
                if value is not None:
                    feed(receiver, memoryview(value), exact=True)
            return
        session = await self._live_session()
        limits = [self._read_room(receiver) for receiver in receivers]

        def deliver(index: int, view: memoryview) -> None:
            feed(receivers[index], view, exact=False)

        await self._rdma_read(session, keys, limits, deliver)

    def _read_room(self, receiver: FrameReceiver) -> int:
        """The room to reserve for one read: the largest value accepted, or for a read into
        the caller's memory, the largest frame of that size (a larger one is read again with
        the largest room)."""
        room = self.options.max_value_size
        into = receiver.into
        if into is not None and into.device.type == "cpu":
            room = min(room, into.nbytes + MAX_HEADER_LEN + END_MARKER.size)
        return room

    async def _tcp_read(self, key: str) -> Any:
        """The stored value (a numpy array) or None when absent."""
        session = await self._live_session()
        conn = session.conn

        def read() -> Any:
            try:
                value = conn.tcp_read_cache(key)
            except Exception:
                # The client reports an absent key as an error: ask whether the key is there
                # (a failure of that call is the connection's).
                if not conn.check_exist(key):
                    return None
                raise
            return value if value is not None and len(value) else None

        return await self._on(session, f"get of {key}", read)

    async def _rdma_read(
        self,
        session: Session,
        keys: Sequence[str],
        rooms: Sequence[int],
        deliver: Callable[[int, memoryview], None],
    ) -> None:
        """Read ``keys`` into staging, reserving ``rooms[i]`` bytes for key ``i``, and hand
        each value read to ``deliver(i, view)`` (never called for an absent key). Keys that
        reserve the same room share one request; when a request meets an absent key
        (InfiniStore then fails the whole request), its keys are read one by one."""
        import infinistore  # type: ignore[import-untyped]

        groups: dict[int, list[int]] = {}
        for index, room in enumerate(rooms):
            groups.setdefault(room, []).append(index)
        pending = [(room, indexes) for room, indexes in groups.items()]
        while pending:
            room, indexes = pending.pop()
            doing = f"get of {keys[indexes[0]]}" + (
                f" and {len(indexes) - 1} more" if len(indexes) > 1 else ""
            )
            staging = session.staging
            assert staging is not None
            blocks = [await self._reserve(session, room, doing)]
            while len(blocks) < len(indexes):
                more = staging.allocate((room,), _uint8())
                if more is None:
                    break
                blocks.append(more)
            batch, rest = indexes[: len(blocks)], indexes[len(blocks) :]
            if rest:
                pending.append((room, rest))
            try:
                try:
                    await self._transfer(session, False, [keys[i] for i in batch], blocks, room)
                except infinistore.InfiniStoreKeyNotFound:
                    if len(batch) > 1:
                        pending.extend((room, [i]) for i in batch)
                    continue
                except asyncio.CancelledError:
                    raise
                except KvplugError:
                    raise
                except Exception as error:
                    mapped = self._server_error(session, error, doing)
                    limited = room < self.options.max_value_size
                    if limited and error_code(error) == CODE_INVALID_REQUEST:
                        # Larger than the caller's memory: read again, one by one (InfiniStore
                        # fails the whole request), with room for any value, so that the
                        # frame's header tells another layout (LayoutMismatch) from damage.
                        pending.extend((self.options.max_value_size, [i]) for i in batch)
                        continue
                    raise mapped from None
                for block, index in zip(blocks, batch, strict=True):
                    deliver(index, block.memoryview())
            finally:
                for block in blocks:
                    wipe_end(block.memoryview(), room)
                    block.release()

    async def contains_bytes(self, key: str) -> bool:
        session = await self._live_session()
        return bool(await self._on(session, f"contains of {key}", session.conn.check_exist, key))

    async def batched_exists_bytes(self, keys: Sequence[str]) -> list[bool]:
        """``check_exist`` of each key (InfiniStore has no multi-exists), in one trip to the
        client's thread."""
        session = await self._live_session()
        conn = session.conn
        return await self._on(
            session,
            f"contains of {keys[0]} and {len(keys) - 1} more",
            lambda: [bool(conn.check_exist(key)) for key in keys],
        )

    async def _batched_contains(self, keys: Sequence[CacheKey]) -> int:
        """The leading keys present, from InfiniStore's binary search over the list
        (``get_match_last_index``), checked key by key in ``exact_contains`` mode."""
        session = await self._live_session()
        conn, exact = session.conn, self.options.exact_contains
        names = [self.key_string(key) for key in keys]

        def prefix() -> int:
            try:
                found = int(conn.get_match_last_index(names)) + 1
            except Exception:
                # The client raises both for "no key matches" (-1) and for a failed call: ask
                # about the first key (a failed call fails again there), then count.
                if not conn.check_exist(names[0]):
                    return 0
                return _leading(conn, names, len(names))
            # A binary search stops at a boundary present->absent, which is at or after the
            # first absent key: exact mode checks the keys before it.
            return _leading(conn, names, found) if exact else found

        return int(await self._on(session, f"contains of {names[0]} and more", prefix))

    async def remove_bytes(self, key: str) -> bool:
        session = await self._live_session()
        deleted = await self._on(session, f"remove of {key}", session.conn.delete_keys, [key])
        return int(deleted) > 0

    # -- framing: every value ends with its end marker ----------------------------------------

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        await self.put_bytes(self.key_string(key), self._value_parts(key, obj))

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        await self.batched_put_bytes(
            [self.key_string(key) for key in keys],
            [self._value_parts(key, obj) for key, obj in zip(keys, objs, strict=True)],
        )

    def _value_parts(self, key: CacheKey, obj: MemoryObj) -> list[Buffer]:
        header, payload = encode_frame(obj, self.serde, key)
        return [header, payload, end_marker(len(header) + memoryview(payload).nbytes)]


def _leading(conn: Any, keys: Sequence[str], upto: int) -> int:
    """How many of the first ``upto`` keys are present before the first absent one."""
    for index in range(upto):
        if not conn.check_exist(keys[index]):
            return index
    return upto


def _uint8() -> Any:
    import torch

    return torch.uint8


__all__ = [
    "END_MAGIC",
    "END_MARKER",
    "ConnectionFactory",
    "InfiniStoreBackend",
    "InfiniStoreOptions",
    "client_config",
    "default_connection_factory",
    "end_marker",
    "error_code",
]
