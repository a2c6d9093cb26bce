"""Promotion of lower-tier hits: a value a read found in a lower tier is written back into the
faster tiers (at once into host-memory tiers, through the write-behind into the others), and a
hit read straight into the caller's memory is read again into the budget in the background,
while promotions in flight hold at most the write-behind's limit in bytes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from kvplug.errors import BackendError, CapacityExceeded, KvplugError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.runtime.store.parts import StoreParts
from kvplug.runtime.store.tier import Tier

logger = logging.getLogger("kvplug.store")

Fetch = Callable[[Tier, list[CacheKey], float], Awaitable[tuple[list[MemoryObj | None], bool]]]
"""Reads keys from one tier into the budget by a deadline: the objects, and whether memory
stayed short."""


class Promotion:
    """Writes lower-tier hits back into the faster tiers; runs background promotions."""

    def __init__(self, parts: StoreParts, fetch: Fetch) -> None:
        self._tiers = parts.tiers
        self._guard = parts.guard
        self._write_behind = parts.write_behind
        self._ledger = parts.ledger
        self._metrics = parts.metrics
        self._fetch = fetch
        self._promoting_bytes = 0
        self._background: set[asyncio.Task[None]] = set()
        """Promotions in flight."""

    async def write_back(
        self,
        source: Tier,
        hits: list[tuple[CacheKey, MemoryObj]],
        started: int,
        *,
        now: bool = False,
    ) -> None:
        """Copy ``hits``, read from ``source`` by a read that began at ``started``, into the
        faster tiers: at once into host-memory tiers (no copy there; every tier with ``now``),
        through the write-behind into the others. A key written or removed since the read
        began is left alone, and a value written back while such a write happened is taken out
        again (it may be the older one)."""
        ledger = self._ledger
        for tier in self._tiers[: source.index]:
            fresh = [(k, o) for k, o in hits if ledger.may_write_back(k, started)]
            if not fresh or not tier.available():
                continue
            if not (now or tier.backend.capabilities.zero_copy):  # off the read path
                for key, obj in fresh:
                    self._write_behind.write_back(key, obj, tier, started)
                continue
            keys, objs = [k for k, _ in fresh], [o for _, o in fresh]
            nbytes = sum(obj.nbytes for obj in objs)
            try:
                put = tier.backend.batched_put(keys, objs)
                ok, _ = await self._guard.call(tier, "put", put, nbytes)
            except CapacityExceeded:
                ok = False
            if ok:
                self._guard.wrote(tier)
            for key in keys:
                if ledger.clock.changed_since(key, started):
                    with contextlib.suppress(BackendError, OSError):
                        await tier.backend.remove(key)

    def schedule(self, source: Tier, keys: list[CacheKey], nbytes: int, started: int) -> bool:
        """Promote ``keys`` (read from ``source`` by a read that began at ``started``) in the
        background, while promotions in flight hold at most the write-behind's limit in bytes
        (one always goes); False when it was skipped (counted). The read stays open until the
        promotion ends."""
        limit = self._write_behind.limit
        if self._promoting_bytes and self._promoting_bytes + nbytes > limit:
            self._metrics.promotions_skipped.inc(len(keys))
            return False
        self._promoting_bytes += nbytes
        self._ledger.clock.extend(started)  # a put meanwhile must win over the promotion
        task = asyncio.get_running_loop().create_task(self._promote(source, keys, nbytes, started))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return True

    async def _promote(self, source: Tier, keys: list[CacheKey], nbytes: int, started: int) -> None:
        """Read ``keys`` from ``source`` again, into the memory budget if it has room now, and
        write them back into the faster tiers."""
        hits: list[tuple[CacheKey, MemoryObj]] = []
        try:
            got, _ = await self._fetch(source, keys, time.monotonic())
            hits = [(key, obj) for key, obj in zip(keys, got, strict=True) if obj is not None]
            if hits:
                await self.write_back(source, hits, started)
        except (KvplugError, OSError) as error:  # a promotion that fails changes nothing
            logger.debug("promoting %d keys from %s failed: %r", len(keys), source.name, error)
        finally:
            for _, obj in hits:
                obj.release()
            self._promoting_bytes -= nbytes
            self._ledger.clock.end(started)

    async def stop(self) -> None:
        """Cancel the promotions in flight and wait for them to end."""
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
