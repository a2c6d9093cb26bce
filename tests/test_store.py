"""The tiered Store: fan-out, write-back, lookup, prefetch, isolation of failing tiers, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import kvplug
from kvplug import (
    Backend,
    BackendUnavailable,
    BytesBackend,
    CacheKey,
    Capabilities,
    FreeListAllocator,
    MemoryObj,
    NotSupported,
)
from kvplug.backend import Buffer
from kvplug.runtime.config import Config
from kvplug.runtime.store import Store, open_store
from kvplug.stats import summarize


class DictTier(BytesBackend):
    """A byte store in a dict that can be told to fail or to be slow."""

    capabilities = Capabilities(remove=True, list_keys=True)

    def __init__(self, url: Any = "dict://", **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.values: dict[str, bytes] = {}
        self.failing = False
        self.gate: asyncio.Event | None = None

    async def _maybe_fail(self) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.failing:
            raise BackendUnavailable("dict tier is down")

    async def get_bytes(self, key: str) -> Buffer | None:
        await self._maybe_fail()
        return self.values.get(key)

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        await self._maybe_fail()
        self.values[key] = b"".join(parts)

    async def contains_bytes(self, key: str) -> bool:
        await self._maybe_fail()
        return key in self.values

    async def remove_bytes(self, key: str) -> bool:
        await self._maybe_fail()
        return self.values.pop(key, None) is not None

    def _list_keys(self) -> Any:
        async def keys() -> Any:
            for text in list(self.values):
                yield CacheKey.parse(text)

        return keys()


def key(n: int) -> CacheKey:
    return CacheKey("store-test", 1, 0, n)


def filled(allocator: kvplug.Allocator, value: float, shape=(2, 2, 16, 64)) -> MemoryObj:
    obj = allocator.allocate(shape, torch.float16)
    assert obj is not None
    obj.tensor.fill_(value)
    return obj


async def two_dict_store(**kwargs: Any) -> tuple[Store, DictTier, DictTier, FreeListAllocator]:
    allocator = FreeListAllocator(64 << 20, pin=False)
    fast, slow = DictTier(allocator=allocator), DictTier(allocator=allocator)
    store = Store(tiers=[fast, slow], allocator=allocator, **kwargs)
    return store, fast, slow, allocator


def test_put_reaches_every_tier_and_get_prefers_the_first() -> None:
    async def main() -> None:
        store, fast, slow, allocator = await two_dict_store()
        obj = filled(allocator, 1.0)
        await store.put(key(1), obj)
        obj.release()
        await store.flush()
        assert await fast.contains(key(1)) and await slow.contains(key(1))
        hit = await store.get(key(1))
        assert hit is not None and bool((hit.tensor == 1.0).all())
        hit.release()
        stats = store.stats()
        assert stats["tiers"][store.tier_names[0]]["hits"] == 1
        assert stats["tiers"][store.tier_names[1]]["hits"] == 0
        await store.close()
        assert allocator.stats().used == 0

    asyncio.run(main())


def test_a_hit_in_a_lower_tier_is_written_back_into_the_faster_tiers() -> None:
    async def main() -> None:
        store, fast, slow, allocator = await two_dict_store()
        obj = filled(allocator, 3.0)
        await slow.put(key(2), obj)
        obj.release()
        hit = await store.get(key(2))
        assert hit is not None and bool((hit.tensor == 3.0).all())
        hit.release()
        await store.flush()
        assert await fast.contains(key(2))
        await store.close()

    asyncio.run(main())


def test_lookup_counts_the_prefix_present_in_any_tier() -> None:
    async def main() -> None:
        store, fast, slow, allocator = await two_dict_store()
        obj = filled(allocator, 0.5)
        for n, tier in ((0, fast), (1, slow), (2, fast), (4, slow)):
            await tier.put(key(n), obj)
        obj.release()
        assert await store.lookup([key(n) for n in range(6)]) == 3
        assert await store.lookup([key(4), key(0), key(1)]) == 3
        assert await store.lookup([key(3), key(0)]) == 0
        assert await store.lookup([]) == 0
        await store.close()

    asyncio.run(main())


def test_lookup_of_keys_the_first_tier_holds_never_waits_for_a_slow_tier() -> None:
    async def main() -> None:
        store, fast, slow, allocator = await two_dict_store()
        obj = filled(allocator, 0.5)
        for n in range(3):
            await fast.put(key(n), obj)
        obj.release()
        slow.gate = asyncio.Event()  # a paused lower tier: any call to it waits
        assert await asyncio.wait_for(store.lookup([key(0), key(1), key(2)]), 1) == 3
        assert await asyncio.wait_for(store.contains(key(1)), 1)
        slow.gate.set()
        await store.close()

    asyncio.run(main())


def test_prefetch_loads_a_contiguous_prefix_into_the_first_tier() -> None:
    async def main() -> None:
        store, fast, slow, allocator = await two_dict_store()
        obj = filled(allocator, 2.0)
        for n in (0, 1, 3):
            await slow.put(key(n), obj)
        await fast.put(key(2), obj)
        obj.release()
        assert await store.prefetch([key(n) for n in range(5)]) == 4
        assert [await fast.contains(key(n)) for n in range(5)] == [True] * 4 + [False]
        assert await store.prefetch([key(9), key(0)]) == 0
        await store.close()
        assert allocator.stats().used == 0

    asyncio.run(main())


def test_a_slow_tier_never_blocks_puts_and_its_overflow_is_counted() -> None:
    async def main() -> None:
        store, fast, slow, allocator = await two_dict_store(write_behind_size=16384)
        slow.gate = asyncio.Event()
        start = time.perf_counter()
        for n in range(10):
            obj = filled(allocator, float(n))
            await store.put(key(n), obj)
            obj.release()
        assert time.perf_counter() - start < 1.0
        await asyncio.sleep(0.05)
        slow_name = store.tier_names[1]
        # The write-behind held two puts (16 KiB); the other eight were dropped and hold no memory.
        assert store.stats()["tiers"][slow_name]["dropped_puts"] == 8
        assert allocator.stats().object_count == 2
        slow.gate.set()
        await store.flush()
        assert len(fast.values) == 10 and len(slow.values) == 2
        await store.close()
        assert allocator.stats().used == 0

    asyncio.run(main())


def test_a_failing_tier_is_isolated_and_retried_after_back_off() -> None:
    async def main() -> None:
        # Long enough that the get right after the failure falls within it on a busy machine too.
        store, fast, slow, allocator = await two_dict_store(backoff=2.0)
        obj = filled(allocator, 4.0)
        await slow.put(key(1), obj)
        obj.release()
        fast.failing = True
        hit = await store.get(key(1))
        assert hit is not None
        hit.release()
        health = store.health()
        assert not health[0].healthy and "dict tier is down" in (health[0].last_error or "")
        assert health[1].healthy
        assert store.stats()["tiers"][store.tier_names[0]]["errors"] == 1
        # Skipped while backing off: no second error, still served by the slow tier.
        hit = await store.get(key(1))
        assert hit is not None
        hit.release()
        assert store.stats()["tiers"][store.tier_names[0]]["errors"] == 1
        fast.failing = False
        await asyncio.sleep(2.05)
        assert await store.lookup([key(1)]) == 1
        assert store.health()[0].healthy
        await store.close()

    asyncio.run(main())


def test_metrics_export_in_prometheus_format() -> None:
    async def main() -> None:
        store, _fast, _slow, allocator = await two_dict_store()
        obj = filled(allocator, 1.0)
        await store.put(key(1), obj)
        obj.release()
        await store.flush()
        (await store.get(key(1))).release()
        assert await store.get(key(2)) is None
        text = store.prometheus_text()
        assert 'kvplug_tier_hits_total{op="batched_get",tier="0:dict://"} 1.0' in text
        assert 'kvplug_tier_misses_total{op="batched_get",tier="1:dict://"} 1.0' in text
        assert 'kvplug_tier_op_seconds_count{op="batched_get",tier="0:dict://"} 2.0' in text
        assert 'kvplug_tier_op_seconds_bucket{le="+Inf",op="batched_get",tier="0:dict://"} 2.0' in (
            text
        )
        assert (
            f'kvplug_tier_bytes_total{{op="batched_put",tier="0:dict://"}} {obj.nbytes}.0' in text
        )
        # one set of counters: the series, stats() and each tier's own operation_stats agree
        for name, tier in zip(store.tier_names, store.tiers, strict=True):
            own = tier.operation_stats()
            for op, counts in own.items():
                for counter in ("calls", "errors", "keys", "hits", "misses", "bytes"):
                    line = f'kvplug_tier_{counter}_total{{op="{op}",tier="{name}"}} '
                    assert f"{line}{float(getattr(counts, counter))}" in text
            assert store.stats()["tiers"][name]["reads"] == summarize(own).reads
        tiers = store.stats()["tiers"]
        assert (tiers["0:dict://"]["hit_rate"], tiers["1:dict://"]["hit_rate"]) == (0.5, 0.0)
        await store.close()

    asyncio.run(main())


def test_remove_and_clear_per_tier() -> None:
    async def main() -> None:
        store, fast, slow, allocator = await two_dict_store()
        for n in range(3):
            obj = filled(allocator, float(n))
            await store.put(key(n), obj)
            obj.release()
        await store.flush()
        assert await store.remove_from(key(0), tiers=[0]) is True
        assert await store.remove(key(0)) is True
        assert await store.remove(key(0)) is False
        assert await store.clear(tiers=[1]) == 2
        assert len(fast.values) == 2 and not slow.values
        with pytest.raises(kvplug.ConfigError, match="no tier 5"):
            await store.remove_from(key(1), tiers=[5])
        await store.close()

    asyncio.run(main())


def test_clear_needs_list_and_delete() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(8 << 20, pin=False)
        hole = await kvplug.open_backend("blackhole://")
        store = Store(tiers=[hole], allocator=allocator)
        with pytest.raises(NotSupported, match="cannot be cleared"):
            await store.clear()
        await store.close()

    asyncio.run(main())


def test_open_from_config_allocates_in_the_cpu_tier_for_zero_copy_puts() -> None:
    async def main() -> None:
        config = Config.from_dict({"local_cpu": True, "max_local_cpu_size": "32MiB"})
        store = await open_store(config)
        cpu: Backend = store.tiers[0]
        obj = store.allocate((2, 2, 16, 64), torch.float16)
        assert obj is not None and obj.allocator is cpu.allocator
        await store.put(key(1), obj)
        await store.flush()
        hit = await store.get(key(1))
        assert hit is not None and hit.data_ptr() == obj.data_ptr()
        hit.release()
        obj.release()
        await store.close()
        await store.close()
        with pytest.raises(kvplug.BackendClosed):
            await store.get(key(1))

    asyncio.run(main())


class BrokenCloseTier(DictTier):
    """A tier whose close fails after releasing what it can."""

    async def _close(self) -> None:
        raise BackendUnavailable("could not say goodbye to the server")


def test_close_closes_every_tier_even_when_one_fails_and_then_says_which() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(16 << 20, pin=False)
        tiers = [DictTier(allocator=allocator), BrokenCloseTier(allocator=allocator)]
        tiers.append(DictTier(allocator=allocator))
        store = Store(tiers=tiers, allocator=allocator)
        with pytest.raises(kvplug.BackendError, match="1 of 3 tiers failed to close") as error:
            await store.close()
        assert "goodbye" in str(error.value) and "1:dict://" in str(error.value)
        assert all(tier.closed for tier in tiers)

    asyncio.run(main())


class BuggyTier(DictTier):
    """A tier with a programming error, not a storage failure."""

    bug = True

    async def get_bytes(self, key: str) -> Buffer | None:
        if self.bug:
            raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")
        return await super().get_bytes(key)

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        if self.bug:
            raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")
        await super().put_bytes(key, parts)


def test_a_bug_in_a_tier_reaches_the_caller_instead_of_being_called_a_failing_tier() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(16 << 20, pin=False)
        store = Store(tiers=[BuggyTier(allocator=allocator)], allocator=allocator)
        with pytest.raises(kvplug.UnexpectedBackendError, match="unsupported operand") as bug:
            await store.get(key(1))
        assert isinstance(bug.value.__cause__, TypeError)
        assert store.health()[0].healthy
        await store.close()

    asyncio.run(main())


def test_a_bug_in_a_queued_put_is_logged_and_the_queue_keeps_draining(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        allocator = FreeListAllocator(16 << 20, pin=False)
        buggy = BuggyTier(allocator=allocator)
        store = Store(tiers=[DictTier(allocator=allocator), buggy], allocator=allocator)
        obj = filled(allocator, 1.0)
        await store.put(key(1), obj)
        await asyncio.wait_for(store.flush(), 10)
        buggy.bug = False
        await store.put(key(2), obj)
        obj.release()
        await asyncio.wait_for(store.flush(), 10)
        assert list(buggy.values) == [str(key(2))]
        assert store.stats()["tiers"][store.tier_names[1]]["dropped_puts"] == 1
        await store.close()
        assert allocator.stats().used == 0

    with caplog.at_level("ERROR", logger="kvplug.store"):
        asyncio.run(main())
    assert "unexpected error on a queued put" in caplog.text and "TypeError" in caplog.text


def test_an_os_error_of_a_tier_is_isolated_like_any_storage_failure() -> None:
    class DiskFullTier(DictTier):
        async def get_bytes(self, key: str) -> Buffer | None:
            raise OSError(5, "Input/output error")

    async def main() -> None:
        allocator = FreeListAllocator(16 << 20, pin=False)
        store = Store(tiers=[DiskFullTier(allocator=allocator)], allocator=allocator)
        assert await store.get(key(1)) is None
        assert not store.health()[0].healthy
        await store.close()

    asyncio.run(main())
