"""The Store as the engine-facing runtime: one batched call per tier, one memory budget with
documented eviction and waiting rules, a write-behind bounded in bytes that never lets an older
value outlive a newer one, and the Store as a Backend (URL, wrappers, SyncClient)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_store import DictTier

import kvplug
from kvplug import (
    Backend,
    BackendUnavailable,
    CacheKey,
    CapacityExceeded,
    ConfigError,
    FreeListAllocator,
    KvplugError,
    MemoryObj,
)
from kvplug.backend import Buffer
from kvplug.runtime.config import Config
from kvplug.runtime.store import Store, open_store
from kvplug.runtime.sync import SyncClient
from kvplug_cpu.backend import CpuBackend
from kvplug_testing.threads import loop_thread

MiB = 1 << 20
CHUNK = (2, 2, 128, 1024)  # fp16: 1 MiB


def key(n: int) -> CacheKey:
    return CacheKey("runtime-test", 1, 0, n)


def chunk(allocator: kvplug.Allocator, value: float) -> MemoryObj:
    obj = allocator.allocate(CHUNK, torch.float16)
    assert obj is not None, "the test's allocator is full"
    obj.tensor.fill_(value)
    return obj


def value_of(obj: MemoryObj | None) -> float | None:
    if obj is None:
        return None
    values = obj.tensor.unique()
    assert values.numel() == 1, f"a mixed object: {values}"
    return float(values.item())


async def value_read(backend: Backend, k: CacheKey) -> float | None:
    """The value ``backend`` holds under ``k`` (None for a miss); the object read is released."""
    got = await backend.get(k)
    try:
        return value_of(got)
    finally:
        if got is not None:
            got.release()


class CountingTier(DictTier):
    """A dict tier that records every batched call it receives (the keys, in order), and whose
    writes can be held (``put_gate``) or refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, list[int]]] = []
        self.refuse_puts = False
        self.put_gate: asyncio.Event | None = None

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        if self.put_gate is not None:
            await self.put_gate.wait()
        await super().put_bytes(key, parts)

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        self.calls.append(("get", [k.chunk_hash for k in keys]))
        return await super()._batched_get(keys)

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        self.calls.append(("put", [k.chunk_hash for k in keys]))
        if self.refuse_puts:
            raise CapacityExceeded("the counting tier is full")
        await super()._batched_put(keys, objs)

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        self.calls.append(("exists", [k.chunk_hash for k in keys]))
        return await super()._batched_exists(keys)

    def of(self, operation: str) -> list[list[int]]:
        return [keys for op, keys in self.calls if op == operation]


async def counting_store(**options: Any) -> tuple[Store, CountingTier, CountingTier]:
    allocator = FreeListAllocator(64 * MiB, pin=False)
    fast = CountingTier(allocator=allocator)
    slow = CountingTier(allocator=allocator)
    return Store(tiers=[fast, slow], allocator=allocator, **options), fast, slow


# -- batched per tier ---------------------------------------------------------------------------


def test_batched_get_asks_each_tier_once_for_the_keys_still_missing_in_lookup_order() -> None:
    async def main() -> None:
        store, fast, slow = await counting_store()
        for n in (0, 2, 4):
            obj = chunk(store.budget, float(n))
            await fast.put(key(n), obj)
            obj.release()
        for n in (1, 3, 5, 6):
            obj = chunk(store.budget, float(n))
            await slow.put(key(n), obj)
            obj.release()
        got = await store.batched_get([key(n) for n in range(9)])
        assert [value_of(o) for o in got] == [0, 1, 2, 3, 4, 5, 6, None, None]
        assert fast.of("get") == [list(range(9))]
        assert slow.of("get") == [[1, 3, 5, 6, 7, 8]]
        for obj in got:
            if obj is not None:
                obj.release()
        # The four hits of the lower tier go back into the first one in one batched write.
        await store.flush()
        assert fast.of("put") == [[1, 3, 5, 6]]
        assert store.stats()["misses"]["absent"] == 2
        await store.close()
        assert store.budget.stats().used == 0

    asyncio.run(main())


def test_batched_put_is_one_call_to_the_first_tier_and_batched_writes_below() -> None:
    async def main() -> None:
        store, fast, slow = await counting_store(write_batch=4)
        objs = [chunk(store.budget, float(n)) for n in range(10)]
        slow.put_gate = asyncio.Event()  # hold the lower tier so that its queue fills up
        await store.batched_put([key(n) for n in range(10)], objs)
        for obj in objs:
            obj.release()
        assert fast.of("put") == [list(range(10))]
        slow.put_gate.set()
        await store.flush()
        written = slow.of("put")
        assert sorted(n for batch in written for n in batch) == list(range(10))
        assert all(len(batch) <= 4 for batch in written) and len(written) <= 4
        assert await store.batched_contains([key(n) for n in range(12)]) == 10
        await store.close()

    asyncio.run(main())


def test_batched_contains_keeps_its_prefix_meaning_across_tiers() -> None:
    async def main() -> None:
        store, fast, slow = await counting_store()
        obj = chunk(store.budget, 1.0)
        for n, tier in ((0, fast), (1, slow), (2, slow), (3, fast), (5, slow)):
            await tier.put(key(n), obj)
        obj.release()
        assert await store.batched_contains([key(n) for n in range(7)]) == 4
        assert await store.batched_contains([key(5), key(4)]) == 1
        assert await store.contains(key(3)) and not await store.contains(key(4))
        await store.close()

    asyncio.run(main())


def test_batched_exists_asks_each_tier_once_for_the_keys_the_faster_ones_lacked() -> None:
    async def main() -> None:
        store, fast, slow = await counting_store()
        obj = chunk(store.budget, 1.0)
        for n, tier in ((0, fast), (1, slow), (3, fast), (5, slow)):
            await tier.put(key(n), obj)
        obj.release()
        asked = [key(n) for n in (0, 1, 2, 3, 5, 1, 6)]  # a duplicate, misses in the middle
        assert await store.batched_exists(asked) == [True, True, False, True, True, True, False]
        assert fast.of("exists") == [[0, 1, 2, 3, 5, 1, 6]]
        assert slow.of("exists") == [[1, 2, 5, 1, 6]]
        obj = chunk(store.budget, 2.0)
        await fast.put(key(7), obj)
        obj.release()
        assert await store.batched_exists([key(7), key(0)]) == [True, True]
        assert len(slow.of("exists")) == 1  # every key found in the fast tier
        await store.close()

    asyncio.run(main())


# -- one memory budget --------------------------------------------------------------------------


def test_a_disk_tier_in_front_of_the_cpu_tier_reads_into_the_cpu_tiers_memory(
    tmp_path: Path,
) -> None:
    """[file, cpu]: one buffer (the cpu tier's max_size), never the process-wide 2 GiB one."""

    async def main() -> None:
        config = Config.from_dict({"tiers": [f"file://{tmp_path}/disk", "cpu://?max_size=32MiB"]})
        store = await open_store(config)
        disk, cpu = store.tiers
        assert isinstance(cpu, CpuBackend)
        assert disk.allocator is cpu.allocator is store.budget
        assert store.budget.stats().capacity == 32 * MiB
        assert store.stats()["memory"]["budget_bytes"] == 32 * MiB
        obj = store.allocate(CHUNK, torch.float16)
        assert obj is not None and obj.allocator is store.budget
        obj.tensor.fill_(3.0)
        await store.put(key(1), obj)
        obj.release()
        await store.flush()
        await cpu.remove(key(1))
        got = await store.get(key(1))
        assert value_of(got) == 3.0 and got is not None and got.allocator is store.budget
        got.release()
        await store.close()

    asyncio.run(main())


def test_buffer_size_is_the_budget_without_a_cpu_tier_and_caps_it_with_one(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        alone = await open_store(
            Config.from_dict({"tiers": [f"file://{tmp_path}/a"], "buffer_size": "48MiB"})
        )
        assert alone.budget.stats().capacity == 48 * MiB
        assert alone.tiers[0].allocator is alone.budget
        assert alone.write_behind_limit == 12 * MiB  # a quarter of the budget by default
        await alone.close()
        both = await open_store(
            Config.from_dict(
                {
                    "tiers": ["cpu://?max_size=1GiB", f"file://{tmp_path}/b"],
                    "buffer_size": "24MiB",
                    "write_behind_size": "5MiB",
                }
            )
        )
        assert both.budget.stats().capacity == 24 * MiB
        assert all(tier.allocator is both.budget for tier in both.tiers)
        assert both.write_behind_limit == 5 * MiB
        await both.close()

    asyncio.run(main())


def test_a_lower_tier_read_evicts_only_entries_that_only_the_cpu_tier_references() -> None:
    """Budget of 6 chunks, all held by cpu entries; a read of a lower-tier key needs room: the
    cpu tier evicts an entry nobody reads, never the one a caller is holding."""

    async def main() -> None:
        budget = FreeListAllocator(6 * MiB, pin=False)
        cpu = CpuBackend("cpu://", allocator=budget)
        lower = DictTier(allocator=budget)
        store = Store(tiers=[cpu, lower], allocator=budget)
        for n in range(6):
            obj = chunk(budget, float(n))
            await cpu.put(key(n), obj)
            obj.release()
        staged = MemoryObj.from_tensor(torch.full(CHUNK, 9.0, dtype=torch.float16))
        await lower.put(key(9), staged)
        held = await store.get(key(0))  # least recently used, but a caller holds it
        assert held is not None
        for n in range(1, 6):  # make key 0 the first eviction candidate again
            (await cpu.get(key(n))).release()
        got = await store.get(key(9))
        assert value_of(got) == 9.0
        assert await cpu.contains(key(0)), "the entry a caller holds was evicted"
        assert not await cpu.contains(key(1)), "the least recently used free entry stays"
        assert cpu.evictions >= 1 and budget.stats().shortages == 0
        for obj in (held, got):
            assert obj is not None
            obj.release()
        await store.close()
        assert budget.stats().used == 0

    asyncio.run(main())


def test_a_get_waits_for_memory_then_misses_with_a_counted_reason() -> None:
    async def main() -> None:
        budget = FreeListAllocator(4 * MiB, pin=False)
        lower = DictTier(allocator=budget)
        store = Store(tiers=[lower], allocator=budget, timeout=0.3)
        staged = MemoryObj.from_tensor(torch.full(CHUNK, 5.0, dtype=torch.float16))
        await lower.put(key(1), staged)
        hogs = [chunk(budget, 0.0) for _ in range(4)]  # the engine holds the whole budget
        start = time.monotonic()
        assert await store.get(key(1)) is None
        waited = time.monotonic() - start
        assert 0.25 <= waited < 5.0
        stats = store.stats()
        assert stats["misses"] == {"absent": 0, "memory_short": 1}
        assert stats["memory"]["waits"] >= 1 and stats["memory"]["shortages"] >= 1
        assert 'kvplug_store_misses_total{reason="memory_short"} 1.0' in store.prometheus_text()
        # Memory freed while a get waits: the get is served.
        store.options = store.options.model_copy(update={"timeout": 10.0})
        reader = asyncio.create_task(store.get(key(1)))
        await asyncio.sleep(0.2)
        assert not reader.done()
        hogs.pop().release()
        got = await asyncio.wait_for(reader, 5)
        assert value_of(got) == 5.0 and got is not None
        got.release()
        for hog in hogs:
            hog.release()
        await store.close()

    asyncio.run(main())


# -- write-behind in bytes ----------------------------------------------------------------------


def test_the_write_behind_is_bounded_in_bytes_and_says_what_it_dropped() -> None:
    async def main() -> None:
        store, fast, slow = await counting_store(write_behind_size=3 * MiB)
        slow.put_gate = asyncio.Event()
        start = time.perf_counter()
        for n in range(10):
            obj = chunk(store.budget, float(n))
            await store.put(key(n), obj)
            obj.release()
        assert time.perf_counter() - start < 2.0, "a slow tier blocked puts"
        stats = store.stats()
        assert stats["write_behind"]["queued_bytes"] <= 3 * MiB
        assert stats["write_behind"]["limit_bytes"] == 3 * MiB
        assert store.write_behind_room == 3 * MiB - stats["write_behind"]["queued_bytes"]
        slow_stats = stats["tiers"][store.tier_names[1]]
        assert slow_stats["dropped_by_reason"]["write_behind_full"] == 7
        assert slow_stats["dropped_puts"] == 7
        # The dict tiers keep bytes of their own: the budget holds only what is queued.
        assert store.budget.stats().used <= 3 * MiB
        text = store.prometheus_text()
        assert "kvplug_store_write_behind_bytes 3.145728e+06" in text
        dropped = 'kvplug_tier_dropped_puts_total{reason="write_behind_full",tier="1:dict://"}'
        assert f"{dropped} 7.0" in text
        slow.put_gate.set()
        await store.flush()
        assert len(slow.values) == 3 and len(fast.values) == 10
        await store.close()
        assert store.budget.stats().used == 0

    asyncio.run(main())


def test_a_put_no_tier_accepts_raises_at_once_and_offer_says_which() -> None:
    async def main() -> None:
        store, fast, slow = await counting_store(write_behind_size=1 * MiB)
        fast.refuse_puts = True
        slow.put_gate = asyncio.Event()
        objs = [chunk(store.budget, float(n)) for n in range(3)]
        assert await store.offer([key(n) for n in range(3)], objs) == [True, False, False]
        start = time.perf_counter()
        with pytest.raises(CapacityExceeded, match="1 of 1 puts were not accepted") as refused:
            await store.put(key(7), objs[0])
        assert time.perf_counter() - start < 1.0
        assert refused.value.stored == (False,)
        assert "counting tier is full" in str(refused.value)
        assert "write_behind_full" in str(refused.value)
        assert store.stats()["rejected_puts"] == 3
        slow.put_gate.set()
        for obj in objs:
            obj.release()
        await store.close()

    asyncio.run(main())


def test_a_failing_first_tier_with_no_other_tier_is_a_backend_unavailable_put() -> None:
    async def main() -> None:
        allocator = FreeListAllocator(8 * MiB, pin=False)
        only = DictTier(allocator=allocator)
        only.failing = True
        store = Store(tiers=[only], allocator=allocator)
        obj = chunk(allocator, 1.0)
        with pytest.raises(BackendUnavailable, match="dict tier is down"):
            await store.put(key(1), obj)
        assert store.stats()["tiers"][store.tier_names[0]]["errors_by_op"]["batched_put"] == 1
        obj.release()
        await store.close()

    asyncio.run(main())


# -- never an older value after a newer one -----------------------------------------------------


def test_an_overwrite_the_lower_tier_could_not_take_removes_its_older_value() -> None:
    async def main() -> None:
        store, fast, slow = await counting_store(write_behind_size=1 * MiB)
        old = chunk(store.budget, 1.0)
        await store.put(key(1), old)
        old.release()
        await store.flush()
        slow.put_gate = asyncio.Event()
        blocker = chunk(store.budget, 0.0)
        await store.put(key(2), blocker)  # fills the write-behind
        blocker.release()
        new = chunk(store.budget, 2.0)
        await store.put(key(1), new)  # the lower tier cannot take it now
        new.release()
        await fast.remove(key(1))  # the first tier forgets the newer value
        assert await store.get(key(1)) is None, "the lower tier's older value was served"
        assert not await store.contains(key(1))
        slow.put_gate.set()
        await store.flush()
        assert await store.get(key(1)) is None and str(key(1)) not in slow.values
        await store.close()

    asyncio.run(main())


def test_a_remove_during_a_lower_tier_write_is_not_undone_by_that_write() -> None:
    async def main() -> None:
        store, _fast, slow = await counting_store()
        slow.put_gate = asyncio.Event()
        obj = chunk(store.budget, 4.0)
        await store.put(key(1), obj)
        obj.release()
        await asyncio.sleep(0.05)  # the lower tier's worker has taken the write
        assert slow.of("put") == [[1]]
        assert await store.remove(key(1)) is True
        assert await store.get(key(1)) is None
        slow.put_gate.set()
        await store.flush()
        assert str(key(1)) not in slow.values and await store.get(key(1)) is None
        await store.close()

    asyncio.run(main())


def test_a_lower_tier_hit_is_not_written_back_over_a_put_made_during_the_read() -> None:
    async def main() -> None:
        store, fast, slow = await counting_store()
        old = chunk(store.budget, 1.0)
        await slow.put(key(1), old)
        old.release()
        slow.gate = asyncio.Event()
        reader = asyncio.create_task(store.get(key(1)))
        await asyncio.sleep(0.05)
        new = chunk(store.budget, 2.0)
        await store.put(key(1), new)
        new.release()
        slow.gate.set()
        got = await reader
        assert value_of(got) in (1.0, 2.0)
        if got is not None:
            got.release()
        await store.flush()
        latest = await store.get(key(1))
        assert value_of(latest) == 2.0
        assert value_of(await fast.get(key(1))) == 2.0
        if latest is not None:
            latest.release()
        await store.close()

    asyncio.run(main())


def test_a_first_tier_that_refuses_a_newer_value_drops_its_older_one() -> None:
    async def main() -> None:
        store, fast, _slow = await counting_store()
        old = chunk(store.budget, 1.0)
        await store.put(key(1), old)
        old.release()
        await store.flush()
        fast.refuse_puts = True
        new = chunk(store.budget, 2.0)
        await store.put(key(1), new)  # accepted: queued for the lower tier
        new.release()
        for _ in range(2):
            assert await value_read(store, key(1)) == 2.0
            await store.flush()
        assert str(key(1)) not in fast.values
        await store.close()

    asyncio.run(main())


# -- a Backend ----------------------------------------------------------------------------------


def config_file(tmp_path: Path, tiers: list[str]) -> Path:
    path = tmp_path / "tiers.yaml"
    path.write_text(yaml.safe_dump({"tiers": tiers}))
    return path


def test_a_store_opens_by_url_is_wrapped_by_audit_and_nests_as_a_tier(tmp_path: Path) -> None:
    inner = config_file(tmp_path, ["cpu://?max_size=16MiB", f"file://{tmp_path}/disk"])

    async def main() -> None:
        audited = await kvplug.open_backend(f"audit::store://{inner}")
        store = audited.inner  # type: ignore[attr-defined]
        assert isinstance(store, Store) and isinstance(store, Backend)
        obj = store.allocate(CHUNK, torch.float16)
        assert obj is not None
        obj.tensor.fill_(6.0)
        await audited.put(key(1), obj)
        obj.release()
        assert await value_read(audited, key(1)) == 6.0
        assert audited.stats()["get"] == {"hit": 1}  # type: ignore[attr-defined]
        await audited.close()
        outer = await open_store(Config.from_dict({"tiers": [f"store://{inner}"]}))
        assert await value_read(outer, key(1)) == 6.0  # the inner store's disk tier kept it
        await outer.close()

    asyncio.run(main())


def test_a_sync_client_takes_an_opened_store(tmp_path: Path) -> None:
    path = config_file(tmp_path, ["cpu://?max_size=16MiB"])
    with SyncClient(f"store://{path}") as client:
        assert isinstance(client.backend, Store)
        obj = MemoryObj.from_tensor(torch.full((64,), 2.0))
        client.batched_put([key(1), key(2)], [obj, obj]).result(10)
        got = client.batched_get([key(1), key(2), key(3)]).result(10)
        assert [value_of(o) for o in got] == [2.0, 2.0, None]
        for o in got:
            if o is not None:
                o.release()
        assert client.prefetch([key(1), key(2), key(3)]).result(10) == 2


def test_bad_store_urls_and_configs_say_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(kvplug.InvalidBackendURL, match=r"store:///path/to/config\.yaml"):
        Store("store://host:1/x.yaml")
    with pytest.raises(ConfigError, match="not both"):
        Store(f"store://{tmp_path}/x.yaml", tiers=[DictTier()])

    async def open_missing() -> None:
        await kvplug.open_backend(f"store://{tmp_path}/missing.yaml")

    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        asyncio.run(open_missing())


def test_a_store_serves_other_loops_on_its_own_while_it_runs_and_refuses_them_after() -> None:
    allocator = FreeListAllocator(8 * MiB, pin=False)
    store = Store(tiers=[DictTier(allocator=allocator)], allocator=allocator)
    obj = small(allocator, 3.0)

    async def round_trip() -> float:
        await store.put(key(1), obj)
        got = await store.get(key(1))
        assert got is not None
        try:
            return float(got.tensor.sum())
        finally:
            got.release()

    with loop_thread() as home:
        first = asyncio.run_coroutine_threadsafe(round_trip(), home).result(10)
        assert asyncio.run(round_trip()) == first  # another loop, served on the store's own
        with pytest.raises(KvplugError, match=r"offer, flush, .* only from that one"):
            asyncio.run(store.offer([key(2)], [obj]))
    with pytest.raises(BackendUnavailable, match="belongs to an event loop that is no longer"):
        asyncio.run(round_trip())
    obj.release()


# -- never an older value: random schedules -----------------------------------------------------

OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 3)),
        st.tuples(st.just("remove"), st.integers(0, 3)),
        st.tuples(st.just("get"), st.integers(0, 3)),
        st.tuples(st.just("evict"), st.integers(0, 3)),
        st.tuples(st.just("hold"), st.booleans()),
        st.tuples(st.just("fail"), st.booleans()),
        st.tuples(st.just("run"), st.integers(1, 5)),
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=OPERATIONS)
def test_a_get_returns_the_latest_accepted_value_or_a_miss_never_an_older_one(
    operations: list[tuple[str, Any]],
) -> None:
    """Puts, removes, first-tier evictions, a lower tier that stalls or fails, and a
    write-behind with room for one object, in any order: every get answers the value of the
    latest accepted put of its key, or misses; never an older value, never a removed one."""

    async def main() -> None:
        store, fast, slow = await counting_store(write_behind_size=1 * MiB, backoff=0.001)
        latest: dict[int, float | None] = {}
        version = 0.0

        async def check(n: int, when: str) -> None:
            got = await store.get(key(n))
            seen = value_of(got)
            if got is not None:
                got.release()
            assert seen is None or seen == latest.get(n), (
                f"{when}: key {n} read {seen}, the latest accepted value is {latest.get(n)}"
            )

        for op, arg in operations:
            if op == "put":
                version += 1
                obj = chunk(store.budget, version)
                if all(await store.offer([key(arg)], [obj])):
                    latest[arg] = version
                obj.release()
            elif op == "remove":
                with contextlib.suppress(BackendUnavailable):
                    await store.remove(key(arg))
                    latest[arg] = None
            elif op == "get":
                await check(arg, "during the run")
            elif op == "evict":
                await fast.remove(key(arg))
            elif op == "hold":
                if arg:
                    slow.put_gate = slow.put_gate or asyncio.Event()
                elif slow.put_gate is not None:
                    slow.put_gate.set()
                    slow.put_gate = None
            elif op == "fail":
                slow.failing = arg
            else:
                for _ in range(arg):
                    await asyncio.sleep(0.002)
        if slow.put_gate is not None:
            slow.put_gate.set()
        slow.failing = False
        await asyncio.sleep(0.01)  # past the back-off
        await asyncio.wait_for(store.flush(), 10)
        for n in range(4):
            await check(n, "after the queues drained")
            await fast.remove(key(n))
            await check(n, "from the lower tier alone")
        await store.close()
        assert store.budget.stats().used == 0

    asyncio.run(main())


# -- races found in review: reads, puts, removes and close overlapping ---------------------------


class SlowCpu(CpuBackend):
    """A host-memory tier whose batched reads and writes take a few milliseconds."""

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        await asyncio.sleep(0.01)
        return await super()._batched_get(keys)

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        await asyncio.sleep(0.01)
        await super()._batched_put(keys, objs)


class CopyingCpu(CpuBackend):
    """A host-memory tier that declares no zero-copy, as a disk tier would not."""

    capabilities = dataclasses.replace(CpuBackend.capabilities, zero_copy=False)


def small(allocator: kvplug.Allocator, value: float) -> MemoryObj:
    obj = allocator.allocate((1024,), torch.float16)
    assert obj is not None
    obj.tensor.fill_(value)
    return obj


async def opened(*tiers: CpuBackend) -> list[CpuBackend]:
    for tier in tiers:
        await tier.open()
    return list(tiers)


@pytest.mark.parametrize("reader_first", [True, False])
def test_a_read_overlapping_a_put_never_writes_the_older_value_back(reader_first: bool) -> None:
    async def main() -> None:
        first, lower = await opened(
            CpuBackend("cpu://?max_size=1MiB"), SlowCpu("cpu://?max_size=1MiB")
        )
        store = Store(tiers=[first, lower])
        old = small(lower.allocator, 1.0)
        await lower.put(key(1), old)
        old.release()
        new = small(store.budget, 2.0)

        async def read() -> None:
            got = await store.get(key(1))
            assert value_of(got) in (1.0, 2.0)
            if got is not None:
                got.release()

        tasks = [store.put(key(1), new), read()]
        await asyncio.gather(*(reversed(tasks) if reader_first else tasks))
        new.release()
        await store.flush(5)
        got = await store.get(key(1))
        assert value_of(got) == 2.0, "the older value was written back over the put"
        assert got is not None
        got.release()
        await store.close()

    asyncio.run(main())


def test_a_write_back_never_revives_a_key_removed_while_it_ran() -> None:
    async def main() -> None:
        tiers = await opened(
            CpuBackend("cpu://?max_size=1MiB"),
            CopyingCpu("cpu://?max_size=1MiB"),
            SlowCpu("cpu://?max_size=1MiB"),
        )
        removal: list[asyncio.Task[bool]] = []

        def on_latency(tier: str, op: str, seconds: float, nbytes: int) -> None:
            if tier.startswith("2:") and op == "get" and not removal:
                removal.append(asyncio.get_running_loop().create_task(store.remove(key(1))))

        store = Store(tiers=tiers, on_latency=on_latency)
        old = small(tiers[2].allocator, 1.0)
        await tiers[2].put(key(1), old)
        old.release()
        assert await value_read(store, key(1)) == 1.0
        assert await removal[0] is True
        assert await store.get(key(1)) is None
        await store.flush(5)
        assert await store.get(key(1)) is None
        await store.close()

    asyncio.run(main())


def test_a_first_tier_that_copies_keeps_the_newest_value_after_a_write_back() -> None:
    async def main() -> None:
        first, lower = await opened(
            CopyingCpu("cpu://?max_size=1MiB"), CpuBackend("cpu://?max_size=1MiB")
        )
        store = Store(tiers=[first, lower])
        old = small(lower.allocator, 1.0)
        await lower.put(key(1), old)
        old.release()
        got = await store.get(key(1))
        assert got is not None
        got.release()
        new = small(store.budget, 2.0)
        await store.put(key(1), new)
        new.release()
        await store.flush(5)
        for tier in (None, first):
            got = await (store.get(key(1)) if tier is None else tier.get(key(1)))
            assert value_of(got) == 2.0
            assert got is not None
            got.release()
        await store.close()

    asyncio.run(main())


def test_a_read_in_flight_when_the_store_closes_leaves_no_worker_and_no_entry() -> None:
    removes: list[CacheKey] = []

    class CountingRemoves(CopyingCpu):
        async def _remove(self, key: CacheKey) -> bool:
            removes.append(key)
            return await super()._remove(key)

    async def main() -> None:
        first, lower = await opened(
            CountingRemoves("cpu://?max_size=1MiB"), SlowCpu("cpu://?max_size=1MiB")
        )
        store = Store(tiers=[first, lower])
        old = small(lower.allocator, 1.0)
        await lower.put(key(1), old)
        old.release()
        reader = asyncio.ensure_future(store.get(key(1)))
        await asyncio.sleep(0)
        await store.close()
        try:
            got = await reader
        except kvplug.BackendClosed:
            got = None
        if got is not None:
            got.release()
        await asyncio.sleep(0.2)
        assert not len(store._ledger) and store._ledger.queued_bytes == 0
        assert not any(t.worker is not None and not t.worker.done() for t in store._tiers)
        assert len(removes) <= 1

    asyncio.run(main())


@pytest.mark.parametrize("released_after", [0.2, None])
def test_write_behind_wait_holds_a_put_for_room_up_to_its_limit(
    released_after: float | None,
) -> None:
    """With ``write_behind_wait`` a put waits for the write-behind to drain (the engine is
    throttled, the lower tier gets every chunk); past the wait it is dropped as usual."""

    async def main() -> None:
        store, _fast, slow = await counting_store(write_behind_size=1 * MiB, write_behind_wait=1.0)
        slow.put_gate = asyncio.Event()
        first, second = chunk(store.budget, 1.0), chunk(store.budget, 2.0)
        await store.put(key(1), first)
        if released_after is not None:
            asyncio.get_running_loop().call_later(released_after, slow.put_gate.set)
        start = time.monotonic()
        await store.put(key(2), second)
        waited = time.monotonic() - start
        dropped = store.stats()["tiers"][store.tier_names[1]]["dropped_by_reason"]
        if released_after is None:
            assert 0.9 <= waited < 5.0 and dropped["write_behind_full"] == 1
            slow.put_gate.set()
        else:
            assert 0.15 <= waited < 0.9 and dropped["write_behind_full"] == 0
        await store.flush(5)
        assert sorted(slow.values) == sorted(
            str(key(n)) for n in ((1, 2) if released_after is not None else (1,))
        )
        for obj in (first, second):
            obj.release()
        await store.close()

    asyncio.run(main())


def test_flush_does_not_wait_for_a_failing_tier_and_its_removals_run_when_it_is_back() -> None:
    async def main() -> None:
        store, fast, slow = await counting_store(backoff=0.2)
        old = chunk(store.budget, 1.0)
        await store.put(key(1), old)
        old.release()
        await store.flush(5)
        slow.failing = True
        new = chunk(store.budget, 2.0)
        await store.put(key(1), new)  # the lower tier fails it: its older value must go
        new.release()
        start = time.monotonic()
        await store.flush(5)
        assert time.monotonic() - start < 2.0, "flush waited for a failing tier"
        assert store.stats()["write_behind"]["queued_removals"] == 1
        assert str(key(1)) in slow.values  # the older value, skipped by reads meanwhile
        await fast.remove(key(1))
        assert await store.get(key(1)) is None
        slow.failing = False
        for _ in range(100):
            await asyncio.sleep(0.05)
            if str(key(1)) not in slow.values:
                break
        assert str(key(1)) not in slow.values, "the removal never ran once the tier was back"
        assert store.stats()["write_behind"]["queued_removals"] == 0
        await store.close()

    asyncio.run(main())


def test_a_second_remove_is_false_while_the_lower_tier_still_finishes_the_first() -> None:
    """A remove right after a put whose lower-tier write is in flight: the write lands after
    the tier's remove, its removal is queued; a second remove must still say False."""

    async def main() -> None:
        store, _fast, slow = await counting_store()
        slow.put_gate = asyncio.Event()
        obj = chunk(store.budget, 1.0)
        await store.put(key(1), obj)
        obj.release()
        await asyncio.sleep(0.05)  # the lower tier's worker holds the write
        assert await store.remove(key(1)) is True
        slow.put_gate.set()
        await asyncio.sleep(0)  # the write lands in the lower tier, its removal is queued
        assert await store.remove(key(1)) is False
        assert await store.get(key(1)) is None
        await store.flush(5)
        assert str(key(1)) not in slow.values
        await store.close()

    asyncio.run(main())
