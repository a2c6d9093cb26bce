"""The contract suite against every form of the Redis tier (plugins/redis), each against real
servers this module starts: standalone (with direct reads and without), TLS, unix socket,
Sentinel (plain and over TLS) and Cluster. Standalone,
TLS, unix socket and Cluster hand the suite their ServerControl, so clause 10 (deadlines and
recovery) runs against a real pause and a real restart. Clause 9 (a full store) runs against
servers of its own with a small maxmemory, once refusing writes and once evicting."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplug_contracts import BackendContract
from kvplug_contracts.suite import CapacityContract
from kvplug_testing import OverTLS, RedisCluster, RedisServer, SentinelGroup

pytestmark = pytest.mark.redis


class TestRedisConformance(BackendContract):
    @pytest.fixture
    def kvplug_url(self, standalone: RedisServer) -> str:
        return standalone.url

    @pytest.fixture
    def server_control(self, standalone: RedisServer) -> RedisServer:
        return standalone


class TestRedisThroughTheClientLibraryConformance(BackendContract):
    """direct_reads=false: reads go through redis-py's pipelines and the core's frame
    decoding (BytesBackend's default receive_frames) instead of kvplug's own connections."""

    @pytest.fixture
    def kvplug_url(self, standalone: RedisServer) -> str:
        return standalone.url

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"direct_reads": False}

    @pytest.fixture
    def server_control(self, standalone: RedisServer) -> RedisServer:
        return standalone


class TestRedissConformance(OverTLS, BackendContract):
    @pytest.fixture
    def kvplug_url(self, tls_server: RedisServer) -> str:
        return tls_server.url

    @pytest.fixture
    def server_control(self, tls_server: RedisServer) -> RedisServer:
        return tls_server


class TestUnixSocketConformance(BackendContract):
    @pytest.fixture
    def kvplug_url(self, unix_server: RedisServer) -> str:
        return unix_server.url

    @pytest.fixture
    def server_control(self, unix_server: RedisServer) -> RedisServer:
        return unix_server


class TestSentinelConformance(BackendContract):
    """Failover is tested in test_redis_backend.py; stopping the whole group is not a
    Sentinel scenario, so clause 10 is n/a here."""

    @pytest.fixture
    def kvplug_url(self, sentinel_group: SentinelGroup) -> str:
        return sentinel_group.url


class TestTLSSentinelConformance(OverTLS, BackendContract):
    """rediss+sentinel://: TLS to the sentinels and to the master they name, with a client
    certificate (every process asks for one). Clause 10 is n/a, as for plain Sentinel."""

    @pytest.fixture
    def kvplug_url(self, tls_sentinel_group: SentinelGroup) -> str:
        assert tls_sentinel_group.url.startswith("rediss+sentinel://")
        return tls_sentinel_group.url


class TestClusterConformance(BackendContract):
    @pytest.fixture
    def kvplug_url(self, cluster: RedisCluster) -> str:
        return cluster.url

    @pytest.fixture
    def server_control(self, cluster: RedisCluster) -> RedisCluster:
        return cluster


class TestFullRedisConformance(CapacityContract):
    """maxmemory with noeviction: puts raise CapacityExceeded, reads keep working."""

    @pytest.fixture
    def kvplug_url(self) -> Iterator[str]:
        with RedisServer(maxmemory="4mb", policy="noeviction") as server:
            yield server.url

    @pytest.fixture
    def small_store_options(self) -> dict[str, object]:
        return {}  # the server behind kvplug_url is the small store


class TestEvictingRedisConformance(CapacityContract):
    """maxmemory with allkeys-lru: evicted keys read as misses."""

    @pytest.fixture
    def kvplug_url(self) -> Iterator[str]:
        with RedisServer(maxmemory="4mb", policy="allkeys-lru") as server:
            yield server.url

    @pytest.fixture
    def small_store_options(self) -> dict[str, object]:
        return {}
