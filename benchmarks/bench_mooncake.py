"""mooncakestore:// in one run: kvplug's Mooncake backend against Mooncake's own Python client
on its zero-copy calls, side by side, against the same master and node.

The script starts a ``mooncake_master`` and a node (a process that lends ``--node-size`` of
memory to the store, as an inference node does; :mod:`kvplug_testing.mooncake`), both on
127.0.0.1 with metadata exchanged by P2PHANDSHAKE. Two clients in this process lend nothing
(``global_segment_size=0``), so every byte moves over TCP loopback into and out of the node:

* **kvplug**: ``kvplug.open_backend(master.url(global_segment_size=0), allocator=A)`` with
  ``A = FreeListAllocator(..., pin=False)``, whose buffer the backend registers once; the
  chunks and the ``get_into`` destinations are objects of ``A`` (the zero-copy path). Its
  calls are awaited on this script's event loop (the backend runs Mooncake's blocking calls on
  its worker threads, one hop per call, and checksums every payload with xxh3 on put and get).
* **raw**: a ``mooncake.store.MooncakeDistributedStore`` set up with the same settings
  (P2PHANDSHAKE, tcp, no segment) and a buffer of its own registered with ``register_buffer``,
  holding the same bytes; its calls are made directly on this thread, no thread hop and no
  event loop, which is the least a caller of Mooncake pays: ``batch_upsert_from`` /
  ``batch_get_into`` of ``--batch`` chunks, and ``upsert_from`` / ``get_into`` one at a time.

Shapes: chunks of 32 and 24 MiB, where the transfer dominates, and of 256 KiB (``--chunks``
x 8 of them per pass), where the round trips to the master show. Paths (each a pass over the
chunks): batched put (``batched_put`` of ``--batch`` chunks against ``batch_upsert_from``),
batched get_into (``batched_get_into`` against ``batch_get_into``), per-op put (``put``
against ``upsert_from``), per-op get_into (``get_into`` against ``get_into``), and, as a
secondary row, kvplug's ``batched_get`` (new objects of ``A``) against the raw
``batch_get_into`` once more. Per call (``--lookups`` calls a round, the median in
microseconds): ``batched_exists`` of one batch of stored keys, all present and half of them
absent, against the raw ``batch_is_exist`` of the same names; and on the 256 KiB chunks
``get`` of one chunk and ``batched_get`` of one batch against the raw ``batch_get_into``.

After the timed rounds, one untimed pass of each kvplug path runs with Mooncake's client
wrapped in a proxy that counts its calls, and the script prints the Mooncake calls per kvplug
operation (per batch on the batched paths).

Every pass uses keys of its own on each stack; after a round the keys are removed (kvplug's
``remove``, raw ``batch_remove(force=True)``), so the node holds at most one pass of both
stacks. A round runs each path on both stacks in turn, the order alternating (kvplug first in
even rounds, raw first in odd ones: kvplug, raw, raw, kvplug, ...), after one warm-up round that
is not counted. A cell is the MB/s (1e6 bytes) of the median of ``--repeat`` passes; the ratio
is kvplug's MB/s / raw's (target >= 0.95), with the range of the per-round ratios. Destinations
are zeroed before each read pass and every chunk read back is compared bit-exact with its
source (``torch.equal``) on both sides, outside the timed region.

At the end it prints the time xxh3-64 (kvplug's payload checksum) takes over one chunk,
against the raw per-chunk transfer time: kvplug hashes each payload once per put and once per
read, on the calling worker thread, in series with the transfer. It also times, on the raw
client alone, the Mooncake calls kvplug's backend makes (``batch_is_exist``, the multi-buffer
put and get of a frame header slot + payload) next to those of the raw stack, so that a gap
can be told apart from what Mooncake itself charges for kvplug's call pattern.

Mooncake binds all interfaces, so run it in the private network namespace of
scripts/isolated.sh (it refuses to run elsewhere unless ``--any-network`` is given)::

    scripts/isolated.sh .venv/bin/python benchmarks/bench_mooncake.py [--chunks 16] [--batch 8]
        [--repeat 5] [--node-size 4GiB] [--lookups 200]

To measure another version of the backend against the same script, put its
``kvplug_mooncake`` package first on ``PYTHONPATH`` (the first line printed names the backend
module that ran).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

import kvplug
import kvplug_mooncake.backend
from kvplug import CacheKey, FreeListAllocator, MemoryObj
from kvplug.frame import header_len
from kvplug.memory import nbytes_of
from kvplug_mooncake.backend import installed_version
from kvplug_testing.mooncake import CountingStore, MooncakeMaster, MooncakeNode, isolated_network

TARGET_RATIO = 0.95
SHAPES = {
    "[2,32,256,1024] fp16": ((2, 32, 256, 1024), 1),
    "[2,24,256,1024] fp16": ((2, 24, 256, 1024), 1),
    "[2,32,16,128] fp16": ((2, 32, 16, 128), 8),
}
"""Chunk shapes: 32 and 24 MiB (256 tokens of a 32- and a 24-layer model with 8 heads of 128),
where the transfer dominates, and 256 KiB (16 tokens of a smaller model), where the round
trips to the master show; the second number multiplies ``--chunks`` (a pass over small chunks
moves as many bytes as one over 32 MiB chunks)."""
STACKS = ("kvplug", "raw")
PATHS = ("batched put", "batched get_into", "per-op put", "per-op get_into", "batched get")
MODEL = "bench-mooncake"
SMALL_CHUNK = 1 << 20
"""Chunks up to this size also time get and batched_get per call."""
COUNTING_ROUND = 10_000
"""The round number in the keys of the untimed pass that counts Mooncake calls."""
SLACK = 64 << 20
SLOT = 512
HEADER_AREA = 1 << 20


class RawStack:
    """Mooncake's own client on this thread, with one registered buffer holding the sources
    (``count`` chunks) and the read destinations (``count`` chunks)."""

    def __init__(self, master: MooncakeMaster) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.store = MooncakeDistributedStore()
        code = self.store.setup(
            {
                "local_hostname": master.host,
                "metadata_server": master.metadata_server,
                "global_segment_size": 0,
                "local_buffer_size": 16 << 20,
                "protocol": "tcp",
                "rdma_devices": "",
                "master_server_addr": master.address,
            }
        )
        if code != 0:
            raise RuntimeError(f"the raw Mooncake client could not set up: {code}")
        self.config = ReplicateConfig()
        self.config.replica_num = 1
        self.buffer: torch.Tensor | None = None

    def register(self, nbytes: int) -> torch.Tensor:
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)
        code = self.store.register_buffer(self.buffer.data_ptr(), nbytes)
        if code != 0:
            raise RuntimeError(f"register_buffer of {nbytes} bytes returned {code}")
        return self.buffer

    def unregister(self) -> None:
        if self.buffer is not None:
            self.store.unregister_buffer(self.buffer.data_ptr())
            self.buffer = None

    def close(self) -> None:
        self.unregister()
        self.store.close()


class Chunks:
    """The chunks of one shape on both stacks: sources and destinations in kvplug's allocator
    and in the raw client's registered buffer, the same bytes in both."""

    def __init__(self, shape: tuple[int, ...], count: int, raw: RawStack) -> None:
        self.shape = shape
        self.count = count
        self.nbytes = nbytes_of(shape, torch.float16)
        # sources, get_into destinations, and the objects batched_get returns (one pass)
        self.allocator = FreeListAllocator(3 * count * self.nbytes + SLACK, pin=False)
        generator = torch.Generator().manual_seed(17)
        self.sources: list[MemoryObj] = []
        self.dests: list[MemoryObj] = []
        for _ in range(count):
            obj = self._allocate()
            obj.raw.copy_(
                torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, generator=generator)
            )
            self.sources.append(obj)
        self.dests = [self._allocate() for _ in range(count)]
        buffer = raw.register(2 * count * self.nbytes + HEADER_AREA)
        self.raw_sources = [buffer[n * self.nbytes : (n + 1) * self.nbytes] for n in range(count)]
        self.raw_dests = [
            buffer[(count + n) * self.nbytes : (count + n + 1) * self.nbytes] for n in range(count)
        ]
        for source, raw_source in zip(self.sources, self.raw_sources, strict=True):
            raw_source.copy_(source.raw)
        self.raw_source_ptrs = [t.data_ptr() for t in self.raw_sources]
        self.raw_dest_ptrs = [t.data_ptr() for t in self.raw_dests]
        # header slots for the decomposition (raw multi-buffer calls, as kvplug makes them)
        self.raw_header_ptrs = [
            buffer.data_ptr() + 2 * count * self.nbytes + n * SLOT for n in range(count)
        ]
        buffer[2 * count * self.nbytes :].fill_(7)
        self.tag = "x".join(str(d) for d in shape)

    def _allocate(self) -> MemoryObj:
        obj = self.allocator.allocate(self.shape, torch.float16)
        assert obj is not None, "the benchmark's allocator is too small"
        return obj

    def kvplug_keys(self, path: str, round_: int) -> list[CacheKey]:
        model = f"{MODEL}/{self.tag}/{path.replace(' ', '-')}/{round_}"
        return [CacheKey(model, 1, 0, n + 1, dtype="half") for n in range(self.count)]

    def raw_names(self, path: str, round_: int) -> list[str]:
        return [
            f"raw-{MODEL}/{self.tag}/{path.replace(' ', '-')}/{round_}/{n}"
            for n in range(self.count)
        ]

    def clear_dests(self) -> None:
        for dest in self.dests:
            dest.raw.zero_()
        for raw_dest in self.raw_dests:
            raw_dest.zero_()

    def check(self, stack: str, got: list[torch.Tensor]) -> None:
        for n, data in enumerate(got):
            same = torch.equal(self.sources[n].raw, data.contiguous().view(torch.uint8).view(-1))
            assert same, f"{stack}: chunk {n} of {self.tag} read back differs from its source"

    def close(self) -> None:
        for obj in self.sources + self.dests:
            obj.release()


@dataclass
class ShapeResult:
    times: dict[str, dict[str, list[float]]]
    """path -> stack -> seconds of each counted pass"""
    latencies: dict[str, dict[str, list[float]]]
    """operation -> stack -> seconds per call, the median of each round"""
    calls: dict[str, dict[str, float]]
    """path -> Mooncake call -> calls per kvplug operation (a batch for the batched paths)"""
    parts: dict[str, float]
    """raw call -> seconds per chunk (the decomposition)"""


async def measure_shape(
    shape: tuple[int, ...],
    count: int,
    master: MooncakeMaster,
    raw: RawStack,
    args: argparse.Namespace,
) -> ShapeResult:
    batch = args.batch
    chunks = Chunks(shape, count, raw)
    groups = [list(range(s, min(s + batch, count))) for s in range(0, count, batch)]
    nbytes = chunks.nbytes
    backend = await kvplug.open_backend(
        master.url(global_segment_size=0), allocator=chunks.allocator, timeout=60
    )
    store, config = raw.store, raw.config

    # -- kvplug, on the event loop ------------------------------------------------------------
    async def kvplug_batched_put(keys: list[CacheKey]) -> None:
        for group in groups:
            await backend.batched_put([keys[n] for n in group], [chunks.sources[n] for n in group])

    async def kvplug_batched_get_into(keys: list[CacheKey]) -> None:
        for group in groups:
            hits = await backend.batched_get_into(
                [keys[n] for n in group], [chunks.dests[n] for n in group]
            )
            assert all(hits), f"kvplug batched_get_into missed: {hits}"

    async def kvplug_put(keys: list[CacheKey]) -> None:
        for key, obj in zip(keys, chunks.sources, strict=True):
            await backend.put(key, obj)

    async def kvplug_get_into(keys: list[CacheKey]) -> None:
        for key, dest in zip(keys, chunks.dests, strict=True):
            assert await backend.get_into(key, dest), f"kvplug get_into missed {key}"

    got: list[MemoryObj | None] = []

    async def kvplug_batched_get(keys: list[CacheKey]) -> None:
        for group in groups:
            got.extend(await backend.batched_get([keys[n] for n in group]))

    # -- raw Mooncake, direct calls on this thread ---------------------------------------------
    def raw_batched_put(names: list[str]) -> None:
        for group in groups:
            codes = store.batch_upsert_from(
                [names[n] for n in group],
                [chunks.raw_source_ptrs[n] for n in group],
                [nbytes] * len(group),
                config,
            )
            assert all(code == 0 for code in codes), f"raw batch_upsert_from: {codes}"

    def raw_batched_get_into(names: list[str]) -> None:
        for group in groups:
            codes = store.batch_get_into(
                [names[n] for n in group],
                [chunks.raw_dest_ptrs[n] for n in group],
                [nbytes] * len(group),
            )
            assert all(code == nbytes for code in codes), f"raw batch_get_into: {codes}"

    def raw_put(names: list[str]) -> None:
        for name, ptr in zip(names, chunks.raw_source_ptrs, strict=True):
            code = store.upsert_from(name, ptr, nbytes, config)
            assert code == 0, f"raw upsert_from: {code}"

    def raw_get_into(names: list[str]) -> None:
        for name, ptr in zip(names, chunks.raw_dest_ptrs, strict=True):
            code = store.get_into(name, ptr, nbytes)
            assert code == nbytes, f"raw get_into: {code}"

    async def timed_kvplug(work: Callable[[list[CacheKey]], Awaitable[None]], keys: Any) -> float:
        start = time.perf_counter()
        await work(keys)
        return time.perf_counter() - start

    def timed_raw(work: Callable[[list[str]], None], names: Any) -> float:
        start = time.perf_counter()
        work(names)
        return time.perf_counter() - start

    def check_kvplug_dests() -> None:
        chunks.check("kvplug", [dest.raw for dest in chunks.dests])

    def check_raw_dests() -> None:
        chunks.check("raw", chunks.raw_dests)

    def check_kvplug_got() -> None:
        assert len(got) == count and all(obj is not None for obj in got), "batched_get missed"
        chunks.check("kvplug batched_get", [obj.raw for obj in got if obj is not None])
        for obj in got:
            if obj is not None:
                obj.release()
        got.clear()

    absent_keys = [CacheKey(MODEL + "/absent", 1, 0, n + 1, dtype="half") for n in range(batch)]
    absent_names = [f"raw-{MODEL}/absent/{n}" for n in range(batch)]

    async def kvplug_median(call: Callable[[], Awaitable[None]]) -> float:
        samples = []
        for _ in range(args.lookups):
            start = time.perf_counter()
            await call()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def raw_median(call: Callable[[], None]) -> float:
        samples = []
        for _ in range(args.lookups):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    latencies: dict[str, dict[str, list[float]]] = {}

    async def measure_latencies(round_: int) -> None:
        """Median microseconds per call of the operations whose Mooncake calls the backend
        chooses: batched_exists of one batch of the round's batched keys (all present, and
        half of them absent) against the raw batch_is_exist of the same names; and for chunks
        of 1 MiB or less, get of one chunk and batched_get of one batch against the raw
        batch_get_into (which is told the size)."""
        keys = chunks.kvplug_keys("batched", round_)[:batch]
        names = chunks.raw_names("batched", round_)[:batch]
        size, half = len(keys), len(keys) // 2
        mixed_keys = keys[:half] + absent_keys[half:size]
        mixed_names = names[:half] + absent_names[half:size]

        async def exists(query: list[CacheKey], expected: list[bool]) -> None:
            found = await backend.batched_exists(query)
            assert found == expected, f"kvplug batched_exists: {found}"

        def raw_exists(query: list[str], expected: list[bool]) -> None:
            found = store.batch_is_exist(query)
            assert found == [int(e) for e in expected], f"raw batch_is_exist: {found}"

        async def get(query: list[CacheKey]) -> None:
            found = await backend.batched_get(query)
            assert all(obj is not None for obj in found), "kvplug batched_get missed"
            for obj in found:
                if obj is not None:
                    obj.release()

        def raw_get(query: list[str]) -> None:
            found = store.batch_get_into(
                query, chunks.raw_dest_ptrs[: len(query)], [nbytes] * len(query)
            )
            assert all(code == nbytes for code in found), f"raw batch_get_into: {found}"

        present, mixed = [True] * size, [True] * half + [False] * (size - half)
        cases: dict[str, tuple[Callable[[], Awaitable[None]], Callable[[], None]]] = {
            "batched_exists, all present": (
                lambda: exists(keys, present),
                lambda: raw_exists(names, present),
            ),
            "batched_exists, half absent": (
                lambda: exists(mixed_keys, mixed),
                lambda: raw_exists(mixed_names, mixed),
            ),
        }
        if nbytes <= SMALL_CHUNK:
            cases["get, one chunk"] = (lambda: get(keys[:1]), lambda: raw_get(names[:1]))
            cases["batched_get, one batch"] = (lambda: get(keys), lambda: raw_get(names))
        for label, (ours, theirs) in cases.items():
            kvplug_seconds = await kvplug_median(ours)
            raw_seconds = raw_median(theirs)
            if round_ >= 0:
                stacks = latencies.setdefault(label, {s: [] for s in STACKS})
                stacks["kvplug"].append(kvplug_seconds)
                stacks["raw"].append(raw_seconds)

    # path -> stack -> (timed work, check after it, key kind)
    plan: dict[str, dict[str, tuple[Any, Callable[[], None] | None, str]]] = {
        "batched put": {
            "kvplug": (kvplug_batched_put, None, "batched"),
            "raw": (raw_batched_put, None, "batched"),
        },
        "batched get_into": {
            "kvplug": (kvplug_batched_get_into, check_kvplug_dests, "batched"),
            "raw": (raw_batched_get_into, check_raw_dests, "batched"),
        },
        "batched get": {
            "kvplug": (kvplug_batched_get, check_kvplug_got, "batched"),
            "raw": (raw_batched_get_into, check_raw_dests, "batched"),
        },
        "per-op put": {
            "kvplug": (kvplug_put, None, "per-op"),
            "raw": (raw_put, None, "per-op"),
        },
        "per-op get_into": {
            "kvplug": (kvplug_get_into, check_kvplug_dests, "per-op"),
            "raw": (raw_get_into, check_raw_dests, "per-op"),
        },
    }
    times: dict[str, dict[str, list[float]]] = {p: {s: [] for s in STACKS} for p in PATHS}

    async def remove(round_: int, kind: str) -> None:
        for key in chunks.kvplug_keys(kind, round_):
            assert await backend.remove(key), f"kvplug remove of {key} found nothing"
        codes = store.batch_remove(chunks.raw_names(kind, round_), True)
        assert all(code == 0 for code in codes), f"raw batch_remove: {codes}"

    try:
        for round_ in range(-1, args.repeat):  # round -1: warm-up, not counted
            order = STACKS if round_ % 2 == 0 else STACKS[::-1]
            for path in ("batched put", "batched get_into", "batched get", "per-op put"):
                if path == "per-op put":
                    await measure_latencies(round_)
                    await remove(round_, "batched")
                for stack in order:
                    work, check, kind = plan[path][stack]
                    if check is not None:
                        chunks.clear_dests()
                    if stack == "kvplug":
                        seconds = await timed_kvplug(work, chunks.kvplug_keys(kind, round_))
                    else:
                        seconds = timed_raw(work, chunks.raw_names(kind, round_))
                    if check is not None:
                        check()
                    if round_ >= 0:
                        times[path][stack].append(seconds)
            for stack in order:
                work, check, kind = plan["per-op get_into"][stack]
                chunks.clear_dests()
                if stack == "kvplug":
                    seconds = await timed_kvplug(work, chunks.kvplug_keys(kind, round_))
                else:
                    seconds = timed_raw(work, chunks.raw_names(kind, round_))
                assert check is not None
                check()
                if round_ >= 0:
                    times["per-op get_into"][stack].append(seconds)
            await remove(round_, "per-op")
        calls = await count_calls(backend, plan, chunks, groups)
        parts = decompose(store, config, chunks, batch, args.repeat)
    finally:
        for obj in got:
            if obj is not None:
                obj.release()
        await backend.close()
        chunks.close()
        raw.unregister()
    return ShapeResult(times, latencies, calls, parts)


async def count_calls(
    backend: Any, plan: dict[str, dict[str, Any]], chunks: Chunks, groups: list[list[int]]
) -> dict[str, dict[str, float]]:
    """One untimed pass of each kvplug path with Mooncake's client wrapped in a
    :class:`CountingStore`: the calls per operation (per batch on the batched paths)."""
    counter = CountingStore(backend._store)
    backend._store = counter
    per_path: dict[str, dict[str, float]] = {}
    try:
        for path in ("batched put", "batched get_into", "batched get", "per-op put"):
            work, check, kind = plan[path]["kvplug"]
            counter.calls.clear()
            await work(chunks.kvplug_keys(kind, COUNTING_ROUND))
            if check is not None:
                check()
            operations = len(groups) if kind == "batched" else chunks.count
            per_path[path] = {name: n / operations for name, n in counter.calls.items()}
        work, check, kind = plan["per-op get_into"]["kvplug"]
        counter.calls.clear()
        await work(chunks.kvplug_keys(kind, COUNTING_ROUND))
        per_path["per-op get_into"] = {n: c / chunks.count for n, c in counter.calls.items()}
        keys = chunks.kvplug_keys("batched", COUNTING_ROUND)
        for label, query in (
            ("batched_exists, all present", keys[: len(groups[0])]),
            ("batched_exists, half absent", [*keys[:1], CacheKey(MODEL + "/none", 1, 0, 1)]),
        ):
            counter.calls.clear()
            await backend.batched_exists(query)
            per_path[label] = dict(counter.calls)
        for kind in ("batched", "per-op"):
            for key in chunks.kvplug_keys(kind, COUNTING_ROUND):
                await backend.remove(key)
    finally:
        backend._store = counter.store
    return per_path


def decompose(store: Any, config: Any, chunks: Chunks, batch: int, repeat: int) -> dict[str, float]:
    """Seconds per chunk (median of ``repeat`` batches of ``batch`` chunks) of the raw calls
    kvplug's backend makes, against the raw calls the benchmark's raw stack makes: where a gap
    between the two comes from, outside kvplug's own Python."""
    nbytes, hl = chunks.nbytes, header_len(len(chunks.shape))
    n = list(range(min(batch, chunks.count)))
    src = [chunks.raw_source_ptrs[i] for i in n]
    dst = [chunks.raw_dest_ptrs[i] for i in n]
    hdr = [chunks.raw_header_ptrs[i] for i in n]
    samples: dict[str, list[float]] = {}

    def timed(label: str, expect: int, call: Callable[..., list[int]], *args: Any) -> None:
        start = time.perf_counter()
        codes = call(*args)
        samples.setdefault(label, []).append((time.perf_counter() - start) / len(n))
        assert all(code == expect for code in codes), f"{label}: {codes}"

    sizes = [nbytes] * len(n)
    put_parts = [[h, s] for h, s in zip(hdr, src, strict=True)]
    get_parts = [[h, d] for h, d in zip(hdr, dst, strict=True)]
    part_sizes = [[hl, nbytes]] * len(n)
    for r in range(repeat + 1):  # the first round warms up
        single = [f"decompose/{chunks.tag}/single/{r}/{i}" for i in n]
        multi = [f"decompose/{chunks.tag}/multi/{r}/{i}" for i in n]
        timed("batch_upsert_from", 0, store.batch_upsert_from, single, src, sizes, config)
        timed("batch_is_exist", 0, store.batch_is_exist, multi)
        timed(
            "batch_put_from_multi_buffers",
            0,
            store.batch_put_from_multi_buffers,
            multi,
            put_parts,
            part_sizes,
            config,
        )
        start = time.perf_counter()
        described = store.batch_get_replica_desc(single)
        samples.setdefault("batch_get_replica_desc", []).append(
            (time.perf_counter() - start) / len(n)
        )
        assert len(described) == len(n), f"batch_get_replica_desc: {described}"
        timed("batch_get_into", nbytes, store.batch_get_into, single, dst, sizes)
        timed(
            "batch_get_into_multi_buffers",
            hl + nbytes,
            store.batch_get_into_multi_buffers,
            multi,
            get_parts,
            part_sizes,
        )
        # one chunk a call, as the per-op rows make them
        one = [f"decompose/{chunks.tag}/one/{r}/{i}" for i in n]
        framed = [f"decompose/{chunks.tag}/one-framed/{r}/{i}" for i in n]
        start = time.perf_counter()
        for i, name in enumerate(one):
            assert store.upsert_from(name, src[i], nbytes, config) == 0
        samples.setdefault("per-op upsert_from", []).append((time.perf_counter() - start) / len(n))
        start = time.perf_counter()
        for i, name in enumerate(framed):
            assert store.batch_is_exist([name]) == [0]
            codes = store.batch_put_from_multi_buffers(
                [name], [put_parts[i]], [part_sizes[i]], config
            )
            assert codes == [0], f"per-op batch_put_from_multi_buffers: {codes}"
        samples.setdefault("per-op is_exist + multi put", []).append(
            (time.perf_counter() - start) / len(n)
        )
        store.batch_remove(single + multi + one + framed, True)
        if r == 0:
            samples.clear()
    return {label: statistics.median(values) for label, values in samples.items()}


def report(name: str, nbytes: int, times: dict[str, dict[str, list[float]]]) -> None:
    print(
        f"\n{name}: MB/s (1e6 bytes) of the median pass; ratio = kvplug MB/s / raw MB/s "
        f"(target >= {TARGET_RATIO}), per-round ratios low-high"
    )
    print(f"  {'path':18} {'kvplug MB/s':>12} {'raw MB/s':>10} {'ratio':>7}   per round")
    for path in PATHS:
        ours, theirs = times[path]["kvplug"], times[path]["raw"]
        kvplug_rate = nbytes / statistics.median(ours) / 1e6
        raw_rate = nbytes / statistics.median(theirs) / 1e6
        ratio = kvplug_rate / raw_rate
        pairs = [t / o for o, t in zip(ours, theirs, strict=True)]
        flag = "" if ratio >= TARGET_RATIO else "  below target"
        print(
            f"  {path:18} {kvplug_rate:>12.0f} {raw_rate:>10.0f} {ratio:>6.2f}x   "
            f"{min(pairs):.2f}-{max(pairs):.2f}{flag}"
        )


def report_latencies(name: str, latencies: dict[str, dict[str, list[float]]], batch: int) -> None:
    print(
        f"  {name}: microseconds per call (median of each round's calls, median over rounds; "
        f"a batch is {batch} keys) against the raw call"
    )
    for label, stacks in latencies.items():
        ours = statistics.median(stacks["kvplug"]) * 1e6
        theirs = statistics.median(stacks["raw"]) * 1e6
        print(f"    {label:28} kvplug {ours:8.0f}   raw {theirs:8.0f}   ratio {theirs / ours:.2f}x")


def report_calls(name: str, calls: dict[str, dict[str, float]], batch: int) -> None:
    print(
        f"  {name}: Mooncake calls per kvplug operation (batched paths: per batch of {batch}; "
        "counted in an untimed pass)"
    )
    for path, made in calls.items():
        listed = ", ".join(f"{call} {n:g}" for call, n in sorted(made.items()))
        print(f"    {path:28} {sum(made.values()):4g}  ({listed})")


def checksum_hint(
    name: str,
    shape: tuple[int, ...],
    count: int,
    times: dict[str, dict[str, list[float]]],
    parts: dict[str, float],
) -> None:
    """xxh3-64 over one chunk against the raw client's time per chunk, and the raw calls
    kvplug makes against those the raw stack makes."""
    nbytes = nbytes_of(shape, torch.float16)
    chunk = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    view = MemoryObj.from_tensor(chunk).memoryview()
    xxhash.xxh3_64_intdigest(view)
    samples = []
    for _ in range(9):
        start = time.perf_counter()
        xxhash.xxh3_64_intdigest(view)
        samples.append(time.perf_counter() - start)
    hashing = statistics.median(samples)
    print(
        f"  {name}: xxh3-64 of one chunk {hashing * 1e3:.2f} ms ({nbytes / hashing / 1e9:.1f} "
        "GB/s); as a share of the raw time per chunk:"
    )
    for path in PATHS[:4]:
        per_chunk = statistics.median(times[path]["raw"]) / count
        print(
            f"    {path:18} raw {per_chunk * 1e3:6.2f} ms/chunk -> checksum "
            f"{hashing / per_chunk:.0%} of it"
        )
    print(
        "    raw calls alone, ms per chunk, in batches unless per-op (kvplug's put = "
        "batch_is_exist + batch_put_from_multi_buffers, its get_into = "
        "batch_get_into_multi_buffers, a get of a key family not seen yet = "
        "batch_get_replica_desc + batch_get_into):"
    )
    for label, seconds in parts.items():
        print(f"      {label:30} {seconds * 1e3:6.2f}")


async def main(args: argparse.Namespace) -> None:
    if not isolated_network() and not args.any_network:
        print(
            "bench_mooncake: Mooncake's master and clients bind all interfaces; run this in a "
            "private network namespace: scripts/isolated.sh .venv/bin/python "
            "benchmarks/bench_mooncake.py (or pass --any-network to run here anyway).",
            file=sys.stderr,
        )
        sys.exit(2)
    largest = max(nbytes_of(shape, torch.float16) * times for shape, times in SHAPES.values())
    print(
        f"{installed_version()}; kvplug-mooncake against the raw client; master + node lending "
        f"{args.node_size}, clients lend nothing (TCP loopback, P2PHANDSHAKE); {args.chunks} "
        f"chunks per pass (x8 of 256 KiB), batches of {args.batch}, {args.repeat} rounds (one "
        f"pass of both stacks holds {2 * args.chunks * largest / 2**30:.2f} GiB at most); "
        f"backend {kvplug_mooncake.backend.__file__}"
    )
    results = []
    with MooncakeMaster() as master, MooncakeNode(master, args.node_size):
        raw = RawStack(master)
        try:
            for name, (shape, times) in SHAPES.items():
                count = args.chunks * times
                result = await measure_shape(shape, count, master, raw, args)
                report(name, nbytes_of(shape, torch.float16) * count, result.times)
                report_latencies(name, result.latencies, args.batch)
                report_calls(name, result.calls, args.batch)
                results.append((name, shape, count, result))
        finally:
            raw.close()
    print("\nProfile hint: kvplug hashes each payload (xxh3-64) once per put and once per read")
    for name, shape, count, result in results:
        checksum_hint(name, shape, count, result.times, result.parts)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--node-size", default="4GiB")
    parser.add_argument(
        "--lookups",
        type=int,
        default=200,
        help="calls timed per case and round in the per-call latency table",
    )
    parser.add_argument(
        "--any-network",
        action="store_true",
        help="run outside a private network namespace (Mooncake binds all interfaces)",
    )
    asyncio.run(main(parser.parse_args()))
