"""The Store's read path: each tier asked once, in order, for the keys the faster ones missed,
never for a key whose value there is older than one accepted since; reads into the memory
budget wait for room up to their deadline, reads into the caller's memory use none."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from kvplug.backend import fill_into
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.runtime.store.parts import StoreParts
from kvplug.runtime.store.promotion import Promotion
from kvplug.runtime.store.tier import Tier

MISS_REASONS = ("absent", "memory_short")
"""Why a get missed: no tier had the key; the memory budget had no room within the deadline."""


class Reads:
    """Gets, reads into the caller's memory, and lookups across the tiers."""

    def __init__(self, parts: StoreParts, *, timeout: float, promote: bool) -> None:
        self._tiers = parts.tiers
        self._guard = parts.guard
        self._ledger = parts.ledger
        self._memory = parts.memory
        self._metrics = parts.metrics
        self._timeout = timeout
        self._promote = promote
        self.promotion = Promotion(parts, self.fetch)

    def _to_ask(self, tier: Tier, keys: Sequence[CacheKey], missing: list[int]) -> list[int]:
        """The positions of ``missing`` keys to ask ``tier`` for: none while it backs off, and
        none whose value there is older than one accepted since."""
        if not tier.available():
            return []
        ledger = self._ledger
        if not len(ledger):
            return missing
        return [i for i in missing if not ledger.skipped(keys[i], tier.index)]

    async def fetch(
        self, tier: Tier, keys: list[CacheKey], deadline: float
    ) -> tuple[list[MemoryObj | None], bool]:
        """One tier's objects for ``keys`` (one batched call, again for keys it could not
        allocate for once memory is free), and whether memory stayed short."""
        memory = self._memory
        results: list[MemoryObj | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        asking = keys
        try:
            while True:
                before = memory.shortages()
                ok, got = await self._guard.call(tier, "get", tier.backend.batched_get(asking))
                if not ok or got is None:
                    return results, False
                for i, obj in zip(todo, got, strict=True):
                    if obj is not None:
                        results[i] = obj
                        memory.saw(obj.nbytes)
                todo = [i for i in todo if results[i] is None]
                if not todo or memory.shortages() == before:
                    return results, False
                # Some misses may only be a full budget (any reader's shortage counts here, so
                # a real miss may be asked twice): wait for room, then ask again for them.
                self._metrics.memory_waits.inc()
                if not await memory.room_by(deadline):
                    return results, True
                asking = [keys[i] for i in todo]
        except BaseException:
            for obj in results:
                if obj is not None:
                    obj.release()
            raise

    async def read(
        self, keys: Sequence[CacheKey], *, write_back_now: bool = False
    ) -> list[MemoryObj | None]:
        """Each tier, in order, is asked for the keys the faster ones missed; lower-tier hits
        are written back (``write_back_now``: into every faster tier before this returns)."""
        clock = self._ledger.clock
        started = clock.begin()
        results: list[MemoryObj | None] = [None] * len(keys)
        try:
            missing = list(range(len(keys)))
            if len(self._ledger):
                for i, key in enumerate(keys):
                    newest = self._ledger.newest(key)
                    if newest is not None:
                        results[i] = newest.retain()
                missing = [i for i in missing if results[i] is None]
            deadline = time.monotonic() + self._timeout
            short = False
            for tier in self._tiers:
                if not missing:
                    break
                asked = self._to_ask(tier, keys, missing)
                if not asked:
                    continue
                got, short = await self.fetch(tier, [keys[i] for i in asked], deadline)
                hits = 0
                for i, obj in zip(asked, got, strict=True):
                    if obj is not None:
                        results[i] = obj
                        hits += 1
                missing = [i for i in missing if results[i] is None]
                if hits and tier.index and (self._promote or write_back_now):
                    found = [(keys[i], obj) for i in asked if (obj := results[i]) is not None]
                    await self.promotion.write_back(tier, found, started, now=write_back_now)
                if short:
                    break
            if missing:
                reason = "memory_short" if short else "absent"
                self._metrics.store_misses.labels(reason).inc(len(missing))
            return results
        except BaseException:
            for held in results:
                if held is not None:
                    held.release()
            raise
        finally:
            clock.end(started)

    async def read_into(self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]) -> list[bool]:
        """Each tier, in order, reads the keys the faster ones missed straight into ``dests``
        (the caller's memory, no memory budget in between); lower-tier hits are promoted in
        the background."""
        clock = self._ledger.clock
        started = clock.begin()
        try:
            found = [False] * len(keys)
            missing = list(range(len(keys)))
            if len(self._ledger):
                newest = {
                    i: obj for i in missing if (obj := self._ledger.newest(keys[i])) is not None
                }
                for i, obj in newest.items():  # the newest value: the tiers may hold an older one
                    found[i] = fill_into([obj.retain()], [dests[i]], [keys[i]])[0]
                missing = [i for i in missing if i not in newest]
            promotions: list[tuple[Tier, list[int]]] = []
            for tier in self._tiers:
                if not missing:
                    break
                asked = self._to_ask(tier, keys, missing)
                if not asked:
                    continue
                reading = tier.backend.batched_get_into(
                    [keys[i] for i in asked], [dests[i] for i in asked]
                )
                ok, hits = await self._guard.call(tier, "get", reading)
                if not ok or hits is None:
                    continue
                got = [i for i, hit in zip(asked, hits, strict=True) if hit]
                for i in got:
                    found[i] = True
                if got and tier.index and self._promote:
                    promotions.append((tier, got))
                missing = [i for i in missing if not found[i]]
            if missing:
                self._metrics.store_misses.labels("absent").inc(len(missing))
            for tier, got in promotions:
                nbytes = sum(dests[i].nbytes for i in got)
                self.promotion.schedule(tier, [keys[i] for i in got], nbytes, started)
            return found
        finally:
            clock.end(started)  # a promotion scheduled keeps the read open on its own

    async def exists(self, keys: list[CacheKey]) -> list[bool]:
        """Whether each key is present in some tier (or waits in the write-behind): each tier
        is asked once, in order, for the keys the faster ones did not have, and the slower
        ones are not asked once every key is found."""
        ledger = self._ledger
        present = [ledger.newest(key) is not None for key in keys]
        for tier in self._tiers:
            if all(present):
                break
            if not tier.available():
                continue
            # A value older than an accepted one does not count: that tier is not asked.
            asked = [
                n
                for n, there in enumerate(present)
                if not there and not ledger.skipped(keys[n], tier.index)
            ]
            if not asked:
                continue
            ok, found = await self._guard.call(
                tier, "contains", tier.backend.batched_exists([keys[n] for n in asked])
            )
            if ok and found is not None:
                for n, there in zip(asked, found, strict=True):
                    present[n] = there
        return present

    async def list_keys(self) -> AsyncIterator[CacheKey]:
        """Every key stored in some tier or waiting to be written, each once."""
        seen: set[CacheKey] = set()
        for key in self._ledger.outstanding():
            if self._ledger.newest(key) is not None:
                seen.add(key)
                yield key
        for tier in self._tiers:
            async for key in tier.backend.list_keys():
                if key not in seen and not self._ledger.skipped(key, tier.index):
                    seen.add(key)
                    yield key
