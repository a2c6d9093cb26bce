"""``blackhole://`` declares ``releases_on_cancel``: it never reads or writes an object's
memory, so a put or ``get_into`` (batched or not), cancelled or not, leaves the caller's objects
as they were, held by nobody else; engines lend it their buffers without a copy."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import pytest
import torch

import kvplug
from kvplug import Backend, CacheKey, MemoryObj
from kvplug.runtime.engine import EngineIO

KEYS = [CacheKey("llama", 1, 0, n) for n in range(2)]
Operation = Callable[[Backend, Sequence[MemoryObj]], Awaitable[object]]
OPERATIONS: dict[str, Operation] = {
    "put": lambda b, objs: b.put(KEYS[0], objs[0]),
    "batched_put": lambda b, objs: b.batched_put(KEYS, objs),
    "get_into": lambda b, objs: b.get_into(KEYS[0], objs[0]),
    "batched_get_into": lambda b, objs: b.batched_get_into(KEYS, objs),
}


@pytest.mark.parametrize("turns", [0, 1])
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_an_operation_cancelled_before_or_after_it_ran_leaves_the_objects_alone(
    operation: str, turns: int
) -> None:
    async def scenario() -> None:
        backend = await kvplug.open_backend("blackhole://")
        assert backend.capabilities.releases_on_cancel
        objs = [MemoryObj.from_tensor(torch.full((4096,), 7, dtype=torch.uint8)) for _ in KEYS]
        try:
            task = asyncio.ensure_future(OPERATIONS[operation](backend, objs))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.wait([task])
            assert [obj.ref_count for obj in objs] == [1, 1]
            assert all(bool((obj.raw == 7).all()) for obj in objs)
            assert await backend.get(KEYS[0]) is None
        finally:
            await backend.close()

    asyncio.run(scenario())


def test_engines_lend_it_their_buffers() -> None:
    backend = kvplug.create_backend("blackhole://")
    assert backend.capabilities.releases_on_cancel
    io = EngineIO(backend, timeout=5, what="a test on blackhole://")
    assert io.lends_loads and io.lends_stores
