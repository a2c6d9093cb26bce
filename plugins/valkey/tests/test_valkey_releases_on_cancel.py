"""The Valkey tier's ``releases_on_cancel`` against real valkey-server processes: a cancelled
``get_into`` or put (and their batched forms) lets go of the caller's memory by the time its
cancellation ends, on kvplug's own connections and through valkey-py (``direct_reads=false``,
``direct_writes=false``, TLS puts, a Cluster), on asyncio and on uvloop. The checks are
``kvplug_testing.cancellation``'s; valkey-py is the client library here."""

from __future__ import annotations

import pytest

import kvplug
from kvplug_testing import ValkeyCluster, ValkeySentinelGroup, ValkeyServer
from kvplug_testing.cancellation import OPERATIONS, MasterOf, Tap, check_operation, run_on

pytestmark = pytest.mark.redis

LIBRARY = {"direct_reads": False, "direct_writes": False}


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize("path", ["direct", "client library"])
def test_a_cancelled_operation_lets_go_of_the_callers_memory(
    standalone: ValkeyServer, path: str, operation: str, loop: str
) -> None:
    options = LIBRARY if path == "client library" else {}
    with Tap(*standalone.address) as tap:
        run_on(loop, check_operation(tap.url("valkey"), tap, operation, **options))


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_over_tls_a_cancelled_operation_lets_go_of_the_callers_memory(
    tls_server: ValkeyServer, operation: str
) -> None:
    run_on("uvloop", check_operation(tls_server.url, tls_server, operation))


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_with_sentinel_a_cancelled_operation_lets_go_of_the_callers_memory(
    sentinel_group: ValkeySentinelGroup, operation: str
) -> None:
    run_on("asyncio", check_operation(sentinel_group.url, MasterOf(sentinel_group), operation))


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_on_a_cluster_a_cancelled_operation_lets_go_of_the_callers_memory(
    cluster: ValkeyCluster, operation: str
) -> None:
    run_on("uvloop", check_operation(cluster.url, cluster, operation))


def test_every_mode_declares_releases_on_cancel() -> None:
    for url in (
        "valkey://127.0.0.1:1",
        "valkeys://127.0.0.1:1",
        "valkey+sentinel://127.0.0.1:1/mymaster",
        "valkey+cluster://127.0.0.1:1",
    ):
        for options in ({}, LIBRARY):
            assert kvplug.create_backend(url, **options).capabilities.releases_on_cancel, url
