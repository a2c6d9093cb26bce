"""The contract suite against ``mooncakestore://`` and a real ``mooncake_master``: a master and
a node process that lends the store 1 GiB (where objects live), and the backend under test as
a pure client (``global_segment_size=0``), the way engines on other hosts use a store. The
master is the suite's ``server_control``: clause 10 runs against a real paused, killed and
restarted master. Once with P2PHANDSHAKE, once with the master's HTTP metadata server; clause 9
against a store of 16 MiB."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from mooncake_helpers import empty_store, mooncake_store, wait_until_writable

from kvplug_contracts import BackendContract
from kvplug_contracts.suite import CapacityContract
from kvplug_contracts.support import clause, not_applicable
from kvplug_testing.mooncake import MooncakeMaster


@pytest.fixture(scope="module")
def p2p_store() -> Iterator[MooncakeMaster]:
    with mooncake_store("1GiB") as master:
        yield master


@pytest.fixture(scope="module")
def http_store() -> Iterator[MooncakeMaster]:
    with mooncake_store("1GiB", http_metadata=True) as master:
        yield master


@pytest.fixture(scope="module")
def small_store() -> Iterator[MooncakeMaster]:
    with mooncake_store("16MiB") as master:
        yield master


@clause(9)
def _full_store_elsewhere(self: object) -> None:
    """Clause 9 needs a store small enough to fill: TestFullMooncakeConformance."""
    not_applicable(
        "this store lends 1 GiB for the suite's 80 MiB objects; clause 9 runs in "
        "TestFullMooncakeConformance against a node lending 16 MiB"
    )


class _AgainstMaster(BackendContract):
    test_a_full_store_evicts_or_raises_capacity_exceeded = _full_store_elsewhere
    test_an_object_larger_than_the_whole_store_never_corrupts = _full_store_elsewhere

    master: MooncakeMaster

    @pytest.fixture
    def kvplug_url(self, store: MooncakeMaster) -> str:
        return store.url(global_segment_size=0)

    @pytest.fixture
    def server_control(self, store: MooncakeMaster) -> Iterator[MooncakeMaster]:
        yield store
        if store.paused or not store.running:
            store.resume()
            store.start()
            wait_until_writable(store)


class TestMooncakeConformance(_AgainstMaster):
    """P2PHANDSHAKE: no metadata server, peers exchange endpoints on connect."""

    @pytest.fixture
    def store(self, p2p_store: MooncakeMaster) -> MooncakeMaster:
        return p2p_store


class TestMooncakeHttpMetadataConformance(_AgainstMaster):
    """The master's HTTP metadata server."""

    @pytest.fixture
    def store(self, http_store: MooncakeMaster) -> MooncakeMaster:
        return http_store


class TestFullMooncakeConformance(CapacityContract):
    """A node lending 16 MiB: puts beyond it are evicted by the master or refused."""

    @pytest.fixture
    def kvplug_url(self, small_store: MooncakeMaster) -> str:
        empty_store(small_store)  # each test starts from an empty store, not the last one's
        return small_store.url(global_segment_size=0)

    @pytest.fixture
    def small_store_options(self) -> dict[str, object]:
        return {}
