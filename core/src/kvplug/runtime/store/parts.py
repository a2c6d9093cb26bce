"""What the read path, the write path and promotion of one Store share: its tiers, their guard,
the write-behind with its version ledger, the memory budget and the metrics."""

from __future__ import annotations

from dataclasses import dataclass

from kvplug.runtime.metrics import StoreMetrics
from kvplug.runtime.store.budget import MemoryBudget
from kvplug.runtime.store.freshness import VersionLedger
from kvplug.runtime.store.health import TierGuard
from kvplug.runtime.store.tier import Tier
from kvplug.runtime.store.write_behind import WriteBehind


@dataclass(frozen=True)
class StoreParts:
    """The parts one Store's read path, write path and promotion are built on."""

    tiers: list[Tier]
    """Fastest first; filled when the store opens."""
    guard: TierGuard
    write_behind: WriteBehind
    memory: MemoryBudget
    metrics: StoreMetrics

    @property
    def ledger(self) -> VersionLedger:
        return self.write_behind.ledger
