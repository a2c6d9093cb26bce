"""One set of counters: what each backend's operations did, kept by the template.

Every public operation of a :class:`~kvplug.backend.Backend` is counted once, when it returns
or raises, in an :class:`OperationStats` of its name: calls, errors, keys, hits, misses, bytes,
time and a latency histogram. Nothing else in kvplug counts hits, misses or bytes of a backend:
the Store's per-tier series (``Store.stats()`` and its Prometheus metrics), ``kvplug check``
and the engine integrations' status reports all read these counters, through
:func:`summarize`, so they never disagree.

A tier with per-tenant quotas (:class:`~kvplug.quotas.TenantQuotas`) also counts, per
tenant, what it holds and what happened to it: :class:`TenantStats`, from its
``tenant_stats()`` (:class:`ReportsTenants`).

Example::

    >>> stats = {"batched_get": OperationStats(calls=1, keys=4, hits=3, misses=1, bytes=300),
    ...          "batched_put": OperationStats(calls=1, keys=4, bytes=400)}
    >>> summary = summarize(stats)
    >>> summary.reads, summary.hits, summary.hit_rate, summary.writes, summary.bytes_written
    (4, 3, 0.75, 4, 400)
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable

LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)
"""Upper bounds in seconds of the latency histogram's buckets (a last one, +Inf, follows)."""

READ_OPERATIONS = ("get", "batched_get", "get_into", "batched_get_into")
"""Operations that read values: their hits and misses make a backend's hit rate."""
LOOKUP_OPERATIONS = ("contains", "batched_contains", "batched_exists")
"""Operations that only ask whether keys are present."""
WRITE_OPERATIONS = ("put", "batched_put")


@dataclass
class OperationStats:
    """What one public operation of a backend has done so far: its finished calls, each
    counted once, with its outcome, when it returns or raises."""

    calls: int = 0
    errors: int = 0
    """Calls that raised (a miss is not an error)."""
    keys: int = 0
    """Keys handled by the calls that returned (a batched call counts each of its keys)."""
    hits: int = 0
    """Keys found, by ``get``, ``contains``, ``get_into``, ``batched_exists`` and the batched
    forms (``batched_contains``: the leading keys it reports present)."""
    misses: int = 0
    """Keys not found (``batched_contains``: every key after the leading present ones)."""
    bytes: int = 0
    """Bytes of the objects put, or read by hits."""
    seconds: float = 0.0
    """Time spent in the operation, summed over calls."""
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    """Calls by duration: ``latency_counts[i]`` took at most ``LATENCY_BUCKETS[i]`` seconds
    and more than the bound before it; the last entry counts the calls above every bound."""

    def copy(self) -> OperationStats:
        return OperationStats(
            self.calls,
            self.errors,
            self.keys,
            self.hits,
            self.misses,
            self.bytes,
            self.seconds,
            list(self.latency_counts),
        )


class OperationCounters:
    """The :class:`OperationStats` of each operation of one backend, thread-safe: operations of
    a backend that runs inline finish on many engine threads at once, and a snapshot never
    sees a call half counted."""

    def __init__(self) -> None:
        self._stats: dict[str, OperationStats] = {}
        self._lock = threading.Lock()

    def count(
        self,
        operation: str,
        started: float | None,
        hits: int = 0,
        misses: int = 0,
        nbytes: int = 0,
        errors: int = 0,
        calls: int = 1,
        keys: int | None = None,
    ) -> None:
        """Count ``calls`` finished calls of ``operation`` begun at ``started`` (a
        ``time.perf_counter()``; ``None``: no time). ``keys`` defaults to ``hits + misses``
        for a call that returned and to none for one that raised."""
        seconds = 0.0 if started is None else time.perf_counter() - started
        if keys is None:
            keys = 0 if errors else hits + misses
        bucket = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        lock = self._lock
        lock.acquire()  # half the cost of "with lock" (about 0.1 us here), once per call
        try:
            stats = self._stats.get(operation)
            if stats is None:
                stats = self._stats[operation] = OperationStats()
            stats.calls += calls
            stats.errors += errors
            stats.keys += keys
            stats.hits += hits
            stats.misses += misses
            stats.bytes += nbytes
            stats.seconds += seconds
            if calls:
                stats.latency_counts[bucket] += calls
        finally:
            lock.release()

    def snapshot(self) -> dict[str, OperationStats]:
        """A consistent copy of every operation's counters, by operation name."""
        with self._lock:
            return {name: stats.copy() for name, stats in self._stats.items()}


@dataclass(frozen=True)
class CounterSummary:
    """A backend's counters summed over its operations: what status reports show."""

    reads: int = 0
    """Keys asked by read operations (:data:`READ_OPERATIONS`) that returned."""
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    writes: int = 0
    """Keys stored by ``put`` and ``batched_put`` calls that returned."""
    bytes_written: int = 0
    lookups: int = 0
    """Keys asked by existence checks (:data:`LOOKUP_OPERATIONS`) that returned."""
    lookup_hits: int = 0
    calls: int = 0
    """Calls of every operation."""
    errors: int = 0
    """Calls of every operation that raised."""
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        """``hits / reads``; None before the first read."""
        return self.hits / self.reads if self.reads else None

    def as_dict(self) -> dict[str, int | float | None]:
        """The fields and ``hit_rate``, for a status report."""
        return {**asdict(self), "hit_rate": self.hit_rate}


def summarize(stats: Mapping[str, OperationStats]) -> CounterSummary:
    """Sum a backend's :meth:`~kvplug.backend.Backend.operation_stats` into one
    :class:`CounterSummary`."""
    reads = [stats[name] for name in READ_OPERATIONS if name in stats]
    writes = [stats[name] for name in WRITE_OPERATIONS if name in stats]
    lookups = [stats[name] for name in LOOKUP_OPERATIONS if name in stats]
    return CounterSummary(
        reads=sum(s.hits + s.misses for s in reads),
        hits=sum(s.hits for s in reads),
        misses=sum(s.misses for s in reads),
        bytes_read=sum(s.bytes for s in reads),
        writes=sum(s.keys for s in writes),
        bytes_written=sum(s.bytes for s in writes),
        lookups=sum(s.hits + s.misses for s in lookups),
        lookup_hits=sum(s.hits for s in lookups),
        calls=sum(s.calls for s in stats.values()),
        errors=sum(s.errors for s in stats.values()),
        seconds=sum(s.seconds for s in stats.values()),
    )


@dataclass
class TenantStats:
    """One tenant's share of a size-capped tier with quotas, and what happened to it (or the
    sum over the tenants reported together: :data:`~kvplug.eviction.OTHER_TENANTS`,
    :data:`~kvplug.eviction.UNTENANTED`).

    Example::

        >>> TenantStats(quota=4096, bytes_held=1024, objects=1).as_dict()["quota"]
        4096
    """

    quota: int | None = None
    """The tenant's quota in bytes; None: it has none."""
    bytes_held: int = 0
    """Bytes of its stored entries, as the tier counts them against ``max_size``."""
    objects: int = 0
    """Its stored entries."""
    hits: int = 0
    """Reads of its keys that found them."""
    misses: int = 0
    """Reads of its keys that did not."""
    evictions: int = 0
    """Its entries evicted, to make room for itself or (over its quota) for others."""
    refused: int = 0
    """Its puts no room could be made for: over its quota with nothing of its own left to
    evict, or the tier full of entries that may not go."""

    def as_dict(self) -> dict[str, int | None]:
        """The counters by name (a copy)."""
        return asdict(self)


@runtime_checkable
class ReportsTenants(Protocol):
    """A tier that counts per tenant (``cpu://``, ``file://`` with quotas configured)."""

    def tenant_stats(self) -> dict[str, dict[str, int | None]]:
        """:meth:`TenantStats.as_dict` of each reported tenant, by name; empty without
        quotas."""
        ...


__all__ = [
    "LATENCY_BUCKETS",
    "LOOKUP_OPERATIONS",
    "READ_OPERATIONS",
    "WRITE_OPERATIONS",
    "CounterSummary",
    "OperationCounters",
    "OperationStats",
    "ReportsTenants",
    "TenantStats",
    "summarize",
]
