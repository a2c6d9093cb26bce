"""The contract suite against every form of the Redis tier (plugins/redis), each against real
servers this module starts: standalone (with direct reads and without), TLS, unix socket,
Sentinel (plain and over TLS) and Cluster. Standalone,
TLS, unix socket and Cluster hand the suite their ServerControl, so clause 10 (deadlines and
recovery) runs against a real pause and a real restart. Clause 9 (a full store) runs against
servers of its own with a small maxmemory, once refusing writes and once evicting."""

from __future__ import annotations

import pytest

from kvplug_contracts import BackendContract
from kvplug_contracts.suite import CapacityContract
from kvplug_testing import OverTLS, OverTLSWithoutServerControl
from kvplug_testing.conformance import ControlledServer, FullServer, ServedBy

pytestmark = pytest.mark.redis


class TestRedisConformance(ControlledServer, BackendContract):
    server_fixture = "standalone"


class TestRedisThroughTheClientLibraryConformance(ControlledServer, BackendContract):
    """direct_reads=false: reads go through redis-py's pipelines and the core's frame
    decoding (BytesBackend's default receive_frames) instead of kvplug's own connections."""

    server_fixture = "standalone"

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"direct_reads": False}


class TestRedissConformance(ControlledServer, OverTLS, BackendContract):
    server_fixture = "tls_server"


class TestUnixSocketConformance(ControlledServer, BackendContract):
    server_fixture = "unix_server"


class TestSentinelConformance(ServedBy, BackendContract):
    """Failover is tested in test_redis_backend.py; stopping the whole group is not a
    Sentinel scenario, so clause 10 is n/a here."""

    server_fixture = "sentinel_group"


class TestTLSSentinelConformance(ServedBy, OverTLSWithoutServerControl, BackendContract):
    """rediss+sentinel://: TLS to the sentinels and to the master they name, with a client
    certificate (every process asks for one). Clause 10 is n/a, as for plain Sentinel."""

    server_fixture = "tls_sentinel_group"


class TestClusterConformance(ControlledServer, BackendContract):
    server_fixture = "cluster"


class TestFullRedisConformance(FullServer, CapacityContract):
    """maxmemory with noeviction: puts raise CapacityExceeded, reads keep working."""

    policy = "noeviction"


class TestEvictingRedisConformance(FullServer, CapacityContract):
    """maxmemory with allkeys-lru: evicted keys read as misses."""

    policy = "allkeys-lru"
