"""The engine boundary under ``KvplugHiCacheStorage``, over SGLang's own host pools.

SGLang frees or reuses the host pages of a ``batch_set_v1``/``batch_get_v1`` as soon as the call
returns, also when it reports failure. So when a store or load runs past ``task_timeout`` (a
paused redis-server, a stalled ``file://`` worker, a slow tier behind the audit wrapper) the call
reports failure within ``task_timeout`` plus a small margin, and from then on nothing of kvplug
touches those pages: a page SGLang rewrites right after the report keeps the rewrite, and every
later read of the key returns the bytes SGLang handed over, or a miss, never the rewrite.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from sglang.srt.mem_cache.pool_host import HostKVCache

import kvplug
from kvplug.backend import Backend, Capabilities
from kvplug.errors import CapacityExceeded
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.registry import reset_registry
from kvplug.runtime.engine import tiers_of
from kvplug_sglang import KvplugHiCacheStorage
from kvplug_testing import RedisServer
from kvplug_testing.stall import Stall, stall_disk
from kvplug_testing.threads import no_thread_left_behind

PAGE = 16
TASK_TIMEOUT = 1.0
MARGIN = 0.75
"""Seconds a failed call may take beyond task_timeout (measured: well under 0.1 s idle)."""
POOLS = [
    ("layer_first", False),
    ("page_first", False),
    ("page_first_direct", False),
    ("page_first", True),
    ("layer_first", True),
]
POOL_IDS = [f"{layout}-{'mla' if mla else 'mha'}" for layout, mla in POOLS]

PageBytes = Callable[[HostKVCache, int | torch.Tensor], torch.Tensor]
OpenStorage = Callable[..., KvplugHiCacheStorage]


def extra(url: str, **more: Any) -> dict[str, Any]:
    return {
        "backend_name": "kvplug",
        "module_path": "kvplug_sglang",
        "class_name": "KvplugHiCacheStorage",
        "interface_v1": 1,
        "url": url,
        "task_timeout": TASK_TIMEOUT,
        **more,
    }


def slots(*pages: int) -> torch.Tensor:
    """The host token slots of whole pages."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def keys_of(name: str, count: int) -> list[str]:
    return [f"{i:02x}{name.encode().hex()}" for i in range(count)]


LATE_READ = "a late read wrote the page"


def pages_of(pool: HostKVCache, page_bytes: PageBytes, *pages: int) -> list[torch.Tensor]:
    """The bytes of whole host pages."""
    return [page_bytes(pool, page * PAGE) for page in pages]


def assert_pages(
    pool: HostKVCache,
    page_bytes: PageBytes,
    pages: tuple[int, ...],
    expected: list[torch.Tensor],
    why: str = "",
) -> None:
    for page, want in zip(pages, expected, strict=True):
        assert torch.equal(page_bytes(pool, page * PAGE), want), why


def rewrite(pool: HostKVCache, page_bytes: PageBytes, *pages: int) -> list[torch.Tensor]:
    """SGLang reuses host pages: new bytes in each; the new bytes."""
    for page in pages:
        pool.get_data_page(page * PAGE, flat=False).fill_(-3.5 - page)
    return pages_of(pool, page_bytes, *pages)


def fails_in_time(call: Callable[[], list[bool]]) -> None:
    """``call``, a store or load of two pages, reports both failed within the deadline."""
    started = time.monotonic()
    assert call() == [False, False]
    took = time.monotonic() - started
    assert took < TASK_TIMEOUT + MARGIN, f"failure reported after {took:.2f} s"


def assert_original_or_missing(
    storage: KvplugHiCacheStorage,
    pool: HostKVCache,
    keys: list[str],
    original: list[torch.Tensor],
    rewritten: list[torch.Tensor],
    into: tuple[int, ...],
    page_bytes: PageBytes,
) -> int:
    """Read ``keys`` into the pages ``into``: each page read holds the original bytes, never
    the rewritten ones; the count of pages read."""
    loaded = storage.batch_get_v1(keys, slots(*into))
    for hit, page, sent, later in zip(loaded, into, original, rewritten, strict=True):
        if hit:
            got = page_bytes(pool, page * PAGE)
            assert not torch.equal(got, later), "a rewrite after the failure report was stored"
            assert torch.equal(got, sent)
    return sum(loaded)


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    """Every thread a test starts (kvplug's IO threads, file I/O workers) has ended once the
    storages it opened are closed."""
    with no_thread_left_behind():
        yield


def pending_tasks(storage: KvplugHiCacheStorage) -> list[asyncio.Task[Any]]:
    """The tasks on the storage's event loop besides the one asking."""

    async def others() -> list[asyncio.Task[Any]]:
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    return storage._client.run(others()).result(5)


def file_tier(storage: KvplugHiCacheStorage) -> Any:
    """The ``file://`` backend the storage opened, seen through wrappers and Stores."""
    disks = [tier for tier in tiers_of(storage._client.backend) if tier.url.scheme == "file"]
    assert len(disks) == 1
    return disks[0]


# -- a stalled file:// worker ------------------------------------------------------------------


@pytest.mark.parametrize("where", ["before", "while"])
@pytest.mark.parametrize(("layout", "mla"), POOLS, ids=POOL_IDS)
def test_a_store_stalled_in_a_file_worker_fails_in_time_and_a_rewrite_never_lands(
    layout: str,
    mla: bool,
    where: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: OpenStorage,
    page_bytes: PageBytes,
) -> None:
    pool = make_host_pool(layout, mla=mla, page_size=PAGE)
    storage = open_storage(pool, extra(f"file://{tmp_path}/store?o_direct=false"))
    keys = keys_of(f"stalled-store-{layout}-{mla}-{where}", 2)
    original = pages_of(pool, page_bytes, 0, 1)
    stall = stall_disk(monkeypatch, file_tier(storage), "store", where)
    try:
        fails_in_time(lambda: storage.batch_set_v1(keys, slots(0, 1)))
        assert stall.reached.is_set()
        rewritten = rewrite(pool, page_bytes, 0, 1)
    finally:
        stall.release()
    assert not pending_tasks(storage)
    assert_original_or_missing(storage, pool, keys, original, rewritten, (4, 5), page_bytes)
    assert storage.health().failed_sets == 1


@pytest.mark.parametrize("where", ["before", "while"])
@pytest.mark.parametrize(("layout", "mla"), POOLS, ids=POOL_IDS)
def test_a_load_stalled_in_a_file_worker_fails_in_time_and_never_writes_the_page_later(
    layout: str,
    mla: bool,
    where: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: OpenStorage,
    page_bytes: PageBytes,
) -> None:
    pool = make_host_pool(layout, mla=mla, page_size=PAGE)
    storage = open_storage(pool, extra(f"file://{tmp_path}/store"))  # O_DIRECT: staged reads
    keys = keys_of(f"stalled-load-{layout}-{mla}-{where}", 2)
    assert storage.batch_set_v1(keys, slots(0, 1)) == [True, True]
    original = pages_of(pool, page_bytes, 0, 1)
    stall = stall_disk(monkeypatch, file_tier(storage), "load", where)
    try:
        fails_in_time(lambda: storage.batch_get_v1(keys, slots(4, 5)))
        assert stall.reached.is_set()
        rewritten = rewrite(pool, page_bytes, 4, 5)  # SGLang frees the pages and reuses them
    finally:
        stall.release()
    assert not pending_tasks(storage)
    assert_pages(pool, page_bytes, (4, 5), rewritten, LATE_READ)
    assert storage.batch_get_v1(keys, slots(6, 7)) == [True, True]
    assert_pages(pool, page_bytes, (6, 7), original)


@pytest.mark.parametrize(("layout", "mla"), POOLS, ids=POOL_IDS)
def test_a_stalled_tier_behind_the_audit_wrapper_never_stores_a_rewrite_nor_writes_a_page_late(
    layout: str,
    mla: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: OpenStorage,
    page_bytes: PageBytes,
) -> None:
    """The audit wrapper passes its tier's capabilities through, so SGLang's pages are lent
    through it exactly where the tier itself would be lent them (verification off: the
    wrapper's checksums would hide a rewrite stored under the old key as a miss)."""
    pool = make_host_pool(layout, mla=mla, page_size=PAGE)
    storage = open_storage(
        pool, extra(f"audit://?verify=false::file://{tmp_path}/store?o_direct=false")
    )
    disk = file_tier(storage)
    keys = keys_of(f"audited-{layout}-{mla}", 2)
    original = pages_of(pool, page_bytes, 0, 1)
    stall = stall_disk(monkeypatch, disk, "store", "before")
    try:
        fails_in_time(lambda: storage.batch_set_v1(keys, slots(0, 1)))
        assert stall.reached.is_set()
        rewritten = rewrite(pool, page_bytes, 0, 1)
    finally:
        stall.release()
    monkeypatch.undo()
    assert_original_or_missing(storage, pool, keys, original, rewritten, (2, 3), page_bytes)
    assert storage.batch_set_v1(keys, slots(0, 1)) == [True, True]  # the rewritten pages
    stall = Stall(monkeypatch, disk, "_read_key", disk, "_read_key")  # audit reads whole objects
    try:
        fails_in_time(lambda: storage.batch_get_v1(keys, slots(4, 5)))
        assert stall.reached.is_set()
        reused = rewrite(pool, page_bytes, 4, 5)
    finally:
        stall.release()
    assert_pages(pool, page_bytes, (4, 5), reused, LATE_READ)
    assert storage.batch_get_v1(keys, slots(6, 7)) == [True, True]
    assert_pages(pool, page_bytes, (6, 7), rewritten)


@pytest.mark.parametrize(("layout", "mla"), POOLS, ids=POOL_IDS)
def test_calls_the_audit_wrapper_delays_past_their_deadline_fail_in_time_and_stay_away(
    layout: str,
    mla: bool,
    tmp_path: Path,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: OpenStorage,
    page_bytes: PageBytes,
) -> None:
    """The audit wrapper's delay fault: a store that answers after the deadline."""
    pool = make_host_pool(layout, mla=mla, page_size=PAGE)
    disk = f"file://{tmp_path}/store"
    delay = 3 * TASK_TIMEOUT
    keys, present = keys_of(f"delayed-{layout}-{mla}", 2), keys_of(f"present-{layout}-{mla}", 2)
    plain = open_storage(pool, extra(disk))
    assert plain.batch_set_v1(present, slots(2, 3)) == [True, True]
    slow = open_storage(
        pool, extra(f"audit://?delay={delay}&delay_ops=batched_put,batched_get::{disk}")
    )
    original = pages_of(pool, page_bytes, 0, 1)
    fails_in_time(lambda: slow.batch_set_v1(keys, slots(0, 1)))
    rewritten = rewrite(pool, page_bytes, 0, 1)  # SGLang reuses the pages of the failed backup
    fails_in_time(lambda: slow.batch_get_v1(present, slots(4, 5)))
    reused = rewrite(pool, page_bytes, 4, 5)  # and the pages of the failed prefetch
    time.sleep(delay)  # past the delay: what a call still going on would do, it has done
    assert_pages(pool, page_bytes, (4, 5), reused, LATE_READ)
    assert not pending_tasks(slow)
    assert_original_or_missing(plain, pool, keys, original, rewritten, (6, 7), page_bytes)


# -- a paused redis-server ---------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "mla"), POOLS, ids=POOL_IDS)
def test_a_paused_redis_fails_stores_and_loads_in_time_and_serves_only_what_was_handed_over(
    layout: str,
    mla: bool,
    redis_server: RedisServer,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: OpenStorage,
    page_bytes: PageBytes,
) -> None:
    redis_server.client().flushall()
    pool = make_host_pool(layout, mla=mla, page_size=PAGE, layers=16, heads=4, head_dim=64)
    storage = open_storage(pool, extra(redis_server.url, options={"timeout": 30}))
    stored, handed = keys_of(f"redis-{layout}-{mla}", 2), keys_of(f"paused-{layout}-{mla}", 2)
    assert storage.batch_set_v1(stored, slots(0, 1)) == [True, True]
    original = pages_of(pool, page_bytes, 0, 1, 2, 3)
    redis_server.pause()
    try:
        fails_in_time(lambda: storage.batch_set_v1(handed, slots(2, 3)))
        fails_in_time(lambda: storage.batch_get_v1(stored, slots(4, 5)))
        rewritten = rewrite(pool, page_bytes, 2, 3, 4, 5)
    finally:
        redis_server.resume()
    assert_original_or_missing(
        storage, pool, handed, original[2:], rewritten[:2], (6, 7), page_bytes
    )
    assert storage.batch_get_v1(stored, slots(8, 9)) == [True, True]
    assert_pages(pool, page_bytes, (8, 9), original[:2])
    assert_pages(pool, page_bytes, (4, 5), rewritten[2:], LATE_READ)


# -- wrappers and tiers ------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "mla"), POOLS, ids=POOL_IDS)
def test_audit_over_a_tiers_config_is_seen_through_and_a_page_reused_after_the_store_never_lands(
    layout: str,
    mla: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: OpenStorage,
    page_bytes: PageBytes,
) -> None:
    """A Store writes its lower tiers behind the put: it must get a copy, also through a
    wrapper. The file tier is held until SGLang has reused the pages, then written."""
    tiers = tmp_path / "tiers.yaml"
    disk = f"file://{tmp_path}/disk?o_direct=false"
    tiers.write_text(yaml.safe_dump({"tiers": ["cpu://?max_size=64MiB", disk]}))
    pool = make_host_pool(layout, mla=mla, page_size=PAGE)
    storage = open_storage(pool, extra(f"audit::store://{tiers}"))
    keys = keys_of(f"tiers-{layout}-{mla}", 2)
    original = pages_of(pool, page_bytes, 0, 1)
    stall = stall_disk(monkeypatch, file_tier(storage), "store", "before")
    try:
        assert storage.batch_set_v1(keys, slots(0, 1)) == [True, True]
        # SGLang reuses the pages once the backup is reported.
        rewritten = rewrite(pool, page_bytes, 0, 1)
        assert stall.reached.wait(10), "the Store never wrote its file tier"
    finally:
        stall.release()
    read = assert_original_or_missing(storage, pool, keys, original, rewritten, (4, 5), page_bytes)
    assert read == 2  # reported stored: the Store's host-memory tier serves them
    # What the file tier holds, as another SGLang instance on the same directory reads it.
    other = open_storage(make_host_pool(layout, mla=mla, page_size=PAGE), extra(disk))
    assert_original_or_missing(
        other, other.mem_pool_host, keys, original, rewritten, (4, 5), page_bytes
    )


# -- backends that let go at once when cancelled, and backends that do not --------------------


class HeldMemory(Backend):
    """``held://``: host memory kept on the event loop alone, whose operations can be held.

    Everything it does runs on the loop, so a cancelled operation ends at once and nothing of
    it goes on later: it declares ``releases_on_cancel``, and SGLang's pages are lent to it (no
    copy). A put waits ``hold`` seconds, then copies the bytes out; a load writes the first
    half of the page, waits ``hold`` seconds, then writes the rest. A put of a key in
    ``refused`` fails (the template then tells which keys of a batch were stored)."""

    capabilities = Capabilities(remove=True, releases_on_cancel=True)

    def __init__(self, url: Any, **options: Any) -> None:
        super().__init__(url, **options)
        self.hold = 0.0
        self.refused: set[CacheKey] = set()
        self.objects: dict[CacheKey, torch.Tensor] = {}
        self.put_addresses: list[int] = []

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        self.put_addresses.append(obj.raw.data_ptr())
        if key in self.refused:
            raise CapacityExceeded(f"{key} is refused by the test")
        await asyncio.sleep(self.hold)
        self.objects[key] = obj.raw.clone()

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        data = self.objects.get(key)
        return None if data is None else MemoryObj.from_tensor(data.clone())

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        data = self.objects.get(key)
        if data is None or data.numel() != dest.nbytes:
            return False
        half = data.numel() // 2
        dest.raw[:half].copy_(data[:half])
        await asyncio.sleep(self.hold)
        dest.raw[half:].copy_(data[half:])
        return True

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        return list(await asyncio.gather(*map(self._get_into, keys, dests)))

    async def _contains(self, key: CacheKey) -> bool:
        return key in self.objects

    async def _remove(self, key: CacheKey) -> bool:
        return self.objects.pop(key, None) is not None


class CopiedHeldMemory(HeldMemory):
    """``held-copied://``: the same, declaring no ``releases_on_cancel``: stores get a copy
    taken at submit, loads read into kvplug's memory."""

    capabilities = Capabilities(remove=True)


@pytest.fixture(scope="module", autouse=True)
def held_schemes() -> Iterator[None]:
    for scheme, cls in (("held", HeldMemory), ("held-copied", CopiedHeldMemory)):
        kvplug.register_backend(
            kvplug.BackendSpec(scheme, (scheme,), f"{__name__}:{cls.__name__}"), replace=True
        )
    yield
    reset_registry()


def held(storage: KvplugHiCacheStorage) -> HeldMemory:
    backend = storage._client.backend
    assert isinstance(backend, HeldMemory)
    return backend


def in_pool(pool: HostKVCache, address: int) -> bool:
    buffers = [getattr(pool, name, None) for name in ("kv_buffer", "k_buffer", "v_buffer")]
    return any(
        isinstance(b, torch.Tensor)
        and b.data_ptr() <= address < b.data_ptr() + b.numel() * b.element_size()
        for b in buffers
    )


@pytest.mark.parametrize("scheme", ["held", "held-copied"])
@pytest.mark.parametrize(("layout", "mla"), POOLS, ids=POOL_IDS)
def test_a_held_job_fails_in_time_and_nothing_of_it_lands_later_lent_or_copied(
    layout: str,
    mla: bool,
    scheme: str,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: OpenStorage,
    page_bytes: PageBytes,
) -> None:
    pool = make_host_pool(layout, mla=mla, page_size=PAGE)
    storage = open_storage(pool, extra(f"{scheme}://"))
    backend = held(storage)
    keys, late = keys_of(f"held-{layout}", 2), keys_of(f"late-{layout}", 2)
    assert storage.batch_set_v1(keys, slots(0, 1)) == [True, True]
    lent = layout != "layer_first" and scheme == "held"  # page-major pages, a lending backend
    assert all(in_pool(pool, address) == lent for address in backend.put_addresses)
    original = pages_of(pool, page_bytes, 0, 1, 2, 3)

    backend.hold = 3 * TASK_TIMEOUT
    fails_in_time(lambda: storage.batch_set_v1(late, slots(2, 3)))
    fails_in_time(lambda: storage.batch_get_v1(keys, slots(4, 5)))
    rewritten = rewrite(pool, page_bytes, 2, 3, 4, 5)
    assert not pending_tasks(storage)  # the held operations ended with the calls
    time.sleep(0.2)  # what a job still going on would write by now
    assert_pages(pool, page_bytes, (4, 5), rewritten[2:], LATE_READ)
    backend.hold = 0
    assert_original_or_missing(storage, pool, late, original[2:], rewritten[:2], (6, 7), page_bytes)
    assert storage.batch_get_v1(keys, slots(8, 9)) == [True, True]
    assert_pages(pool, page_bytes, (8, 9), original[:2])


@pytest.mark.parametrize("scheme", ["held", "held-copied"])
@pytest.mark.parametrize(("layout", "mla"), POOLS, ids=POOL_IDS)
def test_each_page_is_reported_stored_only_when_every_segment_is(
    layout: str,
    mla: bool,
    scheme: str,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: OpenStorage,
    page_bytes: PageBytes,
) -> None:
    pool = make_host_pool(layout, mla=mla, page_size=PAGE)
    storage = open_storage(pool, extra(f"{scheme}://"))
    keys = keys_of(f"partial-{layout}", 3)
    assert storage._namespace is not None
    segments = storage._namespace.segment_keys(keys[1])
    held(storage).refused = {segments[-1]}  # the last segment of the middle page
    assert storage.batch_set_v1(keys, slots(0, 1, 2)) == [True, False, True]
    # The store kept every object but the refused one; SGLang hears of two whole pages.
    assert storage.health().counters.writes == 3 * len(segments) - 1
    assert storage.batch_exists(keys) == 1
    assert storage.batch_get_v1(keys, slots(4, 5, 6)) == [True, False, True]
    for page, sent in ((4, 0), (6, 2)):
        assert torch.equal(page_bytes(pool, page * PAGE), page_bytes(pool, sent * PAGE))
