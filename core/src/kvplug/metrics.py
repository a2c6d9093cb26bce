"""The Store's metrics: Prometheus metrics with ``kvplug[metrics]``, plain counters without it.

:class:`StoreMetrics` holds every counter, gauge and histogram of one
:class:`~kvplug.store.Store` in a registry of its own. With prometheus-client installed
(``pip install 'kvplug[metrics]'``) they are Prometheus metrics and
:meth:`StoreMetrics.exposition` renders them in the text exposition format. Without it the same
objects count in process (``Store.stats()`` is unchanged), histograms keep their count and sum,
and :meth:`StoreMetrics.exposition` says how to install the extra.

Example::

    >>> metrics = StoreMetrics()
    >>> metrics.hits.labels("cpu").inc(2)
    >>> metrics.value("kvplug_tier_hits_total", tier="cpu")
    2.0
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from kvplug.errors import KvplugError

LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


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
    prometheus-client's API the Store uses (``labels``, ``inc``, ``set``, ``set_function``,
    ``observe``)."""

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

    def observe(self, value: float) -> None:
        self._samples.add(self._name + "_count", self._labels, 1.0)
        self._samples.add(self._name + "_sum", self._labels, value)


class StoreMetrics:
    """The Store's metrics, in a registry of its own (Prometheus', or plain counters)."""

    def __init__(self) -> None:
        self.prometheus = prometheus()
        if self.prometheus is not None:
            self.registry: Any = self.prometheus.CollectorRegistry()
        else:
            self.registry = _Samples()
        tier = ["tier"]
        self.hits = self._counter("kvplug_tier_hits", "gets answered by the tier", tier)
        self.misses = self._counter("kvplug_tier_misses", "gets the tier missed", tier)
        self.bytes_read = self._counter(
            "kvplug_tier_read_bytes", "bytes returned by the tier", tier
        )
        self.bytes_written = self._counter(
            "kvplug_tier_written_bytes", "bytes stored in the tier", tier
        )
        self.errors = self._counter("kvplug_tier_errors", "operations that failed", ["tier", "op"])
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
        self.latency = self._histogram(
            "kvplug_tier_op_seconds",
            "latency of tier operations (one batched call is one observation)",
            ["tier", "op"],
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
        extra = {"buckets": LATENCY_BUCKETS} if kind == "Histogram" else {}
        return cls(name, documentation, list(labels), registry=self.registry, **extra)

    def _counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Any:
        return self._make("Counter", name, documentation, labels)

    def _gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Any:
        return self._make("Gauge", name, documentation, labels)

    def _histogram(self, name: str, documentation: str, labels: Sequence[str]) -> Any:
        return self._make("Histogram", name, documentation, labels)

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (``name`` as Prometheus names samples, e.g.
        ``kvplug_tier_hits_total``); 0.0 before the first count."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def exposition(self) -> str:
        """Every metric in Prometheus' text exposition format."""
        if self.prometheus is None:
            raise KvplugError(
                "Prometheus metrics need prometheus-client, which is not installed. It comes "
                "with kvplug's 'metrics' extra: pip install 'kvplug[metrics]'. Store.stats() "
                "gives the same counters without it."
            )
        return str(self.prometheus.generate_latest(self.registry).decode())
