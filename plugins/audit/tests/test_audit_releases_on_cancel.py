"""The audit wrapper and ``releases_on_cancel``: it declares exactly what the backend it wraps
declares, and keeps the promise: a cancelled operation's cancellation reaches the caller, and
nothing of the wrapper's own (checksums, logs, counters) touches the caller's objects after it.
Its ``get_into`` reads through ``get`` into the inner backend's memory and copies into the
caller's only once the read is complete. Checked over ``cpu://`` and over a real redis-server
paused mid-value (``kvplug_testing.cancellation``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import kvplug
from kvplug import CacheKey, MemoryObj
from kvplug.backend import Backend
from kvplug_audit.backend import AuditBackend
from kvplug_testing import RedisServer
from kvplug_testing.cancellation import OPERATIONS, Tap, check_operation, run_on


class Unpromised(Backend):
    """A store of objects in a dict that does not declare ``releases_on_cancel``."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.held: dict[CacheKey, MemoryObj] = {}

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        obj = self.held.get(key)
        return None if obj is None else obj.retain()

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        self.held[key] = obj.retain()

    async def _contains(self, key: CacheKey) -> bool:
        return key in self.held


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_over_cpu_a_cancelled_operation_lets_go_of_the_callers_memory(operation: str) -> None:
    run_on("asyncio", check_operation("audit::cpu://?max_size=256MiB", None, operation))


@pytest.mark.redis
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_over_redis_a_cancelled_operation_lets_go_of_the_callers_memory(
    redis_server: RedisServer, operation: str
) -> None:
    with Tap(*redis_server.address) as tap:
        run_on("asyncio", check_operation(f"audit::{tap.url()}", tap, operation))


def test_it_declares_releases_on_cancel_exactly_where_the_wrapped_backend_does() -> None:
    assert AuditBackend("audit://", inner=kvplug.create_backend("cpu://")).capabilities == (
        kvplug.create_backend("cpu://").capabilities
    )
    assert AuditBackend(
        "audit://", inner=kvplug.create_backend("cpu://")
    ).capabilities.releases_on_cancel
    assert not AuditBackend("audit://", inner=Unpromised("dict://")).capabilities.releases_on_cancel
