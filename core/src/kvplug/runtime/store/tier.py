"""What a Store keeps of each of its tiers: the backend, its health and drop streak, and the
queue its write-behind worker drains."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvplug.backend import Backend
from kvplug.keys import CacheKey
from kvplug.runtime.store.health import TierHealth


@dataclass
class Tier:
    """One tier of a Store, fastest first by ``index``."""

    index: int
    name: str
    """``index:url`` (secrets masked), as metrics and stats label the tier."""
    backend: Backend
    health: TierHealth
    offered: Any
    """The Store's count of puts routed to this tier (its labelled series, looked up once: a
    label lookup costs about a microsecond, the cpu tier's whole batched get a few)."""
    waiting: deque[CacheKey] = field(default_factory=deque)
    """Keys with a write or a removal queued for this tier (stale ones are skipped)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    worker: asyncio.Task[None] | None = None
    drop_streak: int = 0
    """Puts dropped in a row with none written (busy write-behind drops not counted)."""
    starved: bool = False
    """The streak reached :data:`~kvplug.runtime.store.health.STARVED_AFTER` and was warned
    about."""

    def available(self) -> bool:
        """Whether the tier may be asked now: healthy, or failing with its back-off over."""
        health = self.health
        return health.healthy or time.monotonic() >= health.retry_at

    def outlives_process(self) -> bool:
        """Whether the tier keeps what it holds when this process dies (and can remove it)."""
        capabilities = self.backend.capabilities
        return capabilities.remove and (
            capabilities.persistent or capabilities.shared_across_processes
        )
