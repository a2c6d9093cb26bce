"""The Store's metrics: Prometheus metrics with ``kvplug[metrics]``, plain counters without it.

:class:`StoreMetrics` holds every metric of one :class:`~kvplug.runtime.store.Store` in a registry
of
its own. What each tier's operations did (calls, errors, keys, hits, misses, bytes, latency, by
tier and operation: ``kvplug_tier_<counter>_total{tier, op}`` and the histogram
``kvplug_tier_op_seconds{tier, op}``) is not counted here: it is read, when asked, from each
tier's own :meth:`~kvplug.backend.Backend.operation_stats` (:mod:`kvplug.stats`), the one set of
counters every report of kvplug reads. The Store counts only what is its own: puts offered and
dropped per tier, misses by reason, the write-behind and the memory budget. A tier with
per-tenant quotas adds its tenants' series, read the same way from its ``tenant_stats()``
(:meth:`StoreMetrics.watch_tenants`): ``kvplug_tier_tenant_<counter>{tier, tenant}``, for the
tenants its quotas name, ``(other)`` and ``(none)`` (so their number stays bounded).

With prometheus-client installed (``pip install 'kvplug[metrics]'``) they are Prometheus
metrics and :meth:`StoreMetrics.exposition` renders them in the text exposition format. Without
it the same objects count in process (``Store.stats()`` is unchanged) and
:meth:`StoreMetrics.exposition` says how to install the extra.

Example::

    >>> from kvplug.stats import OperationStats
    >>> metrics = StoreMetrics(lambda: {"0:cpu://": {"get": OperationStats(calls=2, hits=2)}})
    >>> metrics.offered.labels("0:cpu://").inc(2)
    >>> metrics.value("kvplug_tier_offered_puts_total", tier="0:cpu://")
    2.0
    >>> metrics.value("kvplug_tier_hits_total", tier="0:cpu://", op="get")
    2.0
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

from kvplug.errors import KvplugError
from kvplug.stats import LATENCY_BUCKETS, OperationStats

TierStats = Callable[[], Mapping[str, Mapping[str, OperationStats]]]
"""Each tier's :meth:`~kvplug.backend.Backend.operation_stats`, by tier name."""
TenantsByTier = Callable[[], Mapping[str, Mapping[str, Mapping[str, int | None]]]]
"""Each tier's per-tenant counters (``tenant_stats()``), by tier name, then tenant."""

TIER_COUNTERS = {
    "calls": "finished calls of the tier's operation",
    "errors": "calls of the tier's operation that raised",
    "keys": "keys handled by calls of the tier's operation that returned",
    "hits": "keys the tier's operation found",
    "misses": "keys the tier's operation did not find",
    "bytes": "bytes the tier's operation stored, or read for its hits",
}
"""The counters of :class:`~kvplug.stats.OperationStats` exported per tier and operation, as
``kvplug_tier_<name>_total{tier, op}``."""
LATENCY_METRIC = "kvplug_tier_op_seconds"
TENANT_GAUGES = {
    "quota": ("kvplug_tier_tenant_quota_bytes", "the tenant's byte quota in the tier"),
    "bytes_held": ("kvplug_tier_tenant_bytes", "bytes the tier holds for the tenant"),
    "objects": ("kvplug_tier_tenant_objects", "objects the tier holds for the tenant"),
}
"""The per-tenant gauges: :class:`~kvplug.stats.TenantStats` field -> (metric, help)."""
TENANT_COUNTERS = {
    "hits": ("kvplug_tier_tenant_hits", "reads of the tenant's keys that found them"),
    "misses": ("kvplug_tier_tenant_misses", "reads of the tenant's keys that did not"),
    "evictions": ("kvplug_tier_tenant_evictions", "the tenant's entries evicted"),
    "refused": ("kvplug_tier_tenant_refused_puts", "the tenant's puts no room was made for"),
}
"""The per-tenant counters (``<metric>_total``): field -> (metric, help)."""


@functools.cache
def prometheus() -> ModuleType | None:
    """prometheus_client (the ``metrics`` extra), or None when it is not installed."""
    try:
        import prometheus_client
    except ImportError:
        return None
    return prometheus_client


class _Samples:
    """Samples by (name, labels): the in-process stand-in for a Prometheus registry."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.functions: dict[tuple[str, tuple[tuple[str, str], ...]], Callable[[], float]] = {}
        self.lock = threading.Lock()

    def add(self, name: str, labels: tuple[tuple[str, str], ...], amount: float) -> None:
        with self.lock:
            self.values[name, labels] = self.values.get((name, labels), 0.0) + amount

    def set(self, name: str, labels: tuple[tuple[str, str], ...], value: float) -> None:
        with self.lock:
            self.values[name, labels] = value

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        key = (name, tuple(sorted((labels or {}).items())))
        function = self.functions.get(key)
        if function is not None:
            return float(function())
        return self.values.get(key)


class _Series:
    """A plain metric, or one labelled series of it (:meth:`labels`): the subset of
    prometheus-client's API the Store uses (``labels``, ``inc``, ``set``, ``set_function``)."""

    def __init__(
        self,
        samples: _Samples,
        name: str,
        labelnames: Sequence[str],
        labels: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._samples = samples
        self._name = name
        self._labelnames = tuple(labelnames)
        self._labels = labels

    def labels(self, *values: str) -> _Series:
        labels = tuple(sorted(zip(self._labelnames, values, strict=True)))
        return _Series(self._samples, self._name, (), labels)

    def inc(self, amount: float = 1.0) -> None:
        self._samples.add(self._name + "_total", self._labels, amount)

    def set(self, value: float) -> None:
        self._samples.set(self._name, self._labels, value)

    def set_function(self, function: Callable[[], float]) -> None:
        self._samples.functions[self._name, self._labels] = function


class StoreMetrics:
    """The Store's metrics, in a registry of its own (Prometheus', or plain counters); the
    tiers' operation series are read from ``tier_stats`` when asked."""

    def __init__(self, tier_stats: TierStats) -> None:
        self.prometheus = prometheus()
        self.tier_stats = tier_stats
        self.tenants_by_tier: TenantsByTier = lambda: {}
        if self.prometheus is not None:
            self.registry: Any = self.prometheus.CollectorRegistry()
            self.registry.register(_TierOperations(tier_stats))
        else:
            self.registry = _Samples()
        tier = ["tier"]
        self.offered = self._counter(
            "kvplug_tier_offered_puts",
            "puts routed to the tier: written, queued or dropped",
            tier,
        )
        self.dropped = self._counter(
            "kvplug_tier_dropped_puts",
            "accepted puts that did not reach the tier, by reason",
            ["tier", "reason"],
        )
        self.healthy = self._gauge("kvplug_tier_healthy", "1 when the tier is serving", tier)
        self.queue_depth = self._gauge("kvplug_tier_queue_depth", "keys waiting for the tier", tier)
        self.store_misses = self._counter(
            "kvplug_store_misses", "keys no tier returned, by reason", ["reason"]
        )
        self.rejected = self._counter("kvplug_store_rejected_puts", "puts no tier accepted")
        self.promotions_skipped = self._counter(
            "kvplug_store_promotions_skipped",
            "lower-tier hits not written back: promotions in flight held their byte limit",
        )
        self.memory_waits = self._counter(
            "kvplug_store_memory_waits", "times a get waited for room in the memory budget"
        )
        self.write_behind_bytes = self._gauge(
            "kvplug_store_write_behind_bytes", "bytes of objects waiting for lower tiers"
        )
        self.write_behind_limit = self._gauge(
            "kvplug_store_write_behind_limit_bytes", "most bytes that may wait for lower tiers"
        )
        self.memory_used = self._gauge(
            "kvplug_store_memory_used_bytes", "bytes in use in the memory budget"
        )
        self.memory_budget = self._gauge(
            "kvplug_store_memory_budget_bytes", "size of the memory budget"
        )

    def _make(self, kind: str, name: str, documentation: str, labels: Sequence[str]) -> Any:
        if self.prometheus is None:
            return _Series(self.registry, name, labels)
        cls = getattr(self.prometheus, kind)
        return cls(name, documentation, list(labels), registry=self.registry)

    def _counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Any:
        return self._make("Counter", name, documentation, labels)

    def _gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Any:
        return self._make("Gauge", name, documentation, labels)

    def watch_tenants(self, tenants_by_tier: TenantsByTier) -> None:
        """Export the tiers' per-tenant counters, read from ``tenants_by_tier`` at each
        scrape (once per Store, when it opens)."""
        self.tenants_by_tier = tenants_by_tier
        if self.prometheus is not None:
            self.registry.register(_TenantSeries(tenants_by_tier))

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (``name`` as Prometheus names samples, e.g.
        ``kvplug_tier_hits_total``); 0.0 before the first count."""
        if name.startswith("kvplug_tier_") and ("op" in labels or "tenant" in labels):
            samples = _tier_samples(self.tier_stats) if "op" in labels else self._tenant_samples()
            for sample, sample_labels, value in samples:
                if sample == name and sample_labels == labels:
                    return value
            return 0.0
        return self.registry.get_sample_value(name, labels) or 0.0

    def _tenant_samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        for tier, tenant, field, value in _tenant_values(self.tenants_by_tier()):
            if field in TENANT_GAUGES:
                yield TENANT_GAUGES[field][0], {"tier": tier, "tenant": tenant}, value
            else:
                yield f"{TENANT_COUNTERS[field][0]}_total", {"tier": tier, "tenant": tenant}, value

    def exposition(self) -> str:
        """Every metric in Prometheus' text exposition format."""
        if self.prometheus is None:
            raise KvplugError(
                "Prometheus metrics need prometheus-client, which is not installed. It comes "
                "with kvplug's 'metrics' extra: pip install 'kvplug[metrics]'. Store.stats() "
                "gives the same counters without it."
            )
        return str(self.prometheus.generate_latest(self.registry).decode())


def _tier_samples(tier_stats: TierStats) -> Iterator[tuple[str, dict[str, str], float]]:
    """Every sample of the tiers' operation series: ``(name, labels, value)``."""
    for tier, operations in tier_stats().items():
        for op, stats in sorted(operations.items()):
            labels = {"tier": tier, "op": op}
            for counter in TIER_COUNTERS:
                yield f"kvplug_tier_{counter}_total", labels, float(getattr(stats, counter))
            yield f"{LATENCY_METRIC}_count", labels, float(stats.calls)
            yield f"{LATENCY_METRIC}_sum", labels, stats.seconds


def _tenant_values(
    by_tier: Mapping[str, Mapping[str, Mapping[str, int | None]]],
) -> Iterator[tuple[str, str, str, float]]:
    """``(tier, tenant, field, value)`` of each exported per-tenant counter (a tenant without
    a quota has no quota sample)."""
    for tier, tenants in by_tier.items():
        for tenant, counters in sorted(tenants.items()):
            for field in (*TENANT_GAUGES, *TENANT_COUNTERS):
                value = counters.get(field)
                if value is not None:
                    yield tier, tenant, field, float(value)


class _TenantSeries:
    """A Prometheus collector of the tiers' per-tenant series, read at each scrape."""

    def __init__(self, tenants_by_tier: TenantsByTier) -> None:
        self.tenants_by_tier = tenants_by_tier

    def describe(self) -> list[Any]:
        return list(self._families().values())

    def collect(self) -> list[Any]:
        families = self._families()
        for tier, tenant, field, value in _tenant_values(self.tenants_by_tier()):
            families[field].add_metric([tier, tenant], value)
        return list(families.values())

    @staticmethod
    def _families() -> dict[str, Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["tier", "tenant"]
        families: dict[str, Any] = {
            field: GaugeMetricFamily(name, text, labels=labels)
            for field, (name, text) in TENANT_GAUGES.items()
        }
        families.update(
            (field, CounterMetricFamily(name, text, labels=labels))
            for field, (name, text) in TENANT_COUNTERS.items()
        )
        return families


class _TierOperations:
    """A Prometheus collector of the tiers' operation series, read from their counters at
    each scrape."""

    def __init__(self, tier_stats: TierStats) -> None:
        self.tier_stats = tier_stats

    def describe(self) -> list[Any]:
        return self._families()

    def collect(self) -> list[Any]:
        return self._families(self.tier_stats())

    @staticmethod
    def _families(stats: Mapping[str, Mapping[str, OperationStats]] | None = None) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        labels = ["tier", "op"]
        counters = {
            name: CounterMetricFamily(f"kvplug_tier_{name}", text, labels=labels)
            for name, text in TIER_COUNTERS.items()
        }
        latency = HistogramMetricFamily(
            LATENCY_METRIC,
            "latency of the tier's operations (one batched call is one observation)",
            labels=labels,
        )
        for tier, operations in (stats or {}).items():
            for op, counts in sorted(operations.items()):
                for name, family in counters.items():
                    family.add_metric([tier, op], getattr(counts, name))
                cumulative, buckets = 0, []
                for bound, count in zip(
                    (*map(str, LATENCY_BUCKETS), "+Inf"), counts.latency_counts, strict=True
                ):
                    cumulative += count
                    buckets.append((bound, float(cumulative)))
                latency.add_metric([tier, op], buckets, counts.seconds)
        return [*counters.values(), latency]


__all__ = [
    "LATENCY_METRIC",
    "TENANT_COUNTERS",
    "TENANT_GAUGES",
    "TIER_COUNTERS",
    "StoreMetrics",
    "prometheus",
]
