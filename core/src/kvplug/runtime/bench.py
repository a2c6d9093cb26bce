"""``kvplug bench``: store and retrieve model-shaped KV chunks through the tiers, verify every
byte, and report throughput and latency per operation and tier.

With no configuration it uses the embedded default: host memory (``cpu://``) in front of a
local-disk tier (``file://``) in a temporary directory, so it needs no server.

**What it measures** (:data:`METHOD`). The bench measures what the tiers sustain, not how much
of a burst the write-behind absorbs: its puts wait for write-behind room (the Store's
``write_behind_wait``, up to :data:`PUT_WAIT` seconds a put), so a lower tier is never dropped
a chunk because the bench offered chunks faster than the tier writes them. Each tier's rows
time that tier's own calls; the *sustained* rate is every chunk's bytes over the wall time from
the first put until ``Store.flush()`` returned, when every tier has them. A tier that still
stores or returns fewer chunks than it was offered is a real shortfall: the bench fails and
names the tier, the counts, the reason and what to change (:func:`drop_advice`).
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from kvplug.errors import KvplugError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj, nbytes_of
from kvplug.runtime.config import Config
from kvplug.runtime.store import ADVICE, Store, open_store
from kvplug.units import format_size

DEFAULT_SHAPE = (2, 32, 256, 1024)
DEFAULT_COUNT = 32
FLUSH_TIMEOUT = 60.0
PUT_WAIT = 60.0
"""Seconds one put of the bench may wait for write-behind room (``write_behind_wait``): a lower
tier that frees none in that time is stalled, and its drops are its own."""
METHOD = (
    f"puts wait up to {PUT_WAIT:g} s for write-behind room (the Store's write_behind_wait), so "
    "no tier is dropped a chunk for the bench's own speed; each tier's rows time that tier's own "
    "calls; sustained = every chunk's bytes / wall time from the first put until flush() "
    "returned"
)
"""How the bench measures, as ``kvplug bench`` prints it."""
BENCH_MODEL = "kvplug-bench"
"""The keys' ``fmt``: no engine writes it, so a run never touches an engine's chunks."""

Progress = Callable[[str, int, int], None]
"""Called as ``(phase, done, total)``."""


def drop_advice(reason: str, *, object_bytes: int, write_behind_limit: int) -> str:
    """What to change when a tier was dropped puts for ``reason`` (one of
    :data:`kvplug.runtime.store.DROP_REASONS`), for objects of ``object_bytes``: the Store's advice
    for
    the reason, with the sizes that matter.

    Example::

        >>> advice = drop_advice("full", object_bytes=32 << 20, write_behind_limit=512 << 20)
        >>> print(advice)  # doctest: +NORMALIZE_WHITESPACE
        raise the tier's max_size (or free its space): the objects do not fit in it (one object
        is 32.0MiB)
    """
    advice = ADVICE.get(reason, f"see why the tier drops puts ({reason})")
    size = format_size(object_bytes)
    if reason == "write_behind_full":
        return (
            f"{advice} (write_behind_size is {format_size(write_behind_limit)}, a quarter of the "
            f"memory budget unless the config sets it; one object is {size})"
        )
    if reason == "full":
        return f"{advice} (one object is {size})"
    if reason in ("tier_failing", "tier_error"):
        return f"{advice}; kvplug check URL tests the tier on its own"
    return advice


def describe_drops(offered: int, dropped_by_reason: Mapping[str, float], *, took_none: bool) -> str:
    """A tier's dropped puts in words, reasons most frequent first.

    Example::

        >>> describe_drops(32, {"write_behind_full": 16, "full": 0}, took_none=False)
        'of the 32 puts offered to it, dropped: write_behind_full 16'
        >>> describe_drops(3, {"full": 3}, took_none=True)
        'it took none of the 3 puts offered to it (dropped: full 3)'
    """
    counted = sorted(
        ((int(n), reason) for reason, n in dropped_by_reason.items() if n), reverse=True
    )
    reasons = ", ".join(f"{reason} {n}" for n, reason in counted)
    if took_none:
        return f"it took none of the {offered} puts offered to it (dropped: {reasons})"
    return f"of the {offered} puts offered to it, dropped: {reasons}"


def main_reason(dropped_by_reason: Mapping[str, float]) -> str:
    """The reason most puts were dropped for; ``closed`` and ``untracked`` (what was left when
    the store closed, removals it could not track) only when there is no other.

    Example::

        >>> main_reason({"closed": 5, "tier_failing": 4, "tier_error": 1})
        'tier_failing'
    """
    counted = {reason: n for reason, n in dropped_by_reason.items() if n}
    causes = {r: n for r, n in counted.items() if r not in ("closed", "untracked")} or counted
    return max(causes, key=causes.__getitem__)


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
    offered: int = 0
    """Puts the store routed to this tier, written or dropped."""
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    advice: str | None = None
    """What to change, for the most frequent reason its puts were dropped."""

    def shortfall(self) -> str | None:
        """Why this tier did not store and return every chunk it was given, or ``None``."""
        if self.stored == self.given and self.returned == self.given:
            return None
        parts = [
            f"tier {self.tier} accepted {self.stored} of {self.given} chunks and returned "
            f"{self.returned} ({self.dropped} puts dropped, {self.errors} errors)"
        ]
        if self.dropped_by_reason:
            parts.append(
                describe_drops(self.offered, self.dropped_by_reason, took_none=not self.stored)
            )
        if self.last_problem:
            parts.append(f"last problem: {self.last_problem}")
        if self.advice:
            parts.append(f"to fix: {self.advice}")
        return "; ".join(parts)


@dataclass
class BenchResult:
    rows: list[BenchRow]
    chunk_bytes: int
    verified: int
    mismatches: int
    tiers: list[TierOutcome] = field(default_factory=list)
    namespace: str = ""
    """The keys' ``fmt@model`` prefix: this run's own, removed again at the end."""
    put_seconds: float = math.nan
    """Wall time from the first put until ``flush()`` returned (every tier had every chunk)."""
    waited_puts: int = 0
    """Puts that found the write-behind without room for their chunk and waited for it."""
    waited_seconds: float = 0.0
    write_behind_limit: int = 0
    refused: int = 0
    """Puts the store accepted nowhere (``Store.offer`` said False); each tier says why."""

    @property
    def chunks(self) -> int:
        return self.tiers[0].given if self.tiers else 0

    @property
    def sustained_gb_per_s(self) -> float:
        """Every chunk's bytes over :attr:`put_seconds`: what the tiers sustained together."""
        if not self.put_seconds or math.isnan(self.put_seconds):
            return math.nan
        return self.chunks * self.chunk_bytes / self.put_seconds / 1e9

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
    """Put ``count`` chunks through the store (each put waiting for write-behind room, see
    :data:`METHOD`), then read each tier back; every byte checked."""
    report = progress or (lambda phase, done, total: None)
    rows: dict[tuple[str, str], BenchRow] = {}
    chunk_bytes = nbytes_of(shape, dtype)

    def record(tier: str, op: str, seconds: float, nbytes: int) -> None:
        if op not in ("put", "get"):
            return  # removals of older values the store queues carry no throughput
        row = rows.setdefault((op, tier), BenchRow(op, tier))
        row.seconds.append(seconds)
        row.chunks += nbytes // chunk_bytes
        row.nbytes += nbytes

    store = await open_store(config, on_latency=record, write_behind_wait=PUT_WAIT)
    for name in store.tier_names:
        for operation in ("put", "get"):
            rows[(operation, name)] = BenchRow(operation, name)
    run_name = f"run-{uuid.uuid4().hex[:12]}"
    keys = [CacheKey(f"{BENCH_MODEL}/{run_name}", 1, 0, n) for n in range(count)]
    outcomes = [TierOutcome(name, count) for name in store.tier_names]
    result = BenchResult([], chunk_bytes, 0, 0, outcomes, f"{BENCH_MODEL}/{run_name}@1@0")
    result.write_behind_limit = store.write_behind_limit
    checksums: dict[CacheKey, int] = {}
    try:
        pattern = torch.randint(
            0, 256, (chunk_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        )
        started = time.perf_counter()
        for done, key in enumerate(keys):
            obj = store.allocate(shape, dtype, MemoryFormat.KV_2LTD)
            if obj is None:
                raise KvplugError(
                    f"no memory for chunk {done} of {count} ({chunk_bytes} bytes) in the first "
                    "tier; give it more room (cpu max_size) or pass a smaller --count"
                )
            torch.bitwise_xor(pattern, done % 251, out=obj.raw)
            checksums[key] = _checksum(obj)
            waits = len(store.tiers) > 1 and store.write_behind_room < min(
                obj.phy_size, store.write_behind_limit
            )
            put_started = time.perf_counter()
            if not (await store.offer([key], [obj]))[0]:
                result.refused += 1
            if waits:
                result.waited_puts += 1
                result.waited_seconds += time.perf_counter() - put_started
            obj.release()
            report("put", done + 1, count)
        await store.flush()
        result.put_seconds = time.perf_counter() - started
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
                        result.verified += 1
                    else:
                        result.mismatches += 1
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
        tier_stats = stats[outcome.tier]
        outcome.stored = rows[("put", outcome.tier)].chunks
        outcome.returned = rows[("get", outcome.tier)].chunks
        outcome.dropped = int(tier_stats["dropped_puts"])
        outcome.dropped_by_reason = {
            reason: int(n) for reason, n in tier_stats["dropped_by_reason"].items() if n
        }
        # The store routes every put to every tier: the bench offered each tier all it gave.
        outcome.offered = int(tier_stats.get("offered_puts", outcome.given))
        outcome.errors += int(tier_stats["errors"])
        outcome.last_problem = outcome.last_problem or health.last_error or health.last_dropped
        if outcome.dropped_by_reason:
            outcome.advice = drop_advice(
                main_reason(outcome.dropped_by_reason),
                object_bytes=chunk_bytes,
                write_behind_limit=store.write_behind_limit,
            )
        for operation in ("put", "get"):
            rows[(operation, outcome.tier)].zero_copy = backend.capabilities.zero_copy
    result.rows = sorted(rows.values(), key=lambda r: (r.operation != "put", r.tier))
    return result


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
    "METHOD",
    "PUT_WAIT",
    "BenchResult",
    "BenchRow",
    "TierOutcome",
    "default_bench_config",
    "describe_drops",
    "drop_advice",
    "main_reason",
    "run_bench",
]
