"""A batched put that stores only some of its objects says exactly which: in the error's
``stored`` (aligned with the keys) and in its message, which names the positions stored and
not stored and never claims that nothing was stored when something was. Puts that start
together on a nearly full disk claim its free space first, so the ones that fit are stored
and the others fail before writing, instead of all running out of room half-way."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import (
    key,
    leak_checked_allocator,
    object_files,
    read_back,
    run,
    seeded,
    seeded_bytes,
    small_filesystem,
)

import kvplug
from kvplug import CacheKey, CapacityExceeded, FreeListAllocator
from kvplug_disk.backend import DiskBackend
from kvplug_disk.layout import BLOCK, TEMP_NAME, digest
from kvplug_testing.stall import Stall

allocator = pytest.fixture(leak_checked_allocator, name="allocator")


async def batch(
    disk: DiskBackend, allocator: FreeListAllocator, keys: list[CacheKey], nbytes: int
) -> CapacityExceeded:
    """``batched_put`` of seeded objects (seed = position) under ``keys``, which must fail
    with CapacityExceeded; that error."""
    objs = [seeded(allocator, nbytes, seed=n) for n in range(len(keys))]
    try:
        with pytest.raises(CapacityExceeded) as raised:
            await disk.batched_put(keys, objs)
    finally:
        for obj in objs:
            obj.release()
    return raised.value


async def check_outcome(
    disk: DiskBackend, error: CapacityExceeded, keys: list[CacheKey], nbytes: int
) -> tuple[bool, ...]:
    """The error tells which keys were stored; those read back bit-exact, the others miss."""
    stored = error.stored
    assert stored is not None and len(stored) == len(keys)
    for n, (k, done) in enumerate(zip(keys, stored, strict=True)):
        back = await read_back(disk, k)
        if done:
            assert back is not None and torch.equal(back, seeded_bytes(nbytes, n))
        else:
            assert back is None
    kept = [n for n, done in enumerate(stored) if done]
    lost = [n for n, done in enumerate(stored) if not done]
    message = str(error)
    assert f"{len(kept)} stored" in message and f"{len(lost)} not" in message, message
    for n in lost:
        assert str(n) in message.split(" not (")[1].split(")")[0], message
    if kept:
        assert "nothing was stored" not in message.lower(), message
    return stored


@pytest.mark.parametrize("kind", ["tmpfs", "ext4"])
def test_four_objects_into_room_for_two_store_two_and_say_which(
    tmp_path: Path, allocator: FreeListAllocator, kind: str
) -> None:
    """A real filesystem with room for two of four objects put at once, on four file I/O
    threads: two are stored, the error says which (and not that nothing was stored), they
    read back bit-exact, the other two miss and no temporary file is left."""
    with small_filesystem(kind, tmp_path / "mnt") as mount:
        root = mount / "kv"
        root.mkdir(mode=0o700)
        free = shutil.disk_usage(root).free
        nbytes = free * 2 // 5 // BLOCK * BLOCK - BLOCK  # two files take 4/5 of the room
        keys = [key(n) for n in range(4)]

        async def scenario() -> None:
            disk = await kvplug.open_backend(
                f"file://{root}", allocator=allocator, workers=4, max_size="1GiB"
            )
            assert isinstance(disk, DiskBackend)
            try:
                error = await batch(disk, allocator, keys, nbytes)
                assert sum(await check_outcome(disk, error, keys, nbytes)) == 2
                assert "bytes free" in str(error)  # refused before writing, not by ENOSPC
                assert not [p for p in root.rglob("*") if TEMP_NAME.fullmatch(p.name)]
                assert len(object_files(root)) == 2 == len(disk)
            finally:
                await disk.close()

        run(scenario())


@pytest.mark.parametrize("kind", ["tmpfs", "ext4"])
def test_a_write_in_flight_holds_back_only_the_space_its_file_was_not_given_yet(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Room for two objects. The first put's file is written whole, but its write has not
    ended (held before it closes the file): the disk's free space already lacks that file,
    so a second put fits (counting the first one's claim again would refuse it, as a busy
    machine showed), and a third is refused before writing."""
    with small_filesystem(kind, tmp_path / "mnt") as mount:
        root = mount / "kv"
        root.mkdir(mode=0o700)
        nbytes = shutil.disk_usage(root).free * 2 // 5 // BLOCK * BLOCK - BLOCK

        async def scenario() -> None:
            disk = await kvplug.open_backend(
                f"file://{root}", allocator=allocator, workers=2, max_size="1GiB"
            )
            assert isinstance(disk, DiskBackend)
            (directory,) = disk.directories
            stall = Stall(monkeypatch, directory, "written", disk, "_write")
            objs = [seeded(allocator, nbytes, seed=n) for n in range(3)]
            try:
                first = asyncio.ensure_future(disk.put(key(0), objs[0]))
                for _ in range(1000):
                    if stall.reached.is_set():
                        break
                    await asyncio.sleep(0.01)
                assert stall.reached.is_set(), "the first put never finished writing its file"
                await disk.put(key(1), objs[1])
                with pytest.raises(CapacityExceeded, match="bytes free"):
                    await disk.put(key(2), objs[2])
                await asyncio.to_thread(stall.release)
                await first
                for n in (0, 1):
                    back = await read_back(disk, key(n))
                    assert back is not None and torch.equal(back, seeded_bytes(nbytes, n))
                assert await read_back(disk, key(2)) is None
                assert not [p for p in root.rglob("*") if TEMP_NAME.fullmatch(p.name)]
            finally:
                await asyncio.to_thread(stall.release)
                for obj in objs:
                    obj.release()
                await disk.close()

        run(scenario())


def test_a_batch_whose_disk_refuses_some_writes_names_exactly_the_keys_stored(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk refuses the writes of the second and fourth objects with ENOSPC (injected
    into their files' writes only): ``stored`` is exactly (True, False, True, False), the
    message names positions 0 and 2 as stored and 1 and 3 as not, and the first failure (of
    the second key) with its cause; the first and third read back bit-exact."""
    keys = [key(n) for n in range(4)]
    refused = {digest(keys[1].to_string()), digest(keys[3].to_string())}
    real_pwritev = os.pwritev

    def pwritev(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        name = Path(f"/proc/self/fd/{fd}").readlink().name
        if TEMP_NAME.fullmatch(name) and name[1:33] in refused:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwritev(fd, buffers, offset, *args)

    async def scenario() -> None:
        disk = await kvplug.open_backend(f"file://{tmp_path}", allocator=allocator)
        assert isinstance(disk, DiskBackend)
        monkeypatch.setattr(os, "pwritev", pwritev)
        try:
            error = await batch(disk, allocator, keys, 100_000)
            assert await check_outcome(disk, error, keys, 100_000) == (True, False, True, False)
            message = str(error)
            assert "2 stored (positions 0 and 2) and 2 not (positions 1 and 3)" in message
            assert str(keys[1]) in message and "ENOSPC" in message, message
            assert isinstance(error.__cause__, CapacityExceeded)
        finally:
            monkeypatch.setattr(os, "pwritev", real_pwritev)
            await disk.close()

    run(scenario())
