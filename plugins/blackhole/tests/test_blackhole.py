"""blackhole:// (plugins/blackhole): accepts every put, keeps nothing, always misses."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import torch

import kvplug
from kvplug import (
    BackendClosed,
    CacheKey,
    Capabilities,
    FreeListAllocator,
    NotSupported,
    UnknownOption,
)
from kvplug_blackhole.backend import BlackholeBackend

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def key(i: int) -> CacheKey:
    return CacheKey("llama", 1, 0, i)


async def open_blackhole(url: str = "blackhole://") -> BlackholeBackend:
    backend = await kvplug.open_backend(url)
    assert isinstance(backend, BlackholeBackend)
    return backend


def test_blackhole_is_served_through_its_entry_point() -> None:
    assert "blackhole" in kvplug.available_schemes()
    backend = run(open_blackhole())
    assert backend.capabilities == Capabilities(remove=True, releases_on_cancel=True)
    run(backend.close())


def test_puts_are_accepted_and_nothing_is_ever_found() -> None:
    async def main() -> None:
        backend = await open_blackhole()
        caller = FreeListAllocator(1 << 20)
        obj = caller.allocate((2, 4, 16, 8), torch.float16)
        assert obj is not None
        await backend.put(key(1), obj)
        assert obj.ref_count == 1  # nothing retained
        assert await backend.get(key(1)) is None
        assert not await backend.contains(key(1))
        assert await backend.remove(key(1)) is False
        await backend.batched_put([key(2), key(3)], [obj, obj])
        assert await backend.batched_get([key(1), key(2)]) == [None, None]
        assert await backend.batched_contains([key(1), key(2)]) == 0
        obj.release()
        assert caller.stats().used == 0 and caller.stats().object_count == 0
        assert backend.stats() == {"puts": 3, "bytes_put": 3 * obj.nbytes, "gets": 3}
        await backend.close()

    run(main())


def test_undeclared_capabilities_raise_not_supported() -> None:
    async def main() -> None:
        backend = await open_blackhole()
        with pytest.raises(NotSupported):
            await backend.pin(key(1))
        with pytest.raises(NotSupported):
            await backend.unpin(key(1))
        with pytest.raises(NotSupported):
            backend.list_keys()
        await backend.close()

    run(main())


def test_close_is_idempotent_and_later_calls_raise_backend_closed() -> None:
    async def main() -> None:
        backend = await open_blackhole()
        await backend.close()
        await backend.close()
        obj = kvplug.MemoryObj.from_tensor(torch.zeros(4))
        for call in (
            backend.get(key(1)),
            backend.put(key(1), obj),
            backend.contains(key(1)),
            backend.remove(key(1)),
        ):
            with pytest.raises(BackendClosed):
                await call

    run(main())


def test_only_the_common_options_are_accepted() -> None:
    assert run(open_blackhole("blackhole://?timeout=2")).options.timeout == 2
    with pytest.raises(UnknownOption, match="Did you mean 'timeout'"):
        run(open_blackhole("blackhole://?timout=2"))
