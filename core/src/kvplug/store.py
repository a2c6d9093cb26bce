"""The tiered store: what an engine talks to.

A :class:`Store` holds an ordered list of backends, the tiers (fastest first, as in the
``tiers:`` config). ``put`` stores an object in the first tier at once (so it reads back
immediately) and hands it to every other tier through a bounded queue per tier, so a slow tier
never blocks the engine and never grows memory without bound (what a full queue drops is
counted). ``get`` searches the tiers in order and writes a hit from
a lower tier back into the faster ones. ``lookup`` counts the leading keys present anywhere;
``prefetch`` loads a contiguous prefix into the first tier.

A tier that fails is isolated: its error is counted, the other tiers keep serving, and it is
tried again after an exponential back-off; :meth:`Store.health` tells its state. Per-tier
counters and latency histograms are readable with :meth:`Store.stats` and exportable in
Prometheus format with :meth:`Store.prometheus_text`.

Example::

    >>> import asyncio, torch
    >>> from kvplug.config import Config
    >>> from kvplug.keys import CacheKey
    >>> from kvplug.store import Store
    >>> async def main():
    ...     store = await Store.open(Config.from_dict({"tiers": ["cpu://?max_size=64MiB"]}))
    ...     key = CacheKey("vllm", "llama", 1, 0, 7)
    ...     obj = store.allocate((2, 4, 16, 64), torch.float16)
    ...     obj.tensor.fill_(2.0)
    ...     await store.put(key, obj)
    ...     obj.release()
    ...     await store.flush()
    ...     hit = await store.get(key)
    ...     total = hit.tensor.sum().item()
    ...     hit.release()
    ...     found = await store.lookup([key, key.with_hash(8)])
    ...     await store.close()
    ...     return total, found
    >>> asyncio.run(main())
    (16384.0, 1)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvplug.backend import Backend
from kvplug.config import Config, load_config
from kvplug.errors import (
    BackendClosed,
    BackendError,
    CapacityExceeded,
    ConfigError,
    NotSupported,
)
from kvplug.keys import CacheKey
from kvplug.memory import Allocator, AllocatorStats, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.registry import open_backend
from kvplug.secrets import mask_text

T = TypeVar("T")
logger = logging.getLogger("kvplug.store")

DEFAULT_QUEUE_SIZE = 64
DEFAULT_BUFFER_SIZE = 2 << 30
LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


@runtime_checkable
class AllocatingTier(Protocol):
    """A tier that hands out objects in its own memory, evicting to make room (``cpu://``);
    objects from it are stored in it without a copy."""

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = ...
    ) -> MemoryObj | None: ...


class _TierAllocator(Allocator):
    """Allocates through the first tier, so that objects read from lower tiers land in its
    memory (and write-back into it is free) and room is made by its eviction policy."""

    def __init__(self, tier: AllocatingTier, backing: Allocator) -> None:
        self.tier = tier
        self.backing = backing

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = MemoryFormat.KV_2LTD
    ) -> MemoryObj | None:
        return self.tier.allocate(shape, dtype, fmt)

    def stats(self) -> AllocatorStats:
        return self.backing.stats()

    def _free_block(self, offset: int, size: int) -> None:  # pragma: no cover - never owns
        raise AssertionError("objects of a tier allocator belong to the tier's own allocator")


@dataclass
class TierHealth:
    """A tier's state: healthy, or failing and skipped until ``retry_at`` (monotonic time)."""

    name: str
    healthy: bool = True
    consecutive_errors: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    last_dropped: str | None = None
    """Why the last put that did not reach this tier was dropped (full, queue full, ...)."""


@dataclass
class _Tier:
    name: str
    backend: Backend
    queue: asyncio.Queue[tuple[CacheKey, MemoryObj]]
    health: TierHealth
    worker: asyncio.Task[None] | None = None
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class StoreMetrics:
    """Per-tier Prometheus metrics in a registry of this store's own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["tier"]
        self.hits = Counter(
            "kvplug_tier_hits", "gets answered by the tier", labels, registry=self.registry
        )
        self.misses = Counter(
            "kvplug_tier_misses", "gets the tier missed", labels, registry=self.registry
        )
        self.bytes_read = Counter(
            "kvplug_tier_read_bytes", "bytes returned by the tier", labels, registry=self.registry
        )
        self.bytes_written = Counter(
            "kvplug_tier_written_bytes", "bytes stored in the tier", labels, registry=self.registry
        )
        self.errors = Counter(
            "kvplug_tier_errors", "operations that failed", ["tier", "op"], registry=self.registry
        )
        self.dropped = Counter(
            "kvplug_tier_dropped_puts",
            "puts not made: queue full, tier failing or full",
            labels,
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvplug_tier_op_seconds",
            "latency of tier operations",
            ["tier", "op"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.healthy = Gauge(
            "kvplug_tier_healthy", "1 when the tier is serving", labels, registry=self.registry
        )
        self.queue_depth = Gauge(
            "kvplug_tier_queue_depth", "puts waiting for the tier", labels, registry=self.registry
        )

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


async def _close_each(backends: Sequence[tuple[str, Backend]]) -> list[tuple[str, Exception]]:
    """Close every backend even when some fail; the failures, each logged, by name."""
    failures = []
    for name, backend in backends:
        try:
            await backend.close()
        except Exception as error:
            logger.error("closing tier %s failed: %s: %s", name, type(error).__name__, error)
            failures.append((name, error))
    return failures


class Store:
    """Ordered tiers of backends behind one get/put/lookup interface. Build it with
    :meth:`open`; use it from one event loop (engine threads use a ``SyncClient`` pattern or
    run it on their IO loop)."""

    def __init__(
        self,
        backends: Sequence[Backend],
        *,
        allocator: Allocator,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        on_latency: Callable[[str, str, float, int], None] | None = None,
    ) -> None:
        if not backends:
            raise ConfigError("a Store needs at least one tier; configure tiers: [cpu://]")
        if queue_size < 1:
            raise ConfigError(f"queue_size must be at least 1, got {queue_size}.")
        self.allocator = allocator
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.metrics = StoreMetrics()
        self.on_latency = on_latency
        """Called as ``(tier, op, seconds, nbytes)`` after each tier get and put (benchmarks)."""
        self._closed = False
        names = [self._tier_name(i, b) for i, b in enumerate(backends)]
        self._tiers = [
            _Tier(name, backend, asyncio.Queue(queue_size), TierHealth(name))
            for name, backend in zip(names, backends, strict=True)
        ]
        for tier in self._tiers:
            tier.idle.set()
            self.metrics.healthy.labels(tier.name).set(1)
            tier.worker = asyncio.get_running_loop().create_task(self._drain(tier))

    @staticmethod
    def _tier_name(index: int, backend: Backend) -> str:
        return f"{index}:{backend.url}"  # str(BackendURL) masks its secrets

    @classmethod
    async def open(
        cls,
        config: Config | None = None,
        *,
        allocator: Allocator | None = None,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        backoff: float = 1.0,
        on_latency: Callable[[str, str, float, int], None] | None = None,
    ) -> Store:
        """Open every configured tier (``load_config()`` when no config is given).

        Objects come from ``allocator`` when given; otherwise from the first tier when it can
        allocate (``cpu://``: puts of them are zero-copy there), else from a pinned host buffer
        of 2 GiB.
        """
        config = config or load_config()
        backends: list[Backend] = []
        try:
            for tier in config.tiers:
                backend = await open_backend(tier.url, allocator=allocator, **dict(tier.options))
                if allocator is None:
                    allocator = (
                        _TierAllocator(backend, backend.allocator)
                        if isinstance(backend, AllocatingTier)
                        else FreeListAllocator(
                            DEFAULT_BUFFER_SIZE,
                            sized_by="the Store's host buffer (pass Store.open a smaller "
                            "allocator=)",
                        )
                    )
                backends.append(backend)
        except BaseException:
            await _close_each([(str(backend.url), backend) for backend in backends])
            raise
        assert allocator is not None  # config.tiers is never empty
        return cls(
            backends,
            allocator=allocator,
            queue_size=queue_size,
            backoff=backoff,
            on_latency=on_latency,
        )

    # -- helpers --------------------------------------------------------------------------------

    @property
    def tiers(self) -> list[Backend]:
        return [tier.backend for tier in self._tiers]

    @property
    def tier_names(self) -> list[str]:
        """``index:url`` of each tier (secrets masked), as metrics and stats label them."""
        return [tier.name for tier in self._tiers]

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = MemoryFormat.KV_2LTD
    ) -> MemoryObj | None:
        """An object to fill and put (``None`` when memory is exhausted)."""
        return self.allocator.allocate(shape, dtype, fmt)

    def _ensure_open(self) -> None:
        if self._closed:
            raise BackendClosed("this Store is closed; open a new one with Store.open().")

    def _available(self, tier: _Tier) -> bool:
        health = tier.health
        return health.healthy or time.monotonic() >= health.retry_at

    def _succeeded(self, tier: _Tier) -> None:
        if not tier.health.healthy:
            logger.info("tier %s is serving again", tier.name)
            self.metrics.healthy.labels(tier.name).set(1)
        tier.health.healthy = True
        tier.health.consecutive_errors = 0

    def _failed(self, tier: _Tier, op: str, error: BaseException) -> None:
        health = tier.health
        health.consecutive_errors += 1
        delay = min(self.max_backoff, self.backoff * 2 ** (health.consecutive_errors - 1))
        health.retry_at = time.monotonic() + delay
        health.last_error = mask_text(f"{type(error).__name__}: {error}")
        if health.healthy:
            logger.warning(
                "tier %s failed on %s (%s); skipped for %.1f s",
                tier.name,
                op,
                health.last_error,
                delay,
            )
        health.healthy = False
        self.metrics.errors.labels(tier.name, op).inc()
        self.metrics.healthy.labels(tier.name).set(0)

    async def _call(
        self, tier: _Tier, op: str, operation: Awaitable[T], nbytes: int = 0
    ) -> tuple[bool, T | None]:
        """Run one tier operation with timing and failure isolation: ``(ok, result)``."""
        start = time.perf_counter()
        try:
            result = await operation
        except (BackendClosed, NotSupported, CapacityExceeded):
            raise  # the caller's or the data's problem, not a failing tier
        except (BackendError, OSError) as error:
            self._failed(tier, op, error)
            return False, None
        finally:
            elapsed = time.perf_counter() - start
            self.metrics.latency.labels(tier.name, op).observe(elapsed)
        self._succeeded(tier)
        if self.on_latency is not None:
            if isinstance(result, MemoryObj):
                nbytes = result.nbytes
            self.on_latency(tier.name, op, elapsed, nbytes)
        return True, result

    # -- writes ---------------------------------------------------------------------------------

    def _dropped(self, tier: _Tier, reason: str) -> None:
        tier.health.last_dropped = mask_text(reason)
        self.metrics.dropped.labels(tier.name).inc()

    def _enqueue(self, tier: _Tier, key: CacheKey, obj: MemoryObj) -> None:
        if not self._available(tier):
            self._dropped(tier, f"the tier is skipped after failing ({tier.health.last_error})")
            return
        try:
            tier.queue.put_nowait((key, obj.retain()))
        except asyncio.QueueFull:
            obj.release()
            self._dropped(tier, f"its queue was full ({tier.queue.maxsize} puts waiting)")
            return
        tier.idle.clear()
        self.metrics.queue_depth.labels(tier.name).set(tier.queue.qsize())

    async def _drain(self, tier: _Tier) -> None:
        while True:
            key, obj = await tier.queue.get()
            tier.in_flight += 1
            try:
                ok, _ = await self._call(tier, "put", tier.backend.put(key, obj), obj.nbytes)
                if ok:
                    self.metrics.bytes_written.labels(tier.name).inc(obj.nbytes)
            except (CapacityExceeded, BackendClosed, NotSupported) as error:
                self._dropped(tier, f"{type(error).__name__}: {error}")
            except Exception as error:
                # A bug in the tier (not a store failure): nobody awaits this put to see it, so
                # it is logged in full and counted; the worker keeps draining the queue.
                logger.exception("tier %s raised an unexpected error on a queued put", tier.name)
                self._dropped(tier, f"{type(error).__name__}: {error}")
                self.metrics.errors.labels(tier.name, "put").inc()
            finally:
                obj.release()
                tier.in_flight -= 1
                self.metrics.queue_depth.labels(tier.name).set(tier.queue.qsize())
                if tier.queue.empty() and not tier.in_flight:
                    tier.idle.set()

    async def put(self, key: CacheKey, obj: MemoryObj) -> None:
        """Store ``obj`` in the first tier now (so it can be read back at once) and queue it for
        the others; the caller keeps its reference. A full first tier is counted as a dropped
        put, not raised: the lower tiers may still take the object."""
        self._ensure_open()
        first, *lower = self._tiers
        if self._available(first):
            try:
                ok, _ = await self._call(first, "put", first.backend.put(key, obj), obj.nbytes)
            except CapacityExceeded as error:
                ok = False
                self._dropped(first, f"CapacityExceeded: {error}")
            if ok:
                self.metrics.bytes_written.labels(first.name).inc(obj.nbytes)
        else:
            self._dropped(first, f"the tier is skipped after failing ({first.health.last_error})")
        for tier in lower:
            self._enqueue(tier, key, obj)

    async def batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        if len(keys) != len(objs):
            raise ValueError(f"batched_put got {len(keys)} keys but {len(objs)} objects.")
        for key, obj in zip(keys, objs, strict=True):
            await self.put(key, obj)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued put has reached its tier (or failed)."""
        waits = [tier.idle.wait() for tier in self._tiers]
        await asyncio.wait_for(asyncio.gather(*waits), timeout)

    # -- reads ----------------------------------------------------------------------------------

    async def get(self, key: CacheKey) -> MemoryObj | None:
        """The object from the first tier that has it (the caller releases it), written back
        into the faster tiers; ``None`` when no tier has it."""
        self._ensure_open()
        for index, tier in enumerate(self._tiers):
            if not self._available(tier):
                continue
            ok, obj = await self._call(tier, "get", tier.backend.get(key))
            if not ok or obj is None:
                self.metrics.misses.labels(tier.name).inc()
                continue
            self.metrics.hits.labels(tier.name).inc()
            self.metrics.bytes_read.labels(tier.name).inc(obj.nbytes)
            for faster in self._tiers[:index]:
                self._enqueue(faster, key, obj)
            return obj
        return None

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        return [await self.get(key) for key in keys]

    async def contains(self, key: CacheKey) -> bool:
        return await self.lookup([key]) == 1

    async def lookup(self, keys: Sequence[CacheKey]) -> int:
        """How many leading ``keys`` are present in some tier (each key may be in any tier)."""
        self._ensure_open()
        position = 0
        while position < len(keys):
            advance = 0
            for tier in self._tiers:
                if not self._available(tier):
                    continue
                ok, count = await self._call(
                    tier, "contains", tier.backend.batched_contains(keys[position:])
                )
                if ok and count:
                    advance = max(advance, count)
            if not advance:
                break
            position += advance
        return position

    async def batched_contains(self, keys: Sequence[CacheKey]) -> int:
        """The same as :meth:`lookup`: the backend contract's name for it."""
        return await self.lookup(keys)

    async def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """Load the leading present ``keys`` into the first tier, stopping at the first key no
        tier has; returns how many of them the first tier now holds."""
        self._ensure_open()
        first = self._tiers[0]
        loaded = 0
        for key in keys:
            ok, present = await self._call(first, "contains", first.backend.contains(key))
            if ok and present:
                loaded += 1
                continue
            obj = None
            for tier in self._tiers[1:]:
                if not self._available(tier):
                    continue
                ok, obj = await self._call(tier, "get", tier.backend.get(key))
                if ok and obj is not None:
                    self.metrics.hits.labels(tier.name).inc()
                    self.metrics.bytes_read.labels(tier.name).inc(obj.nbytes)
                    break
            if obj is None:
                break
            try:
                ok, _ = await self._call(first, "put", first.backend.put(key, obj))
            except CapacityExceeded:
                ok = False
            finally:
                obj.release()
            if not ok:
                break
            self.metrics.bytes_written.labels(first.name).inc(obj.nbytes)
            loaded += 1
        return loaded

    # -- maintenance ----------------------------------------------------------------------------

    def _selected(self, tiers: Sequence[int] | None) -> list[_Tier]:
        if tiers is None:
            return list(self._tiers)
        for index in tiers:
            if not 0 <= index < len(self._tiers):
                raise ConfigError(
                    f"no tier {index}: this store has tiers 0 to {len(self._tiers) - 1}."
                )
        return [self._tiers[index] for index in tiers]

    async def remove(self, key: CacheKey, tiers: Sequence[int] | None = None) -> int:
        """Remove ``key`` from the given tiers (all by default); how many held it. Tiers that
        cannot delete are skipped."""
        self._ensure_open()
        removed = 0
        for tier in self._selected(tiers):
            if not tier.backend.capabilities.delete:
                continue
            ok, found = await self._call(tier, "remove", tier.backend.remove(key))
            removed += bool(ok and found)
        return removed

    async def clear(self, tiers: Sequence[int] | None = None) -> int:
        """Remove every key from the given tiers (all by default); needs ``list`` and
        ``delete`` on each. Returns how many objects were removed."""
        self._ensure_open()
        await self.flush()
        removed = 0
        for tier in self._selected(tiers):
            capabilities = tier.backend.capabilities
            if not (capabilities.list and capabilities.delete):
                raise NotSupported(
                    f"tier {tier.name} cannot be cleared: it does not declare both 'list' and "
                    "'delete'. Clear it with its own tools."
                )
            keys = [key async for key in tier.backend.list_keys()]
            for key in keys:
                removed += bool(await tier.backend.remove(key))
        return removed

    def health(self) -> list[TierHealth]:
        """Each tier's state, fastest first (copies)."""
        return [TierHealth(**vars(tier.health)) for tier in self._tiers]

    def stats(self) -> dict[str, dict[str, float]]:
        """Per tier: hits, misses, bytes read and written, errors, dropped puts, queue depth."""
        value = self.metrics.value
        result = {}
        for tier in self._tiers:
            name = tier.name
            errors = sum(
                value("kvplug_tier_errors_total", tier=name, op=op)
                for op in ("get", "put", "contains", "remove")
            )
            result[name] = {
                "hits": value("kvplug_tier_hits_total", tier=name),
                "misses": value("kvplug_tier_misses_total", tier=name),
                "bytes_read": value("kvplug_tier_read_bytes_total", tier=name),
                "bytes_written": value("kvplug_tier_written_bytes_total", tier=name),
                "errors": errors,
                "dropped_puts": value("kvplug_tier_dropped_puts_total", tier=name),
                "queue_depth": float(tier.queue.qsize()),
                "healthy": float(tier.health.healthy),
            }
        return result

    def prometheus_text(self) -> str:
        """Every metric in Prometheus' text exposition format."""
        return generate_latest(self.metrics.registry).decode()

    async def close(self, timeout: float = 30.0) -> None:
        """Finish queued puts (up to ``timeout`` seconds), then close every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(TimeoutError):
            await self.flush(timeout)
        for tier in self._tiers:
            if tier.worker is not None:
                tier.worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tier.worker
            while not tier.queue.empty():
                _, obj = tier.queue.get_nowait()
                obj.release()
                self._dropped(tier, f"the store closed before it was written ({timeout} s)")
        failures = await _close_each([(tier.name, tier.backend) for tier in self._tiers])
        if failures:
            raise BackendError(
                f"{len(failures)} of {len(self._tiers)} tiers failed to close (the others are "
                f"closed): {'; '.join(f'{n}: {type(e).__name__}: {e}' for n, e in failures)}. "
                "Their resources may stay in use until the process exits."
            ) from failures[0][1]

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


__all__ = ["AllocatingTier", "Store", "StoreMetrics", "TierHealth"]
