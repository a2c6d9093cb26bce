"""The host-memory tier, cpu:// (plugins/cpu), opened through kvplug.open_backend."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
import torch

import kvplug
from kvplug import (
    BackendClosed,
    CacheKey,
    Capabilities,
    CapacityExceeded,
    ConfigError,
    FreeListAllocator,
    InvalidBackendURL,
    MemoryFormat,
    MemoryObj,
    UnknownOption,
)
from kvplug_cpu.backend import CpuBackend

T = TypeVar("T")
KiB = 1024
BLOCK = 4096


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def key(i: int, model: str = "llama") -> CacheKey:
    return CacheKey(model, 1, 0, i)


def filled(nbytes: int, value: int) -> MemoryObj:
    """A caller-owned object (no allocator) of ``nbytes`` bytes, all equal to ``value``."""
    return MemoryObj.from_tensor(torch.full((nbytes,), value, dtype=torch.uint8))


async def open_cpu(url: str = "cpu://?max_size=64KiB", **options: Any) -> CpuBackend:
    backend = await kvplug.open_backend(url, **options)
    assert isinstance(backend, CpuBackend)
    return backend


async def put_value(backend: CpuBackend, i: int, nbytes: int = 16 * KiB) -> None:
    await backend.put(key(i), filled(nbytes, i % 256))


async def value_of(backend: CpuBackend, i: int) -> int | None:
    obj = await backend.get(key(i))
    if obj is None:
        return None
    try:
        low, high = int(obj.raw.min()), int(obj.raw.max())
        assert low == high, f"torn object: bytes from {low} to {high}"
        return low
    finally:
        obj.release()


def memcheck(backend: CpuBackend) -> bool:
    assert isinstance(backend.allocator, FreeListAllocator)
    return backend.allocator.memcheck()


async def present(backend: CpuBackend, count: int) -> list[int]:
    return [i for i in range(count) if await backend.contains(key(i))]


# -- opening and options --------------------------------------------------------------------------


def test_cpu_scheme_is_served_through_its_entry_point() -> None:
    assert "cpu" in kvplug.available_schemes()
    assert kvplug.registry.backend_class("cpu://") is CpuBackend


def test_defaults_own_a_5gib_lazily_committed_allocator() -> None:
    async def main() -> None:
        backend = await open_cpu("cpu://")
        assert backend.options.max_size == 5 << 30
        assert backend.options.eviction == "lru"
        assert backend.options.pin_ttl == 300
        assert backend.owns_allocator
        assert isinstance(backend.allocator, FreeListAllocator)
        assert backend.allocator.capacity == 5 << 30
        assert backend.capabilities == Capabilities(
            pin=True, zero_copy=True, remove=True, list_keys=True, releases_on_cancel=True
        )
        await backend.close()

    run(main())


@pytest.mark.parametrize(
    ("size", "expected"), [("512KiB", 512 * KiB), ("1MiB", 1 << 20), (65536, 65536)]
)
def test_max_size_accepts_ints_and_size_strings(size: object, expected: int) -> None:
    async def main() -> None:
        backend = await open_cpu("cpu://", max_size=size)
        assert backend.max_size == expected
        assert backend.allocator.stats().capacity == expected
        await backend.close()

    run(main())


def test_explicit_options_win_over_the_query() -> None:
    async def main() -> None:
        backend = await open_cpu("cpu://?max_size=1MiB&eviction=fifo", eviction="LFU")
        assert backend.options.eviction == "lfu"
        assert backend.max_size == 1 << 20
        await backend.close()

    run(main())


def test_unknown_option_suggests_the_right_name() -> None:
    with pytest.raises(UnknownOption, match=r"max_szie.*Did you mean 'max_size'"):
        run(open_cpu("cpu://?max_szie=1MiB"))


@pytest.mark.parametrize(
    "size", ["lots", "-5", "100", "true", "512,5MiB", "5.GiB", "99999999TiB", "1.5.5GiB"]
)
def test_bad_max_size_is_a_config_error(size: str) -> None:
    with pytest.raises(ConfigError, match="max_size"):
        run(open_cpu(f"cpu://?max_size={size}"))


def test_a_max_size_the_machine_cannot_reserve_names_the_option_and_the_machine() -> None:
    with pytest.raises(ConfigError) as error:
        run(open_cpu("cpu://?max_size=4EiB"))
    message = str(error.value)
    assert message.startswith("cpu:// max_size (max_local_cpu_size in an LMCache config) is")
    assert "in total" in message and "Lower it" in message


def test_bad_eviction_name_names_the_valid_policies() -> None:
    with pytest.raises(ConfigError, match=r"Did you mean 'lru'.*fifo, lfu, lru"):
        run(open_cpu("cpu://?eviction=lruu"))


@pytest.mark.parametrize("ttl", ["0", "-1", "soon"])
def test_pin_ttl_must_be_positive_seconds(ttl: str) -> None:
    with pytest.raises(ConfigError, match="pin_ttl"):
        run(open_cpu(f"cpu://?pin_ttl={ttl}"))


def test_a_host_in_the_url_is_rejected() -> None:
    with pytest.raises(InvalidBackendURL, match="takes none"):
        run(open_cpu("cpu://somehost:1234"))


# -- round trips and ownership --------------------------------------------------------------------

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
]
SHAPES = [(2, 2, 1, 8), (2, 3, 17, 24), (2, 4, 256, 64)]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs included) viewed as ``dtype``."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(shape)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("zero_copy", [False, True], ids=["copied", "zero-copy"])
def test_round_trip_is_bit_exact(
    dtype: torch.dtype, shape: tuple[int, ...], zero_copy: bool
) -> None:
    async def main() -> None:
        backend = await open_cpu("cpu://?max_size=8MiB")
        source = random_tensor(shape, dtype, seed=len(shape) * 31 + shape[2])
        if zero_copy:
            obj = backend.allocator.allocate(shape, dtype, MemoryFormat.KV_2LTD)
            assert obj is not None
            obj.raw.copy_(source.reshape(-1).view(torch.uint8))
        else:
            obj = MemoryObj.from_tensor(source.clone(), MemoryFormat.KV_2LTD)
        await backend.put(key(1), obj)
        obj.release()
        got = await backend.get(key(1))
        assert got is not None
        assert (got.shape, got.dtype, got.fmt) == (shape, dtype, MemoryFormat.KV_2LTD)
        assert torch.equal(got.raw, source.reshape(-1).view(torch.uint8))
        got.release()
        await backend.close()
        assert backend.allocator.stats().used == 0

    run(main())


def test_other_memory_formats_round_trip() -> None:
    async def main() -> None:
        backend = await open_cpu()
        for i, fmt in enumerate([MemoryFormat.KV_MLA_FMT, MemoryFormat.BINARY_BUFFER]):
            obj = MemoryObj.from_tensor(torch.arange(100, dtype=torch.uint8), fmt)
            await backend.put(key(i), obj)
            got = await backend.get(key(i))
            assert got is not None and got.fmt == fmt
            assert torch.equal(got.tensor, obj.tensor)
            got.release()
        await backend.close()

    run(main())


def test_put_of_an_object_in_the_backends_allocator_is_zero_copy() -> None:
    async def main() -> None:
        backend = await open_cpu()
        obj = backend.allocator.allocate((4, 1024), torch.uint8)
        assert obj is not None
        obj.tensor.fill_(7)
        address = obj.data_ptr()
        await backend.put(key(1), obj)
        assert obj.ref_count == 2  # the caller's and the cache's
        obj.release()
        got = await backend.get(key(1))
        assert got is obj and got.data_ptr() == address
        got.release()
        await backend.close()
        assert backend.allocator.stats().object_count == 0

    run(main())


def test_put_of_a_foreign_object_copies_it() -> None:
    async def main() -> None:
        backend = await open_cpu()
        caller = FreeListAllocator(64 * KiB)
        obj = caller.allocate((4, 1024), torch.uint8)
        assert obj is not None
        obj.tensor.fill_(3)
        await backend.put(key(1), obj)
        assert obj.ref_count == 1  # put never keeps the caller's reference
        obj.tensor.fill_(9)  # the caller reuses its buffer
        got = await backend.get(key(1))
        assert got is not None
        assert got.allocator is backend.allocator and got.data_ptr() != obj.data_ptr()
        assert int(got.raw.max()) == 3
        got.release()
        obj.release()
        assert caller.stats().used == 0
        await backend.close()
        assert backend.allocator.stats().used == 0

    run(main())


def test_with_a_given_allocator_it_stores_there_and_caps_its_own_bytes() -> None:
    async def main() -> None:
        shared = FreeListAllocator(256 * KiB)
        backend = await open_cpu("cpu://?max_size=32KiB", allocator=shared)
        assert backend.allocator is shared and not backend.owns_allocator
        obj = shared.allocate((16 * KiB,), torch.uint8)
        assert obj is not None
        await backend.put(key(0), obj)  # zero-copy into the shared allocator
        obj.release()
        got = await backend.get(key(0))
        assert got is obj
        got.release()
        await backend.put(key(1), filled(16 * KiB, 1))  # copied into the shared allocator
        await backend.put(key(2), filled(16 * KiB, 2))  # over 32 KiB: evicts key 0
        assert await present(backend, 3) == [1, 2]
        assert backend.bytes_held == 32 * KiB
        assert shared.stats().used == 32 * KiB
        await backend.close()
        assert shared.stats().used == 0 and shared.stats().object_count == 0

    run(main())


def test_get_returns_an_extra_reference_that_outlives_removal() -> None:
    async def main() -> None:
        backend = await open_cpu()
        await put_value(backend, 5)
        got = await backend.get(key(5))
        assert got is not None and got.ref_count == 2
        assert await backend.remove(key(5))
        assert got.ref_count == 1 and int(got.raw[0]) == 5
        got.release()
        assert backend.allocator.stats().used == 0
        await backend.close()

    run(main())


def test_overwrite_replaces_atomically_and_frees_the_old_object() -> None:
    async def main() -> None:
        backend = await open_cpu()
        await backend.put(key(1), filled(8 * KiB, 1))
        old = await backend.get(key(1))
        await backend.put(key(1), filled(8 * KiB, 2))
        assert await value_of(backend, 1) == 2
        assert old is not None and int(old.raw.min()) == int(old.raw.max()) == 1
        assert backend.bytes_held == 8 * KiB and len(backend) == 1
        old.release()
        assert backend.allocator.stats().object_count == 1
        await backend.close()
        assert backend.allocator.stats().used == 0

    run(main())


def test_miss_is_none_and_counted() -> None:
    async def main() -> None:
        backend = await open_cpu()
        assert await backend.get(key(404)) is None
        assert not await backend.contains(key(404))
        await put_value(backend, 1)
        assert await value_of(backend, 1) == 1
        stats = backend.operation_stats()
        assert (stats["get"].hits, stats["get"].misses) == (1, 1)
        assert (stats["contains"].hits, stats["contains"].misses) == (0, 1)
        await backend.close()

    run(main())


def test_keys_of_other_models_and_workers_are_isolated() -> None:
    async def main() -> None:
        backend = await open_cpu()
        await backend.put(key(1, model="a"), filled(4 * KiB, 1))
        assert await backend.get(key(1, model="b")) is None
        assert await backend.get(CacheKey("a", 2, 1, 1)) is None
        await backend.close()

    run(main())


def test_remove_semantics() -> None:
    async def main() -> None:
        backend = await open_cpu()
        assert await backend.remove(key(1)) is False
        await put_value(backend, 1)
        assert await backend.remove(key(1)) is True
        assert await backend.remove(key(1)) is False
        assert not await backend.contains(key(1))
        assert await backend.get(key(1)) is None
        await put_value(backend, 2)
        assert await backend.pin(key(2))
        assert await backend.remove(key(2)) is True  # explicit remove beats a pin
        assert not backend.is_pinned(key(2))
        await put_value(backend, 2)
        assert not backend.is_pinned(key(2))  # pins went with the removed key
        assert backend.stats()["pinned_keys"] == 0
        await backend.close()
        assert backend.allocator.stats().used == 0

    run(main())


def test_batched_operations() -> None:
    async def main() -> None:
        backend = await open_cpu()
        objs = [filled(4 * KiB, i) for i in range(3)]
        await backend.batched_put([key(i) for i in range(3)], objs)
        assert await backend.batched_contains([key(0), key(1), key(9), key(2)]) == 2
        got = await backend.batched_get([key(2), key(9), key(0)])
        assert [None if g is None else int(g.raw[0]) for g in got] == [2, None, 0]
        for g in got:
            if g is not None:
                g.release()
        await backend.close()
        assert backend.allocator.stats().used == 0

    run(main())


def test_list_keys_is_a_snapshot() -> None:
    async def main() -> None:
        backend = await open_cpu()
        for i in range(3):
            await put_value(backend, i, 4 * KiB)
        listed = []
        async for listed_key in backend.list_keys():
            listed.append(listed_key)
            await backend.remove(listed_key)
        assert sorted(k.chunk_hash for k in listed) == [0, 1, 2]
        assert [k async for k in backend.list_keys()] == []
        await backend.close()

    run(main())


# -- capacity, eviction, pins ---------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "victim"), [("lru", 2), ("fifo", 0), ("lfu", 3)])
def test_eviction_under_pressure_follows_the_policy(policy: str, victim: int) -> None:
    async def main() -> None:
        backend = await open_cpu(f"cpu://?max_size=64KiB&eviction={policy}")
        for i in range(4):  # 4 x 16 KiB fills it
            await put_value(backend, i)
        for i in (2, 2, 0, 0, 3, 1):  # LRU order 2,0,3,1; uses 0:3 1:2 2:3 3:2
            await value_of(backend, i)
        await put_value(backend, 4)
        remaining = await present(backend, 5)
        assert remaining == [i for i in range(5) if i != victim]
        assert backend.evictions == 1
        assert backend.bytes_held == 64 * KiB
        await backend.close()
        assert backend.allocator.stats().used == 0

    run(main())


def test_a_long_stream_of_puts_keeps_the_newest_keys() -> None:
    async def main() -> None:
        backend = await open_cpu()
        for i in range(40):
            await put_value(backend, i)
        assert await present(backend, 40) == [36, 37, 38, 39]
        assert backend.stats()["evictions"] == 36
        assert memcheck(backend)
        await backend.close()

    run(main())


def test_pinned_keys_survive_pressure() -> None:
    async def main() -> None:
        backend = await open_cpu()
        for i in range(4):
            await put_value(backend, i)
        assert await backend.pin(key(0)) and await backend.pin(key(1))
        for i in range(4, 10):
            await put_value(backend, i)
        assert await present(backend, 10) == [0, 1, 8, 9]
        await backend.close()

    run(main())


def test_full_of_pinned_keys_raises_capacity_exceeded_and_reads_keep_working() -> None:
    async def main() -> None:
        backend = await open_cpu()
        for i in range(4):
            await put_value(backend, i)
            assert await backend.pin(key(i))
        with pytest.raises(CapacityExceeded, match="pinned") as error:
            await put_value(backend, 4)
        assert "Unpin" in str(error.value)
        assert await present(backend, 5) == [0, 1, 2, 3]
        assert [await value_of(backend, i) for i in range(4)] == [0, 1, 2, 3]
        assert await backend.unpin(key(2))
        await put_value(backend, 4)
        assert await present(backend, 5) == [0, 1, 3, 4]
        await backend.close()
        assert backend.allocator.stats().used == 0

    run(main())


def test_memory_held_by_readers_cannot_be_reclaimed() -> None:
    async def main() -> None:
        backend = await open_cpu("cpu://?max_size=32KiB")
        await put_value(backend, 0)
        await put_value(backend, 1)
        held = [await backend.get(key(0)), await backend.get(key(1))]
        with pytest.raises(CapacityExceeded, match="referenced by readers"):
            await put_value(backend, 2)
        for obj in held:
            assert obj is not None
            obj.release()
        await put_value(backend, 2)
        assert await value_of(backend, 2) == 2
        await backend.close()
        assert backend.allocator.stats().used == 0

    run(main())


def test_an_object_larger_than_max_size_raises_and_changes_nothing() -> None:
    async def main() -> None:
        backend = await open_cpu()
        await put_value(backend, 0)
        caller = FreeListAllocator(1 << 20)
        big = caller.allocate((64 * KiB + 1,), torch.uint8)
        assert big is not None
        with pytest.raises(CapacityExceeded, match=r"larger than .*max_size"):
            await backend.put(key(1), big)
        assert big.ref_count == 1
        big.release()
        assert caller.stats().used == 0
        assert await value_of(backend, 0) == 0 and backend.evictions == 0
        await backend.close()

    run(main())


def test_pins_expire_after_pin_ttl() -> None:
    async def main() -> None:
        backend = await open_cpu("cpu://?max_size=32KiB&pin_ttl=0.05")
        for i in range(2):
            await put_value(backend, i)
            assert await backend.pin(key(i))
        with pytest.raises(CapacityExceeded):
            await put_value(backend, 2)
        time.sleep(0.1)
        await put_value(backend, 2)  # the expired pins no longer protect key 0
        assert await present(backend, 3) == [1, 2]
        assert not backend.is_pinned(key(1))
        assert await backend.unpin(key(1)) is False
        await backend.close()

    run(main())


def test_pins_count_and_unpin_always_succeeds() -> None:
    async def main() -> None:
        backend = await open_cpu()
        assert await backend.pin(key(1)) is False  # absent
        assert await backend.unpin(key(1)) is False
        await put_value(backend, 1)
        assert await backend.unpin(key(1)) is False  # present, never pinned
        assert await backend.pin(key(1)) and await backend.pin(key(1))
        assert await backend.unpin(key(1)) is True
        assert backend.is_pinned(key(1))
        assert await backend.unpin(key(1)) is True
        assert not backend.is_pinned(key(1))
        assert await backend.unpin(key(1)) is False
        await backend.close()

    run(main())


def test_allocate_evicts_to_make_room() -> None:
    async def main() -> None:
        backend = await open_cpu("cpu://?max_size=32KiB")
        await put_value(backend, 0)
        await put_value(backend, 1)
        obj = backend.allocate((16 * KiB,), torch.uint8)
        assert obj is not None and backend.evictions == 1
        assert await backend.pin(key(1))
        assert backend.allocate((16 * KiB,), torch.uint8) is None  # only a pinned key is left
        obj.tensor.fill_(2)
        await backend.put(key(2), obj)
        obj.release()
        assert await value_of(backend, 2) == 2
        await backend.close()
        assert backend.allocator.stats().used == 0

    run(main())


# -- close, concurrency ---------------------------------------------------------------------------


def test_close_releases_everything_is_idempotent_and_later_calls_raise() -> None:
    async def main() -> None:
        caller = FreeListAllocator(1 << 20)
        backend = await open_cpu()
        baseline = caller.stats()
        for i in range(3):
            obj = caller.allocate((4 * KiB,), torch.uint8)
            assert obj is not None
            await backend.put(key(i), obj)
            obj.release()
        zero_copy = backend.allocator.allocate((4 * KiB,), torch.uint8)
        assert zero_copy is not None
        await backend.put(key(9), zero_copy)
        zero_copy.release()
        await backend.pin(key(9))
        assert backend.allocator.stats().object_count == 4
        await backend.close()
        await backend.close()
        assert backend.closed
        assert backend.allocator.stats().used == 0
        assert backend.allocator.stats().object_count == 0
        assert caller.stats() == baseline
        for call in (
            backend.get(key(0)),
            backend.put(key(0), filled(16, 0)),
            backend.contains(key(0)),
            backend.remove(key(0)),
            backend.pin(key(0)),
            backend.unpin(key(0)),
            backend.batched_get([key(0)]),
            backend.batched_contains([key(0)]),
        ):
            with pytest.raises(BackendClosed, match="closed"):
                await call
        with pytest.raises(BackendClosed):
            backend.list_keys()

    run(main())


def test_hundreds_of_concurrent_tasks_never_see_a_torn_object() -> None:
    async def main() -> None:
        backend = await open_cpu("cpu://?max_size=256KiB")

        async def writer(i: int) -> None:
            await backend.put(key(i % 24), filled(8 * KiB, i % 256))

        async def reader(i: int) -> None:
            await value_of(backend, i % 24)  # asserts all bytes equal

        tasks = [writer(i) if i % 2 else reader(i) for i in range(600)]
        await asyncio.gather(*tasks)
        assert backend.bytes_held <= 256 * KiB
        assert memcheck(backend)
        await backend.close()
        assert backend.allocator.stats().used == 0

    run(main())


def test_many_threads_with_their_own_loops_share_one_backend() -> None:
    backend = run(open_cpu("cpu://?max_size=128KiB"))

    def worker(thread: int) -> int:
        async def body() -> int:
            hits = 0
            for i in range(150):
                k = (i * 7 + thread) % 20
                if i % 3 == 0:
                    await backend.put(key(k), filled(4 * KiB, thread))
                elif i % 3 == 1:
                    hits += await value_of(backend, k) is not None
                else:
                    await backend.pin(key(k))
                    await backend.unpin(key(k))
            return hits

        return asyncio.run(body())

    with ThreadPoolExecutor(max_workers=8) as pool:
        hits = list(pool.map(worker, range(8)))
    assert sum(hits) > 0
    assert memcheck(backend)
    stats = backend.stats()
    assert stats["bytes_held"] == stats["keys"] * 4 * KiB <= 128 * KiB
    run(backend.close())
    assert backend.allocator.stats().used == 0
