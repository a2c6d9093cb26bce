"""The Store's write-behind at its edges: an object larger than its limit, a tier that receives
nothing (said loudly, not only counted), per-key outcomes of a batched put, and overwrites that
no older value outlives, with a tier failing or a write of the older value still in flight."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from test_store import DictTier
from test_store_runtime import MiB, chunk, value_of, value_read

from kvplug import (
    BackendUnavailable,
    CacheKey,
    Capabilities,
    CapacityExceeded,
    FreeListAllocator,
    MemoryObj,
)
from kvplug.backend import Buffer
from kvplug.runtime.config import Config
from kvplug.runtime.store import STARVED_AFTER, Store, open_store
from kvplug.runtime.sync import SyncClient

BIG = (2, 32, 256, 1024)  # fp16: 32 MiB, the chunk


def key(n: int) -> CacheKey:
    return CacheKey("write-behind-test", 1, 0, n)


class PersistentTier(DictTier):
    """A dict tier that says it outlives the process, as a disk or a Redis server does."""

    capabilities = Capabilities(remove=True, list_keys=True, persistent=True)


class PartialTier(DictTier):
    """A tier that stores the first ``room`` objects of a batch and reports which it kept."""

    def __init__(self, *args: Any, room: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.room = room

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        stored = []
        for n, (k, obj) in enumerate(zip(keys, objs, strict=True)):
            if n < self.room:
                await self._put(k, obj)
            stored.append(n < self.room)
        if not all(stored):
            error = CapacityExceeded(f"only {self.room} of {len(keys)} fitted")
            error.stored = tuple(stored)
            raise error


class GatedTier(PersistentTier):
    """A persistent tier whose puts wait for ``put_gate`` when it is set up."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.put_gate: asyncio.Event | None = None
        self.puts_started = 0

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        self.puts_started += 1
        if self.put_gate is not None:
            await self.put_gate.wait()
        await super().put_bytes(key, parts)


# -- an object larger than the write-behind's limit -----------------------------------------------


def test_a_disk_tier_behind_a_small_cpu_tier_receives_every_chunk(tmp_path: Path) -> None:
    """The issue's configuration: the write-behind's limit (a quarter of a 64 MiB cpu tier) is
    smaller than one 32 MiB chunk; an empty write-behind takes it all the same."""

    async def main() -> None:
        config = Config.from_dict(
            {"tiers": [{"url": "cpu://", "max_size": "64MiB"}, f"file://{tmp_path}/disk"]}
        )
        store = await open_store(config)
        assert store.write_behind_limit == 16 * MiB
        for n in range(3):
            obj = store.allocate(BIG, torch.float16)
            assert obj is not None
            obj.tensor.fill_(float(n))
            await store.put(key(n), obj)
            obj.release()
            await store.flush()
        disk = store.tiers[1]
        assert [await disk.contains(key(n)) for n in range(3)] == [True] * 3
        stats = store.stats()["tiers"][store.tier_names[1]]
        assert stats["dropped_puts"] == 0
        assert stats["offered_puts"] == 3
        assert await value_read(disk, key(2)) == 2.0
        await store.close()

    asyncio.run(main())


def test_an_object_larger_than_the_limit_waits_for_an_empty_write_behind() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        fast, slow = DictTier(allocator=allocator), GatedTier(allocator=allocator)
        store = Store(tiers=[fast, slow], allocator=allocator, write_behind_size=1 * MiB)
        slow.put_gate = asyncio.Event()
        objs = [chunk(allocator, float(n)) for n in range(2)]
        # The first 2 MiB object goes into the empty queue; the second finds it busy.
        assert await store.offer([key(0)], objs[:1]) == [True]
        assert await store.offer([key(1)], objs[1:]) == [True]
        reasons = store.stats()["tiers"][store.tier_names[1]]["dropped_by_reason"]
        assert reasons["write_behind_full"] == 1
        slow.put_gate.set()
        await store.flush()
        assert list(slow.values) == [str(key(0))]
        for obj in objs:
            obj.release()
        await store.close()

    asyncio.run(main())


# -- a tier that receives nothing ---------------------------------------------------------------


class TinyTier(DictTier):
    """A tier too small for any object of the test."""

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        raise CapacityExceeded("the tiny tier holds 1 KiB; raise its max_size")


def test_a_tier_that_takes_no_put_is_warned_about_with_what_to_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        fast, tiny = DictTier(allocator=allocator), TinyTier(allocator=allocator)
        store = Store(tiers=[fast, tiny], allocator=allocator)
        for n in range(STARVED_AFTER + 2):
            obj = chunk(allocator, float(n))
            await store.put(key(n), obj)
            obj.release()
            await store.flush()
        stats = store.stats()["tiers"][store.tier_names[1]]
        assert stats["starved"] is True
        assert stats["offered_puts"] == stats["dropped_puts"] == STARVED_AFTER + 2
        await store.close()

    with caplog.at_level(logging.WARNING, logger="kvplug.store"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if "took none of the last" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "1:dict://" in warnings[0]
    assert "raise the tier's max_size" in warnings[0]
    assert "the tiny tier holds 1 KiB" in warnings[0]


def test_a_busy_write_behind_that_sheds_puts_is_not_called_starvation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        fast, slow = DictTier(allocator=allocator), GatedTier(allocator=allocator)
        store = Store(tiers=[fast, slow], allocator=allocator, write_behind_size=2 * MiB)
        slow.put_gate = asyncio.Event()
        for n in range(4 * STARVED_AFTER):
            obj = chunk(allocator, float(n))
            await store.put(key(n), obj)
            obj.release()
        stats = store.stats()["tiers"][store.tier_names[1]]
        assert stats["dropped_by_reason"]["write_behind_full"] >= 4 * STARVED_AFTER - 2
        assert stats["starved"] is False
        slow.put_gate.set()
        await store.close()

    with caplog.at_level(logging.WARNING, logger="kvplug.store"):
        asyncio.run(main())
    assert not [r for r in caplog.records if "took none of the last" in r.getMessage()]


def test_a_starved_tier_that_takes_a_put_again_is_no_longer_starved() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        fast, slow = DictTier(allocator=allocator), DictTier(allocator=allocator)
        store = Store(tiers=[fast, slow], allocator=allocator, backoff=0.01, max_backoff=0.01)
        slow.failing = True
        for n in range(STARVED_AFTER):
            obj = chunk(allocator, float(n))
            await store.put(key(n), obj)
            obj.release()
            await store.flush()
            await asyncio.sleep(0.02)  # past the back-off: the tier is tried and fails again
        assert store.stats()["tiers"][store.tier_names[1]]["starved"] is True
        slow.failing = False
        await asyncio.sleep(0.02)
        obj = chunk(allocator, 9.0)
        await store.put(key(9), obj)
        obj.release()
        await store.flush()
        assert str(key(9)) in slow.values
        assert store.stats()["tiers"][store.tier_names[1]]["starved"] is False
        await store.close()

    asyncio.run(main())


# -- per-key outcomes of a batched put --------------------------------------------------------


def test_a_lower_tier_that_kept_half_a_batch_keeps_that_half() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        fast, partial = DictTier(allocator=allocator), PartialTier(allocator=allocator, room=2)
        store = Store(tiers=[fast, partial], allocator=allocator)
        objs = [chunk(allocator, float(n)) for n in range(4)]
        await store.batched_put([key(n) for n in range(4)], objs)
        await store.flush()
        assert sorted(partial.values) == sorted(str(key(n)) for n in range(2))
        stats = store.stats()["tiers"][store.tier_names[1]]
        assert stats["dropped_by_reason"]["full"] == 2
        assert stats["bytes_written"] == 2 * objs[0].nbytes
        for obj in objs:
            obj.release()
        await store.close()

    asyncio.run(main())


def test_a_first_tier_that_kept_half_a_batch_is_reported_per_key() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        only = PartialTier(allocator=allocator, room=2)
        store = Store(tiers=[only], allocator=allocator)
        objs = [chunk(allocator, float(n)) for n in range(4)]
        assert await store.offer([key(n) for n in range(4)], objs) == [True, True, False, False]
        with pytest.raises(CapacityExceeded, match="2 of 4 puts were not accepted") as refused:
            await store.batched_put([key(n) for n in range(4, 8)], objs)
        assert refused.value.stored == (True, True, False, False)
        assert sorted(only.values) == sorted(str(key(n)) for n in (0, 1, 4, 5))
        for obj in objs:
            obj.release()
        await store.close()

    asyncio.run(main())


# -- overwrites: no older value survives a newer accepted one ------------------------------


def test_an_overwrite_removes_the_older_value_below_before_it_returns() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        fast, disk = DictTier(allocator=allocator), GatedTier(allocator=allocator)
        store = Store(tiers=[fast, disk], allocator=allocator)
        old = chunk(allocator, 1.0)
        await store.put(key(1), old)
        await store.flush()
        assert str(key(1)) in disk.values
        disk.put_gate = asyncio.Event()  # the newer value stays queued
        new = chunk(allocator, 2.0)
        await store.put(key(1), new)
        # Were the process killed now, the persistent tier would hold no older value.
        assert str(key(1)) not in disk.values
        disk.put_gate.set()
        await store.flush()
        assert await value_read(disk, key(1)) == 2.0
        for obj in (old, new):
            obj.release()
        await store.close()

    asyncio.run(main())


def test_an_overwrite_waits_for_the_older_value_being_written_then_removes_it() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        fast, disk = DictTier(allocator=allocator), GatedTier(allocator=allocator)
        store = Store(tiers=[fast, disk], allocator=allocator)
        disk.put_gate = asyncio.Event()
        old, new = chunk(allocator, 1.0), chunk(allocator, 2.0)
        await store.put(key(1), old)
        while not disk.puts_started:  # the older value's write is in flight
            await asyncio.sleep(0.001)
        overwrite = asyncio.ensure_future(store.put(key(1), new))
        await asyncio.sleep(0.05)
        assert not overwrite.done(), "the put returned while an older value could still land"
        disk.put_gate.set()  # the older value lands...
        await overwrite  # ...and is gone before the newer put returns
        assert disk.values.get(str(key(1))) is None or disk.puts_started == 2
        await store.flush()
        assert await value_read(store, key(1)) == 2.0
        for obj in (old, new):
            obj.release()
        await store.close()

    asyncio.run(main())


def test_an_overwrite_with_a_failing_persistent_tier_is_not_accepted_but_served() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        fast, disk = DictTier(allocator=allocator), PersistentTier(allocator=allocator)
        store = Store(tiers=[fast, disk], allocator=allocator)
        disk.failing = True
        new = chunk(allocator, 2.0)
        with pytest.raises(BackendUnavailable, match="an older value may survive") as refused:
            await store.put(key(1), new)
        assert refused.value.stored == (False,)
        assert "dict tier is down" in str(refused.value)
        # The newer value is served while this process lives.
        assert await value_read(store, key(1)) == 2.0
        new.release()
        await store.close()

    asyncio.run(main())


def test_a_volatile_lower_tier_is_not_asked_to_remove_on_every_put() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(64 * MiB, pin=False)
        fast, slow = DictTier(allocator=allocator), DictTier(allocator=allocator)
        removed: list[str] = []
        original = slow.remove_bytes

        async def counting_remove(name: str) -> bool:
            removed.append(name)
            return await original(name)

        slow.remove_bytes = counting_remove  # type: ignore[method-assign]
        store = Store(tiers=[fast, slow], allocator=allocator)
        obj = chunk(allocator, 1.0)
        for _ in range(3):
            await store.put(key(1), obj)
        await store.flush()
        assert removed == []
        obj.release()
        await store.close()

    asyncio.run(main())


# -- the Store from an engine thread ------------------------------------------------------------


def test_an_engine_thread_allocates_from_a_sync_clients_store(tmp_path: Path) -> None:
    config = Config.from_dict({"tiers": [{"url": "cpu://", "max_size": "64MiB"}]})
    client = SyncClient(config)
    try:
        results: list[object] = []

        def engine_thread() -> None:
            try:
                obj = client.backend.allocate((2, 4, 16, 64), torch.float16)  # type: ignore[attr-defined]
                results.append(obj)
            except BaseException as error:  # reported by the assertion below
                results.append(error)

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join(10)
        assert len(results) == 1 and isinstance(results[0], MemoryObj), results
        obj = results[0]
        obj.tensor.fill_(3.0)
        client.put(key(1), obj).result(10)
        obj.release()
        got = client.get(key(1)).result(10)
        assert value_of(got) == 3.0
        assert got is not None
        got.release()
    finally:
        client.close()


class NativeTier(DictTier):
    """A dict tier that says it batches natively."""

    capabilities = Capabilities(remove=True, list_keys=True, native_batching=True)

    async def batched_get_bytes(self, keys: Sequence[str]) -> list[Buffer | None]:
        return [self.values.get(k) for k in keys]

    async def batched_put_bytes(
        self, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        for name, parts in zip(keys, values, strict=True):
            self.values[name] = b"".join(parts)

    async def batched_exists_bytes(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.values for k in keys]


def test_the_store_batches_natively_only_where_every_tier_does() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(16 * MiB, pin=False)
        native, plain = NativeTier(allocator=allocator), DictTier(allocator=allocator)
        assert Store(tiers=[native], allocator=allocator).capabilities.native_batching
        mixed = Store(tiers=[native, plain], allocator=allocator)
        assert not mixed.capabilities.native_batching
        await mixed.close()

    asyncio.run(main())
