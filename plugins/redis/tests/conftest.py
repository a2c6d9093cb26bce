"""The real servers the Redis tier's test modules share: redis-server's family of
kvplug_testing.server_fixtures, and a server on a unix socket. Each module that asks for one
gets its own (module scope), started on a free loopback port or socket and killed when the
module is done."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplug_testing import RedisServer
from kvplug_testing.server_family import REDIS, ServerFamily
from kvplug_testing.server_fixtures import *  # noqa: F403  (the fixtures, for this folder)


@pytest.fixture(scope="session")
def server_family() -> ServerFamily:
    return REDIS


@pytest.fixture(scope="module")
def unix_server() -> Iterator[RedisServer]:
    with RedisServer(unix_socket=True) as server:
        yield server
