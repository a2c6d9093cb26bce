"""Per-op reads of file:// in pieces, the later pieces read on reader threads while the first
ones are hashed: the bytes are the stored ones, the checksum is the one the writer computed,
and damage anywhere, a late piece included, is a counted miss."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import key, leak_checked_allocator, read_back, run, seeded, seeded_bytes

import kvplug
from kvplug import FreeListAllocator, MemoryObj
from kvplug.frame import payload_checksum
from kvplug_disk import piecewise
from kvplug_disk.backend import DiskBackend
from kvplug_disk.fileio import Payload
from kvplug_disk.layout import BLOCK

MiB = 1 << 20
PIECE = 2 * BLOCK
"""The piece size these tests read with, so that small objects take several pieces."""

allocator = pytest.fixture(leak_checked_allocator, name="allocator")


@pytest.fixture
def pieces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Small pieces for the test; the list gets the payload length of each read in pieces."""
    monkeypatch.setattr(piecewise, "READ_PIECE", PIECE)
    lengths: list[int] = []
    original = piecewise.read_hashing

    def spy(fd: int, head: memoryview, payload: Payload, readers: Executor) -> Any:
        assert payload.host is not None
        lengths.append(payload.host.nbytes)
        return original(fd, head, payload, readers)

    monkeypatch.setattr(piecewise, "read_hashing", spy)
    return lengths


async def open_disk(root: Path, allocator: FreeListAllocator, **options: Any) -> DiskBackend:
    backend = await kvplug.open_backend(f"file://{root}", allocator=allocator, **options)
    assert isinstance(backend, DiskBackend)
    return backend


def require_o_direct(disk: DiskBackend) -> None:
    """Pieces are for O_DIRECT reads: skip where the test directory refuses O_DIRECT."""
    if not disk.directories[0].o_direct:
        pytest.skip(f"O_DIRECT is not available here: {disk.directories[0].o_direct_problem}")


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


SIZES = [PIECE + 1, 3 * PIECE, 3 * PIECE + 100, 7 * BLOCK + 5]


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_a_payload_read_with_o_direct_comes_in_pieces_and_is_the_stored_one(
    tmp_path: Path, allocator: FreeListAllocator, pieces: list[int], o_direct: bool
) -> None:
    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator, o_direct=o_direct)
        if o_direct:
            require_o_direct(disk)
        for n, size in enumerate(SIZES):
            obj = seeded(allocator, size, seed=n)
            await disk.put(key(n), obj)
            obj.release()
        for n, size in enumerate(SIZES):
            back = await read_back(disk, key(n))
            assert back is not None and torch.equal(back, seeded_bytes(size, n))
        # A buffered read is one copy out of the page cache: not split.
        assert pieces == (SIZES if o_direct else [])
        assert disk.corrupt_objects == 0
        await disk.close()

    run(scenario())


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned-dest", "unaligned-dest"])
def test_get_into_reads_in_pieces_into_the_callers_memory(
    tmp_path: Path, allocator: FreeListAllocator, pieces: list[int], aligned: bool
) -> None:
    size = 5 * BLOCK

    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator)
        require_o_direct(disk)
        obj = seeded(allocator, size, seed=3)
        await disk.put(key(1), obj)
        obj.release()
        backing = MemoryObj.from_tensor(torch.zeros(size + 2 * BLOCK, dtype=torch.uint8))
        offset = (-backing.data_ptr()) % BLOCK + (0 if aligned else 1)
        dest = MemoryObj.from_tensor(backing.raw[offset : offset + size])
        assert await disk.get_into(key(1), dest)
        assert torch.equal(dest.raw, seeded_bytes(size, 3))
        assert pieces == [size]
        await disk.close()

    run(scenario())


@pytest.mark.parametrize("where", ["first", "middle", "last", "last-byte"])
def test_a_flipped_byte_in_any_piece_is_a_counted_miss(
    tmp_path: Path, allocator: FreeListAllocator, pieces: list[int], where: str
) -> None:
    size = 4 * PIECE + 300  # five pieces, the last one short
    offsets = {"first": 7, "middle": 2 * PIECE + 11, "last": 4 * PIECE + 1, "last-byte": size - 1}

    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator)
        require_o_direct(disk)
        for n in (1, 2):
            obj = seeded(allocator, size, seed=n)
            await disk.put(key(n), obj)
            obj.release()
        path = disk.stored_files(key(1))[0]
        flip(path, BLOCK + offsets[where])
        assert await disk.get(key(1)) is None
        assert disk.corrupt_objects == 1 and disk.operation_stats()["get"].misses == 1
        assert not path.exists() and not await disk.contains(key(1))
        back = await read_back(disk, key(2))
        assert back is not None and torch.equal(back, seeded_bytes(size, 2))
        assert pieces == [size, size]
        await disk.close()

    run(scenario())


def test_a_flipped_byte_late_in_a_large_payload_is_a_counted_miss_for_get_and_get_into(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    """At the real piece size: a payload of three pieces and a bit, damaged in the last."""
    size = 3 * piecewise.READ_PIECE + 12_345
    assert size > 2 * piecewise.READ_PIECE

    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator)
        for n in (1, 2, 3):
            obj = seeded(allocator, size, seed=n)
            await disk.put(key(n), obj)
            obj.release()
        for n, read in ((1, "get"), (2, "get_into")):
            path = disk.stored_files(key(n))[0]
            flip(path, BLOCK + size - 1000)
            if read == "get":
                assert await disk.get(key(n)) is None
            else:
                dest = seeded(allocator, size, seed=9)
                assert not await disk.get_into(key(n), dest)
                dest.release()
            assert disk.corrupt_objects == n
            assert not path.exists() and not await disk.contains(key(n))
        back = await read_back(disk, key(3))
        assert back is not None and torch.equal(back, seeded_bytes(size, 3))
        await disk.close()

    run(scenario())


def test_the_checksum_of_a_read_in_pieces_is_the_writers_and_a_short_file_has_none(
    tmp_path: Path, allocator: FreeListAllocator, pieces: list[int]
) -> None:
    payload_bytes = seeded_bytes(5 * PIECE, 4).numpy().tobytes()
    file = tmp_path / "object"
    file.write_bytes(bytes(BLOCK) + payload_bytes)

    async def scenario() -> None:
        disk = await open_disk(tmp_path / "kv", allocator)
        for nbytes, file_bytes in ((5 * PIECE - 10, 5 * PIECE), (5 * PIECE, 3 * PIECE + 5)):
            os.truncate(file, BLOCK + file_bytes)
            memory = bytearray(5 * PIECE)
            view = memoryview(memory)
            payload = Payload([view], False, view[:nbytes])
            fd = os.open(file, os.O_RDONLY)
            try:
                count, checksum = piecewise.read_hashing(
                    fd, memoryview(bytearray(BLOCK)), payload, disk._workers.readers
                )
            finally:
                os.close(fd)
            assert count == BLOCK + file_bytes
            if file_bytes == 5 * PIECE:
                assert checksum == payload_checksum(payload_bytes[:nbytes])
            else:
                assert checksum is None  # a short file: the caller reports it truncated
        await disk.close()

    run(scenario())


def test_reads_still_verify_their_checksum_when_the_reader_threads_are_gone(
    tmp_path: Path, allocator: FreeListAllocator, pieces: list[int]
) -> None:
    size = 3 * PIECE + 7

    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator)
        require_o_direct(disk)
        for n in (1, 2):
            obj = seeded(allocator, size, seed=n)
            await disk.put(key(n), obj)
            obj.release()
        disk._workers.readers.shutdown(wait=True)
        back = await read_back(disk, key(1))
        assert back is not None and torch.equal(back, seeded_bytes(size, 1))
        path = disk.stored_files(key(2))[0]
        flip(path, BLOCK + size - 2)
        assert await disk.get(key(2)) is None
        assert disk.corrupt_objects == 1
        await disk.close()

    run(scenario())


def test_concurrent_reads_in_pieces_each_get_their_own_bytes(
    tmp_path: Path, allocator: FreeListAllocator, pieces: list[int]
) -> None:
    size = 6 * PIECE + 999

    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator, workers=3)
        require_o_direct(disk)
        for n in range(4):
            obj = seeded(allocator, size, seed=n)
            await disk.put(key(n), obj)
            obj.release()
        backs = await asyncio.gather(*(read_back(disk, key(n % 4)) for n in range(24)))
        for n, back in enumerate(backs):
            assert back is not None and torch.equal(back, seeded_bytes(size, n % 4))
        assert pieces == [size] * 24
        await disk.close()

    run(scenario())
