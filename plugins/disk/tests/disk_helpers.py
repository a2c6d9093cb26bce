"""What the disk and GDS tier tests share: keys, seeded objects, a leak-checked allocator, a
tier of either scheme, the object files on disk and small real filesystems.

On ``sys.path`` through ``pythonpath`` in the pytest configuration (pyproject.toml)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from gds_standin import PosixStandIn

import kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.runtime.store import Store
from kvplug_disk.backend import DiskBackend
from kvplug_disk.fileio import FileIO
from kvplug_disk.layout import BLOCK, OBJECT_NAME

T = TypeVar("T")
MiB = 1 << 20
SCHEMES = ["file", "gds"]
"""The schemes of the tests that run for both (``pytest.mark.parametrize("scheme", SCHEMES)``)."""


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def key(i: int, model: str = "llama") -> CacheKey:
    return CacheKey(model, 1, 0, i)


def seeded_bytes(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def seeded(allocator: FreeListAllocator, nbytes: int, seed: int) -> MemoryObj:
    obj = allocator.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY_BUFFER)
    assert obj is not None
    obj.raw.copy_(seeded_bytes(nbytes, seed))
    return obj


async def open_tier(
    scheme: str,
    root: Path | str,
    allocator: FreeListAllocator,
    *,
    io: FileIO | None = None,
    **options: Any,
) -> DiskBackend:
    """``scheme``:// on ``root`` (a directory, or what follows ``scheme://`` in the URL), opened;
    gds:// with ``io`` (default: a fresh :class:`PosixStandIn`) in place of cuFile."""
    if scheme == "gds":
        options["file_io"] = io if io is not None else PosixStandIn()
    backend = await kvplug.open_backend(f"{scheme}://{root}", allocator=allocator, **options)
    assert isinstance(backend, DiskBackend)
    return backend


def object_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if OBJECT_NAME.fullmatch(p.name) and p.is_file())


def leak_checked_allocator(nbytes: int = 64 << 20) -> Iterator[FreeListAllocator]:
    """Objects of a test and results of get (``pytest.fixture(leak_checked_allocator)``):
    nothing may stay allocated afterwards."""
    pool = FreeListAllocator(nbytes, pin=False)
    yield pool
    assert pool.stats().used == 0, "a reference was leaked"


async def read_back(source: kvplug.Backend | Store, k: CacheKey) -> torch.Tensor | None:
    """A copy of what ``source`` holds under ``k`` (None: a miss), the object released."""
    got = await source.get(k)
    if got is None:
        return None
    try:
        return got.raw.clone()
    finally:
        got.release()


async def put_seeded(
    target: kvplug.Backend | Store,
    allocator: FreeListAllocator,
    k: CacheKey,
    nbytes: int,
    seed: int,
) -> None:
    """Put ``seeded(allocator, nbytes, seed)`` under ``k``; the object is released after."""
    obj = seeded(allocator, nbytes, seed)
    try:
        await target.put(k, obj)
    finally:
        obj.release()


@contextlib.contextmanager
def small_filesystem(kind: str, where: Path, size: int = 24 * MiB) -> Iterator[Path]:
    """A filesystem of ``size`` bytes and ``kind`` (``ext4`` on a loop-mounted image, or
    ``tmpfs``) mounted at ``where``; skips, saying why, where this machine cannot mount it."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip(f"mounting a small {kind} needs root and mount(8)")
    where.mkdir(mode=0o700)
    if kind == "ext4":
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("mkfs.ext4 (e2fsprogs) is not installed")
        image = where.with_suffix(".img")
        with image.open("wb") as file:
            file.truncate(size)
        # No blocks reserved for root: this test runs as root, which could write into them.
        made = subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", str(image)],
            capture_output=True,
            text=True,
        )
        if made.returncode:
            pytest.fail(f"mkfs.ext4 failed: {made.stderr.strip()}")
        command = ["mount", "-o", "loop", str(image), str(where)]
    else:
        command = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=700", "tmpfs", str(where)]
    mounted = subprocess.run(command, capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a {kind} here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def fill(mount: Path) -> Path:
    """Fill the filesystem at ``mount`` to 0 bytes free with one file; its path."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for size in (1 * MiB, 64 << 10, BLOCK, 512, 1):
            chunk = bytes(size)
            with contextlib.suppress(OSError):
                while os.write(fd, chunk) == size:
                    pass
        os.fsync(fd)
    finally:
        os.close(fd)
    os.sync()
    free = shutil.disk_usage(mount).free
    assert free < BLOCK, f"{free} bytes are still free on {mount}"
    return filler
