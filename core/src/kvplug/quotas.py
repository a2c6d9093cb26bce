"""Per-tenant byte quotas of a size-capped tier: what each tenant may hold
(:class:`TenantQuotas`, the options ``tenant_quotas`` and ``default_tenant_quota``) and the
index that keeps to them (:class:`TenantQuotaIndex`).

A quota is both a cap and a guarantee: a tenant over its quota evicts its own entries first,
and one at or below it is never evicted for another tenant. :func:`make_index` gives a tier the
plain :class:`~kvplug.index.EvictableIndex` when no tenant has a quota (nothing is counted per
tenant then) and a :class:`TenantQuotaIndex` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, TypeVar

from kvplug.eviction import DEFAULT_PIN_TTL, DEFAULT_POLICY, EvictionPolicy, make_policy
from kvplug.index import EvictableIndex, Reservation
from kvplug.stats import TenantStats

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


UNTENANTED = "(none)"
"""The name the keys without a tenant are reported under (they have no quota)."""
OTHER_TENANTS = "(other)"
"""The name every tenant without a quota of its own in :attr:`TenantQuotas.named` is reported
under, summed (so that the number of reported tenants stays bounded)."""
REPORT_NAMES = (UNTENANTED, OTHER_TENANTS)
"""Names of reported groups, which no quota may be given to by name."""


@dataclass(frozen=True)
class TenantQuotas:
    """The byte quotas of the tenants of one size-capped tier (the options ``tenant_quotas``
    and ``default_tenant_quota``).

    A quota is both a cap and a guarantee: a tenant never holds more than its quota (its put
    evicts its own entries first, in policy order, and is refused when that cannot make room),
    and while it holds no more than its quota, none of its entries is evicted to make room for
    another tenant. ``named`` gives tenants their own quota; ``default`` applies to every other
    tenant (None: they have none). Keys without a tenant never have a quota: they use the room
    nobody is guaranteed, and go first when a tenant needs room. Bytes are counted as the tier
    counts them against its ``max_size``.

    Example::

        >>> quotas = TenantQuotas({"team-a": 2 << 30}, default=1 << 30)
        >>> quotas.quota_of("team-a"), quotas.quota_of("team-z"), quotas.quota_of("")
        (2147483648, 1073741824, None)
        >>> quotas.report_name("team-a"), quotas.report_name("team-z"), quotas.report_name("")
        ('team-a', '(other)', '(none)')
    """

    named: Mapping[str, int] = field(default_factory=dict)
    """Quotas in bytes by tenant name."""
    default: int | None = None
    """The quota of each tenant not in :attr:`named`; None: such tenants have no quota."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "named", MappingProxyType(dict(self.named)))

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.named.items())), self.default))

    @property
    def enabled(self) -> bool:
        """Whether any tenant has a quota."""
        return bool(self.named) or self.default is not None

    def quota_of(self, tenant: str) -> int | None:
        """The quota of ``tenant`` (``""``: keys without a tenant), None for none."""
        if not tenant:
            return None
        return self.named.get(tenant, self.default)

    def report_name(self, tenant: str) -> str:
        """The name ``tenant``'s counters are reported under: its own when it is in
        :attr:`named`, else :data:`OTHER_TENANTS`, or :data:`UNTENANTED` for ``""``."""
        if not tenant:
            return UNTENANTED
        return tenant if tenant in self.named else OTHER_TENANTS


def tenant_of_key(key: object) -> str:
    """The tenant of ``key``: its ``tenant`` attribute (:attr:`kvplug.keys.CacheKey.tenant`),
    ``""`` for none or for keys without one."""
    return getattr(key, "tenant", None) or ""


class _Share(Generic[K]):
    """One tenant's part of a :class:`TenantQuotaIndex`: its quota, its bytes, its keys in
    their eviction order, and the counters it reports into."""

    __slots__ = ("held", "objects", "policy", "quota", "reserved", "stats", "tenant")

    def __init__(
        self, tenant: str, quota: int | None, policy: EvictionPolicy[K], stats: TenantStats
    ) -> None:
        self.tenant = tenant
        self.quota = quota
        self.policy = policy
        self.stats = stats
        self.held = 0
        self.reserved = 0
        self.objects = 0

    @property
    def usage(self) -> int:
        """Bytes counted against its quota: held and reserved."""
        return self.held + self.reserved

    @property
    def guaranteed(self) -> bool:
        """Whether it is at or below its quota (so no other tenant's put evicts it)."""
        return self.quota is not None and self.usage <= self.quota

    @property
    def excess(self) -> int:
        """Bytes over its quota (all of them without one): who gives up room first."""
        return self.usage - (self.quota or 0)

    def gain(self, nbytes: int, objects: int = 0) -> None:
        self.held += nbytes
        self.objects += objects
        self.stats.bytes_held += nbytes
        self.stats.objects += objects


class _PolicyByShare(EvictionPolicy[K]):
    """The policy of a :class:`TenantQuotaIndex`: each key's uses go to its tenant's own
    policy, so that a tenant's entries are found in their order without walking others'."""

    name = "by-tenant"

    def __init__(self, share_of: dict[K, _Share[K]], shares: dict[str, _Share[K]]) -> None:
        self._share_of = share_of
        self._shares = shares

    def on_put(self, key: K) -> None:
        self._share_of[key].policy.on_put(key)

    def on_hit(self, key: K) -> None:
        share = self._share_of.get(key)
        if share is not None:
            share.policy.on_hit(key)

    def discard(self, key: K) -> None:
        share = self._share_of.get(key)
        if share is not None:
            share.policy.discard(key)

    def candidates(self) -> Iterator[K]:
        for share in list(self._shares.values()):
            yield from share.policy.candidates()

    def __len__(self) -> int:
        return len(self._share_of)

    def __contains__(self, key: object) -> bool:
        return key in self._share_of


class TenantQuotaIndex(EvictableIndex[K, V]):
    """An :class:`EvictableIndex` whose tenants have byte quotas (:class:`TenantQuotas`).

    ``tenant_of(key)`` names a key's tenant (default: :func:`tenant_of_key`, the ``tenant`` of
    a :class:`~kvplug.keys.CacheKey`; ``""`` for none). Each tenant's keys keep their own
    policy order. A tenant's bytes (stored and reserved) count against its quota, and the
    quota is both a cap and a guarantee:

    * **Own first.** :meth:`make_room` (and :meth:`reserve`) for a key whose tenant would go
      over its quota first evicts that tenant's own entries, in policy order; when that
      cannot make room (its entries are pinned, in use, or the object is larger than the
      quota) it answers False and :meth:`quota_refusal` says why.
    * **Guarantee.** When the tier as a whole is full, victims come first from the tenants
      that hold more than their quota or have none (the untenanted keys among them), the
      one most over first (without a quota, all its bytes count as over), then from the
      requesting tenant itself. A tenant at or below its quota is never evicted for another
      tenant's key. Eviction that no key asks for (:meth:`reclaim`, :meth:`evict_one`,
      :meth:`make_room` without ``replacing``: memory for objects in flight, trimming at
      open) takes guaranteed entries only when nothing else can go (quotas that add up to
      more than ``max_size``), the tenant that holds the most first.

    Pins, hold-offs and the owner's ``evictable`` predicate apply as in the base class.
    Counters per tenant (:class:`~kvplug.stats.TenantStats`, :meth:`tenant_stats`) are kept
    for the tenants named in the quotas, the others summed as :data:`OTHER_TENANTS` and the
    keys without a tenant as :data:`UNTENANTED`, so their number stays bounded. Choosing a
    victim costs one pass over the tenants holding entries.

    Example::

        >>> index = TenantQuotaIndex[str, str](
        ...     100, quotas=TenantQuotas({"a": 40, "b": 40}), tenant_of=lambda k: k[0]
        ... )
        >>> evict = lambda key, value: True
        >>> for key in ("a1", "a2", "b1"):
        ...     _ = index.make_room(20, evict, replacing=key)
        ...     index.put(key, key, 20)
        >>> index.make_room(20, evict, replacing="a3")  # "a" is at its quota: "a1" goes
        True
        >>> sorted(index), index.tenant_stats()["a"]["evictions"]
        (['a2', 'b1'], 1)
        >>> index.make_room(50, evict, replacing="a4")  # larger than a's quota
        False
        >>> index.quota_refusal("a4", 50)  # doctest: +ELLIPSIS
        "an object of 50 bytes is larger than tenant 'a''s quota of 40 bytes..."
    """

    tracks_tenants = True

    def __init__(
        self,
        max_size: int,
        policy: str = DEFAULT_POLICY,
        *,
        pin_ttl: float = DEFAULT_PIN_TTL,
        quotas: TenantQuotas,
        tenant_of: Callable[[K], str] = tenant_of_key,
    ) -> None:
        self.quotas = quotas
        """The quotas in force."""
        self._tenant_of = tenant_of
        self._shares: dict[str, _Share[K]] = {}
        self._share_of: dict[K, _Share[K]] = {}
        self._reported = {name: TenantStats(quota) for name, quota in quotas.named.items()}
        self._reported[OTHER_TENANTS] = TenantStats(quotas.default)
        self._reported[UNTENANTED] = TenantStats()
        # Whose key make_room is making room for while it runs (the base class's loop calls
        # _evict_one): None for eviction no key asked for.
        self._requester: _Share[K] | None = None
        super().__init__(max_size, policy, pin_ttl=pin_ttl)

    def _fresh_policy(self) -> EvictionPolicy[K]:
        return _PolicyByShare(self._share_of, self._shares)

    def _share(self, tenant: str) -> _Share[K]:
        """``tenant``'s share, made when it has none."""
        share = self._shares.get(tenant)
        if share is None:
            share = self._shares[tenant] = _Share(
                tenant,
                self.quotas.quota_of(tenant),
                make_policy(self.policy_name),
                self._reported[self.quotas.report_name(tenant)],
            )
        return share

    def _share_for(self, key: K) -> _Share[K]:
        share = self._share_of.get(key)
        return share if share is not None else self._share(self._tenant_of(key))

    def _retire(self, share: _Share[K]) -> None:
        """Forget ``share`` once it holds and reserves nothing (its counters stay)."""
        if not share.objects and not share.reserved and self._shares.get(share.tenant) is share:
            del self._shares[share.tenant]

    # -- changes ----------------------------------------------------------------------------

    def put(self, key: K, value: V, nbytes: int) -> V | None:
        share = self._share_of.get(key)
        if share is None:
            share = self._share_of[key] = self._share(self._tenant_of(key))
            share.gain(nbytes, 1)
        else:
            share.gain(nbytes - self._sizes[key])
        return super().put(key, value, nbytes)

    def update(self, key: K, value: V, nbytes: int) -> V:
        share = self._share_of[key]
        change = nbytes - self._sizes[key]
        old = super().update(key, value, nbytes)
        share.gain(change)
        return old

    def remove(self, key: K) -> V | None:
        share = self._share_of.get(key)
        if share is None:
            return None
        size = self._sizes[key]
        value = super().remove(key)
        del self._share_of[key]
        share.gain(-size, -1)
        self._retire(share)
        return value

    def clear(self) -> list[V]:
        values = super().clear()
        self._share_of.clear()
        for tenant, share in list(self._shares.items()):
            share.gain(-share.held, -share.objects)
            share.policy = make_policy(self.policy_name)
            if not share.reserved:
                del self._shares[tenant]
        return values

    def hit(self, key: K) -> V | None:
        value = super().hit(key)
        if value is not None:
            self._share_of[key].stats.hits += 1
        else:
            self.missed(key)
        return value

    def missed(self, key: K) -> None:
        self._reported[self.quotas.report_name(self._tenant_of(key))].misses += 1

    # -- room -------------------------------------------------------------------------------

    def make_room(
        self,
        nbytes: int,
        evict: Callable[[K, V], bool],
        *,
        replacing: K | None = None,
        evictable: Callable[[V], bool] | None = None,
    ) -> bool:
        if replacing is None:
            return super().make_room(nbytes, evict, evictable=evictable)
        share = self._requester = self._share_for(replacing)
        try:
            if self._room_in_quota(share, nbytes, evict, replacing, evictable) and (
                super().make_room(nbytes, evict, replacing=replacing, evictable=evictable)
            ):
                return True
            share.stats.refused += 1
            return False
        finally:
            self._requester = None
            self._retire(share)

    def reserve(
        self,
        nbytes: int,
        evict: Callable[[K, V], bool],
        *,
        replacing: K | None = None,
        evictable: Callable[[V], bool] | None = None,
    ) -> Reservation | None:
        reservation = super().reserve(nbytes, evict, replacing=replacing, evictable=evictable)
        if reservation is not None and replacing is not None:
            share = self._share_for(replacing)
            share.reserved += nbytes
            reservation.owner = share
        return reservation

    def cancel(self, reservation: Reservation) -> None:
        share = reservation.owner
        if not reservation.settled and isinstance(share, _Share):
            share.reserved -= reservation.nbytes
            reservation.owner = None
            super().cancel(reservation)
            self._retire(share)
        else:
            super().cancel(reservation)

    def _room_in_quota(
        self,
        share: _Share[K],
        nbytes: int,
        evict: Callable[[K, V], bool],
        replacing: K,
        evictable: Callable[[V], bool] | None,
    ) -> bool:
        """Evict ``share``'s own entries until ``nbytes`` more for ``replacing`` fit its
        quota; False when they cannot."""
        quota = share.quota
        if quota is None:
            return True
        if nbytes > quota:
            return False
        current = self._sizes.get(replacing, 0)
        while share.usage - current + nbytes > quota:
            candidates = share.policy.candidates()
            if self._evict_first(candidates, evict, replacing, evictable) is None:
                return False
        return True

    def _evict_one(
        self,
        evict: Callable[[K, V], bool],
        exclude: K | None,
        evictable: Callable[[V], bool] | None,
    ) -> int | None:
        return self._evict_for(self._requester, evict, exclude, evictable)

    def _evict_for(
        self,
        requester: _Share[K] | None,
        evict: Callable[[K, V], bool],
        exclude: K | None,
        evictable: Callable[[V], bool] | None,
    ) -> int | None:
        """Evict one victim for ``requester`` (None: for no tenant) in the order the class
        describes; its size, or None when none may go."""
        for share in self._victim_order(requester):
            freed = self._evict_first(share.policy.candidates(), evict, exclude, evictable)
            if freed is not None:
                return freed
        return None

    def _victim_order(self, requester: _Share[K] | None) -> list[_Share[K]]:
        shares = list(self._shares.values())
        order = sorted(
            (share for share in shares if not share.guaranteed),
            key=lambda share: share.excess,
            reverse=True,
        )
        if requester is None:
            guaranteed = (share for share in shares if share.guaranteed)
            order += sorted(guaranteed, key=lambda share: share.usage, reverse=True)
        elif requester.guaranteed:
            order.append(requester)
        return order

    def _drop_victim(self, key: K) -> int:
        self._share_of[key].stats.evictions += 1
        return super()._drop_victim(key)

    # -- reports ----------------------------------------------------------------------------

    def tenant_stats(self) -> dict[str, dict[str, int | None]]:
        return {name: stats.as_dict() for name, stats in self._reported.items()}

    def quota_refusal(self, key: K, nbytes: int) -> str | None:
        tenant = self._tenant_of(key)
        quota = self.quotas.quota_of(tenant)
        if quota is None:
            return None
        fix = (
            f"Raise tenant {tenant!r}'s quota (the tier's tenant_quotas or "
            "default_tenant_quota option)"
        )
        if nbytes > quota:
            return (
                f"an object of {nbytes} bytes is larger than tenant {tenant!r}'s quota of "
                f"{quota} bytes. {fix}, or store smaller chunks."
            )
        share = self._shares.get(tenant)
        usage = share.usage if share is not None else 0
        if usage - self._sizes.get(key, 0) + nbytes <= quota:
            return None
        return (
            f"tenant {tenant!r} holds {usage} bytes of its quota of {quota} bytes, and none of "
            f"its own entries that could make room for {nbytes} more may go (pinned, read or "
            f"being written now). {fix}, unpin its keys, or release what reads returned."
        )

    def guarantee_note(self, key: K) -> str:
        tenant = self._tenant_of(key)
        others = [s for s in self._shares.values() if s.guaranteed and s.tenant != tenant]
        if not others:
            return ""
        return (
            f"{sum(share.usage for share in others)} bytes belong to {len(others)} other "
            "tenants within their quotas, which are never evicted for another tenant (lower "
            "their quotas to leave more room to share)"
        )


def make_index(
    max_size: int,
    policy: str = DEFAULT_POLICY,
    *,
    pin_ttl: float = DEFAULT_PIN_TTL,
    quotas: TenantQuotas | None = None,
    tenant_of: Callable[[K], str] = tenant_of_key,
) -> EvictableIndex[K, V]:
    """A :class:`TenantQuotaIndex` when ``quotas`` gives some tenant a quota, else a plain
    :class:`EvictableIndex` (which costs nothing per tenant).

    >>> type(make_index(4096)).__name__, type(make_index(4096, quotas=TenantQuotas())).__name__
    ('EvictableIndex', 'EvictableIndex')
    >>> type(make_index(4096, quotas=TenantQuotas(default=1024))).__name__
    'TenantQuotaIndex'
    """
    if quotas is None or not quotas.enabled:
        return EvictableIndex(max_size, policy, pin_ttl=pin_ttl)
    return TenantQuotaIndex(max_size, policy, pin_ttl=pin_ttl, quotas=quotas, tenant_of=tenant_of)


__all__ = [
    "OTHER_TENANTS",
    "REPORT_NAMES",
    "UNTENANTED",
    "TenantQuotaIndex",
    "TenantQuotas",
    "make_index",
    "tenant_of_key",
]
