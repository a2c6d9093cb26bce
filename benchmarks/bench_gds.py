"""The gds:// tier against plain cuFile, same bytes, same offsets, same GPU buffer, one run.

gds:// (kvplug-disk[gds]) puts and gets KV chunks of ``[2, 32, 256, 1024]`` and
``[2, 24, 256, 1024]`` fp16 (32 and 24 MiB) that live in its own registered GPU buffer, one
file per chunk; the raw limit is cufile-python doing what a minimal GDS cache must do for the
same chunks: create a file with O_DIRECT, register it, cuFileWrite the chunk from the same
registered buffer at file offset 4096, close; then open, register and cuFileRead it back at
offset 4096. Chunks are moved one after another (queue depth 1). Median of ``--repeat``
passes, GB/s and the ratio (raw time / kvplug time: 1.0 means no overhead). Needs a CUDA GPU
and cuFile (docs/gds.md).

    python benchmarks/bench_gds.py [--dir /mnt/nvme/tmp] [--chunks 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryObj
from kvplug_disk.gds.backend import GdsBackend

SHAPES = {
    "[2,32,256,1024] fp16, 32 MiB": (2, 32, 256, 1024),
    "[2,24,256,1024] fp16, 24 MiB": (2, 24, 256, 1024),
}
HEADER = 4096


def key(n: int) -> CacheKey:
    return CacheKey("bench-gds", 1, 0, n)


async def kvplug_pass(
    gds: GdsBackend, objs: list[MemoryObj], round_index: int
) -> tuple[float, float]:
    """Seconds to put every chunk, then to get every chunk back (checked bit-exact)."""
    keys = [key(1000 * round_index + n) for n in range(len(objs))]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for k, obj in zip(keys, objs, strict=True):
        await gds.put(k, obj)
    put_seconds = time.perf_counter() - start
    start = time.perf_counter()
    got = [await gds.get(k) for k in keys]
    get_seconds = time.perf_counter() - start
    for obj, back in zip(objs, got, strict=True):
        assert back is not None and torch.equal(back.raw, obj.raw), "wrong bytes read back"
        back.release()
    for k in keys:
        await gds.remove(k)
    return put_seconds, get_seconds


def raw_pass(
    directory: Path, pool: FreeListAllocator, objs: list[MemoryObj], into: list[MemoryObj]
) -> tuple[float, float]:
    """Seconds for cufile-python to write every chunk to a file of its own at offset 4096 from
    the registered buffer, then to read each back into another chunk of that buffer."""
    from cufile import CuFile

    base = ctypes.c_void_p(pool.buffer.data_ptr())
    paths = [directory / f"raw-{n}" for n in range(len(objs))]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for path, obj in zip(paths, objs, strict=True):
        with CuFile(str(path), "w", use_direct_io=True) as handle:
            written = handle.write(base, obj.nbytes, file_offset=HEADER, dev_offset=obj.offset)
            assert written == obj.nbytes, f"cuFileWrite wrote {written} of {obj.nbytes}"
    write_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for path, obj in zip(paths, into, strict=True):
        with CuFile(str(path), "r", use_direct_io=True) as handle:
            read = handle.read(base, obj.nbytes, file_offset=HEADER, dev_offset=obj.offset)
            assert read == obj.nbytes, f"cuFileRead read {read} of {obj.nbytes}"
    read_seconds = time.perf_counter() - start
    for obj, back in zip(objs, into, strict=True):
        assert torch.equal(obj.raw, back.raw), "cuFile read back other bytes"
    for path in paths:
        path.unlink()
    return write_seconds, read_seconds


async def bench_shape(
    directory: Path, label: str, shape: tuple[int, ...], chunks: int, repeat: int
) -> None:
    nbytes = 2 * shape[0] * shape[1] * shape[2] * shape[3]
    gds = await kvplug.open_backend(
        f"gds://{directory}/kvplug",
        buffer_size=nbytes * (3 * chunks + 2),
        max_size=nbytes * chunks * 4,
    )
    assert isinstance(gds, GdsBackend)
    pool = gds.allocator
    assert isinstance(pool, FreeListAllocator)
    objs = [pool.allocate(shape, torch.float16) for _ in range(chunks)]
    into = [pool.allocate(shape, torch.float16) for _ in range(chunks)]
    generator = torch.Generator(device="cuda").manual_seed(0)
    for obj in objs:
        assert obj is not None
        obj.raw.copy_(
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)
        )
    raw_dir = directory / "raw"
    raw_dir.mkdir(exist_ok=True)
    kv_rows: list[tuple[float, float]] = []
    raw_rows: list[tuple[float, float]] = []
    for attempt in range(repeat):  # alternate which goes first, so neither always warms up
        if attempt % 2 == 0:
            kv_rows.append(await kvplug_pass(gds, objs, attempt))  # type: ignore[arg-type]
            raw_rows.append(raw_pass(raw_dir, pool, objs, into))  # type: ignore[arg-type]
        else:
            raw_rows.append(raw_pass(raw_dir, pool, objs, into))  # type: ignore[arg-type]
            kv_rows.append(await kvplug_pass(gds, objs, attempt))  # type: ignore[arg-type]
    total = nbytes * chunks
    print(f"{label}: {chunks} chunks, median of {repeat}, cuFile mode {gds.mode}")
    for index, name in ((0, "put/write"), (1, "get/read")):
        kv = statistics.median(row[index] for row in kv_rows)
        raw = statistics.median(row[index] for row in raw_rows)
        print(
            f"  {name:<9} cuFile {total / raw / 1e9:6.2f} GB/s   gds://     "
            f"{total / kv / 1e9:6.2f} GB/s   ratio {raw / kv:.2f}x"
        )
    for obj in (*objs, *into):
        obj.release()  # type: ignore[union-attr]
    await gds.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to test")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gds.py needs a CUDA GPU and cuFile; see docs/gds.md")
    base = Path(tempfile.mkdtemp(prefix="kvplug-bench-gds-", dir=args.dir))
    base.chmod(0o700)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, in {base} (pid {os.getpid()})"
    )
    try:
        for label, shape in SHAPES.items():
            asyncio.run(bench_shape(base, label, shape, args.chunks, args.repeat))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
