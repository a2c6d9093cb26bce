"""KvplugHiCacheStorage against SGLang's own code: built by SGLang's StorageBackendFactory from
the ``dynamic`` extra config, over real host pools in every layout, for ``cpu://``, ``file://``
and a real redis-server (tenants also for a real kvplug lm-server and a tiers config); and
through SGLang's HiCacheController's backup and prefetch threads, also while the store is down
or paused."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.pool_host import HostKVCache
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.observability.metrics_collector import StorageMetrics

import kvplug
from kvplug import MemoryFormat, MemoryObj
from kvplug.errors import ConfigError, KvplugError
from kvplug.runtime.store import store_url
from kvplug.stats import summarize
from kvplug_sglang import KvplugHiCacheStorage
from kvplug_testing import LMServerProcess, RedisServer, free_port

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 16
DYNAMIC = {
    "backend_name": "kvplug",
    "module_path": "kvplug_sglang",
    "class_name": "KvplugHiCacheStorage",
}

PageBytes = Callable[[HostKVCache, int | torch.Tensor], torch.Tensor]


@dataclass
class Target:
    name: str
    url: str
    options: dict[str, Any]


@pytest.fixture(params=["cpu", "file", "redis"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    if request.param == "cpu":
        return Target("cpu", "cpu://?max_size=64MiB", {})
    if request.param == "file":
        return Target("file", f"file://{tmp_path}/store", {})
    redis: Target = request.getfixturevalue("redis_target")
    return redis


@pytest.fixture
def redis_target(redis_server: RedisServer) -> Target:
    redis_server.client().flushall()
    return Target("redis", redis_server.url, {"timeout": 5})


@pytest.fixture(scope="module")
def lm_server() -> Iterator[LMServerProcess]:
    with LMServerProcess(["--max-memory", "256MiB"]) as server:
        yield server


@pytest.fixture(params=["cpu", "file", "redis", "lm", "store"])
def any_target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """Each kind of built-in store: host memory, a directory, a real redis-server, a real
    kvplug lm-server (shared by the module's tests: each test uses keys of its own), and a
    tiers config (host memory in front of a directory)."""
    if request.param == "cpu":
        return Target("cpu", "cpu://?max_size=64MiB", {})
    if request.param == "file":
        return Target("file", f"file://{tmp_path}/store", {})
    if request.param == "redis":
        redis: Target = request.getfixturevalue("redis_target")
        return redis
    if request.param == "lm":
        lm: LMServerProcess = request.getfixturevalue("lm_server")
        return Target("lm", lm.url, {})
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(f"tiers:\n  - cpu://?max_size=64MiB\n  - file://{tmp_path}/tiered\n")
    return Target("store", store_url(str(tiers)), {})


def extra(target: Target, **more: Any) -> dict[str, Any]:
    return {**DYNAMIC, "interface_v1": 1, "url": target.url, "options": target.options, **more}


def slots(*pages: int) -> torch.Tensor:
    """The host token slots of whole pages."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def keys_of(name: str, count: int) -> list[str]:
    return [f"{i:02x}{name.encode().hex()}" for i in range(count)]


# -- the page API through SGLang's factory and host pools --------------------------------------


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_bit_exact_in_every_layout(
    layout: str,
    mla: bool,
    target: Target,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
    page_bytes: PageBytes,
) -> None:
    source = make_host_pool(layout, mla=mla, page_size=PAGE)
    writer = open_storage(source, extra(target))
    keys = keys_of(f"{layout}-{mla}", 3)
    sent = [page_bytes(source, p * PAGE) for p in (3, 7, 8)]
    allocator = writer._client.backend.allocator
    baseline = allocator.stats().object_count
    assert writer.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, slots(3, 7, 8)) == [True] * 3

    if target.name == "cpu":  # a cpu:// store lives in its process: read back into its pool
        dest, reader = source, writer
    else:  # another SGLang instance on the same store
        dest = make_host_pool(layout, mla=mla, page_size=PAGE)
        reader = open_storage(dest, extra(target))
    before = page_bytes(dest, 4 * PAGE)
    assert reader.batch_exists(keys) == 3
    assert reader.batch_exists([*keys[:2], "ff" * 32, keys[2]]) == 2  # SGLang's prefix count
    assert reader.batch_get_v1(keys, slots(0, 5, 9)) == [True] * 3

    for page, slot in zip(sent, (0, 5, 9), strict=True):
        assert torch.equal(page_bytes(dest, slot * PAGE), page)
    assert torch.equal(page_bytes(dest, 4 * PAGE), before)  # a page not asked for is untouched
    missing = ["ee" * 32, keys[0]]
    assert reader.batch_get_v1(missing, slots(10, 11)) == [False, True]
    health = reader.health()
    assert health.counters == summarize(reader._client.backend.operation_stats())
    per_page = health.objects_per_page
    assert per_page == (1 if mla or layout == "layer_first" else 2)  # MHA page-major: K and V
    assert (health.counters.hits, health.counters.misses) == (4 * per_page, 1 * per_page)
    assert health.counters.bytes_read == 4 * sent[0].numel()
    assert health.counters.writes == (3 * per_page if reader is writer else 0)
    if target.name != "cpu":  # (a cpu:// store keeps its objects in that allocator)
        assert allocator.stats().object_count == baseline  # every gather buffer went back


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_copying_api_stores_the_same_objects_as_the_page_api(
    layout: str,
    redis_target: Target,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
    page_bytes: PageBytes,
) -> None:
    """Without interface_v1 SGLang's controller copies pages out (get_data_page) and in
    (set_from_flat_data_page): those pages are readable with the page API and back."""
    source = make_host_pool(layout, page_size=PAGE)
    dest = make_host_pool(layout, page_size=PAGE)
    legacy = open_storage(source, {**extra(redis_target), "interface_v1": 0})
    paged = open_storage(dest, extra(redis_target))
    old_keys, new_keys = keys_of(f"legacy-{layout}", 2), keys_of(f"paged-{layout}", 2)

    # HiCacheController._generic_page_set
    assert legacy.batch_set(old_keys, [source.get_data_page(p * PAGE) for p in (1, 2)])
    assert paged.batch_get_v1(old_keys, slots(6, 7)) == [True, True]
    for src, dst in ((1, 6), (2, 7)):
        assert torch.equal(page_bytes(dest, dst * PAGE), page_bytes(source, src * PAGE))

    assert paged.batch_set_v1(new_keys, slots(6, 7)) == [True, True]
    # HiCacheController._generic_page_get
    pages = legacy.batch_get(new_keys, [source.get_dummy_flat_data_page() for _ in new_keys])
    assert all(page is not None for page in pages)
    for page, slot in zip(pages, (6, 7), strict=True):
        assert torch.equal(page.view(torch.uint8), page_bytes(dest, slot * PAGE))
    assert legacy.exists(new_keys[0]) and not legacy.exists("dd" * 32)
    assert legacy.get("dd" * 32) is None
    fresh = legacy.get(new_keys[1])  # no target: a new page tensor
    assert fresh is not None and torch.equal(fresh.view(torch.uint8), page_bytes(dest, 7 * PAGE))


def test_each_layout_is_its_own_key_space_never_another_layouts_bytes(
    tmp_path: Path,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
) -> None:
    """page_first and page_first_direct pages have the same size and different byte orders."""
    file = Target("file", f"file://{tmp_path}/store", {})
    first = open_storage(make_host_pool("page_first", page_size=PAGE), extra(file))
    keys = keys_of("layouts", 2)
    assert first.batch_set_v1(keys, slots(0, 1)) == [True, True]
    direct = open_storage(make_host_pool("page_first_direct", page_size=PAGE), extra(file))
    assert direct.batch_exists(keys) == 0
    assert direct.batch_get_v1(keys, slots(2, 3)) == [False, False]


def test_a_cpu_tier_keeps_its_own_copy_of_the_host_pages(
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
    page_bytes: PageBytes,
) -> None:
    """SGLang reuses a host page once its backup is done; a cpu:// tier keeps objects, so it
    must not keep SGLang's memory."""
    pool = make_host_pool("page_first", page_size=PAGE)
    storage = open_storage(pool, extra(Target("cpu", "cpu://?max_size=16MiB", {})))
    keys = keys_of("private", 1)
    stored = page_bytes(pool, 2 * PAGE)
    assert storage.batch_set_v1(keys, slots(2)) == [True]
    pool.get_data_page(2 * PAGE, flat=False).fill_(0)  # SGLang reuses the page
    assert storage.batch_get_v1(keys, slots(5)) == [True]
    assert torch.equal(page_bytes(pool, 5 * PAGE), stored)


def stored_objects(storage: KvplugHiCacheStorage, keys: list[str], tenant: str) -> int:
    """How many objects of ``keys``' pages ``storage``'s store holds for ``tenant`` ("":
    none), asked of the store directly."""
    assert storage._namespace is not None
    namespace = dataclasses.replace(storage._namespace, tenant=tenant)
    wanted = [key for page in keys for key in namespace.segment_keys(page)]
    return sum(storage._wait(storage._client.backend.batched_exists(wanted)))


def test_the_same_pages_under_two_tenants_never_hit_each_other(
    any_target: Target,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
    page_bytes: PageBytes,
) -> None:
    """SGLang hands the storage page hashes alone, so the same hashes (the same tokens under
    the same salt) of two deployments' tenants: the store holds A's pages under A's tenant
    only; B (another SGLang instance, another client of the same store) misses them, stores
    its own beside them, and each reads back its own. A cpu:// store is private to the storage
    that opened it: there B's keys are asked of A's store."""
    pool_a, pool_b = (make_host_pool("page_first", page_size=PAGE) for _ in range(2))
    team_a = open_storage(pool_a, extra(any_target, tenant="team-a"))
    keys = keys_of(f"tenants-{uuid.uuid4().hex}", 3)
    assert team_a.batch_set_v1(keys, slots(0, 1, 2)) == [True] * 3
    per_page = team_a.health().objects_per_page
    assert stored_objects(team_a, keys, "team-a") == 3 * per_page
    assert stored_objects(team_a, keys, "team-b") == stored_objects(team_a, keys, "") == 0
    if any_target.name == "cpu":
        return

    team_b = open_storage(pool_b, extra(any_target, tenant="team-b"))
    assert team_b.batch_exists(keys) == 0
    assert team_b.batch_get_v1(keys, slots(4, 5, 6)) == [False] * 3
    assert team_b.batch_set_v1(keys, slots(0, 1, 2)) == [True] * 3
    assert stored_objects(team_b, keys, "team-b") == 3 * per_page
    assert team_a.batch_get_v1(keys, slots(8, 9, 10)) == [True] * 3
    assert team_b.batch_get_v1(keys, slots(8, 9, 10)) == [True] * 3
    for page in range(3):
        assert torch.equal(page_bytes(pool_a, (8 + page) * PAGE), page_bytes(pool_a, page * PAGE))
        assert torch.equal(page_bytes(pool_b, (8 + page) * PAGE), page_bytes(pool_b, page * PAGE))
    assert not torch.equal(page_bytes(pool_a, 8 * PAGE), page_bytes(pool_b, 8 * PAGE))
    untenanted = open_storage(make_host_pool("page_first", page_size=PAGE), extra(any_target))
    assert untenanted.batch_exists(keys) == 0


@pytest.mark.parametrize("store", ["file", "redis"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_ranks_keep_their_own_pages_and_mla_replicas_share_one_copy(
    mla: bool,
    store: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
    page_bytes: PageBytes,
) -> None:
    """Each TP rank is a process of its own with a backend of its own: ranks meet in a store
    shared across processes (a directory, a Redis)."""
    shared = (
        Target("file", f"file://{tmp_path}/store", {})
        if store == "file"
        else request.getfixturevalue("redis_target")
    )
    pools = [make_host_pool("page_first", mla=mla, page_size=PAGE) for _ in range(2)]
    ranks = [
        open_storage(pool, extra(shared), tp_rank=rank, tp_size=2)
        for rank, pool in enumerate(pools)
    ]
    keys = keys_of(f"ranks-{mla}", 2)
    assert ranks[1].batch_set_v1(keys, slots(0, 1)) == [True, True]  # rank 1: not MLA's writer
    if not mla:
        assert ranks[0].batch_exists(keys) == 0  # another shard's pages
        assert ranks[1].batch_exists(keys) == 2
        return
    assert ranks[0].batch_exists(keys) == 0  # the replica wrote nothing
    assert ranks[0].batch_set_v1(keys, slots(0, 1)) == [True, True]  # rank 0 is the writer
    assert ranks[1].batch_get_v1(keys, slots(4, 5)) == [True, True]
    assert torch.equal(page_bytes(pools[1], 4 * PAGE), page_bytes(pools[0], 0))


def test_a_damaged_stored_page_is_a_miss_never_data(
    tmp_path: Path,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
) -> None:
    file = Target("file", f"file://{tmp_path}/store", {})
    storage = open_storage(make_host_pool("page_first_direct", page_size=PAGE), extra(file))
    keys = keys_of("damaged", 2)
    assert storage.batch_set_v1(keys, slots(0, 1)) == [True, True]
    stored = sorted((tmp_path / "store").rglob("*"), key=lambda p: p.stat().st_mtime)
    victim = next(p for p in reversed(stored) if p.is_file() and p.stat().st_size > 4096)
    with victim.open("r+b") as f:
        f.seek(victim.stat().st_size - 100)
        f.write(b"\xff" * 50)
    loaded = storage.batch_get_v1(keys, slots(2, 3))
    assert loaded.count(False) == 1  # the page with the damaged segment
    assert storage.batch_exists(keys) < 2  # and it is gone from the store


def test_a_stored_page_of_another_size_fails_the_load_loudly_naming_both_sizes(
    tmp_path: Path,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A page stored under this pool's own keys with another size (a build with another layout
    writing the same keys): the get fails, counted and logged with kvplug's LayoutMismatch,
    instead of turning into a silent miss."""
    file = Target("file", f"file://{tmp_path}/store", {})
    storage = open_storage(make_host_pool("page_first_direct", page_size=PAGE), extra(file))
    keys = keys_of("resized", 2)
    assert storage.batch_set_v1(keys, slots(0, 1)) == [True, True]
    asyncio.run(_halve_every_value(file.url))
    with caplog.at_level(logging.WARNING):
        assert storage.batch_get_v1(keys, slots(2, 3)) == [False, False]
    health = storage.health()
    assert health.failed_gets == 1, health
    assert (health.counters.errors, health.counters.misses) == (1, 0), health  # one failed call
    assert (health.last_error or "").startswith("LayoutMismatch: "), health
    assert any("LayoutMismatch" in record.getMessage() for record in caplog.records)


async def _halve_every_value(url: str) -> None:
    backend = await kvplug.open_backend(url)
    try:
        for key in [key async for key in backend.list_keys()]:
            stored = await backend.get(key)
            assert stored is not None
            half = torch.zeros(stored.nbytes // 2, dtype=torch.uint8)
            stored.release()
            await backend.put(key, MemoryObj.from_tensor(half, MemoryFormat.BINARY))
    finally:
        await backend.close()


def test_clear_removes_this_ranks_and_tenants_pages_only(
    tmp_path: Path,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
) -> None:
    file = Target("file", f"file://{tmp_path}/store", {})
    mine = open_storage(make_host_pool("page_first", page_size=PAGE), extra(file))
    other = open_storage(
        make_host_pool("page_first", page_size=PAGE), extra(file), tp_rank=1, tp_size=2
    )
    keys = keys_of("clear", 2)
    assert mine.batch_set_v1(keys, slots(0, 1)) == [True, True]
    assert other.batch_set_v1(keys, slots(0, 1)) == [True, True]
    theirs = open_storage(
        make_host_pool("page_first", page_size=PAGE), extra(file, tenant="another-tenant")
    )
    assert theirs.batch_set_v1(keys, slots(0, 1)) == [True, True]
    mine.clear()
    assert mine.batch_exists(keys) == 0
    assert other.batch_exists(keys) == 2
    assert theirs.batch_exists(keys) == 2  # another tenant's pages of this rank stay


def test_get_stats_reports_pages_and_bandwidth_per_call_when_sglang_asks(
    tmp_path: Path,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
) -> None:
    file = Target("file", f"file://{tmp_path}/store", {})
    pool = make_host_pool("page_first", page_size=PAGE)
    quiet = open_storage(pool, extra(file))
    assert quiet.get_stats() is None
    storage = open_storage(pool, extra(file), enable_storage_metrics=True)
    keys = keys_of("stats", 3)
    storage.batch_set_v1(keys, slots(0, 1, 2))
    storage.batch_get_v1(keys[:2], slots(4, 5))
    stats = storage.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [2]
    assert all(v > 0 for v in stats.backup_bandwidth + stats.prefetch_bandwidth)
    assert storage.get_stats().backup_pgs == []  # drained


def test_sglangs_threads_may_call_at_once(
    tmp_path: Path,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
    page_bytes: PageBytes,
) -> None:
    """The backup, prefetch and prefetch-IO threads share one storage."""
    pool = make_host_pool("layer_first", page_size=PAGE, pages=64)
    storage = open_storage(pool, extra(Target("file", f"file://{tmp_path}/store", {})))
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for round_ in range(5):
                keys = keys_of(f"threads-{n}-{round_}", 2)
                src, dst = (4 * n, 4 * n + 1), (4 * n + 2, 4 * n + 3)
                assert storage.batch_set_v1(keys, slots(*src)) == [True, True]
                assert storage.batch_exists(keys) == 2
                assert storage.batch_get_v1(keys, slots(*dst)) == [True, True]
                for a, b in zip(src, dst, strict=True):
                    assert torch.equal(page_bytes(pool, a * PAGE), page_bytes(pool, b * PAGE))
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    health = storage.health()
    assert health.objects_per_page == 1  # a gathered layer_first page
    assert (health.counters.writes, health.counters.hits) == (6 * 5 * 2, 6 * 5 * 2)


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"urll": "cpu://"}, r"unknown key\(s\) 'urll' \(did you mean 'url'\?\)"),
        ({"url": None}, "neither url nor config"),
        ({"config": "/etc/kvplug.yaml"}, "both url and config"),
        ({"task_timeout": 0}, "task_timeout must be a positive number"),
        ({"task_timeout": "soon"}, "task_timeout must be a positive number"),
        ({"check_on_start": "yes"}, "check_on_start must be true or false"),
        ({"options": ["timeout", 1]}, "options must be a mapping"),
        ({"tenant": 5}, "tenant is refused: a tenant is a non-empty string, got 5"),
        ({"tenant": ""}, "tenant is refused: a tenant is a non-empty string"),
        ({"tenant": "t" * 129}, "tenant is refused: .* has 129 characters"),
        ({"tenant": "a\x00b"}, "tenant is refused: .*NUL"),
    ],
)
def test_a_bad_extra_config_names_the_key_and_the_fix(
    changes: dict[str, Any], message: str, storage_config: Callable[..., Any]
) -> None:
    config = {**DYNAMIC, "url": "cpu://", **changes}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra_config=config), None)


def test_sglangs_own_keys_and_heterogeneous_tp_are_handled(
    storage_config: Callable[..., Any],
) -> None:
    sglang_keys = {"interface_v1": 1, "prefetch_threshold": 64, "prefetch_timeout_base": 1}
    storage = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config={**DYNAMIC, "url": "cpu://", **sglang_keys}), None
    )
    storage.close()
    split = storage_config(extra_config={**DYNAMIC, "url": "cpu://"}, should_split_heads=True)
    with pytest.raises(ConfigError, match="does not split heads"):
        StorageBackendFactory.create_backend("dynamic", split, None)


def test_an_unreachable_store_fails_the_start_unless_told_otherwise(
    storage_config: Callable[..., Any], make_host_pool: Callable[..., HostKVCache]
) -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    config = {**DYNAMIC, "url": url, "options": {"timeout": 1}}
    with pytest.raises(KvplugError, match=f"{url} did not answer at start"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra_config=config), None)
    lenient = storage_config(extra_config={**config, "check_on_start": False})
    storage = StorageBackendFactory.create_backend("dynamic", lenient, None)
    try:
        storage.register_mem_pool_host(make_host_pool("page_first", page_size=PAGE))
        assert storage.batch_exists(keys_of("down", 1)) == 0
        assert storage.batch_set_v1(keys_of("down", 1), slots(0)) == [False]
    finally:
        storage.close()


def test_a_secret_in_the_url_never_reaches_the_logs(
    caplog: pytest.LogCaptureFixture,
    storage_config: Callable[..., Any],
    make_host_pool: Callable[..., HostKVCache],
) -> None:
    url = f"redis://:hunter2-secret@127.0.0.1:{free_port()}"
    config = {**DYNAMIC, "url": url, "options": {"timeout": 1}, "check_on_start": False}
    with caplog.at_level(logging.DEBUG):
        storage = StorageBackendFactory.create_backend(
            "dynamic", storage_config(extra_config=config), None
        )
        storage.register_mem_pool_host(make_host_pool("page_first", page_size=PAGE))
        storage.batch_set_v1(keys_of("secret", 1), slots(0))
        assert "hunter2-secret" not in repr(storage) + str(storage.health())
        storage.close()
    assert "KvplugHiCacheStorage on redis://" in caplog.text
    assert "hunter2-secret" not in caplog.text


# -- a store that goes down, pauses, comes back ----------------------------------------------


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_store_that_goes_down_and_comes_back_reports_failures_then_recovers(
    layout: str,
    own_redis: RedisServer,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
    page_bytes: PageBytes,
) -> None:
    pool = make_host_pool(layout, page_size=PAGE)
    storage = open_storage(pool, extra(Target("redis", own_redis.url, {"timeout": 1})))
    keys = keys_of("outage", 2)
    assert storage.batch_set_v1(keys[:1], slots(0)) == [True]
    own_redis.stop()
    baseline = storage._client.backend.allocator.stats().object_count
    assert storage.batch_set_v1(keys[1:], slots(1)) == [False]
    assert storage.batch_exists(keys) == 0
    assert storage.batch_get_v1(keys, slots(4, 5)) == [False, False]
    assert storage.get(keys[0]) is None
    health = storage.health()
    assert not health.healthy and health.failed_sets == 1 and health.failed_gets == 2
    assert storage._client.backend.allocator.stats().object_count == baseline
    own_redis.start()  # the same port, an empty server
    assert storage.batch_set_v1(keys, slots(0, 1)) == [True, True]
    assert storage.batch_get_v1(keys, slots(4, 5)) == [True, True]
    assert torch.equal(page_bytes(pool, 5 * PAGE), page_bytes(pool, 1 * PAGE))
    assert storage.health().healthy


def test_a_paused_store_makes_calls_fail_within_the_task_timeout_and_release_the_pages(
    own_redis: RedisServer,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: Callable[..., KvplugHiCacheStorage],
) -> None:
    pool = make_host_pool("page_first", page_size=PAGE)
    storage = open_storage(
        pool, extra(Target("redis", own_redis.url, {"timeout": 30}), task_timeout=1)
    )
    keys = keys_of("paused", 2)
    assert storage.batch_set_v1(keys, slots(0, 1)) == [True, True]
    own_redis.pause()
    try:
        started = time.monotonic()
        assert storage.batch_get_v1(keys, slots(4, 5)) == [False, False]
        assert storage.batch_set_v1(keys, slots(0, 1)) == [False, False]
        assert storage.batch_exists(keys) == 0
        assert time.monotonic() - started < 3 * (1 + 0.75)  # each within task_timeout + a margin
    finally:
        own_redis.resume()
    assert storage.batch_get_v1(keys, slots(4, 5)) == [True, True]


# -- through SGLang's HiCacheController -------------------------------------------------------


@pytest.mark.parametrize("interface_v1", [1, 0], ids=["page-api", "copying-api"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_controllers_backup_and_prefetch_round_trip_through_kvplug(
    layout: str,
    interface_v1: int,
    target: Target,
    hicache_controller: Callable[..., contextlib.AbstractContextManager[Any]],
    backup: Callable[..., int],
    prefetch: Callable[..., tuple[int, torch.Tensor]],
    page_bytes: PageBytes,
) -> None:
    tokens = list(range(1000, 1000 + 4 * PAGE))
    config = extra(target, interface_v1=interface_v1)
    with hicache_controller(layout, extra_config=config) as controller:
        assert isinstance(controller.storage_backend, KvplugHiCacheStorage)
        host = controller.mem_pool_host
        written = host.alloc(len(tokens))
        sent = [page_bytes(host, written[i * PAGE]) for i in range(4)]
        assert backup(controller, written, tokens) == len(tokens)

        fetched, into = prefetch(controller, [*tokens, *range(5000, 5000 + PAGE)])
        assert fetched == len(tokens)  # the stored prefix, not the unknown last page
        assert not torch.equal(into[:PAGE], written[:PAGE])
        for i in range(4):
            assert torch.equal(page_bytes(host, into[i * PAGE]), sent[i])
        assert prefetch(controller, list(range(7000, 7000 + 2 * PAGE)))[0] == 0


@pytest.mark.parametrize("server", ["redis", "lm"])
def test_the_controllers_of_two_tenants_sharing_a_server_never_read_each_others_pages(
    server: str,
    request: pytest.FixtureRequest,
    hicache_controller: Callable[..., contextlib.AbstractContextManager[Any]],
    backup: Callable[..., int],
    prefetch: Callable[..., tuple[int, torch.Tensor]],
    page_bytes: PageBytes,
) -> None:
    """SGLang's own backup and prefetch threads of two deployments (two clients of one Redis
    or lm:// server), tenant A's and B's, with the same tokens: B's prefetch misses A's pages,
    B backs up its own, and A's next instance prefetches A's bytes, not B's."""
    shared: Target = (
        request.getfixturevalue("redis_target")
        if server == "redis"
        else Target("lm", request.getfixturevalue("lm_server").url, {})
    )
    start = 10_000 + uuid.uuid4().int % 1_000_000  # tokens of this test's own
    tokens = list(range(start, start + 3 * PAGE))

    def deployment(tenant: str) -> contextlib.AbstractContextManager[Any]:
        return hicache_controller("page_first", extra_config=extra(shared, tenant=tenant))

    with deployment("team-a") as controller:
        host = controller.mem_pool_host
        written = host.alloc(len(tokens))
        sent = [page_bytes(host, written[i * PAGE]) for i in range(3)]
        assert backup(controller, written, tokens) == len(tokens)
    with deployment("team-b") as controller:
        assert prefetch(controller, tokens)[0] == 0
        host = controller.mem_pool_host
        written = host.alloc(len(tokens))
        assert not torch.equal(page_bytes(host, written[0]), sent[0])
        assert backup(controller, written, tokens) == len(tokens)
    with deployment("team-a") as controller:
        fetched, into = prefetch(controller, tokens)
        assert fetched == len(tokens)
        for i in range(3):
            assert torch.equal(page_bytes(controller.mem_pool_host, into[i * PAGE]), sent[i])


def test_a_down_store_never_stops_the_controllers_threads(
    own_redis: RedisServer,
    hicache_controller: Callable[..., contextlib.AbstractContextManager[Any]],
    backup: Callable[..., int],
    prefetch: Callable[..., tuple[int, torch.Tensor]],
    page_bytes: PageBytes,
) -> None:
    config = extra(Target("redis", own_redis.url, {"timeout": 1}), task_timeout=2)
    tokens = list(range(300, 300 + 2 * PAGE))
    with hicache_controller("page_first", extra_config=config) as controller:
        host = controller.mem_pool_host
        written = host.alloc(len(tokens))
        own_redis.stop()
        assert backup(controller, written, tokens) == 0
        assert prefetch(controller, tokens)[0] == 0
        threads = [
            controller.backup_thread,
            controller.prefetch_thread,
            controller.prefetch_io_aux_thread,
        ]
        assert all(thread.is_alive() for thread in threads)

        own_redis.start()
        assert backup(controller, written, tokens) == len(tokens)
        fetched, into = prefetch(controller, tokens)
        assert fetched == len(tokens)
        assert torch.equal(page_bytes(host, into[PAGE]), page_bytes(host, written[PAGE]))


def test_a_paused_store_never_stalls_the_controller_past_the_task_timeout(
    own_redis: RedisServer,
    hicache_controller: Callable[..., contextlib.AbstractContextManager[Any]],
    backup: Callable[..., int],
    prefetch: Callable[..., tuple[int, torch.Tensor]],
) -> None:
    config = extra(Target("redis", own_redis.url, {"timeout": 30}), task_timeout=1)
    tokens = list(range(600, 600 + 2 * PAGE))
    with hicache_controller("page_first_direct", extra_config=config) as controller:
        written = controller.mem_pool_host.alloc(len(tokens))
        assert backup(controller, written, tokens) == len(tokens)
        own_redis.pause()
        resumer = threading.Timer(20, own_redis.resume)  # never left paused if asserts fail
        resumer.start()
        try:
            assert prefetch(controller, tokens, timeout=15)[0] == 0
        finally:
            own_redis.resume()
            resumer.cancel()
        assert prefetch(controller, tokens)[0] == len(tokens)


def test_mla_with_tp_warns_when_the_store_is_private_to_each_process(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, storage_config: Callable[..., Any]
) -> None:
    def open_(**target: str) -> None:
        config = storage_config(
            extra_config={**DYNAMIC, **target}, is_mla_model=True, tp_size=2, tp_rank=1
        )
        StorageBackendFactory.create_backend("dynamic", config, None).close()

    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(f"tiers:\n  - cpu://?max_size=64MiB\n  - file://{tmp_path}/tiered\n")
    with caplog.at_level(logging.WARNING, logger="kvplug.sglang"):
        open_(url=f"file://{tmp_path}/store")
        open_(config=str(tiers))  # the page reaches the shared tier behind the cpu one
        assert "MLA model" not in caplog.text
        open_(url="cpu://")
    assert "the other ranks will miss" in caplog.text
