"""The index of a size-capped tier: what it stores, how many bytes, and what goes first.

An :class:`EvictableIndex` keeps, for each stored key, the owner's value (a memory object, a
file's description) and its size in bytes, against a byte capacity (``max_size``). It counts
the bytes held, the bytes reserved for writes still in flight and the bytes the owner says
live outside the index but count against the capacity (:attr:`~EvictableIndex.external_bytes`,
such as another process's temporary files). It owns the eviction policy
(:mod:`kvplug.eviction`, by name), the pins with their expiry
(:class:`~kvplug.eviction.PinTable`) and the choice of victims.

The index never frees anything itself. When room is needed
(:meth:`~EvictableIndex.make_room`, :meth:`~EvictableIndex.reserve`,
:meth:`~EvictableIndex.reclaim`), it walks the policy's candidates, skips the key being
replaced, pinned keys, keys held off after a failed eviction
(:meth:`~EvictableIndex.hold_off`) and values the owner's ``evictable`` predicate rejects, and
calls the owner's ``evict(key, value)``: the owner frees the victim (releases the memory,
deletes the file) and returns True, and the index drops the entry; or it returns False (the
file could not be deleted, the key is busy) and the index goes on with the next candidate. It
raises nothing when no room can be made: it answers False or None, and the owner raises its
own :class:`~kvplug.errors.CapacityExceeded` with what it knows.

With per-tenant quotas (:class:`~kvplug.quotas.TenantQuotas`), :func:`kvplug.quotas.make_index`
gives a :class:`~kvplug.quotas.TenantQuotaIndex`: each tenant's bytes count against its quota, a
tenant over it evicts its own entries first, and one at or below it is never evicted for
another tenant; counters per tenant come from :meth:`~EvictableIndex.tenant_stats`.

Not thread-safe by itself, like the policies: the owner's lock guards every call, the
``evict`` callbacks included.

Example::

    >>> from kvplug.index import EvictableIndex
    >>> index = EvictableIndex[str, bytes](max_size=10, policy="lru")
    >>> index.put("a", b"aaaa", 4)
    >>> index.put("b", b"bbbb", 4)
    >>> index.hit("a")
    b'aaaa'
    >>> freed = []
    >>> def evict(key, value):
    ...     freed.append(key)  # the owner frees the value here
    ...     return True
    >>> index.make_room(4, evict)  # 8 + 4 > 10: "b" (least recently used) goes
    True
    >>> freed, index.bytes_held
    (['b'], 4)
    >>> index.pin("a")
    True
    >>> index.make_room(8, evict)  # only a pinned key is left
    False
    >>> writing = index.reserve(4, evict)  # a write in flight holds its bytes until committed
    >>> index.free_bytes
    2
    >>> index.commit(writing, "c", b"cccc")
    >>> sorted(index), index.bytes_held, index.reserved
    (['a', 'c'], 8, 0)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

from kvplug.eviction import (
    DEFAULT_PIN_TTL,
    DEFAULT_POLICY,
    EvictionPolicy,
    PinTable,
    check_policy_name,
    make_policy,
)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Reservation:
    """Bytes set aside for one write in flight, from :meth:`EvictableIndex.reserve` until
    :meth:`EvictableIndex.commit` stores the value or :meth:`EvictableIndex.cancel` gives the
    bytes back."""

    __slots__ = ("nbytes", "owner", "settled")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        """The bytes reserved (and the size the committed value is stored with)."""
        self.settled = False
        """Whether it was committed or cancelled (its bytes no longer count as reserved)."""
        self.owner: object = None
        """Whose quota the bytes count against meanwhile
        (:class:`~kvplug.quotas.TenantQuotaIndex`)."""

    def __repr__(self) -> str:
        state = "settled" if self.settled else "open"
        return f"Reservation({self.nbytes} bytes, {state})"


class EvictableIndex(Generic[K, V]):
    """Keys to values with sizes in bytes, under a byte capacity, with eviction and pins.

    ``max_size``: the capacity in bytes; ``policy``: an eviction policy's name (``lru``,
    ``lfu``, ``fifo``; case does not matter; an unknown name raises
    :class:`~kvplug.errors.ConfigError`); ``pin_ttl``: seconds a :meth:`pin` lasts unless the
    call gives its own.

    The capacity is a promise about what the owner asks for, not a check on :meth:`put`:
    make room first (:meth:`make_room` or :meth:`reserve`), then :meth:`put` or
    :meth:`commit`. Replacing a key keeps its pins; removing it drops them.

    ``evict`` callbacks receive ``(key, value)`` of a victim, must free it and return True,
    or return False to have it skipped this time (after :meth:`hold_off` when it should be
    skipped for a while). They must not change the index otherwise; an exception they raise
    propagates with the entry still stored. ``evictable`` predicates receive the value.
    Values are never None (None means absent).
    """

    def __init__(
        self, max_size: int, policy: str = DEFAULT_POLICY, *, pin_ttl: float = DEFAULT_PIN_TTL
    ) -> None:
        self.max_size = max_size
        """The capacity in bytes."""
        self.policy_name = check_policy_name(policy)
        """The eviction policy's canonical name."""
        self.pin_ttl = pin_ttl
        """Seconds a pin lasts when :meth:`pin` is not given a ``ttl``."""
        self.external_bytes = 0
        """Bytes outside the index that count against :attr:`max_size` (another writer's
        temporary files, say); the owner adds and subtracts them."""
        self._values: dict[K, V] = {}
        self._sizes: dict[K, int] = {}
        self._policy: EvictionPolicy[K] = self._fresh_policy()
        self._pins: PinTable[K] = PinTable()
        self._hold_offs: dict[K, float] = {}
        self._bytes_held = 0
        self._reserved = 0

    # -- what is stored ---------------------------------------------------------------------

    @property
    def bytes_held(self) -> int:
        """Bytes of the stored values (the sizes they were stored with)."""
        return self._bytes_held

    @property
    def reserved(self) -> int:
        """Bytes reserved for writes in flight (open :class:`Reservation` s)."""
        return self._reserved

    @property
    def used(self) -> int:
        """Bytes that count against :attr:`max_size`: held, reserved and external."""
        return self._bytes_held + self._reserved + self.external_bytes

    @property
    def free_bytes(self) -> int:
        """:attr:`max_size` less :attr:`used` (negative while over capacity)."""
        return self.max_size - self.used

    @property
    def pinned_keys(self) -> int:
        """How many keys hold pins. Expired pins are dropped lazily (when a key's pins are
        looked at), so this may count keys whose pins have expired since."""
        return len(self._pins)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[K]:
        """The stored keys, in no particular order (do not change the index meanwhile)."""
        return iter(self._values)

    def get(self, key: K) -> V | None:
        """The value stored under ``key``, or None; the policy sees no use."""
        return self._values.get(key)

    def hit(self, key: K) -> V | None:
        """The value stored under ``key``, counted as a use by the policy; None when absent."""
        value = self._values.get(key)
        if value is not None:
            self._policy.on_hit(key)
        return value

    def nbytes(self, key: K) -> int:
        """The size ``key`` was stored with; raises KeyError when it is not stored."""
        return self._sizes[key]

    def __repr__(self) -> str:
        return (
            f"EvictableIndex({len(self._values)} keys, {self._bytes_held} of {self.max_size} "
            f"bytes held, {self._reserved} reserved, {self.policy_name})"
        )

    # -- changes ----------------------------------------------------------------------------

    def put(self, key: K, value: V, nbytes: int) -> V | None:
        """Store ``value`` of ``nbytes`` bytes under ``key`` as a use of it by the policy, and
        return the value it replaces (None if new). Makes no room: call :meth:`make_room`
        first. A replaced key keeps its pins and loses any :meth:`hold_off`."""
        old = self._values.get(key)
        if old is not None:
            self._bytes_held -= self._sizes[key]
            if self._hold_offs:
                self._hold_offs.pop(key, None)
        self._values[key] = value
        self._sizes[key] = nbytes
        self._bytes_held += nbytes
        self._policy.on_put(key)
        return old

    def update(self, key: K, value: V, nbytes: int) -> V:
        """Describe the stored ``key`` anew (its value and size changed behind the owner's
        back) without counting a use; pins and :meth:`hold_off` stay. Returns the old value;
        raises KeyError when ``key`` is not stored."""
        old = self._values[key]
        self._bytes_held += nbytes - self._sizes[key]
        self._values[key] = value
        self._sizes[key] = nbytes
        return old

    def remove(self, key: K) -> V | None:
        """Drop ``key`` with its pins and return its value; None when it was not stored."""
        value = self._values.pop(key, None)
        if value is None:
            return None
        self._bytes_held -= self._sizes.pop(key)
        self._policy.discard(key)
        self._pins.discard(key)
        if self._hold_offs:
            self._hold_offs.pop(key, None)
        return value

    def clear(self) -> list[V]:
        """Drop every entry, pin, hold-off and external byte, start the policy afresh, and
        return the values that were stored (for the owner to release). Open reservations stay:
        their writes still commit or cancel."""
        values = list(self._values.values())
        self._values.clear()
        self._sizes.clear()
        self._pins.clear()
        self._hold_offs.clear()
        self._policy = self._fresh_policy()
        self._bytes_held = 0
        self.external_bytes = 0
        return values

    # -- pins -------------------------------------------------------------------------------

    def pin(self, key: K, ttl: float | None = None) -> bool:
        """Keep the stored ``key`` from eviction for ``ttl`` seconds (default :attr:`pin_ttl`)
        or until one :meth:`unpin`; pins count. False when ``key`` is not stored."""
        if key not in self._values:
            return False
        self._pins.pin(key, self.pin_ttl if ttl is None else ttl)
        return True

    def unpin(self, key: K) -> bool:
        """Release the oldest live pin of ``key``; False when it holds none."""
        return self._pins.unpin(key)

    def is_pinned(self, key: K) -> bool:
        """Whether ``key`` holds a pin that has not expired."""
        return self._pins.is_pinned(key)

    # -- eviction ---------------------------------------------------------------------------

    def hold_off(self, key: K, seconds: float) -> None:
        """Skip the stored ``key`` as a victim for ``seconds`` (its eviction failed); a
        :meth:`put` of the key ends it. Safe to call from an ``evict`` callback."""
        if key in self._values:
            self._hold_offs[key] = time.monotonic() + seconds

    def held_off(self) -> list[K]:
        """The keys eviction skips now because of :meth:`hold_off`."""
        now = time.monotonic()
        return [key for key, until in self._hold_offs.items() if until > now]

    def make_room(
        self,
        nbytes: int,
        evict: Callable[[K, V], bool],
        *,
        replacing: K | None = None,
        evictable: Callable[[V], bool] | None = None,
    ) -> bool:
        """Evict in policy order until ``nbytes`` more bytes fit under :attr:`max_size`;
        False when the candidates run out first (what was evicted stays evicted).

        ``replacing``: the key the new bytes are for (stored already or not); it is never
        evicted, its current bytes count as free, and with quotas
        (:class:`~kvplug.quotas.TenantQuotaIndex`) its tenant's quota applies."""
        # free_bytes, inline: two property calls cost a tenth of a cpu put.
        free = self.max_size - self._bytes_held - self._reserved - self.external_bytes
        if nbytes <= free:
            return True  # the common case, without looking ``replacing`` up
        if replacing is not None:
            free += self._sizes.get(replacing, 0)
        while nbytes > free:
            freed = self._evict_one(evict, replacing, evictable)
            if freed is None:
                return False
            free += freed
        return True

    def reserve(
        self,
        nbytes: int,
        evict: Callable[[K, V], bool],
        *,
        replacing: K | None = None,
        evictable: Callable[[V], bool] | None = None,
    ) -> Reservation | None:
        """:meth:`make_room` for ``nbytes``, then set them aside for a write in flight until
        :meth:`commit` or :meth:`cancel`; None when there is no room."""
        if not self.make_room(nbytes, evict, replacing=replacing, evictable=evictable):
            return None
        self._reserved += nbytes
        return Reservation(nbytes)

    def commit(self, reservation: Reservation, key: K, value: V) -> V | None:
        """End ``reservation`` by storing ``value`` under ``key`` with its bytes (see
        :meth:`put`); returns the replaced value. Raises ValueError when it already ended."""
        if reservation.settled:
            raise ValueError(f"{reservation} was already committed or cancelled.")
        self.cancel(reservation)
        return self.put(key, value, reservation.nbytes)

    def cancel(self, reservation: Reservation) -> None:
        """Give the bytes of ``reservation`` back (the write failed); once is enough, a second
        call does nothing."""
        if not reservation.settled:
            reservation.settled = True
            self._reserved -= reservation.nbytes

    def evict_one(
        self,
        evict: Callable[[K, V], bool],
        *,
        exclude: K | None = None,
        evictable: Callable[[V], bool] | None = None,
    ) -> bool:
        """Evict the policy's first candidate that may go (see the class); False when none
        did."""
        return self._evict_one(evict, exclude, evictable) is not None

    def reclaim(
        self,
        nbytes: int,
        evict: Callable[[K, V], bool],
        *,
        evictable: Callable[[V], bool] | None = None,
    ) -> int:
        """Evict in policy order until at least ``nbytes`` bytes were freed or no candidate is
        left, whatever the capacity; the bytes freed."""
        freed = 0
        while freed < nbytes:
            size = self._evict_one(evict, None, evictable)
            if size is None:
                break
            freed += size
        return freed

    def _evict_one(
        self,
        evict: Callable[[K, V], bool],
        exclude: K | None,
        evictable: Callable[[V], bool] | None,
    ) -> int | None:
        """Evict one victim; its size, or None when no candidate could go."""
        return self._evict_first(self._policy.candidates(), evict, exclude, evictable)

    def _evict_first(
        self,
        candidates: Iterator[K],
        evict: Callable[[K, V], bool],
        exclude: K | None,
        evictable: Callable[[V], bool] | None,
    ) -> int | None:
        """Evict the first of ``candidates`` that may go; its size, or None when none did."""
        now = time.monotonic()
        pins = self._pins
        hold_offs = self._hold_offs
        victim = None
        for key in candidates:
            if key == exclude or pins.is_pinned(key, now):
                continue
            if hold_offs:
                until = hold_offs.get(key)
                if until is not None:
                    if until > now:
                        continue
                    del hold_offs[key]
            value = self._values[key]
            if evictable is not None and not evictable(value):
                continue
            if evict(key, value):
                victim = key
                break
        if victim is None:
            return None
        return self._drop_victim(victim)

    def _drop_victim(self, key: K) -> int:
        """Remove the evicted ``key``; its size."""
        size = self._sizes[key]
        self.remove(key)
        return size

    def _fresh_policy(self) -> EvictionPolicy[K]:
        return make_policy(self.policy_name)

    # -- tenants (counted by kvplug.quotas.TenantQuotaIndex; nothing to count here) ---------

    tracks_tenants: bool = False
    """Whether the index counts per tenant (:class:`~kvplug.quotas.TenantQuotaIndex`): owners
    skip the calls below (and the lock they would take) when it does not."""

    def missed(self, key: K) -> None:
        """A read of ``key`` found nothing (counted per tenant with quotas; :meth:`hit`
        counts its own misses)."""

    def tenant_stats(self) -> dict[str, dict[str, int | None]]:
        """Each reported tenant's :class:`~kvplug.stats.TenantStats`, by name; empty without
        quotas."""
        return {}

    def quota_refusal(self, key: K, nbytes: int) -> str | None:
        """Why ``nbytes`` for ``key`` do not fit its tenant's quota, with the fix, when that is
        why no room could be made; None otherwise (and always without quotas)."""
        return None

    def guarantee_note(self, key: K) -> str:
        """A clause for a "tier full" message: the bytes guaranteed to tenants other than
        ``key``'s, which were not evicted for it; ``""`` when there are none."""
        return ""


class PinsInIndex:
    """``_unpin`` and ``is_pinned`` of a backend whose pins live in its
    :class:`EvictableIndex` (``self._index``), guarded by ``self._lock``: a mixin, listed
    before the backend base (``class MyTier(PinsInIndex, Backend)``). ``_pin`` stays the
    backend's, since finding the key may take I/O."""

    _lock: threading.Lock
    _index: EvictableIndex[Any, Any]

    async def _unpin(self, key: Any) -> bool:
        """Release the oldest live pin of ``key``; False when none is left (never raises for an
        absent or unpinned key)."""
        with self._lock:
            return self._index.unpin(key)

    def is_pinned(self, key: Any) -> bool:
        """Whether ``key`` holds a pin that has not expired."""
        with self._lock:
            return self._index.is_pinned(key)


__all__ = [
    "EvictableIndex",
    "PinsInIndex",
    "Reservation",
]
