"""What file:// keeps in memory per stored key: a slotted index entry that derives its file's
path, shares shape tuples, and stays under 1 KiB per key with the key itself counted."""

from __future__ import annotations

import asyncio
import gc
import shutil
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import key, leak_checked_allocator, object_files, read_back, run, seeded

import kvplug
from kvplug import FreeListAllocator, MemoryObj
from kvplug_disk.backend import DiskBackend
from kvplug_disk.index import IndexEntry, shared_length, shared_shape
from kvplug_disk.layout import digest

allocator = pytest.fixture(leak_checked_allocator, name="allocator")


def small(pool: FreeListAllocator) -> MemoryObj:
    obj = pool.allocate((2, 4), torch.float16)
    assert obj is not None
    return obj


async def open_disk(root: Path, allocator: FreeListAllocator, **options: Any) -> DiskBackend:
    backend = await kvplug.open_backend(f"file://{root}", allocator=allocator, **options)
    assert isinstance(backend, DiskBackend)
    return backend


@pytest.mark.slow
def test_a_stored_key_costs_the_process_less_than_1_kib(tmp_path: Path) -> None:
    """5000 puts of small objects, each a new object with its own shape tuple (an engine's
    pattern), measured with tracemalloc: what the process still holds afterwards per key,
    the key itself included, is under 1 KiB; the index's share (what the puts added: the
    entries, their strings and ints, the eviction policy's order, the index's dicts) is
    under 512 bytes (it was about 590 with a dict per entry, a stored path and a shape tuple
    per entry)."""
    count = 5_000
    batch = 64

    async def scenario() -> tuple[float, float]:
        pool = FreeListAllocator(4 << 20, pin=False)
        disk = await open_disk(tmp_path, pool, max_size="1GiB")
        # Threads, per-thread buffers and the 256 subdirectories come with the first puts.
        for n in range(512):
            obj = small(pool)
            await disk.put(key(n, model="warm"), obj)
            obj.release()
        gc.collect()
        tracemalloc.start()
        try:
            start = tracemalloc.get_traced_memory()[0]
            keys = [key(n) for n in range(count)]
            keys_made = tracemalloc.get_traced_memory()[0] - sys.getsizeof(keys)
            for first in range(0, count, batch):
                some = keys[first : first + batch]
                objs = [small(pool) for _ in some]
                await asyncio.gather(*(disk.put(k, o) for k, o in zip(some, objs, strict=True)))
                for obj in objs:
                    obj.release()
            del keys, some, objs
            gc.collect()
            end = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert len(disk) == count + 512
        await disk.close()
        return (end - start) / count, (end - keys_made) / count

    per_key, index_share = run(scenario())
    assert per_key < 1024, f"{per_key:.0f} bytes per stored key"
    assert index_share < 512, f"the index holds {index_share:.0f} bytes per key"


def test_an_entry_has_no_dict_and_derives_its_path(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        disk = await open_disk(tmp_path, allocator)
        for n in (1, 2):
            obj = allocator.allocate((2, 3, 4), torch.float16)
            assert obj is not None
            await disk.put(key(n), obj)
            obj.release()
        first, second = (disk._index.get(key(n)) for n in (1, 2))
        assert isinstance(first, IndexEntry) and isinstance(second, IndexEntry)
        assert not hasattr(first, "__dict__")
        assert first.stem == digest(key(1).to_string())
        assert Path(first.path) == disk.stored_files(key(1))[0] and Path(first.path).is_file()
        assert first.shape == (2, 3, 4) and first.shape is second.shape
        assert first.size is second.size and first.size == disk._index.nbytes(key(1))
        await disk.close()

    run(scenario())


def test_shapes_and_lengths_are_shared_among_entries() -> None:
    size = torch.Size([7, 11, 13])
    shared = shared_shape(size)
    assert type(shared) is tuple and shared == (7, 11, 13)
    assert shared_shape((7, 11, 13)) is shared and shared_shape(torch.Size([7, 11, 13])) is shared
    length = shared_length(int("123456789"))
    assert length == 123456789 and shared_length(int("123456789")) is length


def test_an_object_file_in_another_subdirectory_than_its_name_says_is_foreign(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    """The index derives a file's path from its name, so a file moved to another subdirectory
    is not an object: it is left alone and counted, and its key is a miss."""

    async def fill() -> None:
        disk = await open_disk(tmp_path, allocator)
        for n in (1, 2):
            obj = seeded(allocator, 5000, seed=n)
            await disk.put(key(n), obj)
            obj.release()
        await disk.close()

    run(fill())
    path = next(p for p in object_files(tmp_path) if p.stem == digest(key(1).to_string()))
    other = "00" if path.parent.name != "00" else "01"
    (tmp_path / other).mkdir(mode=0o700, exist_ok=True)
    moved = tmp_path / other / path.name
    shutil.move(path, moved)

    async def reopen() -> None:
        disk = await open_disk(tmp_path, allocator)
        assert disk.rebuild_stats["objects"] == 1 and disk.rebuild_stats["foreign"] == 1
        assert await disk.get(key(1)) is None
        assert await read_back(disk, key(2)) is not None
        await disk.close()

    run(reopen())
    assert moved.is_file()
