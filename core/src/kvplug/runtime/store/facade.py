"""The :class:`Store` itself: the backend operations of a tiered store, each composed of its
parts (the memory budget, tier health, the write-behind and its version ledger, the read and
write paths, promotion, stats), and how a Store is opened (:func:`open_store`,
:func:`store_url`, :class:`StoreOptions`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote

import torch
from pydantic import Field, field_validator

from kvplug.backend import Backend, BackendOptions, Capabilities
from kvplug.errors import (
    BackendClosed,
    BackendError,
    ConfigError,
    InvalidBackendURL,
    KvplugError,
    NotSupported,
)
from kvplug.keys import CacheKey
from kvplug.memory import Allocator, MemoryFormat, MemoryObj
from kvplug.registry import create_backend
from kvplug.runtime.config import Config, load_config
from kvplug.runtime.metrics import StoreMetrics
from kvplug.runtime.store.budget import (
    MemoryBudget,
    budget_among,
    default_budget,
    fixed_budget,
    serves_memory_tier,
)
from kvplug.runtime.store.health import TierGuard, TierHealth
from kvplug.runtime.store.parts import StoreParts
from kvplug.runtime.store.reads import Reads
from kvplug.runtime.store.stats import operation_stats, store_stats, wire_gauges
from kvplug.runtime.store.tier import Tier
from kvplug.runtime.store.write_behind import WRITE_BEHIND_SHARE, WriteBehind
from kvplug.runtime.store.writes import Writes
from kvplug.units import format_size, parse_size
from kvplug.url import BackendURL

logger = logging.getLogger("kvplug.store")


class StoreOptions(BackendOptions):
    """Options of a :class:`Store` (in a ``store://`` URL's query or as keywords). ``timeout``
    is how long a get waits for memory when the budget is full."""

    buffer_size: int | None = Field(
        None, description="the memory budget in bytes; overrides the config's buffer_size"
    )
    write_behind_size: int | None = Field(
        None, description="bytes waiting for lower tiers; overrides the config's"
    )
    write_behind_wait: float = Field(
        0.0,
        ge=0,
        description="seconds a put may wait for write-behind room before the lower tiers' "
        "writes are dropped (0: never waits)",
    )
    write_batch: int = Field(16, ge=1, description="most objects in one write to a lower tier")
    backoff: float = Field(1.0, gt=0, description="seconds a failing tier is first skipped")
    max_backoff: float = Field(30.0, gt=0, description="longest skip of a failing tier")
    promote: bool = Field(
        True,
        description="write a hit in a lower tier back into the faster tiers (off the read "
        "path for get_into)",
    )
    close_timeout: float = Field(
        5.0, ge=0, description="seconds close() waits for queued writes before dropping them"
    )

    @field_validator("buffer_size", "write_behind_size", mode="before")
    @classmethod
    def _parse_size(cls, value: object) -> int | None:
        if value is None:
            return None
        size = parse_size(value, what="a Store size option")
        if size <= 0:
            raise ConfigError(f"a Store size option must be positive, got {value!r}.")
        return size


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


def _store_capabilities(backends: Sequence[Backend]) -> Capabilities:
    """What a store over ``backends`` can honestly declare."""
    each = [backend.capabilities for backend in backends]
    return Capabilities(
        persistent=any(c.persistent for c in each),
        # Lower tiers are written behind: another process sees a put once the first tier has it.
        shared_across_processes=each[0].shared_across_processes,
        zero_copy=each[0].zero_copy,
        # One batched call per tier: batched end to end only where every tier batches.
        native_batching=all(c.native_batching for c in each),
        remove=all(c.remove for c in each),
        list_keys=all(c.list_keys for c in each),
        device_memory=any(c.device_memory for c in each),
        # A cancelled read or put is cancelled in the tier it was in, before anything is
        # queued; promotions read into the store's own memory.
        releases_on_cancel=all(c.releases_on_cancel for c in each),
    )


class Store(Backend):
    """Ordered tiers of backends behind the backend contract, with one memory budget and a
    write-behind queue bounded in bytes (see :mod:`kvplug.runtime.store` for the rules).

    Build it from a :class:`~kvplug.runtime.config.Config` with :func:`open_store`, by URL with
    ``kvplug.open_backend("store:///path/config.yaml")`` (``store://`` alone reads
    :func:`~kvplug.runtime.config.load_config`), or around backends you opened yourself with
    ``Store(tiers=[...])``. A store lives on the event loop that first uses it (it is
    :attr:`~kvplug.backend.Backend.loop_bound`): its backend operations called from another
    loop run there, while that loop runs; engine threads reach it through a
    :class:`~kvplug.runtime.sync.SyncClient`.
    """

    Options: ClassVar[type[BackendOptions]] = StoreOptions
    # The clauses the contract suite cannot run through a Store, and why: each tier is checked
    # on its own (a copy in an upper tier shadows damage planted in a lower one; the Store
    # has no size of its own to shrink).
    contract_waivers: ClassVar[dict[int, str]] = {
        6: "a Store serves a tier's copy; each tier's damage handling is checked on its own",
        9: "a Store fills as its tiers do; each tier's capacity handling is checked on its own",
    }
    options: StoreOptions
    loop_bound = True

    def __init__(
        self,
        url: BackendURL | str = "store://",
        *,
        tiers: Sequence[Backend] | None = None,
        config: Config | None = None,
        allocator: Allocator | None = None,
        on_latency: Callable[[str, str, float, int], None] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url, allocator=allocator, **options)
        if self.url.scheme != "store" or self.url.hosts or self.url.username:
            raise InvalidBackendURL(
                f"{self.url} is not a store URL: write store:///path/to/config.yaml, or store:// "
                "for the configuration kvplug.load_config() finds."
            )
        if tiers is not None and (config is not None or self.url.path):
            raise ConfigError("give a Store its tiers or a config (or a config path), not both.")
        self._config = config
        self._given_allocator = allocator
        self._tiers: list[Tier] = []
        """Filled when the store opens; every part below shares this list."""
        self.metrics = StoreMetrics(lambda: operation_stats(self._tiers))
        progress = asyncio.Event()
        self._memory = MemoryBudget()
        self._guard = TierGuard(
            self.metrics,
            progress,
            backoff=self.options.backoff,
            max_backoff=self.options.max_backoff,
            on_latency=on_latency,
        )
        self._write_behind = WriteBehind(
            self._tiers,
            self._guard,
            self.metrics,
            progress,
            batch=self.options.write_batch,
            wait=self.options.write_behind_wait,
            closed=lambda: self._closed,
        )
        self._ledger = self._write_behind.ledger
        parts = StoreParts(self._tiers, self._guard, self._write_behind, self._memory, self.metrics)
        self._reads = Reads(parts, timeout=self.options.timeout, promote=self.options.promote)
        self._writes = Writes(parts, wait=self.options.write_behind_wait)
        self.capabilities = Capabilities()
        if tiers is not None:
            backends = list(tiers)
            fixed = fixed_budget(allocator, self.options.buffer_size)
            self._setup(backends, budget_among(backends, fixed))

    # -- opening ------------------------------------------------------------------------------

    @staticmethod
    def config_of(url: BackendURL | str) -> Config:
        """The config a ``store://`` URL names: the YAML file of its path, or
        :func:`~kvplug.runtime.config.load_config` (environment and ``KVPLUG_CONFIG_FILE``) for
        ``store://`` alone."""
        path = BackendURL.parse(url).path
        return Config.from_yaml(Path(path)) if path else load_config()

    def _configured(self) -> Config:
        if self._config is None:
            self._config = self.config_of(self.url)
        return self._config

    def deadline(self) -> None:
        """None: every tier keeps its own deadline, and a put may wait for write-behind room
        (``write_behind_wait``)."""
        return None

    async def _open(self) -> None:
        """Open every configured tier with the one memory budget; a failure closes what was
        opened and raises."""
        if self._opened:
            return
        config = self._configured()
        made: dict[int, Backend] = {}
        try:
            size = self.options.buffer_size
            if size is None:
                size = config.buffer_size
            budget = fixed_budget(self._given_allocator, size)
            if budget is None:
                memory = [i for i, tier in enumerate(config.tiers) if serves_memory_tier(tier.url)]
                if memory:  # the budget is the cpu tier's own buffer (its max_size)
                    tier = config.tiers[memory[0]]
                    made[memory[0]] = create_backend(tier.url, **dict(tier.options))
                    budget = made[memory[0]].allocator
                else:
                    budget = default_budget()
            for index, tier in enumerate(config.tiers):
                if index not in made:
                    made[index] = create_backend(tier.url, allocator=budget, **dict(tier.options))
            backends = [made[index] for index in range(len(config.tiers))]
            for backend in backends:
                await backend.open()
        except BaseException:
            await _close_each([(str(backend.url), backend) for backend in made.values()])
            raise
        self._setup(backends, budget)

    def _setup(self, backends: list[Backend], budget: Allocator) -> None:
        if not backends:
            raise ConfigError("a Store needs at least one tier; configure tiers: [cpu://]")
        self._allocator = budget
        self._memory.attach(budget, backends)
        limit = self.options.write_behind_size
        if limit is None and self._config is not None:
            limit = self._config.write_behind_size
        capacity = budget.stats().capacity
        self._write_behind.limit = limit if limit is not None else capacity // WRITE_BEHIND_SHARE
        self._tiers.extend(
            Tier(i, name, backend, TierHealth(name), self.metrics.offered.labels(name))
            for i, backend in enumerate(backends)
            for name in [f"{i}:{backend.url}"]  # str(BackendURL) masks its secrets
        )
        wire_gauges(self.metrics, self._tiers, self._ledger, self.write_behind_limit, budget)
        self.capabilities = _store_capabilities(backends)
        self._opened = True

    # -- what it is made of -----------------------------------------------------------------------

    @property
    def tiers(self) -> list[Backend]:
        return [tier.backend for tier in self._tiers]

    @property
    def tier_names(self) -> list[str]:
        """``index:url`` of each tier (secrets masked), as metrics and stats label them."""
        return [tier.name for tier in self._tiers]

    @property
    def on_latency(self) -> Callable[[str, str, float, int], None] | None:
        """Called as ``(tier, op, seconds, nbytes)`` after each tier get and put (benchmarks)."""
        return self._guard.on_latency

    @on_latency.setter
    def on_latency(self, hook: Callable[[str, str, float, int], None] | None) -> None:
        self._guard.on_latency = hook

    @property
    def write_behind_limit(self) -> int:
        """Most bytes of objects that may wait for the lower tiers."""
        return self._write_behind.limit

    @property
    def write_behind_room(self) -> int:
        """Bytes the write-behind can still take before puts are dropped for the lower tiers
        (``write_behind_full``): an engine that prefers to hold back can look here first."""
        return self._write_behind.room

    @property
    def budget(self) -> Allocator:
        """The memory budget: every object the store hands out or reads lives here."""
        return self._memory.allocator

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = MemoryFormat.KV_2LTD
    ) -> MemoryObj | None:
        """An object to fill and put, in the memory budget: the cpu tier evicts entries only
        it references to make room. ``None`` when no room can be made (never blocks).
        Thread-safe, and callable from any thread (an engine's worker too), with or without an
        event loop."""
        self._ensure_open_store()
        return self._memory.allocate(shape, dtype, fmt)

    def _ensure_open_store(self) -> None:
        if self._closed:
            raise BackendClosed("this Store is closed; open a new one with open_store().")
        if not self._opened:
            raise KvplugError("this Store is not open yet; await store.open() first.")

    def _ensure_usable(self) -> None:
        self._ensure_open_store()
        loop = asyncio.get_running_loop()
        if self._home_loop is None:
            self._home_loop = loop
        elif loop is not self._home_loop:
            raise KvplugError(
                "this Store belongs to the event loop that first used it: its backend operations "
                "(get, put, contains, remove and their batched forms) work from any loop, but "
                "offer, flush, lookup, prefetch, clear and remove_from only from that one (or "
                "from threads through one kvplug.runtime.sync.SyncClient); allocate works anywhere."
            )

    # -- writes ---------------------------------------------------------------------------------

    async def offer(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> list[bool]:
        """Store each object in the first tier now and queue it for the lower tiers; whether
        each was accepted (stored or queued).

        Before a put is accepted, every tier that outlives this process (``persistent`` or
        ``shared_across_processes``) and does not take the new value now has its older value
        removed, so that no older value is served after a newer one was accepted, also after
        a crash. A put for which that cannot be done (such a tier is failing) is not accepted,
        though the tiers that took it keep it. Never waits for the lower tiers' writes. Puts
        that were not accepted are counted (``kvplug_store_rejected_puts``) with each tier's
        reason."""
        self._ensure_usable()
        return (await self._writes.offer(keys, objs))[0]

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        """Store ``obj`` (see :meth:`_batched_put`); the caller keeps its reference."""
        await self._batched_put([key], [obj])

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """Store the objects: in the first tier before this returns, in the lower tiers through
        the write-behind queue. Raises :class:`~kvplug.errors.CapacityExceeded` (or
        :class:`~kvplug.errors.BackendUnavailable` when a tier failed) naming the keys that were
        not accepted, with ``stored`` telling which were; those are stored."""
        self._ensure_usable()
        await self._writes.put(keys, objs)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write has reached its tier (or was dropped) and every
        removal of an older value has been made, except on tiers that are failing now."""
        await self._write_behind.flush(timeout)

    # -- reads ----------------------------------------------------------------------------------

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        """The bytes of ``key`` from the first tier that has it, read straight into ``dest``."""
        self._ensure_usable()
        return (await self._reads.read_into([key], [dest]))[0]

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        """The bytes of each key read straight into its destination: each tier is asked once,
        in order, for the keys the faster ones missed. A chunk a tier holds is never a miss
        for want of kvplug's own memory: none is used."""
        self._ensure_usable()
        return await self._reads.read_into(list(keys), list(dests))

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        """The object from the first tier that has it (the caller releases it); ``None`` when
        no tier has it, or when the memory budget had no room for it within ``timeout``."""
        self._ensure_usable()
        return (await self._reads.read([key]))[0]

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """The objects for ``keys`` (aligned with them): each tier is asked once, in order,
        for the keys the faster ones missed."""
        self._ensure_usable()
        return await self._reads.read(list(keys))

    async def _contains(self, key: CacheKey) -> bool:
        return (await self._batched_exists([key]))[0]

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is present in some tier (or waits in the write-behind): each tier
        is asked once, in order, for the keys the faster ones did not have, and the slower
        ones are not asked once every key is found."""
        self._ensure_usable()
        return await self._reads.exists(list(keys))

    async def lookup(self, keys: Sequence[CacheKey]) -> int:
        """The same as :meth:`batched_contains` (LMCache's name for it)."""
        return await self.batched_contains(keys)

    async def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """Load the leading present ``keys`` into the first tier, stopping at the first key no
        tier has; how many of them the first tier now holds."""
        self._ensure_usable()
        present = await self.batched_contains(keys)
        objs = await self._reads.read(list(keys[:present]), write_back_now=True)
        loaded = next((n for n, obj in enumerate(objs) if obj is None), len(objs))
        for obj in objs:
            if obj is not None:
                obj.release()
        return loaded

    def _list_keys(self) -> AsyncIterator[CacheKey]:
        """Every key stored in some tier or waiting to be written, each once."""
        self._ensure_usable()
        return self._reads.list_keys()

    # -- maintenance ----------------------------------------------------------------------------

    def _selected(self, tiers: Sequence[int] | None) -> list[Tier]:
        if tiers is None:
            return list(self._tiers)
        for index in tiers:
            if not 0 <= index < len(self._tiers):
                raise ConfigError(
                    f"no tier {index}: this store has tiers 0 to {len(self._tiers) - 1}."
                )
        return [self._tiers[index] for index in tiers]

    async def _remove(self, key: CacheKey) -> bool:
        return await self.remove_from(key)

    async def remove_from(self, key: CacheKey, tiers: Sequence[int] | None = None) -> bool:
        """Remove ``key`` from the given tiers (all by default: :meth:`remove`) and from the
        write-behind; whether any held it. A tier that cannot be reached now removes it once
        it is back."""
        self._ensure_usable()
        selected = self._selected(tiers)
        if not all(tier.backend.capabilities.remove for tier in selected):
            raise NotSupported(
                "these tiers cannot remove keys: "
                + ", ".join(t.name for t in selected if not t.backend.capabilities.remove)
            )
        return await self._writes.remove(key, selected, everywhere=tiers is None)

    async def clear(self, tiers: Sequence[int] | None = None) -> int:
        """Remove every key from the given tiers (all by default); needs ``list_keys`` and
        ``remove`` on each. Returns how many objects were removed."""
        self._ensure_usable()
        await self.flush()
        removed = 0
        for tier in self._selected(tiers):
            capabilities = tier.backend.capabilities
            if not (capabilities.list_keys and capabilities.remove):
                raise NotSupported(
                    f"tier {tier.name} cannot be cleared: it does not declare both 'list_keys' "
                    "and 'remove'. Clear it with its own tools."
                )
            keys = [key async for key in tier.backend.list_keys()]
            for key in keys:
                removed += bool(await tier.backend.remove(key))
        return removed

    # -- reporting ------------------------------------------------------------------------------

    def health(self) -> list[TierHealth]:
        """Each tier's state, fastest first (copies)."""
        return [dataclasses.replace(tier.health) for tier in self._tiers]

    def stats(self) -> dict[str, Any]:
        """Counters of the store: per tier, what its operations did (from its own
        :meth:`~kvplug.backend.Backend.operation_stats`, summed by :func:`~kvplug.stats.summarize`:
        ``reads``, ``hits``, ``misses``, ``hit_rate``, ``bytes_read``, ``writes``,
        ``bytes_written``, ``lookups``, ``errors`` and ``errors_by_op``) and what the Store did
        with it (puts offered and dropped by reason, keys queued, health); the write-behind
        (bytes and keys queued, limit), the memory budget (capacity, used, shortages) and
        misses by reason."""
        return store_stats(
            self.metrics, self._tiers, self._ledger, self.write_behind_limit, self.budget
        )

    def prometheus_text(self) -> str:
        """Every metric in Prometheus' text exposition format (needs ``kvplug[metrics]``)."""
        return self.metrics.exposition()

    def describe(self) -> dict[str, str]:
        return {
            "tiers": ", ".join(self.tier_names),
            "memory budget": format_size(self.budget.stats().capacity),
            "write-behind limit": format_size(self.write_behind_limit),
        }

    async def _close(self) -> None:
        """Finish queued writes (up to ``close_timeout`` seconds; what is left is counted as
        dropped), stop promotions, then close every tier."""
        await self._reads.promotion.stop()
        await self._write_behind.stop(self.options.close_timeout)
        self._memory.detach()
        failures = await _close_each([(tier.name, tier.backend) for tier in self._tiers])
        self._ledger.clear()  # from operations still in flight during close
        if failures:
            raise BackendError(
                f"{len(failures)} of {len(self._tiers)} tiers failed to close (the others are "
                f"closed): {'; '.join(f'{n}: {type(e).__name__}: {e}' for n, e in failures)}. "
                "Their resources may stay in use until the process exits."
            ) from failures[0][1]


def store_url(config_file: str | os.PathLike[str]) -> str:
    """The ``store://`` URL of a Store over the tiers YAML ``config_file``: its absolute path,
    percent-encoded, so any file name makes a valid URL.

    Example::

        >>> store_url("/etc/kv cache/tiers.yaml")
        'store:///etc/kv%20cache/tiers.yaml'
    """
    return f"store://{quote(str(Path(config_file).resolve()))}"


async def open_store(
    config: Config | str | os.PathLike[str] | None = None,
    *,
    allocator: Allocator | None = None,
    **options: Any,
) -> Store:
    """Open a :class:`Store` over a config (a :class:`~kvplug.runtime.config.Config`, a YAML file,
    or :func:`~kvplug.runtime.config.load_config` when None). ``allocator`` replaces the memory
    budget; ``options`` are :class:`StoreOptions`."""
    if config is None or isinstance(config, Config):
        store = Store(config=config, allocator=allocator, **options)
    else:
        store = Store(store_url(config), allocator=allocator, **options)
    await store.open()
    return store
