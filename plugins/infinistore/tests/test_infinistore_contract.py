"""The contract suite against ``infinistore://``.

No machine here has an RDMA device, and InfiniStore's server needs one to start, so the suite
runs against a recording stand-in of InfiniStore's client (``infinistore_standin``), injected
through the backend's ``connection_factory`` seam, once over RDMA (registered staging memory,
``rdma_*_cache_async``) and once over TCP (``tcp_*_cache``). The stand-in's server listens on a
loopback port and can be paused, stopped and started, so clause 10 runs too.

TestInfiniStoreLiveConformance runs the same suite against a real server when
``KVPLUG_INFINISTORE_URL`` names one (``infinistore://host:port``, options in its query).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from infinistore_standin import StandInServer

from kvplug_contracts import BackendContract
from kvplug_contracts.suite import CapacityContract
from kvplug_contracts.support import clause, not_applicable

LIVE_URL = os.environ.get("KVPLUG_INFINISTORE_URL")

# Room for the suite's largest objects (80 MiB) with a few reads at once.
SUITE_OPTIONS = {"max_value_size": "96MiB", "staging_size": "512MiB"}


@pytest.fixture(scope="module")
def standin() -> Iterator[StandInServer]:
    server = StandInServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def small_standin() -> Iterator[StandInServer]:
    server = StandInServer(capacity=4 << 20)
    yield server
    server.close()


@clause(9)
def _full_store_elsewhere(self: object) -> None:
    """Clause 9 needs a store small enough to fill: the InfiniStore store is the server, so it
    runs against a stand-in server of 4 MiB of its own (TestFullInfiniStore*Conformance)."""
    not_applicable(
        "this stand-in server is sized for the suite's 80 MiB objects; clause 9 runs in "
        "TestFullInfiniStoreRDMAConformance and TestFullInfiniStoreTCPConformance against a "
        "stand-in server of 4 MiB"
    )


class _OnTheStandIn(BackendContract):
    connection_type = "rdma"
    test_a_full_store_evicts_or_raises_capacity_exceeded = _full_store_elsewhere
    test_an_object_larger_than_the_whole_store_never_corrupts = _full_store_elsewhere

    @pytest.fixture
    def kvplug_url(self, standin: StandInServer) -> str:
        return standin.url

    @pytest.fixture
    def kvplug_options(self, standin: StandInServer) -> dict[str, Any]:
        return {
            **SUITE_OPTIONS,
            "connection_type": self.connection_type,
            "connection_factory": standin.connection_factory(),
        }

    @pytest.fixture
    def server_control(self, standin: StandInServer) -> Iterator[StandInServer]:
        yield standin
        standin.resume()
        standin.start()


class TestInfiniStoreRDMAConformance(_OnTheStandIn):
    """connection_type=rdma (the default): staging memory registered with register_mr,
    rdma_write_cache_async / rdma_read_cache_async."""


class TestInfiniStoreTCPConformance(_OnTheStandIn):
    """connection_type=tcp: tcp_write_cache / tcp_read_cache."""

    connection_type = "tcp"


class _FullStandIn(CapacityContract):
    connection_type = "rdma"

    @pytest.fixture
    def kvplug_url(self, small_standin: StandInServer) -> str:
        return small_standin.url

    @pytest.fixture
    def kvplug_options(self, small_standin: StandInServer) -> dict[str, Any]:
        return {
            **SUITE_OPTIONS,
            "connection_type": self.connection_type,
            "connection_factory": small_standin.connection_factory(),
        }

    @pytest.fixture
    def small_store_options(self) -> dict[str, object]:
        return {}  # the stand-in behind kvplug_url is the small store (4 MiB, answers 507)


class TestFullInfiniStoreRDMAConformance(_FullStandIn):
    """A full server answers 507: put raises CapacityExceeded, reads keep working."""


class TestFullInfiniStoreTCPConformance(_FullStandIn):
    connection_type = "tcp"


@pytest.mark.skipif(
    not LIVE_URL,
    reason="set KVPLUG_INFINISTORE_URL=infinistore://host:port to run the suite against a real "
    "InfiniStore server (it needs an RDMA device; none here)",
)
class TestInfiniStoreLiveConformance(BackendContract):
    """Against a real server named by KVPLUG_INFINISTORE_URL; clause 10 needs --kvplug-proxy
    or a server_control of the operator's own, and is not run otherwise."""

    @pytest.fixture
    def kvplug_url(self) -> str:
        assert LIVE_URL
        return LIVE_URL

    @pytest.fixture
    def kvplug_options(self) -> dict[str, Any]:
        return {}
