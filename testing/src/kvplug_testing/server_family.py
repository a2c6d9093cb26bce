"""Which servers a Redis-protocol tier is tested against: :data:`REDIS` (redis-server,
redis-sentinel) or :data:`VALKEY` (valkey-server, sentinels run by it), each a
:class:`ServerFamily` naming its standalone server, Sentinel group and Cluster classes, so that a
test written once starts either family's processes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvplug_testing.cluster import RedisCluster
from kvplug_testing.redis import RedisServer
from kvplug_testing.sentinel import SentinelGroup
from kvplug_testing.valkey import ValkeyCluster, ValkeySentinelGroup, ValkeyServer, tls_problem


def _built_with_tls() -> None:
    """Debian's redis-server, which scripts/setup.sh installs, always serves TLS."""
    return None


@dataclass(frozen=True)
class ServerFamily:
    """The server processes of one family; :attr:`name` is also its plain URL scheme."""

    name: str
    server: type[RedisServer]
    sentinel_group: type[SentinelGroup]
    cluster: type[RedisCluster]
    why_no_tls: Callable[[], str | None]
    """Why this family's server cannot serve TLS here, or None."""

    def skip_without_tls(self) -> None:
        """Skip the calling test, with the reason, where this family's server has no TLS."""
        problem = self.why_no_tls()
        if problem is not None:
            pytest.skip(f"{self.name} over TLS: {problem}")


REDIS = ServerFamily("redis", RedisServer, SentinelGroup, RedisCluster, _built_with_tls)
VALKEY = ServerFamily("valkey", ValkeyServer, ValkeySentinelGroup, ValkeyCluster, tls_problem)

__all__ = ["REDIS", "VALKEY", "ServerFamily"]
