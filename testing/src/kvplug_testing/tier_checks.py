"""What the Redis and Valkey tier tests share: seeded objects, keys, a backend opened for a
scenario and closed after it, a round trip of every operation, and the check that values over a
server's proto-max-bulk-len are refused.

Imports torch, pytest and kvplug, unlike the rest of :mod:`kvplug_testing`: import it by name
(``from kvplug_testing.tier_checks import make_obj``); ``import kvplug_testing`` does not."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import torch

import kvplug
from kvplug import Backend, BackendUnavailable, CacheKey, CapacityExceeded, MemoryFormat, MemoryObj

T = TypeVar("T")
SHAPE = (2, 1, 16, 64)
BULK_LIMIT = 1 << 20
"""The proto-max-bulk-len of the small-bulk servers: 1mb, the smallest a server accepts."""


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """``coroutine`` run to its end on a new event loop."""
    return asyncio.run(coroutine)


def make_obj(
    seed: int,
    shape: tuple[int, ...] = SHAPE,
    dtype: torch.dtype = torch.float16,
    fmt: MemoryFormat = MemoryFormat.KV_2LTD,
) -> MemoryObj:
    """An object of ``shape``, ``dtype`` and ``fmt`` holding random bytes drawn from ``seed``."""
    nbytes = int(torch.tensor(shape).prod()) * dtype.itemsize
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), generator=generator, dtype=torch.uint8)
    tensor = data.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
    return MemoryObj.from_tensor(tensor, fmt)


def obj_of_mib(mib: int) -> MemoryObj:
    """An object of ``mib`` MiB (make_obj's random bytes are slow at this size)."""
    return MemoryObj.from_tensor(torch.full((2, mib, 256, 1024), 1.5, dtype=torch.float16))


def same(expected: MemoryObj, got: MemoryObj | None) -> bool:
    """Whether ``got`` has ``expected``'s shape, dtype, format and bytes."""
    return (
        got is not None
        and (got.shape, got.dtype, got.fmt) == (expected.shape, expected.dtype, expected.fmt)
        and torch.equal(got.raw, expected.raw)
    )


def keys_of(model: str, count: int, start: int = 0) -> list[CacheKey]:
    """``count`` keys of ``model`` with chunk hashes ``start``, ``start + 1``, ..."""
    return [CacheKey(model, 1, 0, n) for n in range(start, start + count)]


def new_model() -> str:
    """A model name no other test uses, so tests sharing a server see only their own keys."""
    return f"model-{uuid.uuid4().hex[:10]}"


def fresh_keys(count: int) -> list[CacheKey]:
    """``count`` keys of a model of their own (:func:`new_model`)."""
    return keys_of(new_model(), count)


def release(*objs: MemoryObj | None) -> None:
    """Release each of ``objs`` that is an object (a get's None is skipped)."""
    for obj in objs:
        if obj is not None:
            obj.release()


@contextlib.contextmanager
def releasing(*objs: MemoryObj | None) -> Iterator[None]:
    """Release ``objs`` when the block ends, also when it fails."""
    try:
        yield
    finally:
        release(*objs)


@contextlib.asynccontextmanager
async def opened(url: str, **options: Any) -> AsyncIterator[Backend]:
    """The backend of ``url`` opened with ``options``, closed when the block ends."""
    backend = await kvplug.open_backend(url, **options)
    try:
        yield backend
    finally:
        await backend.close()


async def reads_back(backend: Backend, key: CacheKey, expected: MemoryObj) -> None:
    """Assert that ``key`` reads back as ``expected`` through ``backend``."""
    got = await backend.get(key)
    with releasing(got):
        assert same(expected, got)


async def round_trip(url: str, **options: Any) -> bool:
    """Put, get, batched put/get/contains and remove through ``url``; True if all agree."""
    model = new_model()
    objs = [make_obj(n) for n in range(3)]
    with releasing(*objs):
        async with opened(url, **options) as backend:
            await backend.put(keys_of(model, 1)[0], objs[0])
            got = await backend.get(keys_of(model, 1)[0])
            with releasing(got):
                ok = same(objs[0], got)
            batch = keys_of(model, 2, start=1)
            await backend.batched_put(batch, objs[1:])
            many = await backend.batched_get(batch)
            with releasing(*many):
                ok = ok and all(same(o, g) for o, g in zip(objs[1:], many, strict=True))
            ok = ok and await backend.batched_contains(keys_of(model, 3)) == 3
            return ok and await backend.remove(batch[0]) and not await backend.contains(batch[0])


async def fails_once_open(url: str) -> None:
    """Open ``url`` (a failure to connect is logged, not raised) and ask it for a key: what a
    server that refuses this client raises then. The deadline only tells a hang from a loaded
    machine: a refusal comes at once, a TLS handshake to sentinels and their master under a CPU
    hog took over 2 s."""
    async with opened(url, timeout=15.0) as backend:
        await backend.contains(fresh_keys(1)[0])


def the_client_certificate_is_required(url: str) -> None:
    """``url`` (TLS, with a client certificate) round-trips; without its certificate (the
    query's first option alone) the server refuses it."""
    assert "ssl_certfile" in url
    assert run(round_trip(url))
    with pytest.raises(BackendUnavailable):
        run(fails_once_open(url.split("&")[0]))


async def oversize_values_are_refused(url: str, mib: int) -> None:
    """Through ``url`` (values of BULK_LIMIT at most), a put and a batched put of a ``mib`` MiB
    value raise CapacityExceeded naming the server's limit, store nothing, and the backend
    keeps working."""
    keys = keys_of(new_model(), 4)
    big, small = obj_of_mib(mib), make_obj(30)
    with releasing(big, small):
        async with opened(url) as backend:
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
            await reads_back(backend, keys[3], small)


__all__ = [
    "BULK_LIMIT",
    "SHAPE",
    "fails_once_open",
    "fresh_keys",
    "keys_of",
    "make_obj",
    "new_model",
    "obj_of_mib",
    "opened",
    "oversize_values_are_refused",
    "reads_back",
    "release",
    "releasing",
    "round_trip",
    "run",
    "same",
    "the_client_certificate_is_required",
]
