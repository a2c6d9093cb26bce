"""``cpu://`` declares ``releases_on_cancel``, and it holds: no operation of the tier awaits,
so a cancelled one never started, and a put of memory outside the tier's allocator stores a
copy. The checks are ``kvplug_testing.cancellation``'s, without a server to pause;
an engine integration then reads straight into its buffers (EngineIO lends loads) while stores
still get a copy, since the tier keeps the objects it stores."""

from __future__ import annotations

import asyncio

import pytest
import torch

import kvplug
from kvplug.runtime.engine import EngineIO
from kvplug_testing.cancellation import OPERATIONS, check_operation, run_on


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_a_cancelled_operation_lets_go_of_the_callers_memory(operation: str) -> None:
    run_on("asyncio", check_operation("cpu://?max_size=256MiB", None, operation))


def test_a_put_cancelled_before_it_ran_stores_nothing() -> None:
    async def scenario() -> None:
        backend = await kvplug.open_backend("cpu://?max_size=16MiB")
        assert backend.capabilities.releases_on_cancel
        key = kvplug.CacheKey("llama", 1, 0, 7)
        obj = kvplug.MemoryObj.from_tensor(torch.ones(1024))
        try:
            task = asyncio.ensure_future(backend.put(key, obj))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert obj.ref_count == 1
            assert not await backend.contains(key)
        finally:
            await backend.close()

    asyncio.run(scenario())


def test_engines_read_into_their_own_buffers_and_store_copies() -> None:
    backend = kvplug.create_backend("cpu://?max_size=16MiB")
    assert backend.capabilities.releases_on_cancel
    io = EngineIO(backend, timeout=5, what="a test on cpu://")
    assert io.lends_loads  # releases_on_cancel
    assert not io.lends_stores  # zero_copy: the tier may keep the object it stored
