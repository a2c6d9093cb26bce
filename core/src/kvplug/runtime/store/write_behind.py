"""The write-behind: accepted values queued for the lower tiers while the values waiting hold at
most ``limit`` bytes, and one worker per tier that drains its queue in batches, making the
writes and the removals of older values the :class:`~.freshness.VersionLedger` says it owes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvplug.errors import BackendClosed, CapacityExceeded
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.runtime.metrics import StoreMetrics
from kvplug.runtime.store.freshness import MAX_STALE_REMOVALS, VersionLedger
from kvplug.runtime.store.health import TierGuard, stored_keys
from kvplug.runtime.store.tier import Tier
from kvplug.units import format_size

logger = logging.getLogger("kvplug.store")

WRITE_BEHIND_SHARE = 4
"""Without ``write_behind_size``, objects waiting for lower tiers hold at most 1/4 of the
budget."""


class WriteBehind:
    """The queues of the lower tiers, bounded in bytes, and their workers."""

    def __init__(
        self,
        tiers: list[Tier],
        guard: TierGuard,
        metrics: StoreMetrics,
        progress: asyncio.Event,
        *,
        batch: int,
        wait: float,
        closed: Callable[[], bool],
    ) -> None:
        self._tiers = tiers
        self._guard = guard
        self._metrics = metrics
        self.progress = progress
        """Set whenever the write-behind may have become flushed (see :meth:`flush`)."""
        self._batch = batch
        self._wait = wait
        self._closed = closed
        self._untracked_warned = False
        self.limit = 0
        """Most bytes of values that may wait for the lower tiers."""
        self.ledger = VersionLedger(self._enqueue, self._untracked, progress)

    @property
    def room(self) -> int:
        """Bytes the write-behind can still take before puts are dropped for the lower tiers."""
        return max(0, self.limit - self.ledger.queued_bytes)

    # -- admission ------------------------------------------------------------------------------

    def admit(self, key: CacheKey, obj: MemoryObj, targets: Sequence[Tier]) -> bool:
        """Queue ``obj``, a newly accepted value, for ``targets``: True when queued for at
        least one of them. Those it cannot be queued for (no room, or failing) drop their older
        value of the key."""
        if not targets or self._closed():
            return False
        for tier in targets:
            tier.offered.inc()
        others = self.ledger.queued_bytes - self.ledger.held_bytes(key)
        # An empty write-behind takes one object of any size: a limit below the chunk size
        # would otherwise starve every lower tier.
        room = others == 0 or others + obj.phy_size <= self.limit
        usable = [tier for tier in targets if tier.available()]
        queue_for = usable if room else []
        refused = [tier for tier in targets if tier not in queue_for]
        for tier in refused:
            if tier in usable:
                waiting = f"{format_size(others)} of {format_size(self.limit)} waiting"
                self._guard.dropped(tier, "write_behind_full", waiting)
            else:
                failing = f"skipped after failing ({tier.health.last_error})"
                self._guard.dropped(tier, "tier_failing", failing)
        self.ledger.accept(
            key, obj, [tier.index for tier in queue_for], [tier.index for tier in refused]
        )
        return bool(queue_for)

    def write_back(self, key: CacheKey, obj: MemoryObj, tier: Tier, started: int) -> bool:
        """Queue ``obj``, found in a lower tier by a read that began at ``started``, for
        ``tier``, if there is room and the ledger lets it (never over a newer value)."""
        if self._closed() or not tier.available():
            return False
        queued = self.ledger.queued_bytes
        if queued and queued + obj.phy_size > self.limit:
            return False
        return self.ledger.write_back(key, obj, tier.index, started)

    async def room_for(self, nbytes: int) -> None:
        """Wait up to ``wait`` seconds until the write-behind has ``nbytes`` of room (or is
        empty, for more than its limit)."""
        needed = min(nbytes, self.limit)
        deadline = time.monotonic() + self._wait
        room_freed = self.ledger.room_freed
        while self.room < needed and not self._closed():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            room_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(room_freed.wait(), remaining)

    # -- the workers ----------------------------------------------------------------------------

    def _enqueue(self, index: int, key: CacheKey) -> None:
        if self._closed():
            return  # an operation that was in flight when the store closed
        tier = self._tiers[index]
        tier.waiting.append(key)
        tier.wake.set()
        self._metrics.queue_depth.labels(tier.name).set(len(tier.waiting))
        if tier.worker is None or tier.worker.done():
            tier.worker = asyncio.get_running_loop().create_task(self._drain(tier))

    def _untracked(self, index: int) -> None:
        tier = self._tiers[index]
        self._guard.dropped(tier, "untracked", f"{MAX_STALE_REMOVALS} removals already queued")
        if not self._untracked_warned:
            self._untracked_warned = True
            logger.warning(
                "tier %s has %d removals of older values queued; further skipped overwrites "
                "are not tracked, so it may return an older value of such a key",
                tier.name,
                MAX_STALE_REMOVALS,
            )

    def _take(self, tier: Tier) -> tuple[list[tuple[CacheKey, MemoryObj]], list[CacheKey]]:
        """The next batch for ``tier``: objects to write and keys to remove."""
        writes: list[tuple[CacheKey, MemoryObj]] = []
        removals: list[CacheKey] = []
        ledger = self.ledger
        while tier.waiting and len(writes) + len(removals) < self._batch:
            key = tier.waiting.popleft()
            if ledger.take_removal(key, tier.index):
                removals.append(key)
            elif (obj := ledger.take_write(key, tier.index)) is not None:
                writes.append((key, obj))
        self._metrics.queue_depth.labels(tier.name).set(len(tier.waiting))
        return writes, removals

    async def _drain(self, tier: Tier) -> None:
        while True:
            if not tier.waiting:
                tier.wake.clear()
                await tier.wake.wait()
                continue
            if not tier.available():
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
                    self.ledger.finish(key, tier.index)
                self.progress.set()

    def _drop_writes(self, tier: Tier, reason: str, detail: str) -> None:
        """Drop every write queued for ``tier``, each replaced by a removal of the older
        value."""
        ledger = self.ledger
        for key in list(tier.waiting):
            if ledger.write_waiting(key, tier.index):
                self._guard.dropped(tier, reason, detail)
                ledger.purge(key, tier.index)
        tier.waiting = deque(k for k in tier.waiting if ledger.queued(k, tier.index))
        ledger.settle_all()
        self._metrics.queue_depth.labels(tier.name).set(len(tier.waiting))
        self.progress.set()

    async def _write(self, tier: Tier, writes: list[tuple[CacheKey, MemoryObj]]) -> None:
        keys = [key for key, _ in writes]
        objs = [obj for _, obj in writes]
        nbytes = sum(obj.nbytes for obj in objs)
        stored = None
        try:
            ok, _ = await self._guard.call(
                tier, "put", tier.backend.batched_put(keys, objs), nbytes
            )
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
            self._guard.wrote(tier)
            return
        if stored is not None:  # the tier says which it kept: only the others are dropped
            if any(stored):
                self._guard.wrote(tier)
            keys = [key for key, done in zip(keys, stored, strict=True) if not done]
        # Which of these the tier kept is unknown: each is removed again, so that no older
        # value outlives the newer one accepted elsewhere.
        self._guard.dropped(tier, reason, detail, len(keys))
        for key in keys:
            self.ledger.purge(key, tier.index)

    async def _remove_older(self, tier: Tier, keys: list[CacheKey]) -> None:
        if not tier.backend.capabilities.remove:
            return
        results = await asyncio.gather(
            *(self._guard.call(tier, "remove", tier.backend.remove(key)) for key in keys),
            return_exceptions=True,
        )
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, BaseException):
                # Closed, or a bug in the tier: retrying cannot help. Counted, like a drop.
                reason = "closed" if isinstance(result, BackendClosed) else "tier_error"
                self._guard.dropped(tier, reason, f"removing an older value: {result!r}")
            elif not result[0]:
                self.ledger.purge(key, tier.index)  # again after the back-off

    # -- waiting and stopping -------------------------------------------------------------------

    async def until_idle(self, key: CacheKey, tier: Tier) -> None:
        """Wait until no write or removal of ``key`` is in flight on ``tier``."""
        while self.ledger.in_flight(key, tier.index):
            self.progress.clear()
            await self.progress.wait()

    def flushed(self) -> bool:
        """Nothing left to write, and no removal left but those waiting for a tier that is
        failing (they are retried when it is back, whoever waits)."""
        tiers = self._tiers
        return self.ledger.flushed(lambda index: not tiers[index].health.healthy)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write has reached its tier (or was dropped) and every
        removal of an older value has been made, except on tiers that are failing now."""

        async def flushed() -> None:
            while True:
                self.progress.clear()
                if self.flushed():
                    return
                await self.progress.wait()

        await asyncio.wait_for(flushed(), timeout)

    async def stop(self, close_timeout: float) -> None:
        """Finish queued writes (up to ``close_timeout`` seconds), stop the workers, count what
        is left as dropped (``closed``) and let go of every value."""
        ledger = self.ledger
        if self._tiers and len(ledger):
            with contextlib.suppress(TimeoutError):
                await self.flush(close_timeout)
        for tier in self._tiers:
            if tier.worker is not None:
                tier.worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tier.worker
            left = [k for k in tier.waiting if ledger.queued(k, tier.index)]
            if left:
                detail = "the store closed before it was written"
                self._guard.dropped(tier, "closed", detail, len(left))
        ledger.clear()
        self.progress.set()
