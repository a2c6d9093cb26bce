"""What a Store reports about itself: the gauges its metrics read at a scrape, and
:meth:`~kvplug.runtime.store.Store.stats`, per tier (with its tenants, where it has quotas) and
for the write-behind, the memory budget and the misses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvplug.memory import Allocator
from kvplug.runtime.metrics import StoreMetrics
from kvplug.runtime.store.freshness import VersionLedger
from kvplug.runtime.store.health import DROP_REASONS
from kvplug.runtime.store.layers import layers
from kvplug.runtime.store.reads import MISS_REASONS
from kvplug.runtime.store.tier import Tier
from kvplug.stats import OperationStats, ReportsTenants, summarize


def operation_stats(tiers: Sequence[Tier]) -> dict[str, dict[str, OperationStats]]:
    """Each tier's :meth:`~kvplug.backend.Backend.operation_stats`, by tier name: the source of
    the per-tier series (thread-safe: read at a Prometheus scrape)."""
    return {tier.name: tier.backend.operation_stats() for tier in tiers}


def tenant_stats(tiers: Sequence[Tier]) -> dict[str, dict[str, dict[str, int | None]]]:
    """Each tier's per-tenant counters (its ``tenant_stats()``, seen through wrappers), by
    tier name, for the tiers that count per tenant (those with quotas)."""
    by_tier = {}
    for tier in tiers:
        layer = next((lay for lay in layers(tier.backend) if isinstance(lay, ReportsTenants)), None)
        counters = {} if layer is None else layer.tenant_stats()
        if counters:
            by_tier[tier.name] = counters
    return by_tier


def wire_gauges(
    metrics: StoreMetrics,
    tiers: Sequence[Tier],
    ledger: VersionLedger,
    write_behind_limit: int,
    budget: Allocator,
) -> None:
    """Set the gauges of a Store that just opened, and those read when scraped."""
    for tier in tiers:
        metrics.healthy.labels(tier.name).set(1)
    metrics.write_behind_limit.set(write_behind_limit)
    metrics.write_behind_bytes.set_function(lambda: ledger.queued_bytes)
    metrics.memory_budget.set(budget.stats().capacity)
    metrics.memory_used.set_function(lambda: budget.stats().used)
    metrics.watch_tenants(lambda: tenant_stats(tiers))


def store_stats(
    metrics: StoreMetrics,
    tiers: Sequence[Tier],
    ledger: VersionLedger,
    write_behind_limit: int,
    budget: Allocator,
) -> dict[str, Any]:
    """The counters :meth:`~kvplug.runtime.store.Store.stats` returns."""
    value = metrics.value
    tenants = tenant_stats(tiers)
    by_tier: dict[str, dict[str, Any]] = {}
    for tier in tiers:
        tier_name, operations = tier.name, tier.backend.operation_stats()
        dropped = {
            reason: value("kvplug_tier_dropped_puts_total", tier=tier_name, reason=reason)
            for reason in DROP_REASONS
        }
        by_tier[tier_name] = {
            **summarize(operations).as_dict(),
            "errors_by_op": {op: stats.errors for op, stats in operations.items()},
            "offered_puts": value("kvplug_tier_offered_puts_total", tier=tier_name),
            "dropped_puts": sum(dropped.values()),
            "dropped_by_reason": dropped,
            "starved": tier.starved,
            "queued": len(tier.waiting),
            "healthy": tier.health.healthy,
        }
        if tier_name in tenants:
            by_tier[tier_name]["tenants"] = tenants[tier_name]
    memory = budget.stats()
    return {
        "tiers": by_tier,
        "write_behind": {
            "queued_bytes": ledger.queued_bytes,
            "queued_keys": len(ledger),
            "queued_removals": ledger.removals_queued(),
            "limit_bytes": write_behind_limit,
        },
        "memory": {
            "budget_bytes": memory.capacity,
            "used_bytes": memory.used,
            "shortages": memory.shortages,
            "waits": value("kvplug_store_memory_waits_total"),
        },
        "misses": {
            reason: value("kvplug_store_misses_total", reason=reason) for reason in MISS_REASONS
        },
        "rejected_puts": value("kvplug_store_rejected_puts_total"),
        "promotions_skipped": value("kvplug_store_promotions_skipped_total"),
    }
