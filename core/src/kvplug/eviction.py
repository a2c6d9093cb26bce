"""Eviction policies: which stored key a size-capped tier gives up first.

A policy only orders keys; it never sees objects or sizes. The tier tells it what happens
(:meth:`~EvictionPolicy.on_put`, :meth:`~EvictionPolicy.on_hit`,
:meth:`~EvictionPolicy.discard`) and, when it needs room, walks
:meth:`~EvictionPolicy.candidates` from the best victim on, skipping keys it must keep (pinned
ones), evicts one, and :meth:`~EvictionPolicy.discard` s it. Tiers normally do all of this
through :class:`kvplug.index.EvictableIndex`, which adds the sizes, the capacity, the pins and
the choice of victims.

* ``lru`` (the default): least recently put or read first.
* ``lfu``: lowest number of uses first (a put counts one, each hit one more); among keys with
  the same count, the one that reached that count first.
* ``fifo``: oldest put first; reads change nothing.

:class:`kvplug.quotas.TenantQuotas` adds byte quotas per tenant on top of a policy: it says
what each tenant may hold, and so which entries are guaranteed.

Every operation is O(1) (LFU's :meth:`~EvictionPolicy.candidates` also sorts the distinct use
counts, of which there are few). Policies are not thread-safe: the tier's lock guards them.

Example::

    >>> from kvplug.eviction import make_policy
    >>> policy = make_policy("LRU")
    >>> for key in (1, 2, 3):
    ...     policy.on_put(key)
    >>> policy.on_hit(1)
    >>> list(policy.candidates())
    [2, 3, 1]
    >>> pinned = {2}
    >>> victim = next(k for k in policy.candidates() if k not in pinned)
    >>> policy.discard(victim)
    >>> victim, len(policy)
    (3, 2)
"""

from __future__ import annotations

import abc
import difflib
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator
from typing import Any, ClassVar, Generic, TypeVar

from kvplug.errors import ConfigError

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(abc.ABC, Generic[K]):
    """The order in which a tier evicts its keys.

    The owner reports every stored key with :meth:`on_put`, every read with :meth:`on_hit` and
    every removal (explicit or by eviction) with :meth:`discard`. :meth:`candidates` yields the
    tracked keys best victim first; the owner skips those it cannot evict. Do not change the
    policy while iterating :meth:`candidates`: pick a victim, stop, then :meth:`discard` it.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def on_put(self, key: K) -> None:
        """``key`` was stored; a put of a key already tracked counts as a use of it."""

    @abc.abstractmethod
    def on_hit(self, key: K) -> None:
        """``key`` was read. Untracked keys are ignored."""

    @abc.abstractmethod
    def discard(self, key: K) -> None:
        """Stop tracking ``key`` (removed or evicted). Untracked keys are ignored."""

    @abc.abstractmethod
    def candidates(self) -> Iterator[K]:
        """Every tracked key, in eviction order (best victim first)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many keys are tracked."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} keys)"


class LRUPolicy(EvictionPolicy[K]):
    """Least recently used first: puts and hits move a key to the back of the queue."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def on_put(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_hit(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def discard(self, key: K) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[K]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class FIFOPolicy(LRUPolicy[K]):
    """Oldest put first. Hits change nothing; a new put of a key makes it the newest."""

    name = "fifo"

    def on_hit(self, key: K) -> None:
        pass


class LFUPolicy(EvictionPolicy[K]):
    """Least frequently used first; among equals, the key that reached its count first.

    A put of a new key counts one use; every hit or repeated put one more. Keys live in one
    insertion-ordered bucket per use count, so each operation moves a key between two buckets.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._uses: dict[K, int] = {}
        self._buckets: dict[int, OrderedDict[K, None]] = {}

    def _bump(self, key: K, old: int) -> None:
        if old:
            bucket = self._buckets[old]
            del bucket[key]
            if not bucket:
                del self._buckets[old]
        self._uses[key] = old + 1
        self._buckets.setdefault(old + 1, OrderedDict())[key] = None

    def on_put(self, key: K) -> None:
        self._bump(key, self._uses.get(key, 0))

    def on_hit(self, key: K) -> None:
        uses = self._uses.get(key)
        if uses is not None:
            self._bump(key, uses)

    def discard(self, key: K) -> None:
        uses = self._uses.pop(key, None)
        if uses is not None:
            bucket = self._buckets[uses]
            del bucket[key]
            if not bucket:
                del self._buckets[uses]

    def candidates(self) -> Iterator[K]:
        for uses in sorted(self._buckets):
            yield from self._buckets[uses]

    def uses(self, key: K) -> int:
        """How many times ``key`` was put or hit since it was stored (0 if untracked)."""
        return self._uses.get(key, 0)

    def __len__(self) -> int:
        return len(self._uses)

    def __contains__(self, key: object) -> bool:
        return key in self._uses


POLICIES: dict[str, type[EvictionPolicy[Any]]] = {
    policy.name: policy for policy in (LRUPolicy, LFUPolicy, FIFOPolicy)
}
"""Policies by their (lower-case) name."""

DEFAULT_POLICY = "lru"
DEFAULT_PIN_TTL = 300.0
"""Seconds a pin lasts when neither the tier nor the call says otherwise."""


def check_policy_name(name: str) -> str:
    """The canonical (lower-case) form of ``name``; raises :class:`ConfigError` with a
    did-you-mean and the valid names when no policy has that name."""
    canonical = name.strip().lower() if isinstance(name, str) else ""
    if canonical in POLICIES:
        return canonical
    valid = sorted(POLICIES)
    close = difflib.get_close_matches(canonical, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"unknown eviction policy {name!r}: kvplug has no policy of that name.{hint} "
        f"Use one of: {', '.join(valid)} (case does not matter)."
    )


def make_policy(name: str = DEFAULT_POLICY) -> EvictionPolicy[K]:
    """A new, empty policy by name (``"lru"``, ``"lfu"``, ``"fifo"``; case-insensitive).

    Raises :class:`~kvplug.errors.ConfigError` naming the valid policies for an unknown name.
    """
    return POLICIES[check_policy_name(name)]()


class PinTable(Generic[K]):
    """Pins that expire: each ``pin`` holds a key for ``ttl`` seconds or until one ``unpin``.

    Not thread-safe by itself: tiers call it under the lock that guards their index.

    Example::

        >>> pins = PinTable[str]()
        >>> pins.pin("a", ttl=60.0)
        >>> pins.pin("a", ttl=60.0)
        >>> pins.unpin("a"), pins.is_pinned("a"), pins.unpin("a"), pins.unpin("a")
        (True, True, True, False)
    """

    def __init__(self) -> None:
        self._deadlines: dict[K, deque[float]] = {}

    def pin(self, key: K, ttl: float) -> None:
        self._deadlines.setdefault(key, deque()).append(time.monotonic() + ttl)

    def is_pinned(self, key: K, now: float | None = None) -> bool:
        """Whether ``key`` holds a pin that has not expired (expired ones are dropped)."""
        deadlines = self._deadlines.get(key)
        if deadlines is None:
            return False
        now = time.monotonic() if now is None else now
        while deadlines and deadlines[0] <= now:
            deadlines.popleft()
        if not deadlines:
            del self._deadlines[key]
            return False
        return True

    def unpin(self, key: K) -> bool:
        """Release the oldest live pin of ``key``; False when it holds none."""
        if not self.is_pinned(key):
            return False
        deadlines = self._deadlines[key]
        deadlines.popleft()
        if not deadlines:
            del self._deadlines[key]
        return True

    def discard(self, key: K) -> None:
        """Forget every pin of ``key`` (it was removed)."""
        self._deadlines.pop(key, None)

    def clear(self) -> None:
        self._deadlines.clear()

    def __len__(self) -> int:
        return len(self._deadlines)


__all__ = [
    "DEFAULT_PIN_TTL",
    "DEFAULT_POLICY",
    "POLICIES",
    "EvictionPolicy",
    "FIFOPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "PinTable",
    "check_policy_name",
    "make_policy",
]
