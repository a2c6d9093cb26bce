"""KvplugL2Adapter against LMCache's own code: its ``basic_check`` tool, its MP
``StorageManager`` and controllers, its ``lmcache server``, and its plugin factory, on
``cpu://``, ``file://`` (a temporary directory) and ``redis://`` (a real redis-server on a free
loopback port). Runs in a venv with LMCache installed (0.5.6 and 0.5.7rc2 are tested)."""

from __future__ import annotations

import doctest
import importlib.metadata
import importlib.util
import json
import logging
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lmcache", reason="these tests need LMCache (run them in an LMCache venv)")

from lmcache.cli.commands.describe import fmt_bytes
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import parse_args
from lmcache.v1.distributed.storage_manager import StorageManager
from lmcache_support import (
    CHUNK_BYTES,
    DEADLINE,
    LAYOUT,
    LMCACHE_CLI,
    Driver,
    LMCacheServer,
    chunk,
    key,
    l1_object,
    make_adapter,
    plugin_spec,
    server_command,
    wait_until,
)

from kvplug.errors import BackendUnavailable, ConfigError, UnknownOption, UnknownScheme
from kvplug.runtime.sync import SyncClient
from kvplug.stats import summarize
from kvplug_lmcache import l2_adapter
from kvplug_lmcache.keys import cache_key_to_object_key, object_key_to_cache_key
from kvplug_lmcache.l2_adapter import KvplugL2Adapter
from kvplug_testing import RedisServer, free_port

LMCACHE_VERSION = importlib.metadata.version("lmcache")
BASIC_CHECK = (
    "lmcache.inprocess.v1.basic_check"  # 0.5.7: in-process modules moved under lmcache.inprocess
    if importlib.util.find_spec("lmcache.inprocess") is not None
    else "lmcache.v1.basic_check"
)

needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (bash scripts/setup.sh installs it)",
)


@dataclass
class Target:
    """One kvplug backend the adapter is tested on."""

    name: str
    url: str
    options: dict[str, Any]

    def params(self, **extra: Any) -> dict[str, Any]:
        return {"url": self.url, "options": self.options, **extra}

    def model_keys(self, model: str) -> list[ObjectKey] | None:
        """The MP keys of ``model`` the backend holds, read by kvplug itself (None for cpu://,
        whose data lives only in the process that wrote it)."""
        if self.name == "cpu":
            return None
        with SyncClient(self.url, **self.options) as client:

            async def listed() -> list[ObjectKey]:
                keys = [cache_key_to_object_key(k) async for k in client.backend.list_keys()]
                return [k for k in keys if k.model_name == model]

            return client.run(listed()).result(DEADLINE)


@pytest.fixture(params=["cpu", "file", "redis"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    if request.param == "cpu":
        return Target("cpu", "cpu://?max_size=64MiB", {})
    if request.param == "file":
        return Target("file", f"file://{tmp_path}/kv", {})
    server: RedisServer = request.getfixturevalue("redis_server")
    return Target("redis", server.url, {"timeout": 5})


@pytest.fixture
def model() -> str:
    """A model name of this test only, so tests sharing a redis-server never meet."""
    return f"kvplug-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def adapter(target: Target) -> Iterator[Any]:
    built = make_adapter(target.params())
    yield built
    built.close()


# -- LMCache's own check tool -----------------------------------------------------------------


def test_lmcache_basic_check_passes_through_the_plugin(target: Target, model: str) -> None:
    spec = json.dumps(plugin_spec(target.params()))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            BASIC_CHECK,
            "--mode",
            "test_l2_adapter",
            "--model",
            model,
            "--l2-adapter",
            spec,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "=== Testing L2 adapter #0 (KvplugL2Adapter) ===" in output, output
    for line in (
        "Validation: 5/5 correctly absent",
        "Batch store OK",
        "Validation: 5/5 found",
        "Validation (loaded): 5/5",
        "Validation (content): 5/5",
    ):
        assert line in output, output
    assert "Test Failed" not in output, output
    stored = target.model_keys(model)
    if stored is not None:  # the check really went through kvplug into the store
        assert len(stored) == 5


# -- the MP StorageManager ----------------------------------------------------------------------


def storage_manager(params: dict[str, Any]) -> StorageManager:
    """LMCache's StorageManager from its own argument parser, our adapter in the plugin JSON."""
    config = parse_args(
        [
            "--l1-size-gb",
            "0.05",
            "--eviction-policy",
            "LRU",
            "--l2-adapter",
            json.dumps(plugin_spec(params)),
        ]
    )
    return StorageManager(config)


def our_adapter(manager: StorageManager) -> Any:
    (_, adapter), *_ = manager.l2_adapters()
    assert isinstance(adapter, KvplugL2Adapter)
    return adapter


def write_l1(manager: StorageManager, keys: list[ObjectKey], seed: int) -> dict[ObjectKey, Any]:
    reserved = manager.reserve_write(keys, LAYOUT)
    assert set(reserved) == set(keys)
    written = {}
    for n, k in enumerate(keys):
        reserved[k].tensor.copy_(chunk(seed + n))
        written[k] = reserved[k].tensor.clone()
    manager.finish_write(keys)
    return written


def prefetch(manager: StorageManager, keys: list[ObjectKey]) -> Any:
    handle = manager.submit_prefetch_task(
        PrefetchTaskSpec(
            key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=LAYOUT)]
        )
    )
    assert manager.wait_prefetch_status(handle, DEADLINE), "prefetch did not finish"
    result = manager.query_prefetch_status(handle)
    assert result is not None
    return result


def stored_in_l2(manager: StorageManager, keys: list[ObjectKey]) -> Callable[[], bool]:
    """Whether the store controller is done and the adapter lists every key."""

    def check() -> bool:
        controller = manager.report_status()["store_controller"]
        if controller["pending_keys_count"] or controller["in_flight_task_count"]:
            return False
        listed = our_adapter(manager).list_l2_keys(model_name=keys[0].model_name)
        return {e.key.to_object_key() for e in listed.entries} >= set(keys)

    return check


def drop_from_l1(manager: StorageManager, keys: list[ObjectKey]) -> None:
    """Delete ``keys`` from L1 once the store controller has let go of them (it may still hold
    a read lock for a moment after the store is listed)."""
    deleted = 0

    def dropped() -> bool:
        nonlocal deleted
        deleted += manager.delete_l1_keys(keys)[0]
        return deleted == len(keys)

    wait_until(dropped, "L1 letting go of the stored keys")


def test_storage_manager_round_trip_is_bit_exact(target: Target, model: str) -> None:
    manager = storage_manager(target.params())
    try:
        adapter = our_adapter(manager)
        keys = [key(model, n) for n in range(6)]
        written = write_l1(manager, keys, seed=10)
        wait_until(stored_in_l2(manager, keys), "the store controller's L2 store")
        drop_from_l1(manager, keys)

        result = prefetch(manager, keys)
        assert (result.l1_hit_count, result.l2_hit_count) == (0, len(keys))
        with manager.read_prefetched_results(keys, result.l1_owners) as objects:
            assert objects is not None
            for k, obj in zip(keys, objects, strict=True):
                assert torch.equal(obj.tensor, written[k])
        manager.finish_read_prefetched(keys, l1_owners=result.l1_owners)
        wait_until(  # the prefetch controller unlocked them after the load
            lambda: adapter.report_status()["locked_keys"] == 0, "the controller's unlock"
        )
        status = manager.report_status()
        assert status["is_healthy"], status
    finally:
        manager.close()
    stored = target.model_keys(model)
    assert stored is None or set(stored) == set(keys)


# -- locks ---------------------------------------------------------------------------------------


def test_lookup_locks_count_and_unlock_releases_exactly_them(adapter: Any, model: str) -> None:
    driver = Driver(adapter)
    a, b, never = key(model, 1), key(model, 2), key(model, 3)
    data = {a: chunk(1), b: chunk(2)}
    assert driver.store([a, b], [l1_object(data[a]), l1_object(data[b])])

    assert driver.lookup([a, never]) == [True, False]
    assert driver.lookup([a]) == [True]  # two lookups: two locks on a
    adapter.submit_unlock([never, key(model, 4)])  # never locked: harmless
    adapter.submit_unlock([b])  # present but not locked: harmless too
    adapter.delete([a, b])  # LMCache's L2 eviction skips locked keys
    assert driver.lookup([b]) == [False]
    adapter.submit_unlock([a])
    driver.settle()
    assert adapter.report_status()["locked_keys"] == 1  # one lock of a left
    adapter.delete([a])
    out = l1_object(torch.zeros_like(data[a]))
    assert driver.load([a], [out]) == [True]
    assert torch.equal(out.tensor, data[a])

    adapter.submit_unlock([a, a])  # the last lock, then one more that is ignored
    driver.settle()
    assert adapter.report_status()["locked_keys"] == 0
    adapter.delete([a])
    assert driver.lookup([a]) == [False]
    assert adapter.get_usage().total_bytes_used == 0


def test_a_lock_never_given_back_ends_after_lock_ttl(target: Target, model: str) -> None:
    adapter = make_adapter(target.params(lock_ttl=0.2))
    try:
        driver = Driver(adapter)
        kept = key(model, 1)
        assert driver.store([kept], [l1_object(chunk(1))])
        assert driver.lookup([kept]) == [True]  # LMCache never collects or unlocks this one
        adapter.delete([kept])
        assert driver.lookup([kept]) == [True]  # still locked: not deleted
        time.sleep(0.5)  # past lock_ttl
        adapter.delete([kept])
        assert driver.lookup([kept]) == [False]
        adapter.submit_unlock([kept, kept, kept])  # late unlocks of expired locks: harmless
        driver.settle()
        assert adapter.report_status()["locked_keys"] == 0
    finally:
        adapter.close()


@pytest.mark.parametrize("scheme", ["cpu", "file"])
def test_a_locked_key_is_pinned_against_the_backends_eviction(
    scheme: str, tmp_path: Path, model: str
) -> None:
    room = {"cpu": "cpu://?max_size=64KiB", "file": f"file://{tmp_path}/kv?max_size=96KiB"}
    adapter = make_adapter({"url": room[scheme]})
    try:
        driver = Driver(adapter)
        small = torch.Size([8192])  # 16 KiB of fp16: a few fit
        locked, data = key(model, 0), chunk(0).view(-1)[: small.numel()].clone()
        assert driver.store([locked], [l1_object(data)])
        assert driver.lookup([locked]) == [True]
        assert adapter.report_status()["pins_locked_keys"]
        for n in range(1, 13):
            filler = l1_object(torch.full(small, n, dtype=torch.float16))
            assert driver.store([key(model, n)], [filler])
        out = l1_object(torch.zeros(small, dtype=torch.float16))
        assert driver.load([locked], [out]) == [True]
        assert torch.equal(out.tensor, data)

        adapter.submit_unlock([locked])
        driver.settle()
        for n in range(13, 25):
            filler = l1_object(torch.full(small, n, dtype=torch.float16))
            assert driver.store([key(model, n)], [filler])
        assert driver.lookup([locked]) == [False]  # unpinned: evicted like any other key
    finally:
        adapter.close()


# -- data ----------------------------------------------------------------------------------------


def test_keys_are_isolated_by_rank_group_salt_and_model(adapter: Any, model: str) -> None:
    driver = Driver(adapter)
    same_hash = b"\x00\x11" * 8
    variants = [
        ObjectKey(same_hash, model, 0),
        ObjectKey(same_hash, model, ObjectKey.ComputeKVRank(2, 1, 2, 1)),
        ObjectKey(same_hash, model, 0, object_group_id=1),
        ObjectKey(same_hash, model, 0, cache_salt="alice"),
        ObjectKey(same_hash, model, 0, cache_salt="bob"),
        ObjectKey(same_hash, model + "-other", 0),
    ]
    assert len({str(object_key_to_cache_key(v)) for v in variants}) == len(variants)
    data = [torch.full((256,), n, dtype=torch.float16) for n in range(len(variants))]
    for variant, tensor in zip(variants, data, strict=True):
        assert driver.store([variant], [l1_object(tensor)])
    outs = [l1_object(torch.zeros(256, dtype=torch.float16)) for _ in variants]
    assert driver.load(variants, outs) == [True] * len(variants)
    for out, tensor in zip(outs, data, strict=True):
        assert torch.equal(out.tensor, tensor)
    usage = adapter.get_usage()
    assert usage.bytes_by_cache_salt["alice"] == usage.bytes_by_cache_salt["bob"] == 512


def test_a_store_is_complete_when_reported(adapter: Any, target: Target, model: str) -> None:
    driver = Driver(adapter)
    keys = [key(model, n) for n in range(4)]
    buffers = [chunk(n) for n in range(4)]
    expected = [b.clone() for b in buffers]
    assert driver.store(keys, [l1_object(b) for b in buffers])
    for b in buffers:  # LMCache reuses its L1 buffers once a store is reported done
        b.fill_(-1)
    outs = [l1_object(torch.zeros_like(b)) for b in buffers]
    assert driver.load(keys, outs) == [True] * 4
    for out, want in zip(outs, expected, strict=True):
        assert torch.equal(out.tensor, want)
    # L1's buffers are lent only to a backend that lets go of them at once when a task is
    # cancelled (and, for stores, keeps nothing after the put: cpu:// keeps what it is given).
    status = adapter.report_status()
    lets_go = "releases_on_cancel" in status["capabilities"]
    assert status["zero_copy_puts"] is (lets_go and target.name != "cpu")
    assert status["zero_copy_loads"] is lets_go


def test_a_stored_object_of_another_size_is_a_failed_load(adapter: Any, model: str) -> None:
    driver = Driver(adapter)
    small, other = key(model, 1), key(model, 2)
    assert driver.store(
        [small, other],
        [l1_object(torch.ones(64, dtype=torch.float16)), l1_object(chunk(2).view(-1)[:128])],
    )
    wrong = l1_object(torch.full((128,), 7.0, dtype=torch.float16))
    right = l1_object(torch.zeros(128, dtype=torch.float16))
    assert driver.load([small, other], [wrong, right]) == [False, True]
    assert torch.equal(wrong.tensor, torch.full((128,), 7.0, dtype=torch.float16))  # untouched
    assert torch.equal(right.tensor, chunk(2).view(-1)[:128])
    assert adapter.report_status()["size_mismatches"] == 1


def test_report_status_counters_are_the_backends_own(adapter: Any, model: str) -> None:
    driver = Driver(adapter)
    keys = [key(model, n) for n in range(4)]
    assert driver.store(keys[:3], [l1_object(chunk(n)) for n in range(3)])
    assert driver.lookup(keys) == [True, True, True, False]
    outs = [l1_object(torch.zeros_like(chunk(0))) for _ in keys]
    assert driver.load(keys, outs) == [True, True, True, False]
    counters = adapter.report_status()["counters"]
    assert counters == summarize(adapter._backend.operation_stats()).as_dict()
    assert (counters["writes"], counters["bytes_written"]) == (3, 3 * CHUNK_BYTES)
    assert (counters["lookups"], counters["lookup_hits"]) == (4 + 1, 3)  # and the start's probe
    assert (counters["reads"], counters["hits"], counters["misses"]) == (4, 3, 1)
    assert (counters["bytes_read"], counters["hit_rate"]) == (3 * CHUNK_BYTES, 0.75)
    assert counters["errors"] == 0


# -- usage, listing, touch, status ------------------------------------------------------------


def test_usage_listing_touch_and_delete(adapter: Any, target: Target, model: str) -> None:
    driver = Driver(adapter)
    keys = [key(model, n) for n in range(5)]
    others = [key(model + "-x", n) for n in range(2)]
    assert driver.store(keys + others, [l1_object(chunk(n)) for n in range(7)])
    usage = adapter.get_usage()
    assert usage.total_bytes_used == 7 * CHUNK_BYTES
    capacity = {"cpu": 64 << 20, "file": 10 << 30, "redis": 0}[target.name]  # max_size or 0
    assert usage.total_capacity_bytes == capacity
    assert adapter.report_status()["max_capacity_bytes"] == capacity
    assert_usage(adapter.report_status(), target, objects=7)

    pages, cursor = [], None
    while True:
        page = adapter.list_l2_keys(model_name=model, page_size=2, cursor=cursor)
        pages.append(page.entries)
        cursor = page.next_page_token
        if cursor is None:
            break
    assert [len(p) for p in pages] == [2, 2, 1]
    listed = [entry.key.to_object_key() for p in pages for entry in p]
    assert sorted(listed, key=lambda k: k.chunk_hash) == keys
    assert {entry.size_bytes for p in pages for entry in p} == {CHUNK_BYTES}
    with pytest.raises(ValueError, match="cursor"):
        adapter.list_l2_keys(cursor="not-a-token")

    adapter.submit_touch(keys)  # a no-op for the data
    driver.settle()
    outs = [l1_object(torch.zeros_like(chunk(0))) for _ in keys]
    assert driver.load(keys, outs) == [True] * 5

    adapter.delete([*keys[:3], key(model, 99)])  # an absent key is skipped
    assert driver.lookup(keys) == [False, False, False, True, True]
    adapter.submit_unlock(keys[3:])
    assert adapter.get_usage().total_bytes_used == 4 * CHUNK_BYTES
    status = adapter.report_status()
    assert status["is_healthy"] and status["failed_stores"] == 0
    assert_usage(status, target, objects=4)
    json.dumps(status)  # LMCache serves it on its HTTP /status endpoint


def assert_usage(status: dict[str, Any], target: Target, objects: int) -> None:
    """The usage ``lmcache describe`` shows ("Stored objects", "Used"): the backend's own
    counters where it keeps them (cpu://, file://), else what the adapter stored (redis://)."""
    if target.name == "redis":
        assert status["usage_source"] == "adapter"
        assert status["stored_object_count"] == status["tracked_keys"] == objects
        assert status["current_size_bytes"] == status["bytes_used"] == objects * CHUNK_BYTES
    else:
        assert status["usage_source"] == "backend"
        assert status["stored_object_count"] == status["kvplug"]["keys"] == objects
        held = status["kvplug"]["bytes_held"]  # with kvplug's headers and the tier's rounding
        assert status["current_size_bytes"] == held >= objects * CHUNK_BYTES


def test_memory_tags_say_where_the_bytes_live(adapter: Any, target: Target) -> None:
    if LMCACHE_VERSION.startswith("0.5.6"):
        pytest.skip("LMCache 0.5.6 has no memory tags (get_memory_tags came with 0.5.7)")
    from lmcache.v1.distributed.api import MemoryResidency, MemorySegment

    tags = adapter.get_memory_tags()
    expected = {
        "cpu": (MemorySegment.DRAM, MemoryResidency.LOCAL),
        "file": (MemorySegment.STORAGE, MemoryResidency.LOCAL),
        "redis": (MemorySegment.STORAGE, MemoryResidency.REMOTE),
    }[target.name]
    assert (tags.segment, tags.residency) == expected


@needs_redis
def test_status_and_logs_never_show_the_password(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "s3cret-pw-" + uuid.uuid4().hex[:8]
    with RedisServer(password=secret) as server:
        adapter = make_adapter({"url": server.url, "options": {"timeout": 2}})
        try:
            driver = Driver(adapter)
            assert driver.store([key("m", 1)], [l1_object(chunk(1))])
            server.stop()
            assert not driver.store([key("m", 2)], [l1_object(chunk(2))])
            status = adapter.report_status()
        finally:
            adapter.close()
    assert not status["is_healthy"]
    assert status["last_error"]
    assert secret not in json.dumps(status)
    assert "KvplugL2Adapter on redis://" in caplog.text  # the failure was logged, masked
    assert secret not in caplog.text
    assert "127.0.0.1" in status["target"]


# -- configuration errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        ({}, ConfigError, "neither url nor config"),
        ({"url": "cpu://", "config": "/x.yaml"}, ConfigError, "both url and config"),
        ({"urll": "cpu://"}, ConfigError, "did you mean 'url'"),
        ({"url": "cpu://", "task_timeout": 0}, ConfigError, "task_timeout"),
        ({"url": 5}, ConfigError, "url must be a non-empty string"),
        ({"url": "cpu://", "options": ["timeout", 5]}, ConfigError, "options must be a mapping"),
        ({"url": "nosuch://x"}, UnknownScheme, "no installed kvplug plugin serves"),
        ({"url": "cpu://", "options": {"max_sise": "1GiB"}}, UnknownOption, "'max_size'"),
        ({"config": "/nonexistent/kvplug.yaml"}, ConfigError, "kvplug.yaml"),
    ],
)
def test_bad_adapter_params_fail_with_kvplugs_message(
    params: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make_adapter(params)


def test_an_unreachable_store_fails_at_start_unless_told_otherwise(model: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    with pytest.raises(BackendUnavailable, match="KvplugL2Adapter cannot reach redis://127"):
        make_adapter({"url": url, "options": {"timeout": 2}})
    adapter = make_adapter({"url": url, "options": {"timeout": 2}, "check_on_start": False})
    try:
        driver = Driver(adapter)
        assert driver.lookup([key(model, 1)]) == [False]
        assert not driver.store([key(model, 1)], [l1_object(chunk(1))])
        out = l1_object(torch.zeros_like(chunk(1)))
        assert driver.load([key(model, 1)], [out]) == [False]
        assert not adapter.report_status()["is_healthy"]
    finally:
        adapter.close()


def test_a_tiers_config_works_like_a_url(tmp_path: Path, model: str) -> None:
    earlier = make_adapter({"url": f"file://{tmp_path}/kv"})  # an earlier run, on the file tier
    try:
        earlier_keys = [key(model, n) for n in range(100, 102)]
        assert Driver(earlier).store(earlier_keys, [l1_object(chunk(n)) for n in range(2)])
    finally:
        earlier.close()
    config = tmp_path / "kvplug.yaml"
    config.write_text(f"tiers: ['cpu://?max_size=32MiB', 'file://{tmp_path}/kv']\n")
    adapter = make_adapter({"config": str(config)})
    try:
        assert not adapter.report_status()["zero_copy_puts"]  # a Store writes behind
        driver = Driver(adapter)
        keys = [key(model, n) for n in range(3)]
        buffers = [chunk(n) for n in range(3)]
        assert driver.store(keys, [l1_object(b) for b in buffers])
        for b in buffers:
            b.zero_()
        outs = [l1_object(torch.zeros_like(chunk(0))) for _ in keys]
        assert driver.load(keys, outs) == [True] * 3
        assert all(torch.equal(o.tensor, chunk(n)) for n, o in enumerate(outs))
        # Usage is the largest tier's (the file tier, where the capacity comes from), by its
        # own counters: the earlier run's objects too, once the write-behind reached it.
        wait_until(
            lambda: adapter.report_status()["stored_object_count"] == 5, "5 objects on file://"
        )
        status = adapter.report_status()
        assert status["usage_source"] == "backend" and status["tracked_keys"] == 3
        assert status["max_capacity_bytes"] == 10 << 30  # file://'s default max_size
        assert status["current_size_bytes"] >= 5 * CHUNK_BYTES
    finally:
        adapter.close()
    assert len(Target("file", f"file://{tmp_path}/kv", {}).model_keys(model) or []) == 5


# -- lmcache server ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"url": "nosuch://x"}, "no installed kvplug plugin serves the scheme 'nosuch'"),
        ({"url": "redis://127.0.0.1:{port}"}, "KvplugL2Adapter cannot reach redis://127.0.0.1"),
        ({"url": "cpu://", "options": {"max_sise": 1}}, "Did you mean 'max_size'?"),
    ],
)
def test_a_bad_adapter_config_stops_lmcache_server_at_start(
    params: dict[str, Any], message: str
) -> None:
    params = {
        **params,
        "url": params["url"].format(port=free_port()),
        "options": {**params.get("options", {}), "timeout": 2},
    }
    result = subprocess.run(
        server_command(params, free_port(), free_port()),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert message in output, output
    assert "cache server is running" not in output


def test_lmcache_server_runs_with_the_plugin_and_reports_its_status(
    tmp_path: Path, model: str
) -> None:
    params = {"url": f"file://{tmp_path}/kv"}
    earlier = make_adapter(params)  # an earlier server's objects, which this one finds
    try:
        assert Driver(earlier).store(
            [key(model, n) for n in range(3)], [l1_object(chunk(n)) for n in range(3)]
        )
        held = earlier.report_status()["current_size_bytes"]
    finally:
        earlier.close()
    with LMCacheServer(params) as server:
        status = server.status()
        assert status["is_healthy"] is True, status
        adapter_status = server.adapter_status()
        assert adapter_status["type"] == "KvplugL2Adapter"
        assert adapter_status["is_healthy"] is True
        assert adapter_status["target"] == params["url"]
        assert adapter_status["stored_object_count"] == 3
        # What an operator sees: LMCache's own describe command shows kvplug's usage.
        describe = subprocess.run(
            [str(LMCACHE_CLI), "describe", "kvcache", "--url", server.url],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    shown = describe.stdout + describe.stderr
    assert describe.returncode == 0, shown
    kvplug_section = shown.split("L2: KvplugL2Adapter")[-1]
    assert re.search(r"Stored objects:\s+3\n", kvplug_section), shown
    used = f"{fmt_bytes(held)} / {fmt_bytes(10 << 30)} (0.0%)"  # file://'s default max_size
    assert re.search(rf"Used:\s+{re.escape(used)}\n", kvplug_section), shown


# -- a store that goes down and comes back ----------------------------------------------------


@needs_redis
def test_redis_down_makes_loads_miss_and_stores_fail_then_recovers(model: str) -> None:
    with RedisServer() as server:
        params = {"url": server.url, "options": {"timeout": 2}, "task_timeout": 20}
        manager = storage_manager(params)
        try:
            adapter = our_adapter(manager)
            first = [key(model, n) for n in range(4)]
            write_l1(manager, first, seed=0)
            wait_until(stored_in_l2(manager, first), "the first L2 store")
            drop_from_l1(manager, first)

            server.stop()
            result = prefetch(manager, first)  # finishes: a miss, no hang
            assert (result.l1_hit_count, result.l2_hit_count) == (0, 0)
            second = [key(model, n) for n in range(10, 14)]
            write_l1(manager, second, seed=10)
            wait_until(
                lambda: (
                    adapter.report_status()["failed_stores"] >= 1
                    and manager.report_status()["store_controller"]["in_flight_task_count"] == 0
                ),
                "the failed L2 store",
            )
            result = prefetch(manager, second)  # LMCache kept them in L1
            assert result.l1_hit_count == len(second)
            manager.finish_read_prefetched(second, l1_owners=result.l1_owners)
            status = manager.report_status()
            assert status["store_controller"]["thread_alive"]
            assert status["prefetch_controller"]["is_healthy"]
            assert not status["l2_adapters"][0]["is_healthy"]

            server.start()  # the same port; the data is gone
            wait_until(
                lambda: (
                    prefetch(manager, first).l2_hit_count == 0
                    and adapter.report_status()["is_healthy"]
                ),
                "recovery",
            )
            third = [key(model, n) for n in range(20, 24)]
            written = write_l1(manager, third, seed=20)
            wait_until(stored_in_l2(manager, third), "an L2 store after recovery")
            drop_from_l1(manager, third)
            result = prefetch(manager, third)
            assert result.l2_hit_count == len(third)
            with manager.read_prefetched_results(third, result.l1_owners) as objects:
                assert objects is not None
                for k, obj in zip(third, objects, strict=True):
                    assert torch.equal(obj.tensor, written[k])
            manager.finish_read_prefetched(third, l1_owners=result.l1_owners)
            assert manager.report_status()["store_controller"]["thread_alive"]
        finally:
            manager.close()


def test_the_module_examples_run() -> None:
    result = doctest.testmod(l2_adapter, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
