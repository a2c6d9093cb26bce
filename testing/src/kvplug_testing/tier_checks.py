"""What the Redis and Valkey tier tests share: seeded objects, keys, and the check that values
over a server's proto-max-bulk-len are refused.

Imports torch, pytest and kvplug, unlike the rest of :mod:`kvplug_testing`: import it by name
(``from kvplug_testing.tier_checks import make_obj``); ``import kvplug_testing`` does not."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import torch

import kvplug
from kvplug import CacheKey, CapacityExceeded, MemoryObj

T = TypeVar("T")
SHAPE = (2, 1, 16, 64)
BULK_LIMIT = 1 << 20
"""The proto-max-bulk-len of the small-bulk servers: 1mb, the smallest a server accepts."""


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """``coroutine`` run to its end on a new event loop."""
    return asyncio.run(coroutine)


def make_obj(seed: int, shape: tuple[int, ...] = SHAPE) -> MemoryObj:
    """An fp16 object of ``shape`` holding random bytes drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * 2,), generator=generator)
    return MemoryObj.from_tensor(data.to(torch.uint8).view(torch.float16).reshape(shape))


def obj_of_mib(mib: int) -> MemoryObj:
    """An object of ``mib`` MiB (make_obj's random bytes are slow at this size)."""
    return MemoryObj.from_tensor(torch.full((2, mib, 256, 1024), 1.5, dtype=torch.float16))


def same(expected: MemoryObj, got: MemoryObj | None) -> bool:
    """Whether ``got`` has ``expected``'s shape, dtype and bytes."""
    return (
        got is not None
        and got.shape == expected.shape
        and got.dtype == expected.dtype
        and torch.equal(got.raw, expected.raw)
    )


def keys_of(model: str, count: int, start: int = 0) -> list[CacheKey]:
    """``count`` keys of ``model`` with chunk hashes ``start``, ``start + 1``, ..."""
    return [CacheKey(model, 1, 0, n) for n in range(start, start + count)]


def new_model() -> str:
    """A model name no other test uses, so tests sharing a server see only their own keys."""
    return f"model-{uuid.uuid4().hex[:10]}"


async def oversize_values_are_refused(url: str, mib: int) -> None:
    """Through ``url`` (values of BULK_LIMIT at most), a put and a batched put of a ``mib`` MiB
    value raise CapacityExceeded naming the server's limit, store nothing, and the backend
    keeps working."""
    backend = await kvplug.open_backend(url)
    keys = keys_of(new_model(), 4)
    big, small = obj_of_mib(mib), make_obj(30)
    try:
        with pytest.raises(CapacityExceeded) as single:
            await backend.put(keys[0], big)
        with pytest.raises(CapacityExceeded) as batched:
            await backend.batched_put(keys[1:3], [small, big])
        for refused in (single.value, batched.value):
            message = str(refused)
            assert f"proto-max-bulk-len ({BULK_LIMIT} bytes)" in message, message
            assert "CONFIG SET proto-max-bulk-len" in message and "max_value_size" in message
        assert not await backend.contains(keys[0]) and not await backend.contains(keys[2])
        await backend.put(keys[3], small)
        got = await backend.get(keys[3])
        try:
            assert same(small, got)
        finally:
            if got is not None:
                got.release()
    finally:
        big.release()
        small.release()
        await backend.close()


__all__ = [
    "BULK_LIMIT",
    "SHAPE",
    "keys_of",
    "make_obj",
    "new_model",
    "obj_of_mib",
    "oversize_values_are_refused",
    "run",
    "same",
]
