"""The Store's write path: a put stored in the first tier and queued for the lower ones,
accepted only once no tier that outlives this process can still serve an older value; and a
removal from the tiers and the write-behind."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvplug.errors import BackendUnavailable, CapacityExceeded
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.runtime.store.health import stored_keys
from kvplug.runtime.store.parts import StoreParts
from kvplug.runtime.store.tier import Tier


class Writes:
    """Puts and removals across the tiers."""

    def __init__(self, parts: StoreParts, *, wait: float) -> None:
        self._tiers = parts.tiers
        self._guard = parts.guard
        self._write_behind = parts.write_behind
        self._ledger = parts.ledger
        self._memory = parts.memory
        self._metrics = parts.metrics
        self._wait = wait

    # -- puts -----------------------------------------------------------------------------------

    async def offer(
        self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]
    ) -> tuple[list[bool], dict[int, str]]:
        """Whether each put was accepted, and why each key whose older value may survive was
        refused (see :meth:`~kvplug.runtime.store.Store.offer`)."""
        if len(keys) != len(objs):
            raise ValueError(f"a put got {len(keys)} keys but {len(objs)} objects.")
        for obj in objs:
            self._memory.saw(obj.nbytes)
        with self._ledger.clock.changing(keys):
            unsafe = await self._invalidate(keys, self._tiers[1:])
            in_first = await self._put_first(keys, objs)
            missed = [index for index, stored in enumerate(in_first) if not stored]
            if missed:  # the first tier may hold an older value of what it did not take
                failed = await self._invalidate([keys[i] for i in missed], self._tiers[:1])
                unsafe.update({missed[i]: reason for i, reason in failed.items()})
            if self._wait and len(self._tiers) > 1:
                await self._write_behind.room_for(sum(obj.phy_size for obj in objs))
            accepted = self._accept(keys, objs, in_first)
        accepted = [ok and index not in unsafe for index, ok in enumerate(accepted)]
        self._metrics.rejected.inc(accepted.count(False))
        return accepted, unsafe

    async def put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """:meth:`offer`, raising for the keys that were not accepted."""
        accepted, unsafe = await self.offer(keys, objs)
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

    async def _put_first(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> list[bool]:
        """Store in the first tier now; which keys it took."""
        first = self._tiers[0]
        first.offered.inc(len(keys))
        if not first.available():
            detail = f"skipped ({first.health.last_error})"
            self._guard.dropped(first, "tier_failing", detail, len(keys))
            return [False] * len(keys)
        return await self._put_in(first, keys, objs)

    async def _put_in(
        self, tier: Tier, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]
    ) -> list[bool]:
        nbytes = sum(obj.nbytes for obj in objs)
        try:
            put = tier.backend.batched_put(keys, objs)
            ok, _ = await self._guard.call(tier, "put", put, nbytes)
        except CapacityExceeded as error:
            stored = stored_keys(error, len(keys))
            if stored is None and len(keys) > 1:
                # Which keys fitted is unknown: each is offered once more on its own.
                return [
                    all(await self._put_in(tier, [k], [o])) for k, o in zip(keys, objs, strict=True)
                ]
            stored = stored or [False]
            self._guard.dropped(tier, "full", f"CapacityExceeded: {error}", stored.count(False))
            if any(stored):
                self._guard.wrote(tier)
            return stored
        if not ok:
            self._guard.dropped(tier, "tier_error", f"{tier.health.last_error}", len(keys))
            return [False] * len(keys)
        self._guard.wrote(tier)
        return [True] * len(keys)

    async def _invalidate(self, keys: Sequence[CacheKey], tiers: Sequence[Tier]) -> dict[int, str]:
        """Remove each key's value from each of ``tiers`` that outlives this process, now:
        once a newer value is accepted, no older one may survive there, not even a crash of
        this process before the write-behind got to it. Why it failed, by key index."""
        tiers = [tier for tier in tiers if tier.outlives_process()]
        failed: dict[int, str] = {}
        if not tiers:
            return failed

        async def invalidate(tier: Tier, index: int, key: CacheKey) -> None:
            self._ledger.cancel_write(key, tier.index)  # the older value queued is never written
            await self._write_behind.until_idle(key, tier)  # one being written lands first
            if not tier.available():
                failed[index] = f"{tier.name} is failing ({tier.health.last_error})"
                return
            ok, _ = await self._guard.call(tier, "remove", tier.backend.remove(key))
            if not ok:
                failed[index] = f"{tier.name}: {tier.health.last_error}"

        await asyncio.gather(
            *(invalidate(tier, index, key) for tier in tiers for index, key in enumerate(keys))
        )
        return failed

    def _accept(
        self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj], in_first: list[bool]
    ) -> list[bool]:
        """Queue each object for the lower tiers; whether each was accepted anywhere."""
        first, lower = self._tiers[0], self._tiers[1:]
        accepted = []
        for key, obj, stored in zip(keys, objs, in_first, strict=True):
            if stored:
                self._ledger.superseded(key, first.index)
            queued = self._write_behind.admit(key, obj, lower)
            if not stored and queued:
                # The first tier may hold an older value: it goes, readers skip it meanwhile.
                self._ledger.purge(key, first.index)
            accepted.append(stored or queued)
        return accepted

    # -- removals -------------------------------------------------------------------------------

    async def remove(self, key: CacheKey, selected: list[Tier], *, everywhere: bool) -> bool:
        """Remove ``key`` from the ``selected`` tiers (all of them: ``everywhere``) and from
        the write-behind; whether any held it. A tier that cannot be reached now removes it
        once it is back."""
        ledger = self._ledger
        with ledger.clock.changing([key]):
            # What a tier holds while a write or removal of the key is under way there is the
            # write-behind's business: it does not make the key present (a second remove is
            # False).
            unsettled = {tier.index for tier in selected if ledger.skipped(key, tier.index)}
            found = ledger.remove(key, [tier.index for tier in selected], everywhere=everywhere)

            async def remove_from(tier: Tier) -> bool:
                if tier.available():
                    ok, removed = await self._guard.call(tier, "remove", tier.backend.remove(key))
                    if ok:
                        return bool(removed) and tier.index not in unsettled
                ledger.purge(key, tier.index)
                return False

            results = await asyncio.gather(*(remove_from(tier) for tier in selected))
            ledger.settle(key)
        return found or any(results)
