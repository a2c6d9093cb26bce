"""``kvplug bench``: store and retrieve model-shaped KV chunks through the tiers, verify every
byte, and report throughput and latency per operation and tier.

With no configuration it uses the embedded default: host memory (``cpu://``) in front of a
local-disk tier (``file://``) in a temporary directory, so it needs no server.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from kvplug.config import Config
from kvplug.errors import KvplugError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj, nbytes_of
from kvplug.store import Store, open_store

DEFAULT_SHAPE = (2, 32, 256, 1024)
DEFAULT_COUNT = 32
FLUSH_TIMEOUT = 60.0
BENCH_MODEL = "kvplug-bench"
"""The keys' ``fmt``: no engine writes it, so a run never touches an engine's chunks."""

Progress = Callable[[str, int, int], None]
"""Called as ``(phase, done, total)``."""


@dataclass
class BenchRow:
    """The timings of one operation on one tier."""

    operation: str
    tier: str
    seconds: list[float] = field(default_factory=list)
    """One per call; a lower tier's puts are batched, so one call may carry several chunks."""
    chunks: int = 0
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
class TierOutcome:
    """What one tier did with the chunks the bench gave it."""

    tier: str
    given: int
    stored: int = 0
    returned: int = 0
    dropped: int = 0
    errors: int = 0
    last_problem: str | None = None
    """The last error or the reason of the last dropped put."""
    removed: int | None = None
    """Chunks removed again after the run; ``None`` when the tier cannot delete."""

    def shortfall(self) -> str | None:
        """Why this tier did not store and return every chunk it was given, or ``None``."""
        if self.stored == self.given and self.returned == self.given:
            return None
        counts = (
            f"accepted {self.stored} of {self.given} chunks and returned {self.returned}"
            f" ({self.dropped} puts dropped, {self.errors} errors)"
        )
        last = f"; last problem: {self.last_problem}" if self.last_problem else ""
        return f"tier {self.tier} {counts}{last}"


@dataclass
class BenchResult:
    rows: list[BenchRow]
    chunk_bytes: int
    verified: int
    mismatches: int
    tiers: list[TierOutcome] = field(default_factory=list)
    namespace: str = ""
    """The keys' ``fmt@model`` prefix: this run's own, removed again at the end."""

    @property
    def shortfalls(self) -> list[str]:
        """One line per tier that stored or returned fewer chunks than it was given."""
        return [line for line in (tier.shortfall() for tier in self.tiers) if line]


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
    chunk_bytes = nbytes_of(shape, dtype)

    def record(tier: str, op: str, seconds: float, nbytes: int) -> None:
        row = rows.setdefault((op, tier), BenchRow(op, tier))
        row.seconds.append(seconds)
        row.chunks += nbytes // chunk_bytes
        row.nbytes += nbytes

    store = await open_store(config, on_latency=record)
    for name in store.tier_names:
        for operation in ("put", "get"):
            rows[(operation, name)] = BenchRow(operation, name)
    run_name = f"run-{uuid.uuid4().hex[:12]}"
    keys = [CacheKey(f"{BENCH_MODEL}/{run_name}", 1, 0, n) for n in range(count)]
    outcomes = [TierOutcome(name, count) for name in store.tier_names]
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
            row = rows[("get", name)]
            for done, key in enumerate(keys):
                start = time.perf_counter()
                try:
                    got = await backend.get(key)
                except (KvplugError, OSError) as error:
                    outcomes[index].errors += 1
                    outcomes[index].last_problem = f"get: {type(error).__name__}: {error}"
                    got = None
                elapsed = time.perf_counter() - start
                if got is None:
                    row.misses += 1
                else:
                    row.seconds.append(elapsed)
                    row.chunks += 1
                    row.nbytes += got.nbytes
                    if _checksum(got) == checksums[key] and got.shape == tuple(shape):
                        verified += 1
                    else:
                        mismatches += 1
                    got.release()
                report(f"get tier {index}", done + 1, count)
    finally:
        try:
            with contextlib.suppress(TimeoutError):
                await store.flush(FLUSH_TIMEOUT)  # a put still queued would land after removal
            await _remove_from_every_tier(store, keys, outcomes, report)
        finally:
            await store.close()
    stats = store.stats()["tiers"]
    for outcome, health, backend in zip(outcomes, store.health(), store.tiers, strict=True):
        outcome.stored = rows[("put", outcome.tier)].chunks
        outcome.returned = rows[("get", outcome.tier)].chunks
        outcome.dropped = int(stats[outcome.tier]["dropped_puts"])
        outcome.errors += int(stats[outcome.tier]["errors"])
        outcome.last_problem = outcome.last_problem or health.last_error or health.last_dropped
        for operation in ("put", "get"):
            rows[(operation, outcome.tier)].zero_copy = backend.capabilities.zero_copy
    ordered = sorted(rows.values(), key=lambda r: (r.operation != "put", r.tier))
    return BenchResult(
        ordered, chunk_bytes, verified, mismatches, outcomes, f"{BENCH_MODEL}/{run_name}@1@0"
    )


async def _remove_from_every_tier(
    store: Store, keys: Sequence[CacheKey], outcomes: list[TierOutcome], report: Progress
) -> None:
    """Remove the run's chunks from every tier that can delete, so nothing is left behind."""
    for index, (backend, outcome) in enumerate(zip(store.tiers, outcomes, strict=True)):
        if not backend.capabilities.remove:
            continue
        outcome.removed = 0
        for done, key in enumerate(keys):
            try:
                outcome.removed += bool(await backend.remove(key))
            except (KvplugError, OSError) as error:
                outcome.last_problem = f"remove: {type(error).__name__}: {error}"
            report(f"clean tier {index}", done + 1, len(keys))


__all__ = [
    "BENCH_MODEL",
    "BenchResult",
    "BenchRow",
    "TierOutcome",
    "default_bench_config",
    "run_bench",
]
