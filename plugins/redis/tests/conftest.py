"""The real servers the Redis tier's test modules share: each module that asks for one gets its
own (module scope), started on a free loopback port and killed when the module is done."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplug_testing import RedisCluster, RedisServer, SentinelGroup


@pytest.fixture(scope="module")
def standalone() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def tls_server() -> Iterator[RedisServer]:
    with RedisServer(tls=True) as server:
        yield server


@pytest.fixture(scope="module")
def unix_server() -> Iterator[RedisServer]:
    with RedisServer(unix_socket=True) as server:
        yield server


@pytest.fixture(scope="module")
def sentinel_group() -> Iterator[SentinelGroup]:
    with SentinelGroup() as group:
        yield group


@pytest.fixture(scope="module")
def tls_sentinel_group() -> Iterator[SentinelGroup]:
    with SentinelGroup(tls=True) as group:
        yield group


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster() as nodes:
        yield nodes
