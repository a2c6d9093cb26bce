"""The disk tier against fio and dd with O_DIRECT, same block size, same directory, one run.

kvplug writes and reads one file per 32 MiB chunk (plus its 4 KiB header block) with O_DIRECT
from allocator memory; fio and dd move the same bytes in the same file count and block size,
O_DIRECT too. Absolute numbers on a virtual disk are inflated by the host's cache, so only the
ratio in one run means anything; the target is >= 0.9x of fio.

    .venv/bin/python benchmarks/bench_disk.py [--dir /path/on/the/disk] [--chunks 32]

fio comes from Debian (apt-get install fio); without it only dd is compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import kvplug
from kvplug import CacheKey, FreeListAllocator

SHAPE = (2, 32, 256, 1024)
CHUNK = 2 * 32 * 256 * 1024 * 2


def key(n: int) -> CacheKey:
    return CacheKey("bench-disk", 1, 0, n)


async def kvplug_pass(directory: Path, chunks: int, depth: int) -> tuple[float, float]:
    """Seconds to put, then to get, ``chunks`` chunks with ``depth`` operations in flight."""
    allocator = FreeListAllocator(CHUNK * (chunks + depth + 2), pin=False)
    disk = await kvplug.open_backend(
        f"file://{directory}", allocator=allocator, max_size=CHUNK * chunks * 2, workers=depth
    )
    objs = [allocator.allocate(SHAPE, torch.float16) for _ in range(chunks)]
    for n, obj in enumerate(objs):
        assert obj is not None
        obj.raw.fill_(n % 251)

    async def limited(operations: list) -> list:  # type: ignore[type-arg]
        gate = asyncio.Semaphore(depth)

        async def one(op):  # type: ignore[no-untyped-def]
            async with gate:
                return await op

        return await asyncio.gather(*(one(op) for op in operations))

    start = time.perf_counter()
    await limited([disk.put(key(n), obj) for n, obj in enumerate(objs)])  # type: ignore[arg-type]
    put_seconds = time.perf_counter() - start
    for obj in objs:
        obj.release()  # type: ignore[union-attr]
    start = time.perf_counter()
    got = await limited([disk.get(key(n)) for n in range(chunks)])
    get_seconds = time.perf_counter() - start
    for n, obj in enumerate(got):
        assert obj is not None and bool((obj.raw == n % 251).all()), "wrong bytes read back"
        obj.release()
    await disk.close()
    return put_seconds, get_seconds


def fio_pass(directory: Path, chunks: int, depth: int) -> tuple[float, float] | None:
    """Seconds for fio to write, then read, the same bytes: ``depth`` jobs, O_DIRECT, psync."""
    if shutil.which("fio") is None:
        return None
    per_job = chunks // depth
    seconds = []
    for rw in ("write", "read"):
        result = subprocess.run(
            [
                "fio",
                "--name=kv",
                f"--directory={directory}",
                f"--rw={rw}",
                "--bs=32m",
                "--direct=1",
                "--ioengine=psync",
                f"--numjobs={depth}",
                f"--nrfiles={per_job}",
                f"--size={per_job * 32}m",
                "--group_reporting",
                "--output-format=json",
                # Files are created in the timed run, as kvplug creates one per object.
                "--create_on_open=1",
                "--fallocate=none",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        job = json.loads(result.stdout)["jobs"][0][rw]
        seconds.append(job["io_bytes"] / job["bw_bytes"])
    return seconds[0], seconds[1]


def dd_pass(directory: Path, chunks: int) -> tuple[float, float]:
    """Seconds for dd to write, then read, one 32 MiB file per chunk with O_DIRECT."""
    times = []
    for direction in ("write", "read"):
        start = time.perf_counter()
        for n in range(chunks):
            path = directory / f"dd-{n}"
            args = (
                ["if=/dev/zero", f"of={path}", "oflag=direct"]
                if direction == "write"
                else [f"if={path}", "of=/dev/null", "iflag=direct"]
            )
            subprocess.run(["dd", "bs=32M", "count=1", "status=none", *args], check=True)
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to test")
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvplug-bench-disk-", dir=args.dir))
    base.chmod(0o700)
    total = CHUNK * args.chunks
    print(f"{args.chunks} chunks of {CHUNK >> 20} MiB in {base}")
    try:
        for depth in (1, 4):
            rows: dict[str, list[tuple[float, float]]] = {"kvplug": [], "fio": [], "dd": []}
            for attempt in range(args.repeat):
                run_dir = base / f"d{depth}-{attempt}"
                for name in rows:
                    (run_dir / name).mkdir(parents=True)
                rows["kvplug"].append(
                    asyncio.run(kvplug_pass(run_dir / "kvplug", args.chunks, depth))
                )
                fio = fio_pass(run_dir / "fio", args.chunks, depth)
                if fio is not None:
                    rows["fio"].append(fio)
                if depth == 1:
                    rows["dd"].append(dd_pass(run_dir / "dd", args.chunks))
                shutil.rmtree(run_dir)
            print(f"queue depth {depth} (median of {args.repeat}):")
            medians = {}
            for name, samples in rows.items():
                if samples:
                    put = statistics.median(s[0] for s in samples)
                    get = statistics.median(s[1] for s in samples)
                    medians[name] = (put, get)
                    print(
                        f"  {name:<7} write {total / put / 1e9:6.2f} GB/s   "
                        f"read {total / get / 1e9:6.2f} GB/s"
                    )
            reference = "fio" if "fio" in medians else "dd"
            if reference in medians:
                put_ratio = medians[reference][0] / medians["kvplug"][0]
                get_ratio = medians[reference][1] / medians["kvplug"][1]
                print(
                    f"  ratio   write {put_ratio:.2f}x, read {get_ratio:.2f}x of {reference} "
                    "(target >= 0.9)"
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
