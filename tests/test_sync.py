"""SyncClient: the async backend driven from engine worker threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from typing import ClassVar

import pytest
import torch

import kvplug
from kvplug import (
    BackendClosed,
    BackendSpec,
    BackendTimeout,
    CacheKey,
    CapacityExceeded,
    FreeListAllocator,
    KvplugError,
    MemoryFormat,
    MemoryObj,
    UnexpectedBackendError,
    UnknownScheme,
)
from kvplug import errors as kvplug_errors
from kvplug.inline import NeededALoop
from kvplug.runtime.sync import SyncClient
from kvplug_blackhole.backend import BlackholeBackend
from kvplug_cpu.backend import CpuBackend


def key(n: int) -> CacheKey:
    return CacheKey("sync-test", 1, 0, n)


@pytest.fixture
def client():
    with SyncClient("cpu://?max_size=64MiB") as client:
        yield client


def test_put_then_get_from_another_thread_is_bit_exact(client) -> None:
    allocator = FreeListAllocator(1 << 22)
    obj = allocator.allocate((2, 2, 16, 64), torch.bfloat16, MemoryFormat.KV_2LTD)
    obj.tensor.normal_()
    expected = obj.tensor.clone()
    client.put(key(1), obj).result(10)
    obj.release()

    def read() -> torch.Tensor:
        got = client.get(key(1)).result(10)
        assert got is not None
        try:
            return got.tensor.clone()
        finally:
            got.release()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert torch.equal(pool.submit(read).result(), expected)
    assert allocator.stats().used == 0


def test_caller_may_release_right_after_submitting_a_put(client) -> None:
    allocator = FreeListAllocator(1 << 22)
    objs = []
    futures = []
    for n in range(20):
        obj = allocator.allocate((1024,), torch.float32)
        obj.tensor.fill_(n)
        futures.append(client.put(key(n), obj))
        obj.release()
        objs.append(obj)
    for future in futures:
        future.result(10)
    for n in range(20):
        got = client.get(key(n)).result(10)
        assert got is not None and bool((got.tensor == n).all())
        got.release()
    assert allocator.stats().object_count == 0


def test_many_threads_share_one_client(client) -> None:
    errors: list[BaseException] = []

    def worker(thread_id: int) -> None:
        try:
            for n in range(25):
                k = key(thread_id * 1000 + n)
                tensor = torch.full((256,), float(thread_id * 1000 + n))
                client.put(k, MemoryObj.from_tensor(tensor)).result(10)
                got = client.get(k).result(10)
                assert got is not None and torch.equal(got.tensor, tensor)
                got.release()
                assert client.contains(k).result(10)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    keys = [key(t * 1000 + n) for t in range(8) for n in range(25)]
    assert client.batched_contains(keys).result(10) == len(keys)


def test_operations_of_an_inline_backend_run_on_the_callers_thread(client) -> None:
    seen: list[int] = []
    backend = client.backend
    original = backend._get

    async def recording_get(k: CacheKey) -> MemoryObj | None:
        seen.append(threading.get_ident())
        return await original(k)

    backend._get = recording_get
    client.put(key(1), MemoryObj.from_tensor(torch.ones(8))).result(10)
    future = client.get(key(1))
    assert future.done(), "an operation of a runs_inline backend must be done on return"
    got = future.result()
    assert got is not None and got.tensor.sum().item() == 8.0
    got.release()
    assert seen == [threading.get_ident()]


def test_an_inline_operations_future_works_as_any_future(client) -> None:
    """The future an inline operation returns (kvplug.runtime.sync.Finished, born done and
    sharing one condition) answers what engines ask of a concurrent.futures.Future: results,
    exceptions, callbacks, wait and as_completed beside a pending future, cancel."""
    client.put(key(2), MemoryObj.from_tensor(torch.ones(4))).result(10)
    hit, miss = client.contains(key(2)), client.contains(key(3))
    assert isinstance(hit, concurrent.futures.Future)
    assert (hit.result(), miss.result(0), hit.exception()) == (True, False, None)
    assert (hit.done(), hit.running(), hit.cancel(), hit.cancelled()) == (True, False, False, False)
    called: list[concurrent.futures.Future[bool]] = []
    hit.add_done_callback(called.append)
    assert called == [hit]
    pending: concurrent.futures.Future[int] = concurrent.futures.Future()
    done, not_done = concurrent.futures.wait([hit, pending, miss], timeout=0.01)
    assert (done, not_done) == ({hit, miss}, {pending})
    pending.set_result(1)
    assert set(concurrent.futures.as_completed([hit, pending, miss], timeout=5)) == {
        hit,
        miss,
        pending,
    }
    with _inline_client(_RaisesTheOldWordingCpu) as failing:
        failed = failing.get(key(4))
        assert failed.done() and isinstance(failed.exception(), UnexpectedBackendError)
        for _ in range(2):  # the same error each time it is asked for
            with pytest.raises(UnexpectedBackendError):
                failed.result()


class _WaitingCpu(CpuBackend):
    """A backend that claims runs_inline but whose get waits once."""

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        await asyncio.sleep(0)
        return await super()._get(key)


def test_an_inline_backend_whose_operation_waits_fails_clearly_and_releases() -> None:
    backend = _WaitingCpu("cpu://?max_size=8MiB")
    asyncio.run(backend.open())
    with SyncClient(backend) as waiting:
        obj = MemoryObj.from_tensor(torch.full((4,), 2.0))
        waiting.put(key(2), obj).result(10)
        with pytest.raises(KvplugError, match=r"declares runs_inline.*Remove runs_inline"):
            waiting.get(key(2)).result(10)
        assert obj.ref_count == 1, "the client's own reference was not given back"


class _SleepingCpu(CpuBackend):
    """A backend that claims runs_inline but whose get sleeps: asyncio.sleep with a delay asks
    the running loop for a future before it suspends."""

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        await asyncio.sleep(0.01)
        return await super()._get(key)


class _HidesItsWaitCpu(CpuBackend):
    """A backend whose get would carry on past a failed wait, as a hook catching every
    Exception does."""

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        try:
            await asyncio.sleep(0.01)
        except Exception:
            return None
        return await super()._get(key)


class _RaisesTheOldWordingCpu(CpuBackend):
    """A backend whose get raises a RuntimeError with the words CPython uses for a missing
    loop, without waiting for anything."""

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        raise RuntimeError("no running event loop")


def _inline_client(backend_class: type[CpuBackend]) -> SyncClient:
    backend = backend_class("cpu://?max_size=8MiB")
    asyncio.run(backend.open())
    return SyncClient(backend)


@pytest.mark.parametrize("backend_class", [_SleepingCpu, _HidesItsWaitCpu, _WaitingCpu])
def test_an_inline_operation_that_really_waits_is_caught_by_kvplug_itself(
    backend_class: type[CpuBackend],
) -> None:
    """An operation of a runs_inline backend that awaits something that suspends (a sleep of
    10 ms, also one that swallows every Exception around it, or a bare yield) is abandoned on
    the caller's thread and reported as such, its cause kvplug's own NeededALoop; the call is
    counted as a failed get."""
    with _inline_client(backend_class) as waiting:
        waiting.put(key(3), MemoryObj.from_tensor(torch.ones(4))).result(10)
        future = waiting.get(key(3))
        assert future.done(), "an inline operation that waited must fail at once, not later"
        with pytest.raises(KvplugError, match=r"declares runs_inline.*Remove runs_inline") as error:
            future.result()
        assert isinstance(error.value.__cause__, NeededALoop)
        expected = "yielded to the event loop" if backend_class is _WaitingCpu else "create_future"
        assert expected in str(error.value)
        assert waiting.backend.operation_stats()["get"].errors == 1
        assert waiting.contains(key(3)).result(10), "the backend works on after the abandoned get"


def test_whether_an_inline_operation_waited_is_never_read_from_an_errors_text() -> None:
    """A RuntimeError that only reads like a missing loop is the backend's own error: it is
    translated like any other (UnexpectedBackendError), not taken for a wait."""
    with _inline_client(_RaisesTheOldWordingCpu) as client:
        with pytest.raises(UnexpectedBackendError, match="no running event loop") as error:
            client.get(key(4)).result(10)
        assert "runs_inline" not in str(error.value)
        assert type(error.value.__cause__) is RuntimeError


def test_an_inline_call_from_inside_a_running_loop_leaves_that_loop_as_it_was() -> None:
    """Code on an event loop may call a SyncClient: the operation runs inline there too, a wait
    is caught the same way, and the thread's running loop is the caller's again afterwards."""
    with SyncClient("cpu://?max_size=8MiB") as fast, _inline_client(_SleepingCpu) as sleeping:

        async def calls() -> None:
            loop = asyncio.get_running_loop()
            fast.put(key(5), MemoryObj.from_tensor(torch.ones(4))).result(10)
            got = fast.get(key(5)).result(10)
            assert got is not None
            got.release()
            assert asyncio.get_running_loop() is loop
            with pytest.raises(KvplugError, match="declares runs_inline"):
                sleeping.get(key(5)).result(10)
            assert asyncio.get_running_loop() is loop
            await asyncio.sleep(0.001)  # the caller's loop still serves its own waits

        asyncio.run(calls())


def test_batched_operations_return_aligned_results(client) -> None:
    objs = [MemoryObj.from_tensor(torch.full((8,), float(n))) for n in range(4)]
    client.batched_put([key(n) for n in range(4)], objs).result(10)
    got = client.batched_get([key(0), key(99), key(3)]).result(10)
    assert got[1] is None
    assert got[0] is not None and got[0].tensor[0].item() == 0.0
    assert got[2] is not None and got[2].tensor[0].item() == 3.0
    for obj in got:
        if obj is not None:
            obj.release()
    assert client.batched_contains([key(0), key(1), key(99), key(2)]).result(10) == 2


def test_errors_surface_from_the_future(client) -> None:
    huge = MemoryObj.from_tensor(torch.zeros(80 << 20, dtype=torch.uint8))
    with pytest.raises(CapacityExceeded):
        client.put(key(5), huge).result(10)
    assert not client.contains(key(5)).result(10)


def test_closed_client_refuses_work_and_close_is_idempotent() -> None:
    client = SyncClient("cpu://?max_size=8MiB")
    backend = client.backend
    client.close()
    client.close()
    assert backend.closed
    with pytest.raises(BackendClosed):
        client.get(key(1))


def threads_started_since(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads alive now that were not before (other tests' threads may end meanwhile, so a
    count would not do)."""
    return set(threading.enumerate()) - before


def test_bad_url_fails_at_construction_without_leaving_a_thread() -> None:
    before = set(threading.enumerate())
    with pytest.raises(UnknownScheme):
        SyncClient("nosuchscheme://")
    assert threads_started_since(before) == set()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
def test_use_after_fork_is_a_clear_error(client) -> None:
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            client.contains(key(1))
        except KvplugError as error:
            os._exit(0 if "forked" in str(error) else 1)
        except BaseException:
            os._exit(2)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_client_over_a_tiered_store_from_config(tmp_path) -> None:
    from kvplug.runtime.config import Config

    config = Config.from_dict({"tiers": ["cpu://?max_size=16MiB", f"file://{tmp_path}/disk"]})
    with SyncClient(config) as client:
        obj = MemoryObj.from_tensor(torch.full((64,), 5.0))
        client.put(key(1), obj).result(10)
        got = client.get(key(1)).result(10)
        assert got is not None and torch.equal(got.tensor, obj.tensor)
        got.release()
        assert client.lookup([key(1), key(2)]).result(10) == 1
        client.run(client.backend.flush()).result(10)
        assert client.remove(key(1)).result(10) is True
        assert client.prefetch([key(1)]).result(10) == 0
        with pytest.raises(kvplug_errors.NotSupported, match=r"Store \(store://\) cannot pin"):
            client.pin(key(1)).result(10)


class SlowToOpen(BlackholeBackend):
    """Holds a resource and then never finishes opening (a server that accepts and stalls)."""

    instances: ClassVar[list[SlowToOpen]] = []
    resource_held = False

    async def _open(self) -> None:
        SlowToOpen.instances.append(self)
        self.resource_held = True
        await asyncio.Event().wait()

    async def _close(self) -> None:
        self.resource_held = False


def test_an_open_that_runs_past_open_timeout_is_cancelled_and_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvplug.registry, "_registry", kvplug.registry.Registry())
    kvplug.register_backend(BackendSpec("slow", ("slow-to-open",), f"{__name__}:SlowToOpen"))
    SlowToOpen.instances.clear()
    before = set(threading.enumerate())
    with pytest.raises(BackendTimeout, match=r"open_timeout=0\.2"):
        SyncClient("slow-to-open://", open_timeout=0.2)
    (backend,) = SlowToOpen.instances
    assert backend.closed and not backend.resource_held
    assert threads_started_since(before) == set()  # the IO thread is gone too


class BlocksTheLoop(BlackholeBackend):
    """A get that blocks the IO thread (a hook calling a blocking function)."""

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        time.sleep(1.5)
        return None


def test_close_is_bounded_when_an_operation_blocks_the_io_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kvplug.registry, "_registry", kvplug.registry.Registry())
    kvplug.register_backend(BackendSpec("blocks", ("blocks",), f"{__name__}:BlocksTheLoop"))
    before = set(threading.enumerate())
    client = SyncClient("blocks://")
    stuck = client.get(key(1))
    time.sleep(0.1)  # the get holds the IO thread now
    start = time.monotonic()
    with pytest.raises(concurrent.futures.TimeoutError):
        client.close(timeout=0.3)
    assert time.monotonic() - start < 1.2, "close waited for the blocked IO thread"
    assert "did not stop within 0.3 s" in caplog.text
    assert stuck.result(5) is None  # the thread ends by itself once the operation returns
    deadline = time.monotonic() + 10
    while threads_started_since(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threads_started_since(before) == set()
