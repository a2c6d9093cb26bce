"""Per-tenant byte quotas in the size-capped tiers with real objects: cpu:// (copied and
zero-copy puts), file:// (files, a reopen) and a Store opened from a tiers YAML. The flood
test: one tenant floods while another reads its working set, which fits its quota, each time
after the flood has put as much as the whole tier holds (so that without quotas LRU would have
evicted all of it); every one of those reads hits, counted exactly."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

import kvplug
from kvplug import CacheKey, CapacityExceeded, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.quotas import OTHER_TENANTS, UNTENANTED
from kvplug.runtime.config import Config
from kvplug.runtime.metrics import prometheus
from kvplug.runtime.store import Store, open_store
from kvplug_cpu.backend import CpuBackend
from kvplug_disk.backend import DiskBackend
from kvplug_disk.layout import file_length

T = TypeVar("T")
KiB = 1024
CHUNK = 4 * KiB
"""Every object of these tests: one 4 KiB allocator block (a cpu tier counts blocks)."""
WORKING_SET = 8
"""Tenant b's keys, read again and again; 8 chunks fit its quota."""


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def key(tenant: str, i: int) -> CacheKey:
    plain = CacheKey("llama", 1, 0, i)
    return plain.with_tenant(tenant) if tenant else plain


def foreign(value: int) -> MemoryObj:
    """A caller-owned object (no allocator): a cpu tier stores a copy of it."""
    return MemoryObj.from_tensor(torch.full((CHUNK,), value, dtype=torch.uint8))


def in_allocator(allocate: Callable[..., MemoryObj | None], value: int) -> MemoryObj:
    obj = allocate((CHUNK,), torch.uint8, MemoryFormat.BINARY_BUFFER)
    assert obj is not None, "no room for an object"
    obj.raw.fill_(value)
    return obj


async def put_one(tier: kvplug.Backend, k: CacheKey, obj: MemoryObj) -> None:
    try:
        await tier.put(k, obj)
    finally:
        obj.release()


async def reads_that_hit(tier: kvplug.Backend, keys: list[CacheKey]) -> int:
    hits = 0
    for k in keys:
        got = await tier.get(k)
        if got is not None:
            assert int(got.raw[0]) == k.chunk_hash % 256
            hits += 1
            got.release()
    return hits


async def flood(
    tier: kvplug.Backend, make: Callable[[int], MemoryObj], floods: int, read_every: int
) -> int:
    """Tenant b stores its working set, then team-a puts ``floods`` chunks while b reads its
    whole working set after every ``read_every`` of them; how many of b's reads hit."""
    b_keys = [key("team-b", i) for i in range(WORKING_SET)]
    for k in b_keys:
        await put_one(tier, k, make(k.chunk_hash))
    hits = 0
    for i in range(floods):
        await put_one(tier, key("team-a", 1000 + i), make(i))
        if i % read_every == read_every - 1:
            hits += await reads_that_hit(tier, b_keys)
    return hits


def b_within_quota(quota: int, reads: int) -> dict[str, int | None]:
    """Tenant b's counters after :func:`flood`: everything read hit, nothing evicted."""
    return {
        "quota": quota,
        "bytes_held": WORKING_SET * CHUNK,
        "objects": WORKING_SET,
        "hits": reads,
        "misses": 0,
        "evictions": 0,
        "refused": 0,
    }


# -- cpu:// -------------------------------------------------------------------------------------


CPU_CHUNKS = 64
"""What a cpu tier of 256 KiB holds."""
QUOTAS = {
    # b's working set fits its quota; team-a has none, so it takes what is left
    "a-without-quota": ("team-b:64KiB", 64 * KiB, OTHER_TENANTS),
    # quotas that add up to more than the tier: a fills it within its quota, and then its
    # own chunks must go, not b's, though b is nearer its quota than a
    "overcommitted": ("team-a:240KiB,team-b:40KiB", 40 * KiB, "team-a"),
}


@pytest.mark.parametrize("quotas", sorted(QUOTAS))
@pytest.mark.parametrize("copied", [True, False], ids=["copied", "zero-copy"])
def test_cpu_a_flooding_tenant_evicts_only_its_own_chunks(copied: bool, quotas: str) -> None:
    spec, b_quota, a_name = QUOTAS[quotas]

    async def main() -> None:
        cpu = await kvplug.open_backend(f"cpu://?max_size=256KiB&tenant_quotas={spec}")
        assert isinstance(cpu, CpuBackend)

        def make(value: int) -> MemoryObj:
            return foreign(value % 256) if copied else in_allocator(cpu.allocate, value % 256)

        try:
            hits = await flood(cpu, make, 8 * CPU_CHUNKS, CPU_CHUNKS)
            stats = cpu.tenant_stats()
        finally:
            await cpu.close()
        reads = 8 * WORKING_SET
        assert hits == reads
        assert stats["team-b"] == b_within_quota(b_quota, reads)
        room_for_a = CPU_CHUNKS - WORKING_SET
        assert stats[a_name]["evictions"] == 8 * CPU_CHUNKS - room_for_a
        assert stats[a_name]["bytes_held"] == room_for_a * CHUNK
        assert stats[UNTENANTED]["objects"] == 0

    run(main())


def test_cpu_without_quotas_the_same_flood_evicts_every_chunk_of_the_other_tenant() -> None:
    async def main() -> None:
        cpu = await kvplug.open_backend("cpu://?max_size=256KiB")
        try:
            hits = await flood(cpu, lambda value: foreign(value % 256), 8 * CPU_CHUNKS, CPU_CHUNKS)
        finally:
            await cpu.close()
        assert hits == 0

    run(main())


def test_cpu_a_flooding_tenant_with_a_quota_stays_within_it() -> None:
    async def main() -> None:
        cpu = await kvplug.open_backend(
            "cpu://?max_size=256KiB&tenant_quotas=team-a:32KiB,team-b:64KiB"
        )
        assert isinstance(cpu, CpuBackend)
        try:
            hits = await flood(cpu, lambda value: foreign(value % 256), 200, 8)
            stats = cpu.tenant_stats()
            assert cpu.stats()["bytes_held"] == (8 + WORKING_SET) * CHUNK
        finally:
            await cpu.close()
        assert hits == WORKING_SET * 200 // 8
        assert stats["team-b"] == b_within_quota(64 * KiB, hits)
        assert stats["team-a"] | {"hits": 0} == {
            "quota": 32 * KiB,
            "bytes_held": 32 * KiB,
            "objects": 8,
            "hits": 0,
            "misses": 0,
            "evictions": 200 - 8,
            "refused": 0,
        }

    run(main())


def test_cpu_a_put_over_the_quota_is_refused_naming_the_tenant_and_the_others_stay() -> None:
    async def main() -> None:
        cpu = await kvplug.open_backend("cpu://?max_size=64KiB&tenant_quotas=team-a:8KiB")
        assert isinstance(cpu, CpuBackend)
        try:
            await put_one(cpu, key("", 1), foreign(1))
            big = MemoryObj.from_tensor(torch.ones(12 * KiB, dtype=torch.uint8))
            with pytest.raises(CapacityExceeded) as refused:
                await cpu.put(key("team-a", 2), big)
            assert "larger than tenant 'team-a''s quota of 8192 bytes" in str(refused.value)
            assert "tenant_quotas" in str(refused.value)

            await put_one(cpu, key("team-a", 3), foreign(3))
            await put_one(cpu, key("team-a", 4), foreign(4))
            assert await cpu.pin(key("team-a", 3)) and await cpu.pin(key("team-a", 4))
            with pytest.raises(CapacityExceeded, match="tenant 'team-a' holds 8192 bytes"):
                await cpu.put(key("team-a", 5), foreign(5))
            with pytest.raises(CapacityExceeded, match="tenant 'team-a' holds 8192 bytes"):
                await cpu.put(key("team-a", 5), in_allocator(cpu.allocate, 5))
            assert sorted(k.chunk_hash for k in [k async for k in cpu.list_keys()]) == [1, 3, 4]
            stats = cpu.tenant_stats()
        finally:
            await cpu.close()
        assert stats["team-a"]["refused"] == 3
        assert stats[UNTENANTED]["bytes_held"] == CHUNK

    run(main())


def test_cpu_without_quotas_counts_nothing_per_tenant() -> None:
    async def main() -> None:
        cpu = await kvplug.open_backend("cpu://?max_size=64KiB")
        assert isinstance(cpu, CpuBackend)
        await put_one(cpu, key("team-a", 1), foreign(1))
        assert cpu.tenant_stats() == {}
        await cpu.close()

    run(main())


# -- file:// ------------------------------------------------------------------------------------


async def open_disk(root: Path, allocator: FreeListAllocator, query: str) -> DiskBackend:
    disk = await kvplug.open_backend(f"file://{root}?{query}", allocator=allocator)
    assert isinstance(disk, DiskBackend)
    return disk


def test_disk_a_flooding_tenant_evicts_only_its_own_files_and_a_reopen_counts_them(
    tmp_path: Path,
) -> None:
    length = file_length(CHUNK)
    files = 32
    # overcommitted: a may fill the tier within its quota, and must then evict its own files
    quotas = f"team-a:{30 * length},team-b:{10 * length}"
    query = f"max_size={files * length}&tenant_quotas={quotas}"

    async def main() -> None:
        allocator = FreeListAllocator(4 << 20, pin=False)
        disk = await open_disk(tmp_path / "kv", allocator, query)
        try:
            hits = await flood(
                disk, lambda value: in_allocator(allocator.allocate, value % 256), 3 * files, files
            )
            assert await disk.get(key("team-b", 999)) is None
            stats = disk.tenant_stats()
        finally:
            await disk.close()
        reads = 3 * WORKING_SET
        assert hits == reads
        assert stats["team-b"] | {"bytes_held": None, "misses": 0} == b_within_quota(
            10 * length, reads
        ) | {"bytes_held": None}
        assert stats["team-b"]["bytes_held"] == WORKING_SET * length
        assert stats["team-b"]["misses"] == 1
        room_for_a = files - WORKING_SET
        assert stats["team-a"]["evictions"] == 3 * files - room_for_a

        again = await open_disk(tmp_path / "kv", allocator, query)
        try:
            found = again.tenant_stats()
            assert await reads_that_hit(again, [key("team-b", i) for i in range(WORKING_SET)]) == (
                WORKING_SET
            )
        finally:
            await again.close()
        assert (found["team-b"]["objects"], found["team-a"]["objects"]) == (
            WORKING_SET,
            room_for_a,
        )
        assert found["team-b"]["bytes_held"] == WORKING_SET * length
        assert allocator.stats().used == 0

    run(main())


def test_disk_a_put_over_the_quota_is_refused_naming_the_tenant(tmp_path: Path) -> None:
    length = file_length(CHUNK)

    async def main() -> None:
        allocator = FreeListAllocator(1 << 20, pin=False)
        disk = await open_disk(
            tmp_path / "kv", allocator, f"max_size={8 * length}&tenant_quotas=team-a:{length}"
        )
        try:
            await put_one(disk, key("team-a", 1), in_allocator(allocator.allocate, 1))
            assert await disk.pin(key("team-a", 1))
            with pytest.raises(CapacityExceeded, match=f"tenant 'team-a' holds {length} bytes"):
                await put_one(disk, key("team-a", 2), in_allocator(allocator.allocate, 2))
            await disk.unpin(key("team-a", 1))
            await put_one(disk, key("team-a", 2), in_allocator(allocator.allocate, 2))
            assert [k.chunk_hash async for k in disk.list_keys()] == [2]
            stats = disk.tenant_stats()["team-a"]
        finally:
            await disk.close()
        assert (stats["refused"], stats["evictions"], stats["objects"]) == (1, 1, 1)

    run(main())


# -- a Store from a tiers YAML ---------------------------------------------------------------------

YAML_FORMS = {
    "mapping": """
tiers:
  - url: cpu://
    max_size: 256KiB
    tenant_quotas: {team-a: 240KiB, team-b: 40KiB}
""",
    "url": """
tiers:
  - cpu://?max_size=256KiB&tenant_quotas=team-b:64KiB
""",
}
YAML_QUOTAS = {"mapping": QUOTAS["overcommitted"], "url": QUOTAS["a-without-quota"]}


@pytest.mark.parametrize("form", sorted(YAML_FORMS))
def test_a_store_from_a_tiers_yaml_keeps_a_tenants_hit_rate_while_another_floods(
    tmp_path: Path, form: str
) -> None:
    config_file = tmp_path / "tiers.yaml"
    config_file.write_text(YAML_FORMS[form])
    _, b_quota, a_name = YAML_QUOTAS[form]

    async def main() -> None:
        store = await open_store(config_file)
        name = store.tier_names[0]

        def make(value: int) -> MemoryObj:
            return in_allocator(store.allocate, value % 256)

        try:
            hits = await flood(store, make, 8 * CPU_CHUNKS, CPU_CHUNKS)
            await store.flush()
            tenants = store.stats()["tiers"][name]["tenants"]
            value = store.metrics.value
            series = (
                value("kvplug_tier_tenant_hits_total", tier=name, tenant="team-b"),
                value("kvplug_tier_tenant_evictions_total", tier=name, tenant="team-b"),
                value("kvplug_tier_tenant_bytes", tier=name, tenant="team-b"),
                value("kvplug_tier_tenant_quota_bytes", tier=name, tenant="team-b"),
                value("kvplug_tier_tenant_evictions_total", tier=name, tenant=a_name),
            )
            text = store.prometheus_text() if prometheus() is not None else None
        finally:
            await store.close()
        reads = 8 * WORKING_SET
        evicted = 8 * CPU_CHUNKS - (CPU_CHUNKS - WORKING_SET)
        assert hits == reads
        assert tenants["team-b"] == b_within_quota(b_quota, reads)
        assert tenants[a_name]["evictions"] == evicted
        assert series == (reads, 0, WORKING_SET * CHUNK, b_quota, evicted)
        if text is not None:
            labels = f'tenant="team-b",tier="{name}"'
            assert f"kvplug_tier_tenant_hits_total{{{labels}}} {float(reads)}" in text
            assert f"kvplug_tier_tenant_evictions_total{{{labels}}} 0.0" in text
            assert f'kvplug_tier_tenant_objects{{tenant="(none)",tier="{name}"}} 0.0' in text
            assert 'kvplug_tier_tenant_quota_bytes{tenant="(none)"' not in text

    run(main())


def test_a_store_without_quotas_reports_no_tenants() -> None:
    async def main() -> None:
        store = Store(tiers=[await kvplug.open_backend("cpu://?max_size=64KiB")])
        await put_one(store, key("team-a", 1), in_allocator(store.allocate, 1))
        assert "tenants" not in store.stats()["tiers"][store.tier_names[0]]
        assert store.metrics.value("kvplug_tier_tenant_bytes", tier="0:cpu://", tenant="x") == 0
        await store.close()

    run(main())


def test_the_tiers_yaml_keeps_the_quotas_for_the_tier_to_check() -> None:
    config = Config.from_yaml(YAML_FORMS["mapping"])
    assert dict(config.tiers[0].options)["tenant_quotas"] == {
        "team-a": "240KiB",
        "team-b": "40KiB",
    }
    bad = Config.from_yaml(YAML_FORMS["mapping"].replace("40KiB", "1TiB"))

    async def main() -> None:
        with pytest.raises(kvplug.ConfigError, match="larger than the tier's max_size"):
            await open_store(bad)

    run(main())
