"""What the lm:// client tests share: running a coroutine with a bound, keys, objects of random
bytes compared bit for bit, and opening the client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import torch

import kvplug
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug_lm.backend import LMBackend

T = TypeVar("T")

# A shape per memory format, each at most 4 dims (what LMCache's plain protocol carries).
SHAPES: dict[MemoryFormat, tuple[int, ...]] = {
    MemoryFormat.UNDEFINED: (3, 40),
    MemoryFormat.KV_2LTD: (2, 3, 16, 8),
    MemoryFormat.KV_T2D: (16, 2, 24),
    MemoryFormat.KV_2TD: (2, 16, 24),
    MemoryFormat.BINARY: (500,),
    MemoryFormat.BINARY_BUFFER: (777,),
    MemoryFormat.KV_MLA_FMT: (1, 3, 16, 8),
}


def run(coroutine: Awaitable[T], timeout: float = 60.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(bounded())


def key(n: int, model: str = "llama") -> kvplug.CacheKey:
    return kvplug.CacheKey(model, 1, 0, n)


def random_obj(
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float16,
    fmt: MemoryFormat = MemoryFormat.KV_2LTD,
    seed: int = 0,
) -> MemoryObj:
    """An object of random bytes (every bit pattern, NaNs included: compared as bytes)."""
    generator = torch.Generator().manual_seed(seed)
    nbytes = int(torch.tensor(shape).prod()) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return MemoryObj(raw, shape, dtype, fmt)


def same(expected: MemoryObj, got: MemoryObj | None) -> bool:
    return (
        got is not None
        and got.shape == expected.shape
        and got.dtype == expected.dtype
        and got.fmt == expected.fmt
        and torch.equal(got.raw, expected.raw)
    )


async def opened(url: str, **options: Any) -> LMBackend:
    backend = await kvplug.open_backend(url, **options)
    assert isinstance(backend, LMBackend)
    return backend


__all__ = ["SHAPES", "key", "opened", "random_obj", "run", "same"]
