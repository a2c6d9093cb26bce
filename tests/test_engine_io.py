"""``kvplug.runtime.engine.EngineIO``, what every engine integration moves chunks with: never a
report while kvplug can touch the engine's buffer, a deadline that holds, the bytes of the
submit and nothing later, and no false miss for want of kvplug's memory."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from test_store import DictTier

import kvplug
from kvplug import BackendTimeout, CacheKey, Capabilities, FreeListAllocator, MemoryObj
from kvplug.backend import Buffer
from kvplug.runtime.config import Config
from kvplug.runtime.engine import EngineIO, keeps_objects, lends_for_load, lends_for_store
from kvplug.runtime.store import Store, open_store

MiB = 1 << 20


def key(n: int) -> CacheKey:
    return CacheKey("engine-io-test", 1, 0, n)


def engine_buffer(value: int, nbytes: int = MiB) -> tuple[torch.Tensor, MemoryObj]:
    """An engine's own buffer and the view of it an integration hands kvplug."""
    data = torch.full((nbytes,), value, dtype=torch.uint8)
    return data, MemoryObj.from_tensor(data)


class GatedTier(DictTier):
    """A byte store whose puts and gets wait at gates; it lets go on cancellation (its work
    happens on the event loop, and a cancelled wait touches nothing)."""

    capabilities = Capabilities(remove=True, list_keys=True, releases_on_cancel=True)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.put_gate = asyncio.Event()
        self.put_gate.set()
        self.get_gate = asyncio.Event()
        self.get_gate.set()

    async def put_bytes(self, name: str, parts: Sequence[Buffer]) -> None:
        await self.put_gate.wait()
        await super().put_bytes(name, parts)

    async def get_bytes(self, name: str) -> Buffer | None:
        await self.get_gate.wait()
        return await super().get_bytes(name)


class HoldsTooLong(GatedTier):
    """Declares releases_on_cancel but keeps the caller's object after a cancellation."""

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        for obj in objs:
            obj.retain()
        try:
            await super()._batched_put(keys, objs)
        except asyncio.CancelledError:
            for obj in objs:
                asyncio.get_running_loop().call_later(0.3, obj.release)
            raise
        for obj in objs:
            obj.release()


class ThreadedTier(DictTier):
    """Does not declare releases_on_cancel: EngineIO must copy for it."""


def test_a_store_past_its_deadline_fails_at_once_and_a_later_rewrite_never_lands() -> None:
    async def main() -> None:
        tier = ThreadedTier(allocator=FreeListAllocator(16 * MiB, pin=False))
        tier.gate = asyncio.Event()  # every operation of the tier waits
        io = EngineIO(tier, timeout=0.3, what="a test on dict://")
        assert not io.lends_stores
        data, view = engine_buffer(1)
        start = time.perf_counter()
        with pytest.raises(BackendTimeout, match=r"task_timeout=0\.3"):
            await io.store([key(1)], [view])
        assert time.perf_counter() - start < 1.0
        assert view.ref_count == 1
        data.fill_(2)  # the engine reuses its buffer right after the failure report
        tier.gate.set()
        await asyncio.sleep(0.05)
        got = await tier.get(key(1))
        assert got is None or bool((got.raw == 1).all()), "the engine's later bytes landed"
        if got is not None:
            got.release()
        await tier.close()

    asyncio.run(main())


def test_a_load_past_its_deadline_never_writes_the_engines_buffer_afterwards() -> None:
    async def main() -> None:
        tier = ThreadedTier(allocator=FreeListAllocator(16 * MiB, pin=False))
        _, source = engine_buffer(7)
        await tier.put(key(1), source)
        tier.gate = asyncio.Event()
        io = EngineIO(tier, timeout=0.3, what="a test on dict://")
        assert not io.lends_loads
        data, view = engine_buffer(0)
        with pytest.raises(BackendTimeout):
            await io.load([key(1)], [view])
        assert view.ref_count == 1
        data.fill_(9)  # the engine hands the buffer to another request
        tier.gate.set()
        await asyncio.sleep(0.05)
        assert bool((data == 9).all()), "a late read wrote into the engine's buffer"
        await tier.close()

    asyncio.run(main())


def test_a_lending_backend_is_lent_the_buffer_and_lets_go_on_the_deadline() -> None:
    async def main() -> None:
        tier = GatedTier(allocator=FreeListAllocator(16 * MiB, pin=False))
        io = EngineIO(tier, timeout=0.3, what="a test on dict://")
        assert io.lends_stores and io.lends_loads
        data, view = engine_buffer(3)
        tier.put_gate.clear()
        with pytest.raises(BackendTimeout):
            await io.store([key(1)], [view])
        assert view.ref_count == 1
        data.fill_(4)
        tier.put_gate.set()
        await asyncio.sleep(0.05)
        assert await tier.get(key(1)) is None  # the cancelled put stored nothing
        await io.store([key(2)], [view])
        out, dest = engine_buffer(0)
        assert await io.load([key(2), key(3)], [dest, engine_buffer(0)[1]]) == [True, False]
        assert bool((out == 4).all())
        await tier.close()

    asyncio.run(main())


def test_a_backend_that_keeps_the_buffer_despite_its_claim_is_waited_for_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> float:
        tier = HoldsTooLong(allocator=FreeListAllocator(16 * MiB, pin=False))
        io = EngineIO(tier, timeout=0.2, what="a test on dict://")
        _, view = engine_buffer(5)
        tier.put_gate.clear()
        start = time.perf_counter()
        with pytest.raises(BackendTimeout):
            await io.store([key(1)], [view])
        elapsed = time.perf_counter() - start
        assert view.ref_count == 1, "reported while the backend still held the buffer"
        await tier.close()
        return elapsed

    with caplog.at_level(logging.ERROR, logger="kvplug.integration"):
        assert asyncio.run(main()) >= 0.45
    assert any("declares releases_on_cancel" in r.getMessage() for r in caplog.records)


def test_a_full_budget_never_turns_a_load_into_a_miss(tmp_path: Path) -> None:
    async def main() -> None:
        config = Config.from_dict(
            {"tiers": [{"url": "cpu://", "max_size": "8MiB"}, f"file://{tmp_path}"]}
        )
        store = await open_store(config, promote=False)
        _, source = engine_buffer(6)
        await store.tiers[1].put(key(1), source)
        held = []
        while (obj := store.allocate((MiB,), torch.uint8)) is not None:
            held.append(obj)
        io = EngineIO(store, timeout=2.0, what="a test on store://")
        data, view = engine_buffer(0)
        start = time.perf_counter()
        assert await io.load([key(1)], [view]) == [True]
        assert time.perf_counter() - start < 1.0
        assert bool((data == 6).all())
        for obj in held:
            obj.release()
        await store.close()

    asyncio.run(main())


def test_wrappers_are_seen_through_when_deciding_to_lend(tmp_path: Path) -> None:
    async def main() -> None:
        two = Config.from_dict(
            {"tiers": [{"url": "cpu://", "max_size": "8MiB"}, f"file://{tmp_path}/a"]}
        )
        store = await open_store(two)
        wrapped = await kvplug.open_backend("audit::blackhole://")
        config = tmp_path / "two.yaml"
        config.write_text(f"tiers:\n  - cpu://?max_size=8MiB\n  - file://{tmp_path}/b\n")
        audited_store = await kvplug.open_backend(f"audit::store://{config}")
        assert keeps_objects(store) and keeps_objects(audited_store)
        assert not lends_for_store(audited_store)
        assert not keeps_objects(wrapped)
        assert lends_for_load(store) == store.capabilities.releases_on_cancel
        for backend in (store, wrapped, audited_store):
            await backend.close()

    asyncio.run(main())


def test_a_single_tier_store_over_a_lending_tier_is_lent(tmp_path: Path) -> None:
    async def main() -> None:
        tier = GatedTier(allocator=FreeListAllocator(16 * MiB, pin=False))
        store = Store(tiers=[tier], allocator=tier.allocator)
        assert not keeps_objects(store) and lends_for_store(store) and lends_for_load(store)
        await store.close()

    asyncio.run(main())
