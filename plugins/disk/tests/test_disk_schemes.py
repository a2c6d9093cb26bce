"""What file:// and gds:// share, checked once for each scheme (gds:// with
``gds_standin.PosixStandIn`` moving the payloads in place of cuFile): the file layout, staging
of objects outside aligned memory, the index rebuilt at open, instances sharing a directory,
sharding over several directories and hostile keys. What only one scheme does is in
test_disk_backend.py and test_gds_backend.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from disk_helpers import (
    SCHEMES,
    key,
    leak_checked_allocator,
    object_files,
    open_tier,
    put_seeded,
    read_back,
    run,
    seeded_bytes,
)
from gds_standin import PosixStandIn

from kvplug import CacheKey, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.keys import InvalidKey
from kvplug_disk import payloads
from kvplug_disk.gds import scheme as gds_scheme
from kvplug_disk.gds.backend import GdsBackend
from kvplug_disk.layout import (
    BLOCK,
    OBJECT_NAME,
    TEMP_NAME,
    decode_block,
    digest,
    file_length,
    object_name,
)

KiB = 1024
MiB = 1024 * KiB

allocator = pytest.fixture(leak_checked_allocator, name="allocator")


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


# -- layout and round trips --------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_object_is_one_block_aligned_file_named_by_the_key_digest(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    """The same file for both schemes; gds:// moves it through the FileIO seam, which is asked
    for the probe at open and for the payload, and registers the allocator's buffer once."""
    io = PosixStandIn()

    async def scenario() -> None:
        tier = await open_tier(scheme, tmp_path / "kv", allocator, io=io)
        await put_seeded(tier, allocator, key(1), 10_000, seed=1)
        got = await read_back(tier, key(1))
        assert got is not None and torch.equal(got, seeded_bytes(10_000, 1))
        if scheme == "gds":
            assert isinstance(tier, GdsBackend)
            assert tier.mode == "posix-stand-in"
            assert tier.describe()["io"] == "posix-stand-in"
            assert (io.calls["write"], io.calls["read"], io.calls["register"]) == (2, 2, 1)
        await tier.close()

    run(scenario())
    subdir, name = object_name(key(1).to_string())
    path = tmp_path / "kv" / subdir / name
    assert object_files(tmp_path) == [path]
    assert name == digest(key(1).to_string()) + ".kv"
    data = path.read_bytes()
    assert len(data) == file_length(10_000) == BLOCK + 3 * BLOCK
    header = decode_block(data[:BLOCK])
    assert header.key_text == key(1).to_string() and header.payload_checksummed
    assert header.frame.payload_len == 10_000
    assert data[BLOCK : BLOCK + 10_000] == seeded_bytes(10_000, 1).numpy().tobytes()
    assert data[BLOCK + 10_000 :] == bytes(3 * BLOCK - 10_000)  # zero padding, nothing stale
    assert stat_mode(tmp_path / "kv") == 0o700 and stat_mode(path.parent) == 0o700
    assert not [p for p in tmp_path.rglob("*") if TEMP_NAME.fullmatch(p.name)]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_objects_outside_aligned_memory_round_trip_through_staging_or_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """from_tensor objects (no allocator), a 64-byte-aligned allocator for get, and an object
    larger than the staging pool (file:// then goes buffered, gds:// stages it in memory of
    its own), all bit-exact."""
    monkeypatch.setattr(payloads, "BOUNCE_POOL_SIZE", 1 * MiB)
    monkeypatch.setattr(gds_scheme, "STAGING_POOL_SIZE", 1 * MiB)
    unaligned = FreeListAllocator(8 * MiB, alignment=64, pin=False)

    async def scenario() -> None:
        tier = await open_tier(scheme, tmp_path / "kv", unaligned)
        small = torch.arange(3000, dtype=torch.float32)
        big = seeded_bytes(3 * MiB + 5, seed=7)
        await tier.put(key(1), MemoryObj.from_tensor(small))
        await tier.put(key(2), MemoryObj.from_tensor(big, MemoryFormat.BINARY_BUFFER))
        for k, expected in ((key(1), small), (key(2), big)):
            got = await tier.get(k)
            assert got is not None and got.allocator is unaligned
            assert got.dtype == expected.dtype and torch.equal(got.tensor, expected)
            got.release()
        await tier.close()

    run(scenario())
    assert unaligned.stats().used == 0


# -- persistence and sharing -------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_reopen_finds_every_object_with_its_metadata(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    root = tmp_path / "kv"
    tensor = torch.randn(2, 3, 16, 8).to(torch.bfloat16)

    async def scenario() -> None:
        first = await open_tier(scheme, root, allocator)
        obj = allocator.allocate(tensor.shape, tensor.dtype, MemoryFormat.KV_2LTD)
        assert obj is not None
        obj.tensor.copy_(tensor)
        await first.put(key(1), obj)
        obj.release()
        for i in range(2, 6):
            await put_seeded(first, allocator, key(i), 4096 * i, seed=i)
        await first.close()

        second = await open_tier(scheme, root, allocator)
        assert second.rebuild_stats["objects"] == 5 and len(second) == 5
        assert sorted(k.chunk_hash for k in [k async for k in second.list_keys()]) == [
            1,
            2,
            3,
            4,
            5,
        ]
        got = await second.get(key(1))
        assert got is not None
        assert (got.shape, got.dtype, got.fmt) == (tuple(tensor.shape), torch.bfloat16, 1)
        assert torch.equal(got.tensor, tensor)
        got.release()
        for i in range(2, 6):
            back = await read_back(second, key(i))
            assert back is not None and torch.equal(back, seeded_bytes(4096 * i, i))
        assert second.bytes_held == sum(file_length(4096 * i) for i in range(2, 6)) + file_length(
            tensor.numel() * 2
        )
        assert second.discovered == 0
        await second.close()

    run(scenario())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_instances_sharing_a_directory_see_each_others_writes_and_removals(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    """An engine's tensor-parallel ranks (or hosts on a shared mount) are instances with a
    backend each on one directory: what one writes after the other opened is found, by
    contains, get and get_into, and what one removes or evicts is gone for the other."""

    async def scenario() -> None:
        root = tmp_path / "kv"
        first = await open_tier(scheme, root, allocator)
        second = await open_tier(scheme, root, allocator)
        assert type(first).capabilities.shared_across_processes
        await put_seeded(first, allocator, key(1), 6000, seed=1)
        assert await second.contains(key(1))  # written after second opened
        assert await second.batched_contains([key(1), key(2)]) == 1
        dest = MemoryObj.from_tensor(torch.zeros(6000, dtype=torch.uint8))
        assert await second.get_into(key(1), dest)
        assert torch.equal(dest.raw, seeded_bytes(6000, 1))
        back = await read_back(second, key(1))
        assert back is not None and torch.equal(back, seeded_bytes(6000, 1))
        assert second.discovered == 1 and second.stats()["discovered"] == 1
        await put_seeded(second, allocator, key(1), 9000, seed=2)  # replaced by the other
        back = await read_back(first, key(1))
        assert back is not None and torch.equal(back, seeded_bytes(9000, 2))
        await put_seeded(second, allocator, key(3), 100, seed=3)
        assert await first.pin(key(3))
        assert await first.remove(key(3))
        assert not await second.contains(key(3))  # removed by the other instance
        assert await second.get(key(3)) is None
        assert not await second.get_into(
            key(3), MemoryObj.from_tensor(torch.zeros(100, dtype=torch.uint8))
        )
        assert not await second.remove(key(3))
        await first.close()
        await second.close()

    run(scenario())


# -- directories, sharding and keys ------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_objects_are_sharded_over_several_directories_by_key_hash_and_found_again(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    dirs = first, second, third = tmp_path / "nvme0", tmp_path / "nvme1", tmp_path / "nvme2"

    async def scenario() -> None:
        tier = await open_tier(scheme, f"{first},{second}", allocator, paths=[str(third)])
        assert [d.path for d in tier.directories] == [str(d) for d in dirs]
        for i in range(48):
            await put_seeded(tier, allocator, key(i), 4096, seed=i)
        await tier.close()
        again = await open_tier(scheme, f"{first}?paths={second},{third}", allocator)
        assert again.rebuild_stats["objects"] == 48
        for i in range(48):
            back = await read_back(again, key(i))
            assert back is not None and torch.equal(back, seeded_bytes(4096, i))
        await again.close()

    run(scenario())
    counts = [len(object_files(d)) for d in dirs]
    assert sum(counts) == 48 and all(count > 5 for count in counts)
    for path in object_files(tmp_path):
        stem = path.name.removesuffix(".kv")
        assert path.parent.parent == dirs[int(stem[2:10], 16) % len(dirs)]


HOSTILE = (
    "..",
    "../../etc",
    "../../../../../../../../etc/passwd",
    "/abs/path",
    "/",
    "a/../../b",
    "x\\..\\y",
    "dir/./sub/",
    "~/x",
    "$(touch pwned)",
    "模型/ünïcödé-🚀",
    "d/" * 300,
    "n" * 3000,
)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_hostile_keys_never_create_files_outside_the_directories(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    root = tmp_path / "a" / "b" / "kv"

    async def scenario() -> None:
        tier = await open_tier(scheme, root, allocator)
        for n, model in enumerate(HOSTILE):
            await put_seeded(tier, allocator, key(n, model), 4096, seed=n)
            tagged = CacheKey("m", 1, 0, n, tags=(("..", "../" * 20),))
            await put_seeded(tier, allocator, tagged, 4096, seed=100 + n)
        for n, model in enumerate(HOSTILE):
            back = await read_back(tier, key(n, model))
            assert back is not None and torch.equal(back, seeded_bytes(4096, n))
        with pytest.raises(InvalidKey, match=f"{scheme}:// keeps each key .* at most"):
            await put_seeded(tier, allocator, key(1, "m" * 5000), 4096, seed=0)
        await tier.close()

    run(scenario())
    for path in tmp_path.rglob("*"):
        assert path == root or root in path.parents or path in root.parents, path
        if path.is_file():
            assert OBJECT_NAME.fullmatch(path.name) and path.parent.parent == root
    assert len(object_files(root)) == 2 * len(HOSTILE)
