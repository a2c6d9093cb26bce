"""The Redis tier's ``releases_on_cancel``: a cancelled ``get_into`` or put (and their batched
forms) lets go of the caller's memory by the time its cancellation ends, on every path the
bytes take: kvplug's own connections (plain TCP, unix socket, TLS reads, the master a Sentinel
names), the client library (``direct_reads=false``/``direct_writes=false``, TLS puts) and a
Cluster, on asyncio's event loop and on uvloop (whose transports, like asyncio's from Python
3.12, keep the buffers they are given). Each check pauses a real server mid-value
(``kvplug_testing.cancellation``); the scenarios the Valkey tier runs too are
``kvplug_testing.tier_suite``'s. The checks themselves are shown to catch a backend that goes on
reading or writing the caller's memory after a cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import pytest

from kvplug import Backend
from kvplug.backend import Buffer
from kvplug.frame import FrameReceiver
from kvplug_redis import RedisBackend
from kvplug_testing import RedisServer
from kvplug_testing.cancellation import (
    OPERATIONS,
    check_cancelled_get_into,
    check_cancelled_put,
    check_operation,
    run_on,
)
from kvplug_testing.tier_suite import ReleasesOnCancelScenarios

pytestmark = pytest.mark.redis


class TestRedisReleasesOnCancel(ReleasesOnCancelScenarios):
    urls = (
        "redis://127.0.0.1:1",
        "rediss://127.0.0.1:1",
        "unix:///tmp/kvplug-none.sock",
        "redis+sentinel://127.0.0.1:1/mymaster",
        "redis+cluster://127.0.0.1:1",
    )


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_on_a_unix_socket_a_cancelled_operation_lets_go_of_the_callers_memory(
    unix_server: RedisServer, operation: str
) -> None:
    run_on("asyncio", check_operation(unix_server.url, unix_server, operation))


# -- the checks catch a backend that breaks the promise ---------------------------------------


class KeepsReading(RedisBackend):
    """Lets its direct reads run on after a cancellation, into the caller's memory."""

    async def receive_frames(self, keys: Sequence[str], receivers: Sequence[FrameReceiver]) -> None:
        await asyncio.shield(super().receive_frames(keys, receivers))


class KeepsSending(RedisBackend):
    """Lets its direct writes run on after a cancellation, from the caller's memory."""

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        await asyncio.shield(super().put_bytes(key, parts))


@pytest.mark.parametrize(
    ("broken", "check", "found"),
    [
        (KeepsReading, check_cancelled_get_into, "wrote into the caller's memory"),
        (KeepsSending, check_cancelled_put, "read as damaged"),
    ],
)
def test_the_checks_catch_a_backend_that_touches_the_memory_after_a_cancellation(
    standalone: RedisServer,
    broken: type[RedisBackend],
    check: Callable[..., Coroutine[Any, Any, None]],
    found: str,
) -> None:
    async def scenario() -> None:
        backend: Backend = broken(standalone.url, timeout=60)
        await backend.open()
        try:
            with pytest.raises(AssertionError, match=found):
                await check(backend, standalone)
            await asyncio.sleep(0.5)  # what the broken backend left running ends
        finally:
            await backend.close()

    run_on("asyncio", scenario())
