"""The engine boundary, against vLLM's own tiering code: once KvplugTier reports a job finished
through ``get_finished_jobs`` (failed too), vLLM may reuse the job's primary-tier rows, so kvplug
never reads or writes them again; a job past its ``task_timeout`` is reported failed by then;
what a key holds is what the row held when its store was submitted, never a later rewrite; and
``drain_jobs`` and ``shutdown`` (after which vLLM unmaps the rows) end within the deadline too.

The slow stores are real: a redis-server paused with SIGSTOP, a ``file://`` tier whose worker
thread stalls (before, or while, it touches the buffer it was given), and ``audit::store://``
over two tiers whose lower one stalls its write-behind. Each test rewrites the rows right after
the failure report, as vLLM may, then lets the stall go and checks the rows and the store. The
disk tests run on ``file://`` as it declares itself and behind :class:`Unlent`, so that both
ways kvplug moves rows (lent to the backend, or copied) are covered; :class:`Holding` is a
backend that breaks its contract, which must fail a reset and a shutdown in time, not hang them.

The tiers are driven as vLLM's ``TieringOffloadingManager`` drives them (``submit_store``,
``submit_load``, polling ``get_finished_jobs``), on rows of the primary tier it built.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

import kvplug_vllm.tier
from kvplug import Backend, BackendSpec, CacheKey, KvplugError, MemoryObj, register_backend
from kvplug.backend import Wrapper
from kvplug.runtime.engine import tiers_of
from kvplug_disk import DiskBackend
from kvplug_testing import RedisServer
from kvplug_testing.stall import stall_disk
from kvplug_vllm import KvplugTier
from kvplug_vllm.testing import ROW_BYTES, Engine, chunk_keys, payloads

Start = Callable[..., Engine]

TASK_TIMEOUT = 1.0
"""The tiers' ``task_timeout`` here."""
LATE = 1.5
"""Seconds past ``task_timeout`` within which a failed job must be reported (the operation's
unwinding, the polling here, a busy machine)."""
CALL = 0.5
"""Seconds an engine call that must not block (submit, poll) may take on a busy machine."""
WRAPS = pytest.mark.parametrize("wrap", ["", "unlent::"], ids=["as-declared", "unlent"])
"""Each stalled-disk test runs on ``file://`` as it declares itself (lent the rows where it
declares ``releases_on_cancel``) and behind :class:`Unlent` (given copies)."""
STALL = 30.0
"""Seconds a stalled worker waits at most for the test to let it go (never reached when the
test passes)."""
REWRITE = b"\xee" * ROW_BYTES
"""What the engine writes into a row once the job that used it is reported."""
BLANK = b"\x11" * ROW_BYTES


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    """Fails a test that leaves a thread running after its engines are shut down."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"threads left running: {[t.name for t in left]}"


class Unlent(Wrapper):
    """``unlent::<url>``: the backend at ``url`` without its ``releases_on_cancel``
    capability, like any backend that does not declare it: kvplug stores a copy of the rows
    and reads into memory of its own, never lending the rows to the backend."""

    def __init__(self, url: str, *, inner: Backend, **options: Any) -> None:
        super().__init__(url, inner=inner, **options)
        if getattr(self.capabilities, "releases_on_cancel", False):
            self.capabilities = dataclasses.replace(self.capabilities, releases_on_cancel=False)


class Holding(Wrapper):
    """``holding::<url>``: a backend that breaks its contract: it declares
    ``releases_on_cancel``, yet a thread of its keeps the buffer of every read into the
    caller's memory until :attr:`let_go` is set, also after the read was cancelled."""

    let_go = threading.Event()

    def __init__(self, url: str, *, inner: Backend, **options: Any) -> None:
        super().__init__(url, inner=inner, **options)
        if "releases_on_cancel" in {field.name for field in dataclasses.fields(self.capabilities)}:
            self.capabilities = dataclasses.replace(self.capabilities, releases_on_cancel=True)

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        held = [dest.retain() for dest in dests]

        def hold() -> None:
            Holding.let_go.wait(STALL)
            for dest in held:
                dest.release()

        threading.Thread(target=hold, name="test-holding").start()
        await asyncio.sleep(STALL)
        return [False] * len(keys)


@pytest.fixture(scope="module", autouse=True)
def scheme_wrappers() -> None:
    for name, wrapper in (("unlent", Unlent), ("holding", Holding)):
        spec = BackendSpec(name, (name,), f"{__name__}:{wrapper.__name__}", kind="wrapper")
        register_backend(spec, replace=True)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash scripts/setup.sh installs it)")
    with RedisServer() as server:
        yield server


class Jobs:
    """Submits jobs on rows of ``engine``'s primary tier to its kvplug tier and collects their
    results, as vLLM's tiering manager does; every call is timed against :data:`CALL`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tier: KvplugTier = engine.tier
        self._ids = itertools.count(1)
        self._submitted: dict[int, float] = {}
        self._results: dict[int, tuple[JobResult, float]] = {}

    def write(self, row: int, data: bytes) -> None:
        self.engine.rows[row] = np.frombuffer(data, dtype=np.int8)

    def row(self, row: int) -> bytes:
        return bytes(self.engine.rows[row].tobytes())

    def _submit(self, keys: list[OffloadKey], rows: list[int], promotion: bool) -> int:
        job = next(self._ids)
        metadata = TransferJob(job, keys, np.array(rows), promotion, ReqContext(f"req-{job}"))
        started = time.monotonic()
        (self.tier.submit_load if promotion else self.tier.submit_store)(metadata)
        assert time.monotonic() - started < CALL, "submitting a job blocked"
        self._submitted[job] = started
        return job

    def store(self, keys: list[OffloadKey], rows: list[int]) -> int:
        return self._submit(keys, rows, promotion=False)

    def load(self, keys: list[OffloadKey], rows: list[int]) -> int:
        return self._submit(keys, rows, promotion=True)

    def poll(self) -> None:
        started = time.monotonic()
        for result in self.tier.get_finished_jobs():
            self._results[result.job_id] = (result, time.monotonic())
        assert time.monotonic() - started < CALL, "get_finished_jobs blocked"

    def reported(self, job: int) -> bool:
        self.poll()
        return job in self._results

    def wait(self, job: int, within: float = 30.0) -> tuple[JobResult, float]:
        """The job's result and the seconds from its submission to its report; fails when it
        is not reported within ``within`` seconds."""
        deadline = time.monotonic() + within
        while not self.reported(job):
            assert time.monotonic() < deadline, f"job {job} not reported within {within} s"
            time.sleep(0.005)
        result, at = self._results[job]
        return result, at - self._submitted[job]

    def failed_in_time(self, job: int) -> None:
        """The job is reported failed within ``task_timeout`` plus :data:`LATE`."""
        result, took = self.wait(job, within=TASK_TIMEOUT + LATE)
        assert not result.success and not result.successful_keys
        assert took < TASK_TIMEOUT + LATE

    def read(self, keys: list[OffloadKey], rows: list[int]) -> list[bytes | None]:
        """Load ``keys`` into ``rows`` (blanked first): each row's bytes, or None for a miss."""
        for row in rows:
            self.write(row, BLANK)
        result, _ = self.wait(self.load(keys, rows))
        hits = set(keys if result.success else result.successful_keys or ())
        return [self.row(row) if key in hits else None for key, row in zip(keys, rows, strict=True)]


def disk_of(tier: KvplugTier) -> DiskBackend:
    """The ``file://`` backend under the tier: the tier's own, or inside wrappers and Stores."""
    disks = [b for b in tiers_of(tier._client.backend) if isinstance(b, DiskBackend)]
    assert len(disks) == 1, f"not one file:// backend under {tier}: {disks}"
    return disks[0]


def stalling(start: Start, url: str, **tier: Any) -> Engine:
    """An engine whose tier is the ``file://`` tier at ``url``, whose worker a test stalls."""
    engine = start({"url": url, "task_timeout": TASK_TIMEOUT, **tier})
    capabilities = engine.tier._client.backend.capabilities
    if url.startswith("unlent::"):  # so kvplug copies and reads into its own memory
        assert not getattr(capabilities, "releases_on_cancel", False)
    return engine


def stored_earlier(start: Start, url: str, keys: list[OffloadKey], data: list[bytes]) -> None:
    """An earlier engine on ``url`` that stored ``data`` under ``keys`` and shut down."""
    writer = start({"url": url})
    writer.offload(keys, data)
    writer.settle()
    writer.close()


# -- a paused redis-server ----------------------------------------------------------------------


def lookups_in_flight(engine: Engine, requests: int) -> None:
    """Lookups of ``requests`` requests sent to the tier's lookup thread, one batch each."""
    for seed in range(requests):
        context = engine.request()
        with engine.locked():
            answers = [engine.manager.lookup(k, context) for k in chunk_keys(2, seed=100 + seed)]
        assert answers == [LookupResult.RETRY] * 2
    engine.step()  # the step's end sends them


def test_a_paused_redis_fails_jobs_by_the_deadline_a_reset_waits_for_nothing_no_rewrite_lands(
    start: Start, own_redis: RedisServer
) -> None:
    store = {"url": own_redis.url, "options": {"timeout": 30}}
    engine = start({**store, "task_timeout": TASK_TIMEOUT, "lookup_timeout": TASK_TIMEOUT})
    jobs = Jobs(engine)
    keys = chunk_keys(2)
    data = payloads(2, ROW_BYTES)
    jobs.write(0, data[0])
    assert jobs.wait(jobs.store(keys[:1], [0]))[0].success
    own_redis.pause()
    try:
        jobs.write(1, data[1])
        jobs.write(2, BLANK)
        stored, loaded = jobs.store(keys[1:], [1]), jobs.load(keys[:1], [2])
        lookups_in_flight(engine, 5)
        jobs.failed_in_time(stored)
        jobs.failed_in_time(loaded)
        jobs.write(1, REWRITE)
        jobs.write(2, REWRITE)
        started = time.monotonic()
        engine.tier.drain_jobs()  # a cache reset: vLLM then reuses every row
        assert time.monotonic() - started < LATE
    finally:
        own_redis.resume()
    assert jobs.row(1) == jobs.row(2) == REWRITE
    engine.close()
    restarted = Jobs(start(store))
    assert restarted.read(keys, [3, 4]) in ([data[0], None], data)


def test_a_shutdown_with_jobs_and_lookups_stuck_in_a_paused_redis_ends_within_the_deadline(
    start: Start, own_redis: RedisServer
) -> None:
    engine = start(
        {
            "url": own_redis.url,
            "options": {"timeout": 30},
            "task_timeout": TASK_TIMEOUT,
            "lookup_timeout": TASK_TIMEOUT,
        }
    )
    jobs = Jobs(engine)
    own_redis.pause()
    try:
        jobs.write(0, payloads(1, ROW_BYTES)[0])
        jobs.store(chunk_keys(1), [0])
        jobs.load(chunk_keys(1, seed=1), [1])
        lookups_in_flight(engine, 5)
        started = time.monotonic()
        engine.close()
        assert time.monotonic() - started < TASK_TIMEOUT + LATE
    finally:
        own_redis.resume()


# -- the audit wrapper's delay fault -------------------------------------------------------------


def test_jobs_the_audit_wrapper_delays_past_their_deadline_fail_in_time_and_stay_away(
    start: Start, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/kv"
    delay = 3 * TASK_TIMEOUT
    keys = chunk_keys(2)
    data = payloads(2, ROW_BYTES)
    stored_earlier(start, url, keys[:1], data[:1])
    slow = f"audit://?delay={delay}&delay_ops=batched_put,batched_get::{url}"
    engine = start({"url": slow, "task_timeout": TASK_TIMEOUT})
    jobs = Jobs(engine)
    jobs.write(0, data[1])
    jobs.write(1, BLANK)
    storing, loading = jobs.store(keys[1:], [0]), jobs.load(keys[:1], [1])
    jobs.failed_in_time(storing)
    jobs.failed_in_time(loading)
    jobs.write(0, REWRITE)  # vLLM reuses the rows of the failed jobs
    jobs.write(1, REWRITE)
    time.sleep(delay)  # past the delay: what a job still going on would do, it has done
    assert jobs.row(1) == REWRITE, "a late read wrote the row"
    engine.close()
    assert Jobs(start({"url": url})).read(keys[1:], [2]) in ([data[1]], [None])


# -- a stalled file:// worker -------------------------------------------------------------------


@WRAPS
@pytest.mark.parametrize("where", ["before", "while"])
def test_a_load_whose_disk_worker_stalls_is_reported_failed_and_never_writes_the_row_late(
    start: Start, tmp_path: Path, where: str, wrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}/kv"
    keys = chunk_keys(1)
    data = payloads(1, ROW_BYTES)
    stored_earlier(start, url, keys, data)
    engine = stalling(start, wrap + url)
    jobs = Jobs(engine)
    stall = stall_disk(monkeypatch, disk_of(engine.tier), "load", where)
    try:
        jobs.write(3, BLANK)
        loading = jobs.load(keys, [3])
        assert stall.reached.wait(TASK_TIMEOUT + LATE)
        jobs.failed_in_time(loading)
        jobs.write(3, REWRITE)
    finally:
        stall.release()
    assert jobs.row(3) == REWRITE
    assert jobs.read(keys, [4]) == data


@WRAPS
@pytest.mark.parametrize("where", ["before", "while"])
def test_a_store_whose_disk_worker_stalls_is_reported_failed_and_never_persists_the_rewrite(
    start: Start, tmp_path: Path, where: str, wrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}/kv"
    keys = chunk_keys(1)
    data = payloads(1, ROW_BYTES)
    engine = stalling(start, wrap + url)
    jobs = Jobs(engine)
    stall = stall_disk(monkeypatch, disk_of(engine.tier), "store", where)
    try:
        jobs.write(0, data[0])
        storing = jobs.store(keys, [0])
        assert stall.reached.wait(TASK_TIMEOUT + LATE)
        jobs.failed_in_time(storing)
        jobs.write(0, REWRITE)
    finally:
        stall.release()
    assert jobs.read(keys, [1]) in ([data[0]], [None])
    engine.close()
    assert Jobs(start({"url": url})).read(keys, [1]) in ([data[0]], [None])


@WRAPS
def test_a_shutdown_with_a_disk_worker_stalled_on_a_load_ends_within_the_deadline(
    start: Start, tmp_path: Path, wrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}/kv"
    keys = chunk_keys(1)
    stored_earlier(start, url, keys, payloads(1, ROW_BYTES))
    engine = stalling(start, wrap + url, options={"timeout": 1})
    jobs = Jobs(engine)
    stall = stall_disk(monkeypatch, disk_of(engine.tier), "load", "before")
    closing = threading.Thread(target=engine.close, name="test-shutdown")
    try:
        jobs.load(keys, [1])
        assert stall.reached.wait(TASK_TIMEOUT + LATE)
        started = time.monotonic()
        closing.start()
        closing.join(TASK_TIMEOUT + LATE)
        assert not closing.is_alive(), "shutdown still waits for the stalled worker"
        assert time.monotonic() - started < TASK_TIMEOUT + LATE
    finally:
        stall.release()  # the worker reads into kvplug's memory, never the unmapped rows
        closing.join(STALL)


# -- audit::store:// over two tiers ------------------------------------------------------------


@pytest.mark.parametrize("upper", ["cpu", "redis"])
def test_a_wrapped_multi_tier_store_gets_a_copy_so_a_late_write_behind_persists_the_original(
    start: Start,
    tmp_path: Path,
    upper: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = (
        "cpu://?max_size=64MiB"
        if upper == "cpu"
        else request.getfixturevalue("own_redis").url + "?timeout=5"
    )
    lower = f"file://{tmp_path}/kv"
    config = tmp_path / "tiers.yaml"
    config.write_text(f"tiers:\n  - url: {first}\n  - url: {lower}\n")
    keys = chunk_keys(2)
    data = payloads(2, ROW_BYTES)
    engine = start({"url": f"audit::store://{config}", "task_timeout": TASK_TIMEOUT})
    jobs = Jobs(engine)
    stall = stall_disk(monkeypatch, disk_of(engine.tier), "store", "before")
    try:
        jobs.write(0, data[0])
        jobs.write(1, data[1])
        result, took = jobs.wait(jobs.store(keys, [0, 1]), within=TASK_TIMEOUT + LATE)
        assert result.success and took < TASK_TIMEOUT + LATE
        jobs.write(0, REWRITE)
        jobs.write(1, REWRITE)
        assert stall.reached.wait(TASK_TIMEOUT + LATE)  # the write-behind, still to come
    finally:
        stall.release()
    assert jobs.read(keys, [2, 3]) == data
    engine.close()
    alone = Jobs(start({"url": lower}))  # what the lower tier persisted
    for key, original in zip(keys, data, strict=True):
        assert alone.read([key], [2]) in ([original], [None])


# -- a backend that breaks its contract -----------------------------------------------------------


def test_a_backend_that_keeps_the_rows_after_the_deadline_fails_a_reset_and_a_shutdown_in_time(
    start: Start, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvplug_vllm.tier, "UNWIND_SECONDS", 0.5, raising=False)
    engine = start({"url": f"holding::file://{tmp_path}/kv", "task_timeout": TASK_TIMEOUT})
    jobs = Jobs(engine)
    Holding.let_go.clear()
    calls: dict[str, BaseException | None] = {}

    def call(name: str, method: Callable[[], None]) -> float:
        """Seconds ``method`` took, run on a thread of its own (it may block)."""
        thread = threading.Thread(target=lambda: calls.update({name: catch(method)}))
        started = time.monotonic()
        thread.start()
        thread.join(TASK_TIMEOUT + LATE)
        assert not thread.is_alive(), f"{name} blocks while the backend keeps the rows"
        return time.monotonic() - started

    try:
        loading = jobs.load(chunk_keys(1), [0])
        assert call("drain", engine.tier.drain_jobs) < TASK_TIMEOUT + LATE
        assert isinstance(calls["drain"], KvplugError)
        assert "still use rows" in str(calls["drain"])
        assert not jobs.reported(loading)  # the rows are still the backend's: never reported
        assert call("shutdown", engine.tier.shutdown) < TASK_TIMEOUT + LATE
        assert isinstance(calls["shutdown"], KvplugError)  # so vLLM keeps the rows mapped
    finally:
        Holding.let_go.set()
    result, _ = jobs.wait(loading)
    assert not result.success
    engine.close()


def catch(method: Callable[[], None]) -> BaseException | None:
    try:
        method()
    except BaseException as error:
        return error
    return None
