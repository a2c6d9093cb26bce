"""The Store's one memory budget: which allocator it is (the one given, a buffer of
``buffer_size``, the cpu tier's own buffer, else 2 GiB), the memory tier that makes room in it
by evicting, and waiting for room when it is full."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from kvplug.backend import Backend
from kvplug.errors import KvplugError
from kvplug.memory import Allocator, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.registry import backend_class
from kvplug.runtime.store.layers import layers
from kvplug.units import GiB
from kvplug.url import split_chain

DEFAULT_BUFFER_SIZE = 2 * GiB


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


def memory_tier(backend: Backend) -> MemoryTier | None:
    """The :class:`MemoryTier` that ``backend`` is or wraps, or None."""
    return next((layer for layer in layers(backend) if isinstance(layer, MemoryTier)), None)


def serves_memory_tier(url: str) -> bool:
    """Whether ``url`` (possibly a wrapper chain) opens a :class:`MemoryTier`."""
    cls = backend_class(split_chain(url)[-1])
    return callable(getattr(cls, "allocate", None)) and callable(getattr(cls, "reclaim", None))


def fixed_budget(given: Allocator | None, size: int | None) -> Allocator | None:
    """The budget when it does not come from a cpu tier: the allocator ``given``, else a buffer
    of ``size`` bytes (``buffer_size``); None without either."""
    if given is not None:
        return given
    if size is None:
        return None
    return FreeListAllocator(size, sized_by="buffer_size (the Store's memory budget)")


def default_budget() -> Allocator:
    return FreeListAllocator(
        DEFAULT_BUFFER_SIZE,
        sized_by="the Store's memory budget (set buffer_size in the config)",
    )


def budget_among(backends: Sequence[Backend], fixed: Allocator | None) -> Allocator:
    """The budget of a store over ``backends`` opened elsewhere: ``fixed``, else the first
    memory tier's allocator, else the default."""
    if fixed is not None:
        return fixed
    return (
        next((b.allocator for b in backends if memory_tier(b) is not None), None)
        or default_budget()
    )


class MemoryBudget:
    """The allocator every object of a Store lives in, once attached to the opened tiers."""

    def __init__(self) -> None:
        self._allocator: Allocator | None = None
        self._memory_tier: MemoryTier | None = None
        self._previous_reclaimer: Any = None
        self.largest_object = 0
        """The largest object seen: a get short of memory waits for room for it."""

    def attach(self, allocator: Allocator, backends: Sequence[Backend]) -> None:
        """Make ``allocator`` the budget, and the first memory tier among ``backends`` that
        allocates in it the one that evicts to make room."""
        self._allocator = allocator
        self._memory_tier = next((m for b in backends if (m := memory_tier(b)) is not None), None)
        if self._memory_tier is not None and self._memory_tier.allocator is not allocator:
            self._memory_tier = None  # its evictions would free nothing in the budget
        if self._memory_tier is not None and isinstance(allocator, FreeListAllocator):
            self._previous_reclaimer = allocator.set_reclaimer(self._memory_tier.reclaim)

    def detach(self) -> None:
        """Give the budget its reclaimer from before :meth:`attach` back (the tiers close)."""
        if self._memory_tier is not None and isinstance(self._allocator, FreeListAllocator):
            self._allocator.set_reclaimer(self._previous_reclaimer)

    @property
    def allocator(self) -> Allocator:
        if self._allocator is None:
            raise KvplugError("this Store is not open yet; await store.open() first.")
        return self._allocator

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat
    ) -> MemoryObj | None:
        """An object in the budget, the memory tier evicting to make room; None when no room
        can be made (never blocks)."""
        if self._memory_tier is not None:
            return self._memory_tier.allocate(shape, dtype, fmt)
        return self.allocator.allocate(shape, dtype, fmt)

    def saw(self, nbytes: int) -> None:
        """An object of ``nbytes`` was put or read."""
        if nbytes > self.largest_object:
            self.largest_object = nbytes

    def shortages(self) -> int:
        """How often the budget had no room so far."""
        budget = self.allocator
        return (
            budget.shortages if isinstance(budget, FreeListAllocator) else budget.stats().shortages
        )

    def has_room(self) -> bool:
        budget = self.allocator
        if isinstance(budget, FreeListAllocator):
            return budget.has_room(max(self.largest_object, budget.alignment))
        return True

    async def room_by(self, deadline: float) -> bool:
        """Wait until the budget has room for the largest object seen, up to ``deadline``."""
        step = 0.001
        while not self.has_room():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(step, remaining))
            step = min(step * 2, 0.05)
        return True
