"""Errors the client library raises that are none of its own classes, against real
redis-server and valkey-server processes, through redis-py and valkey-py.

A failover or a resharding closes connections that other tasks are using (the cluster client
disconnects the nodes it replaces, ``ConnectionPool.disconnect`` every connection in use), and
an operation caught between the library's "connected?" check and its write then fails inside
the library with ``AttributeError: 'NoneType' object has no attribute 'writelines'``. Here a
connection is disconnected with the library's own ``disconnect()`` exactly in that window; the
operation must fail with a kvplug error (retryable: ``BackendUnavailable``), the server's
password must not appear in it, and the next operation must succeed on a new connection."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

import kvplug
from kvplug import BackendUnavailable, CacheKey
from kvplug.backend import Backend
from kvplug_redis import RedisBackend
from kvplug_testing import RedisServer, ValkeyServer
from kvplug_testing.tier_checks import make_obj, run

pytestmark = pytest.mark.redis

PASSWORD = "cl13nt-errors-pw"

Operation = Callable[[Backend, CacheKey], Awaitable[Any]]


async def _get(backend: Backend, key: CacheKey) -> Any:
    got = await backend.get(key)
    if got is not None:
        got.release()


async def _batched_get(backend: Backend, key: CacheKey) -> Any:
    for got in await backend.batched_get([key, key]):
        if got is not None:
            got.release()


async def _put(backend: Backend, key: CacheKey) -> None:
    obj = make_obj(1)
    try:
        await backend.put(key, obj)
    finally:
        obj.release()


async def _batched_put(backend: Backend, key: CacheKey) -> None:
    obj = make_obj(2)
    try:
        await backend.batched_put([key], [obj])
    finally:
        obj.release()


async def _list_keys(backend: Backend, key: CacheKey) -> list[CacheKey]:
    return [listed async for listed in backend.list_keys()]


async def _ping(backend: Backend, key: CacheKey) -> float:
    assert isinstance(backend, RedisBackend)
    return await backend.ping()


OPERATIONS: dict[str, Operation] = {
    "get": _get,
    "batched_get": _batched_get,
    "put": _put,
    "batched_put": _batched_put,
    "contains": lambda backend, key: backend.contains(key),
    "batched_contains": lambda backend, key: backend.batched_contains([key, key]),
    "remove": lambda backend, key: backend.remove(key),
    "list_keys": _list_keys,
    "ping": _ping,
}


@pytest.fixture(scope="module", params=["redis", "valkey"])
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """redis-server through redis-py (redis://), valkey-server through valkey-py
    (valkey://), each with a password."""
    kind = ValkeyServer if request.param == "valkey" else RedisServer
    with kind(password=PASSWORD) as started:
        yield started


class ClosedUnderIt:
    """Makes the next ``count`` sends on the library's TCP connections find their connection
    closed: ``check_health``, which the library awaits right after it checked that the
    connection is open, disconnects it first, as a concurrent failover does."""

    def __init__(
        self, backend: RedisBackend, monkeypatch: pytest.MonkeyPatch, count: int = 1
    ) -> None:
        self.count = count
        self.closed = 0
        connection = backend.client_library().connection
        check_health = connection.check_health

        async def closed_first(conn: Any) -> None:
            await check_health(conn)
            if self.count:
                self.count -= 1
                await conn.disconnect()
                self.closed += 1

        monkeypatch.setattr(connection, "check_health", closed_first)


LIBRARY_BY_DEFAULT = ("remove", "list_keys", "ping")
"""What goes through the library's connections even with kvplug's own for reads and writes."""


@pytest.mark.parametrize(
    ("operation", "direct"),
    [(name, False) for name in OPERATIONS] + [(name, True) for name in LIBRARY_BY_DEFAULT],
    ids=[f"{name}-library" for name in OPERATIONS] + [f"{n}-default" for n in LIBRARY_BY_DEFAULT],
)
def test_a_connection_closed_under_an_operation_is_unavailable_and_the_next_one_succeeds(
    server: RedisServer, operation: str, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every operation on the library's connections (all of them with ``direct_reads`` and
    ``direct_writes`` off, as in Cluster mode; some by default)."""
    options: dict[str, Any] = {"key_prefix": f"errors-{uuid.uuid4().hex}:"}
    if not direct:
        options.update(direct_reads=False, direct_writes=False)
    operate = OPERATIONS[operation]

    async def main() -> None:
        backend = await kvplug.open_backend(server.url, **options)
        assert isinstance(backend, RedisBackend)
        key = CacheKey("llama", 1, 0, 7)
        try:
            await _put(backend, key)  # the library's connections are open and idle now
            closing = ClosedUnderIt(backend, monkeypatch)
            with pytest.raises(BackendUnavailable) as raised:
                await operate(backend, key)
            assert closing.closed == 1
            text = str(raised.value)
            assert "AttributeError: 'NoneType' object has no attribute" in text
            assert f"inside {backend.client_library().name}" in text
            assert PASSWORD not in text and ":***@" in text
            assert isinstance(raised.value.__cause__, AttributeError)
            await asyncio.wait_for(operate(backend, key), 10)  # recovered without a reopen
            assert closing.closed == 1
        finally:
            await backend.close()

    run(main())
