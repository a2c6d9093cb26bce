"""The local-disk tier, file:// (plugins/disk), opened through kvplug.open_backend: the FileIO
seam, staging, crash consistency, corruption, full disks, O_DIRECT and its fallback, directory
checks and the index rebuild. What file:// shares with gds:// (the layout, persistence,
sharing a directory, sharding, hostile keys) is checked for both in test_disk_schemes.py."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
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
from kvplug import (
    BackendClosed,
    BackendTimeout,
    CacheKey,
    CapacityExceeded,
    ConfigError,
    FreeListAllocator,
    InvalidBackendURL,
    MemoryFormat,
    MemoryObj,
    UnknownOption,
)
from kvplug_disk import directories
from kvplug_disk import payloads as payloads_module
from kvplug_disk.backend import DiskBackend
from kvplug_disk.fileio import PosixFileIO
from kvplug_disk.layout import (
    BLOCK,
    TEMP_NAME,
    file_length,
    new_writer_id,
)

KiB = 1024
MiB = 1024 * KiB
LOGGER = "kvplug.disk"


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if TEMP_NAME.fullmatch(p.name))


allocator = pytest.fixture(leak_checked_allocator, name="allocator")


async def open_disk(url: str, allocator: FreeListAllocator, **options: Any) -> DiskBackend:
    backend = await kvplug.open_backend(url, allocator=allocator, **options)
    assert isinstance(backend, DiskBackend)
    return backend


# -- layout and round trips --------------------------------------------------------------------


def test_file_urls_move_payloads_through_the_file_io_they_are_given(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    """The FileIO seam is file://'s own: a FileIO passed as ``file_io`` moves every payload
    (here the per-payload one the gds:// tests use in place of cuFile), the files are the same
    as the default PosixFileIO's, and each reads the other's."""
    io = PosixStandIn()

    async def scenario() -> None:
        seam = await open_disk(f"file://{tmp_path}/a", allocator, file_io=io)
        plain = await open_disk(f"file://{tmp_path}/b", allocator)
        assert isinstance(seam.io, PosixStandIn) and isinstance(plain.io, PosixFileIO)
        for backend in (seam, plain):
            await put_seeded(backend, allocator, key(1), 10_000, seed=1)
        assert (io.calls["write"], io.calls["read"]) == (1, 0)
        got = await read_back(seam, key(1))
        assert got is not None and torch.equal(got, seeded_bytes(10_000, 1))
        assert io.calls["read"] == 1
        await seam.close()
        await plain.close()

    run(scenario())
    (first,) = object_files(tmp_path / "a")
    (second,) = object_files(tmp_path / "b")
    assert first.read_bytes() == second.read_bytes()


def test_a_file_io_without_host_views_gets_a_copy_when_the_bounce_pool_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FileIO that moves one buffer per payload never gets host views: an object outside
    aligned memory and larger than the bounce pool is copied into memory of its own."""
    monkeypatch.setattr(payloads_module, "BOUNCE_POOL_SIZE", 1 * MiB)
    unaligned = FreeListAllocator(8 * MiB, alignment=64, pin=False)
    big = seeded_bytes(3 * MiB + 5, seed=7)

    async def scenario() -> None:
        disk = await kvplug.open_backend(
            f"file://{tmp_path}", allocator=unaligned, file_io=PosixStandIn()
        )
        await disk.put(key(1), MemoryObj.from_tensor(big, MemoryFormat.BINARY_BUFFER))
        got = await disk.get(key(1))
        assert got is not None and torch.equal(got.tensor, big)
        got.release()
        await disk.close()

    run(scenario())
    assert unaligned.stats().used == 0


def test_replacing_a_key_keeps_one_file_and_charges_it_once(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator)
        for seed in range(3):
            await put_seeded(disk, allocator, key(1), 20_000, seed)
        assert disk.bytes_held == file_length(20_000)
        got = await read_back(disk, key(1))
        assert got is not None and torch.equal(got, seeded_bytes(20_000, 2))
        await disk.close()

    run(scenario())
    assert len(object_files(tmp_path)) == 1
    assert temp_files(tmp_path) == []


def test_fsync_option_round_trips(tmp_path: Path, allocator: FreeListAllocator) -> None:
    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}/kv?fsync=true", allocator)
        await put_seeded(disk, allocator, key(1), 5000, seed=3)
        got = await read_back(disk, key(1))
        assert got is not None and torch.equal(got, seeded_bytes(5000, 3))
        await disk.close()

    run(scenario())


# -- persistence and the index rebuild ---------------------------------------------------------


def test_rebuild_skips_foreign_and_damaged_files_and_logs_one_summary_line(
    tmp_path: Path, allocator: FreeListAllocator, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "kv"
    url = f"file://{root}"

    async def fill() -> None:
        disk = await open_disk(url, allocator)
        for i in range(4):
            await put_seeded(disk, allocator, key(i), 8192, seed=i)
        await disk.close()

    run(fill())
    files = object_files(root)
    torn = files[0]  # cut mid-payload, as a torn write would be
    torn.write_bytes(torn.read_bytes()[: BLOCK + 100])
    garbage = files[1]
    garbage.write_bytes(b"\x00" * 3 * BLOCK)
    foreign = [root / "README.txt", root / "zz" / "notes.kv", root / files[2].parent / "x.bin"]
    (root / "zz").mkdir(mode=0o700)
    for path in foreign:
        path.write_bytes(b"not ours")
    dead_pid = int(  # a process that has exited and been reaped
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    stem = "ab" * 16
    leftover = root / stem[:2] / f".{stem}.{dead_pid}.0123456789abcdef.tmp"
    leftover.parent.mkdir(mode=0o700, exist_ok=True)
    leftover.write_bytes(b"half a write")
    # A pid says nothing about a writer (in a container every engine start is pid 1): a
    # temporary file named with this live process's pid, whose writer holds no lock, is gone.
    recycled = root / stem[:2] / f".{stem}.{os.getpid()}.fedcba9876543210.tmp"
    recycled.write_bytes(b"left by a dead writer whose pid is reused")

    caplog.set_level(logging.INFO, logger=LOGGER)

    async def reopen() -> None:
        disk = await open_disk(url, allocator)
        assert disk.rebuild_stats["objects"] == 2
        assert disk.rebuild_stats["corrupt"] == 2 and disk.corrupt_objects == 2
        assert disk.rebuild_stats["temp_removed"] == 2
        assert disk.rebuild_stats["temp_in_use"] == 0
        assert disk.rebuild_stats["foreign"] == 3
        for i in range(4):
            back = await read_back(disk, key(i))
            assert back is None or torch.equal(back, seeded_bytes(8192, i))
        assert await disk.batched_contains([key(i) for i in range(4)]) in (0, 1, 2)
        await disk.close()

    run(reopen())
    summary = [r for r in caplog.records if r.name == LOGGER and "index rebuilt" in r.message]
    assert len(summary) == 1
    assert summary[0].levelno == logging.WARNING
    for words in ("2 damaged", "2 temporary file(s) of interrupted", "3 foreign"):
        assert words in summary[0].message
    assert not torn.exists() and not garbage.exists() and not leftover.exists()
    assert all(path.exists() for path in foreign) and not recycled.exists()


def test_reopening_with_a_smaller_max_size_evicts_the_oldest(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    url = f"file://{tmp_path}"

    async def scenario() -> None:
        disk = await open_disk(url, allocator)
        for i in range(6):
            await put_seeded(disk, allocator, key(i), 64 * KiB, seed=i)
            os.utime(disk.stored_files(key(i))[0], (1000.0 + i, 1000.0 + i))
        await disk.close()
        small = await open_disk(url, allocator, max_size=3 * file_length(64 * KiB))
        assert small.rebuild_stats["evicted"] == 3
        assert [await small.contains(key(i)) for i in range(6)] == [False] * 3 + [True] * 3
        await small.close()

    run(scenario())
    assert len(object_files(tmp_path)) == 3


# -- crash consistency -------------------------------------------------------------------------

WRITER = """
import asyncio, sys, torch, kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryFormat

SIZE = int(sys.argv[2])

def batch(allocator, first):
    keys, objs = [], []
    for n in range(first, first + 8):
        obj = allocator.allocate((SIZE,), torch.uint8, MemoryFormat.BINARY_BUFFER)
        generator = torch.Generator().manual_seed(n)
        obj.raw.copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=generator))
        keys.append(CacheKey("crash", 1, 0, n))
        objs.append(obj)
    return keys, objs

async def main(url):
    allocator = FreeListAllocator(256 << 20, pin=False)
    disk = await kvplug.open_backend(url, allocator=allocator)
    written, previous = 0, None
    while True:  # the next batch is made while the previous one is being written
        keys, objs = batch(allocator, written)
        written += 8
        current = (asyncio.ensure_future(disk.batched_put(keys, objs)), objs, written)
        if previous is not None:
            task, done, count = previous
            await task
            for obj in done:
                obj.release()
            print(count, flush=True)
        previous = current

asyncio.run(main(sys.argv[1]))
"""


def test_a_writer_killed_mid_write_leaves_nothing_torn(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    """SIGKILL a process writing 2 MiB objects, 8 at a time; after reopen every key found reads
    back exactly as seeded, every key whose put returned is found, no temporary file is left."""
    size = 2 * MiB
    root = tmp_path / "kv"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, f"file://{root}", str(size)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    committed = 0
    try:
        for line in writer.stdout:
            committed = int(line)
            if committed >= 48:
                break
        deadline = time.monotonic() + 2
        while not temp_files(root) and time.monotonic() < deadline:
            pass  # kill while a write is in flight, when the timing allows
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
    assert committed >= 48, "the writer died before it wrote anything"
    # A temporary file of the dead writer, in case the kill fell between two writes.
    stem = "cd" * 16
    (root / stem[:2]).mkdir(mode=0o700, exist_ok=True)
    (root / stem[:2] / f".{stem}.{writer.pid}.0000000000000000.tmp").write_bytes(b"x" * 5000)

    async def reopen() -> list[int]:
        disk = await open_disk(f"file://{root}", allocator)
        assert disk.rebuild_stats["temp_removed"] >= 1
        assert disk.corrupt_objects == 0
        found = sorted(k.chunk_hash for k in [k async for k in disk.list_keys()])
        for n in found:
            back = await read_back(disk, CacheKey("crash", 1, 0, n))
            assert back is not None, f"key {n} listed but not readable"
            assert torch.equal(back, seeded_bytes(size, n)), f"key {n} is torn"
        await disk.close()
        return found

    found = run(reopen())
    assert set(range(committed)) <= set(found)
    assert temp_files(root) == []


# -- damage and full disks ---------------------------------------------------------------------


@pytest.mark.parametrize("where", ["payload", "header", "key", "padding"])
def test_a_flipped_byte_reads_as_a_counted_miss_and_the_file_is_removed(
    tmp_path: Path, allocator: FreeListAllocator, where: str
) -> None:
    # The frame header of a one-dimensional object is 64 bytes, then the key record (12).
    offsets = {"payload": BLOCK + 5000, "header": 20, "key": 64 + 12 + 3, "padding": BLOCK - 100}

    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator)
        await put_seeded(disk, allocator, key(1), 9000, seed=1)
        await put_seeded(disk, allocator, key(2), 9000, seed=2)
        path = Path(disk.stored_files(key(1))[0])
        data = bytearray(path.read_bytes())
        data[offsets[where]] ^= 0x04
        path.write_bytes(bytes(data))
        assert await disk.get(key(1)) is None
        assert disk.corrupt_objects == 1
        assert not path.exists() and not await disk.contains(key(1))
        back = await read_back(disk, key(2))
        assert back is not None and torch.equal(back, seeded_bytes(9000, 2))
        await disk.close()

    run(scenario())


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned-dest", "unaligned-dest"])
def test_get_into_reads_into_the_callers_memory_and_a_damaged_file_is_a_counted_miss(
    tmp_path: Path, allocator: FreeListAllocator, aligned: bool
) -> None:
    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator)
        await put_seeded(disk, allocator, key(1), 3 * BLOCK, seed=1)
        await put_seeded(disk, allocator, key(2), 3 * BLOCK, seed=2)
        # An engine's buffer: page-aligned (O_DIRECT straight into it) or one byte off
        # (through a bounce buffer).
        backing = MemoryObj.from_tensor(torch.zeros(4 * BLOCK + 1, dtype=torch.uint8))
        offset = (-backing.data_ptr()) % BLOCK + (0 if aligned else 1)
        dest = MemoryObj.from_tensor(backing.raw[offset : offset + 3 * BLOCK])
        assert await disk.get_into(key(1), dest)
        assert torch.equal(dest.raw, seeded_bytes(3 * BLOCK, 1))
        assert dest.ref_count == 1
        if aligned:  # whole blocks of aligned memory need no bounce buffer either way
            assert disk.scheme.bounce.pool is None
            dest.raw.copy_(seeded_bytes(3 * BLOCK, 5))
            await disk.put(key(4), dest)
            assert dest.ref_count == 1
            assert disk.scheme.bounce.pool is None
            back = await read_back(disk, key(4))
            assert back is not None and torch.equal(back, seeded_bytes(3 * BLOCK, 5))
            assert torch.equal(dest.raw, seeded_bytes(3 * BLOCK, 5))
        path = Path(disk.stored_files(key(2))[0])
        data = bytearray(path.read_bytes())
        data[BLOCK + 100] ^= 0x04
        path.write_bytes(bytes(data))
        assert not await disk.get_into(key(2), dest)
        assert disk.corrupt_objects == 1
        assert not path.exists() and not await disk.contains(key(2))
        assert not await disk.get_into(key(3), dest)
        await disk.close()

    run(scenario())


def test_enospc_from_the_write_raises_capacity_exceeded_and_leaves_no_temp_file(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator)
        await put_seeded(disk, allocator, key(1), 9000, seed=1)
        held = disk.bytes_held
        real_pwritev = os.pwritev

        def full(fd: int, buffers: Any, offset: int) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwritev", full)
        with pytest.raises(CapacityExceeded, match="full") as raised:
            await put_seeded(disk, allocator, key(2), 9000, seed=2)
        assert "ENOSPC" in str(raised.value) and str(tmp_path) in str(raised.value)
        assert temp_files(tmp_path) == []
        assert not await disk.contains(key(2)) and disk.bytes_held == held
        back = await read_back(disk, key(1))
        assert back is not None and torch.equal(back, seeded_bytes(9000, 1))
        monkeypatch.setattr(os, "pwritev", real_pwritev)
        await put_seeded(disk, allocator, key(2), 9000, seed=2)
        assert await disk.contains(key(2))
        await disk.close()

    run(scenario())


def test_too_little_free_space_raises_capacity_exceeded_before_writing(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator)
        await put_seeded(disk, allocator, key(1), 9000, seed=1)
        monkeypatch.setattr(
            shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 30, used=0, free=8192)
        )
        with pytest.raises(CapacityExceeded, match="8192 bytes free"):
            await put_seeded(disk, allocator, key(2), 9000, seed=2)
        assert temp_files(tmp_path) == [] and len(object_files(tmp_path)) == 1
        back = await read_back(disk, key(1))
        assert back is not None and torch.equal(back, seeded_bytes(9000, 1))
        await disk.close()

    run(scenario())


def test_a_full_store_evicts_by_policy_deletes_the_files_and_spares_pins(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    one = file_length(64 * KiB)

    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}?eviction=lru", allocator, max_size=4 * one)
        for i in range(4):
            await put_seeded(disk, allocator, key(i), 64 * KiB, seed=i)
        assert await disk.pin(key(0))
        assert await read_back(disk, key(1)) is not None  # 1 is now recent
        await put_seeded(disk, allocator, key(4), 64 * KiB, seed=4)
        await put_seeded(disk, allocator, key(5), 64 * KiB, seed=5)
        present = [await disk.contains(key(i)) for i in range(6)]
        assert present == [True, True, False, False, True, True]
        assert disk.evictions == 2 and disk.bytes_held == 4 * one
        with pytest.raises(CapacityExceeded, match="larger than the tier's max_size"):
            await disk.put(key(9), MemoryObj.from_tensor(torch.zeros(5 * one, dtype=torch.uint8)))
        await disk.close()

    run(scenario())
    assert len(object_files(tmp_path)) == 4


# -- O_DIRECT ----------------------------------------------------------------------------------


def test_o_direct_is_probed_and_used_on_a_disk_filesystem(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    if directories._probe_o_direct(str(tmp_path), new_writer_id()) is not None:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")

    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator)
        assert [d.o_direct for d in disk.directories] == [True]
        await put_seeded(disk, allocator, key(1), 100_000, seed=1)
        back = await read_back(disk, key(1))
        assert back is not None and torch.equal(back, seeded_bytes(100_000, 1))
        await disk.close()
        never = await open_disk(f"file://{tmp_path}?o_direct=false", allocator)
        assert [d.o_direct for d in never.directories] == [False]
        back = await read_back(never, key(1))
        assert back is not None and torch.equal(back, seeded_bytes(100_000, 1))
        await never.close()

    run(scenario())
    assert temp_files(tmp_path) == []  # the probe file is gone too


def test_a_filesystem_refusing_o_direct_falls_back_with_one_warning(
    allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On tmpfs (/dev/shm). Linux 6.6 and later accept O_DIRECT on tmpfs; there the refusal of
    older kernels (EINVAL at open) is reproduced, which also proves no O_DIRECT open is tried
    after the probe."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("/dev/shm (a tmpfs) does not exist on this machine")
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="kvplug-disk-test-"))
    try:
        if directories._probe_o_direct(str(shm), new_writer_id()) is None:
            real_open = os.open

            def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
                if flags & os.O_DIRECT and str(path).startswith(str(shm)):
                    raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
                return real_open(path, flags, *args, **kwargs)

            monkeypatch.setattr(os, "open", refusing_open)
        caplog.set_level(logging.WARNING, logger=LOGGER)

        async def scenario() -> None:
            disk = await open_disk(f"file://{shm}/kv", allocator)
            assert [d.o_direct for d in disk.directories] == [False]
            await put_seeded(disk, allocator, key(1), 50_000, seed=1)
            back = await read_back(disk, key(1))
            assert back is not None and torch.equal(back, seeded_bytes(50_000, 1))
            await disk.close()

        run(scenario())
        warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
        assert len(warnings) == 1
        assert "O_DIRECT" in warnings[0].message and f"{shm}/kv" in warnings[0].message
        assert "EINVAL" in warnings[0].message and "buffered" in warnings[0].message
    finally:
        shutil.rmtree(shm)


# -- directories -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_directory_others_can_write_to_is_refused_unless_allowed(
    tmp_path: Path, allocator: FreeListAllocator, mode: int
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(ConfigError, match="refusing the cache directory") as refused:
        run(open_disk(f"file://{shared}", allocator))
    assert "chmod 700" in str(refused.value) and "allow_shared_dir=true" in str(refused.value)

    async def allowed() -> None:
        disk = await open_disk(f"file://{shared}?allow_shared_dir=true", allocator)
        await put_seeded(disk, allocator, key(1), 4096, seed=1)
        await disk.close()

    run(allowed())


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can chown to another user")
def test_a_directory_owned_by_another_user_is_refused(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(ConfigError, match="owned by uid 12345"):
        run(open_disk(f"file://{theirs}", allocator))


def test_bad_urls_and_options_are_clear_errors(tmp_path: Path) -> None:
    for url, error, words in (
        ("file://", InvalidBackendURL, "names no directory"),
        ("file://host/dir", InvalidBackendURL, "three slashes"),
        (f"file://{tmp_path},relative", InvalidBackendURL, "not an absolute path"),
        (f"file://{tmp_path}?max_size=100", UnknownOption, "nothing would fit"),
        (f"file://{tmp_path}?eviction=lru2", UnknownOption, "Did you mean 'lru'"),
        (f"file://{tmp_path}?workers=0", UnknownOption, "workers"),
        (f"file://{tmp_path}?odirect=false", UnknownOption, "Did you mean 'o_direct'"),
    ):
        with pytest.raises(error, match=words):
            run(kvplug.open_backend(url))
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        run(kvplug.open_backend(f"file://{blocker}"))


# -- concurrency and lifecycle -----------------------------------------------------------------


def test_queue_depth_bounds_the_operations_in_flight(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = threading.Lock()
    in_flight = peak = 0
    real_pwritev = os.pwritev

    def slow_pwritev(fd: int, buffers: Any, offset: int) -> int:
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(0.01)
        try:
            return real_pwritev(fd, buffers, offset)
        finally:
            with lock:
                in_flight -= 1

    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator, workers=8, queue_depth=2)
        monkeypatch.setattr(os, "pwritev", slow_pwritev)
        objs = [seeded(allocator, 4096, seed=i) for i in range(16)]
        await asyncio.gather(*(disk.put(key(i), obj) for i, obj in enumerate(objs)))
        for obj in objs:
            obj.release()
        assert await disk.batched_contains([key(i) for i in range(16)]) == 16
        await disk.close()

    run(scenario())
    assert peak == 2


def test_close_is_idempotent_and_later_operations_raise_backend_closed(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator)
        await put_seeded(disk, allocator, key(1), 4096, seed=1)
        await disk.close()
        await disk.close()
        obj = seeded(allocator, 4096, seed=2)
        with pytest.raises(BackendClosed):
            await disk.put(key(2), obj)
        assert obj.ref_count == 1
        obj.release()
        for operation in (disk.get(key(1)), disk.contains(key(1)), disk.remove(key(1))):
            with pytest.raises(BackendClosed):
                await operation

    run(scenario())
    assert len(object_files(tmp_path)) == 1  # persistent: close keeps the files


async def settled(condition: Callable[[], bool], within: float = 60.0) -> bool:
    """Whether ``condition`` holds within ``within`` seconds (work left on a thread)."""
    give_up = time.monotonic() + within
    while not condition():
        if time.monotonic() > give_up:
            return False
        await asyncio.sleep(0.01)
    return True


class Stall:
    """Replaces an ``os`` call with one that waits for :meth:`release` first (at most
    ``limit`` seconds)."""

    def __init__(self, real: Callable[..., int], limit: float = 120) -> None:
        self.real = real
        self.limit = limit
        self.entered = threading.Event()
        self.returned = threading.Event()
        self.gate = threading.Event()

    def __call__(self, *args: Any) -> int:
        self.entered.set()
        self.gate.wait(self.limit)
        try:
            return self.real(*args)
        finally:
            self.returned.set()

    def release(self) -> None:
        self.gate.set()


def test_a_put_past_its_deadline_waits_only_for_the_write_call_in_progress_and_stores_nothing(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline ends the put. A write system call in progress reads the object until it
    returns (here 1.5 s in, past the 1 s deadline), so the timeout is raised once it has; the
    object is then the caller's alone, and the abandoned write stores nothing."""
    stall = Stall(os.pwritev, limit=1.5)

    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator, timeout=1.0)
        monkeypatch.setattr(os, "pwritev", stall)
        obj = seeded(allocator, 9000, seed=1)
        try:
            with pytest.raises(BackendTimeout) as raised:
                await disk.put(key(1), obj)
            assert str(raised.value).startswith("put of ")
            assert str(tmp_path) in str(raised.value)
            assert stall.returned.is_set() and obj.ref_count == 1
        finally:
            stall.release()
            obj.release()
        monkeypatch.setattr(os, "pwritev", stall.real)
        assert await settled(lambda: temp_files(tmp_path) == [])
        assert not await disk.contains(key(1)) and object_files(tmp_path) == []
        await disk.close()

    run(scenario())


def test_a_get_into_past_its_deadline_waits_only_for_the_read_call_in_progress(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for a put: the timeout is raised once the read system call in progress returned,
    and from then on nothing writes into the destination."""
    stall = Stall(os.preadv, limit=1.5)

    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator, timeout=1.0)
        await put_seeded(disk, allocator, key(1), 9000, seed=1)
        monkeypatch.setattr(os, "preadv", stall)
        dest = allocator.allocate((9000,), torch.uint8, MemoryFormat.BINARY_BUFFER)
        assert dest is not None
        try:
            with pytest.raises(BackendTimeout, match=r"^get_into of "):
                await disk.get_into(key(1), dest)
            assert stall.returned.is_set() and dest.ref_count == 1
            dest.raw.fill_(7)
        finally:
            stall.release()
        await disk.close()  # waits for the file I/O in flight
        assert bool((dest.raw == 7).all())
        dest.release()

    run(scenario())


def test_opening_has_no_deadline_and_an_operation_that_opens_keeps_one_for_its_work(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index rebuild takes as long as the files need, past ``timeout``; an operation on a
    backend nobody opened opens it first, then has ``timeout`` for its own work."""
    real_rebuild = DiskBackend._rebuild

    def slow_rebuild(self: DiskBackend) -> None:
        time.sleep(0.8)
        real_rebuild(self)

    monkeypatch.setattr(DiskBackend, "_rebuild", slow_rebuild)
    stall = Stall(os.pwritev, limit=1.0)  # the put waits for the write call in progress

    async def scenario() -> None:
        opened = await open_disk(f"file://{tmp_path}/a", allocator, timeout=0.3)
        await put_seeded(opened, allocator, key(1), 9000, seed=1)
        await opened.close()

        never_opened = DiskBackend(
            f"file://{tmp_path}/b", allocator=allocator, timeout=0.5, o_direct=False
        )
        monkeypatch.setattr(os, "pwritev", stall)
        obj = seeded(allocator, 9000, seed=2)
        try:
            with pytest.raises(BackendTimeout, match=r"^put of .* took longer than 0\.5 s"):
                await never_opened.put(key(2), obj)
            assert never_opened.rebuild_stats["objects"] == 0  # it was opened
        finally:
            stall.release()
        assert await settled(lambda: obj.ref_count == 1)
        obj.release()
        await never_opened.close()

    run(scenario())
