"""What the disk and GDS tier tests share: keys, seeded objects, a leak-checked allocator and
the object files on disk.

On ``sys.path`` through ``pythonpath`` in the pytest configuration (pyproject.toml)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

import kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.store import Store
from kvplug_disk.layout import OBJECT_NAME

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def key(i: int, model: str = "llama") -> CacheKey:
    return CacheKey(model, 1, 0, i)


def seeded_bytes(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def seeded(allocator: FreeListAllocator, nbytes: int, seed: int) -> MemoryObj:
    obj = allocator.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY_BUFFER)
    assert obj is not None
    obj.raw.copy_(seeded_bytes(nbytes, seed))
    return obj


def object_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if OBJECT_NAME.fullmatch(p.name) and p.is_file())


def leak_checked_allocator(nbytes: int = 64 << 20) -> Iterator[FreeListAllocator]:
    """Objects of a test and results of get (``pytest.fixture(leak_checked_allocator)``):
    nothing may stay allocated afterwards."""
    pool = FreeListAllocator(nbytes, pin=False)
    yield pool
    assert pool.stats().used == 0, "a reference was leaked"


async def read_back(source: kvplug.Backend | Store, k: CacheKey) -> torch.Tensor | None:
    """A copy of what ``source`` holds under ``k`` (None: a miss), the object released."""
    got = await source.get(k)
    if got is None:
        return None
    try:
        return got.raw.clone()
    finally:
        got.release()


async def put_seeded(
    target: kvplug.Backend | Store,
    allocator: FreeListAllocator,
    k: CacheKey,
    nbytes: int,
    seed: int,
) -> None:
    """Put ``seeded(allocator, nbytes, seed)`` under ``k``; the object is released after."""
    obj = seeded(allocator, nbytes, seed)
    try:
        await target.put(k, obj)
    finally:
        obj.release()
