"""gds:// with real cuFile (cufile-python) on a CUDA GPU: round trips from GPU memory and from
pinned host memory, bit-exact; what the checksums catch in each; two instances sharing a
directory; the contract suite with host, pinned and GPU memory. Skipped, with the reason,
where there is no CUDA GPU or cuFile cannot be loaded (see docs/gds.md for the set-up, and
docs/gpu.md for how these runs are made)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import object_files, run, seeded_bytes

import kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug_contracts import BackendContract
from kvplug_contracts.support import violated
from kvplug_disk.fileio.cufile import CuFileIO
from kvplug_disk.gds.backend import GdsBackend
from kvplug_disk.layout import BLOCK, decode_block

MiB = 1 << 20
CHUNK = (2, 32, 256, 1024)


def _cufile_problem() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        CuFileIO()
    except Exception as error:
        return f"cuFile is not usable here: {error}"
    return None


PROBLEM = _cufile_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")


def key(i: int) -> CacheKey:
    return CacheKey("llama-gds", 1, 0, i)


def fill(obj: MemoryObj, seed: int) -> torch.Tensor:
    data = seeded_bytes(obj.nbytes, seed)
    obj.raw.copy_(data.to(obj.device))
    return data


async def open_gds(url: str, **options: Any) -> GdsBackend:
    backend = await kvplug.open_backend(url, **options)
    assert isinstance(backend, GdsBackend)
    return backend


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.uint8]
)
def test_gpu_objects_round_trip_bit_exact_through_cufile(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    async def scenario() -> None:
        gds = await open_gds(f"gds://{tmp_path}?buffer_size=512MiB")
        print(f"cuFile mode: {gds.mode} ({gds.mode_reason})")
        assert gds.mode in ("gds", "compat")
        pool = gds.allocator
        assert isinstance(pool, FreeListAllocator) and pool.buffer.is_cuda
        for n, shape in enumerate([CHUNK, (2, 24, 256, 1024), (2, 32, 17, 1024), (1,)]):
            obj = pool.allocate(shape, dtype, MemoryFormat.KV_2LTD)
            assert obj is not None
            expected = fill(obj, n)
            await gds.put(key(n), obj)
            obj.release()
            got = await gds.get(key(n))
            assert got is not None and got.device.type == "cuda"
            assert (got.shape, got.dtype) == (tuple(shape), dtype)
            assert torch.equal(got.raw.cpu(), expected)
            got.release()
        await gds.close()
        assert pool.stats().used == 0

    run(scenario())
    for path in object_files(tmp_path):
        assert not decode_block(path.read_bytes()[:BLOCK]).payload_checksummed


def test_pinned_host_objects_round_trip_checksummed_and_readable_by_file(tmp_path: Path) -> None:
    pinned = FreeListAllocator(256 * MiB, pin=True)
    assert pinned.buffer.is_pinned()

    async def scenario() -> None:
        gds = await open_gds(f"gds://{tmp_path}", allocator=pinned)
        obj = pinned.allocate(CHUNK, torch.float16)
        assert obj is not None
        expected = fill(obj, 1)
        await gds.put(key(1), obj)
        obj.release()
        got = await gds.get(key(1))
        assert got is not None and got.raw.is_pinned() and torch.equal(got.raw, expected)
        got.release()
        await gds.close()
        disk = await kvplug.open_backend(f"file://{tmp_path}", allocator=pinned)
        again = await disk.get(key(1))
        assert again is not None and torch.equal(again.raw, expected)
        again.release()
        await disk.close()

    run(scenario())
    (path,) = object_files(tmp_path)
    data = path.read_bytes()
    assert decode_block(data[:BLOCK]).payload_checksummed
    assert data[BLOCK : BLOCK + 32 * MiB] == seeded_bytes(32 * MiB, 1).numpy().tobytes()
    assert pinned.stats().used == 0


def test_allocator_buffers_are_registered_with_cufile_once(tmp_path: Path) -> None:
    pinned = FreeListAllocator(64 * MiB, pin=True)

    async def scenario() -> None:
        gds = await open_gds(f"gds://{tmp_path}?buffer_size=256MiB")
        own = gds.allocator
        assert isinstance(own, FreeListAllocator)
        assert gds.io.registered(own.buffer), gds.io.register_error
        obj = pinned.allocate((MiB,), torch.uint8, MemoryFormat.BINARY_BUFFER)
        assert obj is not None
        fill(obj, 9)
        await gds.put(key(1), obj)
        await gds.put(key(2), obj)
        obj.release()
        assert gds.io.registered(pinned.buffer), gds.io.register_error
        await gds.close()
        assert not gds.io.registered(own.buffer) and not gds.io.registered(pinned.buffer)

    run(scenario())


def test_pageable_and_foreign_objects_are_staged_bit_exact(tmp_path: Path) -> None:
    pageable = FreeListAllocator(64 * MiB, pin=False)

    async def scenario() -> None:
        gds = await open_gds(f"gds://{tmp_path}", allocator=pageable)
        host = pageable.allocate((3 * MiB + 5,), torch.uint8, MemoryFormat.BINARY_BUFFER)
        assert host is not None
        expected_host = fill(host, 2)
        gpu_tensor = seeded_bytes(5 * MiB + 3, 3).cuda()
        await gds.put(key(1), host)
        await gds.put(key(2), MemoryObj.from_tensor(gpu_tensor, MemoryFormat.BINARY_BUFFER))
        host.release()
        for k, expected in ((key(1), expected_host), (key(2), gpu_tensor.cpu())):
            got = await gds.get(k)
            assert got is not None and torch.equal(got.raw, expected)
            got.release()
        await gds.close()

    run(scenario())
    assert pageable.stats().used == 0


def _damage(root: Path, how: str) -> None:
    (path,) = object_files(root)
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[BLOCK + 1000] ^= 0x01
    else:
        del data[len(data) - BLOCK :]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("how", "gpu_checksum", "detected"),
    [("truncate", False, True), ("flip", True, True), ("flip", False, False)],
)
def test_what_the_checks_catch_for_gpu_payloads(
    tmp_path: Path, how: str, gpu_checksum: bool, detected: bool
) -> None:
    """Length and headers are always checked; a payload byte changed in place in a file
    written from GPU memory is caught only with gpu_checksum=true (documented)."""

    async def scenario() -> None:
        url = f"gds://{tmp_path}?buffer_size=256MiB&gpu_checksum={str(gpu_checksum).lower()}"
        gds = await open_gds(url)
        obj = gds.allocator.allocate(CHUNK, torch.float16)
        assert obj is not None
        fill(obj, 4)
        await gds.put(key(1), obj)
        obj.release()
        _damage(tmp_path, how)
        got = await gds.get(key(1))
        if detected:
            assert got is None and gds.corrupt_objects == 1
        else:
            assert got is not None and gds.corrupt_objects == 0
            got.release()
        await gds.close()

    run(scenario())


def test_two_instances_share_a_directory_from_gpu_memory(tmp_path: Path) -> None:
    async def scenario() -> None:
        first = await open_gds(f"gds://{tmp_path}?buffer_size=256MiB")
        second = await open_gds(f"gds://{tmp_path}?buffer_size=256MiB")
        obj = first.allocator.allocate(CHUNK, torch.bfloat16)
        assert obj is not None
        expected = fill(obj, 5)
        await first.put(key(1), obj)
        obj.release()
        assert await second.contains(key(1))
        got = await second.get(key(1))
        assert got is not None and got.device.type == "cuda"
        assert torch.equal(got.raw.cpu(), expected)
        got.release()
        assert await second.remove(key(1))
        assert not await first.contains(key(1))
        await first.close()
        await second.close()

    run(scenario())


# -- the contract suite with cuFile -----------------------------------------------------------


def _checked(pool: FreeListAllocator) -> None:
    stats = pool.stats()
    if stats.used:
        violated(5, f"{stats.object_count} object(s) ({stats.used} bytes) still allocated")


class TestGdsCuFilePageableConformance(BackendContract):
    """Objects in pageable host memory (the suite's own allocator): staged through cuFile's
    registered pinned pool."""

    @pytest.fixture
    def kvplug_url(self, tmp_path: Path) -> str:
        return f"gds://{tmp_path}/gds"

    @pytest.fixture
    def small_store_options(self) -> dict[str, Any]:
        return {"max_size": "4MiB"}


class TestGdsCuFilePinnedConformance(TestGdsCuFilePageableConformance):
    """Objects in pinned host memory: straight through cuFile, registered, checksummed."""

    @pytest.fixture
    def allocator(self) -> Iterator[FreeListAllocator]:
        pool = FreeListAllocator(512 * MiB, pin=True)
        yield pool
        _checked(pool)


class TestGdsCuFileGpuConformance(TestGdsCuFilePageableConformance):
    """Objects in GPU memory, with gpu_checksum=true so that damaged payloads are caught."""

    @pytest.fixture
    def allocator(self) -> Iterator[FreeListAllocator]:
        pool = FreeListAllocator(512 * MiB, device="cuda")
        yield pool
        _checked(pool)

    @pytest.fixture
    def kvplug_options(self) -> dict[str, Any]:
        return {"gpu_checksum": True}
