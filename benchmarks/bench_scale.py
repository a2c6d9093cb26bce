"""Per-operation latency against the number of keys already stored, per backend.

For each backend (``--backends cpu,disk,redis``) and each level of stored keys (``--levels
1,1000,100000,1000000``), the script fills the backend up to that level with ``batched_put``
in large batches (not timed), then times ``--ops`` single operations of each kind, one at a
time, through kvplug's async API (``kvplug.open_backend``):

* **put**: a key not stored yet (the keys put here are removed again, untimed, so every level
  holds exactly its number of keys while the other operations run);
* **get hit**: a stored key drawn at random over the whole level (the returned object is
  released inside the timed region, as an engine would);
* **get miss**: a key never stored;
* **contains**: a stored key drawn at random.

Every object is small: a 256-byte ``uint8`` payload (``BINARY`` format). The backends:

* ``cpu://`` (in-process) with an allocator of 256-byte alignment given to it, so that a
  million payloads take 256 MiB; objects are allocated in that allocator and stored without a
  copy, as the Store does;
* ``file://<dir>`` (kvplug-disk, O_DIRECT, the default options) in a new directory under
  ``--dir``: each key is one file of a 4 KiB header block and a 4 KiB payload block. Before
  each level the free space of ``--dir`` is checked (``shutil.disk_usage``) and the level is
  skipped, with the reason, when filling it would leave less than ``--min-free`` free;
* ``redis://127.0.0.1:<port>``: a redis-server this script starts (kvplug_testing's
  ``RedisServer``, loopback only) and kills at the end.

Memory per stored key, measured between consecutive levels and divided by the keys added:

* cpu and disk: the growth of this process's resident set (``/proc/self/statm``) after a
  ``gc.collect()``; for cpu the payload bytes of the added keys (their 256-byte allocator
  blocks, which the fill writes) are subtracted, so the figure is the index and the objects'
  bookkeeping. With ``--tracemalloc`` the Python allocations made during each fill that are
  still alive after it (``tracemalloc``, which slows the fill) are reported as well;
* redis: the growth of the server's ``INFO memory`` ``used_memory``.

A level that adds fewer than 5,000 keys prints no memory figure (the allocators grow in
arenas and pages, which makes small deltas noise).

    .venv/bin/python benchmarks/bench_scale.py [--backends cpu,disk,redis]
        [--levels 1,1000,100000,1000000] [--ops 2000] [--json out.json] [--plot out.svg]
        [--dir /tmp] [--min-free 4GiB] [--tracemalloc]

``--plot`` writes the curves (median latency against keys stored) only when matplotlib can be
imported; otherwise it says so and the tables are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import kvplug
from kvplug import Backend, CacheKey, FreeListAllocator, MemoryObj
from kvplug.memory import MemoryFormat
from kvplug.units import format_size, parse_size
from kvplug_testing import RedisServer

PAYLOAD = 256
"""Bytes of each stored object's payload."""
DISK_BYTES_PER_KEY = 8192
"""One object file on disk: a 4 KiB header block and the payload padded to one 4 KiB block."""
OPERATIONS = ("put", "get hit", "get miss", "contains")
BACKENDS = ("cpu", "disk", "redis")
MISS_BASE = 10**12
"""Key numbers from here on are never stored: the misses."""
PUT_BASE = 2 * 10**12
"""Key numbers from here on are the timed puts' fresh keys (removed after timing)."""
WARMUP = 50
MEMORY_MIN_KEYS = 5_000
FILL_BATCH = {"cpu": 10_000, "disk": 1_000, "redis": 5_000}


def key(n: int) -> CacheKey:
    """Key number ``n``: built on demand, so the benchmark keeps no key alive itself."""
    return CacheKey("bench-scale", 1, 0, n)


def rss_bytes() -> int:
    """This process's resident set size."""
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Latency:
    """One cell of a table: per-operation latencies of one kind at one level."""

    samples_ns: list[int]

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_ns) / 1e3

    @property
    def p99_us(self) -> float:
        ordered = sorted(self.samples_ns)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] / 1e3


@dataclass
class Level:
    """What was measured with ``keys`` keys stored."""

    keys: int
    latency: dict[str, Latency] = field(default_factory=dict)
    memory_per_key: float | None = None
    """Bytes per added key (see the module docstring for what each backend counts)."""
    traced_per_key: float | None = None
    fill_seconds: float = 0.0
    skipped: str | None = None


class Subject:
    """One backend under test: how to open it, make payloads, and measure its memory."""

    name: str
    description: str
    memory_note: str

    backend: Backend

    async def open(self) -> None:
        raise NotImplementedError

    def objects(self, count: int) -> list[MemoryObj]:
        """``count`` payload objects to put (the caller releases them)."""
        raise NotImplementedError

    def memory(self) -> int:
        """The memory figure whose growth per key is reported."""
        return rss_bytes()

    def payload_bytes(self, keys: int) -> int:
        """Bytes of ``keys`` payloads included in :meth:`memory` that are not index memory."""
        return 0

    def skip_reason(self, stored: int, level: int, ops: int) -> str | None:
        """Why the level cannot be filled, or None."""
        return None

    async def close(self) -> None:
        await self.backend.close()


def _fill(obj: MemoryObj, value: int) -> MemoryObj:
    obj.raw.fill_(value & 0xFF)
    return obj


class CpuSubject(Subject):
    name = "cpu"
    memory_note = "process RSS growth minus the added payloads' 256-byte allocator blocks"

    def __init__(self, max_keys: int) -> None:
        capacity = (max_keys + 16_384) * PAYLOAD
        self.allocator = FreeListAllocator(capacity, alignment=PAYLOAD, pin=False)
        self.description = (
            f"cpu:// (in-process; its allocator: {format_size(capacity)}, 256-byte blocks, "
            "zero-copy puts)"
        )
        self._made = 0

    async def open(self) -> None:
        self.backend = await kvplug.open_backend(
            f"cpu://?max_size={self.allocator.capacity}", allocator=self.allocator
        )

    def objects(self, count: int) -> list[MemoryObj]:
        made: list[MemoryObj] = []
        for _ in range(count):
            obj = self.allocator.allocate((PAYLOAD,), torch.uint8, MemoryFormat.BINARY)
            assert obj is not None, "the cpu allocator is too small for this level"
            made.append(_fill(obj, self._made))
            self._made += 1
        return made

    def payload_bytes(self, keys: int) -> int:
        return keys * PAYLOAD


class DiskSubject(Subject):
    name = "disk"
    memory_note = "process RSS growth (the index and its bookkeeping; payloads are in files)"

    def __init__(self, parent: Path, min_free: int) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="kvplug-bench-scale-", dir=parent))
        self.min_free = min_free
        self.allocator = FreeListAllocator(64 << 20, pin=False)
        self.description = f"file://{self.directory} (kvplug-disk, O_DIRECT, default options)"
        self.source = _fill(self._allocate(), 0x5A)

    def _allocate(self) -> MemoryObj:
        obj = self.allocator.allocate((PAYLOAD,), torch.uint8, MemoryFormat.BINARY)
        assert obj is not None
        return obj

    async def open(self) -> None:
        self.backend = await kvplug.open_backend(
            f"file://{self.directory}?max_size=1TiB", allocator=self.allocator
        )

    def objects(self, count: int) -> list[MemoryObj]:
        # Puts write bytes to files: one source object serves every key.
        return [self.source.retain() for _ in range(count)]

    def skip_reason(self, stored: int, level: int, ops: int) -> str | None:
        need = (level - stored + ops) * DISK_BYTES_PER_KEY
        free = shutil.disk_usage(self.directory).free
        if free - need < self.min_free:
            return (
                f"filling {level} keys needs about {format_size(need)} more, and "
                f"{self.directory.parent} has {format_size(free)} free: that would leave less "
                f"than {format_size(self.min_free)}"
            )
        return None

    async def close(self) -> None:
        try:
            await self.backend.close()
        finally:
            self.source.release()
            shutil.rmtree(self.directory, ignore_errors=True)


class RedisSubject(Subject):
    name = "redis"
    memory_note = (
        "redis-server INFO memory used_memory growth: the key, the value (a 128-byte frame "
        "header and the 256-byte payload) and redis' own overhead"
    )

    def __init__(self) -> None:
        self.server = RedisServer()
        self.allocator = FreeListAllocator(64 << 20, pin=False)
        self.source: MemoryObj | None = None
        self.description = "redis://127.0.0.1 (a redis-server started here)"

    async def open(self) -> None:
        try:
            self.server.start()
        except BaseException:
            self.server.close()
            raise
        with self.server.client() as client:
            version = client.info("server").get("redis_version")
        self.description = f"{self.server.url} (redis-server {version}, started here)"
        obj = self.allocator.allocate((PAYLOAD,), torch.uint8, MemoryFormat.BINARY)
        assert obj is not None
        self.source = _fill(obj, 0xA5)
        try:
            self.backend = await kvplug.open_backend(self.server.url, allocator=self.allocator)
        except BaseException:
            self.server.close()
            raise

    def objects(self, count: int) -> list[MemoryObj]:
        assert self.source is not None
        return [self.source.retain() for _ in range(count)]

    def memory(self) -> int:
        with self.server.client() as client:
            return int(client.info("memory")["used_memory"])

    async def close(self) -> None:
        try:
            await self.backend.close()
        finally:
            if self.source is not None:
                self.source.release()
            self.server.close()


def chunks(start: int, stop: int, size: int) -> Iterator[range]:
    for first in range(start, stop, size):
        yield range(first, min(first + size, stop))


async def fill(subject: Subject, start: int, stop: int, trace: bool) -> tuple[float, int | None]:
    """Store keys ``start .. stop-1``; the seconds it took and, when ``trace``, the bytes of
    Python allocations made during it that are still alive."""
    if trace:
        tracemalloc.start()
    begin = time.perf_counter()
    for numbers in chunks(start, stop, FILL_BATCH[subject.name]):
        objs = subject.objects(len(numbers))
        try:
            await subject.backend.batched_put([key(n) for n in numbers], objs)
        finally:
            for obj in objs:
                obj.release()
    seconds = time.perf_counter() - begin
    traced = None
    if trace:
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    return seconds, traced


async def time_each(
    numbers: list[int], operation: Callable[[CacheKey], Awaitable[None]]
) -> list[int]:
    """Nanoseconds of ``operation`` on each key number, one at a time."""
    samples: list[int] = []
    clock = time.perf_counter_ns
    for n in numbers:
        k = key(n)
        begin = clock()
        await operation(k)
        samples.append(clock() - begin)
    return samples


async def measure_level(
    subject: Subject, stored: int, ops: int, rng: random.Random
) -> dict[str, Latency]:
    """Time ``ops`` operations of each kind with ``stored`` keys stored (puts are undone)."""
    backend = subject.backend

    async def get_hit(k: CacheKey) -> None:
        obj = await backend.get(k)
        assert obj is not None, f"{k} should be stored"
        obj.release()

    async def get_miss(k: CacheKey) -> None:
        assert await backend.get(k) is None

    async def contains(k: CacheKey) -> None:
        assert await backend.contains(k)

    hits = [rng.randrange(stored) for _ in range(ops + WARMUP)]
    misses = [MISS_BASE + n for n in range(ops + WARMUP)]
    result: dict[str, Latency] = {}
    for name, operation, numbers in (
        ("contains", contains, hits),
        ("get hit", get_hit, hits),
        ("get miss", get_miss, misses),
    ):
        await time_each(numbers[:WARMUP], operation)
        result[name] = Latency(await time_each(numbers[WARMUP:], operation))

    fresh = [PUT_BASE + n for n in range(ops + WARMUP)]
    objs = subject.objects(len(fresh))
    by_number = dict(zip(fresh, objs, strict=True))

    async def put(k: CacheKey) -> None:
        await backend.put(k, by_number[int(k.chunk_hash)])

    try:
        await time_each(fresh[:WARMUP], put)
        result["put"] = Latency(await time_each(fresh[WARMUP:], put))
    finally:
        for obj in objs:
            obj.release()
        for n in fresh:
            await backend.remove(key(n))
    return result


async def run_backend(subject: Subject, args: argparse.Namespace) -> list[Level]:
    print(f"\n{subject.name}: {subject.description}", flush=True)
    await subject.open()
    levels: list[Level] = []
    stored = 0
    rng = random.Random(19)
    try:
        gc.collect()
        before = subject.memory()
        for count in args.levels:
            reason = subject.skip_reason(stored, count, args.ops)
            if reason is not None:
                print(f"  {count} keys: skipped, {reason}", flush=True)
                levels.append(Level(count, skipped=reason))
                break  # larger levels need even more
            level = Level(count)
            level.fill_seconds, traced = await fill(subject, stored, count, args.tracemalloc)
            added = count - stored
            gc.collect()
            after = subject.memory()
            if added >= MEMORY_MIN_KEYS:
                level.memory_per_key = (after - before - subject.payload_bytes(added)) / added
                if traced is not None:
                    level.traced_per_key = traced / added
            before, stored = after, count
            level.latency = await measure_level(subject, stored, args.ops, rng)
            gc.collect()
            before = subject.memory()  # timed puts were removed; their leftovers not counted
            levels.append(level)
            print(
                f"  {count} keys: filled in {level.fill_seconds:.1f} s; "
                + ", ".join(f"{op} {level.latency[op].median_us:.1f} us" for op in OPERATIONS),
                flush=True,
            )
    finally:
        await subject.close()
    return levels


def table(subject: Subject, levels: list[Level], ops: int) -> str:
    lines = [
        f"### {subject.name}: {subject.description}",
        "",
        f"{PAYLOAD}-byte payloads; median / p99 of {ops} single operations, in µs; memory per "
        f"key: {subject.memory_note}.",
        "",
        "| keys stored | put | get hit | get miss | contains | memory per key | fill |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level in levels:
        if level.skipped is not None:
            lines.append(f"| {level.keys:,} | skipped: {level.skipped} | | | | | |")
            continue
        cells = [
            f"{level.latency[op].median_us:.1f} / {level.latency[op].p99_us:.1f}"
            for op in OPERATIONS
        ]
        if level.memory_per_key is None:
            memory = "—"
        else:
            memory = f"{level.memory_per_key:,.0f} B"
            if level.traced_per_key is not None:
                memory += f" ({level.traced_per_key:,.0f} B traced)"
        fill_cell = f"{level.fill_seconds:.1f} s"
        lines.append(f"| {level.keys:,} | {' | '.join(cells)} | {memory} | {fill_cell} |")
    return "\n".join(lines)


def as_json(subject: Subject, levels: list[Level]) -> dict[str, Any]:
    return {
        "description": subject.description,
        "memory": subject.memory_note,
        "levels": [
            {
                "keys": level.keys,
                "skipped": level.skipped,
                "fill_seconds": level.fill_seconds,
                "memory_per_key_bytes": level.memory_per_key,
                "traced_per_key_bytes": level.traced_per_key,
                "latency_us": {
                    op: {"median": cell.median_us, "p99": cell.p99_us}
                    for op, cell in level.latency.items()
                },
            }
            for level in levels
        ],
    }


def plot(results: dict[str, tuple[Subject, list[Level]]], path: Path) -> None:
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        print(f"\nno plot written to {path}: matplotlib is not installed (the tables above)")
        return
    figure, axes = plt.subplots(1, len(OPERATIONS), figsize=(4 * len(OPERATIONS), 3.5))
    for axis, op in zip(axes, OPERATIONS, strict=True):
        for name, (_, levels) in results.items():
            measured = [level for level in levels if level.skipped is None]
            axis.plot(
                [level.keys for level in measured],
                [level.latency[op].median_us for level in measured],
                marker="o",
                label=name,
            )
        axis.set(xscale="log", yscale="log", title=op, xlabel="keys stored")
        axis.set_ylabel("median µs")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    print(f"\nplot written to {path}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="cpu,disk,redis", help="cpu,disk,redis")
    parser.add_argument("--levels", default="1,1000,100000,1000000", help="keys stored")
    parser.add_argument("--ops", type=int, default=2000, help="timed operations per cell")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--plot", type=Path, help="an .svg of the curves (needs matplotlib)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--min-free", default="4GiB", help="free space a disk level leaves")
    parser.add_argument("--tracemalloc", action="store_true", help="trace each fill's allocs")
    args = parser.parse_args()
    args.backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    args.levels = sorted({int(level) for level in args.levels.split(",")})
    if not args.levels or args.levels[0] < 1:
        parser.error("--levels must be positive key counts, e.g. 1,1000,100000")
    if args.ops < 1:
        parser.error("--ops must be at least 1")
    args.min_free = parse_size(args.min_free)
    return args


def make_subject(name: str, args: argparse.Namespace) -> Subject:
    if name == "cpu":
        return CpuSubject(args.levels[-1] + args.ops + WARMUP)
    if name == "disk":
        return DiskSubject(args.dir, args.min_free)
    return RedisSubject()


async def main() -> None:
    args = parse_args()
    print(
        f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}; levels {args.levels}, {args.ops} ops per cell"
    )
    results: dict[str, tuple[Subject, list[Level]]] = {}
    for name in args.backends:
        subject = make_subject(name, args)
        results[name] = (subject, await run_backend(subject, args))
    for subject, levels in results.values():
        print("\n" + table(subject, levels, args.ops))
    if args.json is not None:
        document = {
            "machine": {"node": platform.node(), "cores": os.cpu_count()},
            "ops": args.ops,
            "payload_bytes": PAYLOAD,
            "backends": {name: as_json(s, levels) for name, (s, levels) in results.items()},
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"\nresults written to {args.json}")
    if args.plot is not None:
        plot(results, args.plot)


if __name__ == "__main__":
    asyncio.run(main())
