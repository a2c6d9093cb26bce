"""The tiered store: what an engine talks to, and itself a :class:`~kvplug.backend.Backend`.

A :class:`Store` holds an ordered list of backends, the tiers (fastest first, as in the
``tiers:`` config), and one host-memory budget. It is a backend like any other: it can be
opened by URL (``store:///etc/kvplug.yaml``), wrapped (``audit::store:///etc/kvplug.yaml``),
checked with ``kvplug contract --config FILE`` and driven by a ``SyncClient``.

**Batched per tier.** ``batched_get`` asks each tier once for the keys still missing, in lookup
order; ``batched_put`` hands the first tier one batched call and every lower tier batched calls
from its write-behind queue; ``batched_exists`` says which keys some tier has (each tier asked
once, for the keys the faster ones lacked) and ``batched_contains`` counts the leading ones.
A hit in a lower tier is written back into the faster tiers, batched too, and off the read
path except into host-memory tiers. ``get_into``/``batched_get_into`` read each tier straight
into the caller's memory, with no budget in between, and promote lower-tier hits in the
background, bounded in bytes.

**One memory budget.** Every object the store hands out or reads lives in one allocator, fixed
at open: the ``allocator`` given, else a buffer of the config's ``buffer_size``, else the cpu
tier's own buffer (its ``max_size``), else 2 GiB. Every tier's ``get`` reads into it. When it is
full, the cpu tier evicts entries that nobody but itself references (never one being read);
a get that still finds no room waits for memory up to its deadline (``timeout``) and then
reports a miss counted as ``memory_short``.

**Write-behind in bytes.** A put stores the object in the first tier before it returns and
queues it for the lower tiers while the objects waiting hold at most ``write_behind_size``
bytes (a quarter of the budget by default; an empty write-behind takes any object). A put is
*accepted* when the first tier took it or it was queued, and every tier that outlives this
process and does not hold the new value yet had its older value removed first; a lower tier
that cannot take it is counted as a dropped put with its reason and has the key's older value
removed, so an older value is never served after a newer one was accepted, not even after a
crash. A put not accepted raises at once, its ``stored`` telling which keys were
(:meth:`Store.offer` says it per key instead). A tier that drops every put it is offered is
warned about, with what to change.

A tier that fails is isolated: its error is counted, the other tiers keep serving, and it is
tried again after an exponential back-off; :meth:`Store.health` tells its state.
:meth:`Store.stats` and :meth:`Store.prometheus_text` show per-tier counters and latency, the
queued bytes, dropped puts by reason and misses by reason.

Example::

    >>> import asyncio, torch
    >>> from kvplug.runtime.config import Config
    >>> from kvplug.keys import CacheKey
    >>> from kvplug.runtime.store import open_store
    >>> async def main():
    ...     store = await open_store(Config.from_dict({"tiers": ["cpu://?max_size=64MiB"]}))
    ...     key = CacheKey("llama", 1, 0, 7)
    ...     obj = store.allocate((2, 4, 16, 64), torch.float16)
    ...     obj.tensor.fill_(2.0)
    ...     await store.put(key, obj)
    ...     obj.release()
    ...     hit = await store.get(key)
    ...     total = hit.tensor.sum().item()
    ...     hit.release()
    ...     found = await store.batched_contains([key, key.with_hash(8)])
    ...     await store.close()
    ...     return total, found
    >>> asyncio.run(main())
    (16384.0, 1)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable
from urllib.parse import quote

import torch
from pydantic import Field, field_validator

from kvplug.backend import Backend, BackendOptions, Capabilities, fill_into
from kvplug.errors import (
    BackendClosed,
    BackendError,
    BackendUnavailable,
    CapacityExceeded,
    ConfigError,
    InvalidBackendURL,
    KvplugError,
    NotSupported,
    UnexpectedBackendError,
)
from kvplug.keys import CacheKey
from kvplug.memory import Allocator, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.registry import backend_class, create_backend
from kvplug.runtime.config import Config, load_config
from kvplug.runtime.metrics import StoreMetrics
from kvplug.secrets import mask_text
from kvplug.stats import OperationStats, summarize
from kvplug.units import GiB, format_size, parse_size
from kvplug.url import BackendURL, split_chain

T = TypeVar("T")
logger = logging.getLogger("kvplug.store")

DEFAULT_BUFFER_SIZE = 2 * GiB
WRITE_BEHIND_SHARE = 4
"""Without ``write_behind_size``, objects waiting for lower tiers hold at most 1/4 of the
budget."""
MAX_STALE_REMOVALS = 100_000
"""Removals of older values a tier may have queued (see :class:`Store`); beyond them a skipped
overwrite is counted as ``untracked``."""
DROP_REASONS = (
    "write_behind_full",
    "tier_failing",
    "full",
    "tier_error",
    "closed",
    "untracked",
)
"""Why a put did not reach a tier: the write-behind queue had no room; the tier was skipped
after failing; the tier was full (``CapacityExceeded``); the tier failed on this put; the store
closed before it was written; too many removals were queued to track the older value."""
STARVED_AFTER = 4
"""Puts in a row a tier must drop (for a reason other than a busy write-behind) with none
written in between before the store warns that the tier receives nothing."""
ADVICE = {
    "write_behind_full": "raise the store's write_behind_size or write_behind_wait",
    "tier_failing": "bring the tier back (its last error is in Store.health())",
    "full": "raise the tier's max_size (or free its space): the objects do not fit in it",
    "tier_error": "check the tier: its puts fail (the error is in Store.health())",
    "untracked": "let the tier catch up with its queued removals",
    "closed": "do not close the store while it is used",
}
"""What to change when a tier drops puts, by drop reason."""
MISS_REASONS = ("absent", "memory_short")
"""Why a get missed: no tier had the key; the memory budget had no room within the deadline."""


@runtime_checkable
class MemoryTier(Protocol):
    """A tier that holds objects in the budget's memory and can make room in it (``cpu://``):
    the store allocates through it, and installs :meth:`reclaim` as the budget's reclaimer."""

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = ...
    ) -> MemoryObj | None: ...

    def reclaim(self, nbytes: int) -> int: ...

    @property
    def allocator(self) -> Allocator: ...


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


@dataclass
class TierHealth:
    """A tier's state: healthy, or failing and skipped until ``retry_at`` (monotonic time)."""

    name: str
    healthy: bool = True
    consecutive_errors: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    last_dropped: str | None = None
    """Why the last put that did not reach this tier was dropped."""


@dataclass
class _Tier:
    index: int
    name: str
    backend: Backend
    health: TierHealth
    offered: Any
    """The Store's count of puts routed to this tier (its labelled series, looked up once: a
    label lookup costs about a microsecond, the cpu tier's whole batched get a few)."""
    waiting: deque[CacheKey] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    worker: asyncio.Task[None] | None = None
    removals: int = 0
    """Keys queued here for removal of an older value."""
    drop_streak: int = 0
    """Puts dropped in a row with none written (busy write-behind drops not counted)."""
    starved: bool = False
    """The streak reached :data:`STARVED_AFTER` and was warned about."""


@dataclass
class _Pending:
    """What the write-behind still has to do for one key."""

    obj: MemoryObj | None
    """The newest accepted value (one reference held), or None once the key was removed."""
    writes: set[int] = field(default_factory=set)
    """Tiers that have to store ``obj``."""
    removals: set[int] = field(default_factory=set)
    """Tiers whose value of the key is older than the newest accepted one: removed there."""
    busy: set[int] = field(default_factory=set)
    """Tiers with an operation on this key in flight."""

    def queued(self, tier: int) -> bool:
        return tier in self.writes or tier in self.removals


def stored_keys(error: BaseException, count: int) -> list[bool] | None:
    """Which of the ``count`` keys of a failed batched put were stored, when the error says
    (:attr:`~kvplug.errors.BackendError.stored`); None when that is unknown."""
    stored = error.stored if isinstance(error, BackendError) else None
    if stored is None or len(stored) != count:
        return None
    return list(stored)


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


def layers(backend: Backend) -> list[Backend]:
    """``backend`` and the backends it wraps (``audit::...``), outermost first."""
    chain = [backend]
    while isinstance(inner := getattr(chain[-1], "inner", None), Backend):
        chain.append(inner)
    return chain


def tiers_of(backend: Backend) -> list[Backend]:
    """The backends that hold the bytes, seen through wrappers: each tier of the
    :class:`Store` that ``backend`` is or wraps, else ``backend``, each as the innermost
    backend it wraps.

    Example::

        >>> import asyncio, kvplug
        >>> async def demo() -> list[list[str]]:
        ...     audited = await kvplug.open_backend("audit::blackhole://")
        ...     store = Store(tiers=[await kvplug.open_backend("cpu://?max_size=8MiB"), audited])
        ...     schemes = [[tier.url.scheme for tier in tiers_of(b)] for b in (store, audited)]
        ...     await store.close()
        ...     return schemes
        >>> asyncio.run(demo())
        [['cpu', 'blackhole'], ['blackhole']]
    """
    store = store_of(backend)
    return [layers(tier)[-1] for tier in (store.tiers if store is not None else [backend])]


def store_of(backend: Backend) -> Store | None:
    """The :class:`Store` that ``backend`` is or wraps (``audit::store://...``), or None."""
    return next((layer for layer in layers(backend) if isinstance(layer, Store)), None)


def _memory_tier(backend: Backend) -> MemoryTier | None:
    return next((layer for layer in layers(backend) if isinstance(layer, MemoryTier)), None)


def _serves_memory_tier(url: str) -> bool:
    """Whether ``url`` (possibly a wrapper chain) opens a :class:`MemoryTier`."""
    cls = backend_class(split_chain(url)[-1])
    return callable(getattr(cls, "allocate", None)) and callable(getattr(cls, "reclaim", None))


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
    write-behind queue bounded in bytes (see the module documentation for the rules).

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
        self.on_latency = on_latency
        """Called as ``(tier, op, seconds, nbytes)`` after each tier get and put (benchmarks)."""
        self.metrics = StoreMetrics(self._tier_stats)
        self._config = config
        self._given_allocator = allocator
        self._tiers: list[_Tier] = []
        self._memory: MemoryTier | None = None
        self._budget: Allocator | None = None
        self._previous_reclaimer: Any = None
        self.write_behind_limit = 0
        """Most bytes of objects that may wait for the lower tiers."""
        self._pending: dict[CacheKey, _Pending] = {}
        self._pending_bytes = 0
        self._progress = asyncio.Event()
        """Set whenever the write-behind may have become flushed (see :meth:`flush`)."""
        self._room_freed = asyncio.Event()
        self._opened = False
        self._largest_object = 0
        self._writes = 0
        self._written_at: dict[CacheKey, int] = {}
        self._reads: Tally[int] = Tally()
        self._writing: Tally[CacheKey] = Tally()
        self._untracked_warned = False
        self._promoting_bytes = 0
        self._background: set[asyncio.Task[None]] = set()
        """Promotions in flight."""
        self.capabilities = Capabilities()
        if tiers is not None:
            self._setup(list(tiers), self._budget_for(list(tiers)))

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

    def _fixed_budget(self, config: Config | None) -> Allocator | None:
        """The budget when it does not come from a cpu tier: the allocator given, or a buffer
        of ``buffer_size`` (the option, else the config's)."""
        if self._given_allocator is not None:
            return self._given_allocator
        size = self.options.buffer_size
        if size is None and config is not None:
            size = config.buffer_size
        if size is None:
            return None
        return FreeListAllocator(size, sized_by="buffer_size (the Store's memory budget)")

    @staticmethod
    def _default_budget() -> Allocator:
        return FreeListAllocator(
            DEFAULT_BUFFER_SIZE,
            sized_by="the Store's memory budget (set buffer_size in the config)",
        )

    def _budget_for(self, backends: Sequence[Backend]) -> Allocator:
        budget = self._fixed_budget(None)
        if budget is not None:
            return budget
        return (
            next((b.allocator for b in backends if _memory_tier(b) is not None), None)
            or self._default_budget()
        )

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
            budget = self._fixed_budget(config)
            if budget is None:
                memory = [i for i, tier in enumerate(config.tiers) if _serves_memory_tier(tier.url)]
                if memory:  # the budget is the cpu tier's own buffer (its max_size)
                    tier = config.tiers[memory[0]]
                    made[memory[0]] = create_backend(tier.url, **dict(tier.options))
                    budget = made[memory[0]].allocator
                else:
                    budget = self._default_budget()
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
        self._budget = budget
        self._allocator = budget
        self._memory = next((m for b in backends if (m := _memory_tier(b)) is not None), None)
        if self._memory is not None and self._memory.allocator is not budget:
            self._memory = None  # its evictions would free nothing in the budget
        if self._memory is not None and isinstance(budget, FreeListAllocator):
            self._previous_reclaimer = budget.set_reclaimer(self._memory.reclaim)
        capacity = budget.stats().capacity
        limit = self.options.write_behind_size
        if limit is None and self._config is not None:
            limit = self._config.write_behind_size
        self.write_behind_limit = limit if limit is not None else capacity // WRITE_BEHIND_SHARE
        self._tiers = [
            _Tier(i, name, backend, TierHealth(name), self.metrics.offered.labels(name))
            for i, backend in enumerate(backends)
            for name in [f"{i}:{backend.url}"]  # str(BackendURL) masks its secrets
        ]
        for tier in self._tiers:
            self.metrics.healthy.labels(tier.name).set(1)
        self.metrics.write_behind_limit.set(self.write_behind_limit)
        self.metrics.write_behind_bytes.set_function(lambda: self._pending_bytes)
        self.metrics.memory_budget.set(capacity)
        self.metrics.memory_used.set_function(lambda: budget.stats().used)
        self.capabilities = _store_capabilities(backends)
        self._opened = True

    # -- helpers --------------------------------------------------------------------------------

    @property
    def tiers(self) -> list[Backend]:
        return [tier.backend for tier in self._tiers]

    @property
    def tier_names(self) -> list[str]:
        """``index:url`` of each tier (secrets masked), as metrics and stats label them."""
        return [tier.name for tier in self._tiers]

    @property
    def write_behind_room(self) -> int:
        """Bytes the write-behind can still take before puts are dropped for the lower tiers
        (``write_behind_full``): an engine that prefers to hold back can look here first."""
        return max(0, self.write_behind_limit - self._pending_bytes)

    @property
    def budget(self) -> Allocator:
        """The memory budget: every object the store hands out or reads lives here."""
        if self._budget is None:
            raise KvplugError("this Store is not open yet; await store.open() first.")
        return self._budget

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = MemoryFormat.KV_2LTD
    ) -> MemoryObj | None:
        """An object to fill and put, in the memory budget: the cpu tier evicts entries only
        it references to make room. ``None`` when no room can be made (never blocks).
        Thread-safe, and callable from any thread (an engine's worker too), with or without an
        event loop."""
        self._ensure_open_store()
        if self._memory is not None:
            return self._memory.allocate(shape, dtype, fmt)
        return self.budget.allocate(shape, dtype, fmt)

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
        delay = min(
            self.options.max_backoff, self.options.backoff * 2 ** (health.consecutive_errors - 1)
        )
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
        self._progress.set()
        self.metrics.healthy.labels(tier.name).set(0)

    async def _call(
        self, tier: _Tier, op: str, operation: Awaitable[T], nbytes: int = 0
    ) -> tuple[bool, T | None]:
        """Run one tier operation with timing and failure isolation: ``(ok, result)``."""
        start = time.perf_counter()
        try:
            result = await operation
        except (BackendClosed, NotSupported, CapacityExceeded, UnexpectedBackendError):
            raise  # the caller's or the data's problem, or a bug: not a failing tier
        except (BackendError, OSError) as error:
            self._failed(tier, op, error)
            return False, None
        self._succeeded(tier)
        if self.on_latency is not None:
            self.on_latency(tier.name, op, time.perf_counter() - start, nbytes)
        return True, result

    def _note_write(self, key: CacheKey) -> None:
        """Remember that ``key`` changed, for reads in flight (their write-back must not put an
        older value over it)."""
        self._writes += 1
        if self._reads:
            self._written_at[key] = self._writes

    def _begin_read(self) -> int:
        self._reads[self._writes] += 1
        return self._writes

    def _end_read(self, started: int) -> None:
        self._reads[started] -= 1
        if not self._reads[started]:
            del self._reads[started]
        if not self._reads:
            self._written_at.clear()
        elif len(self._written_at) > 4096:
            oldest = min(self._reads)
            self._written_at = {k: s for k, s in self._written_at.items() if s > oldest}

    def _changed_since(self, key: CacheKey, started: int) -> bool:
        """Whether a put or remove of ``key`` began after ``started`` or is under way."""
        return key in self._writing or self._written_at.get(key, -1) > started

    @contextlib.contextmanager
    def _changing(self, keys: Sequence[CacheKey]) -> Iterator[None]:
        """Mark ``keys`` as being put or removed, before and after (see :meth:`_changed_since`)."""
        for key in keys:
            self._note_write(key)
            self._writing[key] += 1
        try:
            yield
        finally:
            for key in keys:
                self._writing[key] -= 1
                if not self._writing[key]:
                    del self._writing[key]
                self._note_write(key)  # reads that began meanwhile must not undo it

    # -- the write-behind -----------------------------------------------------------------------

    def _dropped(self, tier: _Tier, reason: str, detail: str, count: int = 1) -> None:
        tier.health.last_dropped = mask_text(f"{reason}: {detail}")
        self.metrics.dropped.labels(tier.name, reason).inc(count)
        if reason in ("write_behind_full", "closed"):
            return  # shedding load while the tier writes, or shutting down: not starvation
        tier.drop_streak += count
        if tier.drop_streak >= STARVED_AFTER and not tier.starved:
            tier.starved = True
            logger.warning(
                "tier %s took none of the last %d puts it was offered (%s); a tier that "
                "receives nothing serves nothing. To fix it: %s.",
                tier.name,
                tier.drop_streak,
                tier.health.last_dropped,
                ADVICE[reason],
            )

    def _wrote(self, tier: _Tier) -> None:
        """A put reached ``tier``: end a streak of drops."""
        tier.drop_streak = 0
        if tier.starved:
            tier.starved = False
            logger.info("tier %s receives puts again", tier.name)

    def _enqueue(self, tier: _Tier, key: CacheKey) -> None:
        if self._closed:
            return  # an operation that was in flight when the store closed
        tier.waiting.append(key)
        tier.wake.set()
        self.metrics.queue_depth.labels(tier.name).set(len(tier.waiting))
        if tier.worker is None or tier.worker.done():
            tier.worker = asyncio.get_running_loop().create_task(self._drain(tier))

    def _queue_removal(self, entry: _Pending, tier: _Tier, key: CacheKey) -> None:
        """Have ``tier`` drop its (older) value of ``key``; readers skip it there meanwhile."""
        queued = entry.queued(tier.index)
        entry.writes.discard(tier.index)
        if tier.index in entry.removals:
            return
        if tier.removals >= MAX_STALE_REMOVALS:
            self._dropped(tier, "untracked", f"{MAX_STALE_REMOVALS} removals already queued")
            if not self._untracked_warned:
                self._untracked_warned = True
                logger.warning(
                    "tier %s has %d removals of older values queued; further skipped overwrites "
                    "are not tracked, so it may return an older value of such a key",
                    tier.name,
                    MAX_STALE_REMOVALS,
                )
            return
        entry.removals.add(tier.index)
        tier.removals += 1
        if not queued:
            self._enqueue(tier, key)

    def _entry(self, key: CacheKey) -> _Pending:
        entry = self._pending.get(key)
        if entry is None:
            entry = self._pending[key] = _Pending(None)
        return entry

    def _set_value(self, entry: _Pending, obj: MemoryObj | None) -> None:
        old = entry.obj
        entry.obj = obj.retain() if obj is not None else None
        self._pending_bytes += (obj.phy_size if obj is not None else 0) - (
            old.phy_size if old is not None else 0
        )
        if old is not None:
            old.release()
            self._room_freed.set()

    def _admit(
        self, key: CacheKey, obj: MemoryObj, targets: Sequence[_Tier], *, newer: bool = True
    ) -> bool:
        """Queue ``obj`` for ``targets``: True when queued for at least one of them. When
        ``obj`` is ``newer`` than what the tiers may hold (a put, not a write-back), tiers it
        cannot be queued for drop their older value of the key."""
        if not targets or self._closed:
            return False
        entry = self._pending.get(key)
        if entry is not None and not newer:
            return False  # a put or remove of the key is under way: it wins
        if newer:
            for tier in targets:
                tier.offered.inc()
        held = entry.obj.phy_size if entry is not None and entry.obj is not None else 0
        others = self._pending_bytes - held
        # An empty write-behind takes one object of any size: a limit below the chunk size
        # would otherwise starve every lower tier.
        room = others == 0 or others + obj.phy_size <= self.write_behind_limit
        usable = [t for t in targets if self._available(t)]
        if not (room and usable) and not newer:
            return False
        if room and usable:
            entry = self._entry(key)
            self._set_value(entry, obj)
        elif entry is not None:
            # An older value queued must be neither served nor written.
            self._set_value(entry, None)
            entry.writes.clear()
        for tier in targets:
            if room and tier in usable:
                assert entry is not None
                queued = entry.queued(tier.index)
                if tier.index in entry.removals:
                    entry.removals.discard(tier.index)
                    tier.removals -= 1
                entry.writes.add(tier.index)
                if not queued:
                    self._enqueue(tier, key)
                continue
            reason = "write_behind_full" if tier in usable else "tier_failing"
            detail = (
                f"{format_size(self._pending_bytes)} of {format_size(self.write_behind_limit)} "
                "waiting"
                if reason == "write_behind_full"
                else f"skipped after failing ({tier.health.last_error})"
            )
            self._dropped(tier, reason, detail)
            self._queue_removal(self._entry(key), tier, key)
        self._settle(key)
        return room and bool(usable)

    def _settle(self, key: CacheKey) -> None:
        """Let go of ``key``'s value once no write needs it (removals may wait long for a
        failing tier), and of the entry once nothing is queued or in flight for it."""
        entry = self._pending.get(key)
        if entry is None or entry.writes or entry.busy:
            return
        self._set_value(entry, None)
        if not entry.removals:
            del self._pending[key]
        self._progress.set()

    def _take(self, tier: _Tier) -> tuple[list[tuple[CacheKey, MemoryObj]], list[CacheKey]]:
        """The next batch for ``tier``: objects to write and keys to remove."""
        writes: list[tuple[CacheKey, MemoryObj]] = []
        removals: list[CacheKey] = []
        while tier.waiting and len(writes) + len(removals) < self.options.write_batch:
            key = tier.waiting.popleft()
            entry = self._pending.get(key)
            if entry is None:
                continue
            if tier.index in entry.removals:
                entry.removals.discard(tier.index)
                tier.removals -= 1
                removals.append(key)
            elif tier.index in entry.writes and entry.obj is not None:
                entry.writes.discard(tier.index)
                writes.append((key, entry.obj.retain()))
            else:
                continue
            entry.busy.add(tier.index)
        self.metrics.queue_depth.labels(tier.name).set(len(tier.waiting))
        return writes, removals

    async def _drain(self, tier: _Tier) -> None:
        while True:
            if not tier.waiting:
                tier.wake.clear()
                await tier.wake.wait()
                continue
            if not self._available(tier):
                self._drop_writes(tier, "tier_failing", f"skipped ({tier.health.last_error})")
                if tier.waiting:  # removals wait for the tier to come back
                    await asyncio.sleep(max(0.001, tier.health.retry_at - time.monotonic()))
                continue
            writes, removals = self._take(tier)
            try:
                if writes:
                    await self._write(tier, writes)
                if removals:
                    await self._remove_older(tier, removals)
            finally:
                for _, obj in writes:
                    obj.release()
                for key in [k for k, _ in writes] + removals:
                    entry = self._pending.get(key)
                    if entry is not None:
                        entry.busy.discard(tier.index)
                    self._settle(key)
                self._progress.set()

    def _drop_writes(self, tier: _Tier, reason: str, detail: str) -> None:
        """Drop every write queued for ``tier``, each replaced by a removal of the older
        value."""
        for key in list(tier.waiting):
            entry = self._pending.get(key)
            if entry is not None and tier.index in entry.writes and tier.index not in entry.busy:
                self._dropped(tier, reason, detail)
                self._queue_removal(entry, tier, key)
        tier.waiting = deque(k for k in tier.waiting if self._queued_here(k, tier))
        for key in list(self._pending):
            self._settle(key)
        self.metrics.queue_depth.labels(tier.name).set(len(tier.waiting))
        self._progress.set()

    def _queued_here(self, key: CacheKey, tier: _Tier) -> bool:
        entry = self._pending.get(key)
        return entry is not None and entry.queued(tier.index)

    async def _write(self, tier: _Tier, writes: list[tuple[CacheKey, MemoryObj]]) -> None:
        keys = [key for key, _ in writes]
        objs = [obj for _, obj in writes]
        nbytes = sum(obj.nbytes for obj in objs)
        stored = None
        try:
            ok, _ = await self._call(tier, "put", tier.backend.batched_put(keys, objs), nbytes)
        except CapacityExceeded as error:
            ok, reason, detail = False, "full", f"CapacityExceeded: {error}"
            stored = stored_keys(error, len(keys))
        except BackendClosed as error:
            ok, reason, detail = False, "closed", f"BackendClosed: {error}"
        except Exception as error:
            # A bug in the tier, not a storage failure: nobody awaits this put to see it, so it
            # is logged in full and counted; the worker keeps draining the queue.
            logger.exception("tier %s raised an unexpected error on a queued put", tier.name)
            ok, reason, detail = False, "tier_error", f"{type(error).__name__}: {error}"
        else:
            reason, detail = "tier_error", f"{tier.health.last_error}"
        if ok:
            self._wrote(tier)
            return
        if stored is not None:  # the tier says which it kept: only the others are dropped
            if any(stored):
                self._wrote(tier)
            keys = [key for key, done in zip(keys, stored, strict=True) if not done]
        # Which of these the tier kept is unknown: each is removed again, so that no older
        # value outlives the newer one accepted elsewhere.
        self._dropped(tier, reason, detail, len(keys))
        for key in keys:
            self._queue_removal(self._entry(key), tier, key)

    async def _remove_older(self, tier: _Tier, keys: list[CacheKey]) -> None:
        if not tier.backend.capabilities.remove:
            return
        results = await asyncio.gather(
            *(self._call(tier, "remove", tier.backend.remove(key)) for key in keys),
            return_exceptions=True,
        )
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, BaseException):
                # Closed, or a bug in the tier: retrying cannot help. Counted, like a drop.
                reason = "closed" if isinstance(result, BackendClosed) else "tier_error"
                self._dropped(tier, reason, f"removing an older value: {result!r}")
            elif not result[0]:
                self._queue_removal(self._entry(key), tier, key)  # again after the back-off

    # -- writes ---------------------------------------------------------------------------------

    async def _put_first(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> list[bool]:
        """Store in the first tier now; which keys it took."""
        first = self._tiers[0]
        first.offered.inc(len(keys))
        if not self._available(first):
            self._dropped(first, "tier_failing", f"skipped ({first.health.last_error})", len(keys))
            return [False] * len(keys)
        return await self._put_in(first, keys, objs)

    async def _put_in(
        self, tier: _Tier, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]
    ) -> list[bool]:
        nbytes = sum(obj.nbytes for obj in objs)
        try:
            ok, _ = await self._call(tier, "put", tier.backend.batched_put(keys, objs), nbytes)
        except CapacityExceeded as error:
            stored = stored_keys(error, len(keys))
            if stored is None and len(keys) > 1:
                # Which keys fitted is unknown: each is offered once more on its own.
                return [
                    all(await self._put_in(tier, [k], [o])) for k, o in zip(keys, objs, strict=True)
                ]
            stored = stored or [False]
            self._dropped(tier, "full", f"CapacityExceeded: {error}", stored.count(False))
            if any(stored):
                self._wrote(tier)
            return stored
        if not ok:
            self._dropped(tier, "tier_error", f"{tier.health.last_error}", len(keys))
            return [False] * len(keys)
        self._wrote(tier)
        return [True] * len(keys)

    @staticmethod
    def _outlives_process(tier: _Tier) -> bool:
        """Whether ``tier`` keeps what it holds when this process dies (and can remove it)."""
        capabilities = tier.backend.capabilities
        return capabilities.remove and (
            capabilities.persistent or capabilities.shared_across_processes
        )

    async def _invalidate(self, keys: Sequence[CacheKey], tiers: Sequence[_Tier]) -> dict[int, str]:
        """Remove each key's value from each of ``tiers`` that outlives this process, now:
        once a newer value is accepted, no older one may survive there, not even a crash of
        this process before the write-behind got to it. Why it failed, by key index."""
        tiers = [tier for tier in tiers if self._outlives_process(tier)]
        failed: dict[int, str] = {}
        if not tiers:
            return failed

        async def invalidate(tier: _Tier, index: int, key: CacheKey) -> None:
            entry = self._pending.get(key)
            if entry is not None and tier.index in entry.writes:
                entry.writes.discard(tier.index)  # the older value queued is never written
                self._settle(key)
            await self._until_idle(key, tier)  # an older value being written lands first
            if not self._available(tier):
                failed[index] = f"{tier.name} is failing ({tier.health.last_error})"
                return
            ok, _ = await self._call(tier, "remove", tier.backend.remove(key))
            if not ok:
                failed[index] = f"{tier.name}: {tier.health.last_error}"

        await asyncio.gather(
            *(invalidate(tier, index, key) for tier in tiers for index, key in enumerate(keys))
        )
        return failed

    async def _until_idle(self, key: CacheKey, tier: _Tier) -> None:
        """Wait until no write or removal of ``key`` is in flight on ``tier``."""
        while True:
            entry = self._pending.get(key)
            if entry is None or tier.index not in entry.busy:
                return
            self._progress.clear()
            await self._progress.wait()

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
        return (await self._offer(keys, objs))[0]

    async def _offer(
        self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]
    ) -> tuple[list[bool], dict[int, str]]:
        """:meth:`offer`, and why each key whose older value may survive was refused."""
        self._ensure_usable()
        if len(keys) != len(objs):
            raise ValueError(f"a put got {len(keys)} keys but {len(objs)} objects.")
        for obj in objs:
            self._largest_object = max(self._largest_object, obj.nbytes)
        with self._changing(keys):
            unsafe = await self._invalidate(keys, self._tiers[1:])
            in_first = await self._put_first(keys, objs)
            missed = [index for index, stored in enumerate(in_first) if not stored]
            if missed:  # the first tier may hold an older value of what it did not take
                failed = await self._invalidate([keys[i] for i in missed], self._tiers[:1])
                unsafe.update({missed[i]: reason for i, reason in failed.items()})
            if self.options.write_behind_wait and len(self._tiers) > 1:
                await self._room_for(sum(obj.phy_size for obj in objs))
            accepted = self._accept(keys, objs, in_first)
        accepted = [ok and index not in unsafe for index, ok in enumerate(accepted)]
        self.metrics.rejected.inc(accepted.count(False))
        return accepted, unsafe

    async def _room_for(self, nbytes: int) -> None:
        """Wait up to ``write_behind_wait`` seconds until the write-behind has ``nbytes`` of
        room (or is empty, for more than its limit)."""
        needed = min(nbytes, self.write_behind_limit)
        deadline = time.monotonic() + self.options.write_behind_wait
        while self.write_behind_room < needed and not self._closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._room_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room_freed.wait(), remaining)

    def _accept(
        self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj], in_first: list[bool]
    ) -> list[bool]:
        """Queue each object for the lower tiers; whether each was accepted anywhere."""
        first, lower = self._tiers[0], self._tiers[1:]
        accepted = []
        for key, obj, stored in zip(keys, objs, in_first, strict=True):
            entry = self._pending.get(key)
            if stored and entry is not None and 0 in entry.removals and 0 not in entry.busy:
                entry.removals.discard(0)  # the older value it was to remove is gone already
                first.removals -= 1
            queued = self._admit(key, obj, lower)
            if not stored and queued:
                # The first tier may hold an older value: it goes, readers skip it meanwhile.
                self._queue_removal(self._entry(key), first, key)
            accepted.append(stored or queued)
        return accepted

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        """Store ``obj`` (see :meth:`_batched_put`); the caller keeps its reference."""
        await self._batched_put([key], [obj])

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """Store the objects: in the first tier before this returns, in the lower tiers through
        the write-behind queue. Raises :class:`~kvplug.errors.CapacityExceeded` (or
        :class:`~kvplug.errors.BackendUnavailable` when a tier failed) naming the keys that were
        not accepted, with ``stored`` telling which were; those are stored."""
        accepted, unsafe = await self._offer(keys, objs)
        if all(accepted):
            return
        refused = [str(k) for k, ok in zip(keys, accepted, strict=True) if not ok]
        reasons = [
            f"{t.name}: {t.health.last_dropped}" for t in self._tiers if t.health.last_dropped
        ]
        reasons += sorted({f"an older value may survive in {reason}" for reason in unsafe.values()})
        failing = unsafe or any(not t.health.healthy for t in self._tiers)
        error = (BackendUnavailable if failing else CapacityExceeded)(
            f"{len(refused)} of {len(keys)} puts were not accepted ({', '.join(refused[:3])}"
            f"{', ...' if len(refused) > 3 else ''}): {'; '.join(reasons)}. Free room (release "
            "objects, raise max_size or write_behind_size) or bring the failing tier back."
        )
        error.stored = tuple(accepted)
        raise error

    def _flushed(self) -> bool:
        """Nothing left to write, and no removal left but those waiting for a tier that is
        failing (they are retried when it is back, whoever waits)."""
        return all(
            not entry.writes
            and not entry.busy
            and all(not self._tiers[index].health.healthy for index in entry.removals)
            for entry in self._pending.values()
        )

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write has reached its tier (or was dropped) and every
        removal of an older value has been made, except on tiers that are failing now."""

        async def flushed() -> None:
            while True:
                self._progress.clear()
                if self._flushed():
                    return
                await self._progress.wait()

        await asyncio.wait_for(flushed(), timeout)

    # -- reads ----------------------------------------------------------------------------------

    def _skipped(self, key: CacheKey, tier: int) -> bool:
        """Whether ``tier``'s value of ``key`` is older than one accepted since."""
        if not self._pending:
            return False
        entry = self._pending.get(key)
        return entry is not None and (tier in entry.removals or tier in entry.busy)

    def _to_ask(self, tier: _Tier, keys: Sequence[CacheKey], missing: list[int]) -> list[int]:
        """The positions of ``missing`` keys to ask ``tier`` for: none while it backs off, and
        none whose value there is older than one accepted since."""
        if not self._available(tier):
            return []
        if not self._pending:
            return missing
        return [i for i in missing if not self._skipped(keys[i], tier.index)]

    def _has_room(self) -> bool:
        budget = self.budget
        if isinstance(budget, FreeListAllocator):
            return budget.has_room(max(self._largest_object, budget.alignment))
        return True

    async def _room_by(self, deadline: float) -> bool:
        """Wait until the budget has room for the largest object seen, up to ``deadline``."""
        step = 0.001
        while not self._has_room():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(step, remaining))
            step = min(step * 2, 0.05)
        return True

    def _shortages(self) -> int:
        budget = self.budget
        return (
            budget.shortages if isinstance(budget, FreeListAllocator) else budget.stats().shortages
        )

    async def _get_from(
        self, tier: _Tier, keys: list[CacheKey], deadline: float
    ) -> tuple[list[MemoryObj | None], bool]:
        """One tier's objects for ``keys`` (one batched call, again for keys it could not
        allocate for once memory is free), and whether memory stayed short."""
        results: list[MemoryObj | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        asking = keys
        try:
            while True:
                before = self._shortages()
                ok, got = await self._call(tier, "get", tier.backend.batched_get(asking))
                if not ok or got is None:
                    return results, False
                for i, obj in zip(todo, got, strict=True):
                    if obj is not None:
                        results[i] = obj
                        if obj.nbytes > self._largest_object:
                            self._largest_object = obj.nbytes
                todo = [i for i in todo if results[i] is None]
                if not todo or self._shortages() == before:
                    return results, False
                # Some misses may only be a full budget (any reader's shortage counts here, so
                # a real miss may be asked twice): wait for room, then ask again for them.
                self.metrics.memory_waits.inc()
                if not await self._room_by(deadline):
                    return results, True
                asking = [keys[i] for i in todo]
        except BaseException:
            for obj in results:
                if obj is not None:
                    obj.release()
            raise

    async def _read(
        self, keys: Sequence[CacheKey], *, write_back_now: bool = False
    ) -> list[MemoryObj | None]:
        """Each tier, in order, is asked for the keys the faster ones missed; lower-tier hits
        are written back (:meth:`_write_back`; ``write_back_now``: into every faster tier
        before this returns)."""
        started = self._begin_read()
        results: list[MemoryObj | None] = [None] * len(keys)
        try:
            missing = list(range(len(keys)))
            if self._pending:
                for i, key in enumerate(keys):
                    entry = self._pending.get(key)
                    if entry is not None and entry.obj is not None:
                        results[i] = entry.obj.retain()
                missing = [i for i in missing if results[i] is None]
            deadline = time.monotonic() + self.options.timeout
            short = False
            for tier in self._tiers:
                if not missing:
                    break
                asked = self._to_ask(tier, keys, missing)
                if not asked:
                    continue
                got, short = await self._get_from(tier, [keys[i] for i in asked], deadline)
                hits = 0
                for i, obj in zip(asked, got, strict=True):
                    if obj is not None:
                        results[i] = obj
                        hits += 1
                missing = [i for i in missing if results[i] is None]
                if hits and tier.index and (self.options.promote or write_back_now):
                    found = [(keys[i], obj) for i in asked if (obj := results[i]) is not None]
                    await self._write_back(tier, found, started, now=write_back_now)
                if short:
                    break
            if missing:
                reason = "memory_short" if short else "absent"
                self.metrics.store_misses.labels(reason).inc(len(missing))
            return results
        except BaseException:
            for held in results:
                if held is not None:
                    held.release()
            raise
        finally:
            self._end_read(started)

    async def _write_back(
        self,
        source: _Tier,
        hits: list[tuple[CacheKey, MemoryObj]],
        started: int,
        *,
        now: bool = False,
    ) -> None:
        """Copy lower-tier hits into the faster tiers: at once into host-memory tiers (no copy
        there; every tier with ``now``), through the write-behind into the others. A key
        written or removed since the read began is left alone, and a value written back while
        such a write happened is taken out again (it may be the older one)."""
        for tier in self._tiers[: source.index]:
            fresh = [
                (k, o)
                for k, o in hits
                if not self._changed_since(k, started)
                and k not in self._pending
                and not self._skipped(k, tier.index)
            ]
            if not fresh or not self._available(tier):
                continue
            if not (now or tier.backend.capabilities.zero_copy):  # off the read path
                for key, obj in fresh:
                    self._admit(key, obj, [tier], newer=False)
                continue
            keys, objs = [k for k, _ in fresh], [o for _, o in fresh]
            nbytes = sum(obj.nbytes for obj in objs)
            try:
                ok, _ = await self._call(tier, "put", tier.backend.batched_put(keys, objs), nbytes)
            except CapacityExceeded:
                ok = False
            if ok:
                self._wrote(tier)
            for key in keys:
                if self._changed_since(key, started):
                    with contextlib.suppress(BackendError, OSError):
                        await tier.backend.remove(key)

    async def _read_into(self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]) -> list[bool]:
        """Each tier, in order, reads the keys the faster ones missed straight into ``dests``
        (the caller's memory, no memory budget in between); lower-tier hits are promoted in
        the background (:meth:`_promote`)."""
        started = self._begin_read()
        promoting = False
        try:
            found = [False] * len(keys)
            missing = list(range(len(keys)))
            if self._pending:
                newest = {i: entry.obj for i in missing if (entry := self._pending.get(keys[i]))}
                for i, obj in newest.items():
                    if obj is not None:  # the newest value: the tiers may hold an older one
                        found[i] = fill_into([obj.retain()], [dests[i]], [keys[i]])[0]
                missing = [i for i in missing if i not in newest or newest[i] is None]
            promotions: list[tuple[_Tier, list[int]]] = []
            for tier in self._tiers:
                if not missing:
                    break
                asked = self._to_ask(tier, keys, missing)
                if not asked:
                    continue
                reading = tier.backend.batched_get_into(
                    [keys[i] for i in asked], [dests[i] for i in asked]
                )
                ok, hits = await self._call(tier, "get", reading)
                if not ok or hits is None:
                    continue
                got = [i for i, hit in zip(asked, hits, strict=True) if hit]
                for i in got:
                    found[i] = True
                if got and tier.index and self.options.promote:
                    promotions.append((tier, got))
                missing = [i for i in missing if not found[i]]
            if missing:
                self.metrics.store_misses.labels("absent").inc(len(missing))
            for tier, got in promotions:
                promoting |= self._schedule_promotion(
                    tier, [keys[i] for i in got], sum(dests[i].nbytes for i in got), started
                )
            return found
        finally:
            if not promoting:
                self._end_read(started)

    def _schedule_promotion(
        self, source: _Tier, keys: list[CacheKey], nbytes: int, started: int
    ) -> bool:
        """Promote ``keys`` (read from ``source`` by a read that began at ``started``) in the
        background, while promotions in flight hold at most ``write_behind_limit`` bytes (one
        always goes); False when it was skipped (counted)."""
        if self._promoting_bytes and self._promoting_bytes + nbytes > self.write_behind_limit:
            self.metrics.promotions_skipped.inc(len(keys))
            return False
        self._promoting_bytes += nbytes
        self._reads[started] += 1  # the read stays open: a put meanwhile must win
        task = asyncio.get_running_loop().create_task(self._promote(source, keys, nbytes, started))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return True

    async def _promote(
        self, source: _Tier, keys: list[CacheKey], nbytes: int, started: int
    ) -> None:
        """Read ``keys`` from ``source`` again, into the memory budget if it has room now, and
        write them back into the faster tiers (:meth:`_write_back`)."""
        hits: list[tuple[CacheKey, MemoryObj]] = []
        try:
            got, _ = await self._get_from(source, keys, time.monotonic())
            hits = [(key, obj) for key, obj in zip(keys, got, strict=True) if obj is not None]
            if hits:
                await self._write_back(source, hits, started)
        except (KvplugError, OSError) as error:  # a promotion that fails changes nothing
            logger.debug("promoting %d keys from %s failed: %r", len(keys), source.name, error)
        finally:
            for _, obj in hits:
                obj.release()
            self._promoting_bytes -= nbytes
            self._end_read(started)

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        """The bytes of ``key`` from the first tier that has it, read straight into ``dest``
        (see :meth:`_read_into`)."""
        self._ensure_usable()
        return (await self._read_into([key], [dest]))[0]

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        """The bytes of each key read straight into its destination: each tier is asked once,
        in order, for the keys the faster ones missed. A chunk a tier holds is never a miss
        for want of kvplug's own memory: none is used."""
        self._ensure_usable()
        return await self._read_into(list(keys), list(dests))

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        """The object from the first tier that has it (the caller releases it); ``None`` when
        no tier has it, or when the memory budget had no room for it within ``timeout``."""
        self._ensure_usable()
        return (await self._read([key]))[0]

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """The objects for ``keys`` (aligned with them): each tier is asked once, in order,
        for the keys the faster ones missed."""
        self._ensure_usable()
        return await self._read(list(keys))

    async def _contains(self, key: CacheKey) -> bool:
        return (await self._batched_exists([key]))[0]

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is present in some tier (or waits in the write-behind): each tier
        is asked once, in order, for the keys the faster ones did not have, and the slower
        ones are not asked once every key is found."""
        self._ensure_usable()
        keys = list(keys)
        present = [
            entry is not None and entry.obj is not None for entry in map(self._pending.get, keys)
        ]
        for tier in self._tiers:
            if all(present):
                break
            if not self._available(tier):
                continue
            # A value older than an accepted one does not count: that tier is not asked.
            asked = [
                n
                for n, there in enumerate(present)
                if not there and not self._skipped(keys[n], tier.index)
            ]
            if not asked:
                continue
            ok, found = await self._call(
                tier, "contains", tier.backend.batched_exists([keys[n] for n in asked])
            )
            if ok and found is not None:
                for n, there in zip(asked, found, strict=True):
                    present[n] = there
        return present

    async def lookup(self, keys: Sequence[CacheKey]) -> int:
        """The same as :meth:`batched_contains` (LMCache's name for it)."""
        return await self.batched_contains(keys)

    async def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """Load the leading present ``keys`` into the first tier, stopping at the first key no
        tier has; how many of them the first tier now holds."""
        self._ensure_usable()
        present = await self.batched_contains(keys)
        objs = await self._read(list(keys[:present]), write_back_now=True)
        loaded = next((n for n, obj in enumerate(objs) if obj is None), len(objs))
        for obj in objs:
            if obj is not None:
                obj.release()
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
        with self._changing([key]):
            return await self._remove_selected(key, selected, everywhere=tiers is None)

    async def _remove_selected(
        self, key: CacheKey, selected: list[_Tier], *, everywhere: bool
    ) -> bool:
        # What a tier holds while a write or removal of the key is under way there is the
        # write-behind's business: it does not make the key present (a second remove is False).
        unsettled = {tier.index for tier in selected if self._skipped(key, tier.index)}
        found = False
        entry = self._pending.get(key)
        if entry is not None:
            if everywhere:
                found = entry.obj is not None
                self._set_value(entry, None)
            for tier in selected:
                entry.writes.discard(tier.index)
                if tier.index in entry.busy:  # a write in flight lands after this removal
                    self._queue_removal(entry, tier, key)

        async def remove_from(tier: _Tier) -> bool:
            if self._available(tier):
                ok, removed = await self._call(tier, "remove", tier.backend.remove(key))
                if ok:
                    return bool(removed) and tier.index not in unsettled
            self._queue_removal(self._entry(key), tier, key)
            return False

        results = await asyncio.gather(*(remove_from(tier) for tier in selected))
        self._settle(key)
        return found or any(results)

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

    def _list_keys(self) -> AsyncIterator[CacheKey]:
        """Every key stored in some tier or waiting to be written, each once."""
        self._ensure_usable()

        async def keys() -> AsyncIterator[CacheKey]:
            seen: set[CacheKey] = set()
            for key, entry in list(self._pending.items()):
                if entry.obj is not None:
                    seen.add(key)
                    yield key
            for tier in self._tiers:
                async for key in tier.backend.list_keys():
                    if key not in seen and not self._skipped(key, tier.index):
                        seen.add(key)
                        yield key

        return keys()

    def health(self) -> list[TierHealth]:
        """Each tier's state, fastest first (copies)."""
        return [dataclasses.replace(tier.health) for tier in self._tiers]

    def _tier_stats(self) -> dict[str, dict[str, OperationStats]]:
        """Each tier's :meth:`~kvplug.backend.Backend.operation_stats`, by tier name: the
        source of the per-tier series (thread-safe: read at a Prometheus scrape)."""
        return {tier.name: tier.backend.operation_stats() for tier in self._tiers}

    def stats(self) -> dict[str, Any]:
        """Counters of the store: per tier, what its operations did (from its own
        :meth:`~kvplug.backend.Backend.operation_stats`, summed by :func:`~kvplug.stats.summarize`:
        ``reads``, ``hits``, ``misses``, ``hit_rate``, ``bytes_read``, ``writes``,
        ``bytes_written``, ``lookups``, ``errors`` and ``errors_by_op``) and what the Store did
        with it (puts offered and dropped by reason, keys queued, health); the write-behind
        (bytes and keys queued, limit), the memory budget (capacity, used, shortages) and
        misses by reason."""
        value = self.metrics.value
        tiers: dict[str, dict[str, Any]] = {}
        for tier in self._tiers:
            tier_name, operations = tier.name, tier.backend.operation_stats()
            dropped = {
                reason: value("kvplug_tier_dropped_puts_total", tier=tier_name, reason=reason)
                for reason in DROP_REASONS
            }
            tiers[tier_name] = {
                **summarize(operations).as_dict(),
                "errors_by_op": {op: stats.errors for op, stats in operations.items()},
                "offered_puts": value("kvplug_tier_offered_puts_total", tier=tier_name),
                "dropped_puts": sum(dropped.values()),
                "dropped_by_reason": dropped,
                "starved": tier.starved,
                "queued": len(tier.waiting),
                "healthy": tier.health.healthy,
            }
        budget = self.budget.stats()
        return {
            "tiers": tiers,
            "write_behind": {
                "queued_bytes": self._pending_bytes,
                "queued_keys": len(self._pending),
                "queued_removals": sum(tier.removals for tier in self._tiers),
                "limit_bytes": self.write_behind_limit,
            },
            "memory": {
                "budget_bytes": budget.capacity,
                "used_bytes": budget.used,
                "shortages": budget.shortages,
                "waits": value("kvplug_store_memory_waits_total"),
            },
            "misses": {
                reason: value("kvplug_store_misses_total", reason=reason) for reason in MISS_REASONS
            },
            "rejected_puts": value("kvplug_store_rejected_puts_total"),
            "promotions_skipped": value("kvplug_store_promotions_skipped_total"),
        }

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
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._tiers and self._pending:
            with contextlib.suppress(TimeoutError):
                await self.flush(self.options.close_timeout)
        for tier in self._tiers:
            if tier.worker is not None:
                tier.worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tier.worker
            left = [k for k in tier.waiting if self._queued_here(k, tier)]
            if left:
                self._dropped(tier, "closed", "the store closed before it was written", len(left))
        for entry in self._pending.values():
            self._set_value(entry, None)
        self._pending.clear()
        self._progress.set()
        if self._memory is not None and isinstance(self._budget, FreeListAllocator):
            self._budget.set_reclaimer(self._previous_reclaimer)
        failures = await _close_each([(tier.name, tier.backend) for tier in self._tiers])
        for entry in self._pending.values():  # from operations still in flight during close
            self._set_value(entry, None)
        self._pending.clear()
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


__all__ = [
    "ADVICE",
    "DROP_REASONS",
    "MISS_REASONS",
    "STARVED_AFTER",
    "MemoryTier",
    "Store",
    "StoreOptions",
    "TierHealth",
    "layers",
    "open_store",
    "store_of",
    "store_url",
    "tiers_of",
]
