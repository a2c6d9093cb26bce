"""``kvplug bench``: store and retrieve model-shaped KV chunks through the tiers, verify every
byte, and report throughput and latency per operation and tier.

With no configuration it uses the embedded default: host memory (``cpu://``) in front of a
local-disk tier (``file://``) in a temporary directory, so it needs no server.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from kvplug.config import Config
from kvplug.errors import KvplugError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj, nbytes_of
from kvplug.store import Store

DEFAULT_SHAPE = (2, 32, 256, 1024)
DEFAULT_COUNT = 32

Progress = Callable[[str, int, int], None]
"""Called as ``(phase, done, total)``."""


@dataclass
class BenchRow:
    """The timings of one operation on one tier."""

    operation: str
    tier: str
    seconds: list[float] = field(default_factory=list)
    nbytes: int = 0
    misses: int = 0
    zero_copy: bool = False
    """The tier hands over memory instead of copying it: its GB/s would mean nothing."""

    @property
    def count(self) -> int:
        return len(self.seconds)

    @property
    def gb_per_s(self) -> float:
        total = sum(self.seconds)
        return self.nbytes / total / 1e9 if total else math.nan

    def percentile_ms(self, q: float) -> float:
        if not self.seconds:
            return math.nan
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


@dataclass
class BenchResult:
    rows: list[BenchRow]
    chunk_bytes: int
    verified: int
    mismatches: int


def default_bench_config(directory: str, chunk_bytes: int, count: int) -> Config:
    """cpu in front of a disk tier in ``directory``, each big enough for the whole run."""
    room = max(chunk_bytes * count * 2, 64 << 20)
    return Config.from_dict(
        {
            "tiers": [
                {"url": "cpu://", "max_size": room},
                {"url": f"file://{directory}", "max_size": room},
            ]
        }
    )


def _checksum(obj: MemoryObj) -> int:
    return int(xxhash.xxh3_64_intdigest(obj.memoryview()))


async def run_bench(
    config: Config,
    *,
    shape: Sequence[int] = DEFAULT_SHAPE,
    dtype: torch.dtype = torch.float16,
    count: int = DEFAULT_COUNT,
    progress: Progress | None = None,
) -> BenchResult:
    """Put ``count`` chunks through the store, then read each tier back; every byte checked."""
    report = progress or (lambda phase, done, total: None)
    rows: dict[tuple[str, str], BenchRow] = {}

    def record(tier: str, op: str, seconds: float, nbytes: int) -> None:
        row = rows.setdefault((op, tier), BenchRow(op, tier))
        row.seconds.append(seconds)
        row.nbytes += nbytes

    store = await Store.open(config, on_latency=record)
    chunk_bytes = nbytes_of(shape, dtype)
    keys = [CacheKey("vllm", "kvplug-bench", 1, 0, n) for n in range(count)]
    checksums: dict[CacheKey, int] = {}
    verified = mismatches = 0
    try:
        pattern = torch.randint(
            0, 256, (chunk_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        )
        for done, key in enumerate(keys):
            obj = store.allocate(shape, dtype, MemoryFormat.KV_2LTD)
            if obj is None:
                raise KvplugError(
                    f"no memory for chunk {done} of {count} ({chunk_bytes} bytes) in the first "
                    "tier; give it more room (cpu max_size) or pass a smaller --count"
                )
            torch.bitwise_xor(pattern, done % 251, out=obj.raw)
            checksums[key] = _checksum(obj)
            await store.put(key, obj)
            obj.release()
            report("put", done + 1, count)
        await store.flush()
        for index, (name, backend) in enumerate(zip(store.tier_names, store.tiers, strict=True)):
            row = rows.setdefault(("get", name), BenchRow("get", name))
            for done, key in enumerate(keys):
                start = time.perf_counter()
                got = await backend.get(key)
                elapsed = time.perf_counter() - start
                if got is None:
                    row.misses += 1
                else:
                    row.seconds.append(elapsed)
                    row.nbytes += got.nbytes
                    if _checksum(got) == checksums[key] and got.shape == tuple(shape):
                        verified += 1
                    else:
                        mismatches += 1
                    got.release()
                report(f"get tier {index}", done + 1, count)
    finally:
        await store.close()
    for name, backend in zip(store.tier_names, store.tiers, strict=True):
        for row in rows.values():
            if row.tier == name:
                row.zero_copy = backend.capabilities.zero_copy
    ordered = sorted(rows.values(), key=lambda r: (r.operation != "put", r.tier))
    return BenchResult(ordered, chunk_bytes, verified, mismatches)


__all__ = ["BenchResult", "BenchRow", "default_bench_config", "run_bench"]
