"""The Store's reads into the caller's memory (``get_into``, an engine's load): each tier reads
straight into the caller's buffer with no memory budget in between, and a hit in a lower tier
is promoted off the read path, bounded in bytes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from test_store import DictTier
from test_store_runtime import CHUNK, MiB, chunk

from kvplug import CacheKey, FreeListAllocator, MemoryObj
from kvplug.backend import Buffer
from kvplug.runtime.config import Config
from kvplug.runtime.store import Store, open_store


def key(n: int) -> CacheKey:
    return CacheKey("store-reads-test", 1, 0, n)


def engine_buffer(value: float = 0.0) -> MemoryObj:
    """An engine's own buffer: torch memory kvplug did not allocate."""
    return MemoryObj.from_tensor(torch.full(CHUNK, value, dtype=torch.float16))


async def cpu_over_disk(tmp_path: Path, **options: Any) -> Store:
    config = Config.from_dict(
        {"tiers": [{"url": "cpu://", "max_size": "8MiB"}, f"file://{tmp_path}/disk"]}
    )
    return await open_store(config, timeout=2.0, **options)


async def on_disk_only(store: Store, n: int, value: float) -> None:
    """Store chunk ``n`` in the disk tier alone."""
    obj = chunk(store, value)
    await store.tiers[1].put(key(n), obj)
    obj.release()


def test_a_full_budget_still_loads_a_chunk_of_the_lower_tier_into_engine_memory(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        store = await cpu_over_disk(tmp_path, promote=False)
        await on_disk_only(store, 1, 5.0)
        held = []  # every byte of the budget in use, none of it evictable
        while (obj := store.allocate(CHUNK, torch.float16)) is not None:
            held.append(obj)
        assert held and store.budget.stats().used == store.budget.stats().capacity
        dest = engine_buffer()
        start = time.perf_counter()
        assert await store.get_into(key(1), dest)
        assert time.perf_counter() - start < 1.0, "the load waited for kvplug's own memory"
        assert bool((dest.tensor == 5.0).all())
        assert store.stats()["misses"]["memory_short"] == 0
        assert store.stats()["memory"]["waits"] == 0
        for obj in held:
            obj.release()
        await store.close()

    asyncio.run(main())


def test_a_load_into_engine_memory_allocates_nothing_in_the_budget(tmp_path: Path) -> None:
    async def main() -> None:
        store = await cpu_over_disk(tmp_path, promote=False)
        await on_disk_only(store, 1, 3.0)
        obj = chunk(store, 4.0)
        await store.put(key(2), obj)
        obj.release()
        await store.flush()
        used = store.budget.stats().used
        allocations = (
            store.budget.stats().allocations
            if hasattr(store.budget.stats(), "allocations")
            else None
        )
        dests = [engine_buffer(), engine_buffer(), engine_buffer(9.0)]
        assert await store.batched_get_into([key(1), key(2), key(3)], dests) == [True, True, False]
        assert [float(d.tensor[0, 0, 0, 0]) for d in dests[:2]] == [3.0, 4.0]
        assert store.budget.stats().used == used
        if allocations is not None:
            assert store.budget.stats().allocations == allocations
        assert store.stats()["misses"]["absent"] == 1
        await store.close()

    asyncio.run(main())


def test_a_lower_tier_hit_read_into_engine_memory_is_promoted_in_the_background(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        store = await cpu_over_disk(tmp_path)
        await on_disk_only(store, 1, 7.0)
        dest = engine_buffer()
        assert await store.get_into(key(1), dest)
        dest.tensor.fill_(-1.0)  # the engine reuses its buffer at once
        for _ in range(200):
            if await store.tiers[0].contains(key(1)):
                break
            await asyncio.sleep(0.01)
        promoted = await store.tiers[0].get(key(1))
        assert promoted is not None and bool((promoted.tensor == 7.0).all())
        promoted.release()
        await store.close()

    asyncio.run(main())


def test_promote_false_leaves_the_faster_tiers_alone(tmp_path: Path) -> None:
    async def main() -> None:
        store = await cpu_over_disk(tmp_path, promote=False)
        await on_disk_only(store, 1, 7.0)
        dest = engine_buffer()
        assert await store.get_into(key(1), dest)
        got = await store.get(key(1))
        assert got is not None
        got.release()
        await asyncio.sleep(0.05)
        assert not await store.tiers[0].contains(key(1))
        await store.close()

    asyncio.run(main())


class RereadTier(DictTier):
    """A dict tier whose second and later gets of a key wait for ``reread_gate`` (a promotion reads
    a key again after the load that found it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reread_gate = asyncio.Event()
        self.read: set[str] = set()
        self.gets = 0

    async def get_bytes(self, key: str) -> Buffer | None:
        self.gets += 1
        if key in self.read:
            await self.reread_gate.wait()
        self.read.add(key)
        return self.values.get(key)


def test_promotions_in_flight_are_bounded_in_bytes() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        fast, slow = DictTier(allocator=allocator), RereadTier(allocator=allocator)
        store = Store(tiers=[fast, slow], allocator=allocator, write_behind_size=4 * MiB)
        for n in range(6):
            obj = chunk(allocator, float(n))
            await slow.put(key(n), obj)
            obj.release()
        for n in range(6):
            assert await store.get_into(key(n), engine_buffer())
        await asyncio.sleep(0.05)
        assert store.stats()["promotions_skipped"] == 2  # 1 MiB each: four fit in 4 MiB
        assert slow.gets == 6 + 4
        slow.reread_gate.set()
        for _ in range(100):
            await store.flush()
            if len(fast.values) == 4:
                break
            await asyncio.sleep(0.01)
        assert sorted(fast.values) == sorted(str(key(n)) for n in range(4))
        await store.close()

    asyncio.run(main())


class GatedPutTier(DictTier):
    """A dict tier whose puts wait for ``put_gate`` once it is set up."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.put_gate: asyncio.Event | None = None

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        if self.put_gate is not None:
            await self.put_gate.wait()
        await super().put_bytes(key, parts)


def test_a_lower_tier_hit_does_not_wait_for_its_write_back_into_a_slow_first_tier() -> None:
    """Tiers [redis, file] read from the disk: the get returns without waiting for a SET."""

    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        remote, disk = GatedPutTier(allocator=allocator), DictTier(allocator=allocator)
        store = Store(tiers=[remote, disk], allocator=allocator)
        obj = chunk(allocator, 2.0)
        await disk.put(key(1), obj)
        obj.release()
        remote.put_gate = asyncio.Event()
        got = await asyncio.wait_for(store.get(key(1)), 1.0)
        assert got is not None and bool((got.tensor == 2.0).all())
        got.release()
        assert await asyncio.wait_for(store.get_into(key(1), engine_buffer()), 1.0)
        remote.put_gate.set()
        await store.flush()
        await asyncio.sleep(0.05)
        await store.flush()
        assert str(key(1)) in remote.values  # written back, off the read path
        await store.close()

    asyncio.run(main())


def test_a_load_reads_the_newest_value_waiting_in_the_write_behind() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        fast, slow = DictTier(allocator=allocator), GatedPutTier(allocator=allocator)
        store = Store(tiers=[fast, slow], allocator=allocator)
        old = chunk(allocator, 1.0)
        await store.put(key(1), old)
        await store.flush()
        await fast.remove(key(1))  # only the slow tier has the older value now
        slow.put_gate = asyncio.Event()
        new = chunk(allocator, 2.0)
        await store.put(key(1), new)
        await fast.remove(key(1))  # the newer value waits in the write-behind alone
        dest = engine_buffer()
        assert await store.get_into(key(1), dest)
        assert bool((dest.tensor == 2.0).all())
        slow.put_gate.set()
        for obj in (old, new):
            obj.release()
        await store.close()

    asyncio.run(main())
