"""The Store's freshness rule, in one place: an older value of a key is never served after a
newer one was accepted, not even after a crash.

:class:`VersionLedger` holds, for each key with work outstanding, the newest accepted value and
what each tier still owes it: a write of that value, a removal of an older one, or an
operation in flight. Its methods are the only way a value is accepted, written back from a
lower tier, purged from a tier, taken by a write-behind worker or let go; readers ask it which
tiers may serve a key. :class:`ReadClock` tells a write-back whether its key changed while the
read that found it was running. (Across a crash the rule needs one more step, taken by the
write path before it accepts a put: tiers that outlive the process drop their older value
first, see :mod:`kvplug.runtime.store.writes`.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj

MAX_STALE_REMOVALS = 100_000
"""Removals of older values a tier may have queued; beyond them a skipped overwrite is counted
as ``untracked``."""
TRACKED_CHANGES = 4096
"""Changes remembered for reads in flight before those older than every open read are
forgotten."""


class LedgerInvariantError(AssertionError):
    """An invariant of :class:`VersionLedger` or :class:`ReadClock` was broken: a bug in the
    Store, never a failure of a tier."""


@dataclass(slots=True)
class PendingVersion:
    """What the write-behind still has to do for one key, by tier index."""

    value: MemoryObj | None
    """The newest accepted value (one reference held), or None once no tier needs it."""
    writes: set[int] = field(default_factory=set)
    """Tiers that have to store ``value``."""
    removals: set[int] = field(default_factory=set)
    """Tiers whose value of the key is older than the newest accepted one: removed there."""
    busy: set[int] = field(default_factory=set)
    """Tiers with an operation on this key in flight."""

    def queued(self, tier: int) -> bool:
        return tier in self.writes or tier in self.removals


class ReadClock:
    """Which keys changed while reads were in flight.

    A read notes when it began (:meth:`begin`); a put or a removal marks its keys before and
    after it runs (:meth:`changing`). A value the read found in a lower tier may be written
    back into the faster tiers only if its key did not change since (:meth:`changed_since`):
    it may be older than what that put accepted.
    """

    def __init__(self) -> None:
        self._changes = 0
        self._changed_at: dict[CacheKey, int] = {}
        self._open: Tally[int] = Tally()
        """Reads in flight, by the change count when each began."""
        self._changing: Tally[CacheKey] = Tally()

    @property
    def open_reads(self) -> int:
        """Reads in flight, each promotion that keeps its read open counted once more."""
        return self._open.total()

    def begin(self) -> int:
        """Open a read; what to pass to :meth:`changed_since` and :meth:`end`."""
        self._open[self._changes] += 1
        return self._changes

    def extend(self, started: int) -> None:
        """Keep the read that began at ``started`` open once more (a promotion that finishes
        its write-back after the read returned): :meth:`end` it once more."""
        if self._open[started] <= 0:
            raise LedgerInvariantError(f"no read that began at {started} is open to extend")
        self._open[started] += 1

    def end(self, started: int) -> None:
        if self._open[started] <= 0:
            raise LedgerInvariantError(f"no read that began at {started} is open to end")
        self._open[started] -= 1
        if not self._open[started]:
            del self._open[started]
        if not self._open:
            self._changed_at.clear()
        elif len(self._changed_at) > TRACKED_CHANGES:
            oldest = min(self._open)
            self._changed_at = {k: at for k, at in self._changed_at.items() if at > oldest}

    def changed_since(self, key: CacheKey, started: int) -> bool:
        """Whether a put or remove of ``key`` began after ``started`` or is under way."""
        return key in self._changing or self._changed_at.get(key, -1) > started

    @contextlib.contextmanager
    def changing(self, keys: Sequence[CacheKey]) -> Iterator[None]:
        """Mark ``keys`` as being put or removed, before and after."""
        for key in keys:
            self._note(key)
            self._changing[key] += 1
        try:
            yield
        finally:
            for key in keys:
                self._changing[key] -= 1
                if not self._changing[key]:
                    del self._changing[key]
                self._note(key)  # reads that began meanwhile must not undo it

    def _note(self, key: CacheKey) -> None:
        self._changes += 1
        if self._open:
            self._changed_at[key] = self._changes


class VersionLedger:
    """The versions the write-behind owes the tiers, keyed by cache key.

    Invariants, checked after every change (:class:`LedgerInvariantError` when broken):

    1. A tier never both owes a key's newest value and owes the removal of an older one.
    2. A tier is owed a write only while there is a value to write, and it is the newest
       accepted one: a newer value replaces it for every tier it is queued for.
    3. Each tier has at most ``max_removals`` removals queued; a removal beyond them is
       refused and reported to ``on_untracked``.
    4. A key is forgotten only when no tier owes it anything and nothing is in flight (or
       the store closed: :meth:`clear`).
    5. A value read from a lower tier is written back only for a key with nothing
       outstanding here and no put or removal since its read began (:meth:`write_back`,
       :meth:`may_write_back`): it is never taken for newer than an accepted value.
    6. While a tier owes a removal of a key or has an operation on it in flight, readers skip
       that tier for that key (:meth:`skipped`).

    ``on_queued(tier, key)`` is called when a tier that owed the key nothing now owes it a
    write or a removal (its worker has to pick the key up).
    """

    def __init__(
        self,
        on_queued: Callable[[int, CacheKey], None],
        on_untracked: Callable[[int], None],
        progress: asyncio.Event,
        *,
        max_removals: int = MAX_STALE_REMOVALS,
    ) -> None:
        self._entries: dict[CacheKey, PendingVersion] = {}
        self._removals: Tally[int] = Tally()
        self._on_queued = on_queued
        self._on_untracked = on_untracked
        self._progress = progress
        self._max_removals = max_removals
        self.queued_bytes = 0
        """Bytes of the values held (what the write-behind limit bounds)."""
        self.room_freed = asyncio.Event()
        """Set whenever a value is let go."""
        self.clock = ReadClock()

    # -- what readers may see -------------------------------------------------------------------

    def __len__(self) -> int:
        """Keys with something outstanding."""
        return len(self._entries)

    def newest(self, key: CacheKey) -> MemoryObj | None:
        """The newest accepted value of ``key`` while a tier still needs it (not retained)."""
        entry = self._entries.get(key)
        return entry.value if entry is not None else None

    def outstanding(self) -> list[CacheKey]:
        """The keys with something outstanding, now."""
        return list(self._entries)

    def skipped(self, key: CacheKey, tier: int) -> bool:
        """Whether ``tier``'s value of ``key`` may be older than one accepted since: readers
        do not ask that tier for it."""
        if not self._entries:
            return False
        entry = self._entries.get(key)
        return entry is not None and (tier in entry.removals or tier in entry.busy)

    def queued(self, key: CacheKey, tier: int) -> bool:
        """Whether ``tier`` owes ``key`` a write or a removal not yet taken."""
        entry = self._entries.get(key)
        return entry is not None and entry.queued(tier)

    def write_waiting(self, key: CacheKey, tier: int) -> bool:
        """Whether ``tier`` owes ``key`` a write that no operation in flight makes."""
        entry = self._entries.get(key)
        return entry is not None and tier in entry.writes and tier not in entry.busy

    def in_flight(self, key: CacheKey, tier: int) -> bool:
        """Whether a write or removal of ``key`` is under way on ``tier``."""
        entry = self._entries.get(key)
        return entry is not None and tier in entry.busy

    def held_bytes(self, key: CacheKey) -> int:
        entry = self._entries.get(key)
        return entry.value.phy_size if entry is not None and entry.value is not None else 0

    def removals_queued(self) -> int:
        """Removals of older values queued, over all tiers."""
        return sum(self._removals.values())

    def flushed(self, failing: Callable[[int], bool]) -> bool:
        """Nothing left to write or in flight, and no removal left but those owed by tiers
        that are ``failing``."""
        return all(
            not entry.writes and not entry.busy and all(failing(tier) for tier in entry.removals)
            for entry in self._entries.values()
        )

    def may_write_back(self, key: CacheKey, started: int) -> bool:
        """Whether a value of ``key`` that a read beginning at ``started`` found in a lower tier
        may be written into a faster one: nothing is outstanding for the key and no put or
        removal of it began since."""
        return key not in self._entries and not self.clock.changed_since(key, started)

    # -- accepting values -----------------------------------------------------------------------

    def accept(
        self,
        key: CacheKey,
        value: MemoryObj,
        queue_for: Sequence[int],
        purge_from: Sequence[int],
    ) -> None:
        """A newer ``value`` of ``key`` was accepted: ``queue_for`` tiers owe it a write, and
        ``purge_from`` tiers, which will not get it, owe the removal of their older value.
        Held only while some tier needs it; without ``queue_for``, an older value waiting here
        is neither served nor written any more."""
        if not set(queue_for).isdisjoint(purge_from):
            raise LedgerInvariantError(f"{key}: tiers both to write and to purge")
        entry = self._entries.get(key)
        if queue_for:
            entry = self._entry(key)
            self._set_value(entry, value)
            for tier in queue_for:
                queued = entry.queued(tier)
                if tier in entry.removals:
                    entry.removals.discard(tier)
                    self._removals[tier] -= 1
                entry.writes.add(tier)
                if not queued:
                    self._on_queued(tier, key)
        elif entry is not None:
            self._set_value(entry, None)
            entry.writes.clear()
        for tier in purge_from:
            self.purge(key, tier)
        entry = self._entries.get(key)
        if entry is not None:
            self._check(key, entry)
        self.settle(key)

    def write_back(self, key: CacheKey, value: MemoryObj, tier: int, started: int) -> bool:
        """Queue ``value``, found in a lower tier by a read that began at ``started``, for
        ``tier``; refused (False) unless :meth:`may_write_back`."""
        if not self.may_write_back(key, started):
            return False
        entry = self._entry(key)
        self._set_value(entry, value)
        entry.writes.add(tier)
        self._on_queued(tier, key)
        self._check(key, entry)
        return True

    def superseded(self, key: CacheKey, tier: int) -> None:
        """``tier`` took the newest value itself: a removal of its older value still queued
        would remove the newer one, and is dropped (one in flight lands first)."""
        entry = self._entries.get(key)
        if entry is not None and tier in entry.removals and tier not in entry.busy:
            entry.removals.discard(tier)
            self._removals[tier] -= 1

    def cancel_write(self, key: CacheKey, tier: int) -> None:
        """``tier`` will not be written the value queued for it (its older value is being
        removed instead)."""
        entry = self._entries.get(key)
        if entry is not None and tier in entry.writes:
            entry.writes.discard(tier)
            self.settle(key)

    # -- removing -------------------------------------------------------------------------------

    def purge(self, key: CacheKey, tier: int) -> None:
        """``tier`` owes the removal of its (older) value of ``key``; readers skip it there
        meanwhile. Past ``max_removals`` queued for the tier, refused: ``on_untracked``."""
        entry = self._entry(key)
        queued = entry.queued(tier)
        entry.writes.discard(tier)
        if tier in entry.removals:
            return
        if self._removals[tier] >= self._max_removals:
            self._on_untracked(tier)
            return
        entry.removals.add(tier)
        self._removals[tier] += 1
        if not queued:
            self._on_queued(tier, key)
        self._check(key, entry)

    def remove(self, key: CacheKey, tiers: Sequence[int], *, everywhere: bool) -> bool:
        """``key`` is being removed from ``tiers`` (every tier when ``everywhere``): no write of
        it is owed to them, one in flight is followed by a removal. Whether the newest value
        was held here (and so let go, ``everywhere``)."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        found = False
        if everywhere:
            found = entry.value is not None
            self._set_value(entry, None)
        entry.writes.difference_update(tiers)
        for tier in tiers:
            if tier in entry.busy:  # a write in flight lands after this removal
                self.purge(key, tier)
        self._check(key, entry)
        return found

    # -- the write-behind workers ---------------------------------------------------------------

    def take_removal(self, key: CacheKey, tier: int) -> bool:
        """Start the removal ``tier`` owes ``key``, if it owes one; :meth:`finish` it."""
        entry = self._entries.get(key)
        if entry is None or tier not in entry.removals:
            return False
        entry.removals.discard(tier)
        self._removals[tier] -= 1
        entry.busy.add(tier)
        return True

    def take_write(self, key: CacheKey, tier: int) -> MemoryObj | None:
        """Start the write ``tier`` is owed for ``key``, if any: the value, retained (the
        caller releases it); :meth:`finish` it."""
        entry = self._entries.get(key)
        if entry is None or tier not in entry.writes:
            return None
        value = entry.value
        if value is None:
            raise LedgerInvariantError(f"{key}: a write owed to tier {tier} with no value")
        entry.writes.discard(tier)
        entry.busy.add(tier)
        return value.retain()

    def finish(self, key: CacheKey, tier: int) -> None:
        """The operation taken on ``tier`` for ``key`` is over (whether it worked or not)."""
        entry = self._entries.get(key)
        if entry is not None:  # None only once the store closed
            entry.busy.discard(tier)
        self.settle(key)

    # -- letting go -----------------------------------------------------------------------------

    def settle(self, key: CacheKey) -> None:
        """Let go of ``key``'s value once no write needs it (removals may wait long for a
        failing tier), and of the key once nothing is owed or in flight for it."""
        entry = self._entries.get(key)
        if entry is None or entry.writes or entry.busy:
            return
        self._set_value(entry, None)
        if not entry.removals:
            del self._entries[key]
        self._progress.set()

    def settle_all(self) -> None:
        for key in list(self._entries):
            self.settle(key)

    def clear(self) -> None:
        """Let go of every value and key (the store closed)."""
        for entry in self._entries.values():
            self._set_value(entry, None)
        self._entries.clear()

    # -- internals ------------------------------------------------------------------------------

    def _entry(self, key: CacheKey) -> PendingVersion:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = PendingVersion(None)
        return entry

    def _set_value(self, entry: PendingVersion, value: MemoryObj | None) -> None:
        old = entry.value
        entry.value = value.retain() if value is not None else None
        self.queued_bytes += (value.phy_size if value is not None else 0) - (
            old.phy_size if old is not None else 0
        )
        if old is not None:
            old.release()
            self.room_freed.set()

    def _check(self, key: CacheKey, entry: PendingVersion) -> None:
        if not entry.writes.isdisjoint(entry.removals):
            raise LedgerInvariantError(
                f"{key}: tiers {sorted(entry.writes & entry.removals)} owe both a write and a "
                "removal"
            )
        if entry.writes and entry.value is None:
            raise LedgerInvariantError(f"{key}: writes owed to {sorted(entry.writes)}, no value")
