"""The Redis tier's data path: KV-cache chunks as Redis strings, through redis-py's asyncio
client, and kvplug's own connections for reads.

The URL forms (``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``,
``rediss+sentinel://``, ``redis+cluster://``) are read by :mod:`kvplug_redis.urls`, the options
are :class:`~kvplug_redis.options.RedisOptions`, the clients of each event loop are made by
:mod:`kvplug_redis.connections` (with :mod:`kvplug_redis.sentinel` following the master), and
values go on the wire as :mod:`kvplug_redis.pipeline` packs them.

**Storage.** One Redis string per chunk, under ``key_prefix`` + the key's LMCache string form
(``kvplug:llama@1@0@2a@half``). The value is kvplug's whole frame (header, checksums,
payload), written by one ``SET`` (``SET ... PX`` with a ``ttl``), so data and metadata never
disagree and a reader sees the old value or the new one, never a mix. Batched operations are
one non-transactional pipeline (one round trip; per node on a cluster). ``list_keys`` uses
``SCAN MATCH <prefix>*``, never ``KEYS``.

**Direct reads.** Outside Cluster and replica reads, reads (``get``, ``get_into`` and their
batched forms) do not use the client library: they read ``GET`` replies on connections of their
own, each payload received straight into the memory the caller gets, the object returned or
``get_into``'s buffer (:meth:`RedisBackend.receive_frames`, :mod:`kvplug_redis.direct`;
``direct_reads=False`` turns this off).

**Direct writes.** Outside Cluster and TLS, puts send their ``SET`` s on those same connections,
each value's buffers (the frame header and the payload in allocator memory) handed to the socket
with ``sendmsg``, never joined or buffered; a batch goes as pipelines of about
:data:`~kvplug_redis.pipeline.PIPELINE_BYTES` on as many connections at once
(``direct_writes=False`` sends through the client library instead).

**Failures.** Every operation runs under the ``timeout`` deadline and a bound of
``max_connections`` operations in flight (further callers wait, within their deadline, rather
than fail with redis-py's ``MaxConnectionsError``). An unreachable, restarting, loading or
failing-over server raises :class:`~kvplug.errors.BackendUnavailable`, a slow one
:class:`~kvplug.errors.BackendTimeout`; the next operation reconnects by itself. A server out
of memory (``maxmemory`` with ``noeviction``) makes puts raise
:class:`~kvplug.errors.CapacityExceeded` while reads keep working, and so does a value larger
than ``max_value_size`` or the server's ``proto-max-bulk-len`` (read at the first put).

**Client versions.** The backend uses internals of the client library (the connections'
stream writer, packed commands of memoryviews), so it accepts only the versions it is tested
with (:data:`~kvplug_redis.client_library.REDIS_PY_VERSIONS`, the range kvplug-redis pins) and
otherwise raises :class:`~kvplug.errors.PluginLoadError` when it is created.

**Credentials** come from the options, then the URL, then the ``REDIS_USERNAME`` and
``REDIS_PASSWORD`` environment variables; they are never logged.

kvplug-valkey reuses this class: valkey-py has redis-py's API, so a subclass swaps the client
library (:meth:`RedisBackend.client_library`), the schemes and the environment prefix.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

from kvplug.backend import Buffer, BytesBackend, Capabilities, gather_all
from kvplug.errors import (
    BackendClosed,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    CapacityExceeded,
    InvalidBackendURL,
    KvplugError,
)
from kvplug.frame import FrameReceiver
from kvplug.keys import CacheKey, InvalidKey
from kvplug.memory import Allocator
from kvplug.options import BackendOptions
from kvplug.url import BackendURL
from kvplug_redis.client_library import ClientLibrary, redis_py
from kvplug_redis.connections import (
    CONNECTS_AT_ONCE,
    ConnectionBudget,
    LoopClients,
    make_loop_clients,
    restore_startup_nodes,
)
from kvplug_redis.direct import DirectConnections, Endpoint, pack
from kvplug_redis.failures import NoMasterHint, translate
from kvplug_redis.options import RedisOptions, credentials, sentinel_password
from kvplug_redis.pipeline import (
    PIPELINE_BYTES,
    fetch_spread,
    group_by_size,
    send_sets,
    set_command,
)
from kvplug_redis.sentinel import MasterTracker
from kvplug_redis.tls import ssl_context, tls_settings
from kvplug_redis.urls import Mode, UrlForms, escape_glob

T = TypeVar("T")

logger = logging.getLogger("kvplug.redis")

SCAN_COUNT = 1000
"""The ``COUNT`` hint of each ``SCAN`` page of ``list_keys``."""
PROBE_TTL_MS = 60_000
"""The probe key of :meth:`RedisBackend.ping` expires by itself if its ``DEL`` is lost."""


class RedisBackend(BytesBackend):
    """A shared, persistent byte store on Redis: standalone, TLS, unix socket, Sentinel or
    Cluster, chosen by the URL's scheme (:mod:`kvplug_redis.urls` lists the URL forms).

    **Atomicity.** Each object is one Redis string holding the whole frame, written by one
    ``SET``: readers see the old value or the new one (clause 3), and there is no separate
    metadata key to disagree with the data.

    **Event loops.** The client library's connections belong to one event loop, so each loop
    that uses the backend (one at a time: another thread's ``asyncio.run``, a
    :class:`~kvplug.runtime.sync.SyncClient` it is handed to) gets connections of its own, closed
    with
    the backend or when that loop shuts down.

    **Replicas.** With ``read_from_replicas`` (Sentinel, Cluster), gets and contains go to
    replicas, which lag the master: a get right after a put may miss. Off by default.

    **Cancellation** (``releases_on_cancel``, in every mode): a cancelled ``get_into`` or put
    has let go of the caller's memory when its cancellation ends. kvplug's own connections
    abort the connection and detach the reply reader before the operation raises
    (:mod:`kvplug_redis.direct`); the client library reads into memory of its own, copied into
    the caller's only once a reply is complete, and gets copies of what it sends (a slice at a
    time, :func:`~kvplug_redis.pipeline.send_sets`; a cluster's values are joined), since a
    transport may keep what it was given after the put ended.
    """

    capabilities = Capabilities(
        persistent=True,
        shared_across_processes=True,
        native_batching=True,
        remove=True,
        list_keys=True,
        releases_on_cancel=True,
    )
    Options: ClassVar[type[BackendOptions]] = RedisOptions
    options: RedisOptions

    schemes: ClassVar[Mapping[str, Mode]] = {
        "redis": Mode.STANDALONE,
        "rediss": Mode.TLS,
        "unix": Mode.UNIX,
        "redis+sentinel": Mode.SENTINEL,
        "redis-sentinel": Mode.SENTINEL,
        "rediss+sentinel": Mode.SENTINEL,
        "redis+cluster": Mode.CLUSTER,
    }
    """Scheme -> how to connect; a subclass for another client library renames them. Where two
    schemes share a mode, hints name the first (plain) or the first TLS one."""
    tls_schemes: ClassVar[frozenset[str]] = frozenset({"rediss", "rediss+sentinel"})
    """The schemes whose connections use TLS, the one place that says so (:attr:`tls`): every
    ``Mode.TLS`` scheme, and the Sentinel scheme that speaks TLS both to the sentinels and to
    the servers they name. A subclass that renames :attr:`schemes` renames these too."""
    env_prefix: ClassVar[str] = "REDIS"
    """Environment variables: ``REDIS_USERNAME``, ``REDIS_PASSWORD``,
    ``REDIS_SENTINEL_PASSWORD``, ``REDIS_SERVICE_NAME``."""
    default_port: ClassVar[int] = 6379
    default_sentinel_port: ClassVar[int] = 26379
    default_service_name: ClassVar[str] = "mymaster"

    @classmethod
    def client_library(cls) -> ClientLibrary:
        """The client library; kvplug-valkey returns valkey-py's parts."""
        return redis_py()

    @classmethod
    def url_forms(cls) -> UrlForms:
        """The URL forms this class serves, from its class attributes."""
        return UrlForms(
            schemes=cls.schemes,
            tls_schemes=cls.tls_schemes,
            env_prefix=cls.env_prefix,
            default_port=cls.default_port,
            default_sentinel_port=cls.default_sentinel_port,
            default_service_name=cls.default_service_name,
        )

    def __init__(
        self, url: BackendURL | str, *, allocator: Allocator | None = None, **options: Any
    ) -> None:
        parsed = BackendURL.parse(url)
        forms = self.url_forms()
        forms.refuse_secrets_in_query(parsed)
        super().__init__(parsed, allocator=allocator, **options)
        mode = self.schemes.get(self.url.scheme)
        if mode is None:
            raise InvalidBackendURL(
                f"{type(self).__name__} does not serve {self.url.scheme}://; it serves "
                f"{', '.join(s + '://' for s in self.schemes)}."
            )
        self.mode = mode
        forms.check_options_fit(self.url, mode, self.options)
        self.target = forms.target(self.url, mode, self.options)
        self._lib = self.client_library()
        self._lib.check_version()
        self._in_flight = 0
        # Made now, though they connect only when used: bad TLS files fail at creation.
        self._clients = self._make_clients()
        """The clients of the event loop used last (or not yet used): see
        :meth:`_clients_here`."""
        self._clients_elsewhere: list[LoopClients] = []
        """The clients of other loops, until those loops close or the backend does."""
        self.direct = self._make_direct_connections()
        """kvplug's own connections (module :mod:`kvplug_redis.direct`), or None where reads
        and writes go through the client library."""
        self.reads_direct = self.direct is not None and self._can_read_direct()
        """Whether gets read on :attr:`direct` connections, into the caller's memory."""
        self.writes_direct = (
            self.direct is not None and self.options.direct_writes and self.direct.sends_from_memory
        )
        """Whether puts send on :attr:`direct` connections, from the object's memory."""
        if self.direct is not None and self.tracker is not None:
            self.tracker.on_change(self.direct.forget)
        self._ttl_ms = None if self.options.ttl is None else max(1, round(self.options.ttl * 1000))
        self._bulk_limit: int | None = None
        """The server's ``proto-max-bulk-len`` once read (:meth:`_read_bulk_limit`)."""
        self._bulk_limit_read = False

    @property
    def tracker(self) -> MasterTracker | None:
        """Sentinel: which server the sentinels name master, followed as it changes (module
        :mod:`kvplug_redis.sentinel`), in the event loop used last; None in the other modes."""
        return self._clients.tracker

    def _clients_here(self) -> LoopClients:
        """The clients of the running event loop, made at its first operation. Why: the
        client library's connections and the tracker's tasks belong to one loop, and a backend
        may be used from another (one at a time: another thread's ``asyncio.run``, a
        :class:`~kvplug.runtime.sync.SyncClient` it was handed to)."""
        loop = asyncio.get_running_loop()
        clients = self._clients
        if clients.loop is loop:
            return clients
        if clients.loop is None:
            clients.keep(str(self.url), self._drop_direct_connections_here)
            return clients
        others = [
            c
            for c in (clients, *self._clients_elsewhere)
            if c.loop is not None and not c.loop.is_closed()  # a closed loop's are let go
        ]
        mine = next((c for c in others if c.loop is loop), None)
        if mine is None:
            mine = self._make_clients()
            mine.keep(str(self.url), self._drop_direct_connections_here)
            if self.direct is not None:
                if mine.tracker is not None:
                    mine.tracker.on_change(self.direct.forget)
                # Its endpoint came from another loop's tracker, which may not follow the
                # master any more: this loop's tracker is asked afresh.
                self.direct.forget()
        self._clients = mine
        self._clients_elsewhere = [c for c in others if c is not mine]
        return mine

    @property
    def tls(self) -> bool:
        """Whether connections to the servers use TLS (``rediss://``, ``rediss+sentinel://``;
        with Sentinel, the sentinels' connections too)."""
        return self.url.scheme in self.tls_schemes

    # -- configuration ---------------------------------------------------------------------------

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a subclass whose :attr:`tls_schemes` do not match its :attr:`schemes`: a
        ``Mode.TLS`` scheme left out would connect in the clear."""
        super().__init_subclass__(**kwargs)
        mismatch = cls.url_forms().tls_mismatch()
        if mismatch is not None:
            raise TypeError(f"{cls.__name__}.{mismatch}")

    def _scheme_of(self, mode: Mode, *, tls: bool = False) -> str:
        """This class's scheme for ``mode`` as hints spell it (``redis+sentinel://``), its TLS
        form with ``tls`` (``rediss+sentinel://``) where the mode has one."""
        return self.url_forms().scheme_of(mode, tls=tls)

    def _credentials(self) -> tuple[str | None, str | None]:
        """(username, password): the options, else the URL, else the environment."""
        return credentials(self.options, self.url, self.env_prefix)

    def _make_clients(self) -> LoopClients:
        """The clients of one event loop (:func:`~kvplug_redis.connections.make_loop_clients`);
        a TLS scheme's PEM files are checked each time."""
        return make_loop_clients(
            self._lib,
            self.mode,
            self.target,
            self.options,
            credentials=self._credentials(),
            sentinel_password=sentinel_password(self.options, self.env_prefix),
            tls=tls_settings(self.options, self.url) if self.tls else None,
        )

    # -- running operations ----------------------------------------------------------------------

    async def _run(
        self,
        what: str,
        operation: Callable[[Any], Awaitable[T]],
        *,
        read: bool = False,
        direct: bool = False,
    ) -> T:
        """``operation(client)`` under the bound on operations in flight, with the library's
        errors turned into kvplug's. An operation on the client library's connections (not
        ``direct``) also waits for one of them to be idle, or for a spare one to be opened
        (:class:`~kvplug_redis.connections.ConnectionBudget`).

        It also has a deadline of its own, ``options.timeout``, for the calls that run outside
        a public operation (:meth:`ping`, pages of ``list_keys``, ``read_raw``); within one,
        the operation's deadline, which started first, ends it first."""
        self.ensure_open()
        clients = self._clients_here()
        client = clients.reader if read else clients.writer
        budget = None if direct or self.mode is Mode.CLUSTER else clients.budget
        self._in_flight += 1
        try:
            return await self._run_bounded(what, operation, client, budget, clients.slots)
        finally:
            self._in_flight -= 1
            if self.closed and not self._in_flight:
                # An operation in flight during close() may have been connecting while close()
                # emptied the pools; its new connection would stay open (and valkey-py's
                # Sentinel connections then fail in __del__). The last one closes them again.
                await clients.aclose(str(self.url))

    async def _run_bounded(
        self,
        what: str,
        operation: Callable[[Any], Awaitable[T]],
        client: Any,
        budget: ConnectionBudget | None,
        slots: asyncio.Semaphore,
    ) -> T:
        async def bounded() -> T:
            async with slots:
                if budget is None:
                    self.ensure_open()  # close() may have run while this operation waited
                    try:
                        return await operation(client)
                    except BaseException:  # failed, timed out or cancelled
                        if self.mode is Mode.CLUSTER:
                            restore_startup_nodes(self._lib, client, self.target.hosts)
                        raise
                await budget.admit()
                try:
                    self.ensure_open()
                    return await operation(client)
                finally:
                    budget.done()

        limit = self.options.timeout
        try:
            try:
                async with asyncio.timeout(limit):
                    return await bounded()
            except TimeoutError:
                raise BackendTimeout(
                    f"{what} on {self.url} took longer than {limit} s; the server is slow or "
                    "unreachable. Raise the 'timeout' option or check the server."
                ) from None
        except KvplugError:
            if self.closed:
                raise BackendClosed(
                    f"{what} on {self.url} was cut short by close(); open a new backend."
                ) from None
            raise
        except Exception as error:
            translated = self._translate(error, what)
            if translated is error:  # MemoryError, as the template leaves it
                raise
            raise translated from error

    def _translate(self, error: Exception, what: str) -> Exception:
        """The library's ``error`` as the kvplug error that tells the caller what to do
        (:func:`~kvplug_redis.failures.translate`); one of no kind known there as the template
        translates a hook's (:meth:`~kvplug.backend.Backend.translate_error`)."""
        if self.closed:
            return BackendClosed(f"{what} on {self.url} was cut short by close(); open a new one.")
        translated = translate(
            error,
            f"{what} on {self.url}",
            self._lib,
            env_prefix=self.env_prefix,
            no_master=self._no_master_hint(),
        )
        return self.translate_error(what, error) if translated is error else translated

    def _no_master_hint(self) -> NoMasterHint:
        return NoMasterHint(
            service=self.target.service,
            tls=self.tls,
            tls_sentinel_scheme=self._scheme_of(Mode.SENTINEL, tls=True),
        )

    async def _read_bulk_limit(self, what: str) -> None:
        """Read the server's ``proto-max-bulk-len`` (on a cluster, the smallest of the
        primaries') once, for :meth:`_check_size`. Why before sending: the server answers a
        longer value with a protocol error and drops the connection, for a large value while
        it is still being sent, which reads as an unreachable server. Where ``CONFIG GET`` is
        refused (ACL) or renamed, values are checked against ``max_value_size`` only."""
        async with self._clients_here().reading_bulk_limit:
            if self._bulk_limit_read:
                return
            try:
                self._bulk_limit = await self._run(
                    f"{what} (reading proto-max-bulk-len)", self._server_bulk_limit
                )
            except (BackendUnavailable, BackendClosed):
                raise
            except BackendError as error:
                logger.info(
                    "%s: the server's proto-max-bulk-len cannot be read (%s); puts are checked "
                    "against max_value_size (%d) alone. Set max_value_size to the server's "
                    "proto-max-bulk-len: a longer value is cut off by the server mid-send, "
                    "which reads as an unreachable server",
                    self.url,
                    error,
                    self.options.max_value_size,
                )
            self._bulk_limit_read = True

    async def _server_bulk_limit(self, client: Any) -> int | None:
        nodes: list[Any] = [None]
        if self.mode is Mode.CLUSTER:
            nodes = await self._primaries(client)
        limits: list[int] = []
        for node in nodes:
            target = {} if node is None else {"target_nodes": node}
            reply = await client.config_get("proto-max-bulk-len", **target)
            value = reply.get("proto-max-bulk-len")
            if value is None or not str(value).isdigit():
                return None
            limits.append(int(value))
        return min(limits)

    def _check_size(self, key: str, size: int) -> None:
        server, option = self._bulk_limit, self.options.max_value_size
        if server is not None and size > server and server <= option:
            raise CapacityExceeded(
                f"put of {key!r} on {self.url}: the object is {size} bytes, more than the "
                f"server's proto-max-bulk-len ({server} bytes), the largest value it takes. "
                "Store smaller chunks, or raise proto-max-bulk-len on the server to at least "
                f"that (CONFIG SET proto-max-bulk-len {size}, and in its config file); "
                f"max_value_size ({option}) must allow it too."
            )
        if size > option:
            raise CapacityExceeded(
                f"put of {key!r} on {self.url}: the object is {size} bytes, more than "
                f"max_value_size ({option}), the largest value this backend sends. Store "
                "smaller chunks, or raise max_value_size (and the server's proto-max-bulk-len "
                "if it is lower)."
            )

    def _value(self, key: str, parts: Sequence[Buffer]) -> bytes:
        """One bytes value from the frame's parts, checked against ``max_value_size``."""
        # Why a join: a client command argument is one bulk string, so a pipelined or cluster
        # SET needs the frame as one buffer (single puts avoid it: _set_pieces).
        value = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        self._check_size(key, len(value))
        return value

    def _set_pieces(self, key: str, parts: Sequence[Buffer]) -> list[bytes | memoryview]:
        """``SET key <frame> [PX ms]`` as RESP pieces, the frame's parts sent as they are
        (:func:`~kvplug_redis.pipeline.set_command`), checked against the size limits."""
        views = [memoryview(part).cast("B") for part in parts]
        size = sum(view.nbytes for view in views)
        self._check_size(key, size)
        return set_command(key.encode(), views, size, self._ttl_ms)

    # -- kvplug's own connections ---------------------------------------------------------------

    def _can_read_direct(self) -> bool:
        return self.options.direct_reads and not self.options.read_from_replicas

    def _make_direct_connections(self) -> DirectConnections | None:
        """kvplug's own connections, which read ``GET`` values straight into allocator memory
        and send ``SET`` values from it (see :mod:`kvplug_redis.direct`): to one server (plain,
        TLS, unix socket) or to the master the sentinels name. Cluster (slots, redirections)
        stays with the client library, as do replica reads, TLS writes, and what
        ``direct_reads=False`` or ``direct_writes=False`` turn off."""
        options = self.options
        if self.mode is Mode.CLUSTER or not (self._can_read_direct() or options.direct_writes):
            return None
        username, password = self._credentials()
        setup: list[bytes] = []
        if password is not None or username:
            auth = (username, password or "") if username else (password or "",)
            setup.append(pack(b"AUTH", *(part.encode() for part in auth)))
        if self.target.db:
            setup.append(pack(b"SELECT", b"%d" % self.target.db))
        setup.append(pack(b"CLIENT", b"SETNAME", b"kvplug"))
        direct = DirectConnections(
            locate=self._direct_endpoint,
            errors=self._lib.exceptions,
            setup=setup,
            auth_first=password is not None or bool(username),
            ssl_context=ssl_context(self.options, self.url) if self.tls else None,
            max_idle=options.max_connections,
            max_connecting=CONNECTS_AT_ONCE,
            suspect=self._suspect_master if self.mode is Mode.SENTINEL else None,
        )
        return direct

    def _drop_direct_connections_here(self) -> None:
        """The running loop shuts down: its own connections are closed with it."""
        if self.direct is not None:
            self.direct.drop_connections_here()

    def _suspect_master(self) -> None:
        """An own connection broke or met ``READONLY``: the tracker asks again."""
        tracker = self._clients_here().tracker
        if tracker is not None:
            tracker.suspect()

    async def _direct_endpoint(self) -> Endpoint:
        """Where own connections go: the URL's server, or the master the sentinels name now
        (asked again after a broken connection or a ``READONLY`` reply)."""
        target = self.target
        tracker = self._clients_here().tracker
        if tracker is not None:
            host, port = await tracker.locate()
            return Endpoint(host=host, port=port)
        if target.socket_path is not None:
            return Endpoint(path=target.socket_path)
        host, port = target.hosts[0]
        return Endpoint(host=host, port=port)

    # -- reads -----------------------------------------------------------------------------------

    async def receive_frames(self, keys: Sequence[str], receivers: Sequence[FrameReceiver]) -> None:
        """With :attr:`direct` reads: one pipeline of ``GET`` s on kvplug's own connections,
        each value received by the socket straight into its receiver's memory (the object
        ``get`` returns, or ``get_into``'s buffer); reads into the caller's buffers are spread
        over up to :data:`FETCH_SPREAD` connections. Without: :meth:`batched_get_bytes`, then
        one copy (the default). A read that fails or is cancelled aborts its connections
        before it raises, so nothing writes into the receivers afterwards."""
        direct = self.direct
        if direct is None or not self.reads_direct:
            await super().receive_frames(keys, receivers)
            return
        what = "get" if len(keys) == 1 else f"get of {len(keys)} keys"
        if len(keys) > 1 and all(receiver.into is not None for receiver in receivers):
            await self._run(
                what, lambda _client: fetch_spread(direct, keys, receivers), read=True, direct=True
            )
        else:
            await self._run(
                what, lambda _client: direct.fetch(keys, receivers), read=True, direct=True
            )

    async def get_bytes(self, key: str) -> Buffer | None:
        value: bytes | None = await self._run("get", lambda c: c.get(key), read=True)
        return value

    async def batched_get_bytes(self, keys: Sequence[str]) -> list[Buffer | None]:
        """One pipeline of ``GET`` s through the client library (direct reads off)."""

        def gets(pipe: Any) -> None:
            for key in keys:
                pipe.get(key)

        values: list[Buffer | None] = await self._run(
            f"get of {len(keys)} keys", lambda c: self._pipelined(c, gets), read=True
        )
        return values

    # -- writes ----------------------------------------------------------------------------------

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        if not self._bulk_limit_read:  # known after the first put: no lock on the hot path
            await self._read_bulk_limit("put")
        if self.mode is Mode.CLUSTER:
            value = self._value(key, parts)
            await self._run("put", lambda c: c.set(key, value, px=self._ttl_ms))
            return
        pieces = self._set_pieces(key, parts)
        direct = self.direct
        if direct is not None and self.writes_direct:
            await self._run("put", lambda _client: direct.store(pieces, 1), direct=True)
        else:
            await self._run("put", lambda c: send_sets(c, pieces, self._lib))

    async def batched_put_bytes(
        self, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        """Pipelines of ``SET`` s of about ``PIPELINE_BYTES`` each (one for a usual batch)."""
        if not self._bulk_limit_read:
            await self._read_bulk_limit("batched_put")
        await self._run(
            "batched_put",
            lambda c: self._put_pipelines(c, keys, values),
            direct=self.writes_direct and self.mode is not Mode.CLUSTER,
        )

    async def _put_pipelines(
        self, client: Any, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        batches = group_by_size(keys, values, PIPELINE_BYTES)
        if self.mode is Mode.CLUSTER:
            for batch in batches:
                joined = [(key, self._value(key, parts)) for key, parts in batch]

                def sets(pipe: Any, joined: list[tuple[str, bytes]] = joined) -> None:
                    for key, value in joined:
                        pipe.set(key, value, px=self._ttl_ms)

                await self._pipelined(client, sets)
            return
        # Several pipelines on several connections at once: the server reads one while this
        # process writes the next. Every value is checked (its size) before any is sent, and
        # all pipelines end before the objects are let go.
        packed = [
            [p for k, parts in batch for p in self._set_pieces(k, parts)] for batch in batches
        ]
        direct = self.direct
        await gather_all(
            direct.store(pieces, len(batch))
            if direct is not None and self.writes_direct
            else send_sets(client, pieces, self._lib, len(batch))
            for pieces, batch in zip(packed, batches, strict=True)
        )

    async def remove_bytes(self, key: str) -> bool:
        count: int = await self._run("remove", lambda c: c.delete(key))
        return count > 0

    # -- existence -------------------------------------------------------------------------------

    async def contains_bytes(self, key: str) -> bool:
        direct = self.direct
        if direct is not None and self.reads_direct:
            found = await self._run(
                "contains", lambda _client: direct.exists([key]), read=True, direct=True
            )
            return found[0]
        count: int = await self._run("contains", lambda c: c.exists(key), read=True)
        return count > 0

    async def batched_exists_bytes(self, keys: Sequence[str]) -> list[bool]:
        """One pipeline of ``EXISTS`` (on kvplug's own connections where reads are)."""
        direct = self.direct
        if direct is not None and self.reads_direct:
            return await self._run(
                "batched_exists",
                lambda _client: direct.exists(keys),
                read=True,
                direct=True,
            )

        def exists(pipe: Any) -> None:
            for key in keys:
                pipe.exists(key)

        counts = await self._run("batched_exists", lambda c: self._pipelined(c, exists), read=True)
        return [bool(count) for count in counts]

    @staticmethod
    async def _pipelined(client: Any, commands: Callable[[Any], None]) -> list[Any]:
        async with client.pipeline(transaction=False) as pipe:
            commands(pipe)
            results: list[Any] = await pipe.execute()
            return results

    # -- listing, health, lifecycle --------------------------------------------------------------

    async def _list_keys(self) -> AsyncIterator[CacheKey]:
        """Keys under ``key_prefix``, found with ``SCAN MATCH <prefix>*`` (never ``KEYS``),
        page by page, each page under the deadline; keys that do not parse as a
        :class:`~kvplug.keys.CacheKey` (other tools' keys) are skipped. Keys written or
        removed during the scan may or may not be listed."""
        prefix = self.options.key_prefix
        pattern = escape_glob(prefix) + "*"
        seen: set[bytes] = set()  # SCAN may return a key twice
        async for page in self._scan_pages(pattern):
            for raw in page:
                if raw in seen:
                    continue
                seen.add(raw)
                try:
                    yield CacheKey.parse(raw.decode()[len(prefix) :])
                except (UnicodeDecodeError, InvalidKey):
                    continue

    async def _scan_pages(self, pattern: str) -> AsyncIterator[list[bytes]]:
        """Pages of ``SCAN`` results; on a cluster, every primary is scanned in turn."""
        nodes: list[Any] = [None]
        if self.mode is Mode.CLUSTER:
            nodes = await self._run("list_keys", self._primaries)
        for node in nodes:
            cursor = 0
            while True:
                cursor, page = await self._run("list_keys", self._scanner(cursor, pattern, node))
                yield page
                if not cursor:
                    break

    @staticmethod
    def _scanner(
        cursor: int, pattern: str, node: Any
    ) -> Callable[[Any], Awaitable[tuple[int, list[bytes]]]]:
        async def scan(client: Any) -> tuple[int, list[bytes]]:
            if node is None:
                next_cursor, page = await client.scan(cursor, match=pattern, count=SCAN_COUNT)
                return int(next_cursor), list(page)
            cursors, page = await client.scan(
                cursor, match=pattern, count=SCAN_COUNT, target_nodes=node
            )
            return int(cursors[node.name]), list(page)

        return scan

    @staticmethod
    async def _primaries(client: Any) -> list[Any]:
        await client.initialize()
        nodes: list[Any] = client.get_primaries()
        return nodes

    async def ping(self) -> float:
        """A data-path health check: ``SET`` a random probe value under ``key_prefix``, ``GET``
        it back and ``DEL`` it, on the master. Returns the round trip in seconds; raises
        :class:`~kvplug.errors.BackendUnavailable`/:class:`~kvplug.errors.BackendTimeout`
        like any operation, and :class:`~kvplug.errors.BackendError` if the value read back
        differs."""
        name = f"{self.options.key_prefix}kvplug-probe:{secrets.token_hex(8)}"
        token = secrets.token_bytes(16)

        async def round_trip(client: Any) -> tuple[bytes | None, float]:
            started = time.perf_counter()
            await client.set(name, token, px=PROBE_TTL_MS)
            got: bytes | None = await client.get(name)
            await client.delete(name)
            return got, time.perf_counter() - started

        got, seconds = await self._run("ping", round_trip)
        if got != token:
            raise BackendError(
                f"ping on {self.url}: the probe key read back {got!r}, not what was written. "
                "Something else writes under this key_prefix, or the server is misbehaving."
            )
        return seconds

    async def _open(self) -> None:
        """Check that the server answers a ``PING``. An unreachable server is logged, not
        raised: operations raise :class:`~kvplug.errors.BackendUnavailable` until it answers,
        then work without a reopen. Refused credentials raise now."""
        try:
            await self._run("open", lambda c: c.ping())
        except BackendUnavailable as error:
            logger.warning("%s is not reachable now; operations will retry: %s", self.url, error)

    async def _close(self) -> None:
        """Close the connections. Operations in flight end with
        :class:`~kvplug.errors.BackendClosed`. The clients of another event loop are closed
        on that loop: now if it runs (in another thread), else when it runs next."""
        if self.direct is not None:
            self.direct.close()  # aborts reads in flight before their objects are released
        here = asyncio.get_running_loop()
        where = str(self.url)
        closing: list[Awaitable[None]] = []
        for clients in (self._clients, *self._clients_elsewhere):
            loop = clients.loop
            if loop is None or loop is here:
                closing.append(clients.aclose(where))
            elif not loop.is_closed():
                elsewhere = asyncio.run_coroutine_threadsafe(clients.aclose(where), loop)
                if loop.is_running():
                    closing.append(asyncio.wrap_future(elsewhere))
        for outcome in await asyncio.gather(*closing, return_exceptions=True):
            if isinstance(outcome, Exception):
                logger.debug("%s: error while closing: %s", self.url, outcome)


__all__ = ["RedisBackend"]
