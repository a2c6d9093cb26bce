"""The client library seam: the parts of redis-py the backend uses, and the versions it is
tested with.

The backend uses internals of the client library (its connections' stream writer, packed
commands of memoryviews), so it accepts only the versions it is tested with and otherwise
raises :class:`~kvplug.errors.PluginLoadError` when it is created. valkey-py has redis-py's
API under other names: kvplug-valkey builds a :class:`ClientLibrary` of valkey-py's parts, with
its own :class:`ClientVersions`, and hands it to :class:`~kvplug_redis.backend.RedisBackend`
through :meth:`~kvplug_redis.backend.RedisBackend.client_library`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from kvplug.errors import PluginLoadError


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
        """The range as a version specifier: ``>=5.3,<9``."""
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


def load_client_library(
    name: str, package: str, brand: str, versions: ClientVersions
) -> ClientLibrary:
    """The :class:`ClientLibrary` of a redis-py-shaped package: ``package`` (``"redis"``,
    ``"valkey"``) whose asyncio client, cluster client and errors are named after ``brand``
    (``Redis``/``RedisCluster``/``RedisError``, ``Valkey``/...). ``name`` is how messages call
    it; ``versions`` are the releases it is tested with."""
    top = importlib.import_module(package)
    aio = importlib.import_module(f"{package}.asyncio")
    cluster = importlib.import_module(f"{package}.asyncio.cluster")
    sentinel = importlib.import_module(f"{package}.asyncio.sentinel")
    retry = importlib.import_module(f"{package}.asyncio.retry")
    backoff = importlib.import_module(f"{package}.backoff")
    exceptions = importlib.import_module(f"{package}.exceptions")
    return ClientLibrary(
        name=name,
        client=getattr(aio, brand),
        connection_pool=aio.ConnectionPool,
        ssl_connection=aio.SSLConnection,
        unix_connection=aio.UnixDomainSocketConnection,
        connection=aio.Connection,
        sentinel=sentinel.Sentinel,
        sentinel_connection=sentinel.SentinelManagedConnection,
        sentinel_ssl_connection=sentinel.SentinelManagedSSLConnection,
        master_not_found=sentinel.MasterNotFoundError,
        cluster=getattr(cluster, f"{brand}Cluster"),
        cluster_node=cluster.ClusterNode,
        retry=retry.Retry,
        backoff=backoff.ExponentialBackoff,
        exceptions=exceptions,
        base_error=getattr(exceptions, f"{brand}Error"),
        cluster_exception=getattr(exceptions, f"{brand}ClusterException"),
        version=top.__version__,
        versions=versions,
    )


def redis_py() -> ClientLibrary:
    """redis-py's asyncio client (hiredis parses replies when it is installed)."""
    return load_client_library("redis-py", "redis", "Redis", REDIS_PY_VERSIONS)


__all__ = [
    "REDIS_PY_VERSIONS",
    "ClientLibrary",
    "ClientVersions",
    "load_client_library",
    "redis_py",
]
