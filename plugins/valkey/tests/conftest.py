"""The real valkey-server processes the Valkey tier's test modules share: each module that asks
for one gets its own (module scope), started on a free loopback port and killed when the module
is done. TLS ones are skipped, with the reason, when the valkey-server was built without TLS."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplug_testing import ValkeyCluster, ValkeySentinelGroup, ValkeyServer, tls_problem

TLS_PROBLEM = tls_problem()
"""Why the valkey-server cannot serve TLS (the PyPI wheels' are built without it), or None."""


def needs_tls() -> None:
    if TLS_PROBLEM is not None:
        pytest.skip(TLS_PROBLEM)


@pytest.fixture(scope="module")
def standalone() -> Iterator[ValkeyServer]:
    with ValkeyServer() as server:
        yield server


@pytest.fixture(scope="module")
def tls_server() -> Iterator[ValkeyServer]:
    needs_tls()
    with ValkeyServer(tls=True) as server:
        yield server


@pytest.fixture(scope="module")
def sentinel_group() -> Iterator[ValkeySentinelGroup]:
    with ValkeySentinelGroup() as group:
        yield group


@pytest.fixture(scope="module")
def tls_sentinel_group() -> Iterator[ValkeySentinelGroup]:
    needs_tls()
    with ValkeySentinelGroup(tls=True) as group:
        yield group


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    with ValkeyCluster() as nodes:
        yield nodes
