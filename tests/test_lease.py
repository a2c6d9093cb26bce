"""Leases: a caller's memory lent to worker threads and taken back at once on cancellation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from kvplug.lease import Lease, Revoked
from kvplug.memory import MemoryObj


def caller_object() -> MemoryObj:
    return MemoryObj.from_tensor(torch.zeros(1 << 16, dtype=torch.uint8))


def test_the_reference_goes_back_once_when_the_work_ends_first() -> None:
    obj = caller_object()
    lease = Lease(obj)
    assert obj.ref_count == 2
    with lease.use() as lent:
        lent.raw.fill_(1)
    lease.end()
    lease.end()
    assert obj.ref_count == 1
    asyncio.run(lease.revoke())
    assert obj.ref_count == 1
    with pytest.raises(Revoked), lease.use():
        pass


def test_revoke_waits_for_the_access_in_progress_and_no_other_starts() -> None:
    obj = caller_object()
    lease = Lease(obj)
    inside, finish = threading.Event(), threading.Event()
    writes_after: list[int] = []

    def worker() -> None:
        try:
            with lease.use() as lent:
                inside.set()
                finish.wait(5)
                lent.raw.fill_(2)
            while True:  # every later access is refused
                with lease.use() as lent:
                    lent.raw.fill_(3)
                    writes_after.append(1)
        except Revoked:
            pass
        finally:
            lease.end()

    async def main() -> float:
        thread = threading.Thread(target=worker)
        thread.start()
        await asyncio.to_thread(inside.wait, 5)
        revoking = asyncio.ensure_future(lease.revoke())
        await asyncio.sleep(0.05)
        assert not revoking.done(), "revoke returned while the worker was writing"
        started = time.perf_counter()
        finish.set()
        await revoking
        elapsed = time.perf_counter() - started
        assert obj.ref_count == 1
        thread.join(5)
        return elapsed

    assert asyncio.run(main()) < 1.0
    assert not writes_after
    assert bool((obj.raw == 2).all())
    assert obj.ref_count == 1


def test_many_threads_and_a_revoke_never_write_after_it() -> None:
    obj = caller_object()
    lease = Lease(obj)
    stop_marks: list[bool] = []

    def worker(value: int) -> None:
        try:
            while True:
                with lease.use() as lent:
                    lent.raw[value] = value
        except Revoked:
            stop_marks.append(True)

    async def main() -> None:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(1, 9)]
        for thread in threads:
            thread.start()
        await asyncio.sleep(0.05)
        await lease.revoke()
        snapshot = obj.raw.clone()
        obj.raw.fill_(0)  # the caller rewrites its buffer at once
        for thread in threads:
            thread.join(5)
        assert bool((obj.raw == 0).all()), "a worker wrote after revoke returned"
        assert snapshot[1:9].tolist() == list(range(1, 9))

    asyncio.run(main())
    lease.end()
    assert len(stop_marks) == 8
    assert obj.ref_count == 1


def test_a_revoke_cancelled_meanwhile_still_waits_for_the_access_then_raises() -> None:
    obj = caller_object()
    lease = Lease(obj)
    inside, finish = threading.Event(), threading.Event()

    def worker() -> None:
        try:
            with lease.use() as lent:
                inside.set()
                finish.wait(5)
                lent.raw.fill_(4)
        finally:
            lease.end()

    async def main() -> None:
        thread = threading.Thread(target=worker)
        thread.start()
        await asyncio.to_thread(inside.wait, 5)
        revoking = asyncio.ensure_future(lease.revoke())
        await asyncio.sleep(0.02)
        revoking.cancel()  # a deadline on top of the caller's cancellation
        await asyncio.sleep(0.05)
        assert not revoking.done(), "the revoke gave up while the worker still wrote"
        finish.set()
        with pytest.raises(asyncio.CancelledError):
            await revoking
        assert obj.ref_count == 1
        thread.join(5)

    asyncio.run(main())
