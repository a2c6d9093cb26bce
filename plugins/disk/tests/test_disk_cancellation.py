"""Cancelled puts and get_intos of file:// and gds:// (``releases_on_cancel``): engines lend
these tiers their own buffers, so when a put or a get_into is cancelled (by its caller, or by
its deadline) the tier has stopped touching the caller's object by the time the cancellation
finishes. It waits for the access in progress, if any (one system call, copy or hash), never
for a file I/O thread stalled elsewhere; that thread, once it goes on, abandons the work. A
cancelled put leaves no file and no index entry; a cancelled get_into writes nothing more into
its destination.

The stalls are real threads held where a stalled disk holds them: opening the file, between
the pieces of a read, between two writes of one object, in fsync, in the rename. Every backend
here runs one file I/O thread, so an operation started after the stalled one runs once that
one has ended, whatever it did.
"""

from __future__ import annotations

import asyncio
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import (
    key,
    leak_checked_allocator,
    object_files,
    put_seeded,
    read_back,
    run,
    seeded,
    seeded_bytes,
)
from gds_standin import PosixStandIn

import kvplug
from kvplug import BackendTimeout, FreeListAllocator, MemoryObj
from kvplug_disk import piecewise, reads
from kvplug_disk.backend import READ_PIECE, DiskBackend
from kvplug_disk.fileio import posix as posix_module
from kvplug_disk.layout import BLOCK, TEMP_NAME

MiB = 1 << 20
PROMPT = 0.5
"""Seconds a cancellation may take while the worker is stalled away from the caller's memory."""
DEADLINE = 0.5
SENTINEL = 0xA5

allocator = pytest.fixture(leak_checked_allocator, name="allocator")


class Gate:
    """Wraps ``real``: the first call that ``stops(*args)`` picks waits for :meth:`release`
    before it runs (``entered`` is set then); the others run at once. ``finished`` counts the
    calls that returned."""

    def __init__(
        self, real: Callable[..., Any], stops: Callable[..., bool] = lambda *args: True
    ) -> None:
        self.real = real
        self.stops = stops
        self.entered = threading.Event()
        self._gate = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False
        self.finished = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            stop = not self._stopped and self.stops(*args)
            self._stopped = self._stopped or stop
        if stop:
            self.entered.set()
            self._gate.wait(60)
        result = self.real(*args, **kwargs)
        with self._lock:
            self.finished += 1
        return result

    def release(self) -> None:
        self._gate.set()


async def open_disk(path: Path, allocator: FreeListAllocator, **options: Any) -> DiskBackend:
    disk = await kvplug.open_backend(
        f"file://{path}", allocator=allocator, **{"workers": 1, "timeout": 30, **options}
    )
    assert isinstance(disk, DiskBackend)
    return disk


async def interrupt(
    operation: Coroutine[Any, Any, Any], reached: Callable[[], bool], how: str
) -> float:
    """Run ``operation`` until ``reached()``, then end it ``how``: ``cancel`` (its caller
    cancels it then) or ``deadline`` (the backend's timeout, :data:`DEADLINE`, ends it).
    Returns the seconds from the interruption until the operation had ended."""
    started = time.monotonic()
    task = asyncio.ensure_future(operation)
    while not reached():
        assert time.monotonic() - started < 30, "the operation never reached its stall"
        await asyncio.sleep(0.002)
    if how == "cancel":
        cancelled = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - cancelled
    with pytest.raises(BackendTimeout):
        await task
    return time.monotonic() - started - DEADLINE


def taken_back(took: float, obj: MemoryObj, release: Callable[[], None]) -> None:
    """After a cancellation that took ``took`` seconds: it did not wait for the stalled
    thread, ``obj`` is its owner's alone, who rewrites it with :data:`SENTINEL` at once; then
    the stalled thread goes on (``release``)."""
    assert took < PROMPT, f"the cancellation waited {took:.2f} s for a stalled thread"
    assert obj.ref_count == 1
    obj.raw.fill_(SENTINEL)
    release()


def only_rewritten(obj: MemoryObj) -> bool:
    """Whether ``obj`` holds what its owner rewrote it with after the cancellation."""
    return bool((obj.raw == SENTINEL).all())


def timeout_for(how: str) -> float:
    return DEADLINE if how == "deadline" else 30.0


def leftovers(root: Path) -> list[Path]:
    """Temporary and object files under ``root``."""
    return [p for p in root.rglob("*") if TEMP_NAME.fullmatch(p.name)] + object_files(root)


def aligned_buffer(nbytes: int, misaligned: bool = False) -> tuple[torch.Tensor, MemoryObj]:
    """An engine's buffer of ``nbytes``: page-aligned host memory it owns (or one byte off a
    page, which the tier stages through memory of its own), and the object lending it."""
    backing = torch.empty(nbytes + 2 * BLOCK, dtype=torch.uint8)
    start = (-backing.data_ptr()) % BLOCK + int(misaligned)
    view = backing[start : start + nbytes]
    return view, MemoryObj.from_tensor(view)


# -- get_into -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_get_into_whose_worker_is_stalled_before_reading_ends_at_once_and_never_writes(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The file I/O thread is stuck opening the file (a stalled disk) when the get_into is
    cancelled: the cancellation does not wait for it, the destination is the caller's again
    at once (ref_count 1), and once the thread goes on it writes nothing into it."""
    gate = Gate(reads.open_object_sized)

    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator, timeout=timeout_for(how))
        dest = allocator.allocate((1 * MiB,), torch.uint8)
        assert dest is not None
        try:
            await put_seeded(disk, allocator, key(1), 1 * MiB, seed=1)
            monkeypatch.setattr(reads, "open_object_sized", gate)
            took = await interrupt(disk.get_into(key(1), dest), gate.entered.is_set, how)
            taken_back(took, dest, gate.release)
            assert await disk.contains(key(1))  # runs once the stalled read has ended
            assert only_rewritten(dest), "written after its cancellation"
            assert torch.equal(await read_back(disk, key(1)), seeded_bytes(1 * MiB, 1))
        finally:
            gate.release()
            dest.release()
            await disk.close()

    run(scenario())


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_get_into_stalled_between_the_pieces_of_its_read_stops_writing_at_its_cancellation(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A 24 MiB payload is read with O_DIRECT straight into the destination in six pieces,
    five of them on reader threads. One reader stalls before its piece while the others have
    filled theirs: the cancellation waits for no stalled piece, and the stalled reader, let
    go, writes nothing into the destination, nor does anything else."""
    nbytes = 6 * READ_PIECE
    gate = Gate(
        piecewise.read_all, lambda fd, views, offset, *rest: offset == BLOCK + 3 * READ_PIECE
    )

    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator, timeout=timeout_for(how))
        assert disk.directories[0].o_direct, "this test needs O_DIRECT where pytest's files are"
        dest = allocator.allocate((nbytes,), torch.uint8)
        assert dest is not None
        try:
            await put_seeded(disk, allocator, key(1), nbytes, seed=1)
            monkeypatch.setattr(piecewise, "read_all", gate)
            took = await interrupt(
                disk.get_into(key(1), dest),
                lambda: gate.entered.is_set() and gate.finished >= 5,
                how,
            )
            taken_back(took, dest, gate.release)
            assert await disk.contains(key(1))  # runs once the stalled read has ended
            assert only_rewritten(dest), "written after its cancellation"
            monkeypatch.setattr(piecewise, "read_all", gate.real)
            assert await disk.get_into(key(1), dest)
            assert torch.equal(dest.raw, seeded_bytes(nbytes, 1))
        finally:
            gate.release()
            dest.release()
            await disk.close()

    run(scenario())


def test_a_get_into_cancelled_again_while_its_read_call_runs_still_waits_for_that_call(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read system call in progress writes into the destination until it returns, so the
    cancellation waits for it, also when the caller cancels a second time meanwhile (a
    deadline on top of an engine's cancel): the destination is the caller's alone when the
    get_into ends, and stays as the caller leaves it."""
    returned = threading.Event()
    gate = Gate(os.preadv, lambda fd, *rest: stat.S_ISREG(os.fstat(fd).st_mode))

    def reading(*args: Any) -> int:
        try:
            return int(gate(*args))
        finally:
            returned.set()

    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator)
        dest = allocator.allocate((1 * MiB,), torch.uint8)
        assert dest is not None
        try:
            await put_seeded(disk, allocator, key(1), 1 * MiB, seed=1)
            monkeypatch.setattr(os, "preadv", reading)
            task = asyncio.ensure_future(disk.get_into(key(1), dest))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            task.cancel()
            await asyncio.sleep(0.1)
            task.cancel()
            threading.Timer(0.2, gate.release).start()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert returned.is_set(), "the cancellation ended while the read call ran"
            taken_back(0.0, dest, lambda: None)
            assert await disk.contains(key(1))  # runs once the cancelled read has ended
            assert only_rewritten(dest), "written after its cancellation"
        finally:
            gate.release()
            dest.release()
            await disk.close()

    run(scenario())


# -- put ----------------------------------------------------------------------------------------


def stall_half_way(gate_at: threading.Event, go: threading.Event) -> Callable[..., int]:
    """``write_all`` that writes the first half of an object's bytes, then waits for ``go``
    (setting ``gate_at``) away from the caller's memory, then writes the rest: a file I/O
    thread stalled in the middle of a write."""
    real = posix_module.write_all

    def write_all(fd: int, buffers: list[memoryview], offset: int, *rest: Any) -> int:
        views = [view for view in buffers if view.nbytes]
        total = sum(view.nbytes for view in views)
        if total < 2 * MiB:
            return real(fd, buffers, offset, *rest)
        half = (total // 2) // BLOCK * BLOCK
        first: list[memoryview] = []
        later: list[memoryview] = []
        taken = 0
        for view in views:
            cut = max(0, min(view.nbytes, half - taken))
            first += [view[:cut]] if cut else []
            later += [view[cut:]] if cut < view.nbytes else []
            taken += view.nbytes
        written = real(fd, first, offset, *rest)
        gate_at.set()
        go.wait(60)
        return written + real(fd, later, offset + written, *rest)

    return write_all


@pytest.mark.parametrize("how", ["cancel", "deadline"])
@pytest.mark.parametrize("before", ["absent", "stored"])
def test_a_put_cancelled_half_way_through_its_write_stores_nothing_and_keeps_the_old_value(
    tmp_path: Path,
    allocator: FreeListAllocator,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    before: str,
) -> None:
    """The write stalls after half of an 8 MiB object went to the temporary file: the
    cancellation does not wait for it, the source is the caller's again at once (the engine
    rewrites it), and the write, let go, is abandoned: no file is left, the index is as it
    was, a key stored before keeps its old value, and a reopen finds the same."""
    nbytes = 8 * MiB
    at, go = threading.Event(), threading.Event()

    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator, timeout=timeout_for(how))
        if before == "stored":
            await put_seeded(disk, allocator, key(1), nbytes, seed=1)
        files, held, count = leftovers(tmp_path), disk.bytes_held, len(disk)
        source = seeded(allocator, nbytes, seed=2)
        try:
            monkeypatch.setattr(posix_module, "write_all", stall_half_way(at, go))
            took = await interrupt(disk.put(key(1), source), at.is_set, how)
            taken_back(took, source, go.set)
            assert await disk.contains(key(1)) is (before == "stored")  # after the write ended
            assert leftovers(tmp_path) == files
            assert (disk.bytes_held, len(disk)) == (held, count)
        finally:
            go.set()
            source.release()
            await disk.close()
        again = await open_disk(tmp_path, allocator)
        try:
            back = await read_back(again, key(1))
            if before == "stored":
                assert back is not None and torch.equal(back, seeded_bytes(nbytes, 1))
            else:
                assert back is None and leftovers(tmp_path) == []
        finally:
            await again.close()

    run(scenario())


@pytest.mark.parametrize("stage", ["fsync", "rename"])
def test_a_put_cancelled_after_its_write_is_either_stored_whole_or_not_at_all(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """Cancelled once every byte is written: in the temporary file's fsync (the put has not
    reached its rename, so it is abandoned: no file, no index entry), or in the rename
    itself (the cancellation waits for it, and the object is stored whole and indexed). In
    both cases the source is the caller's again when the cancellation finishes, and the
    index, the files and a reopen agree."""
    nbytes = 3 * MiB
    if stage == "fsync":  # the temporary file's, not a directory's
        gate = Gate(os.fsync, lambda fd: stat.S_ISREG(os.fstat(fd).st_mode))
    else:
        gate = Gate(os.replace)

    def reached() -> bool:
        if gate.entered.is_set() and stage == "rename":
            threading.Timer(0.3, gate.release).start()  # the cancellation waits for it
        return gate.entered.is_set()

    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator, fsync=stage == "fsync")
        source = seeded(allocator, nbytes, seed=3)
        try:
            monkeypatch.setattr(os, "fsync" if stage == "fsync" else "replace", gate)
            await interrupt(disk.put(key(1), source), reached, "cancel")
            assert source.ref_count == 1
            source.raw.fill_(SENTINEL)
            gate.release()
            stored = await disk.contains(key(1))  # runs once the put's thread has ended
            assert stored is (stage == "rename")
            assert len(object_files(tmp_path)) == int(stored) == len(disk)
            assert not [p for p in tmp_path.rglob("*") if TEMP_NAME.fullmatch(p.name)]
            if stored:
                back = await read_back(disk, key(1))
                assert back is not None and torch.equal(back, seeded_bytes(nbytes, 3))
        finally:
            gate.release()
            source.release()
            await disk.close()
        monkeypatch.undo()
        again = await open_disk(tmp_path, allocator)
        try:
            back = await read_back(again, key(1))
            assert (back is not None) is (stage == "rename")
            if back is not None:
                assert torch.equal(back, seeded_bytes(nbytes, 3))
        finally:
            await again.close()

    run(scenario())


def test_gds_puts_and_get_intos_cancelled_while_cufile_is_stalled_leave_the_caller_alone(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    """gds:// (a stand-in for cuFile here) declares ``releases_on_cancel`` too. A put whose
    thread is stuck registering its file with cuFile is cancelled at once, and the write, let
    go, never reads the source and leaves no file. A get_into reads into the tier's own
    memory and copies on the caller's loop, so one cancelled while its read is stuck the same
    way never writes into the destination."""
    armed = threading.Event()
    gates = [Gate(PosixStandIn.open, lambda *args: armed.is_set()) for _ in range(2)]

    class Stalling(PosixStandIn):
        def open(self, fd: int) -> Any:
            return (gates[0] if not gates[0].entered.is_set() else gates[1])(self, fd)

    async def scenario() -> None:
        gds = await kvplug.open_backend(
            f"gds://{tmp_path}", allocator=allocator, file_io=Stalling(), workers=1, timeout=30
        )
        assert gds.capabilities.releases_on_cancel
        source = seeded(allocator, 1 * MiB, seed=4)
        dest = allocator.allocate((1 * MiB,), torch.uint8)
        assert dest is not None
        try:
            armed.set()
            took = await interrupt(gds.put(key(1), source), gates[0].entered.is_set, "cancel")
            taken_back(took, source, gates[0].release)
            assert not await gds.contains(key(1))
            assert leftovers(tmp_path) == [] and len(gds) == 0

            armed.clear()
            await put_seeded(gds, allocator, key(2), 1 * MiB, seed=5)
            armed.set()
            took = await interrupt(gds.get_into(key(2), dest), gates[1].entered.is_set, "cancel")
            taken_back(took, dest, gates[1].release)
            assert await gds.contains(key(2))  # runs once the stalled read has ended
            assert only_rewritten(dest), "written after its cancellation"
        finally:
            for gate in gates:
                gate.release()
            source.release()
            dest.release()
            await gds.close()

    run(scenario())


# -- the normal path, lent buffers ---------------------------------------------------------------


def test_lent_engine_buffers_stay_bit_exact_under_concurrent_stores_loads_and_cancellations(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    """An engine's stores and loads through :class:`kvplug.runtime.engine.EngineIO` lend file://
    the engine's buffers (no copy): many at once, of sizes from one block to several read
    pieces, in page-aligned and misaligned buffers, come back bit-exact. Loads cancelled at
    random moments meanwhile leave their buffers alone from their cancellation on, and every
    buffer is held by the engine alone once each call has ended."""
    from kvplug.runtime.engine import EngineIO

    sizes = [BLOCK, 100_000, 1 * MiB, 5 * MiB + 12_345, 9 * MiB]
    count = 24
    rng = random.Random(7)

    async def scenario() -> None:
        disk = await kvplug.open_backend(
            f"file://{tmp_path}", allocator=allocator, max_size="1GiB", workers=4
        )
        io = EngineIO(disk, timeout=60, what="the test's engine on file://")
        assert io.lends_stores and io.lends_loads
        keys = [key(n) for n in range(count)]
        engine = [
            aligned_buffer(sizes[n % len(sizes)], misaligned=n % 3 == 0) for n in range(count)
        ]
        for n, (view, _) in enumerate(engine):
            view.copy_(seeded_bytes(view.numel(), n))
        try:
            await asyncio.gather(
                *(io.store([k], [obj]) for k, (_, obj) in zip(keys, engine, strict=True))
            )
            assert all(obj.ref_count == 1 for _, obj in engine)
            for view, _ in engine:
                view.fill_(0)
            found = await asyncio.gather(
                *(io.load([k], [obj]) for k, (_, obj) in zip(keys, engine, strict=True))
            )
            assert found == [[True]] * count
            for n, (view, obj) in enumerate(engine):
                assert obj.ref_count == 1 and torch.equal(view, seeded_bytes(view.numel(), n))

            async def load_cancelled(n: int) -> bool:
                view, obj = engine[n]
                view.fill_(0)
                task = asyncio.ensure_future(io.load([keys[n]], [obj]))
                await asyncio.sleep(rng.uniform(0, 0.01))
                task.cancel()
                try:
                    assert await task == [True]  # it finished before the cancel
                except asyncio.CancelledError:
                    taken_back(0.0, obj, lambda: None)  # the engine reuses its buffer at once
                    return True
                return False

            cancelled = await asyncio.gather(*(load_cancelled(n) for n in range(count)))
        finally:
            await disk.close()  # waits for the file I/O threads to end
        for n, (view, obj) in enumerate(engine):
            assert obj.ref_count == 1
            if cancelled[n]:
                assert only_rewritten(obj), f"buffer {n} written after its cancel"
            else:
                assert torch.equal(view, seeded_bytes(view.numel(), n))

    run(scenario())
