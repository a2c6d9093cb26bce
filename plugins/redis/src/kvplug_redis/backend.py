"""The Redis tier: KV-cache chunks as Redis strings, through redis-py's asyncio client.

URL forms (options go in the query or in code/config, which win)::

    redis://[user[:password]@]host[:port][/db]           one server (port 6379 by default)
    rediss://host:6380?ssl_ca_certs=/etc/ca.pem          the same over TLS
    unix:///run/redis/redis.sock?db=1                    a unix socket
    redis+sentinel://[user[:password]@]h1:26379,h2:26379/mymaster
                                                         a Sentinel-managed master
                                                         (LMCache's redis-sentinel:// too)
    rediss+sentinel://h1:26379,h2:26379/mymaster?ssl_ca_certs=/etc/ca.pem
                                                         the same, TLS to the sentinels and
                                                         to the servers they name
    redis+cluster://[user[:password]@]h1:7000,h2:7001    a Redis Cluster

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
with (:data:`REDIS_PY_VERSIONS`, the range kvplug-redis pins) and otherwise raises
:class:`~kvplug.errors.PluginLoadError` when it is created.

**Credentials** come from the options, then the URL, then the ``REDIS_USERNAME`` and
``REDIS_PASSWORD`` environment variables; they are never logged.

kvplug-valkey reuses this class: valkey-py has redis-py's API, so a subclass swaps the client
library (:meth:`RedisBackend.client_library`), the schemes and the environment prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import os
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Literal, TypeVar

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import Field, SecretStr, field_validator

from kvplug.backend import Buffer, BytesBackend, Capabilities, gather_all
from kvplug.errors import (
    BackendClosed,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    CapacityExceeded,
    InvalidBackendURL,
    KvplugError,
    PluginLoadError,
)
from kvplug.frame import FrameReceiver
from kvplug.keys import CacheKey, InvalidKey
from kvplug.memory import Allocator
from kvplug.options import BackendOptions, BytesBackendOptions
from kvplug.units import parse_size
from kvplug.url import BackendURL
from kvplug_redis.connections import ConnectionBudget, LoopClients, tracked_connection_class
from kvplug_redis.direct import DirectReads, Endpoint, pack
from kvplug_redis.sentinel import MasterTracker

T = TypeVar("T")

logger = logging.getLogger("kvplug.redis")

SEND_SLICE_BYTES = 1 << 20
"""A put hands the socket at most this many bytes at a time (see ``_set_on``)."""


def _slices(pieces: Sequence[bytes | memoryview], limit: int) -> Iterator[list[memoryview]]:
    """``pieces`` regrouped into lists of views of at most ``limit`` bytes, in order."""
    group: list[memoryview] = []
    size = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while view.nbytes:
            take = view[: limit - size]
            group.append(take)
            size += take.nbytes
            view = view[take.nbytes :]
            if size == limit:
                yield group
                group, size = [], 0
    if group:
        yield group


FETCH_SPREAD = 4
"""A batch of direct reads into the caller's buffers (``batched_get_into``, an engine's load)
is spread over at most this many connections at once."""


async def _fetch_spread(
    direct: DirectReads, names: Sequence[str], receivers: Sequence[FrameReceiver]
) -> None:
    """``direct.fetch`` of ``names`` into ``receivers``, in up to :data:`FETCH_SPREAD`
    pipelines on their own connections at once (the server sends on one while this reads
    another); the first error once every pipeline has ended, so none still writes."""
    parts = min(FETCH_SPREAD, len(names))
    bounds = [len(names) * i // parts for i in range(parts + 1)]
    await gather_all(
        direct.fetch(names[lo:hi], receivers[lo:hi]) for lo, hi in itertools.pairwise(bounds)
    )


PIPELINE_BYTES = 64 << 20
"""A batched put sends its values in pipelines of about this many bytes, so a large batch is
not joined into memory all at once."""
SCAN_COUNT = 1000
"""The ``COUNT`` hint of each ``SCAN`` page of ``list_keys``."""
PROBE_TTL_MS = 60_000
"""The probe key of :meth:`RedisBackend.ping` expires by itself if its ``DEL`` is lost."""
CONNECTS_AT_ONCE = 8
"""Connections being opened at once, by the client library and by direct reads each: a burst
of tasks waits for these (and reuses them) instead of starting hundreds of TLS handshakes that
starve every request (:mod:`kvplug_redis.connections`)."""


class Mode(enum.Enum):
    """How the backend reaches Redis, chosen by the URL's scheme."""

    STANDALONE = "standalone"
    TLS = "tls"
    UNIX = "unix"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


@dataclass(frozen=True)
class ClientVersions:
    """The versions of a client library that a plugin is tested with: the one place that
    says so, which the plugin's distribution pins too (a test compares them)."""

    plugin: str
    """The plugin's distribution, which pins the range: ``kvplug-redis``."""
    distribution: str
    """The client library's distribution, as pip names it: ``redis``."""
    lowest: tuple[int, ...]
    """The lowest version tested: ``(5, 3)``."""
    below: int
    """The first major version not tested: ``9``."""

    @property
    def range(self) -> str:
        """For messages: ``5.3 to 8.x``, or ``6.x``."""
        last = f"{self.below - 1}.x"
        if self.lowest == (self.below - 1,):
            return last
        return f"{'.'.join(map(str, self.lowest))} to {last}"

    @property
    def specifier(self) -> str:
        return f">={'.'.join(map(str, self.lowest))},<{self.below}"

    @property
    def requirement(self) -> str:
        """What to ``pip install``: ``redis>=5.3,<9``."""
        return self.distribution + self.specifier

    def covers(self, version: str) -> bool:
        """Whether ``version`` (``8.1.0``, pre-releases included) lies in the tested range."""
        try:
            parsed = Version(version)
        except InvalidVersion:
            return False
        return SpecifierSet(self.specifier).contains(parsed, prereleases=True)


REDIS_PY_VERSIONS = ClientVersions(
    plugin="kvplug-redis", distribution="redis", lowest=(5, 3), below=9
)
"""redis-py 5.3 to 8.x (the tests run 8.1.0; 5.3.0, 6.4.0 and 7.0.1 were checked too). Before
5.3 a connection pool's ``get_connection`` needs a command name, which the put path omits."""


@dataclass(frozen=True)
class ClientLibrary:
    """The parts of the client library the backend uses. redis-py and valkey-py have the same
    API under different names, so kvplug-valkey hands valkey-py's parts here; the fields are
    typed ``Any`` because they are one library's classes or the other's."""

    name: str
    """For messages: ``redis-py``."""
    client: Any
    """The asyncio client class (``redis.asyncio.Redis``), with ``from_pool``."""
    connection_pool: Any
    """``redis.asyncio.ConnectionPool``."""
    ssl_connection: Any
    """``redis.asyncio.SSLConnection``."""
    unix_connection: Any
    """``redis.asyncio.UnixDomainSocketConnection``."""
    connection: Any
    """``redis.asyncio.Connection`` (TCP)."""
    sentinel: Any
    """``redis.asyncio.sentinel.Sentinel``."""
    sentinel_connection: Any
    """``redis.asyncio.sentinel.SentinelManagedConnection``."""
    sentinel_ssl_connection: Any
    """``redis.asyncio.sentinel.SentinelManagedSSLConnection``."""
    master_not_found: type[Exception]
    """``redis.asyncio.sentinel.MasterNotFoundError``."""
    cluster: Any
    """``redis.asyncio.cluster.RedisCluster``."""
    cluster_node: Any
    """``redis.asyncio.cluster.ClusterNode``."""
    retry: Any
    """``redis.asyncio.retry.Retry``."""
    backoff: Any
    """``redis.backoff.ExponentialBackoff``."""
    exceptions: ModuleType
    """``redis.exceptions``: ``ConnectionError``, ``TimeoutError``, ``ResponseError`` ..."""
    base_error: type[Exception]
    """The root of the library's errors (``RedisError``)."""
    cluster_exception: type[Exception]
    """The cluster client's set-up error, outside ``base_error`` (``RedisClusterException``)."""
    version: str
    """The installed version (``redis.__version__``)."""
    versions: ClientVersions
    """The versions the plugin is tested with (:data:`REDIS_PY_VERSIONS`)."""

    def check_version(self) -> None:
        """Raise :class:`~kvplug.errors.PluginLoadError` if :attr:`version` is not tested."""
        tested = self.versions
        if tested.covers(self.version):
            return
        raise PluginLoadError(
            f"{tested.plugin} is tested with {self.name} {tested.range} "
            f"({tested.requirement}), but {self.name} {self.version} is installed: the backend "
            "relies on internals of the library (its connections' stream writer, packed "
            "commands) that other versions lack or may change. Install a tested one: "
            f"pip install '{tested.requirement}'"
        )


def redis_py() -> ClientLibrary:
    """redis-py's asyncio client (hiredis parses replies when it is installed)."""
    import redis.asyncio
    import redis.asyncio.cluster
    import redis.asyncio.retry
    import redis.asyncio.sentinel
    import redis.backoff
    import redis.exceptions

    return ClientLibrary(
        name="redis-py",
        client=redis.asyncio.Redis,
        connection_pool=redis.asyncio.ConnectionPool,
        ssl_connection=redis.asyncio.SSLConnection,
        unix_connection=redis.asyncio.UnixDomainSocketConnection,
        connection=redis.asyncio.Connection,
        sentinel=redis.asyncio.sentinel.Sentinel,
        sentinel_connection=redis.asyncio.sentinel.SentinelManagedConnection,
        sentinel_ssl_connection=redis.asyncio.sentinel.SentinelManagedSSLConnection,
        master_not_found=redis.asyncio.sentinel.MasterNotFoundError,
        cluster=redis.asyncio.cluster.RedisCluster,
        cluster_node=redis.asyncio.cluster.ClusterNode,
        retry=redis.asyncio.retry.Retry,
        backoff=redis.backoff.ExponentialBackoff,
        exceptions=redis.exceptions,
        base_error=redis.exceptions.RedisError,
        cluster_exception=redis.exceptions.RedisClusterException,
        version=redis.__version__,
        versions=REDIS_PY_VERSIONS,
    )


class RedisOptions(BytesBackendOptions):
    """Options of the Redis schemes (query parameters or keyword options; keywords win)."""

    key_prefix: str = Field(
        "kvplug:",
        description="prepended to every Redis key; one prefix per deployment or tenant",
    )
    ttl: float | None = Field(
        None, gt=0, description="seconds a stored chunk lives (SET ... PX); none by default"
    )
    max_connections: int = Field(
        256,
        ge=1,
        description="operations in flight at most (and connections per server, for the client "
        "library and for direct reads each)",
    )
    db: int | None = Field(
        None, ge=0, description="database number (default: the URL path /N, else 0)"
    )
    username: str | None = Field(None, description="ACL user (wins over the URL and env)")
    password: SecretStr | None = Field(None, description="password (wins over URL and env)")
    max_value_size: int = Field(
        512 << 20,
        description="largest frame a put sends; the server's proto-max-bulk-len, read at the "
        "first put, bounds it too",
    )
    ssl_ca_certs: str | None = Field(None, description="TLS schemes: CA bundle (PEM)")
    ssl_certfile: str | None = Field(None, description="TLS schemes: client certificate (PEM)")
    ssl_keyfile: str | None = Field(None, description="TLS schemes: client private key (PEM)")
    ssl_cert_reqs: Literal["required", "optional", "none"] = Field(
        "required", description="TLS schemes: how the server certificate is checked"
    )
    ssl_check_hostname: bool = Field(
        True, description="TLS schemes: the certificate must name the host"
    )
    read_from_replicas: bool = Field(
        False, description="Sentinel and Cluster: gets and contains may go to replicas"
    )
    direct_reads: bool = Field(
        True,
        description="read GET replies straight into allocator memory; off: through the client "
        "library (Cluster and read_from_replicas always read through it)",
    )
    sentinel_username: str | None = Field(None, description="Sentinel: user of the sentinels")
    sentinel_password: SecretStr | None = Field(
        None, description="Sentinel: password of the sentinels (default: REDIS_SENTINEL_PASSWORD)"
    )
    master_check_interval: float = Field(
        1.0,
        gt=0,
        description="Sentinel: seconds between questions to the sentinels about which server "
        "is master (also asked at every +switch-master and after a broken connection)",
    )

    @field_validator("max_value_size", mode="before")
    @classmethod
    def _parse_max_value_size(cls, value: object) -> int:
        return parse_size(value, what="redis max_value_size")


_SECRET_OPTIONS = ("password", "sentinel_password")
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password", "master_check_interval")


@dataclass(frozen=True)
class Target:
    """Where the URL points: validated hosts, socket path, database and Sentinel service."""

    hosts: tuple[tuple[str, int], ...] = ()
    socket_path: str | None = None
    db: int = 0
    service: str | None = None


def escape_glob(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (``SCAN MATCH``)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisBackend(BytesBackend):
    """A shared, persistent byte store on Redis: standalone, TLS, unix socket, Sentinel or
    Cluster, chosen by the URL's scheme (see the module docstring for the URL forms).

    **Atomicity.** Each object is one Redis string holding the whole frame, written by one
    ``SET``: readers see the old value or the new one (clause 3), and there is no separate
    metadata key to disagree with the data.

    **Event loops.** The client library's connections belong to one event loop, so each loop
    that uses the backend (one at a time: another thread's ``asyncio.run``, a
    :class:`~kvplug.sync.SyncClient` it is handed to) gets connections of its own, closed with
    the backend or when that loop shuts down.

    **Replicas.** With ``read_from_replicas`` (Sentinel, Cluster), gets and contains go to
    replicas, which lag the master: a get right after a put may miss. Off by default.
    """

    capabilities = Capabilities(
        persistent=True,
        shared_across_processes=True,
        native_batching=True,
        remove=True,
        list_keys=True,
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

    def __init__(
        self, url: BackendURL | str, *, allocator: Allocator | None = None, **options: Any
    ) -> None:
        parsed = BackendURL.parse(url)
        self._refuse_secrets_in_query(parsed)
        super().__init__(parsed, allocator=allocator, **options)
        mode = self.schemes.get(self.url.scheme)
        if mode is None:
            raise InvalidBackendURL(
                f"{type(self).__name__} does not serve {self.url.scheme}://; it serves "
                f"{', '.join(s + '://' for s in self.schemes)}."
            )
        self.mode = mode
        self._check_options_fit_the_scheme()
        self.target = self._target()
        self._lib = self.client_library()
        self._lib.check_version()
        self._in_flight = 0
        # Made now, though they connect only when used: bad TLS files fail at creation.
        self._clients = self._make_clients()
        """The clients of the event loop used last (or not yet used): see
        :meth:`_clients_here`."""
        self._clients_elsewhere: list[LoopClients] = []
        """The clients of other loops, until those loops close or the backend does."""
        self.direct = self._make_direct_reads()
        """The connections of direct reads (module :mod:`kvplug_redis.direct`), or None where
        gets go through the client library."""
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
        :class:`~kvplug.sync.SyncClient` it was handed to)."""
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

    def _refuse_secrets_in_query(self, url: BackendURL) -> None:
        leaked = [name for name in _SECRET_OPTIONS if name in url.options]
        if leaked:
            # The URL is not shown: its query, which holds the secret, is not masked.
            raise InvalidBackendURL(
                f"a {url.scheme}:// URL has {leaked[0]!r} in its query, where URLs are logged "
                f"unmasked. Put the password in the user-info part "
                f"({url.scheme}://user:password@host), in ${self.env_prefix}_PASSWORD, or in "
                "the option given in code or config."
            )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a subclass whose :attr:`tls_schemes` do not match its :attr:`schemes`: a
        ``Mode.TLS`` scheme left out would connect in the clear."""
        super().__init_subclass__(**kwargs)
        tls_mode = {scheme for scheme, mode in cls.schemes.items() if mode is Mode.TLS}
        if not tls_mode <= cls.tls_schemes <= set(cls.schemes):
            raise TypeError(
                f"{cls.__name__}.tls_schemes must hold every Mode.TLS scheme of its schemes "
                f"({', '.join(sorted(tls_mode))}) and no other class's schemes; it holds "
                f"{', '.join(sorted(cls.tls_schemes))}."
            )

    def _scheme_of(self, mode: Mode, *, tls: bool = False) -> str:
        """This class's scheme for ``mode`` as hints spell it (``redis+sentinel://``), its TLS
        form with ``tls`` (``rediss+sentinel://``) where the mode has one."""
        named = [scheme for scheme, m in self.schemes.items() if m is mode]
        fitting = (scheme for scheme in named if (scheme in self.tls_schemes) == tls)
        return next(fitting, named[0]) + "://"

    def _fail(self, problem: str, fix: str) -> InvalidBackendURL:
        return InvalidBackendURL(f"{self.url}: {problem}. {fix}")

    def _check_options_fit_the_scheme(self) -> None:
        given = self.options.model_fields_set
        scheme = self.url.scheme
        sentinel_scheme = self._scheme_of(Mode.SENTINEL, tls=self.tls)
        if not self.tls:
            tls = [name for name in _TLS_OPTIONS if name in given]
            if tls:
                raise self._fail(
                    f"option {tls[0]!r} applies to TLS, which {scheme}:// does not use",
                    self._tls_hint(),
                )
        if self.mode is not Mode.SENTINEL:
            sentinel = [name for name in _SENTINEL_OPTIONS if name in given]
            if sentinel:
                raise self._fail(
                    f"option {sentinel[0]!r} applies to Sentinel only",
                    f"Use {sentinel_scheme}h1:26379,h2:26379/service, or drop the option",
                )
        if self.options.read_from_replicas and self.mode not in (Mode.SENTINEL, Mode.CLUSTER):
            raise self._fail(
                f"read_from_replicas needs replicas that {scheme}:// cannot find",
                f"Use {sentinel_scheme} or {self._scheme_of(Mode.CLUSTER)}, or drop the option",
            )

    def _tls_hint(self) -> str:
        """The scheme to write for TLS instead of this plain one."""
        tls_sentinel = self._scheme_of(Mode.SENTINEL, tls=True) + "h1:26379,h2:26379/service"
        tls_server = self._scheme_of(Mode.TLS, tls=True) + "host:port"
        if self.mode is Mode.SENTINEL:
            return f"Use {tls_sentinel} for TLS to the sentinels and servers, or drop the option"
        if self.mode is Mode.CLUSTER:
            return (
                f"TLS to a Cluster is not offered; use {tls_server} or {tls_sentinel}, or drop "
                "the option"
            )
        return f"Use {tls_server} for TLS, or drop the option"

    def _target(self) -> Target:
        url, mode = self.url, self.mode
        scheme = url.scheme
        if mode is Mode.UNIX:
            if url.hosts or not url.path.startswith("/") or url.path.endswith("/"):
                raise self._fail(
                    "a unix:// URL names a socket file by its absolute path and has no host",
                    "Write three slashes: unix:///run/redis/redis.sock",
                )
            return Target(socket_path=url.path, db=self.options.db or 0)
        if not url.hosts:
            example = {
                Mode.SENTINEL: f"{scheme}://h1:26379,h2:26379/mymaster",
                Mode.CLUSTER: f"{scheme}://h1:7000,h2:7001",
            }.get(mode, f"{scheme}://host:{self.default_port}")
            raise self._fail("it names no host", f"Write it as {example}")
        if mode is Mode.SENTINEL:
            port = self.default_sentinel_port
            service = url.path.strip("/") or (
                os.environ.get(f"{self.env_prefix}_SERVICE_NAME") or self.default_service_name
            )
            if "/" in service:
                raise self._fail(
                    f"the path {url.path!r} is not one Sentinel service name",
                    f"Write it as {scheme}://h1:26379,h2:26379/mymaster",
                )
            hosts = tuple((host, p or port) for host, p in url.hosts)
            return Target(hosts=hosts, db=self.options.db or 0, service=service)
        hosts = tuple((host, p or self.default_port) for host, p in url.hosts)
        if mode is Mode.CLUSTER:
            if url.path.strip("/") or self.options.db:
                raise self._fail(
                    "Redis Cluster has only database 0",
                    f"Drop the path and the db option: {scheme}://h1:7000,h2:7001",
                )
            return Target(hosts=hosts)
        if len(hosts) > 1:
            raise self._fail(
                f"{scheme}:// takes one host, it names {len(hosts)}",
                f"Use {self._scheme_of(Mode.SENTINEL, tls=self.tls)}h1,h2/service or "
                f"{self._scheme_of(Mode.CLUSTER)}h1,h2 for several servers",
            )
        db_text = url.path.strip("/")
        if db_text and not (db_text.isascii() and db_text.isdigit()):
            raise self._fail(
                f"the path {url.path!r} is not a database number",
                f"Write the database as a number: {scheme}://host:{self.default_port}/0",
            )
        db = self.options.db if self.options.db is not None else int(db_text or 0)
        return Target(hosts=hosts, db=db)

    def _credentials(self) -> tuple[str | None, str | None]:
        """(username, password): the options, else the URL, else the environment."""
        env = os.environ
        username = (
            self.options.username
            or self.url.username
            or env.get(f"{self.env_prefix}_USERNAME")
            or None
        )
        if self.options.password is not None:
            password: str | None = self.options.password.get_secret_value()
        elif self.url.password is not None:
            password = self.url.password
        else:
            password = env.get(f"{self.env_prefix}_PASSWORD") or None
        return username, password

    def _quick_retry(self) -> Any:
        """One retry of a broken connection, 10-100 ms later (see ``_make_clients``)."""
        lib = self._lib
        return lib.retry(lib.backoff(cap=0.1, base=0.01), 1, (lib.exceptions.ConnectionError,))

    def _make_clients(self) -> LoopClients:
        """The clients of one event loop: the writer, and the reader (the same one unless reads
        may go to replicas), with Sentinel the tracker that names the master."""
        lib, options, target = self._lib, self.options, self.target
        budget = ConnectionBudget(CONNECTS_AT_ONCE)
        slots = asyncio.Semaphore(options.max_connections)
        username, password = self._credentials()
        common: dict[str, Any] = {
            "username": username,
            "password": password,
            "socket_timeout": options.timeout,
            "socket_connect_timeout": options.timeout,
            # One quick retry on a broken connection: after a server restart every pooled
            # connection is dead, and the retry reconnects instead of failing the operation.
            # Timeouts are not retried: the deadline is already spent. (redis-py's default
            # backs off for seconds, which also makes Sentinel discovery slow past a dead
            # sentinel.)
            "retry": self._quick_retry(),
            # valkey-py retries a command only for the errors listed here (redis-py for the
            # retry's own): without it a broken connection fails the command at once.
            "retry_on_error": [lib.exceptions.ConnectionError],
            "client_name": "kvplug",
        }
        if self.mode is Mode.CLUSTER:
            if options.read_from_replicas:
                common["read_from_replicas"] = True  # only when asked: deprecated in redis-py 5.3
            client = lib.cluster(
                startup_nodes=[lib.cluster_node(host, port) for host, port in target.hosts],
                max_connections=options.max_connections,
                **common,
            )
            return LoopClients(client, client, None, None, budget, slots)
        common["db"] = target.db
        if self.mode is Mode.SENTINEL:
            sentinel_password = (
                options.sentinel_password.get_secret_value()
                if options.sentinel_password is not None
                else os.environ.get(f"{self.env_prefix}_SENTINEL_PASSWORD") or None
            )
            # ssl=True makes the sentinels' clients use SSLConnection and the master/replica
            # pools SentinelManagedSSLConnection; both get the same certificates.
            tls: dict[str, Any] = {"ssl": True, **self._ssl_settings()} if self.tls else {}
            sentinel = lib.sentinel(
                list(target.hosts),
                sentinel_kwargs={
                    "username": options.sentinel_username,
                    "password": sentinel_password,
                    "socket_timeout": options.timeout,
                    "socket_connect_timeout": options.timeout,
                    "max_connections": options.max_connections,
                    "retry": self._quick_retry(),
                    "client_name": "kvplug",
                    **tls,
                },
                **common,
                **tls,
            )
            assert target.service is not None
            tracker = MasterTracker(
                sentinels=sentinel.sentinels,
                service=target.service,
                interval=options.master_check_interval,
                timeout=options.timeout,
                not_found=lib.master_not_found,
            )
            # Why: the client library asks the sentinels at every new connection and keeps
            # connections to a deposed master that still answers; the tracker decides instead.
            sentinel.discover_master = lambda _service: tracker.locate()
            base = lib.sentinel_ssl_connection if self.tls else lib.sentinel_connection
            writer = sentinel.master_for(
                target.service,
                max_connections=options.max_connections,
                connection_class=self._connection_class(base, budget, tracker),
            )
            reader = writer
            if options.read_from_replicas:
                reader = sentinel.slave_for(
                    target.service,
                    max_connections=options.max_connections,
                    connection_class=self._connection_class(base, budget, None),
                )
            return LoopClients(writer, reader, sentinel, tracker, budget, slots)
        if self.mode is Mode.UNIX:
            base = lib.unix_connection
            common.update(path=target.socket_path)
        else:
            base = lib.ssl_connection if self.tls else lib.connection
            (host, port) = target.hosts[0]
            common.update(host=host, port=port)
        if self.tls:
            common.update(self._ssl_settings())
        common.update(connection_class=self._connection_class(base, budget, None))
        pool = lib.connection_pool(max_connections=options.max_connections, **common)
        client = lib.client.from_pool(pool)
        return LoopClients(client, client, None, None, budget, slots)

    def _connection_class(
        self, base: type[Any], budget: ConnectionBudget, tracker: MasterTracker | None
    ) -> type[Any]:
        """``base`` reporting its connections to the operations' ``budget``, and with a
        ``tracker`` connecting only to the master it names (see
        :func:`~kvplug_redis.connections.tracked_connection_class`)."""
        return tracked_connection_class(
            base,
            budget=budget,
            tracker=tracker,
            moved_error=self._lib.exceptions.ConnectionError,
        )

    def _ssl_settings(self) -> dict[str, Any]:
        """The ``ssl_*`` connection arguments of a TLS scheme, its PEM files checked now so a
        wrong path fails at creation, not as an unreachable server later."""
        options = self.options
        for name in _TLS_OPTIONS:
            path = getattr(options, name)
            if path is not None and not Path(path).is_file():
                raise self._fail(
                    f"{name} {path!r} is not a readable file", "Give the path of a PEM file"
                )
        return {
            "ssl_ca_certs": options.ssl_ca_certs,
            "ssl_certfile": options.ssl_certfile,
            "ssl_keyfile": options.ssl_keyfile,
            "ssl_cert_reqs": options.ssl_cert_reqs,
            "ssl_check_hostname": options.ssl_check_hostname,
        }

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
                    return await operation(client)
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
            raise self._translate(error, what) from error

    def _translate(self, error: Exception, what: str) -> Exception:
        """The library's ``error`` as the kvplug error that tells the caller what to do."""
        if self.closed:
            return BackendClosed(f"{what} on {self.url} was cut short by close(); open a new one.")
        errors = self._lib.exceptions
        where = f"{what} on {self.url}"
        reason = f"{type(error).__name__}: {error}"

        def classes(*names: str) -> tuple[type[Exception], ...]:
            return tuple(getattr(errors, name) for name in names if hasattr(errors, name))

        if isinstance(
            error, classes("AuthenticationError", "AuthorizationError", "NoPermissionError")
        ):
            return BackendError(
                f"{where} was refused ({reason}). Check the user name and password (URL, "
                f"options or ${self.env_prefix}_USERNAME/${self.env_prefix}_PASSWORD) and the "
                "user's ACL permissions."
            )
        if isinstance(error, classes("OutOfMemoryError")) or (
            isinstance(error, errors.ResponseError) and str(error).startswith("OOM")
        ):
            return CapacityExceeded(
                f"{where} failed: the server is full ({error}). Raise its maxmemory, set an "
                "eviction policy such as allkeys-lru, or use a ttl; reads keep working."
            )
        if isinstance(error, errors.ResponseError) and "invalid bulk length" in str(error):
            return CapacityExceeded(
                f"{where} failed: the server refused a value longer than its "
                f"proto-max-bulk-len ({error}). Store smaller chunks, or raise proto-max-bulk-len "
                "on the server (CONFIG SET proto-max-bulk-len); set max_value_size to the "
                "server's limit so such values are refused before they are sent."
            )
        if isinstance(error, errors.TimeoutError):
            return BackendTimeout(
                f"{where} timed out ({reason}): the server is slow or unreachable. Check it, or "
                "raise the 'timeout' option."
            )
        if type(error).__name__ in ("MasterNotFoundError", "SlaveNotFoundError"):
            return BackendUnavailable(self._no_master_message(where, type(error).__name__))
        unavailable = (
            errors.ConnectionError,
            OSError,
            self._lib.cluster_exception,
            *classes("ReadOnlyError", "ClusterDownError", "TryAgainError", "BusyLoadingError"),
        )
        if isinstance(error, unavailable):
            return BackendUnavailable(
                f"{where} failed ({reason}): the server is unreachable, restarting, loading or "
                "failing over. Operations succeed again once it answers; check the server if "
                "this persists."
            )
        if isinstance(error, errors.ResponseError):
            return BackendError(f"{where} was rejected by the server: {error}.")
        if isinstance(error, self._lib.base_error):
            return BackendError(f"{where} failed in {self._lib.name} ({reason}).")
        return error

    def _no_master_message(self, where: str, error_name: str) -> str:
        """Why no sentinel named a server, without the library's message: that lists every
        sentinel client's repr and says nothing of the usual cause, TLS on one side only (the
        whole error stays the ``__cause__``)."""
        if self.tls:
            check = (
                "their TLS set-up: ssl_ca_certs must hold the CA of their certificates, and "
                "sentinels with tls-auth-clients need ssl_certfile and ssl_keyfile"
            )
        else:
            check = (
                "whether they listen on TLS only: then use "
                f"{self._scheme_of(Mode.SENTINEL, tls=True)} with the ssl_* options"
            )
        return (
            f"{where} failed ({error_name}): no sentinel named a server of service "
            f"{self.target.service!r}. The sentinels are unreachable or failing over, do not "
            f"watch that service, or refuse this client; check {check}. Operations succeed "
            "again once a sentinel answers."
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
        """``SET key <frame> [PX ms]`` as RESP pieces, the frame's parts sent as they are.
        Why: joining a 32 MiB payload behind its 128-byte header costs a copy per put; the
        pieces go to the socket in one ``writelines``, still as one ``SET``, so a reader never
        sees a header without its payload."""
        views = [memoryview(part).cast("B") for part in parts]
        size = sum(view.nbytes for view in views)
        self._check_size(key, size)
        name = key.encode()
        count = 3 if self._ttl_ms is None else 5
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (count, len(name), name, size)
        tail = b"\r\n"
        if self._ttl_ms is not None:
            ms = b"%d" % self._ttl_ms
            tail += b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
        return [head, *views, tail]

    async def _send_set(
        self, client: Any, pieces: list[bytes | memoryview], count: int = 1
    ) -> None:
        """``count`` packed ``SET`` s (``pieces``, one pipeline) on a connection of
        ``client``'s pool, retried like the client's own commands (one quick retry of a
        broken connection); the first error reply is raised once all replies are read."""
        pool = client.connection_pool
        # redis-py >= 5.3 warns when get_connection gets a command name; valkey-py needs one.
        conn = await (
            pool.get_connection("SET") if self._lib.name == "valkey-py" else pool.get_connection()
        )
        try:
            await conn.retry.call_with_retry(
                lambda: self._set_on(conn, pieces, count), lambda error: conn.disconnect()
            )
        finally:
            await pool.release(conn)

    async def _set_on(self, conn: Any, pieces: list[bytes | memoryview], count: int) -> None:
        answered = False
        refused: Exception | None = None
        try:
            # Why slices: asyncio (before Python 3.12) keeps what the socket did not take in
            # one bytearray and deletes each sent part from its front, so handing it a 32 MiB
            # value at once costs a memmove of the rest per send (0.3 GB/s); slices of a few
            # MiB, each drained, keep that buffer small.
            for index, group in enumerate(_slices(pieces, SEND_SLICE_BYTES)):
                await conn.send_packed_command(group, check_health=index == 0)
            for _ in range(count):
                try:
                    await conn.read_response()
                except self._lib.exceptions.ResponseError as error:
                    refused = refused or error  # an error reply (OOM ...): read on
            answered = True
        finally:
            if not answered:
                # Why abort: drain() returns with up to the high-water mark still buffered, and
                # since Python 3.12 the transport buffers our memoryviews without copying; a
                # plain close would go on sending them after the caller released the payload.
                writer = getattr(conn, "_writer", None)
                if writer is not None:
                    writer.transport.abort()
                with contextlib.suppress(Exception):
                    await conn.disconnect(nowait=True)
        if refused is not None:
            raise refused

    # -- direct reads --------------------------------------------------------------------------

    def _make_direct_reads(self) -> DirectReads | None:
        """kvplug's own ``GET`` connections, which read values straight into allocator memory
        (see :mod:`kvplug_redis.direct`): to one server (plain, TLS, unix socket) or to the
        master the sentinels name. Cluster (slots, redirections) and replica reads stay with
        the client library, as does everything with ``direct_reads=False``."""
        options = self.options
        if not options.direct_reads or options.read_from_replicas or self.mode is Mode.CLUSTER:
            return None
        username, password = self._credentials()
        setup: list[bytes] = []
        if password is not None or username:
            auth = (username, password or "") if username else (password or "",)
            setup.append(pack(b"AUTH", *(part.encode() for part in auth)))
        if self.target.db:
            setup.append(pack(b"SELECT", b"%d" % self.target.db))
        setup.append(pack(b"CLIENT", b"SETNAME", b"kvplug"))
        direct = DirectReads(
            locate=self._direct_endpoint,
            errors=self._lib.exceptions,
            setup=setup,
            auth_first=password is not None or bool(username),
            ssl_context=self._ssl_context() if self.tls else None,
            max_idle=options.max_connections,
            max_connecting=CONNECTS_AT_ONCE,
            suspect=self._suspect_master if self.mode is Mode.SENTINEL else None,
        )
        return direct

    def _drop_direct_connections_here(self) -> None:
        """The running loop shuts down: its direct-read connections are closed with it."""
        if self.direct is not None:
            self.direct.drop_connections_here()

    def _suspect_master(self) -> None:
        """A direct read met a broken connection or ``READONLY``: the tracker asks again."""
        tracker = self._clients_here().tracker
        if tracker is not None:
            tracker.suspect()

    async def _direct_endpoint(self) -> Endpoint:
        """Where direct reads connect: the URL's server, or the master the sentinels name now
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

    def _ssl_context(self) -> ssl.SSLContext:
        """The ``ssl_*`` options as an :class:`ssl.SSLContext` for direct reads, checking the
        server as the client library's TLS connections do."""
        options = self.options
        verify = {
            "required": ssl.CERT_REQUIRED,
            "optional": ssl.CERT_OPTIONAL,
            "none": ssl.CERT_NONE,
        }[options.ssl_cert_reqs]
        try:
            context = ssl.create_default_context(cafile=options.ssl_ca_certs)
            context.check_hostname = options.ssl_check_hostname and verify != ssl.CERT_NONE
            context.verify_mode = verify
            if options.ssl_certfile is not None:
                context.load_cert_chain(options.ssl_certfile, options.ssl_keyfile)
        except (ssl.SSLError, OSError) as error:
            raise self._fail(
                f"the TLS files could not be loaded ({error})",
                "Give PEM files: ssl_ca_certs a CA bundle, ssl_certfile and ssl_keyfile the "
                "client certificate and its key",
            ) from None
        return context

    # -- reads -----------------------------------------------------------------------------------

    async def receive_frames(self, keys: Sequence[str], receivers: Sequence[FrameReceiver]) -> None:
        """With :attr:`direct` reads: one pipeline of ``GET`` s on kvplug's own connections,
        each value received by the socket straight into its receiver's memory (the object
        ``get`` returns, or ``get_into``'s buffer); reads into the caller's buffers are spread
        over up to :data:`FETCH_SPREAD` connections. Without: :meth:`batched_get_bytes`, then
        one copy (the default). A read that fails or is cancelled aborts its connections
        before it raises, so nothing writes into the receivers afterwards."""
        direct = self.direct
        if direct is None:
            await super().receive_frames(keys, receivers)
            return
        what = "get" if len(keys) == 1 else f"get of {len(keys)} keys"
        if len(keys) > 1 and all(receiver.into is not None for receiver in receivers):
            await self._run(
                what, lambda _client: _fetch_spread(direct, keys, receivers), read=True, direct=True
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
        await self._run("put", lambda c: self._send_set(c, pieces))

    async def batched_put_bytes(
        self, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        """Pipelines of ``SET`` s of about ``PIPELINE_BYTES`` each (one for a usual batch)."""
        if not self._bulk_limit_read:
            await self._read_bulk_limit("batched_put")
        await self._run("batched_put", lambda c: self._put_pipelines(c, keys, values))

    async def _put_pipelines(
        self, client: Any, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        batches: list[list[tuple[str, Sequence[Buffer]]]] = []
        batch: list[tuple[str, Sequence[Buffer]]] = []
        size = 0
        for key, parts in zip(keys, values, strict=True):
            batch.append((key, parts))
            size += sum(memoryview(part).nbytes for part in parts)
            if size >= PIPELINE_BYTES:
                batches.append(batch)
                batch, size = [], 0
        if batch:
            batches.append(batch)
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
        await gather_all(
            self._send_set(client, pieces, len(batch))
            for pieces, batch in zip(packed, batches, strict=True)
        )

    async def remove_bytes(self, key: str) -> bool:
        count: int = await self._run("remove", lambda c: c.delete(key))
        return count > 0

    # -- existence -------------------------------------------------------------------------------

    async def contains_bytes(self, key: str) -> bool:
        count: int = await self._run("contains", lambda c: c.exists(key), read=True)
        return count > 0

    async def batched_contains_bytes(self, keys: Sequence[str]) -> list[bool]:
        """One pipeline of ``EXISTS``."""

        def exists(pipe: Any) -> None:
            for key in keys:
                pipe.exists(key)

        counts = await self._run(
            "batched_contains", lambda c: self._pipelined(c, exists), read=True
        )
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


__all__ = [
    "REDIS_PY_VERSIONS",
    "ClientLibrary",
    "ClientVersions",
    "Mode",
    "RedisBackend",
    "RedisOptions",
    "Target",
    "escape_glob",
    "redis_py",
]
