"""The engine boundary in both LMCache modes, against LMCache's own code and real stores.

LMCache's MP L1 frees a buffer as soon as the store or load task that used it is reported
done, also when it is reported failed, and writes other data there. LMCache's in-process
memory honours reference counts, so there a buffer is reused once no reference is left. So:
a store or load that runs into a stalled store (a paused redis-server, a stalled ``file://``
worker, a write-behind that cannot write) is reported failed within ``task_timeout`` (or the
connector's deadline) plus a small margin; kvplug lets go of LMCache's buffer by then; a buffer
LMCache rewrites after the report keeps the rewrite; and every later read of the key returns
the bytes LMCache handed over, or a miss, never the rewrite. Each stalled-worker case runs on a
backend that is lent LMCache's buffers (``file://``, which declares ``releases_on_cancel``) and
on one that is not (the same disk backend without the declaration: copies and bounces).

Also here: ``report_status`` is one consistent snapshot while tasks fail and succeed, and
wrappers are seen through (capacity and memory tags of ``audit::file://``, the private copy of
``audit::store://``).
"""

from __future__ import annotations

import importlib.metadata
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lmcache_support import (
    CHUNK_BYTES,
    DEADLINE,
    UNDECLARED,
    Driver,
    chunk,
    connector_of,
    engine_key,
    filled,
    key,
    l1_object,
    make_adapter,
    remote_backend,
    same_bits,
    serve_undeclared,
    wait_until,
)

from kvplug.backend import Backend
from kvplug.errors import BackendTimeout
from kvplug.keys import CacheKey
from kvplug.runtime.store import Store, store_url
from kvplug.runtime.sync import SyncClient
from kvplug_lmcache.keys import engine_key_to_cache_key, object_key_to_cache_key
from kvplug_testing import RedisServer
from kvplug_testing.stall import stall_disk
from kvplug_testing.threads import no_thread_left_behind

TASK_TIMEOUT = 1.0
MARGIN = 0.75
"""Seconds a failed task may take beyond its deadline (measured: at most 0.012 s when idle)."""
LMCACHE_VERSION = importlib.metadata.version("lmcache")

needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (bash scripts/setup.sh installs it)",
)
PATHS = {"lent": "file", "copied": UNDECLARED}
"""The backend each stalled-worker case runs on: one lent LMCache's buffers, one not."""


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    """Every thread a test starts (IO threads, file I/O workers) has ended once the adapter
    or connector it opened is closed."""
    with no_thread_left_behind():
        yield


@pytest.fixture(params=list(PATHS))
def scheme(request: pytest.FixtureRequest) -> str:
    serve_undeclared()
    return PATHS[request.param]


@pytest.fixture
def model() -> str:
    """A model name of this test only, so tests sharing a store never meet."""
    return f"boundary-{uuid.uuid4().hex[:12]}"


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.monotonic()
    result = call()
    return time.monotonic() - started, result


def timed_out(future: Any) -> float:
    """Seconds until LMCache's put ``future`` failed with the connector's deadline."""
    started = time.monotonic()
    with pytest.raises(BackendTimeout, match="did not finish within"):
        future.result(DEADLINE)
    return time.monotonic() - started


def lets_go(obj: Any) -> bool:
    """Whether kvplug gives back its reference to LMCache's object ``obj`` (LMCache's own
    left) within the margin."""
    deadline = time.monotonic() + MARGIN
    while obj.get_ref_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(obj.get_ref_count() == 1)


def disks_of(backend: Backend) -> list[Any]:
    """The disk backends behind ``backend``, through wrappers and Stores, in tier order."""
    inner = getattr(backend, "inner", None)
    if isinstance(inner, Backend):
        return disks_of(inner)
    if isinstance(backend, Store):
        return [disk for tier in backend.tiers for disk in disks_of(tier)]
    return [backend] if backend.url.scheme in ("file", UNDECLARED) else []


def read_back(url: str, stored: CacheKey) -> torch.Tensor | None:
    """The bytes another client of ``url`` reads under ``stored``, or None."""
    with SyncClient(url) as client:
        found = client.get(stored).result(DEADLINE)
        if found is None:
            return None
        data = found.raw.clone()
        found.release()
        return data


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


# -- the MP adapter: the audit wrapper's delay fault --------------------------------------------


def test_tasks_the_audit_wrapper_delays_past_their_deadline_fail_in_time_and_stay_away(
    tmp_path: Path, model: str
) -> None:
    disk = f"file://{tmp_path}/kv"
    delay = 3 * TASK_TIMEOUT
    slow = f"audit://?delay={delay}&delay_ops=batched_put,batched_get::{disk}"
    stored, present = key(model, 1), key(model, 2)
    plain = make_adapter({"url": disk, "task_timeout": TASK_TIMEOUT})
    try:
        assert Driver(plain).store([present], [l1_object(chunk(2))])
    finally:
        plain.close()
    adapter = make_adapter({"url": slow, "task_timeout": TASK_TIMEOUT})
    try:
        driver = Driver(adapter)
        buffer, out = chunk(1), torch.zeros_like(chunk(1))
        original = buffer.clone()
        took_store, ok = timed(lambda: driver.store([stored], [l1_object(buffer)]))
        buffer.fill_(-2.5)  # reported done: L1 hands the buffers to other data
        took_load, loaded = timed(lambda: driver.load([present], [l1_object(out)]))
        out.fill_(-2.5)
        rewritten = out.clone()
        time.sleep(delay)  # past the delay: what a task still going on would do, it has done
        assert not ok and loaded == [False]
        assert took_store < TASK_TIMEOUT + MARGIN and took_load < TASK_TIMEOUT + MARGIN
        assert torch.equal(out, rewritten), "a late read wrote into the freed buffer"
    finally:
        adapter.close()
    got = read_back(disk, object_key_to_cache_key(stored))
    assert got is None or torch.equal(got, as_bytes(original)), "the rewrite landed"


# -- the MP adapter: a stalled file:// worker ---------------------------------------------------


@pytest.mark.parametrize("where", ["before", "while"])
def test_a_store_stalled_in_a_disk_worker_fails_in_time_and_a_rewrite_never_lands(
    scheme: str, where: str, tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = make_adapter(
        {"url": f"{scheme}://{tmp_path}/kv?o_direct=false", "task_timeout": TASK_TIMEOUT}
    )
    try:
        driver = Driver(adapter)
        stored = key(model, 1)
        buffer = chunk(1)
        original = buffer.clone()
        (disk,) = disks_of(adapter._backend)
        stall = stall_disk(monkeypatch, disk, "store", where)
        try:
            took, ok = timed(lambda: driver.store([stored], [l1_object(buffer)]))
            buffer.fill_(-2.5)  # reported done: L1 hands the buffer to other data
        finally:
            stall.release()
        out = torch.zeros_like(buffer)
        if driver.load([stored], [l1_object(out)]) == [True]:
            assert not torch.equal(out, buffer), "a rewrite after the failure report was stored"
            assert torch.equal(out, original)
        assert stall.reached.is_set()
        assert not ok
        assert took < TASK_TIMEOUT + MARGIN
        status = adapter.report_status()
        assert (status["failed_stores"], status["stores_finished"]) == (1, 1)
    finally:
        adapter.close()


@pytest.mark.parametrize("where", ["before", "while"])
def test_a_load_stalled_in_a_disk_worker_fails_in_time_and_never_writes_the_buffer_later(
    scheme: str, where: str, tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = make_adapter({"url": f"{scheme}://{tmp_path}/kv", "task_timeout": TASK_TIMEOUT})
    try:
        driver = Driver(adapter)
        stored = key(model, 1)
        assert driver.store([stored], [l1_object(chunk(1))])
        (disk,) = disks_of(adapter._backend)
        stall = stall_disk(monkeypatch, disk, "load", where)
        out = torch.zeros_like(chunk(1))
        try:
            took, loaded = timed(lambda: driver.load([stored], [l1_object(out)]))
            out.fill_(-2.5)  # reported done: L1 hands the buffer to other data
            rewritten = out.clone()
        finally:
            stall.release()
        assert torch.equal(out, rewritten), "a late read wrote into the freed buffer"
        assert stall.reached.is_set()
        assert loaded == [False]
        assert took < TASK_TIMEOUT + MARGIN
        again = torch.zeros_like(out)
        assert driver.load([stored], [l1_object(again)]) == [True]
        assert torch.equal(again, chunk(1))
        assert adapter.report_status()["failed_loads"] == 1
    finally:
        adapter.close()


# -- the MP adapter: a paused redis-server --------------------------------------------------------


@needs_redis
def test_a_paused_redis_fails_adapter_tasks_in_time_and_nothing_lands_later(model: str) -> None:
    with RedisServer() as server:
        # kvplug's own Redis timeout is long: only task_timeout ends the tasks.
        params = {"url": server.url, "options": {"timeout": 30}, "task_timeout": TASK_TIMEOUT}
        adapter = make_adapter(params)
        try:
            driver = Driver(adapter)
            kept, late = key(model, 1), key(model, 2)
            assert driver.store([kept], [l1_object(chunk(1))])
            buffer, out = chunk(2), torch.zeros_like(chunk(1))
            original = buffer.clone()
            server.pause()
            try:
                took, ok = timed(lambda: driver.store([late], [l1_object(buffer)]))
                assert not ok
                assert took < TASK_TIMEOUT + MARGIN
                buffer.fill_(-2.5)
                took, loaded = timed(lambda: driver.load([kept], [l1_object(out)]))
                assert loaded == [False]
                assert took < TASK_TIMEOUT + MARGIN
                out.fill_(-3.5)
                rewritten = out.clone()
            finally:
                server.resume()
            again = torch.zeros_like(out)
            assert driver.load([kept], [l1_object(again)]) == [True]  # a round trip after both
            assert torch.equal(again, chunk(1))
            assert torch.equal(out, rewritten), "a late reply wrote into the freed buffer"
            if driver.load([late], [l1_object(again)]) == [True]:
                assert torch.equal(again, original), "a rewrite after the failure was stored"
            status = adapter.report_status()
            assert (status["failed_stores"], status["failed_loads"]) == (1, 1)
        finally:
            adapter.close()


# -- wrappers are seen through -------------------------------------------------------------------


def two_disk_tiers(tmp_path: Path) -> tuple[str, str]:
    """``audit::store://`` over two disk tiers (the second written behind), and the URL of the
    second."""
    lower = f"file://{tmp_path}/lower"
    tiers = tmp_path / "kvplug.yaml"
    tiers.write_text(yaml.safe_dump({"tiers": [f"file://{tmp_path}/upper", lower]}))
    return f"audit::{store_url(tiers)}", lower


def test_an_audited_store_copies_so_a_rewrite_never_reaches_the_lower_tier(
    tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, lower = two_disk_tiers(tmp_path)
    adapter = make_adapter({"url": url, "task_timeout": TASK_TIMEOUT})
    stored = key(model, 1)
    buffer = chunk(1)
    original = as_bytes(buffer).clone()
    try:
        _, lower_disk = disks_of(adapter._backend)
        stall = stall_disk(monkeypatch, lower_disk, "store", "before")
        try:
            assert Driver(adapter).store([stored], [l1_object(buffer)])
            assert stall.reached.wait(DEADLINE), "the write-behind never started"
            buffer.fill_(-2.5)  # reported done: L1 reuses the buffer
        finally:
            stall.release()
        lower_key = object_key_to_cache_key(stored)
        wait_until(lambda: read_back(lower, lower_key) is not None, "the write-behind")
        assert torch.equal(read_back(lower, lower_key), original)
        assert not adapter.report_status()["zero_copy_puts"]  # the Store writes behind
    finally:
        adapter.close()


def test_capacity_and_memory_tags_see_through_the_audit_wrapper(tmp_path: Path) -> None:
    plain = make_adapter({"url": f"file://{tmp_path}/a?max_size=96MiB"})
    audited = make_adapter({"url": f"audit::file://{tmp_path}/b?max_size=96MiB"})
    try:
        for adapter in (plain, audited):
            assert adapter.get_usage().total_capacity_bytes == 96 << 20
        if not LMCACHE_VERSION.startswith("0.5.6"):  # memory tags came with LMCache 0.5.7
            plain_tags, audited_tags = (a.get_memory_tags() for a in (plain, audited))
            assert audited_tags.segment == plain_tags.segment
            assert audited_tags.residency == plain_tags.residency
    finally:
        plain.close()
        audited.close()


# -- report_status: one consistent snapshot -------------------------------------------------------


def inconsistencies(status: dict[str, Any]) -> list[str]:
    """What in one ``report_status`` does not agree with the rest of it."""
    found = []
    if status["healthy"] is not status["is_healthy"]:
        found.append("healthy differs from is_healthy")
    if status["is_healthy"] and (status.get("failing_tiers") or not status["io_thread_alive"]):
        found.append("is_healthy with a failing tier or a dead IO thread")
    if not status["is_healthy"] and not (
        status.get("failing_tiers") or status["last_error"] or not status["io_thread_alive"]
    ):
        found.append("unhealthy without a reason")
    if status["bytes_used"] != status["tracked_keys"] * CHUNK_BYTES:
        found.append("bytes_used is not the size of the tracked keys")
    kinds = ("stores", "lookups", "loads")
    if any(f"{kind}_finished" not in status for kind in kinds) or "tasks_submitted" not in status:
        return [*found, "no task counts"]
    finished = sum(status[f"{kind}_finished"] for kind in kinds)
    if status["tasks_submitted"] != finished + status["in_flight_tasks"]:
        found.append("tasks submitted are not those finished and in flight")
    for kind in kinds:
        if status[f"failed_{kind}"] > status[f"{kind}_finished"]:
            found.append(f"more failed {kind} than finished")
    return found


ROUNDS = 25
"""Store, lookup and load rounds of each of the two threads of the status test."""


def test_report_status_is_consistent_while_tasks_fail_and_succeed(
    tmp_path: Path, model: str
) -> None:
    # The lower tier fails half its writes and removals, and is skipped for a moment after
    # each failure: stores fail (the Store removes a lower tier's older value before it
    # accepts a put) or succeed; loads succeed from the upper tier.
    faulty = (
        f"audit://?fail_rate=0.5&fail_ops=put,batched_put,remove&seed=7::file://{tmp_path}/lower"
    )
    tiers = tmp_path / "kvplug.yaml"
    tiers.write_text(yaml.safe_dump({"tiers": ["cpu://?max_size=64MiB", faulty]}))
    skip = {"backoff": 0.005, "max_backoff": 0.01}  # a failing tier is retried soon
    adapter = make_adapter({"config": str(tiers), "options": skip, "task_timeout": 10})
    snapshots: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    driver = Driver(adapter)  # one, as LMCache's controllers: it collects every store result

    def work(worker: int) -> None:
        try:
            for n in range(ROUNDS):
                stored, never = key(model, worker * 1000 + n), key(model, 500_000 + n)
                driver.store([stored], [l1_object(chunk(n))])
                driver.lookup([stored, never])
                adapter.submit_unlock([stored])
                driver.load([stored, never], [l1_object(chunk(0)) for _ in "ab"])
        except BaseException as error:
            errors.append(error)

    def watch() -> None:
        while not done.is_set():
            snapshots.append(adapter.report_status())
            time.sleep(0.002)  # each status costs the IO thread a round trip: leave it room

    workers = [threading.Thread(target=work, args=(w,)) for w in range(2)]
    watcher = threading.Thread(target=watch)
    try:
        watcher.start()
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(DEADLINE)
    finally:
        done.set()
        watcher.join(DEADLINE)
        last = adapter.report_status()
        adapter.close()
    assert not errors, errors
    assert len(snapshots) > 10
    problems = Counter(problem for s in [*snapshots, last] for problem in inconsistencies(s))
    assert not problems, f"{problems} in {len(snapshots) + 1} snapshots"
    assert last["stores_finished"] == last["loads_finished"] == 2 * ROUNDS
    assert 0 < last["failed_stores"] < 2 * ROUNDS  # some stores failed, some did not
    assert any(s.get("failing_tiers") for s in snapshots)


# -- the in-process connector ---------------------------------------------------------------


@needs_redis
def test_a_paused_redis_fails_connector_calls_in_time_and_kvplug_lets_go(model: str) -> None:
    """LMCache's reads miss and its put fails within the deadline; kvplug lets go of LMCache's
    buffer by then (the put is cancelled, not left running), so LMCache may reuse it; after
    SIGCONT the key holds the bytes LMCache handed over, or nothing."""
    with RedisServer() as server:
        settings = {"url": server.url, "timeout": 30}  # only LMCache's deadline ends a call
        with remote_backend(settings, model, blocking_timeout_secs=1) as (remote, cpu, meta):
            connector = connector_of(remote)
            kept, late = engine_key(model, 1), engine_key(model, 2)
            obj = filled(cpu, meta, seed=1)
            remote.submit_put_task(kept, obj).result(DEADLINE)
            original = obj.tensor.clone()
            server.pause()
            try:
                took, got = timed(lambda: remote.get_blocking(kept))
                assert got is None
                assert took < connector.deadline + MARGIN
                assert timed_out(remote.submit_put_task(late, obj)) < connector.deadline + MARGIN
                wait_until(lambda: remote.put_failed_count == 1, "LMCache's failure count")
                assert lets_go(obj), "kvplug still holds LMCache's buffer"
                obj.tensor.fill_(-2.5)  # no reference left: LMCache may reuse the buffer
            finally:
                server.resume()
            got = remote.get_blocking(kept)
            assert got is not None and same_bits(got.tensor, original)
            got.ref_count_down()
            got = remote.get_blocking(late)
            if got is not None:
                assert same_bits(got.tensor, original), "a rewrite after the failure was stored"
                got.ref_count_down()
            obj.ref_count_down()


@pytest.mark.parametrize("where", ["before", "while"])
def test_a_connector_put_stalled_in_a_disk_worker_fails_in_time_and_lets_go(
    scheme: str, where: str, tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = {"url": f"{scheme}://{tmp_path}/kv?o_direct=false"}
    with remote_backend(settings, model, blocking_timeout_secs=1) as (remote, cpu, meta):
        connector = connector_of(remote)
        (disk,) = disks_of(connector._client.backend)
        stored = engine_key(model, 1)
        obj = filled(cpu, meta, seed=1)
        original = obj.tensor.clone()
        stall = stall_disk(monkeypatch, disk, "store", where)
        try:
            assert timed_out(remote.submit_put_task(stored, obj)) < connector.deadline + MARGIN
            assert stall.reached.is_set()
            assert lets_go(obj), "kvplug still holds LMCache's buffer"
            obj.tensor.fill_(-2.5)  # no reference left: LMCache may reuse the buffer
        finally:
            stall.release()
        got = remote.get_blocking(stored)
        if got is not None:
            assert same_bits(got.tensor, original), "a rewrite after the failure was stored"
            got.ref_count_down()
        assert connector.stats()["put_failures"] == 1
        obj.ref_count_down()


def test_an_audited_store_behind_the_connector_copies(
    tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, lower = two_disk_tiers(tmp_path)
    stored = engine_key(model, 1)
    with remote_backend({"url": url}, model) as (remote, cpu, meta):
        connector = connector_of(remote)
        _, lower_disk = disks_of(connector._client.backend)
        obj = filled(cpu, meta, seed=1)
        original = as_bytes(obj.tensor).clone()
        stall = stall_disk(monkeypatch, lower_disk, "store", "before")
        try:
            remote.submit_put_task(stored, obj).result(DEADLINE)
            assert stall.reached.wait(DEADLINE), "the write-behind never started"
            wait_until(lambda: obj.get_ref_count() == 1, "kvplug letting go of the buffer")
            obj.tensor.fill_(-2.5)  # no reference left: LMCache may reuse the buffer
        finally:
            stall.release()
        lower_key = engine_key_to_cache_key(stored)
        wait_until(lambda: read_back(lower, lower_key) is not None, "the write-behind")
        assert torch.equal(read_back(lower, lower_key), original)
        assert connector.copies_puts  # the Store writes behind
        obj.ref_count_down()
