"""The Store against its tiers' own backends, and its memory high-water mark, in one run.

Part 1, batched calls: ``Store.batched_put`` (until the lower tier has every chunk: put, then
``flush``) and ``Store.batched_get`` (keys only the lower tier holds, so the cpu tier misses and
takes the hits back) of 8 and 64 chunks of 32 MiB, through ``[cpu, file]`` and ``[cpu, redis]``,
against the same batched call made directly on the lower tier's backend, interleaved, same keys,
same memory. Also ``batched_get`` of keys the cpu tier holds, against the cpu backend itself.
The ratio is direct time / Store time (target >= 0.95).

Part 2, memory: a fresh process writes ``--write-gb`` GB of chunks through ``[cpu 1 GiB, file]``
as fast as it can fill them (an engine outpacing the disk), then reads the last chunks back
through the Store; its peak RSS above what it used before the Store opened is compared with the
configured budget (target <= 1.1x), with the puts dropped for the disk and the misses. Twice:
puts that never wait (the default: the disk gets what the write-behind can hold), and puts that
wait for write-behind room (``write_behind_wait``: the engine is throttled to the disk).

    .venv/bin/python benchmarks/bench_store.py [--batches 8,64] [--repeat 3] [--write-gb 20]

redis-server comes from Debian (apt-get install redis-server); --no-redis skips that config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvplug import CacheKey, MemoryObj
from kvplug.memory import nbytes_of
from kvplug.runtime.config import Config
from kvplug.runtime.store import Store, open_store
from kvplug.units import GiB, parse_size

SHAPE = (2, 32, 256, 1024)
CHUNK = nbytes_of(SHAPE, torch.float16)
TARGET_RATIO = 0.95
TARGET_MEMORY = 1.1
MiB = 1 << 20


def key(n: int, run: str) -> CacheKey:
    return CacheKey(f"bench-store-{run}", 1, 0, n)


async def timed(operation: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await operation()
    return time.perf_counter() - start


def release(objs: Sequence[MemoryObj | None]) -> None:
    for obj in objs:
        assert obj is not None, "a chunk the benchmark stored was missed"
        obj.release()


async def timed_pairs(
    direct: Callable[[], Awaitable[Any]],
    through: Callable[[], Awaitable[Any]],
    repeat: int,
    prepare: Callable[[], Awaitable[Any]] | None = None,
) -> tuple[list[float], list[float]]:
    """Seconds of each pass of ``direct`` and ``through`` (after ``prepare``, untimed), after
    a warm-up of each, alternating which goes first."""

    async def timed_through() -> float:
        if prepare is not None:
            await prepare()
        return await timed(through)

    await direct()  # warm-up: threads, connections, first touch of memory
    await timed_through()
    direct_times: list[float] = []
    store_times: list[float] = []
    for rep in range(repeat):
        if rep % 2 == 0:
            direct_times.append(await timed(direct))
            store_times.append(await timed_through())
        else:
            store_times.append(await timed_through())
            direct_times.append(await timed(direct))
    return direct_times, store_times


async def compare_batch(
    store: Store, name: str, batch: int, repeat: int, shape: tuple[int, ...]
) -> list[dict[str, Any]]:
    cpu, lower = store.tiers
    nbytes = nbytes_of(shape, torch.float16)
    keys = [key(n, f"{name}-{batch}") for n in range(batch)]
    generator = torch.Generator().manual_seed(3)
    objs = []
    for _ in range(batch):
        obj = store.allocate(shape, torch.float16)
        assert obj is not None, "the budget is too small for one batch"
        obj.raw.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator))
        objs.append(obj)

    async def direct_put() -> None:
        await lower.batched_put(keys, objs)

    async def store_put() -> None:  # until the lower tier has every chunk
        await store.batched_put(keys, objs)
        await store.flush()

    async def direct_get() -> None:
        release(await lower.batched_get(keys))

    async def forget_in_cpu() -> None:
        for k in keys:  # only the lower tier holds them: the cpu tier misses, then takes them
            await cpu.remove(k)

    async def store_get() -> None:
        release(await store.batched_get(keys))

    async def cpu_get() -> None:
        release(await cpu.batched_get(keys))

    async def store_cpu_get() -> None:
        release(await store.batched_get(keys))

    rows = []
    for operation, direct, through, prepare in (
        ("put", direct_put, store_put, None),
        ("get (lower tier)", direct_get, store_get, forget_in_cpu),
    ):
        direct_times, store_times = await timed_pairs(direct, through, repeat, prepare)
        direct_s, store_s = statistics.median(direct_times), statistics.median(store_times)
        passes = [d / s for d, s in zip(direct_times, store_times, strict=True)]
        rows.append(
            {
                "config": name,
                "batch": batch,
                "operation": operation,
                "direct_gb_s": nbytes * batch / direct_s / 1e9,
                "store_gb_s": nbytes * batch / store_s / 1e9,
                "ratio": direct_s / store_s,
                "pass_ratios": (min(passes), statistics.median(passes), max(passes)),
            }
        )
    # Hits in the cpu tier move no bytes (zero-copy): what counts is the time the store adds
    # to each batched call.
    await store.batched_put(keys, objs)
    await store.flush()  # else the hits come from the write-behind, not from the cpu tier
    direct_times, store_times = await timed_pairs(cpu_get, store_cpu_get, 201)
    direct_s, store_s = statistics.median(direct_times), statistics.median(store_times)
    rows.append(
        {
            "config": name,
            "batch": batch,
            "operation": "get (cpu hits)",
            "direct_us": direct_s * 1e6,
            "store_us": store_s * 1e6,
        }
    )
    release(objs)
    for k in keys:
        await store.remove(k)
    return rows


async def compare(
    name: str, tiers: list[Any], batches: list[int], repeat: int, shape: tuple[int, ...]
) -> list[dict[str, Any]]:
    """Part 1 for one config: every batch size, through the store and on the backends."""
    nbytes = nbytes_of(shape, torch.float16)
    largest = max(batches)
    # Room for the chunks being put, one batch of results and the cpu tier's copies; the
    # write-behind may hold a whole batch, so nothing is dropped and both sides do the same work.
    config = Config.from_dict(
        {
            "tiers": tiers,
            "buffer_size": nbytes * largest * 4 + 64 * MiB,
            "write_behind_size": nbytes * largest + MiB,
        }
    )
    store = await open_store(config, timeout=120)
    try:
        rows = []
        for batch in batches:
            rows += await compare_batch(store, name, batch, repeat, shape)
        for tier_stats in store.stats()["tiers"].values():
            assert tier_stats["dropped_puts"] == 0, f"puts were dropped: {tier_stats}"
    finally:
        await store.close()
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'config':<10} {'batch':>5}  {'operation':<16} {'direct':>12} {'store':>12}  ratio")
    for row in rows:
        head = f"{row['config']:<10} {row['batch']:>5}  {row['operation']:<16}"
        if "ratio" in row:
            flag = "" if row["ratio"] >= TARGET_RATIO else "  below target"
            low, middle, high = row["pass_ratios"]
            print(
                f"{head} {row['direct_gb_s']:>7.2f} GB/s {row['store_gb_s']:>7.2f} GB/s  "
                f"{row['ratio']:.2f}x (per pass {low:.2f}-{high:.2f}, median {middle:.2f}){flag}"
            )
        else:
            added = row["store_us"] - row["direct_us"]
            print(
                f"{head} {row['direct_us']:>9.1f} us {row['store_us']:>9.1f} us  "
                f"(+{added:.1f} us per call)"
            )
    sys.stdout.flush()


def print_memory(memory: dict[str, Any], cpu_size: str, disk_size: str, wait: float) -> None:
    ratio = memory["peak_above_baseline_bytes"] / memory["budget_bytes"]
    dropped = {k: int(v) for k, v in memory["disk_dropped"].items() if v}
    misses = {k: int(v) for k, v in memory["misses"].items()}
    mode = f"puts wait up to {wait:g} s for room" if wait else "puts never wait"
    print(
        f"memory ({mode}): wrote {memory['written_gb']:.1f} GB through [cpu {cpu_size}, file "
        f"{disk_size}] in {memory['write_seconds']:.1f} s; peak RSS above baseline "
        f"{memory['peak_above_baseline_bytes'] / GiB:.2f} GiB = {ratio:.2f}x of the "
        f"{memory['budget_bytes'] / GiB:.2f} GiB budget (target <= {TARGET_MEMORY}x)"
    )
    print(
        f"memory ({mode}): allocate() found no room {memory['allocate_none']} times; puts refused "
        f"{memory['refused_puts']}; chunks written to disk {memory['disk_written_chunks']:.0f}, "
        f"dropped for disk {dropped}; read back {memory['read_back_hits']} of "
        f"{memory['read_back']}; misses {misses}; budget shortages {memory['shortages']}"
    )


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """This process's peak RSS since it started (VmHWM; getrusage's ru_maxrss would carry the
    parent's peak across fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


async def write_through(
    directory: Path, write_bytes: int, cpu_bytes: int, disk_bytes: int, wait: float
) -> dict[str, Any]:
    """In this process: write ``write_bytes`` through [cpu, file] (puts waiting up to ``wait``
    seconds for write-behind room), then read back the last chunks; the peak RSS above the
    baseline and what the store counted."""
    pattern = torch.randint(
        0, 256, (CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    baseline = rss_bytes()
    config = Config.from_dict(
        {"tiers": [f"cpu://?max_size={cpu_bytes}", f"file://{directory}?max_size={disk_bytes}"]}
    )
    store = await open_store(config, write_behind_wait=wait)
    chunks = write_bytes // CHUNK
    no_memory = refused = 0
    start = time.perf_counter()
    try:
        for n in range(chunks):
            obj = store.allocate(SHAPE, torch.float16)
            if obj is None:
                no_memory += 1
                continue
            torch.bitwise_xor(pattern, n % 251, out=obj.raw)
            accepted = await store.offer([key(n, "memory")], [obj])
            refused += accepted.count(False)
            obj.release()
        await store.flush()
        write_seconds = time.perf_counter() - start
        # Read back what the disk tier can still hold, through the store (the cpu tier misses
        # most of them): every lower-tier read lands in the same budget.
        first = max(0, chunks - disk_bytes // CHUNK // 2)
        tail = [key(n, "memory") for n in range(first, chunks)]
        got = hits = 0
        for start_index in range(0, len(tail), 8):
            batch = tail[start_index : start_index + 8]
            objs = await store.batched_get(batch)
            for obj in objs:
                got += 1
                if obj is not None:
                    hits += 1
                    obj.release()
        stats = store.stats()
    finally:
        await store.close()
    peak = peak_rss_bytes()
    disk_stats = stats["tiers"][store.tier_names[1]]
    return {
        "written_gb": chunks * CHUNK / 1e9,
        "write_seconds": write_seconds,
        "budget_bytes": stats["memory"]["budget_bytes"],
        "peak_above_baseline_bytes": peak - baseline,
        "allocate_none": no_memory,
        "refused_puts": refused,
        "disk_dropped": disk_stats["dropped_by_reason"],
        "disk_written_chunks": disk_stats["bytes_written"] // CHUNK,
        "read_back": got,
        "read_back_hits": hits,
        "misses": stats["misses"],
        "shortages": stats["memory"]["shortages"],
    }


def memory_high_water(
    write_bytes: int, cpu_bytes: int, disk_bytes: int, wait: float
) -> dict[str, Any]:
    """Part 2 in a fresh process, so that its peak RSS is this workload's alone."""
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-store-") as directory:
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--memory-child",
                json.dumps([directory, write_bytes, cpu_bytes, disk_bytes, wait]),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode:
        raise SystemExit(f"the memory run failed:\n{done.stdout}{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--batches", default="8,64", help="batch sizes, comma separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per chunk (256: 32 MiB)")
    parser.add_argument("--dir", default=None, help="directory for the file tier")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--write-gb", type=float, default=20.0)
    parser.add_argument("--cpu-size", default="1GiB", help="the cpu tier (the budget) of part 2")
    parser.add_argument("--disk-size", default="4GiB", help="the file tier of part 2")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        directory, write_bytes, cpu_bytes, disk_bytes, wait = json.loads(args.memory_child)
        result = asyncio.run(
            write_through(Path(directory), write_bytes, cpu_bytes, disk_bytes, wait)
        )
        print(json.dumps(result))
        return

    shape = (2, 32, args.tokens, 1024)
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"chunks {shape} float16 ({nbytes_of(shape, torch.float16) / MiB:.0f} MiB), batches "
        f"{batches}, median of {args.repeat} interleaved; ratio = direct time / store time "
        f"of the medians (target >= {TARGET_RATIO}); each pass pairs the two calls back to back"
    )
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-store-", dir=args.dir) as directory:
        tiers = ["cpu://", {"url": f"file://{directory}/disk", "timeout": 300}]
        print_rows(asyncio.run(compare("cpu+file", tiers, batches, args.repeat, shape)))
    if not args.no_redis:
        from kvplug_testing import RedisServer

        with RedisServer() as server:
            tiers = ["cpu://", {"url": server.url, "timeout": 300}]
            print_rows(asyncio.run(compare("cpu+redis", tiers, batches, args.repeat, shape)))
    for wait in (0.0, 60.0):
        memory = memory_high_water(
            int(args.write_gb * 1e9),
            parse_size(args.cpu_size, what="--cpu-size"),
            parse_size(args.disk_size, what="--disk-size"),
            wait,
        )
        print_memory(memory, args.cpu_size, args.disk_size, wait)


if __name__ == "__main__":
    main()
