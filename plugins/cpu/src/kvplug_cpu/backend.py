"""The host-memory tier, ``cpu://``: kvplug's embedded default and fastest tier.

URL and options (query parameters or keyword options, keywords win)::

    cpu://?max_size=8GiB&eviction=lfu&pin_ttl=60
    cpu://?max_size=8GiB&tenant_quotas=team-a:2GiB,team-b:1GiB

* ``max_size``: bytes this tier may hold; an int or a size string (``512MiB``, ``5GiB``).
  Default 5 GiB.
* ``eviction``: ``lru`` (default), ``lfu`` or ``fifo`` (see :mod:`kvplug.eviction`).
* ``pin_ttl``: seconds a pin lasts before it expires by itself. Default 300.
* ``tenant_quotas``, ``default_tenant_quota``: bytes each tenant may hold and keeps (see
  :class:`~kvplug.options.EvictionOptions` and :class:`~kvplug.quotas.TenantQuotaIndex`).
  Default: no quotas.

Example::

    >>> import asyncio, torch, kvplug
    >>> async def main():
    ...     cpu = await kvplug.open_backend("cpu://?max_size=64MiB")
    ...     key = kvplug.CacheKey("llama", 1, 0, 42)
    ...     obj = cpu.allocator.allocate((2, 4, 16, 8), torch.float16)
    ...     obj.tensor.fill_(1.0)
    ...     await cpu.put(key, obj)          # zero-copy: obj lives in cpu's allocator
    ...     obj.release()                    # put never takes the caller's reference
    ...     hit = await cpu.get(key)
    ...     total = hit.tensor.sum().item()
    ...     hit.release()
    ...     await cpu.close()
    ...     return total
    >>> asyncio.run(main())
    1024.0
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

import torch
from pydantic import Field, field_validator

from kvplug.backend import Backend, BackendOptions, Capabilities
from kvplug.errors import BackendClosed, CapacityExceeded, ConfigError, InvalidBackendURL
from kvplug.index import EvictableIndex, PinsInIndex
from kvplug.keys import CacheKey
from kvplug.memory import (
    DEFAULT_ALIGNMENT,
    Allocator,
    FreeListAllocator,
    MemoryFormat,
    MemoryObj,
    nbytes_of,
)
from kvplug.options import EvictionOptions
from kvplug.quotas import make_index
from kvplug.units import GiB, format_size, host_memory, parse_size
from kvplug.url import BackendURL

DEFAULT_MAX_SIZE = 5 * GiB
logger = logging.getLogger("kvplug.cpu")


class CpuOptions(EvictionOptions):
    """Options of ``cpu://``."""

    max_size: int = Field(
        DEFAULT_MAX_SIZE,
        description="bytes this tier may hold: an int or '512MiB', '5GiB'",
        validate_default=True,  # the default too must hold every tenant quota
    )

    @field_validator("max_size", mode="before")
    @classmethod
    def _parse_max_size(cls, value: object) -> int:
        size = parse_size(value, what="cpu max_size")
        if size < DEFAULT_ALIGNMENT:
            raise ConfigError(
                f"cpu max_size is {size} bytes, less than one {DEFAULT_ALIGNMENT}-byte block, so "
                "nothing would fit. Give a size such as '512MiB' or '5GiB'."
            )
        return size


def _only_ours(obj: MemoryObj) -> bool:
    """Whether the index holds the only reference (so evicting ``obj`` frees its memory)."""
    return obj.ref_count == 1 and obj.pin_count == 0


async def _iterate(keys: list[CacheKey]) -> AsyncIterator[CacheKey]:
    for key in keys:
        yield key


class CpuBackend(PinsInIndex, Backend):
    """A size-capped cache of memory objects in host memory.

    **Memory.** Without an ``allocator`` the tier creates its own
    :class:`~kvplug.memory.FreeListAllocator` of ``max_size`` bytes when opened (anonymous
    memory committed on first touch; CUDA-pinned when CUDA is present) and exposes it as
    :attr:`allocator`.
    Objects allocated there (directly or with :meth:`allocate`, which evicts to make room) are
    stored without a copy; any other object is copied in. With an ``allocator`` given, the tier
    stores into that one and keeps the bytes it holds under ``max_size`` itself.

    **Sharing.** ``get`` returns the stored object itself with one more reference for the
    caller, and a zero-copy ``put`` stores the caller's object itself: treat both as read-only,
    since writing into them changes the cached data.

    **Eviction and pins.** When room is needed, keys are evicted in the policy's order,
    skipping pinned ones. A pin lasts until :meth:`unpin` or ``pin_ttl`` seconds; expired pins
    are dropped lazily while looking for victims. An object larger than ``max_size``, or a
    store whose remaining keys are all pinned, makes ``put`` raise
    :class:`~kvplug.errors.CapacityExceeded`; reads keep working.

    **Tenant quotas** (``tenant_quotas``, ``default_tenant_quota``): a tenant's put that would
    take it over its quota evicts its own entries first, and raises ``CapacityExceeded``
    naming the tenant and its quota when that cannot make room; a tenant at or below its
    quota is never evicted for another tenant (:class:`~kvplug.quotas.TenantQuotaIndex`). A
    put that copies its object in makes that room before it allocates the copy, so the
    allocation does not take another tenant's memory. Counters per tenant:
    :meth:`tenant_stats`.

    **Concurrency.** The index is guarded by a thread lock that is never held across an
    ``await``, so one backend serves tasks of several event loops and threads at once.

    Counters: hits, misses, bytes and latency per operation in
    :meth:`~kvplug.backend.Backend.operation_stats` (as for every backend); what is the tier's
    own in :attr:`evictions`, :attr:`bytes_held`, :meth:`stats` and :meth:`tenant_stats`.
    """

    # releases_on_cancel: no hook awaits, so an operation is cancelled before it starts or not
    # at all, and a put of memory outside the tier's allocator stores a copy.
    capabilities = Capabilities(
        pin=True, zero_copy=True, remove=True, list_keys=True, releases_on_cancel=True
    )
    runs_inline: ClassVar[bool] = True  # no hook awaits; the index has a thread lock
    Options: ClassVar[type[BackendOptions]] = CpuOptions
    # What the contract suite opens to fill the store (clauses 8, 9).
    contract_small_options: ClassVar[dict[str, Any]] = {"max_size": "4MiB"}
    # The clauses the contract suite cannot run here, and why (its verdict says "waived").
    contract_waivers: ClassVar[dict[int, str]] = {
        6: "objects are held in memory as they were put: no stored bytes to damage",
        10: "in-process: there is no server to pause or stop",
    }
    options: CpuOptions

    def __init__(
        self, url: BackendURL | str, *, allocator: Allocator | None = None, **options: Any
    ) -> None:
        super().__init__(url, allocator=allocator, **options)
        if self.url.hosts or self.url.path or self.url.username or self.url.password:
            raise InvalidBackendURL(
                f"{self.url} names a host, path or user, but cpu:// is this process's memory "
                "and takes none. Put options in the query: cpu://?max_size=5GiB"
            )
        self.owns_allocator = allocator is None
        self.max_size: int = self.options.max_size
        """Bytes this tier holds at most."""
        if allocator is None:
            # The allocator's capacity: whole blocks only.
            self.max_size -= self.max_size % DEFAULT_ALIGNMENT
        self._allocator_lock = threading.Lock()
        self._lock = threading.Lock()
        self._index: EvictableIndex[CacheKey, MemoryObj] = make_index(
            self.max_size,
            self.options.eviction,
            pin_ttl=self.options.pin_ttl,
            quotas=self.options.quotas,
        )
        self.evictions = 0

    @property
    def allocator(self) -> Allocator:
        """Where this tier's objects live: the allocator it was given, or its own of
        ``max_size`` bytes, created on first use (so constructing the backend is cheap)."""
        if self._allocator is None:
            with self._allocator_lock:
                if self._allocator is None:
                    self._allocator = FreeListAllocator(
                        self.max_size,
                        sized_by="cpu:// max_size (max_local_cpu_size in an LMCache config)",
                    )
        return self._allocator

    async def _open(self) -> None:
        """Create the tier's own allocator now rather than on the first put."""
        _ = self.allocator
        memory = host_memory()
        if self.owns_allocator and self.max_size > memory.total:
            logger.warning(
                "cpu:// max_size is %s, more than this machine's memory (%s): the process will "
                "run out of memory before the tier is full. Lower max_size.",
                format_size(self.max_size),
                memory,
            )

    # -- counters ---------------------------------------------------------------------------

    @property
    def bytes_held(self) -> int:
        """Allocator bytes (block sizes) of the stored objects."""
        return self._index.bytes_held

    def stats(self) -> dict[str, int]:
        """A consistent snapshot of the counters."""
        with self._lock:
            return {
                "evictions": self.evictions,
                "bytes_held": self._index.bytes_held,
                "keys": len(self._index),
                "pinned_keys": self._index.pinned_keys,
                "max_size": self.max_size,
            }

    def tenant_stats(self) -> dict[str, dict[str, int | None]]:
        """Each reported tenant's counters (:class:`~kvplug.stats.TenantStats`), by name:
        the tenants named in ``tenant_quotas``, ``(other)`` for the rest summed and
        ``(none)`` for keys without a tenant; empty without quotas."""
        if not self._index.tracks_tenants:
            return {}
        with self._lock:
            return self._index.tenant_stats()

    def __len__(self) -> int:
        return len(self._index)

    # -- internals (callers hold self._lock) -------------------------------------------------

    def _evicted(self, key: CacheKey, obj: MemoryObj) -> bool:
        """The index's eviction callback: free the victim's memory (by our reference)."""
        obj.release()
        self.evictions += 1
        return True

    def _too_big(self, nbytes: int) -> CapacityExceeded:
        return CapacityExceeded(
            f"cannot store an object of {nbytes} bytes in {self.url}: it is larger than the "
            f"tier's max_size of {self.max_size} bytes. Raise max_size or store smaller chunks."
        )

    def _full(self, nbytes: int, key: CacheKey | None = None) -> CapacityExceeded:
        quota = None if key is None else self._index.quota_refusal(key, nbytes)
        if quota is not None:
            return CapacityExceeded(f"cannot store {key} in {self.url}: {quota}")
        note = "" if key is None else self._index.guarantee_note(key)
        return CapacityExceeded(
            f"cannot make room for {nbytes} bytes in {self.url} ({self._index.bytes_held} of "
            f"{self.max_size} bytes held in {len(self._index)} objects{'; ' if note else ''}"
            f"{note}): every remaining key is pinned, or the memory is still referenced by "
            "readers. Unpin keys, release objects returned by get, or raise max_size."
        )

    def _insert(self, key: CacheKey, stored: MemoryObj) -> None:
        """Store ``stored`` (taking its reference) under ``key``, replacing any old object in
        one step under the lock; on failure ``stored`` is released and the old one kept."""
        error: Exception
        size = stored.phy_size
        with self._lock:
            if self._closed:
                error = BackendClosed(f"{self.url} was closed during a put; open a new backend.")
            elif size > self.max_size:
                error = self._too_big(stored.nbytes)
            elif self._index.make_room(size, self._evicted, replacing=key):
                old = self._index.put(key, stored, size)
                if old is not None:
                    old.release()
                return
            else:
                error = self._full(size, key)
        stored.release()
        raise error

    # -- allocation ---------------------------------------------------------------------------

    def allocate(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        fmt: MemoryFormat = MemoryFormat.KV_2LTD,
    ) -> MemoryObj | None:
        """A new object in :attr:`allocator`, evicting by policy (:meth:`reclaim`) until it
        fits; ``None`` when nothing reclaimable is left. A later ``put`` of it stores it without
        a copy."""
        self.ensure_open()
        nbytes = nbytes_of(shape, dtype)
        while True:
            obj = self.allocator.allocate(shape, dtype, fmt)
            if obj is not None or not self.reclaim(nbytes):
                return obj

    def reclaim(self, nbytes: int) -> int:
        """Evict entries in policy order until ``nbytes`` bytes of memory are freed or no
        candidate is left; the bytes freed.

        Only entries whose memory eviction really frees are candidates: not pinned, and
        referenced by nobody but this tier. An object a reader holds (a ``get`` result, an
        object being read or written elsewhere) is never evicted for room, since dropping it
        from the index would lose the entry and free nothing. A Store installs this method as
        its memory budget's reclaimer (:meth:`kvplug.memory.FreeListAllocator.set_reclaimer`).
        """
        with self._lock:
            return self._index.reclaim(nbytes, self._evicted, evictable=_only_ours)

    # -- the contract -------------------------------------------------------------------------

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        """The stored object with one reference for the caller (release it; read-only), or
        ``None``."""
        with self._lock:
            obj = self._index.hit(key)
            if obj is None:
                return None
            obj.retain()
            return obj

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        """Store ``obj`` (zero-copy when it lives in :attr:`allocator`, else copied), evicting by
        policy to make room. The caller keeps its reference."""
        if obj.nbytes > self.max_size:
            raise self._too_big(obj.nbytes)
        if obj.allocator is self.allocator:
            stored = obj.retain()
        else:
            if self._index.tracks_tenants:
                self._room_for_copy(key, obj.nbytes)
            copy = self.allocate(obj.shape, obj.dtype, obj.fmt)
            if copy is None:
                with self._lock:
                    raise self._full(obj.nbytes, key)
            try:
                copy.raw.copy_(obj.raw)
            except BaseException:
                copy.release()
                raise
            stored = copy
        self._insert(key, stored)

    def _room_for_copy(self, key: CacheKey, nbytes: int) -> None:
        """Make room for the copy of ``nbytes`` for ``key`` as its tenant may (its own entries
        first), so that allocating the copy, whose reclaim knows no tenant, finds it free."""
        size = -(-nbytes // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
        with self._lock:
            if not self._index.make_room(size, self._evicted, replacing=key):
                raise self._full(size, key)

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """``_put`` of each pair in turn (none waits, so nothing is gained by tasks, and
        :attr:`runs_inline` needs no loop); the first error once every pair was tried."""
        first: BaseException | None = None
        for key, obj in zip(keys, objs, strict=True):
            try:
                await self._put(key, obj)
            except Exception as error:
                first = first or error
        if first is not None:
            raise first

    async def _contains(self, key: CacheKey) -> bool:
        with self._lock:
            return key in self._index

    async def _remove(self, key: CacheKey) -> bool:
        """Delete ``key`` even when pinned (its pins go with it); False if absent."""
        with self._lock:
            obj = self._index.remove(key)
            if obj is None:
                return False
            obj.release()
            return True

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        results: list[MemoryObj | None] = []
        with self._lock:
            for key in keys:
                obj = self._index.hit(key)
                if obj is not None:
                    obj.retain()
                results.append(obj)
        return results

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    async def _pin(self, key: CacheKey) -> bool:
        """Keep ``key`` from eviction for ``pin_ttl`` seconds or until ``unpin``; pins
        count. False if ``key`` is absent."""
        with self._lock:
            return self._index.pin(key)

    def _list_keys(self) -> AsyncIterator[CacheKey]:
        """The keys stored when this is called (a snapshot), in no particular order."""
        with self._lock:
            snapshot = list(self._index)
        return _iterate(snapshot)

    async def _close(self) -> None:
        """Release every stored object (readers keep theirs until they release them)."""
        with self._lock:
            held = self._index.clear()
        for obj in held:
            obj.release()


__all__ = ["DEFAULT_MAX_SIZE", "CpuBackend", "CpuOptions"]
